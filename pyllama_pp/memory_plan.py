"""fit's planner for device memory: how each device's free memory is split between resident expert layers and the
expert cache's slots (EXPERT_CACHE, patch 0014), by the time it predicts for the user's workload
(pyllama_pp.workload), not by what is left over.

The alternatives: no cache (the layers fit placed); the cache in what the placement leaves free (the leftover: one
slot count a layer for every device, the most the device with the least room takes; where the devices differ - free
memory, host-expert layers - so that one would waste another's room, each device takes the most slots its own room
allows, EXPERT_CACHE's per-device list, and a device without room for a token's experts none); and
for each slot count a layer N (a token's experts, 1/16, 1/8, 1/4, 1/2 of a layer's experts, all of them) the most
resident layers that leave each device room for N slots in every host-expert layer - a layer moved to host RAM frees
its experts' bytes, which then serve the cache. Each is priced by pyllama_pp.decode_model (decode: what the decode
probe measured, the hit-rate curve, the links fit measured) and by the bytes its host-expert layers add to each prompt
over the links (a prompt's compute does not change with where the experts live). The fastest for the workload wins;
no cache unless a cache predicts at least GAIN_MIN less time. The chosen one is then placed for real (a dry run with
its cache's bytes reserved before placing), and the plan keeps every alternative with its prediction and why.
Each cached alternative is priced with its misses split between the link and the host CPU too (EXPERT_HYBRID, at
the rates the decode probe measured), and takes the split where it predicts GAIN_MIN less decode time. For an
mmap-ed model each cached alternative is priced with EXPERT_REFILL=1 alone (every miss on the host CPU, one a token
into the slots after it, at the refill's own hit curve, the host's copy into pinned memory then the link): the cache
alone's misses staged into pinned memory are not priced there (MMAP_REFILL_NOTE); where a device is an RPC server's
(the refill is not sent to servers) the cache alone is.

Every device is priced with its own costs and link, so the guard (EXPERT_CACHE_MIN_HIT: each device's own break-even
hit rate) and the split (EXPERT_HYBRID: each device's own CPU rate over its own link's) are one value per device
(`switches.one_or_list`: one value where the devices agree, as on equal devices): a device with a slow link goes to
the CPU path without sending the others' layers there. An RPC device's misses would split with its server's own CPU,
whose rate the decode probe does not measure (its layers' CPU path is the server's device copying the experts in):
its entry stays 0 unless that rate is given (DecodeCosts.hybrid_cpu_s), and the plan says so.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Collection, Optional, Sequence

from . import devices as devspec
from .decode_model import DecodeCosts, DecodeShare, token_seconds
from .defaults import CONTEXT, CUDA_LINK_GBPS
from .expert_cache_plan import Layout, drop_cache, guard_value, miss_gbps, own_slots, plan_cache
from .switches import (EXPERT_CACHE, EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID, EXPERT_REFILL, HYBRID_ALL_CPU,
                       one_or_list, per_device)
from .errors import ConfigError, OutOfMemoryError
from .hit_curve import HitCurve
from .plan import MiB, Plan, alternative_line
from .predict import expected_coverage
from .switches import ExpertCache
from .workload import Workload

# a cache must predict at least this much less time for the workload than none (the prediction's own error: a
# coin-flip gain is not worth a change of placement)
GAIN_MIN = 0.03
# the slot counts tried, as shares of a layer's experts (besides a token's experts and the leftover)
SHARES = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)


@dataclass
class Alternative:
    """One way to spend the devices' memory, with what it predicts.

    Attributes:
        name: in words ("no cache", "leftover", "16 slots a layer").
        slots: cache slots a host-expert layer (0: no cache).
        resident: per device, MoE layers whose experts stay in its memory.
        host: per device, MoE layers whose experts are in host RAM.
        cache_bytes: per device, the slots' bytes.
        hit: the hit rate the curve gives the slots.
        decode_ts: predicted decode tokens/s.
        prompt_extra_s: predicted prompt seconds over the workload beyond the no-cache placement's (the experts of
            layers moved to host RAM crossing the links).
        seconds: the workload's predicted seconds, less the prompt compute every alternative shares.
        paths: per device, where its host-expert layers run ("cache", "hybrid", "refill", "cpu": the guard's choice;
            "": none).
        fits: whether every device has room for it.
        hybrid: EXPERT_HYBRID's value where the misses split with the host CPU predicts GAIN_MIN less decode time
            than the cache alone (0: off): one value for every device, or the list's text, each device its own (0 where
            its split does not gain), switches.one_or_list.
        device_slots: per device, its own slots a layer where the devices take different counts (the leftover on
            unequal devices; `slots` is then the most of them); [] where every device takes `slots`.
        refill: EXPERT_REFILL's value where the slots of an mmap-ed model are priced on the refill's path and a
            device's host layers take it (`hybrid` is then HYBRID_ALL_CPU on every device with slots and `hit` the
            refill curve's); 0: off.
    """

    name: str
    slots: int
    resident: list
    host: list
    cache_bytes: list
    hit: float = 0.0
    decode_ts: float = 0.0
    prompt_extra_s: float = 0.0
    seconds: float = 0.0
    paths: list = field(default_factory=list)
    fits: bool = True
    hybrid: object = 0
    device_slots: list = field(default_factory=list)
    refill: int = 0

    def to_dict(self) -> dict:
        """The alternative as the plan's JSON holds it."""
        return asdict(self)

    def text(self) -> str:
        """One line: what it keeps where, the path its host-expert layers take, its prediction (as the plan prints
        it: plan.alternative_line)."""
        return alternative_line(self.to_dict())


