"""What every handler needs: the job's session, and random tokens."""
from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...jobs import Job
from ...plan import Plan
from ...session import Session


def open_session(job: Job) -> Session:
    """The Session a job describes: its model with its plan, or with its devices, placement and context.

    Raises:
        ConfigError: for a job without a model; whatever Session raises.
    """
    if not job.model:
        raise ConfigError(f"a {job.kind} job needs a model")
    if job.plan:   # a fit plan (Plan.to_dict()): its devices, placement and context
        return Session(job.model, plan=Plan.from_dict(job.plan), variant=job.variant, switches=job.switches or None)
    return Session(job.model, devices=job.devices, placement=job.placement, ctx=job.ctx, variant=job.variant,
                   switches=job.switches or None)


def random_tokens(n: int, n_vocab: int, seed: int) -> np.ndarray:
    """n token ids drawn uniformly from the vocabulary (the same ones for the same seed)."""
    return np.random.default_rng(seed).integers(0, n_vocab, n, dtype=np.int64)
