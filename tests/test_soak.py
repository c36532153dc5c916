"""The soak (pyllama_pp.soak, bench/soak.py), CI-sized: 60 mixed calls in one context on two VDEVs with every
expert in host RAM, in a worker (this process never loads a variant), against a fresh session in another."""
from __future__ import annotations

import copy

import pytest

from pyllama_pp import soak, synth

DEVS = "vdev:2x256MiB@4GBps"
MiB = 1024 * 1024


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


@pytest.fixture(scope="module")
def cache_soak(tiny_model, tmp_path_factory):
    """40 mixed calls with EXPERT_CACHE=1: 1 MiB of expert slots a device, fewer than the experts."""
    return soak.run(tiny_model, "patched", devices=DEVS, calls=40, check_every=10,
                    workdir=str(tmp_path_factory.mktemp("soak-cache")), timeout=120, switches={"EXPERT_CACHE": 1})


def test_soak_with_the_expert_cache_keeps_its_slots_in_their_budget(cache_soak, tiny_cfg):
    """The soak with the device expert cache: the slots are allocated before the first judged call and stay within
    the switch's MiB, the devices' memory never moves after the warm-up, and every checkpoint's logits equal a fresh
    session's. Calls below the threshold fetch experts into the slots (without the cache: a few KB of inputs a call,
    test_soak_mixes_what_it_says). Slots past the budget would be a problem of the judge's."""
    r = cache_soak
    assert r.problems == [] and r.ok and r.exact == r.checkpoints
    assert all(a == r.alloc_bytes[0] for a in r.alloc_bytes)
    assert r.expert_cache == 1 and len(r.cache_buffer_bytes) == 2
    assert all(0 < n <= MiB for n in r.cache_buffer_bytes.values()), r.cache_buffer_bytes
    assert r.ext["cache_ops"] > 0 and r.ext["cache_hits"] + r.ext["cache_misses"] > r.ext["cache_misses"] > 0
    below = r.bands["below offload"]
    assert below["h2d_bytes"] > below["calls"] * synth.expert_bytes_per_layer(tiny_cfg) // tiny_cfg.n_expert
    res = {"calls": 40, "evals": 1, "shifts": 0, "rewinds": 0, "clears": 0, "seconds": 1.0, "rss_start": 1,
           "counts": {}, "bands": {}, "ext": None, "expert_cache": 1, "checkpoints": copy.deepcopy(r.rows)}
    assert soak.judge(res, "patched", DEVS).problems == []
    res["checkpoints"][-1]["cache_buffer_bytes"] = {"VDEV1": MiB + 1}
    (problem,) = soak.judge(res, "patched", DEVS).problems
    assert problem.startswith("expert slots past EXPERT_CACHE=1 MiB at call 40: VDEV1 1048577 bytes"), problem


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


# ---------------------------------------------------------------------------------------------------------
# CUDA devices: memory in use as cudaMemGetInfo reports it, judged with a tolerance; no GPU needed

GiB = 1024 * MiB


def _cuda_res(used: list, warm: int = 2) -> dict:
    """A soak job's result on two CUDA devices: one checkpoint per entry of `used` (bytes in use per device), the
    first `warm` of them in the warm-up."""
    cps = [{"call": 30 + 10 * i, "recipe": i % 5, "warmup": i < warm, "nmse": 0.0, "exact": True, "seconds": 1.0 + i,
            "rss_untrimmed": 300 * MiB, "rss_bytes": 200 * MiB, "alloc_bytes": [], "peak_alloc_bytes": [],
            "failed_allocs": 0, "cuda_used_bytes": list(u)} for i, u in enumerate(used)]
    return {"calls": cps[-1]["call"], "evals": 80, "shifts": 3, "rewinds": 2, "clears": 20, "seconds": 9.0,
            "rss_start": 150 * MiB, "counts": {}, "bands": {"below offload": {"calls": 3, "tokens": 9, "h2d_bytes": 0}},
            "ext": None, "checkpoints": cps,
            "cuda_devices": [{"name": "CUDA0", "description": "NVIDIA H200", "total_bytes": 140 * GiB,
                              "used_bytes": 600 * MiB},
                             {"name": "CUDA1", "description": "NVIDIA H200", "total_bytes": 140 * GiB,
                              "used_bytes": 7 * GiB}]}


