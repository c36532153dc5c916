"""EXPERT_CACHE (patch 0014) on VDEVs with every expert in host RAM: below op offload's threshold the expert ops run on
their layer's device, reading the experts from a per-layer LRU of slots there. The logits equal the baseline's
(test-backend-ops allows a CPU-vs-GPU MUL_MAT_ID an NMSE of 5e-4; on VDEVs both sides run the CPU's kernels on the
same bytes, so the bar is the suite's 1e-6, and they come out exact); 0 is the path without the cache; the counters
follow the LRU; device memory stays flat; ops the slots cannot serve stay on the CPU. The hit-rate guard
(EXPERT_CACHE_MIN_HIT) sends layers whose cache does not pay back to the CPU path, exactly as the simulator's guard does
on the traced ids, and changes neither the logits nor what the CPU path moves."""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import pytest

from pyllama_pp import cli, synth
from pyllama_pp.expert_cache_sim import guard, simulate
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.servers.serve import spawn_server, wait_listening

DECODE = {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}   # every token a batch of its own: below the threshold
HOST_ALL = {"host_experts": "all"}
TWO = "vdev:2x0@0.5"
OPS = 3   # expert ops of a tiny layer (gate, up, down)


def cache(value, min_hit: Optional[int] = 0) -> dict:
    """EXPERT_CACHE=value: MiB per device, or -N slots per layer; EXPERT_CACHE_MIN_HIT=min_hit (0: no guard, every op
    the slots can serve reads them; None: the switch's default)."""
    return {"GGML_SCHED_PP_EXPERT_CACHE": value,
            **({} if min_hit is None else {"GGML_SCHED_PP_EXPERT_CACHE_MIN_HIT": min_hit})}


GUARD = ("cache_cpu_ops", "cache_leaves", "cache_returns", "cache_shadow_hits", "cache_shadow_misses", "cache_cpu_layers")


def totals(ext: dict) -> dict:
    """The cache's counters over all backends (its guard's too)."""
    keys = ("cache_ops", "cache_hits", "cache_misses", "cache_evictions", "cache_bytes", "cache_buffer_bytes") + GUARD
    return {k: sum(b[k] for b in ext["backends"]) for k in keys}


def expert_ops_per_layer(cfg: synth.SynthConfig) -> int:
    """The expert ops of a MoE layer that read its slots: gate, up and down (MUL_MAT_ID), and for gpt-oss the ADD_ID
    of each one's expert biases."""
    return 6 if cfg.arch == "gpt-oss" else 3


def expert_bytes_of_layer(cfg: synth.SynthConfig) -> int:
    """One expert of one layer in all its weights (gate, up, down)."""
    return synth.expert_bytes_per_layer(cfg) // cfg.n_expert


def _decode(runner, variant: str, env=None, devices: str = TWO, n_tokens: int = 12, **kw) -> dict:
    return runner.logits(variant, devices=devices, placement=HOST_ALL, ctx=DECODE, n_tokens=n_tokens, env=env, **kw)


@pytest.fixture(scope="module")
def baseline_decode(runner):
    return _decode(runner, "baseline")


# --- numerics ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [64, 1, -2])
def test_decode_logits_equal_the_baseline(runner, baseline_decode, assert_logits_match, tiny_info, value):
    """Every size, from all 64 experts a layer down to the 2 a token uses: each expert op of each token reads the cache
    (3 ops per layer and token), and every token's logits are the baseline's."""
    p = _decode(runner, "patched", cache(value))
    assert_logits_match(p["logits"], baseline_decode["logits"], f"EXPERT_CACHE={value}")
    t = totals(p["ext"])
    assert t["cache_ops"] == 3 * tiny_info["n_layer"] * 12
    assert t["cache_hits"] + t["cache_misses"] == tiny_info["n_layer"] * 12 * tiny_info["n_expert_used"]
    assert t["cache_buffer_bytes"] > 0


# the other families' tiny presets (attention, shared experts, dense first layers, gating and expert types differ)
FAMILIES = [("mixtral-tiny", {}), ("qwen2moe-tiny", {}), ("glm4moe-tiny", {}), ("deepseek2-tiny", {}),
            ("gptoss-tiny", {}), ("mixtral-tiny", {"n_embd": 256, "head_dim": 64, "expert_type": "q4_k"}),
            ("qwen2moe-tiny", {"expert_type": "bf16"})]


@pytest.mark.parametrize("name, overrides", FAMILIES, ids=[n + "".join(f"-{v}" for v in o.values()) for n, o in FAMILIES])
def test_decode_logits_equal_the_baseline_in_every_family(tmp_path_factory, assert_logits_match, name, overrides):
    from conftest import JobRunner
    cfg = synth.preset(name, seed=1, **overrides)
    path = synth.cached_model(tmp_path_factory.getbasetemp() / "families", name, seed=1, **overrides)
    runner = JobRunner(str(path), tmp_path_factory.mktemp(name + "-logits"))
    b = _decode(runner, "baseline", n_tokens=6)
    p = _decode(runner, "patched", cache(64), n_tokens=6)
    assert_logits_match(p["logits"], b["logits"], name)
    moe_layers = cfg.n_layer - cfg.n_layer_dense_lead
    assert totals(p["ext"])["cache_ops"] == expert_ops_per_layer(cfg) * moe_layers * 6


