"""Virtual accelerator devices (VDEV): pipeline parallelism, expert traffic, link throttling, memory budget.

All runs in worker processes on the tiny model. Timing is only ever checked as a LOWER bound (a throttled
link cannot move X bytes in less than X / bandwidth), which a slow or loaded machine cannot break.
"""
from __future__ import annotations

import pytest

from pyllama_pp import WorkerError

CTX = {"n_ctx": 256, "n_batch": 128, "n_ubatch": 32}   # 64 tokens = 2 ubatches: pipelining can engage
N_TOKENS = 64
SLACK_S = 0.002   # the VDEV link returns up to 0.25 ms before a reserved slot ends; allow for it


def _devs(r: dict) -> list[dict]:
    devs = r["counters"]["devices"]
    assert [d["device"] for d in devs] == ["VDEV0", "VDEV1"], devs
    return devs


@pytest.fixture(scope="module")
def cpu_ref(runner):
    return runner.logits("baseline", devices="cpu", ctx=CTX, n_tokens=N_TOKENS)["logits"]


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_experts_on_device_pipeline_and_logits(runner, variant, cpu_ref, assert_logits_match):
    r = runner.logits(variant, devices="vdev:2x0@0", placement={"host_experts": "none"}, ctx=CTX, n_tokens=N_TOKENS)
    s = r["schedule"]
    # upstream keeps 4 graphs in flight; the patched build one per device (patch 0004)
    want = 4 if variant == "baseline" else 2
    assert s["pipeline_parallel"] is True and s["n_copies"] == want, (s["pipeline_parallel"], s["n_copies"])
    assert [b["name"] for b in s["backends"]][:2] == ["VDEV0", "VDEV1"]
    devs = _devs(r)
    assert all(d["graph_computes"] > 0 for d in devs), "both devices must compute"
    assert_logits_match(r["logits"], cpu_ref, f"{variant} 2 VDEVs (experts on device) vs CPU")


def test_baseline_host_experts_all_goes_through_vdev0(runner, tiny_cfg, cpu_ref, assert_logits_match):
    from pyllama_pp.synth import expert_bytes_per_layer

    r = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "all"}, ctx=CTX,
                      n_tokens=N_TOKENS)
    s = r["schedule"]
    assert s["pipeline_parallel"] is False and s["n_copies"] == 1, "upstream turns pipelining off for overrides"
    assert s["ext"] is None, "the baseline has no scheduler extension"
    v0, v1 = _devs(r)
    # upstream offloads every host-expert op to the first device, whichever device owns the layer
    assert v0["h2d_bytes"] >= expert_bytes_per_layer(tiny_cfg), v0
    assert v1["h2d_bytes"] < 0.05 * v0["h2d_bytes"], (v0["h2d_bytes"], v1["h2d_bytes"])
    assert_logits_match(r["logits"], cpu_ref, "baseline 2 VDEVs (host experts) vs CPU")


def test_experts_on_device_move_no_expert_bytes(runner, tiny_cfg):
    from pyllama_pp.synth import expert_bytes_per_layer

    r = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, ctx=CTX,
                      n_tokens=N_TOKENS)
    for d in _devs(r):
        assert d["h2d_bytes"] < expert_bytes_per_layer(tiny_cfg) / 4, d


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_unthrottled_link_charges_nothing(runner, variant):
    r = runner.logits(variant, devices="vdev:2x0@0", placement={"host_experts": "all"}, ctx=CTX, n_tokens=N_TOKENS)
    assert all(d["link_busy_s"] == 0 for d in _devs(r))


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_throttled_link_lower_bound(runner, variant):
    gbps = 0.25
    # (DIRECT off: a kernel's reads of host memory move at a share of the link - test_patched's direct tests)
    r = runner.logits(variant, devices=f"vdev:2x0@{gbps}GBps", placement={"host_experts": "all"}, ctx=CTX,
                      n_tokens=N_TOKENS, env={"GGML_SCHED_PP_DIRECT": 0})
    wall = r["seconds"]
    devs = _devs(r)
    for d in devs:
        moved = d["h2d_bytes"] + d["d2h_bytes"]          # both directions share the host link
        want = moved / (gbps * 1e9)
        assert d["link_busy_s"] == pytest.approx(want, rel=0.10, abs=1e-4), (d["device"], d["link_busy_s"], want)
        # X bytes over B GB/s cannot take less than X / B
        assert wall >= d["h2d_bytes"] / (gbps * 1e9) - SLACK_S, (d["device"], wall, d["h2d_bytes"])
        assert wall >= d["link_busy_s"] - SLACK_S, (d["device"], wall, d["link_busy_s"])
    big = max(devs, key=lambda d: d["h2d_bytes"])
    assert big["link_busy_s"] > 0.02, "the test needs a transfer long enough to measure"


