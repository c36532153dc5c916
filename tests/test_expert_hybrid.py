"""EXPERT_HYBRID (patch 0014, with EXPERT_CACHE) on VDEVs with every expert in host RAM: a cached layer's misses split
between the link (copied into slots, as without it) and the host CPU, which computes the layer's FFN for its share
from host memory while the device computes the rest; its rows of the last expert op are written over the device's
before the next split. The logits equal the baseline's and the cache's alone (on VDEVs both sides run the CPU's kernels
on the same bytes: the suite's NMSE bar of 1e-6, and they come out exact); the split follows the rule
(expert_cache_sim.link_share) and the counts are the simulator's on the traced ids; 0 is the cache alone."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama_pp import synth
from pyllama_pp.expert_cache_sim import hybrid, link_share
from pyllama_pp.expert_trace import ExpertTrace

from test_expert_cache import FAMILIES, HOST_ALL, TWO, _counts, cache, totals, upstream_servers  # noqa: F401

DECODE = {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}


def hybrid_env(slots: int, cpu_pct: int) -> dict:
    """-slots a layer, no guard, EXPERT_HYBRID=cpu_pct."""
    return {**cache(-slots), "GGML_SCHED_PP_EXPERT_HYBRID": cpu_pct}


def split_counts(ext: dict) -> dict:
    return {k: sum(b[k] for b in ext["backends"]) for k in ("cache_cpu_misses", "cache_hybrid_layers")}


# --- the rule ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("misses, cpu_pct, link", [
    (0, 100, 0), (1, 100, 1), (2, 100, 1), (3, 100, 2), (8, 100, 4),   # equal rates: half each, the odd one up
    (8, 0, 8), (5, 0, 5),                                              # off: every miss over the link
    (6, 200, 2), (7, 200, 3), (1, 10000, 1), (8, 10000, 1),            # a faster CPU: the link keeps one
    (6, 50, 4), (8, 20, 7),                                            # a slower CPU: most go up
])
def test_the_link_takes_its_share_of_a_tokens_misses(misses, cpu_pct, link):
    """k = ceil(m x 100 / (100 + N)): link k / R_link equals CPU (m - k) / R_cpu with N = 100 R_cpu / R_link, the
    rounding to the link (one miss alone goes up)."""
    k = link_share(misses, cpu_pct)
    assert k == link
    if misses and cpu_pct:
        # the fewest for which the link (k / R_link) takes no less than the CPU ((m - k) / R_cpu): one fewer and the
        # CPU would take longer
        assert k * cpu_pct >= 100 * (misses - k)
        assert k == 1 or (k - 1) * cpu_pct < 100 * (misses - k + 1)


def test_the_simulators_split_on_a_known_trace():
    """Two tokens at one layer, 4 slots, equal rates: token 0 misses 4 (2 up, 2 on the CPU), token 1 hits the 2 that
    went up and misses the 2 the CPU computed again (1 up, 1 on the CPU)."""
    ids = np.array([[[0, 1, 2, 3]], [[0, 1, 2, 3]]], dtype=np.int32)
    t = ExpertTrace(ids, [0], 8)
    assert hybrid(t, 4, 100) == {"lookups": 8, "hits": 2, "cpu_misses": 3, "link_misses": 3, "refills": 0}
    assert hybrid(t, 4, 0) == {"lookups": 8, "hits": 4, "cpu_misses": 0, "link_misses": 4, "refills": 0}


def test_the_simulators_refill_on_a_known_trace():
    """EXPERT_REFILL=1, the same two tokens: every miss is the CPU's; token 0 refills expert 0 (its first miss), token 1
    hits it and refills expert 1; nothing goes over the link before the compute."""
    ids = np.array([[[0, 1, 2, 3]], [[0, 1, 2, 3]]], dtype=np.int32)
    t = ExpertTrace(ids, [0], 8)
    assert hybrid(t, 4, 100, refill=1) == {"lookups": 8, "hits": 1, "cpu_misses": 7, "link_misses": 0, "refills": 2}
    assert hybrid(t, 4, 100, refill=2)["hits"] == 2


# --- numerics ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline_decode(runner):
    return runner.logits("baseline", devices=TWO, placement=HOST_ALL, ctx=DECODE, n_tokens=12)


def decode_against_the_cache_alone(runner, baseline_decode, assert_logits_match, env: dict, slots: int, what: str):
    """12 decoded tokens on two VDEVs with `env`: the logits are the baseline's and, bit for bit, the cache's alone
    with as many slots. Returns (the run, its cache totals, its split's counts)."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": DECODE, "n_tokens": 12}
    p = runner.logits("patched", env=env, **kw)
    alone = runner.logits("patched", env=hybrid_env(slots, 0), **kw)
    assert_logits_match(p["logits"], baseline_decode["logits"], what)
    assert np.array_equal(p["logits"], alone["logits"])
    return p, totals(p["ext"]), split_counts(p["ext"])


@pytest.mark.parametrize("slots, cpu_pct", [(2, 100), (8, 100), (8, 400), (64, 100)])
def test_decode_logits_equal_the_baseline_and_the_cache_alone(runner, baseline_decode, assert_logits_match, tiny_info,
                                                              slots, cpu_pct):
    """The tiny model on two VDEVs: each token's misses split (a token of 2 ids: one up, one on the CPU where both
    miss); the logits are the baseline's and the cache's alone; each CPU miss is one of the misses counted."""
    _, t, s = decode_against_the_cache_alone(runner, baseline_decode, assert_logits_match, hybrid_env(slots, cpu_pct),
                                             slots, f"EXPERT_HYBRID={cpu_pct}, {slots} slots")
    assert t["cache_ops"] == 3 * tiny_info["n_layer"] * 12
    assert t["cache_hits"] + t["cache_misses"] == tiny_info["n_layer"] * 12 * tiny_info["n_expert_used"]
    assert 0 < s["cache_cpu_misses"] < t["cache_misses"]
    assert s["cache_hybrid_layers"] <= s["cache_cpu_misses"]
    # only the link's misses were copied into slots
    one = t["cache_bytes"] // (t["cache_misses"] - s["cache_cpu_misses"])
    assert t["cache_bytes"] == one * (t["cache_misses"] - s["cache_cpu_misses"])


def test_zero_is_the_cache_alone(runner):
    """EXPERT_HYBRID=0 (the default): the same logits, bytes, copies and counters as the cache without the switch."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": DECODE, "n_tokens": 12}
    z = runner.logits("patched", env=hybrid_env(8, 0), **kw)
    p = runner.logits("patched", env=cache(-8), **kw)
    assert np.array_equal(z["logits"], p["logits"])
    assert _counts(z) == _counts(p)
    assert not any(split_counts(z["ext"]).values())


def test_each_device_takes_its_own_value_of_a_list(runner, baseline_decode, assert_logits_match):
    """EXPERT_HYBRID=0,400 on two VDEVs: only the second device's misses split with the host CPU (the first copies
    every miss into its slots); the logits are the baseline's."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": DECODE, "n_tokens": 12}
    p = runner.logits("patched", env={**cache(-8), "GGML_SCHED_PP_EXPERT_HYBRID": "0,400"}, **kw)
    assert_logits_match(p["logits"], baseline_decode["logits"], "EXPERT_HYBRID=0,400")
    first, second = [b for b in p["ext"]["backends"] if b["name"] != "CPU"]
    assert first["cache_misses"] > 0 and first["cache_cpu_misses"] == first["cache_hybrid_layers"] == 0
    assert 0 < second["cache_cpu_misses"] < second["cache_misses"] and second["cache_hybrid_layers"] > 0