# --- gpt-oss's expert biases -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """The tiny gpt-oss (MXFP4 experts with biases) and its runner."""
    from conftest import JobRunner
    path = synth.cached_model(tmp_path_factory.getbasetemp() / "families", "gptoss-tiny", seed=1)
    return synth.preset("gptoss-tiny", seed=1), JobRunner(str(path), tmp_path_factory.mktemp("gptoss-biases"))


def test_gptoss_expert_biases_read_the_slots(runner, gptoss, assert_logits_match):
    """gpt-oss adds a row of a host bias [n, n_expert] to each selection after each expert op (ADD_ID, routed by the
    layer's ids): the biases are weights of the layer's slot map too, so its whole expert FFN runs on the device. Six
    ops a layer and token read the slots; its decode graph has as many splits as the tiny qwen3moe's (6 layers too;
    ADD_IDs left on the CPU split each layer three more times); a miss uploads its expert's bias rows with its
    weights; the logits are the baseline's."""
    cfg, oss = gptoss
    b = _decode(oss, "baseline", n_tokens=6)
    p = _decode(oss, "patched", cache(-8), n_tokens=6)
    assert_logits_match(p["logits"], b["logits"], "gpt-oss, 8 slots")
    t = totals(p["ext"])
    assert t["cache_ops"] == 6 * cfg.n_layer * 6
    assert t["cache_hits"] + t["cache_misses"] == cfg.n_layer * 6 * cfg.n_expert_used
    assert p["ext"]["n_splits"] == _decode(runner, "patched", cache(-2))["ext"]["n_splits"]
    bias_bytes = 4 * (2 * cfg.n_ff_exp + cfg.n_embd)   # F32 rows of the gate, up and down biases
    assert t["cache_bytes"] == t["cache_misses"] * (expert_bytes_of_layer(cfg) + bias_bytes)


@pytest.mark.parametrize("n_ubatch", [1, 2])
def test_gptoss_misses_split_with_the_cpu(gptoss, assert_logits_match, n_ubatch):
    """EXPERT_HYBRID on gpt-oss: its FFN is one split on the device, so the host CPU computes its share of the misses
    (its clone of the FFN adds the biases from host memory); the logits are the baseline's and the cache's alone."""
    cfg, oss = gptoss
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": {"n_ctx": 64, "n_batch": n_ubatch, "n_ubatch": n_ubatch},
          "n_tokens": 6}
    b = oss.logits("baseline", **kw)
    alone = oss.logits("patched", env=cache(-8), **kw)
    p = oss.logits("patched", env={**cache(-8), "GGML_SCHED_PP_EXPERT_HYBRID": 100}, **kw)
    assert_logits_match(p["logits"], b["logits"], f"gpt-oss, EXPERT_HYBRID=100, ub{n_ubatch}")
    assert np.array_equal(p["logits"], alone["logits"])
    t = totals(p["ext"])
    cpu = sum(x["cache_cpu_misses"] for x in p["ext"]["backends"])
    assert t["cache_ops"] == 6 * cfg.n_layer * 6 // n_ubatch
    assert 0 < cpu < t["cache_misses"]
    assert sum(x["cache_hybrid_layers"] for x in p["ext"]["backends"]) > 0


def two_servers(variant: str):
    """Two rpc-servers of `variant` on loopback, a VDEV each: their device spec while they serve."""
    started = [spawn_server("vdev:1x0@0", variant, "127.0.0.1") for _ in range(2)]
    try:
        for port, proc in started:
            wait_listening(port, proc, "127.0.0.1")
        yield "rpc://" + ",".join(f"127.0.0.1:{port}" for port, _ in started)
    finally:
        for _, proc in started:
            proc.kill()
            proc.wait(timeout=10)
            proc.stderr.close()


@pytest.fixture
def upstream_servers():
    """Two of upstream's rpc-servers: the experts stay in the client's RAM."""
    yield from two_servers("baseline")


def test_rpc_devices_read_their_cache_over_the_network(runner, upstream_servers, baseline_decode,
                                                       assert_logits_match, tiny_info):
    """Only the generic backend API: RPC devices (upstream's servers) take the slots, the missed experts and the
    slot numbers as tensor sets over the network, and decode to the baseline's logits."""
    p = _decode(runner, "patched", cache(-16), devices=upstream_servers)
    assert_logits_match(p["logits"], baseline_decode["logits"], "RPC devices")
    rpc = [b for b in p["ext"]["backends"] if b["name"].startswith("RPC")]
    assert len(rpc) == 2 and all(b["cache_slots"] == 16 and b["cache_ops"] > 0 for b in rpc)
    assert sum(b["cache_ops"] for b in rpc) == 3 * tiny_info["n_layer"] * 12