def test_judge_cuda_memory_within_tolerance():
    """CUDA's pools may move a little: max(16 MiB, 0.5%) of the first checkpoint after the warm-up, per device; the
    warm-up's own checkpoints (the pools still growing) are not judged."""
    assert soak.cuda_tolerance(1 * GiB) == 16 * MiB and soak.cuda_tolerance(8 * GiB) == int(0.005 * 8 * GiB)
    a, b = 1 * GiB, 8 * GiB            # tolerances 16 MiB and 40.96 MiB
    used = [(a - 300 * MiB, b - 900 * MiB), (a - 2 * MiB, b),          # the warm-up (not judged)
            (a, b), (a + 10 * MiB, b - 40 * MiB), (a - 15 * MiB, b + 2 * MiB), (a + 4 * MiB, b)]
    r = soak.judge(_cuda_res(used), "patched", "cuda:0,1")
    assert r.problems == [] and r.ok, r.problems
    c = r.cuda
    assert c["devices"] == ["CUDA0", "CUDA1"] and c["flat"] is True
    assert c["used_bytes"] == [list(u) for u in used[2:]] and c["warm_used_bytes"] == list(used[1])
    assert c["drift_bytes"] == [-15 * MiB, -40 * MiB]                 # the largest move, signed
    assert c["tolerance_bytes"] == [16 * MiB, int(0.005 * b)]
    assert c["total_bytes"] == [140 * GiB] * 2 and c["used_start_bytes"] == [600 * MiB, 7 * GiB]
    d = r.to_dict()
    assert d["cuda"] == c and d["ok"] is True


def test_judge_cuda_memory_drift_is_a_problem_per_device():
    a, b = 1 * GiB, 8 * GiB
    used = [(a, b), (a, b), (a, b), (a + 17 * MiB, b + 20 * MiB), (a + 3 * MiB, b - 42 * MiB)]
    r = soak.judge(_cuda_res(used, warm=1), "baseline", "cuda")
    assert not r.ok and r.cuda["flat"] is False
    assert r.cuda["drift_bytes"] == [17 * MiB, -42 * MiB]
    assert len(r.problems) == 2, r.problems
    p0, p1 = r.problems
    assert p0.startswith("CUDA0:") and f"{a} -> {a + 17 * MiB} bytes" in p0 and "+17.0 MiB" in p0
    assert "at call 60" in p0 and "more than 16.0 MiB" in p0
    assert p1.startswith("CUDA1:") and f"{b} -> {b - 42 * MiB} bytes" in p1 and "-42.0 MiB" in p1
    assert "at call 70" in p1 and "more than 41.0 MiB" in p1
    # one device that moved, by one byte more than its tolerance: one problem, naming that device only
    used = [(a, b), (a, b + int(0.005 * b) + 1), (a + 16 * MiB, b)]
    r = soak.judge(_cuda_res(used, warm=0), "patched", "cuda")
    assert len(r.problems) == 1 and r.problems[0].startswith("CUDA1:"), r.problems
    # the VDEV check is untouched: no CUDA figures, no `cuda` in the result
    res = _cuda_res([(a, b)] * 3, warm=1)
    for cp in res["checkpoints"]:
        del cp["cuda_used_bytes"]
    del res["cuda_devices"]
    r = soak.judge(res, "patched", DEVS)
    assert r.ok and r.cuda is None and "cuda" not in r.to_dict()


def test_cuda_memory_reads_the_sessions_devices(monkeypatch):
    """The worker's reading: memory_total - memory_free of the session's CUDA devices, in the spec's order."""
    from types import SimpleNamespace

    from pyllama_pp import devices as devspec
    from pyllama_pp.worker.handlers import soak as soak_worker
    found = [{"name": "CPU", "backend": "CPU", "description": "cpu", "memory_total": 64 * GiB, "memory_free": GiB}]
    found += [{"name": f"CUDA{i}", "backend": "CUDA", "description": "NVIDIA H200", "memory_total": 140 * GiB,
               "memory_free": 140 * GiB - (i + 1) * 100 * MiB} for i in range(3)]
    monkeypatch.setattr(soak_worker, "list_devices", lambda variant=None: found)
    got = soak_worker.cuda_memory(SimpleNamespace(spec=devspec.parse("cuda:2,0")))
    assert [(d["name"], d["used_bytes"], d["total_bytes"]) for d in got] == \
        [("CUDA2", 300 * MiB, 140 * GiB), ("CUDA0", 100 * MiB, 140 * GiB)]
    assert [d["name"] for d in soak_worker.cuda_memory(SimpleNamespace(spec=devspec.parse("cuda")))] == \
        ["CUDA0", "CUDA1", "CUDA2"]
    assert soak_worker.cuda_memory(SimpleNamespace(spec=devspec.parse(DEVS))) == []


