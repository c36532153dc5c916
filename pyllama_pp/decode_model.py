"""fit's model of decode time: what a token costs with each MoE layer's experts where a plan puts them, from what the
decode probe measured (`DecodeCosts`, pyllama_pp.compute.decode_costs), the links fit measured and the cache's hit
rate (pyllama_pp.hit_curve). No process is started here.

A token runs every layer in turn (decode does not pipeline), so its time is the sum of its layers' and what is outside
them. Per MoE layer:
- experts resident on the device: `resident_s`;
- experts in host RAM, no slots: the host CPU computes them where they live (upstream's path): `cpu_s`;
- experts in host RAM with S slots a layer, hit rate h: the device reads the hits from its slots and copies each miss
  over the link first: `cached_s + (1 - h) n_used x expert / link` - unless that costs more than the CPU path, where
  the cache's guard sends the layer to the CPU (EXPERT_CACHE_MIN_HIT, set from the same costs): the smaller of the two.
`cached_s` is measured with every lookup a hit (the device's compute, the routing ids read back, the slots' lookup),
`cpu_s` at the run's thread count (the activations' round trip included), so the fixed costs a rate leaves out are in.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from .defaults import CONTEXT


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
    """

    device: str
    outside_s: float
    resident_s: float
    cpu_s: float
    cached_s: float
    threads: int = CONTEXT.n_threads
    load_mode: str = CONTEXT.load_mode

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
        return self.cached_s + (1.0 - hit) * miss_bytes / (link_gbps * 1e9)

    def break_even_hit(self, miss_bytes: float, link_gbps: float) -> float:
        """The hit rate above which a layer's cached path costs less than the CPU path: cached_s + (1 - h) miss = cpu_s
        (at or below 0: the cache always pays; at or above 1: never).

        Args:
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link for the misses.
        Returns:
            h*.
        """
        miss_s = miss_bytes / (link_gbps * 1e9)
        return 1.0 - (self.cpu_s - self.cached_s) / miss_s if miss_s > 0 else (0.0 if self.cached_s < self.cpu_s else 1.0)

    def host_layer_s(self, hit: float, miss_bytes: float, link_gbps: float, slots: int) -> tuple[float, str]:
        """One host-expert layer's seconds a token and the path it takes: with slots, the cached path or, where that
        costs more, the CPU (the guard); without, the CPU.

        Args:
            hit: the layer's hit rate with its slots.
            miss_bytes: bytes of a token's lookups at a layer (n_used experts).
            link_gbps: the device's host link.
            slots: slots a layer (0: none).
        Returns:
            (seconds, "cache" | "cpu").
        """
        if slots <= 0:
            return self.cpu_s, "cpu"
        cached = self.cached_layer_s(hit, miss_bytes, link_gbps)
        return (cached, "cache") if cached < self.cpu_s else (self.cpu_s, "cpu")


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
    """

    resident_layers: int
    host_layers: int
    slots: int = 0
    hit: float = 0.0
    miss_bytes: float = 0.0
    link_gbps: float = 0.0


def token_seconds(costs: Sequence[DecodeCosts], shares: Sequence[DecodeShare]) -> tuple[float, list[str]]:
    """Seconds a decoded token takes over the devices' shares (each with its own costs), and each device's host path.

    Args:
        costs: per device (one entry standing for every device is repeated by the caller).
        shares: per device.
    Returns:
        (seconds, per device "cache" | "cpu" | "" (no host-expert layer)).
    """
    total = max((c.outside_s for c in costs), default=0.0)
    paths = []
    for c, s in zip(costs, shares):
        host, path = c.host_layer_s(s.hit, s.miss_bytes, s.link_gbps, s.slots) if s.host_layers else (0.0, "")
        total += s.resident_layers * c.resident_s + s.host_layers * host
        paths.append(path)
    return total, paths


__all__ = ["DecodeCosts", "DecodeShare", "token_seconds"]
