"""What every handler needs: the job's session, and the tokens of a test."""
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


def bench_tokens(n: int, n_vocab: int, seed: int, stream: bool = False) -> np.ndarray:
    """The n tokens of a test (the same ones for the same seed): random_tokens, or with `stream` n consecutive ids from
    a seeded start (wrapping at n_vocab), for a model whose routing follows such a stream
    (model_file.routes_by_stream: a synthetic model with routing "locality" routes consecutive ids to slowly changing
    experts, as real decode does)."""
    if not stream:
        return random_tokens(n, n_vocab, seed)
    start = int(np.random.default_rng(seed).integers(0, max(n_vocab - n, 0) + 1))
    return (start + np.arange(n, dtype=np.int64)) % n_vocab