def test_cuda_default_is_two_devices():
    """`--devices cuda`: the first two CUDA devices (one where there is one); a spec that names devices is kept."""
    def devs(n):
        return [{"backend": "CPU"}] + [{"backend": "CUDA"}] * n
    assert soak.cuda_pair("cuda", devs(8)) == "cuda:0,1"
    assert soak.cuda_pair("cuda", devs(2)) == "cuda:0,1"
    assert soak.cuda_pair("CUDA", devs(1)) == "cuda:0"
    assert soak.cuda_pair("cuda", devs(0)) == "cuda"          # the worker says why
    assert soak.cuda_pair("cuda:0", devs(8)) == "cuda:0"
    assert soak.cuda_pair("cuda:0,1,2", devs(8)) == "cuda:0,1,2"
    assert soak.cuda_pair(DEVS, devs(2)) == DEVS
    assert soak.soak_devices(DEVS) == DEVS                      # (no worker for a spec that is not `cuda`)


def _soak_script():
    """bench/soak.py (a script, not part of the package)."""
    import importlib.util
    import sys
    from pathlib import Path
    bench_dir = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench_dir)   # it imports _common from its folder
    try:
        spec = importlib.util.spec_from_file_location("soak_script_under_test", Path(bench_dir) / "soak.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(bench_dir)


def test_soak_table_shows_cuda_memory(patched_soak):
    """bench/soak.py's tables: CUDA memory in use (MiB) per device where the devices are CUDA's, VDEV allocations
    as before otherwise."""
    script = _soak_script()
    a, b = 1 * GiB, 8 * GiB
    ok = soak.judge(_cuda_res([(a, b), (a, b), (a + 5 * MiB, b - 3 * MiB)], warm=1), "patched", "cuda:0,1")
    bad = soak.judge(_cuda_res([(a, b), (a, b), (a + 20 * MiB, b)], warm=1), "baseline", "cuda:0,1")
    t = script.table([bad, ok])
    assert "| CUDA in use per device MiB |" in t and "alloc per VDEV" not in t, t
    assert "| 1029.0 / 8189.0 (flat, drift +5.0) |" in t and "| 1044.0 / 8192.0 (MOVED, drift +20.0) |" in t, t
    assert "| FAIL |" in t and "| ok |" in t
    assert "| n/a |" in script.band_table([ok])
    lines = script.cuda_lines(ok)
    assert len(lines) == 2 and lines[0].startswith("patched CUDA0 in use MiB (of 143360.0): start 600.0, warm 1024.0")
    assert lines[1].endswith("after: 8192.0 8189.0; largest drift -3.0 (at most 41.0)"), lines[1]
    v = script.table([patched_soak])
    assert "| alloc per VDEV |" in v and "(flat)" in v and "CUDA" not in v, v
    assert "n/a" not in script.band_table([patched_soak])


def test_soak_vram_line_names_the_slots_and_their_hits(patched_soak, cache_soak):
    """bench/soak.py's VRAM line: each VDEV's allocation at the warm-up's end and after the last call, flat at every
    checkpoint after it, the peak, and with the cache its slots' share and hits."""
    script = _soak_script()
    plain, cached = script.vram_line(patched_soak), script.vram_line(cache_soak)
    for r, line in ((patched_soak, plain), (cache_soak, cached)):
        assert line.startswith("patched VRAM (allocated per VDEV): ") and f"after call {r.calls}, the same at all " \
            f"{len(r.alloc_bytes) - 1} checkpoints after the warm-up; peak " in line, line
    assert "expert slots" not in plain
    ext = cache_soak.ext
    assert "(EXPERT_CACHE=1), which read " in cached and f"{ext['cache_hits']} hits, {ext['cache_misses']} misses" in cached
    moved = copy.deepcopy(cache_soak)
    moved.alloc_bytes[-1] = [a + 1 for a in moved.alloc_bytes[-1]]
    assert ", MOVED at all " in script.vram_line(moved)