def test_small_batches_split_their_misses_too(runner, assert_logits_match):
    """Ubatches of 4 tokens (the clone computes every selection of each token, the CPU's rows written back): the
    baseline's logits."""
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": {"n_ctx": 64, "n_batch": 4, "n_ubatch": 4}, "n_tokens": 24}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=hybrid_env(16, 100), **kw)
    assert_logits_match(p["logits"], b["logits"], "ub4, 16 slots, EXPERT_HYBRID=100")
    assert split_counts(p["ext"])["cache_cpu_misses"] > 0


@pytest.mark.parametrize("name, overrides", FAMILIES,
                         ids=[n + "".join(f"-{v}" for v in o.values()) for n, o in FAMILIES])
def test_decode_logits_equal_the_baseline_in_every_family(tmp_path_factory, assert_logits_match, name, overrides):
    """Every synth family the cache runs (attention, shared experts, dense first layers, gating, expert types and
    gpt-oss's expert biases differ): the baseline's logits, and the CPU computed misses in every family (gpt-oss's
    biases read the slots, so its FFN is one split on the device and the CPU's clone adds them)."""
    from conftest import JobRunner
    path = synth.cached_model(tmp_path_factory.getbasetemp() / "families", name, seed=1, **overrides)
    runner = JobRunner(str(path), tmp_path_factory.mktemp(name + "-hybrid"))
    kw = {"devices": TWO, "placement": HOST_ALL, "ctx": DECODE, "n_tokens": 6}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=hybrid_env(64, 100), **kw)
    assert_logits_match(p["logits"], b["logits"], name)
    assert split_counts(p["ext"])["cache_cpu_misses"] > 0


