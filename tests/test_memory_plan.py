"""fit's memory planner (pyllama_pp.memory_plan): resident expert layers against cache slots, priced by the decode
model (pyllama_pp.decode_model) with handed-in costs (no timing here: the decode probe's numbers are stated per case),
the hit-rate curve (pyllama_pp.hit_curve) and the workload (pyllama_pp.workload)."""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from pyllama_pp import cli, synth
from pyllama_pp.decode_model import DecodeCosts, DecodeShare, token_seconds
from pyllama_pp.errors import ConfigError
from pyllama_pp.expert_cache_plan import drop_cache, layout_of, percent
from pyllama_pp.fit import _weigh
from pyllama_pp.expert_cache_sim import capacity_of, default_warmup, hybrid
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.hit_curve import PRIOR, REFILL_PRIOR, HitCurve
from pyllama_pp.switches import CACHE_SWITCHES, HYBRID_ALL_CPU
from pyllama_pp.memory_plan import (GAIN_MIN, MMAP_HYBRID_NOTE, MMAP_REFILL_NOTE, Alternative, _refill_links,
                                     alternatives, choose, cost_guard, plan_memory)
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.placement import fit as place
from pyllama_pp.plan import Plan
from pyllama_pp.planning import MMAP_REFILL, _tests_workload, Choices, plan_runs
from pyllama_pp.workload import Workload

CTX = ContextParams(n_ctx=512, n_batch=512, n_ubatch=128)
# 12 tiny layers on one 9 MiB VDEV: about half of the layers keep their experts in host RAM
SPEC = "vdev:1x9MiB@4GBps"
# a GPU's shape of costs: a resident layer and a cached one (every lookup a hit) cost about the same on the device,
# the host CPU's path many times more (an H100 with the 30B preset: 3.9 ms of GPU work a token over 48 layers, the
# CPU path ~0.65 ms a layer)
GPU_LIKE = DecodeCosts("gpu-like", outside_s=1e-3, resident_s=6e-5, cpu_s=6.5e-4, cached_s=8e-5)
# a device that computes no faster than the host CPU (a VDEV runs the host's kernels): the cache never pays
CPU_LIKE = DecodeCosts("cpu-like", outside_s=1e-3, resident_s=6e-4, cpu_s=6e-4, cached_s=6.5e-4)
LOCALITY = HitCurve(PRIOR, "prior")
UNIFORM = HitCurve(((0.0, 0.0), (1.0, 1.0)), "uniform")
CHAT = Workload.parse("chat")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(synth.cached_model(tmp_path_factory.mktemp("memplan"), "tiny", seed=1, n_layer=12, routing="locality"))


@pytest.fixture(scope="module")
def leftover(model) -> Plan:
    """The placement with the cache in what it leaves free (placement's auto: the planner's starting point)."""
    return place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto")


def _with_link(plan: Plan, layout, costs: DecodeCosts, miss_over_cpu: float) -> Plan:
    """A copy of the plan whose links make a token's misses at one layer cost `miss_over_cpu` times the CPU path's
    layer (an H100 with the 30B preset: about 0.4; a slow pageable link: 2 or more)."""
    out = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    gbps = layout.n_used * layout.slot_bytes / (miss_over_cpu * costs.cpu_s) / 1e9
    for d in out.devices:
        d.link = {"pinned_gbps": gbps, "pageable_gbps": gbps, "copy_bytes": 0}
    return out


def _refit(model):
    return lambda mib: place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=f"{mib}MiB")


def test_workload_forms():
    assert Workload.parse("chat").steps == (("pp", 2048), ("tg", 256))
    w = Workload.parse("pp=4096,tg=512")
    assert (w.prompt_tokens, w.decode_tokens) == (4096, 512)
    assert Workload.parse("tg=64").steps == (("tg", 64),)
    assert Workload.of_tests([512], [16, 0]).steps == (("pp", 512), ("tg", 16))
    assert w.seconds(1000.0, 100.0) == pytest.approx(4.096 + 5.12)
    for bad in ("chatty", "pp=1,pp=2", "pp=0,tg=0", "pp=-3"):
        with pytest.raises(ConfigError):
            Workload.parse(bad)


def test_hit_curve_prior_and_trace(tmp_path, model):
    """The prior passes through its published points; a uniform synthetic model is named as such; a trace's LRU
    rises with the cache's size."""
    assert LOCALITY.at(0.125) == pytest.approx(0.67) and LOCALITY.at(0.25) == pytest.approx(0.81)
    assert HitCurve.for_model(model).source.startswith("prior")
    uni = synth.cached_model(tmp_path, "tiny", seed=1, n_layer=4)
    assert HitCurve.for_model(uni).at(0.25) == pytest.approx(0.25)
    out = tmp_path / "t.npz"
    assert cli.main(["trace", str(model), "-n", "64", "-o", str(out), "--json"]) == 0
    curve = HitCurve.for_model(model, out)
    hits = [h for _, h in curve.points]
    assert curve.source.startswith("trace") and hits == sorted(hits) and hits[-1] > hits[1] > 0


def test_the_refill_curve_follows_the_simulator_and_the_prior(tmp_path, model):
    """EXPERT_REFILL=1's hit curve: from a trace, the simulator's counts after the same warm-up as LRU's (below LRU's
    where the slots are few: one miss a token goes in); the prior's own points (REFILL_PRIOR), and a curve without
    them LRU's times the prior's share of LRU; on uniform routing the
    same as LRU (any slots' content serves its share); the plan's JSON keeps it."""
    out = tmp_path / "t.npz"
    assert cli.main(["trace", str(model), "-n", "64", "-o", str(out), "--json"]) == 0
    curve = HitCurve.for_model(model, out)
    t = ExpertTrace.load(out)
    slots = capacity_of(0.25, t.n_expert)
    got = hybrid(t, slots, 0, refill=1, uncounted=default_warmup(t))
    assert curve.at(0.25, refill=True) == pytest.approx(got["hits"] / got["lookups"], abs=1e-4)
    assert all(curve.at(f, refill=True) <= curve.at(f) for f, _ in curve.points) and curve.at(0.25, refill=True) > 0
    assert HitCurve.from_dict(json.loads(json.dumps(curve.to_dict()))) == curve
    prior = HitCurve.for_model(model)
    assert prior.at(0.125, refill=True) == pytest.approx(0.6034) and prior.at(0.75, refill=True) < prior.at(0.75)
    assert LOCALITY.at(0.125, refill=True) == pytest.approx(0.6034) and LOCALITY.at(0.5, refill=True) == \
        pytest.approx(0.8634)   # (the prior's LRU without its refill points: the same)
    uniform = HitCurve.for_model(synth.cached_model(tmp_path, "tiny", seed=1, n_layer=4))
    assert uniform.at(0.25, refill=True) == uniform.at(0.25) == pytest.approx(0.25)


def test_the_refill_is_priced_as_one_h100_measured():
    """The refill's path in fit's model with one H100's costs from mmap (the decode probe on the 30B-A3B shape: the
    CPU path 0.806 ms a layer, a cached layer 0.087 ms; the host's copy into pinned memory 25.8 GB/s, the link 55.1):
    8 layers, 16 slots a layer at the hits measured (59.4%) predict the measured tokens within 5% (178.0 t/s with
    EXPERT_REFILL=1, upstream's CPU path 148.6: docs/results/mmap-refill-2026-12-07); the cache alone's staged
    misses (14.3 GB/s) take the CPU path there (the guard); the refill's bar lies below the hits it ran at."""
    h100 = DecodeCosts("h100-mmap", outside_s=0.163e-3, resident_s=0.070e-3, cpu_s=0.806e-3, cached_s=0.087e-3,
                       load_mode="mmap", miss_gbps=14.257)
    miss, link = 8 * 3 * 2048 * 768 * 34 / 32, 55.1
    refill_gbps = 1 / (1 / 25.8 + 1 / link)
    refill, path = h100.host_layer_s(0.594, miss, link, 16, 8, 100000, 1, refill_gbps)
    alone, alone_path = h100.host_layer_s(0.594, miss, link, 16, 8)
    assert path == "refill" and alone_path == "cpu"
    assert 1 / (h100.outside_s + 8 * refill) == pytest.approx(178.0, rel=0.05)
    assert 1 / (h100.outside_s + 8 * h100.cpu_s) == pytest.approx(148.6, rel=0.05)
    bar = h100.refill_break_even_hit(miss, refill_gbps, 8, 1)
    assert 0 < bar < 0.594
    assert h100.refill_layer_s(bar + 0.01, miss, refill_gbps, 8, 1) < h100.cpu_s < \
        h100.refill_layer_s(bar - 0.01, miss, refill_gbps, 8, 1)


def test_an_mmap_plan_takes_the_refill_where_it_gains(tmp_path_factory):
    """An mmap-ed model with one H100's shape of costs (scaled to a tiny model's experts: a token's misses staged
    into pinned memory cost 3.5 CPU layers, over the pinned link 0.9, the host's copy into pinned memory 1.9): the
    plan for decode keeps a cache with every miss on the host CPU and one a token into the slots (EXPERT_HYBRID=HYBRID_ALL_CPU,
    EXPERT_REFILL=1), names it in its text, and sets the guard in the shadow LRU's hits (the refill's bar times
    LRU's hits over the refill's). Uniform routing, a device no faster than the CPU, or pinned weights: no refill."""
    model = str(synth.cached_model(tmp_path_factory.mktemp("used8r"), "tiny", seed=1, n_layer=12, routing="locality",
                                   n_expert_used=8))

    def planned(curve=LOCALITY, load_mode="mmap", cpu_like=False) -> Plan:
        base = place(model, devices="vdev:1x12MiB@4GBps", ctx=CTX, timeout=120, expert_cache="auto")
        layout = layout_of(model, base.n_expert)
        gbps = lambda x: layout.n_used * layout.slot_bytes / (x * 0.806e-3) / 1e9
        costs = CPU_LIKE if cpu_like else DecodeCosts("h100-mmap", outside_s=0.163e-3, resident_s=0.070e-3,
                                                      cpu_s=0.806e-3, cached_s=0.087e-3, load_mode=load_mode,
                                                      miss_gbps=gbps(3.5) if load_mode == "mmap" else None)
        plan = Plan.from_dict(json.loads(json.dumps(base.to_dict())))
        plan.host_copy_gbps = gbps(1.9)
        for d in plan.devices:
            d.link = {"pinned_gbps": gbps(0.9), "pageable_gbps": gbps(3.5), "copy_bytes": 0}
        return plan_memory(plan, layout, {-1: costs}, curve, Workload.parse("tg=256"), lambda mib: place(
            model, devices="vdev:1x12MiB@4GBps", ctx=CTX, timeout=120, expert_cache=f"{mib}MiB"), load_mode)

    plan = planned()
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["refill"] == 1 and chosen["paths"] == ["refill"], plan.memory_plan["why"]
    assert plan.switches["EXPERT_REFILL"] == 1 and plan.switches["EXPERT_HYBRID"] == HYBRID_ALL_CPU
    assert "EXPERT_REFILL=1" in str(plan) and plan.memory_plan["hybrid_note"] == MMAP_REFILL_NOTE
    layout = layout_of(model, plan.n_expert)
    frac = min(d.cache_slots for d in plan.devices if d.host_expert_layers) / layout.n_expert   # (as placed)
    costs = DecodeCosts(**plan.memory_plan["costs"]["-1"])
    bar = costs.refill_break_even_hit(layout.n_used * layout.slot_bytes, _refill_links(plan, "mmap")[0], 8, 1)
    assert plan.cache_guard["break_even"]["pageable"][0] == pytest.approx(
        bar * LOCALITY.at(frac) / LOCALITY.at(frac, True), abs=1e-4)
    guard = plan.run_switches("mmap")["EXPERT_CACHE_MIN_HIT"]
    assert guard == percent(plan.cache_guard["break_even"]["pageable"][0]) >= percent(bar)
    for other in (planned(UNIFORM), planned(cpu_like=True), planned(load_mode="none")):
        assert "EXPERT_REFILL" not in other.switches and not any(a["refill"] for a in
                                                                   other.memory_plan["alternatives"])


