"""Job kind "logits": decode tokens and save the logits."""
from __future__ import annotations

import numpy as np

from ...errors import ConfigError
from ...jobs import LogitsJob
from .base import open_session, random_tokens


def handle(job: LogitsJob) -> dict:
    """Decode the tokens, save the logits to job.out (.npy); the shape, time, schedule and counters."""
    if not job.out:
        raise ConfigError("a logits job needs `out`, the .npy file for the logits")
    with open_session(job) as s:
        toks = job.tokens or random_tokens(job.n_tokens, s.info.n_vocab, job.seed).tolist()
        r = s.eval(toks, logits=job.logits)
        np.save(job.out, r.logits)
        return {"shape": list(r.logits.shape), "seconds": r.seconds, "schedule": s.schedule().to_dict(),
                "counters": r.counters, "ext": r.ext}
