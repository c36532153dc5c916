"""The device expert cache (EXPERT_CACHE, patch 0014) as fit plans it: what `--expert-cache auto|SIZE|Nslots|0` asks
for (pyllama_pp.switches.ExpertCache), each device's slots per layer and bytes as the native allocation gives them
(`Layout`), the one switch value that gives them (`auto_switch`), and all of it written into a fit `Plan`
(`plan_cache`).

The native switch takes one value for every device, or a list of one per device: EXPERT_CACHE=M gives each device M
MiB, split evenly over the host-expert layers it owns (as many slots a layer as fit, at most every expert), and a device
whose layers can use less (every expert cached) takes only that; EXPERT_CACHE=-N gives each such layer N slots,
whatever they take; EXPERT_CACHE=A,B,... gives the first device A, the second B (each M, -N or 0). SIZE is M: fit
reserves it on every device (`fit.reserved_bytes`; a list's sizes each on its own device), so the placement leaves room
for it. auto is what the plan leaves free on each device after its layers, KV, compute buffers, early copies and
margin: of the two forms it takes the one that caches more experts without any device going past its free memory (the
largest M, or the most slots N every device has room for), and adds each device's share to its margin; where the
devices differ (free memory, host-expert layers) so that one would have room for more slots a layer than that value
gives it, each device takes the most its own room allows instead (`own_slots`: a list of -N, one per device; 0 where a
device has no room for the slots a token needs). Nslots is -N: each device's share is added to its margin as auto's
is, and a device without room for it is named; a list's entries are each device's own.

The guard (EXPERT_CACHE_MIN_HIT: a layer whose shadow hits fall below it goes back to the CPU path) is set from costs,
not a fixed bar: `break_even_hit` is the hit rate above which a layer's cached path costs less than the CPU's, from
the rates fit measured (the host CPU's decode expert op, each device's link from pinned and from pageable memory)
and the device's own read (`guard`), each device its own (a list where they differ); a run takes the value for its
load mode (Plan.run_switches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from . import devices as devspec
from .defaults import CONTEXT, threads
from .model_file import expert_bytes_per_layer, expert_layout
from .errors import ConfigError, OutOfMemoryError
from .plan import MiB, Plan
from .switches import EXPERT_CACHE as SWITCH
from .switches import EXPERT_CACHE_MIN_HIT as GUARD_SWITCH
from .switches import MAX_SLOTS as MAX_SLOTS_SWITCH
from .switches import CACHE_SWITCHES, ExpertCache, one_or_list

# the native allocation's sizes (pyllama_pp/native/sched/ggml-backend-pp-cache.cpp, ggml_sched_pp_cache_alloc)
ALIGN = 128          # a device buffer's tensor alignment (CUDA's and VDEV's)
GATHER_TAIL = 512    # GGML_BACKEND_PP_GATHER_TAIL: bytes past a weight's slots a kernel may read
MAX_TOKENS = 64      # GGML_SCHED_PP_CACHE_MAX_TOKENS: tokens whose slot ids a layer keeps


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


def layout_of(model, n_expert: int) -> Layout:
    """The model's slots: one expert of a layer in every expert tensor, the experts a token uses.

    Args:
        model: the GGUF file.
        n_expert: experts per MoE layer.
    Returns:
        Layout.
    """
    n_used, weights = expert_layout(model)
    return Layout(slot_bytes=expert_bytes_per_layer(model) / n_expert, n_expert=n_expert, n_used=n_used,
                  weights=weights)


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


def own_slots(layout: Layout, switch: int, layers: Sequence[int], room: Sequence[int]) -> Optional[list[int]]:
    """Each device's own slots a layer where one EXPERT_CACHE value would leave a device room for more: per device the
    most slots its room allows (at least what `switch` gives it; 0 below the slots a token needs); None where every
    device with host-expert layers would get the same slots either way (one value keeps the plan).

    Args:
        layout: the model's slots.
        switch: the one value chosen for every device.
        layers: host-expert layers per device.
        room: bytes free per device.
    Returns:
        slots a layer per device, or None.
    """
    one = [layout.slots_at(switch, n) for n in layers]
    own = [max(s, layout.most_slots(max(0, r), n)) if n > 0 else 0 for s, n, r in zip(one, layers, room)]
    own = [s if s >= max(1, layout.n_used) else 0 for s in own]
    owning = {s for s, n in zip(own, layers) if n > 0}
    if len(owning) <= 1 or own == one:
        return None
    return own


def break_even_hit(cpu_gbps: float, link_gbps: float, dev_gbps: float) -> float:
    """The hit rate above which a layer's cached path costs less per token than the CPU path (upstream's).

    Per used expert the cached path reads it in the device's memory (1 / dev) and, where it missed, copies it over the
    host link first ((1 - h) / link); the CPU path reads it in host memory (1 / cpu). They cost the same at
    h* = 1 - link (1 / cpu - 1 / dev): 1 or more where the device reads no faster than the host's CPU (the cache never
    pays), 0 or less where a copied miss costs less than the CPU's read (it always pays). A layer's fixed costs
    (reading the ids back, a launch) are not counted: the bar is a lower bound.

    Args:
        cpu_gbps: the host CPU's decode expert op (GB/s of the experts it reads).
        link_gbps: the device's host link for the experts' copies (pinned, or pageable for an mmap-ed model).
        dev_gbps: the device reading experts in its own memory.
    """
    return 1.0 - link_gbps * (1.0 / cpu_gbps - 1.0 / dev_gbps)


def miss_gbps(link: dict, source: str, host_copy_gbps: Optional[float] = None) -> Optional[float]:
    """The rate a cache miss comes up at from `source` host memory.

    Args:
        link: the device's link as fit measured it (DevicePlan.link: pinned_gbps, pageable_gbps).
        source: "pinned" (load mode none) or "pageable" (mmap).
        host_copy_gbps: the host's copy into the pinned staging slots, as measured (None: not measured).
    Returns:
        GB/s: pinned, the link's; pageable, through the staging slots (STAGING) where their copy was measured: the
        slower of that copy and the pinned link (a piece is copied while the one before crosses the link), else the
        pageable link's; None where the link was not measured.
    """
    pinned, pageable = link.get("pinned_gbps"), link.get("pageable_gbps")
    if source == "pinned":
        return pinned or pageable
    return min(host_copy_gbps, pinned) if host_copy_gbps and pinned else pageable


def percent(h: float) -> int:
    """A break-even hit rate as the guard's switch value: whole percent, at least 1 (0 turns the guard off), at most
    100 (every layer goes to the CPU path once its window is seen)."""
    return min(100, max(1, math.ceil(h * 100)))


def guard_value(plan: Plan, break_even: Sequence[float]):
    """EXPERT_CACHE_MIN_HIT's value for the devices' break-even hit rates: each device that caches (every device where
    none does) its own bar in whole percent (`percent`), one value where they agree (switches.one_or_list)."""
    caching = [d.cache_slots > 0 for d in plan.devices]
    return one_or_list([percent(h) for h in break_even], caching if any(caching) else None)


def guard(plan: Plan) -> dict:
    """The cache's guard for a plan, from what fit measured: per device its break-even hit rate from pinned and from
    pageable memory, and the switch value for each load mode (each caching device its own bar, guard_value); {} where
    a rate is missing (the native default stays)."""
    spec = devspec.parse(plan.devices_spec.get("text") or plan.devices_spec)
    cpu = plan.cpu_expert_gbps.get(str(threads(plan.ctx.get("n_threads", CONTEXT.n_threads))))
    dev = spec.expert_read_rates(cpu, len(plan.devices)) if cpu else None
    links = [d.link or {} for d in plan.devices]
    if not cpu or not dev or not all(ln.get("pinned_gbps") or ln.get("pageable_gbps") for ln in links):
        return {}
    per = {}
    for source in ("pinned", "pageable"):
        per[source] = [break_even_hit(cpu, miss_gbps(ln, source, plan.host_copy_gbps), r) for ln, r in zip(links, dev)]
    min_hit = {mode: guard_value(plan, per[source]) for mode, source in (("none", "pinned"), ("mmap", "pageable"))}
    return {"break_even": {k: [round(h, 4) for h in v] for k, v in per.items()}, "min_hit": min_hit,
            "cpu_gbps": round(cpu, 3), "dev_gbps": [round(r, 3) for r in dev]}


def plan_cache(plan: Plan, asked: ExpertCache, layout: Layout) -> Plan:
    """Write the cache into a patched fit plan: the switch (EXPERT_CACHE), each device's slots a layer and bytes, and,
    for auto and a slot count, each device's share added to its margin (target lowered by as much). For a SIZE fit
    reserved it in every device's margin already.

    Args:
        plan: the plan, as fit made it (a SIZE: with the SIZE in its margins).
        asked: what was asked (none: the plan is left as it is).
        layout: the model's slots.
    Returns:
        Plan: the same plan.
    Raises:
        ConfigError: for a slot count a device has no room for, naming the device and its free memory.
    """
    if not asked:
        return plan
    layers = [d.host_expert_layers for d in plan.devices]
    room = [d.target_bytes - d.expected_bytes for d in plan.devices]
    per = [asked.at(i).switch for i in range(len(plan.devices))]
    if asked.auto:
        switch = auto_switch(layout, layers, room)
        own = own_slots(layout, switch, layers, room) if switch else None
        per = [-s for s in own] if own else [switch] * len(plan.devices)
    for i, d in enumerate(plan.devices):
        d.cache_slots = layout.slots_at(per[i], d.host_expert_layers)
        d.cache_bytes = layout.bytes_of(d.cache_slots, d.host_expert_layers)
        if asked.at(i).slots and d.cache_bytes > max(0, room[i]):   # (no slots on a device over its target: fit's)
            raise ConfigError(f"--expert-cache {asked.text}: {d.name} has {max(0, room[i]) / MiB:.1f} MiB free after "
                              f"the plan, and {d.cache_slots} slots in each of its {d.host_expert_layers} host-expert "
                              f"layers take {d.cache_bytes / MiB:.1f} MiB. Fix: fewer slots, a size, or auto (what "
                              "fit leaves free)")
        if not asked.at(i).mib:
            plan.margins[i] += d.cache_bytes
            d.target_bytes -= d.cache_bytes
    plan.expert_cache = asked.text
    switch = per[0] if len(set(per)) == 1 else ",".join(map(str, per))   # (equal devices: one value)
    if switch:
        plan.switches = {**plan.switches, SWITCH: switch}
        plan.cache_guard = guard(plan)
        if plan.cache_guard:
            plan.switches[GUARD_SWITCH] = plan.cache_guard["min_hit"]["none"]
    return plan


def drop_cache(plan: Plan) -> Plan:
    """A plan's cache taken out again (auto's share given back to each device's target, the switch, its guard and
    the hybrid dropped; the measured rates and break-even kept).

    Args:
        plan: a patched plan, with or without a cache.
    Returns:
        Plan: the same plan, without a cache.
    """
    if not plan.expert_cache:
        return plan
    for i, d in enumerate(plan.devices):
        if not ExpertCache.parse(plan.expert_cache).at(i).mib:
            plan.margins[i] -= d.cache_bytes
            d.target_bytes += d.cache_bytes
        d.cache_slots = d.cache_bytes = 0
    plan.switches = {k: v for k, v in plan.switches.items() if k not in CACHE_SWITCHES}
    plan.expert_cache = ""
    return plan


def room_error(plan: Plan, problem: Exception) -> Exception:
    """fit's problem with a plan, as the cache's error where a SIZE left the model no room (ConfigError, naming the
    device and its free memory); any other problem as it is."""
    cache = ExpertCache.parse(plan.expert_cache or None)
    if not any(cache.at(i).bytes for i in range(len(plan.devices))) or not isinstance(problem, OutOfMemoryError):
        return problem
    asked = plan.expert_cache
    over = [d for d in plan.devices if d.expected_bytes > d.target_bytes]
    d = over[0] if over else min(plan.devices, key=lambda x: x.target_bytes)
    size = cache.at(plan.devices.index(d)).bytes
    margin = plan.margins[plan.devices.index(d)] - size
    why = str(problem).split(". Fix:")[0].split(": ", 1)[-1]
    return ConfigError(f"--expert-cache {asked}: no room for the model beside it on {d.name}, which has "
                       f"{d.free_bytes / MiB:.1f} MiB free ({max(0, d.free_bytes - margin - size) / MiB:.1f} MiB "
                       f"after the margin of {margin / MiB:.1f} MiB and the cache's {size / MiB:.0f} MiB): {why}. "
                       "Fix: a smaller --expert-cache, or auto (what fit leaves free)")