def test_guard_keeps_a_slow_link_at_the_cpu_path():
    """A cached layer whose misses cost more than the CPU path (a slow pageable link) takes the CPU path: the cache
    never costs more than upstream's path; a fast link keeps the cache."""
    miss = 8 * 1.5e6   # (a token's 8 experts of 1.5 MB)
    slow, path = GPU_LIKE.host_layer_s(0.3, miss, 5.0, 16)
    assert path == "cpu" and slow == GPU_LIKE.cpu_s
    fast, path = GPU_LIKE.host_layer_s(0.67, miss, 55.0, 16)
    assert path == "cache" and fast < GPU_LIKE.cpu_s
    t, paths = token_seconds([GPU_LIKE], [DecodeShare(2, 10, 16, 0.3, miss, 5.0)])
    assert paths == ["cpu"] and t == pytest.approx(GPU_LIKE.outside_s + 2 * GPU_LIKE.resident_s + 10 * GPU_LIKE.cpu_s)


def test_under_pressure_the_cache_gets_memory_before_whole_layers(model, leftover):
    """GPU-like costs and locality routing: an alternative that moves resident layers to host RAM to give their
    memory to slots decodes faster than the leftover plan and than no cache, and is chosen; made for real, its plan
    has more host-expert layers and slots in each, and keeps every alternative in its JSON."""
    layout = layout_of(model, leftover.n_expert)
    alts = alternatives(_with_link(leftover, layout, GPU_LIKE, 0.4), layout, {-1: GPU_LIKE}, LOCALITY, CHAT)
    assert alts[0].name == "no cache" and alts[0].slots == 0
    moved = [a for a in alts if a.fits and a.slots and sum(a.host) > sum(leftover.host_expert_layers)]
    assert moved, [a.text() for a in alts]
    best = max(moved, key=lambda a: a.decode_ts)
    left = next((a for a in alts if a.name == "leftover"), alts[0])
    assert best.decode_ts > left.decode_ts and best.decode_ts > alts[0].decode_ts
    pick, why = choose(alts)
    assert alts[pick].slots > 0 and "x)" in why
    plan = plan_memory(_with_link(place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto"), layout,
                                  GPU_LIKE, 0.4), layout, {-1: GPU_LIKE}, LOCALITY, CHAT, _refit(model))
    chosen = alts[pick]
    assert plan.host_expert_layers[0] >= leftover.host_expert_layers[0] + (sum(chosen.host) > sum(leftover.host_expert_layers))
    assert plan.devices[0].cache_slots >= min(chosen.slots, layout.n_expert) * 0.9
    assert plan.switches["EXPERT_CACHE"] != 0 and plan.devices[0].expected_bytes <= plan.devices[0].target_bytes
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.memory_plan["chosen"] == pick and len(back.memory_plan["alternatives"]) == len(alts)
    text = str(plan)
    assert "memory: weighed for the workload chat" in text and text.count(" t/s") >= len(alts)


def test_unequal_devices_each_take_their_own_leftover(model):
    """Two VDEVs of unequal memory: the leftover alternative gives each device the most slots its own room allows (one
    value, the smaller room's, would waste the other's), is priced with each device's own hits, and where chosen the
    plan's switch is the per-device list with each device's slots."""
    spec = json.dumps({"kind": "vdev", "devices": [{"memory": "10MiB", "link_gbps": 4},
                                                   {"memory": "14MiB", "link_gbps": 4}]})
    start = place(model, devices=spec, ctx=CTX, timeout=120, expert_cache="auto")
    layout = layout_of(model, start.n_expert)
    plan = _with_link(start, layout, GPU_LIKE, 0.4)
    alts = alternatives(plan, layout, {-1: GPU_LIKE}, LOCALITY, Workload.parse("tg=64"))
    left = next(a for a in alts if a.name == "leftover")
    room = [d.target_bytes + d.cache_bytes - d.expected_bytes for d in plan.devices]
    own = [layout.most_slots(r, d.host_expert_layers) for r, d in zip(room, plan.devices)]
    assert left.device_slots == own and len(set(own)) > 1 and left.fits and left.slots == max(own)
    assert left.cache_bytes == [layout.bytes_of(n, d.host_expert_layers) for n, d in zip(own, plan.devices)]
    assert "/".join(map(str, own)) in left.text()
    out = plan_memory(plan, layout, {-1: GPU_LIKE}, LOCALITY, Workload.parse("tg=64"),
                      lambda mib: place(model, devices=spec, ctx=CTX, timeout=120, expert_cache=f"{mib}MiB"))
    assert out.memory_plan["chosen"] == alts.index(left), out.memory_plan["why"]   # (decode only: the most hits)
    assert out.switches["EXPERT_CACHE"] == ",".join(str(-n) for n in own)
    assert [d.cache_slots for d in out.devices] == own and out.memory_plan["placed"]["slots"] == own


def test_no_cache_where_it_cannot_pay(model, leftover):
    """A device no faster than the CPU, uniform routing with layers to give up, or a workload without decode: no
    cache, and the plan says why."""
    layout = layout_of(model, leftover.n_expert)
    alts = alternatives(leftover, layout, {-1: CPU_LIKE}, LOCALITY, CHAT)
    assert choose(alts)[0] == 0
    uni = alternatives(_with_link(leftover, layout, GPU_LIKE, 2.0), layout, {-1: GPU_LIKE}, UNIFORM, CHAT)
    pick, why = choose(uni)
    assert all(uni[pick].seconds <= a.seconds * (1 + GAIN_MIN) for a in uni if a.fits)
    assert not any(sum(a.host) > sum(leftover.host_expert_layers) for a in [uni[pick]]), why
    plan = _weigh(place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto"), model, SPEC, "prompt",
                  None, "none", 0, False, _refit(model))
    assert not plan.expert_cache and "decodes no token" in plan.memory_plan["why"]
    assert "EXPERT_CACHE" not in plan.switches


def test_prompt_cost_of_moved_layers_counts(model, leftover):
    """Moving layers' experts to host RAM costs prompts their bytes over the link: a prompt-heavy workload weighs it."""
    layout = layout_of(model, leftover.n_expert)
    long_prompt = Workload.parse("pp=16384,tg=8")
    alts = alternatives(_with_link(leftover, layout, GPU_LIKE, 0.4), layout, {-1: GPU_LIKE}, LOCALITY, long_prompt)
    moved = [a for a in alts if sum(a.host) > sum(leftover.host_expert_layers)]
    assert moved and all(a.prompt_extra_s > 0 for a in moved)
    assert all(a.prompt_extra_s == 0 for a in alts if sum(a.host) == sum(leftover.host_expert_layers))


def test_a_partial_layer_is_priced_once(model, leftover):
    """A layer upstream's overflow split (pyllama_pp.plan._host_layers: part of its FFN on the CPU, counted among the
    host-expert layers; or part on the next device, counted among the full layers) is priced once, where those counts
    put it: partial_layers changes neither the resident layers nor any alternative's time."""
    layout = layout_of(model, leftover.n_expert)
    base = _with_link(leftover, layout, GPU_LIKE, 0.4)
    split = Plan.from_dict(json.loads(json.dumps(base.to_dict())))
    split.devices[0].partial_layers += 1
    a, b = (alternatives(p, layout, {-1: GPU_LIKE}, LOCALITY, CHAT) for p in (base, split))
    assert [(x.name, x.resident, x.host, x.seconds) for x in a] == [(x.name, x.resident, x.host, x.seconds) for x in b]
    assert a[0].resident[0] == base.devices[0].full_layers