def _links(plan: Plan, load_mode: str) -> list[float]:
    """Each device's host link for the cache's misses (GB/s): as fit measured it (for mmap: through the staging
    slots, expert_cache_plan.miss_gbps), else the spec's rate, else a PCIe 5 x16 link's."""
    spec = devspec.parse(plan.devices_spec.get("text") or plan.devices_spec)
    shares = spec.link_shares() or []
    out = []
    for i, d in enumerate(plan.devices):
        got = miss_gbps(d.link or {}, "pageable" if load_mode == "mmap" else "pinned", plan.host_copy_gbps)
        out.append(got or (shares[i] if i < len(shares) and shares[i] > 0 else CUDA_LINK_GBPS))
    return out


def _refill_links(plan: Plan, load_mode: str) -> list[float]:
    """Each device's rate for a refilled expert (GB/s): from pinned memory its link's; from an mmap-ed model the
    host's copy into pinned memory (as fit measured the staging's copy) and then the link, one after the other, or
    where that copy was not measured the pageable link's rate (which has a copy of its own in it)."""
    pinned = _links(plan, "none")
    if load_mode != "mmap":
        return pinned
    if not plan.host_copy_gbps:
        return [(d.link or {}).get("pageable_gbps") or ln for d, ln in zip(plan.devices, pinned)]
    return [1.0 / (1.0 / plan.host_copy_gbps + 1.0 / ln) for ln in pinned]


def refill_free(given: Optional[dict]) -> bool:
    """Whether the refill's switches are the planner's to set: the user set neither EXPERT_HYBRID nor EXPERT_REFILL
    (a switch or its variable; where either is set the user's values run).

    Args:
        given: the user's switches, NAME -> value.
    Returns:
        bool.
    """
    return not any(k in (given or {}) for k in (EXPERT_HYBRID, EXPERT_REFILL))


def prices_refill(plan: Plan, load_mode: str, refill: bool = True) -> bool:
    """Whether the slots are priced on the refill's path (MMAP_REFILL_NOTE): an mmap-ed model's, unless the user set
    EXPERT_HYBRID or EXPERT_REFILL (`refill` False) or a device is an RPC server's (servers get no EXPERT_REFILL)."""
    return refill and load_mode == "mmap" and not any(d.server for d in plan.devices)


