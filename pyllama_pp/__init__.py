"""pyllama_pp: A/B harness for llama.cpp multi-GPU pipeline parallelism with host-resident MoE experts.

Two builds of one pinned llama.cpp tree live in this package: `baseline` (pristine) and `patched` (our patch
series). One process holds one of them (`load`); the A/B runner gives each its own worker process.

The layers, each importing only those below it:
    errors, _version, defaults             one exception hierarchy; the version; the table of defaults
    binding, _pin                          one variant's native library in this process
    devices, params, counters, stats       data: device specs, Placement / ContextParams, counter sums, statistics
    network                                data: the bytes a ubatch sends over ggml RPC (fit's and the paper's)
    synth, model_file, plan, jobs, row     model files, a fit plan, worker jobs, the result row
    session                                a model on devices: schedule, eval, KV cache
    worker (client, handlers, loop)        one variant per process: the parent's side, a handler per job kind
    compute                                the compute probe (a layer's compute on a device, measured)
    fit, soak, check, about                fit plans; the soak's API; the logits check; what this install is
    config, rows, planning, runner         A/B configurations, rows from results, choices to configs, the runner
    report, cli                            tables and plots; the `pyllama-pp` command
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
    "Row": "row",
    "ab": "runner", "interleaved": "runner", "mixed_workload": "runner",
    "EvalResult": "session", "Schedule": "session", "Session": "session", "list_devices": "session",
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