def test_guard_from_the_priced_costs(model, leftover):
    """Where the planner chooses a cache, the guard's bar is the break-even of the costs it priced with: a hit rate
    at the bar prices the cached layer as the CPU's. An mmap-ed model's misses come up through the staging slots: at
    the slower of the host's copy into them and the pinned link (a copy as fast as the link: the same bar as pinned
    memory's; a slower one raises it); where that copy was not measured, at the pageable link's rate."""
    layout = layout_of(model, leftover.n_expert)
    base = _with_link(place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto"), layout, GPU_LIKE, 0.4)
    for d in base.devices:
        d.link["pageable_gbps"] = d.link["pinned_gbps"] / 4
    plan = plan_memory(base, layout, {-1: GPU_LIKE}, LOCALITY, CHAT, _refit(model))
    assert plan.cache_guard["from"] == "decode probe"
    assert plan.switches["EXPERT_CACHE_MIN_HIT"] == plan.cache_guard["min_hit"]["none"]
    miss, link = layout.n_used * layout.slot_bytes, base.devices[0].link["pinned_gbps"]
    h = GPU_LIKE.break_even_hit(miss, link)
    assert GPU_LIKE.cached_layer_s(h, miss, link) == pytest.approx(GPU_LIKE.cpu_s)
    bars = {}
    for copy in (None, link, link / 3):   # (the plan made again measured its own links)
        base.host_copy_gbps = copy
        bars[copy] = cost_guard(base, layout, {-1: GPU_LIKE})["min_hit"]
    assert bars[link]["mmap"] == bars[link]["none"] >= 1
    assert bars[None]["mmap"] > bars[link / 3]["mmap"] > bars[link]["mmap"]   # (pageable: a quarter of the link)


@pytest.mark.measured_decode
def test_the_decode_probe_measures_each_path_once(model, tmp_path, monkeypatch):
    """The probe runs the replicas on each path (resident, host CPU, slots) and keeps the result: every cost is a
    time (never negative: on a tiny model the replicas' difference can be within the noise), and a second call reads
    it back without a worker."""
    from pyllama_pp import decode_probe, worker
    monkeypatch.setenv("PYLLAMA_PP_CACHE", str(tmp_path))
    costs = decode_probe.decode_costs(model, "vdev:1x0@4GBps", n_threads=1, reps=1)
    c = costs[-1] if -1 in costs else costs[0]
    assert min(c.outside_s, c.resident_s, c.cpu_s, c.cached_s) >= 0 and c.outside_s + c.resident_s > 0
    assert c.threads == 1
    assert c.load_mode == "none"
    assert c.miss_gbps is None or c.miss_gbps > 0   # (None: the fewest slots added no time here, within the noise)
    monkeypatch.setattr(decode_probe, "run_job", lambda *a, **k: pytest.fail("measured again"))
    assert decode_probe.decode_costs(model, "vdev:1x0@4GBps", n_threads=1, reps=1) == costs


def test_a_measured_miss_rate_below_the_links_prices_the_misses():
    """An mmap-ed model's misses are copied into pinned staging before the link takes them: where the probe measured
    them slower than the link (miss_gbps), a miss costs that, the break-even hit rate rises and the plan's decode
    with a cache slows (on one H100, 16 slots a layer from an mmap-ed model: predicted 204 t/s at the link's 55 GB/s,
    measured 70 against the CPU path's 128; the misses went up at about 13 GB/s)."""
    from dataclasses import replace
    miss, link = 40e6, 55.0
    staged = replace(GPU_LIKE, miss_gbps=13.0)
    assert staged.miss_rate(link) == 13.0 and GPU_LIKE.miss_rate(link) == link
    assert replace(GPU_LIKE, miss_gbps=80.0).miss_rate(link) == link              # (the link bounds a fast copy)
    assert staged.cached_layer_s(0.66, miss, link) == pytest.approx(8e-5 + 0.34 * miss / 13e9)
    assert staged.break_even_hit(miss, link) > GPU_LIKE.break_even_hit(miss, link)
    assert staged.hybrid_pct(miss, link) > GPU_LIKE.hybrid_pct(miss, link)        # (the CPU's share grows)
    share = DecodeShare(0, 14, slots=16, hit=0.66, miss_bytes=miss, link_gbps=link)
    fast, staged_s = token_seconds([GPU_LIKE], [share])[0], token_seconds([staged], [share])[0]
    assert staged_s > fast


def test_the_decode_probe_prices_a_miss_from_its_counters(monkeypatch):
    """The fewest slots' run against the hits' run: the seconds a token added over the bytes its misses copied (the
    counters are over the timed reps); nothing added or nothing moved: no rate (the link's counts)."""
    from pyllama_pp import decode_probe
    runs = []

    def fake(model, spec, path, n_layers, n_expert, n_threads, load_mode, reps, timeout, slots=None):
        runs.append((path, n_layers, slots))
        per_token = 0.010 if slots else 0.002
        moved = 3 * decode_probe.DECODE_TOKENS * 80e6 if slots else 0
        return {"seconds": [per_token * decode_probe.DECODE_TOKENS] * 3,
                "ext": {"backends": [{"name": "CUDA0", "cache_bytes": moved}, {"name": "CPU", "cache_bytes": 1}]}}
    monkeypatch.setattr(decode_probe, "_run", fake)
    rate = decode_probe._miss_gbps("m", "cuda:0", 10, 128, 8, 16, "mmap", 3, 60, cached_s=0.002)
    assert rate == pytest.approx(80e6 / 0.008 / 1e9, rel=1e-3) and runs == [("cached", 10, 8)]
    assert decode_probe._miss_gbps("m", "cuda:0", 10, 128, 8, 16, "mmap", 3, 60, cached_s=0.011) is None


def test_ubatch_auto_weighs_the_memory_at_its_chosen_pair(model, monkeypatch):
    """-ub auto then the memory planner: with GPU-like costs and a slow link's prompts left aside (decode only), the
    plan made again for the cache keeps the pair -ub auto chose, holds more host-expert layers with slots in each,
    and drops the prompt prediction of the placement it left (its alternatives say what prompts pay)."""
    fit_module = sys.modules["pyllama_pp.fit"]
    monkeypatch.setattr(fit_module, "decode_costs", lambda m, d, **kw: {-1: GPU_LIKE})
    base = fit_module.fit_ubatch(model, devices=SPEC, ctx=ContextParams(n_ctx=512), n_tokens=256, timeout=120,
                                 candidates=(64, 128), count_compute=False, expert_cache=0, workload="decode")
    plan = fit_module.fit_ubatch(model, devices=SPEC, ctx=ContextParams(n_ctx=512), n_tokens=256, timeout=120,
                                 candidates=(64, 128), count_compute=False, workload="decode")
    m = plan.memory_plan
    assert m["alternatives"][m["chosen"]]["slots"] > 0 and plan.devices[0].cache_slots > 0, m["why"]
    assert (plan.ctx["n_batch"], plan.ctx["n_ubatch"]) == (base.ctx["n_batch"], base.ctx["n_ubatch"])
    moved = sum(plan.host_expert_layers) > sum(base.host_expert_layers)
    assert (plan.predicted_ts is None) == moved
    assert [r["n_ubatch"] for r in plan.ubatch_auto] == [r["n_ubatch"] for r in base.ubatch_auto]


def test_a_choice_fit_places_otherwise_is_priced_again(model, leftover):
    """Where fit places the chosen cache with fewer slots than priced, what it placed is priced again; where that
    no longer saves GAIN_MIN (here: a refit that places no slot at all), the plan keeps no cache and says why."""
    layout = layout_of(model, leftover.n_expert)
    base = _with_link(place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto"), layout, GPU_LIKE, 0.4)
    alts = alternatives(base, layout, {-1: GPU_LIKE}, LOCALITY, CHAT)
    pick = choose(alts)[0]
    assert alts[pick].slots and sum(alts[pick].host) > sum(base.host_expert_layers)   # (a choice that moves layers)
    no_slots = lambda mib: place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=0)
    plan = plan_memory(base, layout, {-1: GPU_LIKE}, LOCALITY, CHAT, no_slots)
    assert not plan.expert_cache and "EXPERT_CACHE" not in plan.switches and "EXPERT_CACHE_MIN_HIT" not in plan.switches
    assert plan.memory_plan["chosen"] == 0 and "no longer" in plan.memory_plan["why"], plan.memory_plan["why"]


def test_a_choice_fit_finds_no_room_for_keeps_no_cache(model, leftover):
    """Where the chosen alternative's placement has no room after all (fit reserves its size and then leaves a layer
    on the CPU: placement.fit names that a ConfigError of the size), the next fastest is taken instead (none that
    reserves as much or more for its slots: not tried), down to the ones that move no layer (no cache here), and the
    plan says why for each refused, instead of failing the whole fit."""
    layout = layout_of(model, leftover.n_expert)
    start = _with_link(place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="auto"), layout, GPU_LIKE, 0.4)
    short = lambda mib: place(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=f"{mib + 8}MiB")  # noqa: E731
    with pytest.raises(ConfigError, match="no room for the model beside it"):
        short(1)
    plan = plan_memory(start, layout, {-1: GPU_LIKE}, LOCALITY, CHAT, short)
    chosen = plan.memory_plan["alternatives"][choose([Alternative(**a) for a in plan.memory_plan["alternatives"]])[0]]
    assert chosen["host"] != plan.memory_plan["alternatives"][0]["host"], chosen   # (it moves layers: placed again)
    alts = plan.memory_plan["alternatives"]
    refused = [a for a in alts if f"{a['name']} has no placement" in plan.memory_plan["why"]]
    assert "EXPERT_CACHE" not in plan.switches and plan.memory_plan["chosen"] == 0
    assert plan.memory_plan["why"].startswith(f"{chosen['name']} has no placement (--expert-cache"), plan.memory_plan
    assert "; no cache" in plan.memory_plan["why"], plan.memory_plan["why"]
    # (every alternative that moves layers was refused, or reserves at least what a refused one did: not tried)
    assert all(a in refused or max(a["cache_bytes"]) >= min(max(r["cache_bytes"]) for r in refused)
               for a in alts if a["host"] != alts[0]["host"] and a["fits"]), (refused, alts)


def test_an_alternative_fit_cannot_place_gives_way_to_the_next(model, leftover):
    """Where upstream's fit cannot place the fastest alternative (the room the planner counts from whole layers is not
    there: fit lowers the GPU layers instead), the next fastest that it places is taken: on the 9 MiB VDEV, 8 slots
    a layer (every layer's experts to host) has no placement and 4 slots a layer has."""
    layout = layout_of(model, leftover.n_expert)
    start = _with_link(leftover, layout, GPU_LIKE, 0.4)
    alts = alternatives(start, layout, {-1: GPU_LIKE}, LOCALITY, Workload.parse("decode"))
    first = alts[choose(alts)[0]]
    calls = []
    refit = lambda mib: calls.append(mib) or _refit(model)(mib)   # noqa: E731
    plan = plan_memory(start, layout, {-1: GPU_LIKE}, LOCALITY, Workload.parse("decode"), refit)
    taken = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert plan.memory_plan["why"].startswith(f"{first.name} has no placement"), plan.memory_plan["why"]
    assert taken["slots"] and taken["name"] != first.name and plan.switches.get("EXPERT_CACHE"), plan.memory_plan
    assert len(calls) == 2 and calls[1] < calls[0], calls   # (the refused size, then a smaller one it placed)