def test_shared_link_serializes_both_devices(runner):
    gbps = 0.25
    # (DIRECT off in both: by default it is on only with links of their own, and reads other bytes than a copy)
    job = dict(placement={"host_experts": "all"}, ctx=CTX, n_tokens=N_TOKENS, env={"GGML_SCHED_PP_DIRECT": 0})
    shared = runner.logits("patched", devices=f"vdev:2x0@{gbps}GBps,shared", **job)
    dedicated = runner.logits("patched", devices=f"vdev:2x0@{gbps}GBps", **job)
    busy = [d["link_busy_s"] for d in _devs(shared)]
    assert min(busy) > 0.2 * sum(busy), f"both devices must use the link for this test to mean anything: {busy}"
    # one link: the two devices' transfers cannot overlap
    assert shared["seconds"] >= 0.9 * sum(busy), (shared["seconds"], busy)
    # sharing the link changes time, not the bytes each device moves
    assert [d["h2d_bytes"] for d in _devs(shared)] == [d["h2d_bytes"] for d in _devs(dedicated)]


@pytest.mark.parametrize("variant,placement", [("baseline", "none"), ("patched", "all"), ("baseline", "all")])
def test_memory_budget_too_small_is_an_error_not_a_crash(runner, variant, placement):
    with pytest.raises(WorkerError) as ei:
        runner.logits(variant, devices="vdev:2x1MiB@0", placement={"host_experts": placement}, ctx=CTX,
                      n_tokens=N_TOKENS)
    msg = f"{ei.value.error_type}: {ei.value} (exit code {ei.value.exit_code})"
    assert "killed by signal" not in msg and "exit code 3" in msg, f"the worker crashed:\n{msg}"
    assert "OutOfMemoryError" in msg or "ModelError" in msg, msg
    assert "memory" in msg.lower() or "alloc" in msg.lower(), msg
    # the failure is contained: the next job works
    r = runner.run(variant, {"kind": "schedule", "devices": "vdev:2x0@0", "placement": {"host_experts": placement},
                             "ctx": CTX}, cache=False)
    assert r["schedule"]["n_copies"] >= 1


def test_memory_budget_is_respected(runner):
    budget = 16 * 1024**2
    r = runner.logits("baseline", devices=f"vdev:2x{budget}@0", placement={"host_experts": "none"}, ctx=CTX,
                      n_tokens=N_TOKENS)
    mem = {m["buft"]: m for m in r["schedule"]["memory"]}  # device buffers: buft name = device name
    for d in _devs(r):
        assert d["failed_allocs"] == 0
        assert 0 < d["peak_alloc_bytes"] <= budget, d
        m = mem[d["device"]]
        assert d["alloc_bytes"] >= m["model_bytes"] + m["context_bytes"] + m["compute_bytes"], (d, m)


def test_device_count_per_process_and_names(runner):
    r = runner.schedule("baseline", devices="vdev:3x0@0", placement={"host_experts": "none"}, ctx=CTX)
    names = [b["name"] for b in r["schedule"]["backends"]]
    assert names[:3] == ["VDEV0", "VDEV1", "VDEV2"], names
    assert r["schedule"]["pipeline_parallel"] is True