def test_rpc_devices_split_their_misses_with_this_hosts_cpu(runner, upstream_servers, baseline_decode,
                                                           assert_logits_match):
    """RPC devices (upstream's servers, the experts in this host's RAM): the FFN's input is read back over the network,
    this host's CPU computes its share and its rows go back as tensor sets; the baseline's logits."""
    p = runner.logits("patched", env=hybrid_env(16, 100), devices=upstream_servers, placement=HOST_ALL, ctx=DECODE,
                      n_tokens=12)
    assert_logits_match(p["logits"], baseline_decode["logits"], "RPC devices, EXPERT_HYBRID=100")
    rpc = [b for b in p["ext"]["backends"] if b["name"].startswith("RPC")]
    assert len(rpc) == 2 and all(b["cache_cpu_misses"] > 0 for b in rpc)


def refill_env(slots: int, refill: int) -> dict:
    """-slots a layer, no guard, EXPERT_HYBRID on, EXPERT_REFILL=refill."""
    return {**hybrid_env(slots, 100), "GGML_SCHED_PP_EXPERT_REFILL": refill}


@pytest.mark.parametrize("slots, refill", [(2, 1), (8, 1), (8, 2)])
def test_refills_keep_the_logits_and_copy_only_after_the_cpu(runner, baseline_decode, assert_logits_match, slots, refill):
    """EXPERT_REFILL: every miss of a decoded token is the CPU's (none goes up before the device computes), `refill` of
    them go into slots after it: the logits are the baseline's (and the cache's alone, bit for bit), the bytes copied
    into slots are the refills' and nothing else, and the slots serve later tokens (hits)."""
    p, t, s = decode_against_the_cache_alone(runner, baseline_decode, assert_logits_match, refill_env(slots, refill),
                                             slots, f"EXPERT_REFILL={refill}, {slots} slots")
    refills = sum(b["cache_refills"] for b in p["ext"]["backends"])
    assert s["cache_cpu_misses"] == t["cache_misses"] > 0 and t["cache_hits"] > 0
    assert 0 < refills <= refill * s["cache_hybrid_layers"]
    one = t["cache_bytes"] // refills
    assert t["cache_bytes"] == one * refills


def test_refills_from_an_mmaped_model_are_copied_by_the_cpus_graph(runner, baseline_decode, assert_logits_match):
    """From pageable memory (mmap) the CPU's graph copies each refill's bytes into its own pinned memory beside the
    FFN, so none goes through the staging copier's threads (which would contend with the CPU's); the cache alone on the
    same model stages every miss. The logits are the baseline's."""
    kw = {"devices": TWO, "placement": {**HOST_ALL, "load_mode": "mmap"}, "ctx": DECODE, "n_tokens": 12}
    p = runner.logits("patched", env=refill_env(8, 1), **kw)
    alone = runner.logits("patched", env=hybrid_env(8, 0), **kw)
    assert_logits_match(p["logits"], baseline_decode["logits"], "EXPERT_REFILL=1, mmap")
    assert totals(p["ext"])["cache_bytes"] > 0 and sum(b["staged_bytes"] for b in p["ext"]["backends"]) == 0
    assert sum(b["staged_bytes"] for b in alone["ext"]["backends"]) == totals(alone["ext"])["cache_bytes"] > 0