def test_ab_on_one_shared_plan_says_when_the_cache_moved_layers(model, monkeypatch):
    """`ab --fit same` runs the baseline on the patched plan: where that plan moved expert layers to host RAM for cache
    slots, the run's notes say the baseline's placement is not its best and how to get it (--fit each)."""
    monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "decode_costs", lambda m, d, **kw: {-1: GPU_LIKE})
    layout = layout_of(model, 64)   # (the tiny preset's experts: links at which a token's misses cost 0.4 x the CPU's)
    gbps = layout.n_used * layout.slot_bytes / (0.4 * GPU_LIKE.cpu_s) / 1e9
    monkeypatch.setattr(sys.modules["pyllama_pp.memory_plan"], "_links", lambda plan, mode: [gbps] * len(plan.devices))
    shared = plan_runs(Choices(model=model, devices=(SPEC,), fit="same", pp=(), tg=(16,)))
    assert any("--fit each" in n for n in shared.notes), shared.notes
    each = plan_runs(Choices(model=model, devices=(SPEC,), fit="each", pp=(), tg=(16,)))
    assert not any("--fit each" in n for n in each.notes)


def test_a_bad_trace_is_refused_before_any_run(model, tmp_path, no_worker):
    """fit --trace with a file that is not a trace, a trace of another model's experts, or one with no decoded token
    after its warm-up: a ConfigError that says what and how to fix, before any dry run or probe."""
    from pyllama_pp.expert_trace import ExpertTrace
    fit_module = sys.modules["pyllama_pp.fit"]
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a trace")
    ids = np.zeros((8, 12, 2), dtype=np.int32)
    other, prompt_only = tmp_path / "other.npz", tmp_path / "prompt.npz"
    ExpertTrace(ids, np.arange(12), n_expert=32).save(other)
    ExpertTrace(ids, np.arange(12), n_expert=64, n_prompt=8).save(prompt_only)
    for path, words in ((bad, "not an expert trace"), (other, "32 experts a layer"), (prompt_only, "no decoded")):
        with pytest.raises(ConfigError, match=words) as e:
            fit_module.fit(model, devices=SPEC, ctx=CTX, trace=path)
        assert "Fix:" in str(e.value)


def test_the_hybrid_is_priced_and_taken_where_it_gains():
    """EXPERT_HYBRID in fit's model: no misses (every hit) costs the slots alone; with the rates of one H100 (the
    30B-A3B shape, 16 MoE layers) the split predicts the gain measured at 16 slots a layer (1.113x the cache alone,
    paired) within its interval and none worth the switch at 32 (1.008x), as measured; the split's value is the CPU's
    rate over the link's."""
    h100 = DecodeCosts("h100", outside_s=0.185e-3, resident_s=0.068e-3, cpu_s=0.508e-3, cached_s=0.087e-3)
    miss, link = 8 * 5.0e6, 53.3
    n = h100.hybrid_pct(miss, link)
    assert n == round(100 * (miss / h100.cpu_s) / (link * 1e9))
    assert h100.hybrid_layer_s(1.0, miss, link, 8, n) == pytest.approx(h100.cached_s)
    gains = {}
    for hit, token_s in ((0.667, 7.0e-3), (0.80, 5.04e-3)):   # (the cache alone's measured token at that hit rate)
        saved = h100.cached_layer_s(hit, miss, link) - h100.hybrid_layer_s(hit, miss, link, 8, n)
        gains[hit] = token_s / (token_s - 16 * saved)
    assert 1.044 <= gains[0.667] <= 1.182 and gains[0.80] < 1 + GAIN_MIN
    t, paths = token_seconds([h100], [DecodeShare(0, 16, 16, 0.667, miss, link, 8, n)])
    assert paths == ["hybrid"] and t < token_seconds([h100], [DecodeShare(0, 16, 16, 0.667, miss, link, 8)])[0]


def test_a_plan_splits_the_misses_where_the_hybrid_gains(tmp_path_factory):
    """GPU-like costs, eight experts a token and a link at which a token's misses cost 1.5 times the CPU path's
    layer (the host CPU reads experts 1.5 times as fast as the link moves them, as on one H100): 8 slots a layer
    (67% hits) take EXPERT_HYBRID, 16 (81%) do not (it predicts less than GAIN_MIN there, as measured at 25% on the
    H100); where the 8 slots are chosen the plan sets the switch and says so. With a link as fast as the CPU no
    alternative takes it; on a device no faster than the CPU: no cache, no hybrid."""
    model = str(synth.cached_model(tmp_path_factory.mktemp("used8"), "tiny", seed=1, n_layer=12, routing="locality",
                                   n_expert_used=8))

    def planned(spec: str, miss_over_cpu: float, costs=GPU_LIKE, load_mode: str = "none") -> Plan:
        base = place(model, devices=spec, ctx=CTX, timeout=120, expert_cache="auto")
        layout = layout_of(model, base.n_expert)
        assert layout.n_used == 8
        return plan_memory(_with_link(base, layout, costs, miss_over_cpu), layout, {-1: costs}, LOCALITY, CHAT,
                           lambda mib: place(model, devices=spec, ctx=CTX, timeout=120, expert_cache=f"{mib}MiB"),
                           load_mode)
    roomy = {a["slots"]: a for a in planned("vdev:1x14MiB@4GBps", 1.5).memory_plan["alternatives"]}
    assert roomy[8]["hybrid"] == 150 and roomy[8]["paths"] == ["hybrid"]
    assert roomy[16]["hybrid"] == 0 and roomy[16]["paths"] == ["cache"]
    plan = planned("vdev:1x12MiB@4GBps", 1.5)
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["slots"] == 8 and plan.switches["EXPERT_HYBRID"] == chosen["hybrid"] == 150
    assert "EXPERT_HYBRID=150" in str(plan)
    # (the guard's bar is the hybrid path's break-even, below the cache alone's: the layers keep the priced path)
    alone = 1 - (GPU_LIKE.cpu_s - GPU_LIKE.cached_s) / (1.5 * GPU_LIKE.cpu_s)   # (a token's misses: 1.5 CPU layers)
    assert plan.switches["EXPERT_CACHE_MIN_HIT"] < round(100 * alone) and \
        plan.switches["EXPERT_CACHE_MIN_HIT"] <= round(100 * chosen["hit"])
    # (an mmap-ed model's slots are priced on the refill's path alone - every miss on the CPU, one a token into the
    # slots, cheaper here than the CPU path - never on the split, and the plan says why)
    mapped = planned("vdev:1x12MiB@4GBps", 1.5, load_mode="mmap")
    cached = [a for a in mapped.memory_plan["alternatives"] if a["slots"]]
    assert cached and all(a["paths"] == ["refill"] and a["refill"] == 1 and a["hybrid"] == HYBRID_ALL_CPU
                          for a in cached), [a["paths"] for a in cached]
    assert mapped.memory_plan["hybrid_note"] == MMAP_REFILL_NOTE
    fast = planned("vdev:1x12MiB@4GBps", 0.4)
    assert not any(a["hybrid"] for a in fast.memory_plan["alternatives"]) and "EXPERT_HYBRID" not in fast.switches
    none = planned("vdev:1x12MiB@4GBps", 1.5, CPU_LIKE)
    assert "EXPERT_HYBRID" not in none.switches and "EXPERT_CACHE" not in none.switches


def test_the_guard_keeps_the_layers_the_hybrid_makes_faster():
    """An H100's decode probe on an mmap-ed model (16-layer 30B-A3B preset: a miss staged at 14.3 GB/s, the CPU
    path 0.81 ms a layer): 16 slots a layer hit 67%, below the cache alone's break-even (75%): a guard at that bar
    sent every layer to the CPU path and the plan, priced with the misses split (EXPERT_HYBRID), lost 0.83x. With
    the split the cached path beats the CPU path from a lower hit rate, and that is the bar."""
    h100 = DecodeCosts("h100-mmap", outside_s=0.163e-3, resident_s=0.070e-3, cpu_s=0.806e-3, cached_s=0.087e-3,
                       miss_gbps=14.257)
    miss, link = 8 * 641.73e6 / 128, 55.5
    alone = h100.break_even_hit(miss, link)
    n = h100.hybrid_pct(miss, link)
    split = h100.hybrid_break_even_hit(miss, link, 8, n)
    assert split < 0.667 < alone
    assert h100.hybrid_layer_s(split + 0.01, miss, link, 8, n) < h100.cpu_s < h100.hybrid_layer_s(split - 0.01, miss,
                                                                                                  link, 8, n)
    assert h100.hybrid_break_even_hit(miss, link, 8, 0) == alone


# --- run / ab without a fit: the cache planned on the user's placement ------------------------------------------

def _gpu_like(monkeypatch, layout) -> None:
    """GPU-like decode costs and links at which a token's misses cost 0.4 x the CPU path's layer (an H100's)."""
    monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "decode_costs", lambda m, d, **kw: {-1: GPU_LIKE})
    gbps = layout.n_used * layout.slot_bytes / (0.4 * GPU_LIKE.cpu_s) / 1e9
    monkeypatch.setattr(sys.modules["pyllama_pp.memory_plan"], "_links", lambda plan, mode: [gbps] * len(plan.devices))


def test_without_a_fit_the_cache_is_planned_on_the_users_placement(model, monkeypatch):
    """ab without --fit, every expert in host RAM (the user's placement), GPU-like costs: the patched config gets
    EXPERT_CACHE in slots a layer that fit the room the placement's dry run leaves on the device, and its guard; the
    placement is not changed (no plan places it, every layer's experts stay in host RAM); the notes name the choice;
    the baseline gets no switch. --expert-cache auto (refused without --fit before) plans the same."""
    layout = layout_of(model, 64)
    _gpu_like(monkeypatch, layout)
    planned = plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,)))
    (cfg,), (plan,) = planned.configs, planned.plans
    slots = -cfg.switches["EXPERT_CACHE"]
    d = plan.devices[0]
    assert slots >= layout.n_used and plan.host_expert_layers == [12] and cfg.plans == {}
    assert layout.bytes_of(slots, 12) <= d.free_bytes - plan.margins[0] + d.cache_bytes - d.expected_bytes
    assert cfg.switches["EXPERT_CACHE_MIN_HIT"] == plan.cache_guard["min_hit"]["none"]
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["slots"] == slots and all(a["host"] == [12] for a in plan.memory_plan["alternatives"])
    assert any("without a fit" in n and chosen["name"] in n and "x)" in n for n in planned.notes), planned.notes
    assert cfg.notes and cfg.job("baseline").switches == {}
    argv = ["ab", model, "--devices", SPEC, "--expert-cache", "auto", "-p", "0", "-n", "16"]
    auto = plan_runs(cli.choices_from_args(cli.build_parser().parse_args(argv)))
    assert auto.configs[0].switches == cfg.switches