def cost_guard(plan: Plan, layout: Layout, costs: dict[int, DecodeCosts], hybrid=0, refill: int = 0,
               lru_per_refill: float = 1.0) -> dict:
    """The cache's guard from the decode probe's costs (what the planner priced with): per device the hit rate above
    which its cached layer costs less than its CPU layer, from pinned and from pageable memory, and the switch value
    for each load mode: each device that caches its own bar (one value where they agree, guard_value). Where a
    device's misses split with the host CPU (`hybrid`: EXPERT_HYBRID's value, one or a list), its bar is the hybrid
    path's break-even: the cache alone's would send the layers the plan priced on the hybrid back to the CPU; with
    EXPERT_REFILL=refill the refill path's, in the hits the native guard counts (a shadow LRU's, which follows every
    token: the refill's bar times `lru_per_refill`, LRU's hit rate over the refill's at the plan's slots)."""
    miss = layout.n_used * layout.slot_bytes
    split = per_device(hybrid, len(plan.devices))

    def bars(mode: str) -> list[float]:
        out = []
        for i, (ln, rl) in enumerate(zip(_links(plan, mode), _refill_links(plan, mode))):
            c = costs.get(i) or costs[-1]
            out.append(min(1.0, lru_per_refill * c.refill_break_even_hit(miss, rl, layout.n_used, refill))
                       if refill and layout.n_used else c.hybrid_break_even_hit(miss, ln, layout.n_used, split[i]))
        return out

    per = {src: bars(mode) for src, mode in (("pinned", "none"), ("pageable", "mmap"))}
    return {"break_even": {k: [round(h, 4) for h in v] for k, v in per.items()},
            "min_hit": {mode: guard_value(plan, per[src]) for mode, src in (("none", "pinned"), ("mmap", "pageable"))},
            "from": "decode probe"}


def hybrid_values(plan: Plan, costs: Sequence[DecodeCosts], links: Sequence[float], layout: Layout) -> list[int]:
    """Each device's EXPERT_HYBRID from its own costs and link (DecodeCosts.hybrid_pct): 0 where its split's CPU has no
    known rate (an RPC device whose server's CPU was not measured: hybrid_cpu_s)."""
    miss = layout.n_used * layout.slot_bytes
    return [c.hybrid_pct(miss, ln) if layout.n_used and (not d.server or c.hybrid_cpu_s is not None) else 0
            for c, ln, d in zip(costs, links, plan.devices)]


def split_where_it_gains(costs: Sequence[DecodeCosts], shares: Sequence[DecodeShare], hybrid: Sequence[int]) -> list:
    """Per device the EXPERT_HYBRID value a token is priced with: each device's own value where its split saves time
    (its host-expert layers' seconds with it below those without), 0 elsewhere - all 0 unless the devices that save
    save GAIN_MIN of the token together (equal devices: one decision for all, as the total's)."""
    t0, _ = token_seconds(costs, shares)
    saved = [s.host_layers * (c.host_layer_s(s.hit, s.miss_bytes, s.link_gbps, s.slots, s.n_used)[0]
                              - c.host_layer_s(s.hit, s.miss_bytes, s.link_gbps, s.slots, s.n_used, v)[0])
             if v and s.slots and s.host_layers else 0.0 for c, s, v in zip(costs, shares, hybrid)]
    if sum(x for x in saved if x > 0) <= t0 * GAIN_MIN:
        return [0] * len(shares)
    return [v if x > 0 else 0 for v, x in zip(hybrid, saved)]


#: why an mmap-ed model's slots are priced on the refill's path alone: the cache alone's staged misses lost on every
#: GPU measured, also where fit's model, at the staging copy's measured rate, predicted a gain (one H100, 8 layers of
#: the 30B-A3B shape, 73 slots a layer, 90% hits: 328.7 t/s predicted, 146.1 measured, 0.519x upstream's own fit;
#: 0.59x at 16 slots: docs/results/gpu-h100-2026-12-07f), and the refill won (1.20x at 12.5% cached, 1.31x at 25%:
#: docs/results/mmap-refill-2026-12-07)
MMAP_REFILL_NOTE = (f"an mmap-ed model's slots priced with every miss on the host CPU and {EXPERT_REFILL}=1 alone: the "
                    "cache alone's misses staged into pinned memory measured slower than upstream's CPU path wherever "
                    "they ran")