@pytest.fixture
def patched_servers():
    """Two of the patched rpc-servers: each keeps its layers' experts in its own RAM (RPC_HOST) and its own scheduler
    runs their expert ops on its device."""
    yield from two_servers("patched")


def test_patched_servers_cache_their_own_layers(runner, patched_servers, baseline_decode, assert_logits_match,
                                                tiny_info):
    """The experts stay in the servers' RAM, where no client's scheduler sees them: each server's scheduler takes the
    client's EXPERT_CACHE (sent when the client makes its backends) and caches its own layers' experts on its device.
    The logits are the baseline's; the servers' counters reach the client's rows: every expert op of every token read
    the slots, and their hits are the simulator's LRU on the traced ids, each server's layers in its own slots. With
    the cache 0 the run is the one without it, bit for bit, and counts nothing."""
    tr = runner.run("patched", {"kind": "trace", "devices": "vdev:1x0@0.5", "placement": HOST_ALL, "ctx": DECODE,
                                "n_prompt": 0, "n_decode": 12, "seed": 7})
    kw = {"devices": patched_servers, "placement": HOST_ALL, "ctx": DECODE, "tokens": tr["tokens"]}
    base = runner.logits("baseline", **{**kw, "devices": TWO})
    on = runner.logits("patched", env=cache(-16), **kw)
    assert_logits_match(on["logits"], base["logits"], "EXPERT_CACHE on two patched servers")
    rpc = [b for b in on["ext"]["backends"] if b["name"].startswith("RPC")]
    assert len(rpc) == 2 and all(b["cache_slots"] == 16 and b["cache_layers"] > 0 and b["cache_ops"] > 0 for b in rpc)
    assert sum(b["cache_layers"] for b in rpc) == tiny_info["n_layer"]
    sim = simulate(ExpertTrace(tr["ids"], tr["layers"], tr["n_expert"]), 16 / tr["n_expert"], "lru", warmup=0)
    t = totals(on["ext"])
    assert t["cache_ops"] == OPS * tiny_info["n_layer"] * 12
    assert (t["cache_hits"], t["cache_hits"] + t["cache_misses"]) == (sim["hits"], sim["lookups"]) and sim["hits"] > 0
    off = runner.logits("patched", **kw)
    zero = runner.logits("patched", env=cache(0), **kw)
    assert np.array_equal(zero["logits"], off["logits"]) and np.array_equal(off["logits"], on["logits"])
    assert not any(totals(zero["ext"]).values()) and not any(totals(off["ext"]).values())


def test_small_prompt_ubatches_read_the_cache_too(runner, assert_logits_match, tiny_info):
    """A prompt in ubatches of 16 tokens (below the threshold) on two devices: 16 x 2 ids need 32 slots a layer. Every
    expert op of the three ubatches (16, 16, 8 tokens) read the slots: none fell back to the CPU."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": {"n_ctx": 128, "n_batch": 64, "n_ubatch": 16}, "n_tokens": 40}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=cache(-32), **kw)
    assert_logits_match(p["logits"], b["logits"], "ub16, 32 slots")
    t = totals(p["ext"])
    assert t["cache_ops"] == OPS * tiny_info["n_layer"] * 3
    assert t["cache_hits"] + t["cache_misses"] == 40 * tiny_info["n_layer"] * tiny_info["n_expert_used"]


# --- off, and the fallbacks ----------------------------------------------------------------------------------------

STABLE = ("h2d_bytes", "d2h_bytes", "d2d_bytes", "h2d_copies", "d2h_copies", "d2d_copies", "graph_computes",
          "host_syncs", "alloc_bytes", "peak_alloc_bytes", "buffer_allocs")


def _counts(r: dict) -> tuple:
    """What a run moved and computed, without times: device counters and the scheduler's event counts."""
    devs = [{k: d[k] for k in STABLE if k in d} for d in r["counters"]["devices"]]
    ext = {k: v for k, v in r["ext"].items() if isinstance(v, int) and not k.endswith("_us")}
    backends = [{k: v for k, v in b.items() if k == "name" or (isinstance(v, int) and not k.endswith("_us"))}
                for b in r["ext"]["backends"]]
    return devs, ext, backends