def test_without_a_fit_an_mmap_ed_model_runs_the_refill_it_was_priced_on(model, monkeypatch):
    """ab without --fit on an mmap-ed model, GPU-like costs: the slots are priced on the refill's path and the run
    gets every switch of it (EXPERT_CACHE, its guard, EXPERT_HYBRID=HYBRID_ALL_CPU and EXPERT_REFILL=1: the cache's
    switches, CACHE_SWITCHES); with the user's EXPERT_REFILL=0 the slots are priced with the cache alone and the
    run keeps the user's value, with no split planned."""
    _gpu_like(monkeypatch, layout_of(model, 64))
    planned = plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,), load_mode="mmap"))
    (cfg,), (plan,) = planned.configs, planned.plans
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["refill"] == 1 and chosen["paths"] == ["refill"], plan.memory_plan["why"]
    assert {k: cfg.switches.get(k) for k in CACHE_SWITCHES} == {k: plan.run_switches("mmap").get(k)
                                                               for k in CACHE_SWITCHES}
    assert cfg.switches["EXPERT_REFILL"] == 1 and cfg.switches["EXPERT_HYBRID"] == HYBRID_ALL_CPU
    off = plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,), load_mode="mmap",
                            switches={"EXPERT_REFILL": 0}))
    (cfg0,), (plan0,) = off.configs, off.plans
    assert not any(a["refill"] for a in plan0.memory_plan["alternatives"])
    assert plan0.memory_plan["hybrid_note"] == MMAP_HYBRID_NOTE
    assert cfg0.switches["EXPERT_REFILL"] == 0 and not cfg0.switches.get("EXPERT_HYBRID")
    assert "EXPERT_REFILL" not in drop_cache(plan).switches


def test_without_a_fit_no_cache_where_none_pays_and_the_rows_say_why(model, capsys):
    """run without --fit on a device no faster than the host CPU (the tests' stated costs: a VDEV): no cache is set,
    and the run's notes and its rows' say why."""
    assert cli.main(["run", model, "--devices", SPEC, "-p", "0", "-n", "4", "-r", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (note,) = [n for n in doc["notes"] if n.startswith("expert cache")]
    assert "no cache: none predicts the workload faster" in note, note
    assert doc["rows"][0]["switches"].get("EXPERT_CACHE", 0) == 0 and note in doc["rows"][0]["notes"]


def test_without_a_fit_a_cache_the_user_set_is_not_planned(model, monkeypatch):
    """--expert-cache 0, a size, or --switch EXPERT_CACHE without --fit: nothing planned (no dry run, no probe), the
    switch as given; a prompt-only run plans nothing either (its prompt one ubatch: no LAYER_MAJOR to plan), and says
    why where the cache was asked (auto) - not where it is only the default (no news on every prompt run)."""
    monkeypatch.setattr(sys.modules["pyllama_pp.planning"], "plan_on_placement",
                        lambda *a, **k: pytest.fail("planned a cache the user set"))
    for kw, switch in ((dict(expert_cache="0"), None), (dict(expert_cache="2MiB"), 2),
                       (dict(switches={"EXPERT_CACHE": -4}), -4)):
        planned = plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,), **kw))
        assert planned.plans == () and planned.configs[0].switches.get("EXPERT_CACHE") == switch
        assert not any("planned on this placement" in n for n in planned.notes)
    prompt = plan_runs(Choices(command="run", model=model, devices=(SPEC,), pp=(64,), tg=(), n_ubatch=(64,)))
    assert prompt.plans == () and "EXPERT_CACHE" not in prompt.configs[0].switches
    assert not any("expert cache" in n for n in prompt.notes), prompt.notes
    prompt = plan_runs(Choices(command="run", model=model, devices=(SPEC,), pp=(64,), tg=(), n_ubatch=(64,),
                               expert_cache="auto"))
    assert prompt.plans == () and "EXPERT_CACHE" not in prompt.configs[0].switches
    assert any("no cache: the workload decodes no token" in n for n in prompt.notes), prompt.notes


def test_a_cache_set_by_hand_on_an_mmap_ed_model_says_nothing_plans_it(model, monkeypatch):
    """--expert-cache SIZE (or the switch) with --load-mode mmap: nothing is planned for the cache, its guard
    included, and a staged miss can cost more than upstream's CPU path: the notes say so and name auto; not for
    pinned weights, auto, or 0."""
    monkeypatch.setattr(sys.modules["pyllama_pp.planning"], "plan_on_placement",
                        lambda *a, **k: pytest.fail("planned a cache the user set"))
    said = lambda **kw: [n for n in plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,), **kw)).notes
                         if "set by hand on an mmap-ed model" in n]   # noqa: E731
    assert len(said(expert_cache="2MiB", load_mode="mmap")) == 1
    assert "--expert-cache auto" in said(expert_cache="2MiB", load_mode="mmap")[0]
    assert len(said(switches={"EXPERT_CACHE": -4}, load_mode="mmap")) == 1
    assert said(expert_cache="2MiB") == said(expert_cache="0", load_mode="mmap") == []


def test_a_cache_set_by_hand_on_an_mmap_ed_model_runs_its_misses_on_the_cpu(model, monkeypatch):
    """A staged miss costs the host more than computing it from the page cache: a hand-set cache on an mmap-ed model
    runs with every decoded miss on the host CPU and one a token refilled after it (planning.MMAP_REFILL), and the
    note says so with the off-switch; where the user set EXPERT_HYBRID or EXPERT_REFILL, theirs stand and nothing is
    added; pinned weights and auto get none."""
    monkeypatch.setattr(sys.modules["pyllama_pp.planning"], "plan_on_placement",
                        lambda *a, **k: pytest.fail("planned a cache the user set"))
    run = lambda **kw: plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(16,), **kw))   # noqa: E731
    mmap = run(expert_cache="2MiB", load_mode="mmap")
    assert {k: mmap.configs[0].switches.get(k) for k in MMAP_REFILL} == MMAP_REFILL == {"EXPERT_HYBRID": 100000,
                                                                                        "EXPERT_REFILL": 1}
    assert any("EXPERT_REFILL=1" in n and "--switch EXPERT_REFILL=0" in n for n in mmap.notes), mmap.notes
    theirs = run(expert_cache="2MiB", load_mode="mmap", switches={"EXPERT_REFILL": 0})
    assert theirs.configs[0].switches == {"EXPERT_CACHE": 2, "EXPERT_REFILL": 0}
    assert not any("EXPERT_REFILL=1" in n for n in theirs.notes)
    for kw in (dict(expert_cache="2MiB"), dict(expert_cache="0", load_mode="mmap")):
        assert "EXPERT_REFILL" not in run(**kw).configs[0].switches


def test_with_a_fit_a_hand_set_mmap_cache_runs_its_misses_on_the_cpu_too(model):
    """--fit with a size on an mmap-ed model: fit keeps the slots' room and the run takes MMAP_REFILL's switches, said
    in a note, with the guard at its default (fit's bar is priced for staged misses); auto is fit's to plan."""
    run = lambda **kw: plan_runs(Choices(model=model, devices=(SPEC,), fit="same", pp=(), tg=(16,),   # noqa: E731
                                         load_mode="mmap", **kw))
    sized = run(expert_cache="2MiB")
    assert {k: sized.configs[0].switches.get(k) for k in MMAP_REFILL} == MMAP_REFILL
    # (fit's guard, priced for the cache alone's staged misses, is left to its default)
    assert "EXPERT_CACHE_MIN_HIT" not in sized.configs[0].switches
    assert any("fit keeps its room" in n and "EXPERT_REFILL=1" in n for n in sized.notes), sized.notes
    assert "EXPERT_REFILL" not in run(expert_cache="auto").configs[0].switches


# --- unequal devices: each its own guard and split ----------------------------------------------------------------

def _with_links(plan: Plan, layout, costs: DecodeCosts, miss_over_cpu) -> Plan:
    """A copy of the plan whose devices' links make a token's misses at one layer cost `miss_over_cpu[i]` times the CPU
    path's layer on device i."""
    out = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    for d, r in zip(out.devices, miss_over_cpu):
        gbps = layout.n_used * layout.slot_bytes / (r * costs.cpu_s) / 1e9
        d.link = {"pinned_gbps": gbps, "pageable_gbps": gbps, "copy_bytes": 0}
    return out


def _two(model, mib: int, links=(8, 0.2)):
    """fit's plan with the cache as auto on two VDEVs of `mib` MiB each, the second with the slower link."""
    spec = json.dumps({"kind": "vdev", "devices": [{"memory": f"{mib}MiB", "link_gbps": g} for g in links]})
    refit = lambda m: place(model, devices=spec, ctx=CTX, timeout=120, expert_cache=f"{m}MiB")   # noqa: E731
    return place(model, devices=spec, ctx=CTX, timeout=120, expert_cache="auto"), refit


def test_unequal_links_give_each_device_its_own_guard(model):
    """Two VDEVs whose links differ (a token's misses cost 0.4 and 3 times the CPU path's layer): each is priced with
    its own link, so the planned guard is each device's own break-even - the fast one's cache stays on at the hit rate
    the plan predicts while the slow one's layers go to the CPU path; one bar (the largest, as before) would have sent
    the fast device's layers to the CPU too. The plan names each device's bar, its JSON keeps the list, `run --plan`
    replays it; equal links give one value, as before."""
    start, refit = _two(model, 8)
    layout = layout_of(model, start.n_expert)
    plan = plan_memory(_with_links(start, layout, GPU_LIKE, (0.4, 3.0)), layout, {-1: GPU_LIKE}, LOCALITY, CHAT, refit)
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["slots"] and all(d.cache_slots for d in plan.devices), plan.memory_plan["why"]
    assert chosen["paths"] == ["cache", "cpu"] and not chosen["hybrid"], chosen
    miss, links = layout.n_used * layout.slot_bytes, [d.link["pinned_gbps"] for d in plan.devices]
    bars = [percent(GPU_LIKE.break_even_hit(miss, ln)) for ln in links]
    fast, slow = bars
    assert plan.switches["EXPERT_CACHE_MIN_HIT"] == f"{fast},{slow}" == plan.cache_guard["min_hit"]["none"]
    assert fast < chosen["hit"] * 100 < slow   # (the fast device keeps its slots, the slow one's layers leave)
    assert f"EXPERT_CACHE_MIN_HIT={fast},{slow}" in str(plan) and f"VDEV1 {slow}%" in str(plan)
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back.run_switches("none") == plan.run_switches("none") and \
        back.run_switches("none")["EXPERT_CACHE_MIN_HIT"] == f"{fast},{slow}"
    same = plan_memory(_with_links(start, layout, GPU_LIKE, (0.4, 0.4)), layout, {-1: GPU_LIKE}, LOCALITY, CHAT, refit)
    assert isinstance(same.switches["EXPERT_CACHE_MIN_HIT"], int)