#: why an mmap-ed model's cache not priced on the refill (prices_refill) runs without EXPERT_HYBRID's split: its
#: misses are copied into the pinned staging slots by host threads, the same host that would compute the CPU's
#: share; on an H100 (16-layer 30B-A3B preset, 16 slots a layer, 62-68% hits, tg128) the split decoded 68.5 t/s
#: against the cache alone's 79.3 (and upstream's CPU path 149)
MMAP_HYBRID_NOTE = (f"an mmap-ed model's slots priced with the cache alone ({EXPERT_REFILL} is not sent to RPC "
                    f"servers, or {EXPERT_HYBRID} / {EXPERT_REFILL} were set) and no {EXPERT_HYBRID} split: its "
                    "misses are staged by the host threads the CPU's share would need (measured slower)")


def hybrid_note(plan: Plan, costs: dict[int, DecodeCosts], load_mode: str, refill: bool = True) -> str:
    """How the misses were priced where that is news: an mmap-ed model's on the refill's path alone
    (MMAP_REFILL_NOTE, `refill`: prices_refill's answer) or with the cache alone (MMAP_HYBRID_NOTE); why
    EXPERT_HYBRID stays 0 on RPC devices ("" where none stays 0 for a reason: pinned weights and no RPC device, or its
    server's CPU rate given)."""
    if load_mode == "mmap":
        return MMAP_REFILL_NOTE if refill else MMAP_HYBRID_NOTE
    unknown = [d.name for i, d in enumerate(plan.devices)
               if d.server and d.host_expert_layers and (costs.get(i) or costs[-1]).hybrid_cpu_s is None]
    if not unknown:
        return ""
    return (f"{EXPERT_HYBRID} 0 on {', '.join(unknown)}: an RPC device's misses would split with its server's own "
            "CPU, whose expert rate is not measured (the decode probe's CPU path there is the server's device copying "
            "the experts in)")


def _resident(plan: Plan, n_dense: int) -> list[int]:
    """Per device, the MoE layers whose experts are in device memory: its full layers (a layer whose part upstream's
    overflow put on the next device among them: it runs on devices; one with part of its FFN on the CPU is among the
    host-expert layers, priced on the host's path) less the leading dense layers in its range (they have no experts;
    on the first devices)."""
    return [max(0, d.full_layers - max(0, min(d.layers[1], n_dense) - d.layers[0])) for d in plan.devices]


def _prompt_extra(workload: Workload, moved: Sequence[int], layer_bytes: float, links: Sequence[float],
                  plan: Plan, n_used: int, n_expert: int) -> float:
    """Seconds the workload's prompts spend more when `moved` MoE layers per device keep their experts in host RAM:
    their experts cross each link once a batch with LAYER_MAJOR's groups, else the share a ubatch uses once a ubatch
    (the links of a pipeline overlap: the slowest counts)."""
    if not any(moved):
        return 0.0
    n_batch, n_ubatch = plan.ctx.get("n_batch", CONTEXT.n_batch), plan.ctx.get("n_ubatch", CONTEXT.n_ubatch)
    grouped = (plan.layer_major or {}).get("group", 1) > 1
    total = 0.0
    for kind, n in workload.steps:
        if kind != "pp":
            continue
        unit = min(n, n_batch if grouped else n_ubatch)
        share = 1.0 if grouped else expected_coverage(unit, n_used, n_expert)
        per_unit = max(k * layer_bytes * share / (ln * 1e9) for k, ln in zip(moved, links))
        total += math.ceil(n / unit) * per_unit
    return total


