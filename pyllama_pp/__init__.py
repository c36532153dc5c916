"""pyllama_pp: A/B harness for llama.cpp multi-GPU pipeline parallelism with host-resident MoE experts.

Two builds of one pinned llama.cpp tree live in this package: `baseline` (pristine) and `patched` (our patch
series). One process holds one of them (`load`); the A/B runner gives each its own worker process.

The modules sit on floors, each importing only those below it: pyllama_pp.layers.FLOORS lists them (and
docs/DEVELOPING.md shows the list). The table of defaults every command and function reads is pyllama_pp.defaults.
"""
from __future__ import annotations

import importlib

from ._version import __version__
from .fit import fit, fit_ubatch   # (here, not lazily: importing the module pyllama_pp.fit would shadow the function)

# The public names and the module each lives in. The facade imports a module when one of its names is first used
# (PEP 562): `python -m pyllama_pp.worker` runs this file too, and a worker process needs its own few modules, not
# the A/B runner's pandas or the plots' matplotlib (each worker would pay for them at start).
_HOME = {
    "load": "binding", "available_variants": "binding", "build_info": "binding",
    "RunConfig": "config", "expand": "config",
    "DeviceSpec": "devices", "parse_devices": ("devices", "parse"),
    **{name: "errors" for name in ("BuildError", "ConfigError", "DecodeError", "DeviceError", "DeviceSpecError",
                                   "ModelError", "OutOfMemoryError", "PyllamaError", "UnsupportedError",
                                   "VariantError", "WorkerError")},
    "ContextParams": "params", "Placement": "params",
    "DevicePlan": "plan", "Plan": "plan", "PlanError": "plan",
    "Choices": "planning", "RunPlan": "planning", "plan_runs": "planning",
    "Row": "row",
    "ab": "runner", "interleaved": "runner", "mixed_workload": "runner",
    "ExpertTrace": "expert_trace",
    "EvalResult": "session", "Schedule": "session", "Session": "session", "list_devices": "devices",
    "ServingWorker": "worker", "run_job": "worker",
}

__all__ = ["__version__", "fit", "fit_ubatch", *_HOME]


def __getattr__(name: str):
    """The public name `name`, from its module (imported on first use, then kept here)."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'pyllama_pp' has no attribute {name!r}")
    module, attr = home if isinstance(home, tuple) else (home, name)
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
