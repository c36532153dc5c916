"""pyllama_pp: A/B harness for llama.cpp multi-GPU pipeline parallelism with host-resident MoE experts.

Two builds of one pinned llama.cpp tree live in this package: `baseline` (pristine) and `patched` (our patch
series). One process holds one of them (`load`); the A/B runner gives each its own worker process.

The layers, each importing only those below it:
    errors, _version                       one exception hierarchy; the version
    binding, _pin                          one variant's native library in this process
    devices, params, counters, stats       data: device specs, Placement / ContextParams, counter sums, statistics
    synth, model_file, plan, jobs, row     model files, a fit plan, worker jobs, the result row
    session                                a model on devices: schedule, eval, KV cache
    worker (client, handlers, loop)        one variant per process: the parent's side, a handler per job kind
    fit, soak                              planning; the soak's API (each runs workers)
    config, rows, runner                   A/B configurations, rows from results, the A/B runner
    report, cli                            tables and plots; the `pyllama-pp` command
"""
from __future__ import annotations

from ._version import __version__
from .binding import available_variants, build_info, load
from .config import RunConfig, expand
from .devices import DeviceSpec, parse as parse_devices
from .errors import (BuildError, ConfigError, DecodeError, DeviceError, DeviceSpecError, ModelError, OutOfMemoryError,
                     PyllamaError, UnsupportedError, VariantError, WorkerError)
from .fit import fit, fit_ubatch
from .params import ContextParams, Placement
from .plan import DevicePlan, Plan, PlanError
from .row import Row
from .runner import ab, interleaved, mixed_workload
from .session import EvalResult, Schedule, Session, list_devices
from .worker import ServingWorker, run_job

__all__ = [
    "__version__", "load", "available_variants", "build_info", "DeviceSpec", "parse_devices", "Session",
    "Placement", "ContextParams", "Schedule", "EvalResult", "list_devices", "PyllamaError", "BuildError", "ConfigError",
    "VariantError", "DeviceSpecError", "DeviceError", "ModelError", "OutOfMemoryError", "DecodeError",
    "UnsupportedError", "WorkerError", "fit", "fit_ubatch", "Plan", "DevicePlan", "PlanError", "RunConfig", "expand",
    "ab", "interleaved", "mixed_workload", "Row", "run_job", "ServingWorker",
]