def alternatives(plan: Plan, layout: Layout, costs: dict[int, DecodeCosts], curve: HitCurve, workload: Workload,
                 load_mode: str = CONTEXT.load_mode, n_dense: int = 0, move: bool = True,
                 refill: bool = True) -> list[Alternative]:
    """Every alternative for a plan's memory, priced.

    Args:
        plan: the placement with no cache in it (or the leftover cache, which is counted as free).
        layout: the model's slots.
        costs: device index -> DecodeCosts (-1: every device).
        curve: the hit-rate curve.
        workload: what the user will run.
        load_mode: the run's load mode (mmap: misses come up through the staging slots).
        n_dense: the model's leading dense layers (on the first device; no experts).
        move: N slots a layer may move resident layers to host RAM for their room (False: the placement is the
            user's, no layer moves: only the slot counts its room holds).
        refill: an mmap-ed model's slots may be priced on the refill's path (False: the user set EXPERT_HYBRID or
            EXPERT_REFILL; prices_refill).
    Returns:
        [no cache, leftover, N slots ...], each priced (fits False where a device has no room).
    """
    devs = plan.devices
    room = [d.target_bytes + d.cache_bytes - d.expected_bytes for d in devs]
    host0 = [d.host_expert_layers for d in devs]
    res0 = _resident(plan, n_dense)
    layer_bytes = layout.slot_bytes * layout.n_expert
    links = _links(plan, load_mode)
    per = [costs.get(i) or costs[-1] for i in range(len(devs))]
    miss_bytes = layout.n_used * layout.slot_bytes
    # (each device's own EXPERT_HYBRID, where its CPU's rate is known; for an mmap-ed model the refill's path
    # (prices_refill: MMAP_REFILL_NOTE) or the cache alone without a split (MMAP_HYBRID_NOTE))
    hybrid = [0] * len(devs) if load_mode == "mmap" else hybrid_values(plan, per, links, layout)
    refill_links = _refill_links(plan, load_mode) if prices_refill(plan, load_mode, refill) else []

    def priced(name: str, slots, moved: list) -> Alternative:
        """`slots` a layer on every device, or a list of each device's own."""
        own = list(slots) if isinstance(slots, (list, tuple)) else []
        each = own or [slots] * len(devs)
        host = [h + k for h, k in zip(host0, moved)]
        resident = [r - k for r, k in zip(res0, moved)]
        cbytes = [layout.bytes_of(n, h) for n, h in zip(each, host)]
        fits = all(c <= r + k * layer_bytes for c, r, k in zip(cbytes, room, moved))
        hits = [curve.at(n / layout.n_expert) if n else 0.0 for n in each]
        shares = [DecodeShare(r, h, k, hi, miss_bytes, ln, layout.n_used)
                  for r, h, k, hi, ln in zip(resident, host, each, hits, links)]
        if refill_links:   # (the refill's path at its own hit curve - the slots follow the routing more slowly - on
            # every device with slots: EXPERT_REFILL is one value, and acts only where EXPERT_HYBRID is on)
            hits = [curve.at(n / layout.n_expert, refill=True) if n else 0.0 for n in each]
            shares = [dataclasses.replace(sh, hit=hi, refill=1, refill_gbps=rl)
                      for sh, hi, rl in zip(shares, hits, refill_links)]
            split = [HYBRID_ALL_CPU if n and h else 0 for n, h in zip(each, host)]
        else:
            split = split_where_it_gains(per, shares, hybrid)
        tok, paths = token_seconds(per, [dataclasses.replace(sh, hybrid=v) for sh, v in zip(shares, split)])
        refills = 1 if "refill" in paths else 0
        split = split if refills or not refill_links else [0] * len(devs)
        extra = _prompt_extra(workload, moved, layer_bytes, links, plan, layout.n_used, layout.n_expert)
        hit = max(hits, default=0.0) if own else hits[0] if hits else 0.0   # (a list: its largest device's)
        return Alternative(name, max(each, default=0), resident, host, cbytes, round(hit, 4),
                           round(1.0 / tok, 2) if tok else 0.0, round(extra, 4),
                           round(extra + workload.decode_tokens * tok, 4), paths, fits,
                           one_or_list(split, [bool(k and h) for k, h in zip(each, host)]), own, refills)

    def moved_for(slots: int) -> Optional[list]:
        """Per device, the fewest layers to move to host RAM for `slots` slots in each host-expert layer."""
        out = []
        for r, h, free in zip(res0, host0, room):
            k = next((k for k in range(r + 1 if move else 1)
                      if layout.bytes_of(slots, h + k) <= free + k * layer_bytes), None)
            if k is None:
                return None
            out.append(k)
        return out

    alts = [priced("no cache", 0, [0] * len(devs))]
    left = min((layout.most_slots(free, h) for free, h in zip(room, host0) if h), default=0)
    own = own_slots(layout, -left, host0, room)   # (unequal devices: each its own room's slots)
    if own:
        alts.append(priced("leftover", own, [0] * len(devs)))
    elif left >= max(1, layout.n_used):
        alts.append(priced("leftover", left, [0] * len(devs)))
    counts = sorted(({layout.n_used} | {max(layout.n_used, round(s * layout.n_expert)) for s in SHARES}) - {left})
    for n in counts:
        moved = moved_for(n)
        if moved is not None and any(h + k for h, k in zip(host0, moved)):
            alts.append(priced(f"{n} slots a layer", n, moved))
    return alts


