"""The soak (pyllama_pp.soak, bench/soak.py), CI-sized: 60 mixed calls in one context on two VDEVs with every
expert in host RAM, in a worker (this process never loads a variant), against a fresh session in another."""
from __future__ import annotations

import copy

import pytest

from pyllama_pp import soak

DEVS = "vdev:2x256MiB@4GBps"


@pytest.fixture(scope="module")
def patched_soak(tiny_model, tmp_path_factory):
    return soak.run(tiny_model, "patched", devices=DEVS, calls=60, check_every=10,
                    workdir=str(tmp_path_factory.mktemp("soak")), timeout=120)


def test_soak_holds_memory_and_logits(patched_soak):
    r = patched_soak
    assert r.problems == [] and r.ok
    # warm-up (24 sizes + 4) then every recipe once, then a checkpoint every 10 calls and at the end
    assert r.calls == 60 and r.checkpoints == 5 + 4 and r.evals > r.calls
    assert r.matched == r.checkpoints and r.exact == r.checkpoints and r.nmse_max == 0.0
    assert all(a == r.alloc_bytes[0] for a in r.alloc_bytes) and len(r.alloc_bytes[0]) == 2
    assert all(b > 1 << 20 for b in r.alloc_bytes[0])     # compute buffers and KV on each VDEV
    assert abs(r.rss_growth) <= soak.RSS_GROWTH_MAX and r.rss_warm > r.rss_start


def test_soak_mixes_what_it_says(patched_soak):
    r = patched_soak
    assert r.shifts > 0 and r.rewinds > 0 and r.clears > 0
    for k in ("prompt", "continue", "rewind", "shift", "out all", "out last", "out none", "out rows"):
        assert r.counts.get(k, 0) > 0, (k, r.counts)
    bands = r.bands
    assert set(bands) == {"below offload", "offload, below upload-all", "above upload-all"}, bands
    # below the op-offload threshold the expert weights stay on the host: a few KB of inputs per call, not MBs
    per_call = {k: b["h2d_bytes"] / b["calls"] for k, b in bands.items()}
    assert per_call["below offload"] * 20 < per_call["offload, below upload-all"] < per_call["above upload-all"]
    assert r.ext["upload_all"] > 0 and r.ext["gather"] > 0       # both sides of the patched upload-all bar


def test_judge_reports_each_failure(patched_soak):
    """The limits are applied: moved device memory, RSS growth and a logits mismatch each become a problem."""
    res = {"calls": 60, "evals": 1, "shifts": 0, "rewinds": 0, "clears": 0, "seconds": 1.0, "rss_start": 1,
           "counts": {}, "bands": {}, "ext": None, "checkpoints": copy.deepcopy(patched_soak.rows)}
    assert soak.judge(res, "patched", DEVS).problems == []
    last = res["checkpoints"][-1]
    last["alloc_bytes"] = [last["alloc_bytes"][0] + 4096, last["alloc_bytes"][1]]
    last["rss_bytes"] = int(res["checkpoints"][0]["rss_bytes"] * 1.2)
    last["nmse"], last["exact"] = 1e-3, False
    probs = soak.judge(res, "patched", DEVS).problems
    assert len(probs) == 3, probs
    assert any("device memory moved" in p for p in probs)
    assert any("RSS grew" in p for p in probs)
    assert any("NMSE 1.000e-03" in p for p in probs)


def test_recipes_agree_across_variants(tiny_model, tmp_path):
    """The checkpoint recipes (a clear, a continuation, 300 tokens, a context shift, a rewind) in fresh sessions of
    both variants: the same logits bit for bit (the K-shift graph runs through the patched scheduler too)."""
    import numpy as np
    from pyllama_pp.worker import run_job
    job = {"kind": "soak", "model": tiny_model, "devices": DEVS, "placement": {"host_experts": "all"},
           "ctx": {"n_ctx": 1024, "n_batch": 512, "n_ubatch": 128}, "reference": True}
    for v in ("baseline", "patched"):
        assert run_job({**job, "out": str(tmp_path / f"{v}.npz")}, v, timeout=120) == {"recipes": 5}
    with np.load(tmp_path / "baseline.npz") as b, np.load(tmp_path / "patched.npz") as p:
        assert b.files == p.files == [f"r{j}" for j in range(5)]
        for k in b.files:
            assert b[k].shape[0] > 0 and np.array_equal(b[k], p[k]), k