def test_unequal_links_give_each_device_its_own_split(model):
    """The same devices with room for more slots: the slow link's misses split with the host CPU (its CPU reads experts
    three times as fast as that link moves them: EXPERT_HYBRID 300 there) while the fast link's do not gain from it (0:
    every miss over its link); the plan names each device's split. An RPC device's split would run on its server's
    CPU, whose rate the decode probe does not measure: its entry stays 0 and the plan says why, unless that rate is
    given."""
    start, refit = _two(model, 7)
    layout = layout_of(model, start.n_expert)
    base = _with_links(start, layout, GPU_LIKE, (0.4, 3.0))
    plan = plan_memory(base, layout, {-1: GPU_LIKE}, LOCALITY, CHAT, refit)
    chosen = plan.memory_plan["alternatives"][plan.memory_plan["chosen"]]
    assert chosen["paths"] == ["cache", "hybrid"] and plan.switches["EXPERT_HYBRID"] == chosen["hybrid"] == "0,300"
    assert "EXPERT_HYBRID=0,300" in str(plan) and "VDEV1 300% of its link's" in str(plan)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).run_switches("none")["EXPERT_HYBRID"] == "0,300"
    served = Plan.from_dict(json.loads(json.dumps(base.to_dict())))
    served.devices[1].server = "10.0.0.2:50052"
    remote = plan_memory(served, layout, {-1: GPU_LIKE}, LOCALITY, CHAT, refit)
    assert not remote.switches.get("EXPERT_HYBRID") and "VDEV1: an RPC device's misses would split with its server's own CPU" \
        in remote.memory_plan["hybrid_note"] and remote.memory_plan["hybrid_note"] in str(remote)
    known = {-1: GPU_LIKE, 1: dataclasses.replace(GPU_LIKE, hybrid_cpu_s=GPU_LIKE.cpu_s)}
    assert plan_memory(served, layout, known, LOCALITY, CHAT, refit).switches["EXPERT_HYBRID"] == "0,300"


# --- run / ab without a fit: LAYER_MAJOR planned on the user's placement --------------------------------------------
# prompts of two batches of four ubatches (every expert in host RAM: the runs' default placement)
GROUPS = dict(n_batch=(128,), n_ubatch=(32,), pp=(256,), tg=())
GROUPS_ARGS = ["-b", "128", "-ub", "32", "-p", "256", "-n", "0", "-r", "1"]


def _layer_major_note(notes) -> str:
    (note,) = [n for n in notes if n.startswith("layer major")]
    return note


def test_without_a_fit_layer_major_is_on_where_the_groups_fit(model, capsys):
    """ab without --fit, the device with room for a group's buffers beside the placement: the patched config gets
    LAYER_MAJOR=1 from a dry run of the same placement with it (within the device's target, no layer moved), its notes
    and the plan name the group; the patched rows count the groups the runs formed and carry the note, the baseline's
    have no switch; its logits are the baseline's. A depth (-d) is a prompt too."""
    planned = plan_runs(Choices(model=model, devices=(SPEC,), **GROUPS))
    (cfg,), (plan,) = planned.configs, planned.plans
    assert cfg.switches == {"LAYER_MAJOR": 1} and cfg.plans == {} and cfg.job("baseline").switches == {}
    assert plan.host_expert_layers == [12] and plan.layer_major["group"] == 4 and plan.layer_major["bytes"][0] > 0
    assert all(d.expected_bytes <= d.target_bytes for d in plan.devices)
    note = _layer_major_note(planned.notes)
    assert "LAYER_MAJOR=1 (on: " in note and "groups of 4 ubatches (n_batch 128 / n_ubatch 32)" in note, note
    assert note in cfg.notes and "groups of 4 ubatches" in str(plan)
    assert cli.main(["ab", model, "--devices", SPEC, *GROUPS_ARGS, "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["patched"]["layer_major_groups"] == 2 and rows["patched"]["switches"]["LAYER_MAJOR"] == 1, rows
    assert note in rows["patched"]["notes"]
    assert rows["baseline"]["layer_major_groups"] is None and not rows["baseline"]["switches"], rows["baseline"]
    from pyllama_pp.check import check_logits
    got = check_logits(model, devices=SPEC, placement=cfg.placement, ctx=cfg.context(), switches=cfg.switches,
                       n_tokens=256)
    assert got.ok and got.nmse <= 1e-6, got
    depth = plan_runs(Choices(command="run", model=model, devices=(SPEC,), n_batch=(128,), n_ubatch=(32,), pp=(),
                              tg=(4,), depth=(256,), expert_cache="0"))
    assert depth.configs[0].switches["LAYER_MAJOR"] == 1
    # (the depth is not timed: it forms the groups, but the memory plan prices the decode alone)
    wl = _tests_workload(depth.configs[0])
    assert wl.steps == (("tg", 4),) and wl.untimed == (("pp", 256),) and wl.longest_prompt == 256
    assert wl.prompt_tokens == 0


def test_without_a_fit_layer_major_stays_off_where_no_group_forms_or_it_is_set(model, monkeypatch):
    """One ubatch a batch (-b == -ub), LAYER_MAJOR=0 as a switch or a variable, the baseline alone: nothing planned (no
    dry run), no switch added, no note; LAYER_MAJOR=0 given stays in the patched config (the A/B's off-switch), the
    variable's as the switch's."""
    monkeypatch.setattr(sys.modules["pyllama_pp.planning"], "plan_on_placement",
                        lambda *a, **k: pytest.fail("planned LAYER_MAJOR where it cannot act or is set"))
    from pyllama_pp import switches
    kw = dict(command="run", model=model, devices=(SPEC,), pp=(256,), tg=())
    one = plan_runs(Choices(**kw, n_batch=(32,), n_ubatch=(32,)))
    given = plan_runs(Choices(**{**kw, "command": "ab"}, n_batch=(128,), n_ubatch=(32,), switches={"LAYER_MAJOR": 0}))
    baseline = plan_runs(Choices(**kw, variant="baseline", n_batch=(128,), n_ubatch=(32,)))
    monkeypatch.setenv(switches.var(switches.LAYER_MAJOR), "0")
    env = plan_runs(Choices(**kw, n_batch=(128,), n_ubatch=(32,)))
    for planned, switch in ((one, None), (given, 0), (baseline, None), (env, 0)):
        cfg = planned.configs[0]
        assert planned.plans == () and cfg.switches.get("LAYER_MAJOR") == switch, cfg.switches
        assert not any("layer major" in n or "LAYER_MAJOR" in n for n in planned.notes), planned.notes
    assert given.configs[0].job("baseline").switches == {}


@pytest.mark.parametrize("devices,margin,target", [("vdev:1x5MiB@4GBps", None, "5.0"), (SPEC, ("3MiB",), "6.0")],
                         ids=["small-device", "margin"])
def test_without_a_fit_layer_major_stays_off_where_the_groups_do_not_fit(model, capsys, devices, margin, target):
    """A device whose memory (less the --margin) holds the placement but not a group's buffers beside it: no switch,
    and the notes (the run's and its rows') say why, naming the device, what it would hold and its target."""
    planned = plan_runs(Choices(command="run", model=model, devices=(devices,), margin=margin, **GROUPS))
    (cfg,), (plan,) = planned.configs, planned.plans
    assert "LAYER_MAJOR" not in cfg.switches and plan.layer_major["switch"] == 0, plan.layer_major
    assert all(d.expected_bytes <= d.target_bytes for d in plan.devices)   # (the placement alone fits)
    note = _layer_major_note(planned.notes)
    assert "LAYER_MAJOR off: its groups' memory has no room: VDEV0 would hold" in note, note
    assert f"over its {target} MiB (free less the margin)" in note and "Fix: --fit" in note, note
    if margin is None:
        assert cli.main(["run", model, "--devices", devices, *GROUPS_ARGS, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["rows"]
        assert note in row["notes"] and row["layer_major_groups"] is None, row


def test_without_a_fit_the_cache_takes_the_room_the_groups_leave(model, monkeypatch):
    """Prompts that form groups and a short decode (16 tokens), GPU-like costs: the groups save the prompts more than
    the slots their room would hold save the decode, so LAYER_MAJOR is on and the cache takes what the placement and
    the groups' buffers leave (fewer slots than the same run gets with LAYER_MAJOR=0)."""
    layout = layout_of(model, 64)
    _gpu_like(monkeypatch, layout)
    kw = dict(model=model, devices=(SPEC,), **{**GROUPS, "tg": (16,)})
    both, alone = plan_runs(Choices(**kw)), plan_runs(Choices(**kw, switches={"LAYER_MAJOR": 0}))
    (cfg,), (plan,) = both.configs, both.plans
    slots, alone_slots = -cfg.switches["EXPERT_CACHE"], -alone.configs[0].switches["EXPERT_CACHE"]
    d = plan.devices[0]
    assert cfg.switches["LAYER_MAJOR"] == 1 and plan.layer_major["group"] == 4
    assert layout.bytes_of(slots, 12) <= d.free_bytes - plan.margins[0] + d.cache_bytes - d.expected_bytes
    assert d.compute_bytes > alone.plans[0].devices[0].compute_bytes and 0 < slots < alone_slots, (slots, alone_slots)


# --- LAYER_MAJOR's groups weighed against the slots their room holds ------------------------------------------------
# every expert in host RAM on SPEC's device: room beside the placement for a group's buffers (4 ubatches of 32) or for
# more slots a layer, and the two prompts: one whose decode dominates the workload, one whose prompt does
ALL_HOST = Placement(host_experts="all")
GROUPS_CTX = ContextParams(n_ctx=512, n_batch=128, n_ubatch=32)
DECODE_HEAVY, PROMPT_HEAVY = "pp=256,tg=2048", "pp=4096,tg=16"


def _counted(monkeypatch, name: str) -> list:
    """Counts the calls of pyllama_pp.fit's `name` (its dry runs: measure_placement, or placement.fit)."""
    fit_module = sys.modules["pyllama_pp.fit"]
    owner = fit_module if name == "measure_placement" else fit_module.placement
    real, calls = getattr(owner, "measure_placement" if name == "measure_placement" else "fit"), []

    def counted(*a, **k):
        calls.append(k.get("switches"))
        return real(*a, **k)
    monkeypatch.setattr(owner, "measure_placement" if name == "measure_placement" else "fit", counted)
    return calls


def test_without_a_fit_a_decode_heavy_workload_takes_the_groups_room_for_slots(model, monkeypatch):
    """Without a fit, GPU-like costs, a prompt of 256 tokens and 2048 decoded: the groups' buffers would fit, but their
    room holds more slots a layer, which save the decode more than the groups save the prompt: the plan keeps
    LAYER_MAJOR=0 (as its run switch), takes the slots, and says why with both predictions; a prompt-heavy workload
    (4096 tokens, 16 decoded) on the same placement keeps the groups and the fewer slots beside them. Neither makes a
    dry run more than the groups' trial."""
    layout = layout_of(model, 64)
    _gpu_like(monkeypatch, layout)
    runs = _counted(monkeypatch, "measure_placement")
    from pyllama_pp.fit import plan_on_placement
    off = plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload=DECODE_HEAVY)
    assert len(runs) == 2   # (the placement, then with the groups: the plan without them is the first)
    on = plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload=PROMPT_HEAVY)
    assert len(runs) == 4
    w_off, w_on = off.layer_major["weighed"], on.layer_major["weighed"]
    assert off.switches["LAYER_MAJOR"] == 0 and off.run_switches()["LAYER_MAJOR"] == 0 and w_off["chosen"] == "off"
    assert off.layer_major["switch"] == 0 and "group" not in off.layer_major
    assert w_off["off"]["seconds"] < w_off["on"]["seconds"] * (1 - GAIN_MIN), w_off
    assert on.switches["LAYER_MAJOR"] == 1 and on.layer_major["group"] == 4 and w_on["chosen"] == "on"
    assert w_on["on"]["seconds"] <= w_on["off"]["seconds"] and w_on["on"]["prompt_s"] < w_on["off"]["prompt_s"]
    slots_off, slots_on = -off.switches["EXPERT_CACHE"], -on.switches["EXPERT_CACHE"]
    assert 0 < slots_on < slots_off, (slots_on, slots_off)
    assert w_off["off"]["cache"] == f"{slots_off} slots a layer" == w_on["off"]["cache"]
    assert w_off["on"]["cache"] == f"{slots_on} slots a layer" == w_on["on"]["cache"]
    assert off.devices[0].compute_bytes < on.devices[0].compute_bytes   # (no group's buffers in the plan without)
    for plan in (off, on):
        d = plan.devices[0]
        assert d.expected_bytes <= d.target_bytes and plan.host_expert_layers == [12]
    text = str(off)
    assert (f"layer major: LAYER_MAJOR off: the workload in {w_off['off']['seconds']:.2f} s against "
            f"{w_off['on']['seconds']:.2f} s with it; the cache: {slots_off} slots a layer in the groups' room, "
            f"{slots_on} slots a layer beside them") in text, text
    assert str(on).count("LAYER_MAJOR=1 (on: the workload in") == 1


def test_where_the_slots_that_won_have_no_placement_the_groups_stay(model, monkeypatch):
    """The decode-heavy workload's plan without the groups, its cache then placed with no room after all (the memory
    planner keeps none): no groups and no cache would lose on both phases, so the plan with the groups is taken, and
    its why says so."""
    _gpu_like(monkeypatch, layout_of(model, 64))
    fit_module = sys.modules["pyllama_pp.fit"]
    real = fit_module._weigh

    def weigh(plan, *a, **k):
        out = real(plan, *a, **k)
        if not plan.switches.get("LAYER_MAJOR"):
            out.memory_plan = {**out.memory_plan, "why": "no cache: 15 slots a layer has no placement", "chosen": 0}
            out.switches.pop("EXPERT_CACHE")
        return out
    monkeypatch.setattr(fit_module, "_weigh", weigh)
    plan = fit_module.plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload=DECODE_HEAVY)
    w = plan.layer_major["weighed"]
    assert plan.switches["LAYER_MAJOR"] == 1 and plan.switches["EXPERT_CACHE"] < 0 and w["chosen"] == "on"
    assert w["off"]["seconds"] < w["on"]["seconds"]   # (predicted faster, then not placed)
    assert "without it, whose cache then had no placement (no cache: 15 slots a layer has no placement)" in \
        plan.layer_major["why"], plan.layer_major


def test_a_plan_weighed_both_ways_replays_its_choice(model, monkeypatch, tmp_path):
    """The weighed plan's JSON keeps both predictions and its switches: loaded again it prints alike, and `run --plan`
    runs the switches it chose (LAYER_MAJOR=0 with the slots that won over the groups; fit's plan with the groups
    where they won)."""
    layout = layout_of(model, 64)
    _gpu_like(monkeypatch, layout)
    from pyllama_pp.fit import fit, plan_on_placement
    off = plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload=DECODE_HEAVY)
    on = fit(model, devices="vdev:1x8MiB@4GBps", ctx=ContextParams(n_ctx=512, n_batch=32, n_ubatch=16),
             workload=PROMPT_HEAVY, timeout=120)
    assert on.layer_major["weighed"]["chosen"] == "on" and on.switches["LAYER_MAJOR"] == 1, on.layer_major
    for plan in (off, on):
        back = Plan.load(plan.save(tmp_path / f"{plan.path}.json"))
        assert back.layer_major == plan.layer_major and back.memory_plan["why"] == plan.memory_plan["why"]
        assert back.run_switches("none") == plan.run_switches("none") and str(back) == str(plan)
        planned = plan_runs(Choices(command="run", model=model, devices=(back.devices_spec["text"],),
                                    plan=str(tmp_path / f"{plan.path}.json"), pp=(64,), tg=(4,)))
        cfg = planned.configs[0]
        assert {k: cfg.switches[k] for k in plan.run_switches("none")} == plan.run_switches("none"), cfg.switches
    assert off.run_switches("none")["LAYER_MAJOR"] == 0


