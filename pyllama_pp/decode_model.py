"""fit's model of decode time: what a token costs with each MoE layer's experts where a plan puts them, from what the
decode probe measured (`DecodeCosts`, pyllama_pp.compute.decode_costs), the links fit measured and the cache's hit
rate (pyllama_pp.hit_curve). No process is started here.

A token runs every layer in turn (decode does not pipeline), so its time is the sum of its layers' and what is outside
them. Per MoE layer:
- experts resident on the device: `resident_s`;
- experts in host RAM, no slots: the host CPU computes them where they live (upstream's path): `cpu_s`;
- experts in host RAM with S slots a layer, hit rate h: the device reads the hits from its slots and copies each miss
  over the link first: `cached_s + (1 - h) n_used x expert / link` - unless that costs more than the CPU path, where
  the cache's guard sends the layer to the CPU (EXPERT_CACHE_MIN_HIT, set from the same costs): the smaller of the two;
- the same with EXPERT_HYBRID=N: a token's m misses (binomial in n_used with 1 - h) split as the native rule splits
  them (expert_cache_sim.link_share: the link takes ceil(100 m / (100 + N)), at least one), the host CPU computing the rest beside
  the link: the slower of the two counts, and the CPU's share costs HYBRID_FIXED_EXPERTS experts' CPU time more (its
  FFN's fixed part: the activations' round trip, the wait, the sum on the device).
- the same with EXPERT_REFILL=N (EXPERT_HYBRID at its largest): every one of a token's m misses on the host CPU
  beside the device's hits, then min(N, m) of them copied into slots (from an mmap-ed model the CPU's graph copies
  each into pinned memory first, then it crosses the link): `cached_s + m x cpu_s / n_used + min(N, m) x refill`,
  with no fixed part beyond cpu_s's own (which holds upstream's round trip): what one H100 measured (the 30B-A3B
  shape from mmap, 8 layers, 16 slots a layer, hits 59.4%: 0.68 ms a layer against this model's 0.70, 178 t/s
  against 174; docs/results/mmap-refill-2026-12-07), at the refill's own hit curve (pyllama_pp.hit_curve).
`cached_s` is measured with every lookup a hit (the device's compute, the routing ids read back, the slots' lookup),
a miss at the lower of the link's rate and the one measured with the fewest slots (`miss_gbps`: what a miss costs
beside its bytes, its copies' calls and, from an mmap-ed model, the copy into pinned staging first),
`cpu_s` at the run's thread count (the activations' round trip included), so the fixed costs a rate leaves out are in.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from .defaults import CONTEXT
from .expert_cache_sim import link_share

# the hybrid's fixed part, in experts' CPU time (cpu_s / n_used each): what makes the measured gains of one H100 (the
# 30B-A3B shape, 16 layers, locality routing, tg128 @ d2048, paired: 1.113x [1.044, 1.182] the cache alone at 16
# slots a layer, 1.008x [0.918, 1.098] at 32; docs/results/gpu-2026-12-07-prompts-hybrid) come out of this model
# (1.097x, 1.015x); with none it predicts 1.30x and 1.20x
HYBRID_FIXED_EXPERTS = 2.5


@dataclass
class DecodeCosts:
    """Seconds a decoded token spends, measured on one device spec (the decode probe: replicas of the model's own
    layers, pyllama_pp.compute).

    Attributes:
        device: the spec measured on.
        outside_s: outside the MoE layers (embeddings, leading dense layers, output).
        resident_s: one MoE layer with its experts in the device's memory.
        cpu_s: one MoE layer with its experts computed on the host CPU (upstream's path).
        cached_s: one MoE layer with its experts read from the device's slots, every lookup a hit.
        threads: the host CPU threads cpu_s ran with.
        load_mode: the load mode cpu_s ran with ("none": pinned host weights; "mmap").
        miss_gbps: what a miss costs on the cached path, as a rate: the bytes it copied into a slot over the seconds
            it added (its copies' calls, the copy, from pageable memory its staging, and what waits on them),
            measured with the fewest slots; the link's rate counts where it is lower (None: not measured, or no time
            added within the noise: the link's alone).
        hybrid_cpu_s: one MoE layer's experts on the CPU that takes the hybrid's share of the misses, where that is
            not the CPU of cpu_s: an RPC device's server's own CPU (its cpu_s is its server's device copying the
            experts in, the path its layers take without slots). None: cpu_s's CPU (a device of this host), or for
            an RPC device not known (the planner then leaves its hybrid off).
    """

    device: str
    outside_s: float
    resident_s: float
    cpu_s: float
    cached_s: float
    threads: int = CONTEXT.n_threads
    load_mode: str = CONTEXT.load_mode
    miss_gbps: Optional[float] = None
    hybrid_cpu_s: Optional[float] = None

    def miss_rate(self, link_gbps: float) -> float:
        """The rate a token's misses go up at: the link's, or the measured miss_gbps where lower (a miss from an
        mmap-ed model is copied into pinned staging first; the link's rate leaves that out).

        Args:
            link_gbps: the device's host link for the misses.
        Returns:
            GB/s.
        """
        return min(link_gbps, self.miss_gbps) if self.miss_gbps else link_gbps

    def to_dict(self) -> dict:
        """The costs as a plan's JSON holds them."""
        return asdict(self)

    def cached_layer_s(self, hit: float, miss_bytes: float, link_gbps: float) -> float:
        """One host-expert layer's seconds a token on the cached path at hit rate `hit`.

        Args:
            hit: the layer's hit rate.
            miss_bytes: bytes a token's lookups would copy if every one missed (n_used experts of the layer).
            link_gbps: the device's host link for those copies (pinned, or pageable for mmap).
        Returns:
            seconds.
        """
        return self.cached_s + (1.0 - hit) * miss_bytes / (self.miss_rate(link_gbps) * 1e9)

    def break_even_hit(self, miss_bytes: float, link_gbps: float) -> float:
        """The hit rate above which a layer's cached path costs less than the CPU path: cached_s + (1 - h) miss = cpu_s
        (at or below 0: the cache always pays; at or above 1: never).

        Args:
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link for the misses.
        Returns:
            h*.
        """
        miss_s = miss_bytes / (self.miss_rate(link_gbps) * 1e9)
        return 1.0 - (self.cpu_s - self.cached_s) / miss_s if miss_s > 0 else (0.0 if self.cached_s < self.cpu_s else 1.0)

    def hybrid_break_even_hit(self, miss_bytes: float, link_gbps: float, n_used: int, cpu_pct: int) -> float:
        """The hit rate above which a layer's cached path with EXPERT_HYBRID=cpu_pct costs less than the CPU path (the
        guard's bar where the hybrid is on: the guard sends a layer below it to the CPU path, hybrid and all; the
        bar of the cache alone would send layers the hybrid makes faster back to the CPU).

        Args:
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link for the misses.
            n_used: experts a token uses.
            cpu_pct: EXPERT_HYBRID's value (0: the cache alone, break_even_hit).
        Returns:
            h* (with the hybrid in [0, 1]; at or below 0: the path always pays; at or above 1: never).
        """
        if cpu_pct <= 0 or n_used <= 0:
            return self.break_even_hit(miss_bytes, link_gbps)
        return _falling_root(lambda h: self.hybrid_layer_s(h, miss_bytes, link_gbps, n_used, cpu_pct) - self.cpu_s)

    @property
    def share_cpu_s(self) -> float:
        """One MoE layer's experts on the CPU that takes the hybrid's share (hybrid_cpu_s where given, else cpu_s)."""
        return self.hybrid_cpu_s if self.hybrid_cpu_s is not None else self.cpu_s

    def hybrid_pct(self, miss_bytes: float, link_gbps: float) -> int:
        """EXPERT_HYBRID's value for this device: 100 x the expert rate of the CPU that takes the hybrid's share (a
        layer's experts read on its CPU path, share_cpu_s) over the link's.

        Args:
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link for the misses.
        Returns:
            N (at least 1).
        """
        cpu_s = self.share_cpu_s
        return max(1, round(100 * miss_bytes / cpu_s / (self.miss_rate(link_gbps) * 1e9))) if cpu_s > 0 else 1

    def hybrid_layer_s(self, hit: float, miss_bytes: float, link_gbps: float, n_used: int, cpu_pct: int) -> float:
        """One host-expert layer's seconds a token on the cached path with EXPERT_HYBRID=cpu_pct: over the token's
        misses (binomial), the link's share and the CPU's (its experts and the fixed part) side by side.

        Args:
            hit: the layer's hit rate.
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link.
            n_used: experts a token uses.
            cpu_pct: EXPERT_HYBRID's value.
        Returns:
            seconds.
        """
        e_link, e_cpu = miss_bytes / n_used / (self.miss_rate(link_gbps) * 1e9), self.share_cpu_s / n_used
        total = 0.0
        for m in range(1, n_used + 1):
            k = link_share(m, cpu_pct)
            cpu = (m - k + HYBRID_FIXED_EXPERTS) * e_cpu if m > k else 0.0
            total += math.comb(n_used, m) * (1 - hit) ** m * hit ** (n_used - m) * max(k * e_link, cpu)
        return self.cached_s + total

    def refill_layer_s(self, hit: float, miss_bytes: float, refill_gbps: float, n_used: int, refill: int) -> float:
        """One host-expert layer's seconds a token on the cached path with EXPERT_REFILL=refill: over the token's
        misses (binomial), all of them on the host CPU (cpu_s's expert rate), then `refill` of them into slots.

        Args:
            hit: the layer's hit rate with the refill (hit_curve's refill curve).
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            refill_gbps: the rate a refilled expert goes up at (from an mmap-ed model: the host's copy into pinned
                memory and the link's, one after the other).
            n_used: experts a token uses.
            refill: EXPERT_REFILL's value.
        Returns:
            seconds.
        """
        e_cpu, e_up = self.cpu_s / n_used, miss_bytes / n_used / (refill_gbps * 1e9)
        return self.cached_s + sum(math.comb(n_used, m) * (1 - hit) ** m * hit ** (n_used - m)
                                   * (m * e_cpu + min(refill, m) * e_up) for m in range(1, n_used + 1))

    def refill_break_even_hit(self, miss_bytes: float, refill_gbps: float, n_used: int, refill: int) -> float:
        """The hit rate above which a layer's refill path costs less than the CPU path (the guard's bar where
        EXPERT_REFILL is on), as hybrid_break_even_hit.

        Args:
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            refill_gbps: the rate a refilled expert goes up at.
            n_used: experts a token uses.
            refill: EXPERT_REFILL's value.
        Returns:
            h* in [0, 1].
        """
        return _falling_root(lambda h: self.refill_layer_s(h, miss_bytes, refill_gbps, n_used, refill) - self.cpu_s)

    def host_layer_s(self, hit: float, miss_bytes: float, link_gbps: float, slots: int, n_used: int = 0,
                     hybrid: int = 0, refill: int = 0, refill_gbps: float = 0.0) -> tuple[float, str]:
        """One host-expert layer's seconds a token and the path it takes: with slots, the cached path (with
        EXPERT_HYBRID=hybrid where given, or EXPERT_REFILL=refill) or, where that costs more, the CPU (the guard);
        without, the CPU.

        Args:
            hit: the layer's hit rate with its slots (with the refill: the refill curve's).
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link.
            slots: slots a layer (0: none).
            n_used: experts a token uses (for the hybrid's split).
            hybrid: EXPERT_HYBRID's value (0: off).
            refill: EXPERT_REFILL's value (0: off; it takes EXPERT_HYBRID on).
            refill_gbps: the rate a refilled expert goes up at.
        Returns:
            (seconds, "cache" | "hybrid" | "refill" | "cpu").
        """
        if slots <= 0:
            return self.cpu_s, "cpu"
        if refill and hybrid and n_used and refill_gbps > 0:   # (the native refill acts only with EXPERT_HYBRID)
            cached, path = self.refill_layer_s(hit, miss_bytes, refill_gbps, n_used, refill), "refill"
        elif hybrid and n_used:
            cached, path = self.hybrid_layer_s(hit, miss_bytes, link_gbps, n_used, hybrid), "hybrid"
        else:
            cached, path = self.cached_layer_s(hit, miss_bytes, link_gbps), "cache"
        return (cached, path) if cached < self.cpu_s else (self.cpu_s, "cpu")


def _falling_root(cost: Callable[[float], float]) -> float:
    """The hit rate where a path's cost over the CPU path's (falling as hits rise) crosses 0: 0 where it never costs
    more, 1 where it never costs less; bisected to a tenth of a percent."""
    if cost(0.0) <= 0:
        return 0.0
    if cost(1.0) >= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) > 0 else (lo, mid)
    return hi


@dataclass
class DecodeShare:
    """One device's share of a token: its MoE layers by where their experts are, and its cache.

    Attributes:
        resident_layers: MoE layers whose experts are in its memory.
        host_layers: MoE layers whose experts stay in host RAM.
        slots: cache slots a host-expert layer (0: none).
        hit: the hit rate those slots get.
        miss_bytes: bytes of a token's lookups at one layer (n_used experts).
        link_gbps: its host link for the misses.
        n_used: experts a token uses.
        hybrid: EXPERT_HYBRID's value (0: off).
        refill: EXPERT_REFILL's value (0: off; `hit` is then the refill curve's).
        refill_gbps: the rate a refilled expert goes up at.
    """

    resident_layers: int
    host_layers: int
    slots: int = 0
    hit: float = 0.0
    miss_bytes: float = 0.0
    link_gbps: float = 0.0
    n_used: int = 0
    hybrid: int = 0
    refill: int = 0
    refill_gbps: float = 0.0


def token_seconds(costs: Sequence[DecodeCosts], shares: Sequence[DecodeShare]) -> tuple[float, list[str]]:
    """Seconds a decoded token takes over the devices' shares (each with its own costs), and each device's host path.

    Args:
        costs: per device (one entry standing for every device is repeated by the caller).
        shares: per device.
    Returns:
        (seconds, per device "cache" | "hybrid" | "refill" | "cpu" | "" (no host-expert layer)).
    """
    total = max((c.outside_s for c in costs), default=0.0)
    paths = []
    for c, s in zip(costs, shares):
        host, path = c.host_layer_s(s.hit, s.miss_bytes, s.link_gbps, s.slots, s.n_used, s.hybrid, s.refill,
                                    s.refill_gbps) \
            if s.host_layers else (0.0, "")
        total += s.resident_layers * c.resident_s + s.host_layers * host
        paths.append(path)
    return total, paths


__all__ = ["DecodeCosts", "DecodeShare", "token_seconds"]
