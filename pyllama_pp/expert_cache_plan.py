"""The device expert cache (EXPERT_CACHE, patch 0014) as fit plans it: what `--expert-cache auto|SIZE|0` asks for
(`parse`), each device's slots per layer and bytes as the native allocation gives them (`Layout`), the one switch value
that gives them (`auto_switch`), and all of it written into a fit `Plan` (`plan_cache`).

The native switch takes one value for every device: EXPERT_CACHE=M gives each device M MiB, split evenly over the
host-expert layers it owns (as many slots a layer as fit, at most every expert), and a device whose layers can use less
(every expert cached) takes only that; EXPERT_CACHE=-N gives each such layer N slots, whatever they take. SIZE is M:
fit reserves it on every device (`fit.reserved_bytes`), so the placement leaves room for it. auto is what the plan
leaves free on each device after its layers, KV, compute buffers, early copies and margin: of the two forms it takes
the one that caches more experts without any device going past its free memory (the largest M, or the most slots N
every device has room for), and adds each device's share to its margin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

from . import devices as devspec
from .defaults import FIT
from .errors import ConfigError, DeviceSpecError, OutOfMemoryError
from .plan import CACHE_SWITCH as SWITCH
from .plan import MiB, Plan

# the native allocation's sizes (pyllama_pp/native/sched/ggml-backend-pp-cache.cpp, ggml_sched_pp_cache_alloc)
ALIGN = 128          # a device buffer's tensor alignment (CUDA's and VDEV's)
GATHER_TAIL = 512    # GGML_BACKEND_PP_GATHER_TAIL: bytes past a weight's slots a kernel may read
MAX_TOKENS = 64      # GGML_SCHED_PP_CACHE_MAX_TOKENS: tokens whose slot ids a layer keeps
MAX_SLOTS_SWITCH = 65536   # EXPERT_CACHE's range: -65536 slots a layer at most


def parse(value, variant: str = FIT.variant) -> Union[str, int]:
    """What `--expert-cache` (fit's expert_cache) asks for.

    Args:
        value: "auto", a size ("2GiB", "512MiB", or bytes), 0 / "0" (off), or None (FIT.expert_cache, the default;
            0 for the baseline).
        variant: the build the plan is for: the baseline has no cache.
    Returns:
        "auto", the size in bytes (a whole number of MiB, at least 1), or 0.
    Raises:
        ConfigError: for a value that is none of these, a negative size, one below 1 MiB, or a cache for the baseline.
    """
    if value is None:
        value = FIT.expert_cache if variant == "patched" else 0
        if not value:
            return 0
    if str(value).strip().lower() == "auto":
        asked: Union[str, int] = "auto"
    else:
        try:
            asked = devspec.parse_size(str(value).strip() if isinstance(value, str) else value)
        except DeviceSpecError:
            raise ConfigError(f"--expert-cache {value!r}: give auto (what fit leaves free on each device), a size "
                              "such as 512MiB or 2GiB, or 0 (no cache)") from None
        if 0 < asked < MiB:
            raise ConfigError(f"--expert-cache {value}: the cache takes whole MiB a device (EXPERT_CACHE); give 1MiB "
                              "or more, auto, or 0 (no cache)")
        asked -= asked % MiB
    if asked and variant != "patched":
        raise ConfigError(f"--expert-cache {value}: the {variant} build has no expert cache (patch 0014). Fix: drop "
                          "--expert-cache, or plan for --variant patched")
    return asked


def text(asked: Union[str, int]) -> str:
    """How a plan names what was asked: "auto", "512MiB", or "" (no cache)."""
    return asked if isinstance(asked, str) else f"{asked // MiB}MiB" if asked else ""


@dataclass(frozen=True)
class Layout:
    """What one slot of a layer's cache holds, from the model (one expert of the layer in each of its expert
    tensors), and the native allocation's slots and bytes for a device from it.

    Attributes:
        slot_bytes: one expert of one layer in all its expert tensors.
        n_expert: experts per MoE layer (the most slots a layer takes).
        n_used: experts each token uses (a token's lookups need that many slots).
        weights: expert tensors per MoE layer.
    """

    slot_bytes: float
    n_expert: int
    n_used: int
    weights: int

    def other(self, layers: int) -> int:
        """Bytes of a device's slot buffer beside the slots: alignment, the kernels' tail and the slot ids, for
        `layers` layers (the native estimate before it allocates)."""
        return layers * (self.weights * (ALIGN + GATHER_TAIL) + ALIGN + self.n_used * MAX_TOKENS * 4)

    def slots_at(self, switch: int, layers: int) -> int:
        """The slots a layer gets on a device of `layers` host-expert layers with EXPERT_CACHE=switch."""
        if layers <= 0 or switch == 0 or self.slot_bytes <= 0:
            return 0
        if switch < 0:
            return min(-switch, self.n_expert)
        left = switch * MiB - self.other(layers)
        return max(0, min(self.n_expert, int(left // (self.slot_bytes * layers)))) if left > 0 else 0

    def bytes_of(self, slots: int, layers: int) -> int:
        """Device memory `slots` slots a layer take on a device of `layers` host-expert layers (0: no cache)."""
        return int(math.ceil(slots * self.slot_bytes * layers)) + self.other(layers) if slots > 0 and layers > 0 else 0

    def most_slots(self, room: int, layers: int) -> int:
        """The most slots a layer a device of `layers` host-expert layers has room for in `room` bytes."""
        if layers <= 0 or self.slot_bytes <= 0:
            return 0
        return max(0, min(self.n_expert, int((room - self.other(layers)) // (self.slot_bytes * layers))))


def auto_switch(layout: Layout, layers: Sequence[int], room: Sequence[int]) -> int:
    """The EXPERT_CACHE value that caches the most experts with no device past its room (0: none has room for the
    n_used slots a token needs): the largest M MiB (a device whose layers take every expert in less does not bound
    it), or -N slots a layer, whichever caches more (M on a tie).

    Args:
        layout: the model's slots.
        layers: host-expert layers per device.
        room: bytes free per device.
    Returns:
        M (MiB a device), -N (slots a layer) or 0.
    """
    owning = [(n, max(0, r)) for n, r in zip(layers, room) if n > 0]
    if not owning:
        return 0
    bound = math.inf   # the largest budget below each device's next slot it has no room for
    for n, r in owning:
        full = layout.bytes_of(layout.n_expert, n)
        if full > r:
            bound = min(bound, (layout.most_slots(r, n) + 1) * layout.slot_bytes * n + layout.other(n) - 1)
    mib = (max(math.ceil(layout.bytes_of(layout.n_expert, n) / MiB) for n, _ in owning) if bound == math.inf
           else int(bound // MiB))
    slots = min(min(layout.most_slots(r, n) for n, r in owning), MAX_SLOTS_SWITCH)

    def cached(switch: int) -> int:   # (experts cached, counting a device only where a token's lookups fit)
        return sum(n * s for n in layers if (s := layout.slots_at(switch, n)) >= max(1, layout.n_used))
    best = max((mib, -slots), key=lambda sw: (cached(sw), sw > 0)) if mib or slots else 0
    return best if best and cached(best) > 0 else 0


def plan_cache(plan: Plan, asked: Union[str, int], layout: Layout) -> Plan:
    """Write the cache into a patched fit plan: the switch (EXPERT_CACHE), each device's slots a layer and bytes, and,
    for auto, each device's share added to its margin (target lowered by as much). For a SIZE fit reserved it in
    every device's margin already.

    Args:
        plan: the plan, as fit made it (a SIZE: with the SIZE in its margins).
        asked: parse()'s value ("auto", bytes, or 0: the plan is left as it is).
        layout: the model's slots.
    Returns:
        Plan: the same plan.
    """
    if not asked:
        return plan
    layers = [d.host_expert_layers for d in plan.devices]
    if asked == "auto":
        switch = auto_switch(layout, layers, [d.target_bytes - d.expected_bytes for d in plan.devices])
    else:
        switch = asked // MiB
    for i, d in enumerate(plan.devices):
        d.cache_slots = layout.slots_at(switch, d.host_expert_layers)
        d.cache_bytes = layout.bytes_of(d.cache_slots, d.host_expert_layers)
        if asked == "auto":
            plan.margins[i] += d.cache_bytes
            d.target_bytes -= d.cache_bytes
    plan.expert_cache = text(asked)
    if switch:
        plan.switches = {**plan.switches, SWITCH: switch}
    return plan


def room_error(plan: Plan, problem: Exception) -> Exception:
    """fit's problem with a plan, as the cache's error where a SIZE left the model no room (ConfigError, naming the
    device and its free memory); any other problem as it is."""
    asked = plan.expert_cache
    if not asked or asked == "auto" or not isinstance(problem, OutOfMemoryError) or not plan.devices:
        return problem
    size = devspec.parse_size(asked)
    over = [d for d in plan.devices if d.expected_bytes > d.target_bytes]
    d = over[0] if over else min(plan.devices, key=lambda x: x.target_bytes)
    margin = plan.margins[plan.devices.index(d)] - size
    why = str(problem).split(". Fix:")[0].split(": ", 1)[-1]
    return ConfigError(f"--expert-cache {asked}: no room for the model beside it on {d.name}, which has "
                       f"{d.free_bytes / MiB:.1f} MiB free ({max(0, d.free_bytes - margin - size) / MiB:.1f} MiB "
                       f"after the margin of {margin / MiB:.1f} MiB and the cache's {size / MiB:.0f} MiB): {why}. "
                       "Fix: a smaller --expert-cache, or auto (what fit leaves free)")