def test_misses_from_an_mmaped_model_go_through_the_staging_slots(runner, tiny_cfg, baseline_decode,
                                                                   assert_logits_match):
    """An mmap-ed model's host experts are pageable: a miss copied from there straight makes the host wait on the
    copy, so the misses go up through the pinned staging slots the prompt's uploads use (STAGING): every byte the
    cache fetched is staged, the logits are the baseline's; STAGING=0 copies them as they are. A layer's misses
    (each missed expert of each of its expert weights) are copied into the slots together, in bursts, not a copy a
    piece (a copy wakes the copier's threads: at a decode's ~1.7 MB pieces that, not the bytes, set the rate)."""
    mmap = {**HOST_ALL, "load_mode": "mmap"}
    p = runner.logits("patched", devices=TWO, placement=mmap, ctx=DECODE, n_tokens=12, env=cache(-2))
    assert_logits_match(p["logits"], baseline_decode["logits"], "EXPERT_CACHE=-2, mmap")
    staged = sum(b["staged_bytes"] for b in p["ext"]["backends"])
    t = totals(p["ext"])
    assert staged == t["cache_bytes"] > 0, p["ext"]["backends"]
    lookups = t["cache_ops"] // expert_ops_per_layer(tiny_cfg)            # a layer's lookup a token
    pieces = t["cache_misses"] * expert_ops_per_layer(tiny_cfg)           # an upload a missed expert and weight
    slot_ends = staged // (32 << 20) + 1                                  # (a slot's end cuts a call in two)
    assert p["ext"]["stage_copies"] <= lookups + slot_ends < pieces, (p["ext"]["stage_copies"], lookups, pieces)
    off = runner.logits("patched", devices=TWO, placement=mmap, ctx=DECODE, n_tokens=12,
                        env={**cache(-2), "GGML_SCHED_PP_STAGING": 0})
    assert sum(b["staged_bytes"] for b in off["ext"]["backends"]) == 0 and totals(off["ext"])["cache_bytes"] > 0
    assert_logits_match(off["logits"], baseline_decode["logits"], "EXPERT_CACHE=-2, mmap, STAGING=0")


def test_zero_is_the_path_without_the_cache(runner, baseline_decode):
    """EXPERT_CACHE=0 (the default): the same logits bit for bit, and the same bytes, copies, syncs, graphs and
    allocations as a run that does not name the switch; the cache's counters stay 0 and it holds no memory."""
    p = _decode(runner, "patched")
    z = _decode(runner, "patched", cache(0))
    assert np.array_equal(z["logits"], p["logits"]) and np.array_equal(z["logits"], baseline_decode["logits"])
    assert _counts(z) == _counts(p)
    assert not any(totals(z["ext"]).values())