def test_refills_read_the_expert_biases_slots_too(tmp_path_factory, assert_logits_match):
    """gpt-oss (expert biases: a refill copies a bias row beside its experts' matrices), from an mmap-ed model: the
    baseline's logits."""
    from conftest import JobRunner
    path = synth.cached_model(tmp_path_factory.getbasetemp() / "families", "gptoss-tiny", seed=1)
    runner = JobRunner(str(path), tmp_path_factory.mktemp("gptoss-refill"))
    kw = {"devices": TWO, "placement": {**HOST_ALL, "load_mode": "mmap"}, "ctx": DECODE, "n_tokens": 6}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=refill_env(8, 1), **kw)
    assert_logits_match(p["logits"], b["logits"], "gptoss-tiny, EXPERT_REFILL=1")
    assert sum(x["cache_refills"] for x in p["ext"]["backends"]) > 0


# --- the counters -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("slots, cpu_pct, n_ubatch", [(2, 100, 1), (8, 100, 1), (8, 300, 1), (16, 50, 1), (16, 100, 4)])
def test_the_split_is_the_simulators_on_the_traced_ids(runner, slots, cpu_pct, n_ubatch):
    """The routing ids of 40 tokens recorded by the trace, then the same tokens decoded with the hybrid: its hits, CPU
    misses and link misses are pyllama_pp.expert_cache_sim.hybrid's on those ids."""
    ctx = {"n_ctx": 64, "n_batch": n_ubatch, "n_ubatch": n_ubatch}
    n_prompt, n_decode = (40, 0) if n_ubatch > 1 else (0, 40)
    tr = runner.run("patched", {"kind": "trace", "devices": "vdev:1x0@0.5", "placement": HOST_ALL, "ctx": ctx,
                                "n_prompt": n_prompt, "n_decode": n_decode, "seed": 7})
    trace = ExpertTrace(tr["ids"], tr["layers"], tr["n_expert"])
    sim = hybrid(trace, slots, cpu_pct)
    p = runner.logits("patched", devices="vdev:1x0@0.5", placement=HOST_ALL, ctx=ctx, tokens=tr["tokens"],
                      env=hybrid_env(slots, cpu_pct))
    t, s = totals(p["ext"]), split_counts(p["ext"])
    assert t["cache_hits"] + t["cache_misses"] == sim["lookups"]
    assert (t["cache_hits"], s["cache_cpu_misses"]) == (sim["hits"], sim["cpu_misses"]), (t, s, sim)
    assert t["cache_misses"] - s["cache_cpu_misses"] == sim["link_misses"]


@pytest.mark.parametrize("slots, refill", [(2, 1), (8, 1), (16, 2)])
def test_refills_are_the_simulators_on_the_traced_ids(runner, slots, refill):
    """The traced ids of 40 decoded tokens again, with EXPERT_REFILL: hits, CPU misses and refills are
    expert_cache_sim.hybrid's with `refill`."""
    ctx = {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}
    tr = runner.run("patched", {"kind": "trace", "devices": "vdev:1x0@0.5", "placement": HOST_ALL, "ctx": ctx,
                                "n_prompt": 0, "n_decode": 40, "seed": 7})
    sim = hybrid(ExpertTrace(tr["ids"], tr["layers"], tr["n_expert"]), slots, 100, refill=refill)
    p = runner.logits("patched", devices="vdev:1x0@0.5", placement=HOST_ALL, ctx=ctx, tokens=tr["tokens"],
                      env=refill_env(slots, refill))
    t, s = totals(p["ext"]), split_counts(p["ext"])
    refills = sum(b["cache_refills"] for b in p["ext"]["backends"])
    assert (t["cache_hits"], s["cache_cpu_misses"], refills) == (sim["hits"], sim["cpu_misses"], sim["refills"]), (t, s, sim)