def test_a_prompt_only_or_decode_only_workload_weighs_no_second_plan(model, monkeypatch):
    """fit and a run without a fit, prompts that form groups: a prompt-only workload takes the groups by the rule as
    before (the cache is not weighed, no plan without the groups is priced: the dry runs are the placement's and the
    groups' trial alone); a decode-only one tries no groups (no prompt forms one)."""
    _gpu_like(monkeypatch, layout_of(model, 64))
    from pyllama_pp.fit import fit, plan_on_placement
    runs = _counted(monkeypatch, "measure_placement")
    prompt = plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload="pp=4096")
    assert len(runs) == 2 and prompt.switches["LAYER_MAJOR"] == 1 and "weighed" not in prompt.layer_major
    assert prompt.memory_plan["alternatives"] == [] and "decodes no token" in prompt.memory_plan["why"]
    decode = plan_on_placement(model, SPEC, ALL_HOST, GROUPS_CTX, workload="tg=2048")
    assert len(runs) == 3 and not decode.layer_major and "LAYER_MAJOR" not in decode.switches
    fits = _counted(monkeypatch, "fit")
    kw = dict(devices="vdev:1x8MiB@4GBps", ctx=ContextParams(n_ctx=512, n_batch=32, n_ubatch=16), timeout=120)
    plan = fit(model, workload="pp=4096", **kw)
    assert [bool((s or {}).get("LAYER_MAJOR")) for s in fits] == [False, True], fits
    assert plan.switches["LAYER_MAJOR"] == 1 and "weighed" not in plan.layer_major
    decode = fit(model, workload="tg=2048", **kw)
    assert "LAYER_MAJOR" not in decode.switches and not any((s or {}).get("LAYER_MAJOR") for s in fits[2:]), fits


# --- -ub auto: the two searches' best (with the groups, without them) weighed on the whole workload -----------------
# a 12 MiB device: the pair without the groups leaves room for 4 slots a layer, the groups' pairs for none, while the
# groups' prompts run faster (1024-token prompts, n_ubatch 32 or 128)
UB_SPEC = "vdev:1x12MiB@4GBps"
UB_KW = dict(devices=UB_SPEC, ctx=ContextParams(n_ctx=1280), n_tokens=1024, candidates=(32, 128), timeout=120)


def _probed(monkeypatch) -> list:
    """GPU-like costs whose decode probe counts its calls."""
    calls: list = []
    monkeypatch.setattr(sys.modules["pyllama_pp.fit"], "decode_costs",
                        lambda m, d, **kw: calls.append(1) or {-1: GPU_LIKE})
    return calls


def test_ubatch_auto_weighs_the_groups_against_the_slots_for_the_workload(model, monkeypatch):
    """-ub auto, compute not counted (the predictions decide), GPU-like costs: the pair with the groups predicts the
    faster prompts on every workload. Decode-heavy (256 prompt tokens, 2048 decoded): the pair without them, whose room
    holds more slots a layer, saves more than GAIN_MIN of the workload: LAYER_MAJOR=0 (a run switch), the slots placed,
    both sides and why in the plan. Prompt-heavy (4096, 16 decoded): the groups stay. Prompt-only: the choice by the
    prediction alone, as before (no weighing). The decode probe runs once a plan, though both sides are priced."""
    layout = layout_of(model, 64)
    _gpu_like(monkeypatch, layout)
    calls = _probed(monkeypatch)
    fit_module = sys.modules["pyllama_pp.fit"]
    off = fit_module.fit_ubatch(model, workload=DECODE_HEAVY, count_compute=False, **UB_KW)
    assert len(calls) == 1
    w = off.layer_major["weighed"]
    assert w["chosen"] == "off" and off.switches["LAYER_MAJOR"] == 0 and off.run_switches()["LAYER_MAJOR"] == 0
    assert off.layer_major["switch"] == 0 and "group" not in off.layer_major
    assert w["on"]["prompt_ts"] > w["off"]["prompt_ts"] and w["on"]["prompt_s"] < w["off"]["prompt_s"]
    assert w["off"]["seconds"] < w["on"]["seconds"] * (1 - GAIN_MIN), w
    slots = {k: int(w[k]["cache"].split()[0]) if w[k]["cache"] != "no cache" else 0 for k in ("on", "off")}
    assert slots["off"] > slots["on"], w   # (the groups' room holds slots)
    assert {w[s]["prompt_from"] for s in ("on", "off")} == {"predicted"}
    assert off.devices[0].cache_slots > 0 and off.memory_plan["alternatives"][off.memory_plan["chosen"]]["slots"] > 0
    _within(off)
    text = str(off)
    assert (f"layer major: LAYER_MAJOR off: the workload in {w['off']['seconds']:.2f} s against "
            f"{w['on']['seconds']:.2f} s with it; the cache: {w['off']['cache']} in the groups' room, "
            f"{w['on']['cache']} beside them") in text, text
    assert "taken for the workload (layer major, above)" in text

    on = fit_module.fit_ubatch(model, workload=PROMPT_HEAVY, count_compute=False, **UB_KW)
    w = on.layer_major["weighed"]
    assert w["chosen"] == "on" and on.switches["LAYER_MAJOR"] == 1 and on.layer_major["group"] > 1
    assert w["on"]["seconds"] < w["off"]["seconds"] and w["on"]["prompt_s"] < w["off"]["prompt_s"]
    assert "LAYER_MAJOR=1 (on: the workload in" in str(on) and "predicted fastest" in str(on)

    calls.clear()
    alone = fit_module.fit_ubatch(model, workload="pp=4096", count_compute=False, **UB_KW)
    assert not calls and "weighed" not in alone.layer_major and alone.switches["LAYER_MAJOR"] == 1
    assert alone.layer_major["why"].startswith("on: predicted ") and alone.memory_plan["alternatives"] == []
    assert alone.predicted_ts == max(r["predicted_ts"] for r in alone.ubatch_auto if r.get("predicted_ts"))
    assert (alone.ctx["n_batch"], alone.ctx["n_ubatch"]) == (on.ctx["n_batch"], on.ctx["n_ubatch"])


