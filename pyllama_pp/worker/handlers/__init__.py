"""One handler per job kind, each `handle(job) -> dict` in a module of that kind's name (run inside a worker)."""
from __future__ import annotations

from . import fit, info, logits, measure, schedule, soak, trace, workload

HANDLERS = {"info": info.handle, "schedule": schedule.handle, "logits": logits.handle, "measure": measure.handle,
            "workload": workload.handle, "fit": fit.handle, "soak": soak.handle,
            "trace": trace.handle}
