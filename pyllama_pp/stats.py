"""Statistics of the measurements: logits compared (`nmse`, `max_abs_diff`) and the paired speedup's interval
(`paired_ci`, with `t_quantile`: numpy has no t distribution)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .defaults import CONTEXT


def nmse(a, b) -> float:
    """Normalized mean squared error of logits `a` against the reference `b`: sum((a-b)^2) / sum(b^2), in float64.

    Returns:
        0.0 for identical arrays (also when both are zero), inf when b is all zero and a is not.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    den, num = float(np.sum(b * b)), float(np.sum((a - b) ** 2))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def max_abs_diff(a, b) -> float:
    """The largest absolute difference between two logits arrays of one shape (0.0 for empty ones)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p in (0, 1), df >= 1), by bisection on its CDF (the regularized incomplete beta
    function): the paired interval over few loads needs it, and numpy has no t distribution."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p!r}, df={df!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    a, b = df / 2.0, 0.5

    def cdf(t: float) -> float:
        x = df / (df + t * t)
        front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
        ibeta = front * _betacf(a, b, x) / a if x < (a + 1.0) / (a + b + 2.0) else 1.0 - front * _betacf(b, a, 1.0 - x) / b
        return 1.0 - 0.5 * ibeta

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_ci(ratios: Sequence[float], level: float = 0.95, n_boot: int = 10_000, seed: int = CONTEXT.seed,
              groups: Optional[Sequence] = None) -> tuple:
    """The median speedup of ABBA rounds and its confidence interval: (median, lo, hi).

    `ratios` are per round, in round order; rounds 2k and 2k+1 ran the variants in opposite orders, so an advantage
    of running first falls on both: each such pair counts as one sample, the geometric mean of its two ratios (an
    unmatched last round is left out). The interval resamples those pairs (`n_boot` times, percentile method,
    fixed seed). NaN for no complete pair.

    `groups` (one label per round, e.g. the model load the round ran in), two or more of them: what differs between
    loads (where each process's memory landed) is shared by every pair of a load, so each load counts once: the
    estimate is the geometric mean of the loads' medians and the interval Student's t over them (K - 1 degrees of
    freedom; a bootstrap over 2-5 loads would be about as wide as their spread, far below its nominal level). A pair
    never spans two groups."""

    r = np.asarray(list(ratios), dtype=np.float64)
    g = np.zeros(r.size, dtype=np.int64) if groups is None else np.unique(np.asarray(list(groups)), return_inverse=True)[1]
    if g.size != r.size:
        raise ValueError(f"groups must label every round: {g.size} labels for {r.size} rounds")
    xs = []
    for k in np.unique(g):
        rk = r[g == k]
        n = rk.size // 2
        x = np.sqrt(rk[0:2 * n:2] * rk[1:2 * n:2])
        x = x[np.isfinite(x)]
        if x.size:
            xs.append(x)
    if not xs:
        return float("nan"), float("nan"), float("nan")
    if len(xs) >= 2:
        m = np.log([float(np.median(x)) for x in xs])
        half = t_quantile((1 + level) / 2, m.size - 1) * float(m.std(ddof=1)) / math.sqrt(m.size)
        return float(np.exp(m.mean())), float(np.exp(m.mean() - half)), float(np.exp(m.mean() + half))
    x = xs[0]
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, (n_boot, x.size))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(x)), float(lo), float(hi)
