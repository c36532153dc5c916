"""fit, as users call it: `fit` plans a placement (pyllama_pp.placement) and `fit_ubatch` chooses (n_batch, n_ubatch)
with it (pyllama_pp.planner), the compute of each candidate measured by the probe (pyllama_pp.compute.Probe, handed
in here). Prediction is pyllama_pp.predict's; each mechanism's plan is its own module (overlap_plan,
layer_major_plan, expert_cache_plan).

>>> plan = fit("tiny.gguf", devices="vdev:2x24MiB@4GBps", ctx=ContextParams(n_ctx=512, n_ubatch=128))
>>> print(plan)
"""
from __future__ import annotations

import functools

from . import planner
from .compute import Probe
from .placement import fit


@functools.wraps(planner.fit_ubatch)
def fit_ubatch(*args, **kw):
    kw.setdefault("probe", Probe)
    return planner.fit_ubatch(*args, **kw)


__all__ = ["fit", "fit_ubatch"]