def choose(alts: Sequence[Alternative], skip: Collection[int] = ()) -> tuple[int, str]:
    """The alternative to take (its index) and why: the fastest that fits, a cache only where it saves GAIN_MIN;
    none of `skip` (alternatives fit found no placement for)."""
    fits = [i for i, a in enumerate(alts) if a.fits and i not in skip]
    if not fits:
        return 0, "no cache: no alternative has room (the plan is over its target)"
    best = min(fits, key=lambda i: alts[i].seconds)
    none = alts[0]
    if best == 0 or alts[best].seconds > none.seconds * (1 - GAIN_MIN):
        gain = 1 - alts[best].seconds / none.seconds if none.seconds else 0.0
        return 0, ("no cache: none predicts the workload faster" if best == 0 else
                   f"no cache: the best cache ({alts[best].name}) predicts only {gain:.1%} less time, below "
                   f"{GAIN_MIN:.0%}")
    a = alts[best]
    return best, (f"{a.name}: the workload in {a.seconds:.2f} s against {none.seconds:.2f} s without a cache "
                  f"({none.seconds / a.seconds:.2f}x)")


def _placed(plan: Plan, a: Alternative, none: Alternative, layout: Layout, costs: dict, curve: HitCurve,
            workload: Workload, load_mode: str, n_dense: int, refit: Callable[[int], Plan], why: str) -> tuple:
    """The chosen alternative placed for real (its largest device's bytes reserved on every device: fit then decides
    each device's host-expert layers), and why: where fit placed it otherwise, what it placed is priced again, and
    where that no longer saves GAIN_MIN against no cache the plan keeps no cache. None where fit finds no placement
    for it (the room the planner counted is not there: upstream's fit lowers the GPU layers instead), and why."""
    try:
        out = refit(int(math.ceil(max(a.cache_bytes) / MiB)))
    except (OutOfMemoryError, ConfigError) as e:   # (fit names a SIZE that leaves no room a ConfigError: room_error)
        return None, f"{a.name} has no placement ({str(e).splitlines()[0]})"
    out.expert_cache = "auto"
    slots = min((d.cache_slots for d in out.devices if d.host_expert_layers), default=0)
    if out.host_expert_layers == a.host and slots >= a.slots:
        return out, why
    tok, _ = token_seconds([costs.get(i) or costs[-1] for i in range(len(out.devices))],
                           [DecodeShare(r, d.host_expert_layers, slots,
                                        curve.at(slots / layout.n_expert, refill=bool(a.refill)),
                                        layout.n_used * layout.slot_bytes, ln, layout.n_used, v, a.refill, rl)
                            for r, d, ln, v, rl in zip(_resident(out, n_dense), out.devices, _links(out, load_mode),
                                                       per_device(a.hybrid, len(out.devices)),
                                                       _refill_links(out, load_mode))])
    seconds = workload.decode_tokens * tok + a.prompt_extra_s
    placed = (f"; fit placed host-expert layers {'/'.join(map(str, out.host_expert_layers))} with {slots} slots a "
              f"layer: decode {1 / tok:.1f} t/s predicted, {seconds:.2f} s")
    if slots <= 0 or seconds > none.seconds * (1 - GAIN_MIN):
        return drop_cache(plan), f"no cache: {a.name} was chosen{placed}, no longer {GAIN_MIN:.0%} below no cache"
    return out, why + placed