def test_batches_the_slots_cannot_serve_stay_on_the_cpu(runner, assert_logits_match):
    """2 slots a layer serve a token (2 ids), not a ubatch of 4 (up to 8 experts): those ops run on the CPU, as
    without the cache, and move no expert bytes."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": {"n_ctx": 64, "n_batch": 16, "n_ubatch": 4}, "n_tokens": 16}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=cache(-2), **kw)
    assert_logits_match(p["logits"], b["logits"], "ub4, 2 slots")
    t = totals(p["ext"])
    assert t["cache_ops"] == t["cache_hits"] + t["cache_misses"] == 0
    assert sum(x["h2d_bytes"] for x in p["counters"]["devices"]) == sum(x["h2d_bytes"] for x in b["counters"]["devices"])


def test_a_device_without_room_keeps_its_experts_on_the_cpu(runner, assert_logits_match):
    """64 slots a layer (10 MB on the tiny model's 6 layers) do not fit next to the layers on a 6 MiB device: the
    cache warns, asks for no memory the device does not have, and the ops stay on the CPU."""
    p = _decode(runner, "patched", cache(-64), devices="vdev:1x6MiB@0.5")
    b = _decode(runner, "baseline", devices="vdev:1x6MiB@0.5")
    assert_logits_match(p["logits"], b["logits"], "no room")
    t = totals(p["ext"])
    assert t["cache_ops"] == t["cache_buffer_bytes"] == 0
    assert not any(d["failed_allocs"] for d in p["counters"]["devices"])


# --- the counters ----------------------------------------------------------------------------------------------------

def test_misses_of_a_full_cache_are_the_distinct_experts_of_a_prompt(runner, tiny_cfg, tiny_info):
    """A 24-token prompt in one ubatch with a slot for every expert: each layer misses exactly the experts the ubatch
    uses (the coverage measurement, read through llama's eval callback) and hits the rest of its lookups; the last
    layer routes only the output row (2 misses). Every miss uploads the expert once to each of the layer's three
    weights; nothing is evicted."""
    job = {"kind": "measure", "devices": "vdev:1x0@0.5", "placement": HOST_ALL,
           "ctx": {"n_ctx": 64, "n_batch": 32, "n_ubatch": 32}, "tests": [["pp", 24]], "reps": 1, "warmup": 0,
           "coverage": True}
    r = runner.run("patched", job, env=cache(-64))
    test = r["tests"][0]
    per_layer = test["coverage"]["per_layer_mean"]
    n_layer, k = tiny_info["n_layer"], tiny_info["n_expert_used"]
    assert sorted(int(x) for x in per_layer) == list(range(n_layer - 1))
    distinct = sum(int(v) for v in per_layer.values())
    t = totals(test["ext"])
    assert t["cache_misses"] == distinct + k
    assert t["cache_hits"] == (n_layer - 1) * 24 * k + k - t["cache_misses"]
    assert t["cache_evictions"] == 0
    assert t["cache_bytes"] == t["cache_misses"] * expert_bytes_of_layer(tiny_cfg)


@pytest.mark.parametrize("slots, n_ubatch", [(2, 1), (5, 1), (16, 1), (64, 1), (16, 4), (64, 4)])
def test_hits_are_the_simulators_lru_on_the_traced_ids(runner, slots, n_ubatch):
    """The routing ids of 40 tokens recorded by the trace (decoded one by one, or in ubatches of 4 with every row an
    output), then the same tokens decoded the same way with the cache: its hits are those of
    pyllama_pp.expert_cache_sim's LRU with as many slots, counted from the first token."""
    ctx = {"n_ctx": 64, "n_batch": n_ubatch, "n_ubatch": n_ubatch}
    n_prompt, n_decode = (40, 0) if n_ubatch > 1 else (0, 40)
    tr = runner.run("patched", {"kind": "trace", "devices": "vdev:1x0@0.5", "placement": HOST_ALL, "ctx": ctx,
                                "n_prompt": n_prompt, "n_decode": n_decode, "seed": 7})
    trace = ExpertTrace(tr["ids"], tr["layers"], tr["n_expert"])
    sim = simulate(trace, slots / trace.n_expert, "lru", warmup=0)
    assert sim["capacity"] == slots
    p = runner.logits("patched", devices="vdev:1x0@0.5", placement=HOST_ALL, ctx=ctx, tokens=tr["tokens"],
                      env=cache(-slots))
    t = totals(p["ext"])
    assert t["cache_hits"] + t["cache_misses"] == sim["lookups"]
    assert t["cache_hits"] == sim["hits"], (t, sim["hits"])


def test_lru_counts_follow_the_number_of_slots(runner, tiny_cfg, tiny_info):
    """The same 40-token decode with 2, 8 and 64 slots a layer. An LRU keeps what a smaller one keeps (the inclusion
    property), so hits never fall as slots grow; with 2 slots (the 2 ids of a token) every miss after a layer's first
    token evicts, with 64 none does; each miss moves one expert of the layer's three weights."""
    n, k, n_layer = 40, tiny_info["n_expert_used"], tiny_info["n_layer"]
    runs = {s: totals(_decode(runner, "patched", cache(-s), devices="vdev:1x0@0.5", n_tokens=n)["ext"]) for s in (2, 8, 64)}
    for s, t in runs.items():
        assert t["cache_hits"] + t["cache_misses"] == n * n_layer * k, s
        assert t["cache_bytes"] == t["cache_misses"] * expert_bytes_of_layer(tiny_cfg), s
    assert runs[2]["cache_hits"] <= runs[8]["cache_hits"] <= runs[64]["cache_hits"]
    assert runs[2]["cache_evictions"] == runs[2]["cache_misses"] - n_layer * k
    assert runs[64]["cache_evictions"] == 0 and runs[64]["cache_misses"] <= n_layer * tiny_info["n_expert"]
    assert runs[64]["cache_hits"] > runs[2]["cache_hits"]   # (40 tokens of 2 of 64 experts: some come back)


def test_patched_servers_take_their_own_devices_values(runner, patched_servers, baseline_decode, assert_logits_match):
    """EXPERT_CACHE=-3,-5 over two servers: each server's device takes its own entry (sent as EXPERT_CACHE@D when the
    client makes its scheduler), and the logits are the baseline's."""
    on = runner.logits("patched", env=cache("-3,-5"), devices=patched_servers, placement=HOST_ALL, ctx=DECODE,
                       n_tokens=12)
    assert_logits_match(on["logits"], baseline_decode["logits"], "EXPERT_CACHE=-3,-5 on two patched servers")
    rpc = [b for b in on["ext"]["backends"] if b["name"].startswith("RPC")]
    assert [b["cache_slots"] for b in rpc] == [3, 5] and all(b["cache_ops"] > 0 for b in rpc)


def test_the_slots_take_what_the_switch_gives(runner, tiny_cfg):
    """-N: N slots in every layer of every device; N MiB: as many slots as fit in N MiB per device, the same in each
    of its layers."""
    one = expert_bytes_of_layer(tiny_cfg)
    for value in (-5, 1):
        r = _decode(runner, "patched", cache(value), n_tokens=2)
        for b in r["ext"]["backends"]:
            if b["name"] == "CPU":
                assert b["cache_buffer_bytes"] == b["cache_layers"] == 0
                continue
            assert b["cache_layers"] > 0
            slots_bytes = b["cache_slots"] * b["cache_layers"] * one
            if value < 0:
                assert b["cache_slots"] == 5 and slots_bytes <= b["cache_buffer_bytes"] < slots_bytes + (64 << 10)
            else:
                assert b["cache_buffer_bytes"] <= 1 << 20 < slots_bytes + b["cache_layers"] * one + (64 << 10)


def device_slots(ext: dict) -> dict:
    """Each device backend's slots a layer, by name (the CPU's left out)."""
    return {b["name"]: b["cache_slots"] for b in ext["backends"] if b["name"] != "CPU"}


def test_each_device_takes_its_own_value_of_a_list(locality_runner, assert_logits_match, tiny_info):
    """EXPERT_CACHE=-2,-4: the first device 2 slots a layer, the second 4 (the scheduler's device order), each
    counting its own lookups; the logits are the baseline's. A list of one device's 0 leaves that device none."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": DECODE, "tokens": list(range(100, 108))}
    base = locality_runner.logits("baseline", **kw)
    p = locality_runner.logits("patched", env=cache("-2,-4"), **kw)
    assert_logits_match(p["logits"], base["logits"], "EXPERT_CACHE=-2,-4")
    assert list(device_slots(p["ext"]).values()) == [2, 4]
    assert p["ext"]["params"]["EXPERT_CACHE"] == "-2,-4"
    devs = [b for b in p["ext"]["backends"] if b["name"] != "CPU"]
    assert all(b["cache_layers"] > 0 and b["cache_ops"] == OPS * b["cache_layers"] * 8 for b in devs)
    assert sum(b["cache_layers"] for b in devs) == tiny_info["n_layer"]
    half = locality_runner.logits("patched", env=cache("0,-4"), **kw)
    assert_logits_match(half["logits"], base["logits"], "EXPERT_CACHE=0,-4")
    first, second = [b for b in half["ext"]["backends"] if b["name"] != "CPU"]
    assert (first["cache_slots"], first["cache_ops"], second["cache_slots"]) == (0, 0, 4) and second["cache_ops"] > 0


def test_a_list_the_table_refuses_is_named(runner):
    """A list entry out of range, a word, or a list for a switch of one value: the session's ConfigError names it."""
    for env, word in ((cache("-2,x"), "comma list"), (cache("-2,-70000"), "out of range"),
                      ({"GGML_SCHED_PP_OVERLAP": "0,2"}, "not an integer")):
        with pytest.raises(Exception, match=word):
            _decode(runner, "patched", env, n_tokens=1)


# --- the hit-rate guard (EXPERT_CACHE_MIN_HIT) -----------------------------------------------------------------------

GUARD_CTX = {"n_ctx": 160, "n_batch": 1, "n_ubatch": 1}


@pytest.fixture(scope="module")
def locality_runner(tmp_path_factory):
    """The tiny model with routing "locality": a stream of consecutive ids routes to slowly changing experts."""
    from conftest import JobRunner
    path = synth.cached_model(tmp_path_factory.getbasetemp() / "locality", "tiny", seed=1, routing="locality")
    return JobRunner(str(path), tmp_path_factory.mktemp("locality-logits"))


def shadow_rate(t: dict) -> float:
    return t["cache_shadow_hits"] / (t["cache_shadow_hits"] + t["cache_shadow_misses"])


@pytest.mark.parametrize("routing", ["uniform", "locality"])
def test_the_guard_sends_layers_without_locality_to_the_cpu(runner, locality_runner, tiny_info, routing):
    """8 slots of 64 a layer, the floor at its default: uniform routing hits about 1/8 of its lookups, so every layer
    leaves for the CPU once its shadow has seen 32 tokens full, and stays there; locality routing (a stream of ids) hits
    most of them, and every layer stays. Each run computed expert ops from the slots and, uniform, on the CPU, and its
    logits are the baseline's bit for bit."""
    r = runner if routing == "uniform" else locality_runner
    n, n_layer = 64, tiny_info["n_layer"]
    toks = list(range(200, 200 + n)) if routing == "locality" else None
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": GUARD_CTX, "n_tokens": n, "tokens": toks, "seed": 3}
    b = r.logits("baseline", **kw)
    p = r.logits("patched", env=cache(-8, min_hit=None), **kw)
    assert np.array_equal(p["logits"], b["logits"]), routing
    t = totals(p["ext"])
    assert t["cache_ops"] > 0 and t["cache_ops"] + t["cache_cpu_ops"] == OPS * n_layer * n
    assert t["cache_shadow_hits"] + t["cache_shadow_misses"] == n_layer * n * tiny_info["n_expert_used"]
    if routing == "uniform":
        assert t["cache_leaves"] == t["cache_cpu_layers"] == n_layer and t["cache_returns"] == 0
        assert t["cache_cpu_ops"] > 0 and shadow_rate(t) < 0.2
    else:
        assert t["cache_leaves"] == t["cache_cpu_ops"] == t["cache_cpu_layers"] == 0 and shadow_rate(t) > 0.5


# (routing, slots, floor, tokens a graph): all leave; leaves and returns on locality; the same in ubatches of 4
GUARD_CASES = [("uniform", 8, 30, 1), ("locality", 8, 60, 1), ("uniform", 16, 20, 4)]


@pytest.mark.parametrize("routing, slots, min_hit, n_ubatch", GUARD_CASES)
def test_the_guards_decisions_are_the_simulators_on_the_traced_ids(runner, locality_runner, routing, slots, min_hit,
                                                                  n_ubatch):
    """128 tokens traced (decoded one by one, or in ubatches of 4 with every row an output), then decoded the same way
    with the guard: where each layer's ops ran graph by graph, its leaves and returns, its shadow's hits and the
    slots' hits are those of pyllama_pp.expert_cache_sim.guard on the trace's ids."""
    r = runner if routing == "uniform" else locality_runner
    ctx = {**GUARD_CTX, "n_batch": n_ubatch, "n_ubatch": n_ubatch}
    n_prompt, n_decode = (128, 0) if n_ubatch > 1 else (0, 128)
    tr = r.run("patched", {"kind": "trace", "devices": "vdev:1x0@0.5", "placement": HOST_ALL, "ctx": ctx,
                           "n_prompt": n_prompt, "n_decode": n_decode, "seed": 7})
    sim = guard(ExpertTrace(tr["ids"], tr["layers"], tr["n_expert"]), slots, min_hit, tokens_per_graph=n_ubatch)
    assert sim["leaves"] > 0 and (sim["returns"] > 0 or routing == "uniform")   # (the case reaches both sides)
    p = r.logits("patched", devices="vdev:1x0@0.5", placement=HOST_ALL, ctx=ctx, tokens=tr["tokens"],
                 env=cache(-slots, min_hit))
    t = totals(p["ext"])
    assert (t["cache_ops"], t["cache_cpu_ops"]) == (OPS * sim["cached_graphs"], OPS * sim["cpu_graphs"])
    assert (t["cache_leaves"], t["cache_returns"]) == (sim["leaves"], sim["returns"])
    assert t["cache_shadow_hits"] == sim["shadow_hits"]
    assert t["cache_shadow_hits"] + t["cache_shadow_misses"] == sim["shadow_lookups"]
    assert (t["cache_hits"], t["cache_hits"] + t["cache_misses"]) == (sim["hits"], sim["lookups"])
    assert t["cache_cpu_layers"] == sim["cpu_layers"]


def _without_shadow(r: dict) -> tuple:
    devs, ext, backends = _counts(r)
    return devs, ext, [{k: v for k, v in b.items() if not k.startswith("cache_shadow")} for b in backends]


def test_a_floor_of_zero_keeps_no_guard(runner):
    """EXPERT_CACHE_MIN_HIT=0: uniform routing's 8 slots, which a floor of 30 leaves, serve every op; no shadow is kept.
    A floor of 1, which that shadow never falls below, keeps one and otherwise changes nothing: the same logits and
    the same bytes, copies, syncs, graphs and counters. So the guard acts through its decisions alone."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": GUARD_CTX, "n_tokens": 64, "seed": 3}
    z = runner.logits("patched", env=cache(-8, 0), **kw)
    one = runner.logits("patched", env=cache(-8, 1), **kw)
    tz, t1 = totals(z["ext"]), totals(one["ext"])
    assert tz["cache_ops"] == t1["cache_ops"] > 0 and tz["cache_shadow_hits"] + tz["cache_shadow_misses"] == 0
    assert not any(tz[k] for k in GUARD) and t1["cache_shadow_hits"] > 0 and t1["cache_leaves"] == 0
    assert np.array_equal(z["logits"], one["logits"])
    assert _without_shadow(z) == _without_shadow(one)


def test_on_the_cpu_a_layer_moves_and_waits_as_without_the_cache(runner, tiny_info):
    """A floor of 100: every layer leaves once its shadow has seen 32 tokens full (by token 48 here) and never returns.
    The 16 tokens after that cost each device exactly what they cost the path without the cache - the same bytes
    each way, copies, host syncs and graph computes - and read no ids back: the guard reads the ids the CPU's split
    holds already."""
    toks = list(np.random.default_rng(5).integers(0, tiny_info["n_vocab"], 64))
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": GUARD_CTX}
    runs = {(mh, n): runner.logits("patched", env=cache(-8 if mh else 0, mh), tokens=[int(x) for x in toks[:n]], **kw)
            for mh in (100, 0) for n in (48, 64)}
    assert totals(runs[100, 48]["ext"])["cache_cpu_layers"] == tiny_info["n_layer"]

    def tail(mh: int) -> dict:
        """What the tokens 48..63 added (device counters per device, and the scheduler's)."""
        (d0, e0, b0), (d1, e1, b1) = _counts(runs[mh, 48]), _counts(runs[mh, 64])
        devs = [{k: a[k] - b[k] for k in a if k not in ("alloc_bytes", "peak_alloc_bytes")} for a, b in zip(d1, d0)]
        return {"devices": devs, "id_readbacks": e1["id_readbacks"] - e0["id_readbacks"],
                "graphs": e1["graphs"] - e0["graphs"], "reallocs": e1["reallocs"] - e0["reallocs"]}

    guarded, plain = tail(100), tail(0)
    assert guarded == plain and guarded["id_readbacks"] == 0 and guarded["graphs"] == 16
    t0, t1 = totals(runs[100, 48]["ext"]), totals(runs[100, 64]["ext"])
    assert t1["cache_ops"] == t0["cache_ops"]
    assert t1["cache_cpu_ops"] - t0["cache_cpu_ops"] == OPS * tiny_info["n_layer"] * 16


def test_rows_carry_the_guards_counters(tiny_model, tiny_info, capsys):
    """`pyllama-pp run` rows (tg48, a floor of 100, 8 slots): the timed run's expert ops, in the slots and on the CPU,
    add up to all of them, some on the CPU; the slots looked up the experts of the ops that read them (a layer's three
    ops share one lookup), its shadow every routed expert."""
    argv = ["run", tiny_model, "--variant", "patched", "--devices", "vdev:1x0@1", "-p", "0", "-n", "48", "-r", "1",
            "-c", "64", "--switch", "EXPERT_CACHE=-8", "--switch", "EXPERT_CACHE_MIN_HIT=100", "--json"]
    assert cli.main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    n_layer = tiny_info["n_layer"]
    assert row["expert_cache_ops"] + row["expert_cache_cpu_ops"] == OPS * n_layer * 48 and row["expert_cache_cpu_ops"] > 0
    assert row["expert_cache_shadow_hits"] + row["expert_cache_shadow_misses"] == n_layer * 48 * tiny_info["n_expert_used"]
    assert row["expert_cache_hits"] + row["expert_cache_misses"] == row["expert_cache_ops"] // OPS * tiny_info["n_expert_used"]


def _devices(ext: dict) -> list:
    """The device backends' stats (the CPU's left out), in the scheduler's order."""
    return [b for b in ext["backends"] if b["name"] != "CPU"]


@pytest.mark.parametrize("floors", [(100, 0), (0, 100)])
def test_each_device_takes_its_own_floor_of_a_list(runner, tiny_info, floors):
    """EXPERT_CACHE_MIN_HIT=100,0 (and 0,100) on two VDEVs, uniform routing's 8 slots: only the device whose floor is
    100 keeps a shadow and sends its layers to the CPU (every one, once seen); the other's layers read their slots for
    every token and keep no shadow. The logits are the baseline's."""
    n = 64
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": GUARD_CTX, "n_tokens": n, "seed": 3}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=cache(-8, ",".join(map(str, floors))), **kw)
    assert np.array_equal(p["logits"], b["logits"])
    assert p["ext"]["params"]["EXPERT_CACHE_MIN_HIT"] == ",".join(map(str, floors))
    devs = _devices(p["ext"])
    assert len(devs) == 2 and sum(d["cache_layers"] for d in devs) == tiny_info["n_layer"]
    for d, floor in zip(devs, floors):
        if floor:
            assert d["cache_leaves"] == d["cache_cpu_layers"] == d["cache_layers"] and d["cache_cpu_ops"] > 0
            assert d["cache_shadow_hits"] + d["cache_shadow_misses"] == d["cache_layers"] * n * tiny_info["n_expert_used"]
        else:
            assert d["cache_leaves"] == d["cache_cpu_ops"] == d["cache_shadow_hits"] + d["cache_shadow_misses"] == 0
            assert d["cache_ops"] == OPS * d["cache_layers"] * n
        assert d["cache_hits"] + d["cache_misses"] == d["cache_ops"] // OPS * tiny_info["n_expert_used"]


def test_patched_servers_split_with_their_own_cpus_per_device(runner, patched_servers, baseline_decode,
                                                               assert_logits_match, tiny_info):
    """EXPERT_HYBRID=100,0 over two patched servers (sent as EXPERT_HYBRID@D with the other per-device switches): the
    first server's own CPU computes a share of its device's misses, which are then not copied into slots (its cache
    bytes fall short of its misses' bytes), the second's every miss goes up; one value for both (sent with the
    backend) splits on both. The logits are the baseline's."""
    one = expert_bytes_of_layer(synth.preset("tiny", seed=1))
    kw = {"devices": patched_servers, "placement": HOST_ALL, "ctx": DECODE, "n_tokens": 12}
    for value, splits in (("100,0", [True, False]), ("100", [True, True])):
        p = runner.logits("patched", env={**cache(-16), "GGML_SCHED_PP_EXPERT_HYBRID": value}, **kw)
        assert_logits_match(p["logits"], baseline_decode["logits"], f"EXPERT_HYBRID={value} on two patched servers")
        rpc = [b for b in p["ext"]["backends"] if b["name"].startswith("RPC")]
        assert len(rpc) == 2 and all(b["cache_ops"] > 0 and b["cache_misses"] > 0 for b in rpc)
        assert [b["cache_bytes"] < b["cache_misses"] * one for b in rpc] == splits, (value, rpc)
        assert all(b["cache_bytes"] == b["cache_misses"] * one for b, s in zip(rpc, splits) if not s)
