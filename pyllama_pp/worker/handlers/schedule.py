"""Job kind "schedule": load, make the context, report the schedule."""
from __future__ import annotations

from ...jobs import ScheduleJob
from .base import open_session


def handle(job: ScheduleJob) -> dict:
    """The model's facts and the scheduler's view of the reserved graph (with detail: of one ubatch's splits)."""
    with open_session(job) as s:
        sched = s.schedule_detail() if job.detail else s.schedule()
        return {"model": s.info.to_dict(), "schedule": sched.to_dict()}