def _within(plan: Plan) -> None:
    assert all(d.expected_bytes <= d.target_bytes for d in plan.devices), plan


def test_ubatch_auto_weighs_each_side_at_its_measured_prompts(model, monkeypatch, fake_compute):
    """-ub auto with compute counted (stated) and the closest pairs of both sides measured, the groups' measured 1.5x
    their prediction: each side is priced at its fastest measured t/s. Decode-heavy: the pair without the groups is
    taken though the groups measured faster, and the plan says the weighing chose it, not the measure; prompt-heavy:
    the groups' pair measured fastest stays."""
    _gpu_like(monkeypatch, layout_of(model, 64))
    fake_compute(lambda u: 1e-5)
    fit_module = sys.modules["pyllama_pp.fit"]
    monkeypatch.setattr(fit_module, "measure_prompts",
                        lambda plans, **kw: [p.predicted_ts * (1.5 if p.layer_major else 1.0) for p in plans])
    off = fit_module.fit_ubatch(model, workload=DECODE_HEAVY, **UB_KW)
    w, rows = off.layer_major["weighed"], off.ubatch_measured
    assert {r["layer_major"] for r in rows} == {0, 1} and w["chosen"] == "off" and off.switches["LAYER_MAJOR"] == 0
    for side, flag in (("on", 1), ("off", 0)):
        assert w[side]["prompt_from"] == "measured"
        assert w[side]["prompt_ts"] == round(max(r["measured_ts"] for r in rows if r["layer_major"] == flag), 1)
    assert w["on"]["prompt_ts"] > w["off"]["prompt_ts"] and off.devices[0].cache_slots > 0
    text = str(off)
    assert "took the pair the workload's weighing chose (layer major, above):" in text, text
    (mine,) = [line for line in text.splitlines() if line.startswith("    * n_ubatch")]
    assert "LAYER_MAJOR=0" in mine and f"n_ubatch {off.ctx['n_ubatch']}," in mine, mine
    on = fit_module.fit_ubatch(model, workload=PROMPT_HEAVY, **UB_KW)
    assert on.layer_major["weighed"]["chosen"] == "on" and on.switches["LAYER_MAJOR"] == 1
    assert "took the fastest measured:" in str(on)


# --- the three ways of asking for a switch: --expert-cache, --switch and the environment -------------------------

def _plan_doc(plan: Plan) -> dict:
    return {k: v for k, v in plan.to_dict().items() if k != "seconds"}


def test_an_environment_cache_is_planned_as_expert_cache_and_switch(model, monkeypatch):
    """A locality model under memory pressure (half its layers' experts in host RAM), the cache asked three ways - fit's
    expert_cache, the switch, and GGML_SCHED_PP_EXPERT_CACHE in the environment - with prompts that form LAYER_MAJOR's
    groups: each gives the same plan (its switches, the cache's memory on the device, the groups' trial with the cache
    asked in it too), and its dry runs do not read the variable beside the switch they are given."""
    from pyllama_pp.fit import fit
    kw = dict(devices=SPEC, ctx=GROUPS_CTX, timeout=120, workload=PROMPT_HEAVY)
    by_arg = fit(model, expert_cache="2MiB", **kw)
    by_switch = fit(model, switches={"EXPERT_CACHE": 2}, **kw)
    monkeypatch.setenv("GGML_SCHED_PP_EXPERT_CACHE", "2")
    by_env = fit(model, **kw)
    assert by_arg.expert_cache == "2MiB" and by_arg.switches["EXPERT_CACHE"] == 2
    assert by_arg.host_expert_layers[0] > 0 and by_arg.devices[0].cache_slots > 0, by_arg.host_expert_layers
    assert by_arg.layer_major.get("switch") == 1, by_arg.layer_major   # (the trial ran, with the cache asked)
    assert _plan_doc(by_env) == _plan_doc(by_switch) == _plan_doc(by_arg)


def test_run_fit_plans_an_environment_cache_as_its_switch(model, monkeypatch):
    """run --fit with GGML_SCHED_PP_EXPERT_CACHE set plans what --switch EXPERT_CACHE (and --expert-cache) plans: the
    same configs (switches, placement) and plans; the plan's JSON keeps the cache, so `run --plan` replays it without
    the variable."""
    choices = dict(command="run", model=model, devices=(SPEC,), fit="each", pp=(), tg=(8,))
    by_switch = plan_runs(Choices(switches={"EXPERT_CACHE": 2}, **choices))
    by_arg = plan_runs(Choices(expert_cache="2MiB", **choices))
    monkeypatch.setenv("GGML_SCHED_PP_EXPERT_CACHE", "2")
    by_env = plan_runs(Choices(**choices))
    assert by_env.configs == by_switch.configs == by_arg.configs
    assert [_plan_doc(p) for p in by_env.plans] == [_plan_doc(p) for p in by_switch.plans]
    (plan,) = by_env.plans
    assert plan.switches["EXPERT_CACHE"] == 2 and by_env.configs[0].switches["EXPERT_CACHE"] == 2


def test_an_environment_guard_wins_over_the_plan_as_its_switch_does(model, monkeypatch):
    """The cache's guard set in the environment: run --fit runs it over the planned guard, as --switch's."""
    choices = dict(command="run", model=model, devices=(SPEC,), fit="each", pp=(), tg=(8,), expert_cache="2MiB")
    by_switch = plan_runs(Choices(switches={"EXPERT_CACHE_MIN_HIT": 7}, **choices))
    monkeypatch.setenv("GGML_SCHED_PP_EXPERT_CACHE_MIN_HIT", "7")
    by_env = plan_runs(Choices(**choices))
    assert by_env.configs == by_switch.configs and by_env.configs[0].switches["EXPERT_CACHE_MIN_HIT"] == 7


def test_a_guard_given_to_fit_stays_in_its_plan(model, monkeypatch):
    """fit weighs the cache (auto; GPU-like costs: it pays) and sets its guard and split after its choice; a guard the
    user gave to fit (--switch EXPERT_CACHE_MIN_HIT=N) stays N in the plan, so `run --plan` replays the user's guard;
    the rest of the plan is the one planned without it."""
    fit_module = sys.modules["pyllama_pp.fit"]
    monkeypatch.setattr(fit_module, "decode_costs", lambda m, d, **kw: {-1: GPU_LIKE})
    fit = fit_module.fit
    kw = dict(devices=SPEC, ctx=GROUPS_CTX, timeout=120, workload="tg=2048")
    planned = fit(model, **kw)
    assert planned.switches.get("EXPERT_CACHE") and "EXPERT_CACHE_MIN_HIT" in planned.switches, planned.switches
    mine = 3 if planned.switches["EXPERT_CACHE_MIN_HIT"] != 3 else 4
    given = fit(model, switches={"EXPERT_CACHE_MIN_HIT": mine}, **kw)
    assert given.switches["EXPERT_CACHE_MIN_HIT"] == mine
    assert {**given.switches, "EXPERT_CACHE_MIN_HIT": 0} == {**planned.switches, "EXPERT_CACHE_MIN_HIT": 0}
    assert Plan.from_dict(given.to_dict()).switches["EXPERT_CACHE_MIN_HIT"] == mine


def test_resident_layers_leave_out_dense_layers_wherever_they_sit():
    """The layers the memory planner counts resident on a device (a move to host RAM frees their experts' bytes): its
    full layers (a layer split by upstream's overflow is among them or among the host-expert layers, counted once)
    less the leading dense layers in its range, which have no experts - on the second device too where the first
    holds fewer layers than the model has dense ones."""
    from pyllama_pp.memory_plan import _resident
    from pyllama_pp.plan import DevicePlan
    dev = lambda first, end, host, partial=0: DevicePlan(
        name="VDEV", layers=[first, end], full_layers=end - first - host, host_expert_layers=host,
        partial_layers=partial, model_bytes=0, context_bytes=0, compute_bytes=0, free_bytes=0, target_bytes=0)
    plan = Plan(variant="patched", model="m", model_size=0, devices_spec={}, ctx={"n_ubatch": 64, "n_batch": 512},
                status="success", path="spread", reasons=[], n_gpu_layers=9, tensor_split=[], tensor_overrides=[],
                n_ctx=512, n_layer=8, n_expert=8, margins=[0, 0], devices=[dev(0, 2, 0), dev(2, 8, 2, partial=1)])
    assert _resident(plan, 0) == [2, 4]
    assert _resident(plan, 1) == [1, 4]
    assert _resident(plan, 3) == [0, 3]   # (layer 2, dense, sits on the second device)


def test_ub_auto_weighs_layer_major_on_one_basis():
    """-ub auto weighs its side with LAYER_MAJOR against the one without on the whole workload, each side's prompts
    at a t/s: both measured, or both predicted - where one side ran and the other did not, both at their
    predictions (fit._one_basis), so that the predictor's error does not decide."""
    from types import SimpleNamespace
    from pyllama_pp.fit import _one_basis
    on, off = SimpleNamespace(predicted_ts=900.0), SimpleNamespace(predicted_ts=1000.0)   # (all it reads of a Plan)
    both = [(on, 1200.0, "measured"), (off, 1100.0, "measured")]
    assert _one_basis(both) == both
    mixed = _one_basis([(on, 1200.0, "measured"), (off, 1000.0, "predicted")])
    assert [(p, ts, how) for p, ts, how in mixed] == [(on, 900.0, "predicted"), (off, 1000.0, "predicted")]
    assert _one_basis([None, (off, 1000.0, "predicted")]) == [None, (off, 1000.0, "predicted")]
