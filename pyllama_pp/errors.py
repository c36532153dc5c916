"""One exception hierarchy: everything pyllama_pp raises derives from PyllamaError."""
from __future__ import annotations

import re


class PyllamaError(RuntimeError):
    """Base class of pyllama_pp's errors."""


class BuildError(PyllamaError):
    """The package's native build is missing or incomplete (reinstall with `pip install .`)."""


class VariantError(PyllamaError):
    """An unknown variant, or a second variant in a process that already loaded one."""


class DeviceSpecError(PyllamaError, ValueError):
    """A device spec that cannot be parsed or cannot be satisfied by this machine."""


class ConfigError(PyllamaError, ValueError):
    """A parameter out of its range or of the wrong kind (batch sizes, context, placement, switches)."""


class ModelError(PyllamaError):
    """A model file that is missing, unreadable or not a GGUF this build can load."""


class OutOfMemoryError(PyllamaError, MemoryError):
    """An allocation failed: too little device (or host) memory for the placement."""


class DeviceError(PyllamaError):
    """A device failed while in use: a host<->device copy or a kernel that ggml could only abort on (the shim turns
    ggml's abort into this error; VDEV's injected faults end here)."""


class DecodeError(PyllamaError):
    """Decoding failed (bad tokens, context full, or an error inside llama.cpp)."""


class UnsupportedError(PyllamaError):
    """The loaded variant does not have this feature (e.g. the scheduler extension in the baseline)."""


class WorkerError(PyllamaError):
    """A worker process failed or died.

    `error_type` names the error the worker raised (ModelError, DecodeError, ...; the raised object is an instance
    of that class too, so `except ModelError` works across the process boundary), `exit_code` is the worker's exit
    status (3: an expected error, 4: a bug, negative: killed by a signal) and `details` its traceback or the tail of
    its stderr. The message itself is one statement of what went wrong.
    """

    error_type: str = "WorkerError"
    exit_code: "int | None" = None
    details: str = ""


_WORKER_CLASSES: dict = {}


def worker_error(type_name: str, message: str, exit_code: "int | None" = None, details: str = "") -> WorkerError:
    """The error a worker reported, as an instance of both WorkerError and the worker's own error class."""
    base = globals().get(type_name)
    if isinstance(base, type) and issubclass(base, PyllamaError) and base is not WorkerError:
        cls = _WORKER_CLASSES.get(type_name)
        if cls is None:
            cls = _WORKER_CLASSES[type_name] = type(type_name, (WorkerError, base),
                                                    {"__module__": __name__, "__doc__": base.__doc__})
    else:
        cls = WorkerError
    err = cls(message)
    err.error_type, err.exit_code, err.details = (type_name or "WorkerError"), exit_code, details
    return err


_ABORT_PREFIX = re.compile(r"ggml abort: \S+?:\d+: ")


# what the patched ggml-rpc client says in the caller's thread once a server's connection broke (its dispatcher
# keeps a failed send or receive instead of aborting)
RPC_LOST = "lost the connection to"


def is_device_fault(msg: str) -> bool:
    """A message of a device that failed in use (a failed VDEV stream job, an injected copy fault, a lost RPC
    server), not of the model (an allocation that fails is an OutOfMemoryError, injected or not)."""
    return "VDEV stream job failed" in msg or ("injected fault" in msg and " copy #" in msg) or RPC_LOST in msg


def one_statement(msg: str) -> str:
    """A native message (the shim's first line, then llama.cpp's log lines) as one statement: the first line and
    the log line that says why (an injected fault, llama.cpp's 'error loading model: ...', a line saying what failed,
    else its last line). ggml's abort prefixes (file:line) are left out."""
    lines = [_ABORT_PREFIX.sub("", ln.strip()) for ln in (msg or "").strip().splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else "llama.cpp gave no reason"
    rest = [ln.removeprefix("llama.cpp:").strip() for ln in lines[1:]]
    why = next((ln for ln in rest if "injected fault" in ln), None) or \
        next((ln.split("error loading model:", 1)[1].strip() for ln in rest if "error loading model:" in ln), None) or \
        next((ln for ln in rest if "failed" in ln), None) or rest[-1]
    return f"{lines[0]}: {why}"
