"""Worker processes: one variant per process (both variants ship the same library names).

The parent's side is `client` (`run_job`, `ServingWorker`, exported here); the process itself is `loop` (run as
`python -m pyllama_pp.worker`), which hands each job to its kind's handler in `handlers`.
"""
from __future__ import annotations

from .client import ServingWorker, run_job

__all__ = ["run_job", "ServingWorker"]
