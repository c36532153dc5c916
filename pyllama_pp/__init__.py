"""pyllama_pp: A/B harness for llama.cpp multi-GPU pipeline parallelism with host-resident MoE experts.

Two builds of one pinned llama.cpp tree live in this package: `baseline` (pristine) and `patched` (our patch
series). One process holds one of them (`load`); the A/B runner gives each its own worker process.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .binding import available_variants, build_info, load
from .devices import DeviceSpec, parse as parse_devices
from .errors import (BuildError, ConfigError, DecodeError, DeviceError, DeviceSpecError, ModelError, OutOfMemoryError, PyllamaError,
                     UnsupportedError, VariantError, WorkerError)
from .session import ContextParams, EvalResult, Placement, Schedule, Session, list_devices
from .fit import DevicePlan, Plan, PlanError, fit, fit_ubatch

__all__ = [
    "__version__", "load", "available_variants", "build_info", "DeviceSpec", "parse_devices", "Session",
    "Placement", "ContextParams", "Schedule", "EvalResult", "list_devices", "PyllamaError", "BuildError", "ConfigError",
    "VariantError", "DeviceSpecError", "DeviceError", "ModelError", "OutOfMemoryError", "DecodeError",
    "UnsupportedError", "WorkerError", "fit", "fit_ubatch", "Plan", "DevicePlan", "PlanError",
]
