"""The hit rate a per-layer expert cache of a given size gets in decode, as fit's planner predicts with it: from a
trace of the user's own model (`pyllama-pp trace` writes one; LRU as the native cache, simulated by
pyllama_pp.expert_cache_sim), from what a synthetic model says of its routing, or from a stated prior.

The prior (`PRIOR`) is published decode locality: llama.cpp PR #27861 measured a per-layer GPU LRU of CPU-held
experts hitting ~67% with 12.5% of a layer's experts cached and ~81% with 25%; the synthetic locality routing is
calibrated to those two points, and its LRU gives the rest of the curve (47% with one token's experts, 8 of 128;
88% at 50%; docs/RESULTS.md "Expert locality" and the cache's GPU table). A model whose routing is uniform (a synthetic
one says so) hits its share: h = f.

Each curve has a second one beside it: the hit rate with EXPERT_REFILL=1 (every miss of a decoded token on the host
CPU, only the first into the slots after it: the slots follow the routing more slowly than LRU's, which takes every
miss). From a trace it is simulated (expert_cache_sim.hybrid); the prior's is REFILL_PRIOR (the same synthetic
trace's); a curve without one takes the LRU curve times the prior's share of LRU at that size.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np

from .errors import ConfigError
from .expert_cache_sim import capacity_of, default_warmup, hybrid, simulate
from .expert_trace import ExpertTrace
from .model_file import expert_tensor_shape, synth_routing

# (fraction of a layer's experts cached, LRU hit rate): the prior's points, between them linear
PRIOR = ((0.0, 0.0), (0.0625, 0.47), (0.125, 0.67), (0.25, 0.81), (0.5, 0.88), (1.0, 1.0))
PRIOR_NAME = "prior: published decode locality (llama.cpp PR #27861's LRU: 67% at 12.5%, 81% at 25%)"
# the fractions a trace is simulated at
TRACE_FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 1.0)
# EXPERT_REFILL=1's hit rate with the prior (fraction cached, hit rate): the 30B-A3B preset's locality trace, whose
# LRU gives PRIOR's points (`bench/cache_hits.py --synth qwen3-30b-a3b --set routing=locality --set n_layer=2 -n 768`,
# LRU 46.9 / 67.2 / 80.8 / 88.8%), simulated with the refill after the same warm-up (expert_cache_sim.hybrid): one
# refill a token costs 2-7 points where the slots are few and about nothing at half of a layer's experts; uniform
# routing hits its share either way (any slots' content serves f of the lookups)
REFILL_PRIOR = ((0.0, 0.0), (0.0625, 0.447), (0.125, 0.6034), (0.25, 0.7344), (0.5, 0.8634), (1.0, 1.0))


@dataclass(frozen=True)
class HitCurve:
    """Decode hit rate by the fraction of a layer's experts cached.

    Attributes:
        points: (fraction, hit rate) pairs, fractions rising from 0 to 1.
        source: where it comes from, as the plan names it.
        refill: the same pairs with EXPERT_REFILL=1 (() where none is known: the LRU's times REFILL_PRIOR's share of
            PRIOR's at that size, or the LRU's own where the routing is uniform).
        uniform: the routing is uniform (hits are the share cached with or without the refill).
    """

    points: tuple
    source: str
    refill: tuple = ()
    uniform: bool = False

    def at(self, fraction: float, refill: bool = False) -> float:
        """The hit rate with `fraction` of a layer's experts cached (linear between the points).

        Args:
            fraction: 0..1.
            refill: with EXPERT_REFILL=1 (its own points, else the prior's share of LRU's).
        Returns:
            hit rate 0..1.
        """
        f = min(max(fraction, 0.0), 1.0)
        if refill and self.refill:
            xs, ys = zip(*self.refill)
            return float(np.interp(f, xs, ys))
        xs, ys = zip(*self.points)
        lru = float(np.interp(f, xs, ys))
        if not refill or self.uniform or f <= 0:
            return lru
        return lru * float(np.interp(f, *zip(*REFILL_PRIOR))) / float(np.interp(f, *zip(*PRIOR)))

    def to_dict(self) -> dict:
        """The curve as the plan's JSON holds it."""
        return {"source": self.source, "points": [list(p) for p in self.points],
                **({"refill": [list(p) for p in self.refill]} if self.refill else {}),
                **({"uniform": True} if self.uniform else {})}

    @staticmethod
    def from_dict(d: dict) -> "HitCurve":
        """The curve of `to_dict`."""
        return HitCurve(tuple(tuple(p) for p in d["points"]), d["source"],
                        tuple(tuple(p) for p in d.get("refill", ())),
                        bool(d.get("uniform", d["source"].startswith("uniform routing"))))

    @staticmethod
    def from_trace(trace: Union[str, os.PathLike, ExpertTrace], fractions: Sequence[float] = TRACE_FRACTIONS) -> "HitCurve":
        """LRU's hit rates on a recorded trace (its decode tokens after the warm-up expert_cache_sim takes).

        Args:
            trace: an ExpertTrace or the .npz `pyllama-pp trace` wrote.
            fractions: the sizes simulated.
        Returns:
            HitCurve.
        """
        t = _load(trace)
        pts = [(0.0, 0.0)] + [(f, simulate(t, f, "lru")["hit_rate"]) for f in fractions]
        if any(math.isnan(h) for _, h in pts):
            raise ConfigError(f"--trace {_name(trace)}: no decoded "
                              f"token after its warm-up ({t.n_tokens} tokens, {t.n_prompt} of them a prompt), so no "
                              "hit rate. Fix: record decode, e.g. `pyllama-pp trace MODEL -n 128 -o T.npz`")
        refill = [(0.0, 0.0)]
        for f in fractions:   # (EXPERT_REFILL=1: its value is the only one the planner sets)
            got = hybrid(t, capacity_of(f, t.n_expert), 0, refill=1, uncounted=default_warmup(t))
            refill.append((f, round(got["hits"] / got["lookups"], 4)))
        return HitCurve(tuple((f, round(h, 4)) for f, h in pts), f"trace {_name(trace)} (LRU)", tuple(refill))

    @staticmethod
    def for_model(model: Union[str, os.PathLike], trace: Optional[Union[str, os.PathLike, ExpertTrace]] = None) -> "HitCurve":
        """The curve fit plans `model` with: its trace's where one is given; uniform where a synthetic model routes
        uniformly; else the prior.

        Args:
            model: the GGUF file.
            trace: a trace of the model's decode (optional).
        Returns:
            HitCurve.
        """
        if trace is not None:
            shape = expert_tensor_shape(model)
            got = _load(trace).n_expert
            if shape and got != shape[3]:
                raise ConfigError(f"--trace {_name(trace)}: a trace of {got} experts a layer for a model of "
                                  f"{shape[3]}. Fix: record this model's trace (`pyllama-pp trace MODEL -o T.npz`)")
            return HitCurve.from_trace(trace)
        if synth_routing(model) == "uniform":
            return HitCurve(((0.0, 0.0), (1.0, 1.0)), "uniform routing (the synthetic model's): hits = share cached",
                            uniform=True)
        return HitCurve(PRIOR, PRIOR_NAME, REFILL_PRIOR)


def _name(trace) -> str:
    return trace.meta.get("model", "") if isinstance(trace, ExpertTrace) else os.fspath(trace)


def _load(trace) -> ExpertTrace:
    """A trace as given, or read from its file (ConfigError for a file that is not one)."""
    if isinstance(trace, ExpertTrace):
        return trace
    try:
        return ExpertTrace.load(trace)
    except ValueError as e:
        raise ConfigError(f"--trace: {e}. Fix: record one with `pyllama-pp trace MODEL -o T.npz`") from None


__all__ = ["HitCurve", "PRIOR", "REFILL_PRIOR"]
