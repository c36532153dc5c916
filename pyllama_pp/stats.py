"""Statistics of the measurements: logits compared (`nmse`, `max_abs_diff`), the paired speedup's interval
(`paired_ci`, with `t_quantile`: numpy has no t distribution), and how much of the CPU other processes took while a
measurement ran (`CpuWatch`, `Contention`): decode on the CPU moves with it."""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .defaults import CONTEXT, usable_cores


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


BUSY_SHARE = 0.5   # a process that used at least this much of one core while a measurement ran holds the CPU


@dataclass
class Contention:
    """Other processes on the CPU while a measurement ran.

    Attributes:
        cores: the cores this process may use (defaults.usable_cores); cpus: the machine's.
        load_1m: the 1-minute load average at the end (every runnable thread, the measurement's own too).
        others_cores: CPU time of every process but this one and its workers over the window, in cores.
        busy: [name, pid, cores] of each other process that used at least BUSY_SHARE of a core.
    """

    cores: int
    cpus: int
    load_1m: float
    others_cores: float
    busy: list = field(default_factory=list)

    @property
    def contended(self) -> bool:
        """Whether other processes took more than half a core beyond the cores this process may not use."""
        return self.others_cores > max(0, self.cpus - self.cores) + BUSY_SHARE

    def to_dict(self) -> dict:
        """The fields as JSON-ready data; Contention(**d) makes it again."""
        return asdict(self)


def _cpu_seconds() -> dict[int, tuple[str, float]]:
    """Each process's name and CPU seconds so far, from /proc ({} where there is none)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            raw = (d / "stat").read_text()
        except OSError:   # (gone meanwhile)
            continue
        name, rest = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
        out[int(d.name)] = (name, (int(rest[11]) + int(rest[12])) / tick)   # utime, stime
    return out


class CpuWatch:
    """The CPU other processes use while something runs: made at the start, `stop()` at the end (Linux /proc; a
    machine without it reports none)."""

    def __init__(self):
        self._t0, self._before = time.monotonic(), _cpu_seconds()

    def stop(self, exclude: Sequence[int] = (), busy_share: float = BUSY_SHARE) -> Contention:
        """What other processes used since the start.

        Args:
            exclude: pids of processes that are part of the measurement (its workers); this process is left out too.
            busy_share: the share of one core from which a process is listed as busy.
        Returns:
            Contention: the cores, the load, other processes' CPU in cores and the busy ones.
        """
        after, wall = _cpu_seconds(), max(time.monotonic() - self._t0, 1e-6)
        mine = {os.getpid(), *exclude}
        used = {pid: (name, (secs - self._before.get(pid, (name, 0.0))[1]) / wall)
                for pid, (name, secs) in after.items() if pid not in mine}
        busy = sorted(([name, pid, round(c, 2)] for pid, (name, c) in used.items() if c >= busy_share),
                      key=lambda b: -b[2])
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        return Contention(cores=usable_cores(), cpus=os.cpu_count() or 1, load_1m=round(load, 2),
                          others_cores=round(sum(c for _, c in used.values()), 2), busy=busy)