def plan_memory(plan: Plan, layout: Layout, costs: dict[int, DecodeCosts], curve: HitCurve, workload: Workload,
                refit: Callable[[int], Plan], load_mode: str = CONTEXT.load_mode, n_dense: int = 0,
                refill: bool = True) -> Plan:
    """Choose how a patched plan's memory is split between resident expert layers and the cache, and make that plan.

    Args:
        plan: fit's plan with the cache asked as auto (the leftover in it).
        layout: the model's slots.
        costs: device index -> DecodeCosts (the decode probe).
        curve: the hit-rate curve.
        workload: what the user will run.
        refit: places the model again with this many MiB a device reserved for the cache before placing (None: the
            placement is the user's, no layer moves: the cache takes what its room holds or nothing).
        load_mode: the run's load mode.
        n_dense: the model's leading dense layers.
        refill: an mmap-ed model's slots may be priced on the refill's path (prices_refill).
    Returns:
        Plan: the chosen plan, with `memory_plan` (the alternatives, the choice and why).
    """
    alts = alternatives(plan, layout, costs, curve, workload, load_mode, n_dense, move=refit is not None,
                        refill=refill)
    host0 = [d.host_expert_layers for d in plan.devices]
    unplaced: set[int] = set()
    refused = ""   # (the alternatives fit found no placement for, and why: the next fastest is taken instead)
    while True:
        pick, why = choose(alts, unplaced)
        a = alts[pick]
        moved = [h - h0 for h, h0 in zip(a.host, host0)]
        if not a.slots:
            out = drop_cache(plan)
        elif not any(moved):
            asked = (ExpertCache(devices=tuple(ExpertCache(slots=n) for n in a.device_slots)) if a.device_slots
                     else ExpertCache(slots=a.slots))
            out = plan_cache(drop_cache(plan), asked, layout)
            out.expert_cache = "auto"
        else:
            out, why = _placed(plan, a, alts[0], layout, costs, curve, workload, load_mode, n_dense, refit, why)
            if out is None:   # (nor is any that reserves as much or more for its slots: not tried)
                unplaced |= {i for i, x in enumerate(alts) if x.host != host0
                             and max(x.cache_bytes, default=0) >= max(a.cache_bytes)}
                refused += f"{why}; "
                continue
            pick = pick if out.switches.get(EXPERT_CACHE) else 0
        break
    why = refused + why
    if out.switches.get(EXPERT_CACHE):
        # (the refill's bar in the shadow LRU's hits, at the slots placed: the fewest of a device's that caches)
        frac = min((d.cache_slots for d in out.devices if d.host_expert_layers), default=a.slots) / layout.n_expert
        ratio = curve.at(frac) / curve.at(frac, refill=True) if a.refill and curve.at(frac, refill=True) else 1.0
        out.cache_guard = {**out.cache_guard, **cost_guard(out, layout, costs, a.hybrid, a.refill, ratio)}
        out.switches[EXPERT_CACHE_MIN_HIT] = out.cache_guard["min_hit"]["none"]
        if a.hybrid:
            out.switches[EXPERT_HYBRID] = a.hybrid
        if a.refill:
            out.switches[EXPERT_REFILL] = a.refill
    note = hybrid_note(out, costs, load_mode, prices_refill(plan, load_mode, refill)) \
        if out.switches.get(EXPERT_CACHE) or load_mode == "mmap" else ""
    out.memory_plan = {"workload": {"name": workload.name, "steps": workload.as_list()}, "curve": curve.to_dict(),
                       "load_mode": load_mode, "costs": {str(i): c.to_dict() for i, c in costs.items()},
                       "alternatives": [x.to_dict() for x in alts], "chosen": pick, "why": why,
                       "placed": {"host": out.host_expert_layers,
                                  "slots": [d.cache_slots for d in out.devices]},
                       **({"hybrid_note": note} if note else {})}
    return out


__all__ = ["Alternative", "alternatives", "choose", "plan_memory", "GAIN_MIN"]
