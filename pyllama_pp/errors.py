"""One exception hierarchy: everything pyllama_pp raises derives from PyllamaError."""
from __future__ import annotations


class PyllamaError(RuntimeError):
    """Base class of pyllama_pp's errors."""


class BuildError(PyllamaError):
    """The package's native build is missing or incomplete (reinstall with `pip install .`)."""


class VariantError(PyllamaError):
    """An unknown variant, or a second variant in a process that already loaded one."""


class DeviceSpecError(PyllamaError, ValueError):
    """A device spec that cannot be parsed or cannot be satisfied by this machine."""


class ModelError(PyllamaError):
    """A model file that is missing, unreadable or not a GGUF this build can load."""


class OutOfMemoryError(PyllamaError, MemoryError):
    """An allocation failed: too little device (or host) memory for the placement."""


class DecodeError(PyllamaError):
    """Decoding failed (bad tokens, context full, or an error inside llama.cpp)."""


class UnsupportedError(PyllamaError):
    """The loaded variant does not have this feature (e.g. the scheduler extension in the baseline)."""


class WorkerError(PyllamaError):
    """A worker process failed or died; its message and exit code are attached."""
