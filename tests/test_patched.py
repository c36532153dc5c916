"""The patched build on 2 VDEVs with every expert in host RAM: pipelining, per-device expert traffic,
numerics against the baseline (also with each switch off), device memory and the upload-all path.
Shared helpers first, then one banner per patch of the series (patches/), in series order."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest

from pyllama_pp import model_file, synth
from pyllama_pp.defaults import usable_cores


CTX = {"n_ctx": 256, "n_batch": 128, "n_ubatch": 32}   # 64 tokens = 2 ubatches


N_TOKENS = 64


HOST_ALL = {"host_experts": "all"}


DEVS = "vdev:2x0@0"


SWITCHES = ("GATE", "OWNER_OFFLOAD", "EARLY_INPUTS", "UPLOAD_ALL", "STABLE_RESERVE")


FORCE_UPLOAD_ALL = {"GGML_SCHED_PP_UPLOAD_ALL_MIN": 1, "GGML_SCHED_PP_UPLOAD_ALL_MIN_COV": 0}


def _off(name: str) -> dict:
    return {f"GGML_SCHED_PP_{name}": 0}


# the device's own gather of the used experts (patch 0010, on by default wherever a gather exists: VDEVs have one)
NO_GATHER = _off("GATHER")


# the selective copy on every device (patch 0008 makes DIRECT the default on every GPU but the first, 0010 GATHER on
# every device with a gather): for tests of the transient-copy machinery itself
NO_DIRECT = {**_off("DIRECT"), **NO_GATHER}


# uploads on the split's own stream (the default; pinned so the OVERLAP tests keep their control if it changes)
OVERLAP_OFF = _off("OVERLAP")


def _ext_backend(ext: dict, name: str) -> dict:
    for b in ext["backends"]:
        if b["name"] == name:
            return b
    raise AssertionError(f"no backend {name} in ext counters: {[b['name'] for b in ext['backends']]}")


def _h2d_by_device(r: dict) -> dict:
    """Bytes each VDEV's link moved host -> device in a job's result."""
    return {d["device"]: d["h2d_bytes"] for d in r["counters"]["devices"]}


def _compute_bytes(r: dict) -> dict:
    """Compute buffer bytes per buffer type in a job's schedule."""
    return {m["buft"]: m["compute_bytes"] for m in r["schedule"]["memory"]}


def _vdev_compute_buffers(r: dict) -> dict:
    """Each VDEV backend's compute buffer bytes in a job's schedule."""
    return {x["name"]: x["compute_buffer_bytes"] for x in r["schedule"]["backends"] if x["name"].startswith("VDEV")}


def _early_uploads(ext: dict) -> int:
    """Uploads the scheduler queued on a second stream (OVERLAP) over all backends."""
    return sum(x["overlap_uploads"] for x in ext["backends"])


def layers_per_device(model_path: str, schedule: dict, host_layers=None) -> dict[str, int]:
    """How many layers each VDEV owns, from the model bytes the schedule reports on it.

    Layers are assigned to devices in order; a layer's bytes on its device are its weights minus the expert
    tensors kept in host RAM (`host_layers`, default: all). The last device also holds the output layer
    (output + output_norm); the token embeddings stay on the host."""
    hdr = model_file.read_gguf_header(model_path)
    layer_bytes: dict[int, int] = {}
    out_bytes = 0
    for t in hdr["tensors"]:
        m = re.match(r"blk\.(\d+)\.", t["name"])
        if m:
            i = int(m.group(1))
            on_host = "_exps" in t["name"] and (host_layers is None or i in host_layers)
            layer_bytes[i] = layer_bytes.get(i, 0) + (0 if on_host else t["nbytes"])
        elif t["name"].startswith("output"):
            out_bytes += t["nbytes"]
    # llama's memory breakdown comes in no fixed order: layers go to the devices in device order
    # (device buffers only: VDEV_Host, the pinned host buffer type, also belongs to VDEV0)
    rows = sorted((m for m in schedule["memory"] if re.fullmatch(r"VDEV\d+", m["buft"])), key=lambda m: int(m["buft"][4:]))
    counts, il = {}, 0
    for k, m in enumerate(rows):
        want = m["model_bytes"] - (out_bytes if k == len(rows) - 1 else 0)
        got, n = 0, 0
        while got < want and il < len(layer_bytes):
            got += layer_bytes[il]
            il, n = il + 1, n + 1
        assert got == want, f"{m['buft']}: {m['model_bytes']} model bytes are not a run of whole layers"
        counts[m["buft"]] = n
    assert il == len(layer_bytes), f"layer counts {counts} do not add up to {len(layer_bytes)}"
    return counts


@pytest.fixture(scope="module")
def patched_all(runner):
    return runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS)


@pytest.fixture(scope="module")
def baseline_all(runner):
    return runner.logits("baseline", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS)


def _decode_ctx():
    return {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}


CASES = [("ubatch16", {"n_ctx": 256, "n_batch": 128, "n_ubatch": 16}, 96),
         ("ubatch32", {"n_ctx": 256, "n_batch": 128, "n_ubatch": 32}, 96),
         ("ubatch64", {"n_ctx": 256, "n_batch": 128, "n_ubatch": 64}, 128),
         ("decode", _decode_ctx(), 4)]


def _baseline_off_on(runner, devs: str, ub: int, env: dict, switch: dict):
    """Logits of 4 ubatches: the baseline, the patched build with `env`, and with `env` plus `switch`."""
    kw = {"devices": devs, "placement": HOST_ALL, "ctx": {"n_ctx": 512, "n_batch": 4 * ub, "n_ubatch": ub},
          "n_tokens": 4 * ub}
    return (runner.logits("baseline", **kw), runner.logits("patched", env=env, **kw),
            runner.logits("patched", env={**env, **switch}, **kw))


BENCH_CTX = {"n_ctx": 256, "n_batch": 128, "n_ubatch": 32}   # 64 expert selections a ubatch: ~40 of 64 used


def _bench(runner, env):
    r = runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL, "ctx": BENCH_CTX,
                               "tests": [["pp", 128]], "reps": 1}, env=env)
    assert r["schedule"]["pipeline_parallel"] is True
    (t,) = r["tests"]
    assert t["kind"] == "pp" and t["n"] == 128 and len(t["seconds"]) == 1
    return t


MIXED = [["pp", 64], ["pp", 128], ["tg", 4]]


def _mixed(runner, variant: str, env: Optional[dict]) -> dict:
    """The MIXED workload, 2 rounds, with every step's logits; identical runs are made once per session (the
    runner caches the result, the logits stay in its folder)."""
    out = runner.outdir / ("mixed-" + hashlib.md5(json.dumps([variant, env], sort_keys=True, default=str).encode()).hexdigest()[:12] + ".npy")
    job = {"kind": "workload", "devices": DEVS, "placement": HOST_ALL,
           "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 32}, "workload": MIXED, "rounds": 2, "out": str(out)}
    r = runner.run(variant, job, env=env)
    return {**r, "logits": np.load(out)}


ONE = "vdev:1x0@0.2"


# === 0002 GATE: pipelining kept with host weights, as transient copies; one device pipelined too ====================


def test_pipeline_stays_on_with_host_experts(patched_all):
    s = patched_all["schedule"]
    # one graph in flight per device (two VDEVs), not upstream's 4 (patch 0004)
    assert s["pipeline_parallel"] is True and s["n_copies"] == 2, (s["pipeline_parallel"], s["n_copies"])
    ext = patched_all["ext"]
    assert ext is not None and ext["n_copies"] == 2
    assert ext["transient_inputs"] > 0, "host experts must be staged as transient copies"
    assert ext["params"]["GATE"] == 1
    assert ext["offload_owner"] > 0, "offloaded expert ops should run on the layer's owner"


def test_patched_moves_no_more_expert_bytes_than_baseline(runner, patched_all, baseline_all):
    """Without PREFETCH the patched build moves what the baseline moves (within 5%); PREFETCH (on by default with
    OVERLAP=2 since fit plans its copy) also moves the experts a gate used last time and does not use again: at
    most 10% more here, and only where it prefetched."""
    b = sum(d["h2d_bytes"] for d in baseline_all["counters"]["devices"])
    no_pf = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS, env=_off("PREFETCH"))
    p0 = sum(d["h2d_bytes"] for d in no_pf["counters"]["devices"])
    p = sum(d["h2d_bytes"] for d in patched_all["counters"]["devices"])
    assert no_pf["ext"]["prefetch"] == 0 and p0 <= 1.05 * b, (p0, b)
    assert patched_all["ext"]["prefetch"] > 0 and p0 <= p <= 1.10 * b, (p, p0, b)


@pytest.mark.parametrize("switch", [None, *SWITCHES])
@pytest.mark.parametrize("case,ctx,n_tokens", CASES, ids=[c[0] for c in CASES])
def test_logits_match_baseline(runner, case, ctx, n_tokens, switch, assert_logits_match):
    env = _off(switch) if switch else None
    ref = runner.logits("baseline", devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=n_tokens)
    r = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=n_tokens, env=env)
    if switch:
        assert r["ext"]["params"][switch] == 0, f"GGML_SCHED_PP_{switch}=0 was not applied"
    assert_logits_match(r["logits"], ref["logits"],
                        f"patched ({switch or 'all switches on'}=0) vs baseline, {case}" if switch
                        else f"patched vs baseline, {case}")


def test_ubatch32_really_streams_experts_in_both_builds(runner):
    """The numerics comparison above is only meaningful if host experts were offloaded in both builds."""
    ctx = CASES[1][1]
    for v in ("baseline", "patched"):
        r = runner.logits(v, devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=96)
        assert sum(d["h2d_bytes"] for d in r["counters"]["devices"]) > 1_000_000, v


@pytest.mark.parametrize("how", ["env", "switches"])
def test_gate_off_behaves_like_baseline(runner, baseline_all, how):
    if how == "env":
        r = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS,
                          env=_off("GATE"))
    else:
        r = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS,
                          switches={"GATE": 0})
    s = r["schedule"]
    assert s["pipeline_parallel"] is False and s["n_copies"] == 1, "GATE=0 must turn pipelining off"
    assert s["n_copies"] == baseline_all["schedule"]["n_copies"]
    assert r["ext"]["params"]["GATE"] == 0
    assert r["ext"]["transient_inputs"] == 0


def test_gate_off_turns_pipelining_off(runner):
    r = runner.schedule("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, env=_off("GATE"))
    assert r["schedule"]["pipeline_parallel"] is False and r["schedule"]["n_copies"] == 1


def test_device_compute_buffers_stay_small(runner, tiny_cfg, patched_all, baseline_all):
    """Pipelining must not keep n_copies persistent device copies of the host experts: the patched compute
    buffer of each device is at most the baseline's plus two expert tensors."""
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    base = {b["name"]: b["compute_buffer_bytes"] for b in baseline_all["schedule"]["backends"]}
    vdevs = [b for b in patched_all["schedule"]["backends"] if b["name"].startswith("VDEV")]
    assert len(vdevs) == 2, patched_all["schedule"]["backends"]
    for b in vdevs:
        limit = base[b["name"]] + 2 * one_expert_tensor
        assert b["compute_buffer_bytes"] <= limit, \
            f"{b['name']}: {b['compute_buffer_bytes']} B > baseline {base[b['name']]} + 2 x {one_expert_tensor}"


def test_device_compute_buffers_stay_small_at_larger_ubatch(runner, tiny_cfg):
    ctx = {"n_ctx": 512, "n_batch": 256, "n_ubatch": 128}
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    b = {x["name"]: x["compute_buffer_bytes"]
         for x in runner.schedule("baseline", devices=DEVS, placement=HOST_ALL, ctx=ctx)["schedule"]["backends"]}
    p = runner.schedule("patched", devices=DEVS, placement=HOST_ALL, ctx=ctx)["schedule"]
    assert p["pipeline_parallel"] is True
    vdevs = [x for x in p["backends"] if x["name"].startswith("VDEV")]
    assert len(vdevs) == 2, p["backends"]
    for x in vdevs:
        assert x["compute_buffer_bytes"] <= b[x["name"]] + 2 * one_expert_tensor, (x, b[x["name"]])


@pytest.mark.parametrize("ub", [32, 128])
def test_memory_bound_at_the_memory_ab_geometry(runner, tiny_cfg, ub):
    """The memory bound as lab/memory_ab.py measures it (ts 3,5, n_ctx 2304, n_batch = 16 x n_ubatch): each
    device's compute buffer <= baseline + 2 x the largest expert tensor. At n_ubatch 128 the second device needs
    one device copy of the user inputs (EARLY_INPUTS, patch 0004): a copy per graph in flight (mostly the KQ
    mask, EARLY_INPUTS=0) takes it over."""
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    placement = {**HOST_ALL, "tensor_split": [3, 5]}
    ctx = {"n_ctx": 2304, "n_batch": 16 * ub, "n_ubatch": ub}
    b = _vdev_compute_buffers(runner.schedule("baseline", devices=DEVS, placement=placement, ctx=ctx))
    p = runner.schedule("patched", devices=DEVS, placement=placement, ctx=ctx)
    unshared = _vdev_compute_buffers(runner.schedule("patched", devices=DEVS, placement=placement, ctx=ctx, env=_off("EARLY_INPUTS")))
    assert p["schedule"]["pipeline_parallel"] is True and len(b) == 2
    for name, x in _vdev_compute_buffers(p).items():
        assert x <= b[name] + 2 * one_expert_tensor, (name, x, b[name], one_expert_tensor)
        assert x < unshared[name], (name, x, unshared[name])   # the per-graph input copies are gone


@pytest.mark.parametrize("ub, load_mode", [(1, "none"), (32, "none"), (128, "none"), (128, "mmap")],
                         ids=["decode", "ub32", "ub128", "ub128-mmap"])
def test_one_device_pipelines_its_graphs_with_host_experts(runner, assert_logits_match, ub, load_mode):
    """Patch 0002: one device holding every layer, its experts in host RAM: the patched build pipelines its graphs
    (two in flight, host weights as transient copies), so the copies beside compute act on one device too - early
    uploads on the second stream (OVERLAP), the device's gather and prefetch below the upload-all bar, staging for
    pageable (mmap) weights - with the baseline's logits; GATE=0 is upstream's single device again, same logits."""
    kw = {"devices": ONE, "placement": {**HOST_ALL, "load_mode": load_mode},
          "ctx": {"n_ctx": 1024, "n_batch": max(ub, 256), "n_ubatch": ub}, "n_tokens": 32 if ub == 1 else 512}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", **kw)
    off = runner.logits("patched", env={"GGML_SCHED_PP_GATE": 0}, **kw)
    assert b["schedule"]["pipeline_parallel"] is False and off["schedule"]["pipeline_parallel"] is False
    assert p["schedule"]["pipeline_parallel"] is True and p["schedule"]["n_copies"] == 2
    assert_logits_match(p["logits"], b["logits"], f"one device, ub{ub}, {load_mode}")
    assert_logits_match(off["logits"], b["logits"], f"one device, GATE=0, ub{ub}, {load_mode}")
    e, dev = p["ext"], _ext_backend(p["ext"], "VDEV0")
    if ub == 1:      # decode: below the op-offload threshold the experts are used where they are (the CPU)
        assert dev["weight_bytes"] == 0 and e["gather"] == 0, e
    elif load_mode == "mmap":
        assert dev["staged_bytes"] == dev["weight_bytes"] > 0, dev
    else:
        assert dev["overlap_uploads"] > 0, dev
        assert (e["gather"] > 0 and e["prefetch"] > 0) if ub == 32 else e["upload_all"] > 0, e


# === 0003 OWNER_OFFLOAD: offloaded host-weight ops on the layer's own backend =======================================


@pytest.mark.parametrize("tensor_split", [None, [3, 4]], ids=["default-split", "split-3-4"])
@pytest.mark.parametrize("direct", [None, 0], ids=["defaults", "direct-off"])
def test_both_devices_get_their_own_layers_experts(runner, tiny_model, tensor_split, direct):
    """Each device receives the expert bytes of the MoE layers it owns (logits "all": every layer, the last
    one included, processes every token): over its link (VDEV's h2d count, which includes what the devices'
    gathers copy - GATHER, on by default, patch 0010) and, with GATHER and DIRECT off, as the scheduler's own
    transient uploads."""
    r = runner.logits("patched", devices=DEVS, placement={**HOST_ALL, "tensor_split": tensor_split}, ctx=CTX,
                      n_tokens=N_TOKENS, env=None if direct is None else NO_DIRECT)
    assert r["schedule"]["pipeline_parallel"] is True
    owned = layers_per_device(tiny_model, r["schedule"])
    assert all(n > 0 for n in owned.values()), owned
    n_layer = sum(owned.values())
    devs = {d["device"]: d for d in r["counters"]["devices"]}
    ext = r["ext"]
    assert ext["params"]["GATHER"] == (-1 if direct is None else 0) and ext["direct"] == 0, ext
    assert (ext["gather"] > 0) == (direct is None), ext["gather"]
    total_h2d = sum(d["h2d_bytes"] for d in devs.values())
    total_w = sum(_ext_backend(ext, name)["weight_bytes"] for name in owned)
    assert _ext_backend(ext, "CPU")["weight_bytes"] == 0
    for name, n in owned.items():
        share = n / n_layer
        h2d = devs[name]["h2d_bytes"]
        w = _ext_backend(ext, name)["weight_bytes"]
        assert h2d == pytest.approx(share * total_h2d, rel=0.10), \
            f"{name} owns {n}/{n_layer} layers but got {h2d / total_h2d:.1%} of the h2d bytes ({owned})"
        assert w <= h2d, "expert bytes are part of what crossed the link"
        if direct == 0:
            assert w == pytest.approx(share * total_w, rel=0.10), \
                f"{name} owns {n}/{n_layer} layers but got {w / total_w:.1%} of the expert bytes ({owned})"


def test_owner_offload_off_sends_experts_to_the_first_device(runner):
    r = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS,
                      env=_off("OWNER_OFFLOAD"))
    v0, v1 = r["counters"]["devices"]
    assert r["ext"]["offload_owner"] == 0
    assert v1["h2d_bytes"] < 0.05 * v0["h2d_bytes"], (v0["h2d_bytes"], v1["h2d_bytes"])


def test_partial_host_experts_stream_to_the_layer_owner(runner, tiny_model, assert_logits_match):
    """Experts of the last two layers (VDEV1's) in host RAM: the patched build streams them to VDEV1 (by default
    VDEV1 gathers the used experts itself: GATHER; with it and DIRECT off, as transient copies), upstream to VDEV0
    (its first-device rule); the logits agree."""
    placement = {"host_experts": [4, 5]}
    p = runner.logits("patched", devices=DEVS, placement=placement, ctx=CTX, n_tokens=N_TOKENS)
    sel = runner.logits("patched", devices=DEVS, placement=placement, ctx=CTX, n_tokens=N_TOKENS, env=NO_DIRECT)
    b = runner.logits("baseline", devices=DEVS, placement=placement, ctx=CTX, n_tokens=N_TOKENS)
    owned = layers_per_device(tiny_model, p["schedule"], host_layers={4, 5})
    assert owned == {"VDEV0": 4, "VDEV1": 2}, f"this test assumes layers 4 and 5 are VDEV1's: {owned}"
    assert p["schedule"]["pipeline_parallel"] is True
    for r in (p, sel):
        assert _ext_backend(r["ext"], "VDEV0")["weight_bytes"] == 0
        assert _ext_backend(r["ext"], "VDEV0")["gather_bytes_est"] == 0
    assert p["ext"]["gather"] > 0 and _ext_backend(p["ext"], "VDEV1")["gather_bytes_est"] > 0
    assert sel["ext"]["gather"] == 0 and _ext_backend(sel["ext"], "VDEV1")["weight_bytes"] > 0
    bv0, bv1 = b["counters"]["devices"]
    for r in (p, sel):
        pv0, pv1 = r["counters"]["devices"]
        assert pv1["h2d_bytes"] > 10 * pv0["h2d_bytes"], (pv0["h2d_bytes"], pv1["h2d_bytes"])
    assert bv0["h2d_bytes"] > 10 * bv1["h2d_bytes"], (bv0["h2d_bytes"], bv1["h2d_bytes"])
    assert_logits_match(p["logits"], b["logits"], "patched vs baseline, host experts of layers 4-5")
    assert_logits_match(sel["logits"], b["logits"], "patched (GATHER=0 DIRECT=0) vs baseline, host experts of layers 4-5")


# === 0004 EARLY_INPUTS: user inputs uploaded early, fewer copies, last events =======================================


def test_early_inputs_off(runner, patched_all):
    r = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS,
                      env=_off("EARLY_INPUTS"))
    assert r["ext"]["input_early_uploads"] == 0
    assert patched_all["ext"]["input_early_uploads"] > 0


def test_decode_records_one_event_per_device_and_waits_on_none(runner):
    """Patch 0004: in decode (nothing in flight, experts on the CPU) each device records one event per token
    (after its last split) instead of one per split, and no split waits on an event; numerics unchanged."""
    def tg(env):
        r = runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL,
                                   "ctx": {"n_ctx": 256, "n_batch": 16, "n_ubatch": 16}, "tests": [["tg", 8]],
                                   "reps": 2}, env=env)
        assert r["schedule"]["pipeline_parallel"] is True
        # the extension's deltas cover the timed tokens only (not each rep's untimed position-0 token)
        assert r["tests"][0]["ext"]["graphs"] == 2 * 8, r["tests"][0]["ext"]["graphs"]
        return r["tests"][0]["devices"]
    on = tg(None)
    assert len(on) == 2, on
    for d_on in on:
        assert d_on["event_records"] == 2 * 8, d_on    # 2 reps of 8 tokens, one record each
        assert d_on["event_waits"] == 0, d_on


# === 0005 UPLOAD_ALL: whole expert tensors above the coverage bar ===================================================


def test_upload_all_skips_the_readbacks(runner, tiny_cfg):
    forced = _bench(runner, FORCE_UPLOAD_ALL)
    sel = _bench(runner, {**_off("UPLOAD_ALL"), **NO_DIRECT})
    fe, se = forced["ext"], sel["ext"]
    assert fe["params"]["UPLOAD_ALL_MIN"] == 1 and se["params"]["UPLOAD_ALL"] == 0
    # forced upload-all: whole tensors, no host-blocking routing-id readback
    assert fe["upload_all"] > 0 and fe["id_readbacks"] == 0 and fe["selective"] == 0, fe
    # switched off: selective copies after reading the ids back
    assert se["upload_all"] == 0 and se["id_readbacks"] > 0 and se["selective"] > 0, se
    assert 0 < se["experts_used"] < se["experts_total"], "the test needs ubatches that leave experts unused"
    assert sel["coverage"]["coverage"] < 0.9, sel["coverage"]
    # the same ops were offloaded either way; selective moves fewer bytes, per device and in total
    total_f = total_s = 0
    for name in ("VDEV0", "VDEV1"):
        f, s = _ext_backend(fe, name), _ext_backend(se, name)
        assert f["weight_uploads"] == s["weight_uploads"] > 0, (f, s)
        assert 0 < s["weight_bytes"] < f["weight_bytes"], (name, s["weight_bytes"], f["weight_bytes"])
        total_f += f["weight_bytes"]
        total_s += s["weight_bytes"]
    # a whole upload moves one expert tensor per upload
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    n_up = sum(_ext_backend(fe, n)["weight_uploads"] for n in ("VDEV0", "VDEV1"))
    assert total_f == n_up * one_expert_tensor, (total_f, n_up, one_expert_tensor)
    # selective bytes follow the coverage the readbacks saw (within 15%: copies are ranges of experts)
    cov = se["experts_used"] / se["experts_total"]
    assert total_s == pytest.approx(cov * total_f, rel=0.15), (total_s, cov, total_f)
    # and the device counters agree with the scheduler's
    assert sum(d["h2d_bytes"] for d in forced["devices"]) >= total_f
    assert sum(d["h2d_bytes"] for d in sel["devices"]) >= total_s


def test_coverage_is_remeasured_once_per_idle_graph_at_its_first_expert_op(runner):
    """Upload-all re-measures coverage with one readback per graph that starts with nothing in flight (the first
    ubatch of each prompt batch), at its first expert op; never mid-graph or while a graph is in flight, where the
    readback would wait for every upload queued ahead of it."""
    env = {**FORCE_UPLOAD_ALL, "GGML_SCHED_PP_UPLOAD_ALL_MIN_COV": 1}
    every = runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL, "ctx": BENCH_CTX,
                                   "tests": [["pp", 128]], "reps": 3}, env=env)["tests"][0]["ext"]
    assert every["graphs"] == 3 * 4, every["graphs"]   # 3 runs of 4 ubatches
    assert every["id_readbacks"] == 3 and every["selective"] >= 3, every        # one per run
    assert every["upload_all"] > 10 * every["selective"], every


def test_one_row_output_layer_does_not_pull_the_coverage_estimate_down(runner):
    """Default thresholds, ubatches of 128 (about 98% coverage): per prompt, one readback re-measures coverage at
    the first expert op and one reads the ids of the output ubatch's last layer (one row, below every threshold).
    That one-row layer must not count as coverage: otherwise the next prompt starts below 85% and reads ids back
    in its first layers too. (With GATHER, the default, the last layer's GPU gathers that row's experts itself:
    only the measuring readback is left.)"""
    job = {"kind": "measure", "devices": DEVS, "placement": HOST_ALL,
           "ctx": {"n_ctx": 1024, "n_batch": 512, "n_ubatch": 128}, "tests": [["pp", 512]], "reps": 3}
    sel = runner.run("patched", job, env=NO_DIRECT)["tests"][0]["ext"]
    e = runner.run("patched", job)["tests"][0]["ext"]
    for x in (sel, e):
        assert x["graphs"] == 3 * 4 and x["upload_all"] > 0, x
    assert sel["id_readbacks"] == 3 * 2 and sel["direct"] == 0, sel
    assert e["id_readbacks"] == 3 and e["gather"] == 3 * 3 and e["direct"] == 0, e   # the one-row layer's gate, up, down


def test_coverage_bar_follows_the_number_of_links(runner, tmp_path_factory):
    """Patch 0005: with two GPUs on links of their own the default coverage bar is 55% (110 / 2), not 85%: at ~65%
    coverage the patched build uploads whole expert tensors (the stages overlap) where the old bar copied used
    experts after a readback per layer; at ~30% it still copies only the used ones. On one shared link (VDEVs of
    one link group report one bus id, as virtual CUDA devices of one GPU do), or with LINKS=1, the bar stays 85%."""
    def run(skew, env, devs=DEVS):
        model = synth.cached_model(tmp_path_factory.getbasetemp() / "skewed", "tiny", seed=1, routing="skewed", skew=skew)
        r = runner.run("patched", {"kind": "measure", "model": str(model), "devices": devs, "placement": HOST_ALL,
                                   "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 64}, "tests": [["pp", 256]],
                                   "reps": 1}, env=env)
        return r["tests"][0]
    mid, mid_old = run(0.3, None), run(0.3, {"GGML_SCHED_PP_UPLOAD_ALL_MIN_COV": 85})
    low = run(0.8, None)
    assert 0.6 < mid["coverage"]["coverage"] < 0.85 and low["coverage"]["coverage"] < 0.5, (mid["coverage"], low["coverage"])
    assert mid["ext"]["params"]["UPLOAD_ALL_MIN_COV"] == -1
    assert mid["ext"]["upload_all"] > mid["ext"]["selective"], mid["ext"]
    assert mid_old["ext"]["upload_all"] < mid_old["ext"]["selective"], mid_old["ext"]
    assert low["ext"]["upload_all"] == 0 and low["ext"]["selective"] > 0, low["ext"]
    assert mid["ext"]["links"] == 2, mid["ext"]["links"]
    for shared in (run(0.3, None, "vdev:2x0@0,shared"), run(0.3, {"GGML_SCHED_PP_LINKS": 1})):
        assert shared["ext"]["links"] == 1 and shared["ext"]["upload_all"] < shared["ext"]["selective"], shared["ext"]


def test_default_thresholds_choose_selective_for_the_tiny_model(runner):
    """With the default thresholds (4 x n_expert selections; 2 x while in flight) a 32-token ubatch of the tiny
    model (64 selections, ~40 of 64 experts) must not upload everything: the devices gather the used experts
    (GATHER, the default), or with GATHER off the host reads the ids back and copies them."""
    t, sel = _bench(runner, None), _bench(runner, NO_GATHER)
    assert t["ext"]["upload_all"] == 0 and t["ext"]["gather"] > 0, t["ext"]
    assert sel["ext"]["upload_all"] == 0 and sel["ext"]["id_readbacks"] > 0, sel["ext"]


# === 0006 STAGING: pageable host weights through pinned staging slots ===============================================


@pytest.mark.parametrize("how, pageable_buft", [({"no_host": True}, "CPU"), ({"load_mode": "mmap"}, "CPU_Mapped")])
def test_pageable_host_weights_go_through_pinned_staging(runner, assert_logits_match, how, pageable_buft):
    """Patch 0006 (the pinned-memory gate and STAGING): a device copies from pageable memory (no host buffer, or an mmap-ed model)
    synchronously. The patched build stages those uploads through pinned slots (STAGING) and pipelines; with
    STAGING=0 it keeps pipelining off, as upstream. VDEV copies from pageable memory block the host, as CUDA's do."""
    pageable = {**HOST_ALL, **how}
    b = runner.logits("baseline", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS)
    staged = runner.logits("patched", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS)
    off = runner.logits("patched", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS, env=_off("STAGING"))
    assert b["schedule"]["pipeline_parallel"] is False and off["schedule"]["pipeline_parallel"] is False
    assert staged["schedule"]["pipeline_parallel"] is True
    for r, what in ((staged, "staged"), (off, "STAGING=0, PP off")):
        assert_logits_match(r["logits"], b["logits"], f"pageable, {what}")
    # where the weights are: a pageable CPU buffer vs the VDEV host buffer type (pinned)
    assert pageable_buft in {m["buft"] for m in staged["schedule"]["memory"]}
    # (DIRECT off for the pinned run: it reads pinned weights from host memory, pageable ones never; OVERLAP=2's
    # early copies take both)
    pinned = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=CTX, n_tokens=N_TOKENS, env=NO_DIRECT)
    assert staged["ext"]["direct"] == 0
    assert not {"CPU", "CPU_Mapped"} & {m["buft"] for m in pinned["schedule"]["memory"]}
    assert pinned["schedule"]["pipeline_parallel"] is True
    # every host-weight byte of the staged run went through the slots; none of the pinned run did
    vdevs = lambda r: [x for x in r["ext"]["backends"] if x["name"].startswith("VDEV")]
    assert len(vdevs(staged)) == len(vdevs(pinned)) == 2
    for x, y in zip(vdevs(staged), vdevs(pinned)):
        assert x["staged_bytes"] == x["weight_bytes"] == y["weight_bytes"] > 0, (x, y)
        assert y["staged_bytes"] == 0, y
    # uploads from pinned memory, staged or not, are only queued (the staged run waits only for a full slot)
    syncs = lambda x: sum(d["host_syncs"] for d in x["counters"]["devices"])
    assert pinned["ext"]["host_waits"]["upload"] > 0
    assert syncs(staged) <= syncs(pinned) + staged["ext"]["stage_waits"], (syncs(staged), syncs(pinned), staged["ext"])
    # the copier: three quarters of the cores (at most 16) by default, STAGING=N threads with the caller's; the same bytes and
    # logits, and the host's copying time counted (what a staged upload's rate is read from)
    assert staged["ext"]["stage_threads"] == min(16, max(1, 3 * usable_cores() // 4))
    # the ring: one layer's pageable weights a VDEV reads and two slots more, at least 4 slots of 32 MiB (a tiny
    # model's layer is far smaller); the pinned run made none
    assert [x["stage_slots"] for x in vdevs(staged)] == [4, 4] and [x["stage_slots"] for x in vdevs(pinned)] == [0, 0]
    assert staged["ext"]["stage_copy_us"] > 0 and pinned["ext"]["stage_copy_us"] == 0
    three = runner.logits("patched", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS,
                          env={"GGML_SCHED_PP_STAGING": 3})
    assert three["ext"]["stage_threads"] == 3
    assert [x["staged_bytes"] for x in vdevs(three)] == [x["staged_bytes"] for x in vdevs(staged)]
    assert_logits_match(three["logits"], b["logits"], "pageable, STAGING=3")


@pytest.fixture(scope="module")
def wide(runner, tmp_path_factory):
    """A four-layer model with 120 MB of experts a layer (64 experts of 1024 x 576 in Q8_0, three tensors), a runner on
    it, and a layer's expert bytes."""
    cfg = synth.preset("tiny", seed=1, n_layer=4, n_embd=1024, n_ff_exp=576)
    path = tmp_path_factory.mktemp("wide") / "wide.gguf"
    synth.write_gguf(str(path), cfg)
    layer = sum(t["nbytes"] for t in model_file.header(path)["tensors"] if re.match(r"blk\.0\.ffn_.*_exps", t["name"]))
    return type(runner)(str(path), tmp_path_factory.mktemp("wide-rows")), layer   # (the session runner's class)


def test_the_staging_ring_holds_a_layer_of_pageable_weights(wide, assert_logits_match):
    """STAGING's ring (ggml-backend-pp-staging.cpp): a layer's pageable expert weights and two slots more, in slots of
    32 MiB, so that a layer's upload refills slots the device read a layer ago instead of waiting on the device. The
    wide model mmap-ed: each VDEV reads its layers' experts, ceil(120 MB / 32 MiB) + 2 = 6 slots; the logits are the
    baseline's."""
    r, layer = wide
    pageable = {**HOST_ALL, "load_mode": "mmap"}
    b = r.logits("baseline", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS)
    staged = r.logits("patched", devices=DEVS, placement=pageable, ctx=CTX, n_tokens=N_TOKENS)
    assert_logits_match(staged["logits"], b["logits"], "a layer's ring")
    want = max(4, math.ceil(layer / (32 << 20)) + 2)
    assert want == 6, layer
    vdevs = [x for x in staged["ext"]["backends"] if x["name"].startswith("VDEV")]
    assert [x["stage_slots"] for x in vdevs] == [want, want] and all(x["staged_bytes"] > 0 for x in vdevs), vdevs


def test_a_ring_made_at_decode_holds_a_layer_for_the_prompt_after_it(wide):
    """Decode first, with the expert cache (its misses staged piece by piece), then a prompt (whole layers staged): the
    ring is made at the first decode graph from the layers' weights its splits read, so the prompt after it finds a
    layer's slots (6) and does not wait on the device for them."""
    r, _ = wide
    job = {"kind": "measure", "devices": DEVS, "placement": {**HOST_ALL, "load_mode": "mmap"}, "ctx": CTX,
           "tests": [["tg", 4], ["pp", 64]], "reps": 1, "warmup": 0}
    got = r.run("patched", job, env={"GGML_SCHED_PP_EXPERT_CACHE": -8, "GGML_SCHED_PP_EXPERT_CACHE_MIN_HIT": 0})
    slots = [[x["stage_slots"] for x in t["ext"]["backends"] if x["name"].startswith("VDEV")] for t in got["tests"]]
    staged = [sum(x["staged_bytes"] for x in t["ext"]["backends"]) for t in got["tests"]]
    assert slots == [[6, 6], [6, 6]] and 0 < staged[0] < staged[1], (slots, staged)


def test_a_layers_staged_misses_go_up_in_bursts_the_link_reads_while_the_next_is_copied(wide, assert_logits_match):
    """The cache's misses of a split from an mmap-ed model are copied into the staging slots in one call, cut into
    bursts of at least 4 MiB of whole pieces, each uploaded once copied (the link reads one while the host copies the
    next): ubatches of 4 tokens on the wide model miss up to 8 experts a layer, ~15 MB of pieces of 0.6 MB, so a
    layer's call makes several copies, and no burst holds more than 4 MiB and a piece."""
    r, layer = wide
    piece = layer // (64 * 3)   # (an expert of one of the layer's three expert weights)
    kw = {"devices": DEVS, "placement": {**HOST_ALL, "load_mode": "mmap"}, "n_tokens": 16,
          "ctx": {"n_ctx": 64, "n_batch": 16, "n_ubatch": 4}}
    env = {"GGML_SCHED_PP_EXPERT_CACHE": -8, "GGML_SCHED_PP_EXPERT_CACHE_MIN_HIT": 0}
    b = r.logits("baseline", **kw)
    p = r.logits("patched", env=env, **kw)
    assert_logits_match(p["logits"], b["logits"], "bursts of staged misses")
    ext = p["ext"]
    staged = sum(x["staged_bytes"] for x in ext["backends"])
    lookups = sum(x["cache_ops"] for x in ext["backends"]) // 3
    assert staged == sum(x["cache_bytes"] for x in ext["backends"]) > 0, ext["backends"]
    calls = lookups + staged // (32 << 20) + 1   # (a layer's call, cut where a slot ends)
    assert staged / ((4 << 20) + piece) <= ext["stage_copies"] <= staged // (4 << 20) + calls + 1, \
        (ext["stage_copies"], staged, lookups)
    assert staged / ((4 << 20) + piece) > calls   # (bursts, not a copy a call; a copy a piece: ~6x the bound above)


# === 0007 STABLE_RESERVE: stable reservations, dependency padding, kept plans =======================================


def test_prompt_batches_do_not_re_reserve_and_host_waits_are_timed(runner):
    """Patch 0003: the output rows of a prompt's last ubatch stay on their layer's device, so node backends
    match the reserved graph and no re-reservation (a full drain) happens; the host waits are timed by cause
    (patch 0001)."""
    on = _bench(runner, None)["ext"]
    assert on["reallocs"] == 0 and on["plan_switches"] == 0 and on["reallocs_ids_changed"] == 0, on
    assert on["host_waits"]["realloc"] == 0 and on["host_wait_us"]["realloc"] == 0
    assert set(on["host_wait_us"]) == {"user_input", "split_switch", "ids", "fallback", "realloc", "input_events",
                                       "upload"}
    assert on["compute_async_us"] > 0 and on["graphs"] == 4, on  # 128 tokens in ubatches of 32
    assert all(b["submit_us"] > 0 for b in on["backends"]), on["backends"]


def test_decode_after_a_prompt_allocates_from_a_kept_plan(runner, assert_logits_match):
    """Patch 0007 (kept plans): prompts, then decode, twice, in one context (bench/q6's pattern). The decode graph
    keeps its expert ops on the CPU, so its node backends differ from the prompt layout: with one plan the first
    decode token would re-reserve in every round. With kept plans (llama reserves the decode graph when the context
    is made) every step allocates from a plan that fits it: no re-reservation and, with nothing in flight between
    llama_decode calls, no drain. The logits of every step's last token and of each decoded token match the
    baseline."""
    b = _mixed(runner, "baseline", None)
    on = _mixed(runner, "patched", None)
    assert b["logits"].shape == on["logits"].shape == (2 * (len(MIXED) - 1 + 4), b["logits"].shape[1])
    assert_logits_match(on["logits"], b["logits"], "kept plans, mixed workload")
    steps_on = on["steps"]
    for st in steps_on:
        e = st["ext"]
        assert e["reallocs"] == 0 and e["plan_switch_drains"] == 0, (st["round"], st["kind"], e["realloc_log"])
        if st["kind"] == "tg":
            assert e["plan_switches"] == 1, e          # to the decode plan at the first token, then it fits
    assert steps_on[len(MIXED)]["ext"]["plan_switches"] == 1   # round 2's first prompt: back to the prompt plan


def test_allocation_dependency_nodes_keep_the_reserved_node_count(runner):
    """Patch 0007: VDEV, like CUDA, asks for an allocation-dependency node after each non-empty top-k routing;
    the empty last layer of a ubatch without outputs gets none, so its graph has fewer nodes than the reserved
    one. Padding keeps the count: every graph has the reserved node count and none re-reserves."""
    on = _bench(runner, None)["ext"]
    assert on["reallocs"] == 0 and on["graph_nodes_min"] == on["graph_nodes_max"], on


# === 0008 DIRECT: a GPU reads the used experts from pinned host memory ==============================================


@pytest.mark.parametrize("ub", [32, 128])
def test_direct_reads_replace_the_readbacks(runner, tiny_cfg, assert_logits_match, ub):
    """Patch 0008 (DIRECT, the default on every GPU but the first): below the upload-all bar the device reads the used experts from pinned
    host memory itself - no routing-id readback and no copy - except at the first expert op of a graph that starts
    idle, which measures the coverage where a measurement counts (on the first GPU here, which keeps the selective
    copy anyway). Same logits as the baseline; the bytes over the second device's link are the experts the ids
    select (VDEV charges the kernel's reads): no more than the selective copy moves (it copies ranges of experts
    with padding), and most of it; the first device's are those of the selective copy."""
    b, sel, on = _baseline_off_on(runner, DEVS, ub, {"GGML_SCHED_PP_UPLOAD_ALL": 0, **NO_DIRECT},
                                  {"GGML_SCHED_PP_DIRECT": 2})
    assert on["schedule"]["pipeline_parallel"] is True and on["ext"]["params"]["DIRECT"] == 2
    assert_logits_match(on["logits"], b["logits"], f"DIRECT=2 ub{ub}")
    e, s = on["ext"], sel["ext"]
    assert s["direct"] == 0 and s["selective"] > 0, s
    # every expert op either reads directly (VDEV1) or copies the used experts (VDEV0)
    assert e["direct"] > 0 and e["selective"] > 0 and e["direct"] + e["selective"] == s["selective"], (e, s)
    assert e["id_readbacks"] < s["id_readbacks"], (e["id_readbacks"], s["id_readbacks"])
    h_on, h_sel = _h2d_by_device(on), _h2d_by_device(sel)
    first, second = sorted(h_on)
    assert 0.6 * h_sel[second] < h_on[second] <= h_sel[second], (h_on, h_sel)
    assert h_on[first] == pytest.approx(h_sel[first], rel=0.01), (h_on, h_sel)
    assert _ext_backend(e, "VDEV1")["direct_bytes_est"] > 0 and _ext_backend(e, "VDEV0")["direct_bytes_est"] == 0


def test_vdev_charges_direct_reads_at_their_share_of_the_link(runner):
    """VDEV's `direct` option: a kernel's reads of pinned host memory move at that share of the link's rate (the
    same bytes take longer over the link than a copy's)."""
    env = {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_DIRECT": 2, **NO_GATHER}
    kw = {"placement": HOST_ALL, "ctx": {"n_ctx": 512, "n_batch": 512, "n_ubatch": 128}, "n_tokens": 512, "env": env}
    full = runner.logits("patched", devices="vdev:2x0@2,direct=1", **kw)
    slow = runner.logits("patched", devices="vdev:2x0@2,direct=0.25", **kw)
    # (the second device: the first keeps the selective copy)
    for f, s in zip(full["counters"]["devices"][1:], slow["counters"]["devices"][1:]):
        assert f["h2d_bytes"] == s["h2d_bytes"] > 0, (f, s)
        # its link time is direct reads: 4x slower, at least 2.5x
        assert s["link_busy_s"] > 2.5 * f["link_busy_s"] > 0, (f["link_busy_s"], s["link_busy_s"])


def test_direct_by_default_only_on_links_of_their_own(runner, assert_logits_match):
    """Patch 0008: DIRECT=-1 (the default) reads directly only where the GPUs have host links of their own; on
    one shared link the kernels' slow reads would take link time from the other stage's copies (one H200 as two:
    0.91x upstream), so the selective copy stays. Logits match the baseline either way. (GATHER off: DIRECT's
    default is for devices without a gather.)"""
    kw = {"placement": HOST_ALL, "ctx": CTX, "n_tokens": N_TOKENS}
    own = runner.logits("patched", devices="vdev:2x0@0", env=NO_GATHER, **kw)
    shared = runner.logits("patched", devices="vdev:2x0@0,shared", env=NO_GATHER, **kw)
    forced = runner.logits("patched", devices="vdev:2x0@0,shared", env={"GGML_SCHED_PP_DIRECT": 2, **NO_GATHER}, **kw)
    b = runner.logits("baseline", devices="vdev:2x0@0", **kw)
    assert own["ext"]["links"] == 2 and shared["ext"]["links"] == 1
    assert own["ext"]["params"]["DIRECT"] == shared["ext"]["params"]["DIRECT"] == -1
    assert own["ext"]["direct"] > 0 and _ext_backend(own["ext"], "VDEV0")["direct_bytes_est"] == 0   # not the first GPU
    assert shared["ext"]["direct"] == 0 and shared["ext"]["id_readbacks"] > 0, shared["ext"]
    assert forced["ext"]["direct"] > 0                                   # explicit DIRECT=2 still reads directly
    for r, what in ((own, "own links"), (shared, "shared link")):
        assert_logits_match(r["logits"], b["logits"], f"DIRECT default, {what}")


def test_direct_by_default_per_link_with_three_devices(runner, assert_logits_match):
    """DIRECT's auto mode is decided per device: with three VDEVs, the first two on one link and the third on a
    link of its own, only the third reads from host memory (the second shares the first's link; the first keeps
    the selective copy anyway). GATHER off, as above."""
    devs = {"kind": "vdev", "devices": [{"link_gbps": 0, "link_group": 0}, {"link_gbps": 0, "link_group": 0},
                                        {"link_gbps": 0}]}
    kw = {"placement": HOST_ALL, "ctx": CTX, "n_tokens": N_TOKENS}
    r = runner.logits("patched", devices=devs, env=NO_GATHER, **kw)
    b = runner.logits("baseline", devices=devs, **kw)
    assert r["ext"]["links"] == 2 and r["schedule"]["pipeline_parallel"] is True
    est = {x["name"]: x["direct_bytes_est"] for x in r["ext"]["backends"]}
    assert est["VDEV0"] == 0 and est["VDEV1"] == 0 and est["VDEV2"] > 0, est
    assert_logits_match(r["logits"], b["logits"], "DIRECT auto, three devices, two links")


def test_direct_leaves_upload_alls_refresh_to_a_readback(runner):
    """With DIRECT on and coverage above the bar, upload-all's refresh (the first expert op of each idle graph)
    still reads the ids back: DIRECT must not take the op the refresh handed to the selective copy."""
    env = {**FORCE_UPLOAD_ALL, "GGML_SCHED_PP_UPLOAD_ALL_MIN_COV": 1, "GGML_SCHED_PP_DIRECT": 2, **NO_GATHER}
    r = runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL, "ctx": BENCH_CTX,
                               "tests": [["pp", 128]], "reps": 3}, env=env)
    e = r["tests"][0]["ext"]
    assert e["graphs"] == 3 * 4 and e["id_readbacks"] == 3 and e["upload_all"] > 10 * e["selective"], e
    assert e["direct"] == 0, e   # above the bar: upload-all everywhere else
    # control: the same run below the bar (upload-all off) does read directly, so the 0 above means something
    low = runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL, "ctx": BENCH_CTX,
                                 "tests": [["pp", 128]], "reps": 3},
                     env={"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_DIRECT": 2, **NO_GATHER})["tests"][0]["ext"]
    assert low["direct"] > 0, low


def test_direct_skips_graphs_llama_reuses(runner, assert_logits_match):
    """A graph llama reuses (while pipelining: ubatches below 32 tokens) keeps its splits - and on CUDA its captured
    graphs, which would replay the pointer of their capture: DIRECT only takes graphs split for their own compute
    (the control: the same ubatches with graph reuse disabled)."""
    # (ubatches of 16 offload their expert ops only below the devices' usual minimum batch of 32)
    env = {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_DIRECT": 2, **NO_GATHER, "GGML_OP_OFFLOAD_MIN_BATCH": 16}
    ctx = {"n_ctx": 512, "n_batch": 32, "n_ubatch": 16}   # 4 ubatches of 16: the first one's graph, then reused
    b = runner.logits("baseline", devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=64)
    rebuilt = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=64,
                            env={**env, "LLAMA_GRAPH_REUSE_DISABLE": 1})
    reused = runner.logits("patched", devices=DEVS, placement=HOST_ALL, ctx=ctx, n_tokens=64, env=env)
    assert_logits_match(reused["logits"], b["logits"], "DIRECT=2, reused graphs")
    assert rebuilt["ext"]["graphs"] == reused["ext"]["graphs"] == 4
    assert 0 < reused["ext"]["direct"] < rebuilt["ext"]["direct"], (reused["ext"]["direct"], rebuilt["ext"]["direct"])
    assert reused["ext"]["selective"] > rebuilt["ext"]["selective"]


# === 0009 OVERLAP: the next split's expert copy on a second stream ==================================================


@pytest.mark.parametrize("ub, env", [(128, {}), (64, FORCE_UPLOAD_ALL), (32, NO_GATHER)],
                         ids=["ub128", "ub64-all", "ub32-selective"])
def test_overlap_in_the_compute_buffer(runner, tiny_cfg, assert_logits_match, ub, env):
    """Patch 0009 (OVERLAP=2, opt-in; against OVERLAP off): the next split's expert copy goes up on a second
    stream while the split before computes, into memory ggml-alloc placed one split early in the compute buffer -
    no ring: a whole upload, or a selective copy whose ids the split before already read back (up and down after
    gate). Same logits as the
    baseline on slow links and a slow second device; the same decisions and bytes as without it, part of them
    now on the second stream."""
    b, off, on = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", ub, {**OVERLAP_OFF, **env}, {"GGML_SCHED_PP_OVERLAP": 2})
    assert on["schedule"]["pipeline_parallel"] is True and on["ext"]["params"]["OVERLAP"] == 2
    assert_logits_match(on["logits"], b["logits"], f"OVERLAP=2 ub{ub}")
    e_on, e_off = on["ext"], off["ext"]
    for k in ("upload_all", "selective", "id_readbacks", "direct", "gather"):
        assert e_on[k] == e_off[k], (k, e_on[k], e_off[k])
    assert all(x["ring_bytes"] == 0 for x in e_on["backends"])
    assert sum(x["overlap_uploads"] for x in e_on["backends"]) > 0
    assert all(x["overlap_uploads"] == 0 for x in e_off["backends"])
    for name in ("VDEV0", "VDEV1"):
        assert _ext_backend(e_on, name)["weight_bytes"] == _ext_backend(e_off, name)["weight_bytes"]


@pytest.mark.parametrize("ub", [32, 128])
def test_overlap_in_the_compute_buffer_keeps_the_memory_bound(runner, tiny_cfg, ub):
    """The memory bound with OVERLAP=2 (the geometry of test_memory_bound_at_the_memory_ab_geometry): each device's
    compute buffer <= baseline + 2 x the largest expert tensor."""
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    placement = {**HOST_ALL, "tensor_split": [3, 5]}
    ctx = {"n_ctx": 2304, "n_batch": 16 * ub, "n_ubatch": ub}
    b = _vdev_compute_buffers(runner.schedule("baseline", devices=DEVS, placement=placement, ctx=ctx))
    plain = _vdev_compute_buffers(runner.schedule("patched", devices=DEVS, placement=placement, ctx=ctx, env=OVERLAP_OFF))
    p = _vdev_compute_buffers(runner.schedule("patched", devices=DEVS, placement=placement, ctx=ctx, env={"GGML_SCHED_PP_OVERLAP": 2}))
    for name, x in p.items():
        assert x <= b[name] + 2 * one_expert_tensor, (name, x, b[name], one_expert_tensor)
        assert x >= plain[name], (name, x, plain[name])   # the early copies live one split longer


def test_overlap_without_room_runs_without_its_copies(runner, assert_logits_match):
    """OVERLAP=2 is the default, and its early copies need one more expert copy in the compute buffers: on devices
    with room for the placement but not for that copy, the scheduler reserves again without early copies (stats:
    overlap 0, overlap_dropped 1) instead of failing - llama's own fallback would then give up pipelining. The
    same logits as the baseline, pipelining on, nothing allocated past the budget."""
    placement = {**HOST_ALL, "tensor_split": [3, 5]}
    ctx = {"n_ctx": 1024, "n_batch": 512, "n_ubatch": 128}
    kw = {"placement": placement, "ctx": ctx, "n_tokens": 512}
    peak = lambda r: [d["peak_alloc_bytes"] for d in r["counters"]["devices"]]
    off = runner.logits("patched", devices=DEVS, env=OVERLAP_OFF, **kw)
    on = runner.logits("patched", devices=DEVS, **kw)
    assert on["ext"]["overlap"] == 2 and on["ext"]["overlap_dropped"] == 0
    assert any(a > b for a, b in zip(peak(on), peak(off))), (peak(on), peak(off))
    # the device where the copies cost most gets a budget halfway between the two; the other none (0: unlimited)
    gain = [a - b for a, b in zip(peak(on), peak(off))]
    i = gain.index(max(gain))
    budget = [peak(off)[i] + gain[i] // 2 if j == i else 0 for j in range(len(gain))]
    spec = json.dumps({"kind": "vdev", "devices": [{"memory": m} for m in budget]})
    base = runner.logits("baseline", devices=spec, **kw)
    tight = runner.logits("patched", devices=spec, **kw)
    assert tight["schedule"]["pipeline_parallel"] is True
    assert tight["ext"]["overlap"] == 0 and tight["ext"]["overlap_dropped"] == 1, tight["ext"]
    assert tight["ext"]["params"]["OVERLAP"] == 2          # the switch as set; the scheduler ran without
    assert peak(tight)[i] <= budget[i], (peak(tight), budget)
    assert sum(x["overlap_uploads"] for x in tight["ext"]["backends"]) == 0
    assert_logits_match(tight["logits"], base["logits"], "OVERLAP=2 without room")


def test_overlap_in_the_compute_buffer_with_direct_and_kept_plans(runner, assert_logits_match):
    """OVERLAP=2 together with the defaults below the upload-all bar (GATHER on VDEVs since patch 0010, DIRECT
    before it) and kept plans, in the mixed workload: the same logits as the baseline, no re-reservation."""
    b = _mixed(runner, "baseline", None)
    p = _mixed(runner, "patched", {"GGML_SCHED_PP_OVERLAP": 2})
    assert_logits_match(p["logits"], b["logits"], "OVERLAP=2, mixed workload")
    assert sum(st["ext"]["reallocs"] for st in p["steps"]) == 0


def test_overlap_pools_the_expert_copies(tmp_path_factory, assert_logits_match, runner):
    """OVERLAP=2 pools its copies: CUDA pads a quantized tensor whose rows are not a multiple of 512 values by one step (a down
    projection of 768 values, not a gate of 2048), so with OVERLAP=2 a down copy did not fit the block a gate copy
    freed and took fresh memory (2xH200, 30B preset, ub512: 648.3 MiB per GPU against 276.3 with OVERLAP off).
    Pooled - a graph's expert copies in size classes within 1% - OVERLAP=2 costs at most one expert copy more
    than OVERLAP off on each device (unpooled it cost more in this geometry: the pooling is always on). VDEVs
    with CUDA's padding (pad=512), the 30B geometry with 8 experts, 4 layers and a small vocabulary."""
    geometry = {"seed": 1, "n_layer": 4, "n_expert": 8, "n_vocab": 2048}   # a 238 MiB file
    cfg = synth.preset("qwen3-30b-a3b", **geometry)
    model = str(synth.cached_model(tmp_path_factory.getbasetemp() / "geometry", "qwen3-30b-a3b", **geometry))
    one_copy = synth.expert_bytes_per_layer(cfg) // 3 + 512   # + CUDA's padding step
    job = {"kind": "schedule", "model": model, "devices": "vdev:2x0@0,pad=512", "placement": HOST_ALL,
           "ctx": {"n_ctx": 1024, "n_batch": 1024, "n_ubatch": 512}}
    bufs = lambda env: _vdev_compute_buffers(runner.run("patched", job, env=env))
    off, pooled = bufs(OVERLAP_OFF), bufs({"GGML_SCHED_PP_OVERLAP": 2})
    for name in off:
        assert pooled[name] <= off[name] + one_copy, (name, pooled[name], off[name], one_copy)
    # pooled copies (padded on these devices: the tiny preset's rows are not multiples of 512) compute the same
    kw = {"devices": "vdev:2x0@0.5,pad=512", "placement": HOST_ALL, "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 64},
          "n_tokens": 256}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env={"GGML_SCHED_PP_OVERLAP": 2}, **kw)
    assert p["schedule"]["pipeline_parallel"] is True and sum(x["overlap_uploads"] for x in p["ext"]["backends"]) > 0
    assert_logits_match(p["logits"], b["logits"], "OVERLAP=2, pooled copies, pad=512")


def test_overlap_in_the_compute_buffer_keeps_one_plan_for_a_prompt(runner):
    """OVERLAP=2 places the early copies by the ubatch's expert selections, not each op's: the last layer of a
    prompt's last ubatch reads only its output rows (none in the other ubatches), and placing its copies by those
    rows ordered that graph differently - a second allocation plan, switched to with graphs in flight (a drain)
    at every prompt. Upload-all at every op (so every copy can go up early): no plan switch, no drain, and one
    coverage readback per prompt (upload-all's refresh), as with OVERLAP off."""
    def run(overlap):
        env = {**FORCE_UPLOAD_ALL, "GGML_SCHED_PP_UPLOAD_ALL_MIN_COV": 1, "GGML_SCHED_PP_OVERLAP": overlap}
        return runner.run("patched", {"kind": "measure", "devices": DEVS, "placement": HOST_ALL, "ctx": BENCH_CTX,
                                      "tests": [["pp", 128]], "reps": 3}, env=env)["tests"][0]["ext"]
    on, off = run(2), run(0)
    assert on["graphs"] == off["graphs"] == 3 * 4
    assert sum(x["overlap_uploads"] for x in on["backends"]) > 0, on   # the copies did go up early
    assert on["plan_switches"] == on["plan_switch_drains"] == on["reallocs"] == 0, on
    assert on["id_readbacks"] == off["id_readbacks"] == 3, (on["id_readbacks"], off["id_readbacks"])


def test_overlap_stages_pageable_weights_on_its_second_stream(runner, assert_logits_match):
    """OVERLAP=2's early copies take pageable host weights too (an mmap-ed model): each goes up through the staging
    slots (0006) on the second stream, beside the split before, not on the compute stream after it; a slot is read
    by one stream only. The logits match the baseline; with OVERLAP=0 nothing goes up early."""
    pl = {**HOST_ALL, "load_mode": "mmap"}
    ctx = {"n_ctx": 512, "n_batch": 256, "n_ubatch": 64}
    b = runner.logits("baseline", devices=DEVS, placement=pl, ctx=ctx, n_tokens=256)
    for overlap in (2, 0):
        r = runner.logits("patched", devices=DEVS, placement=pl, ctx=ctx, n_tokens=256,
                          env={"GGML_SCHED_PP_OVERLAP": overlap})
        assert r["schedule"]["pipeline_parallel"] is True and r["ext"]["params"]["OVERLAP"] == overlap
        assert_logits_match(r["logits"], b["logits"], f"mmap, OVERLAP={overlap}")
        for name in ("VDEV0", "VDEV1"):
            e = _ext_backend(r["ext"], name)
            assert e["ring_bytes"] == 0 and e["staged_bytes"] == e["weight_bytes"] > 0, e
            assert (e["overlap_uploads"] > 0) == (overlap == 2), e


def test_direct_with_overlap(runner, assert_logits_match):
    """DIRECT and OVERLAP=2 together: an expert op DIRECT may take is not placed early (DIRECT decides late: it
    measures), so fewer copies go up early; the logits still match, on slow links and a slow second device."""
    b, ov, both = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", 64,
                                   {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_OVERLAP": 2, **NO_DIRECT},
                                   {"GGML_SCHED_PP_DIRECT": 2})
    assert_logits_match(both["logits"], b["logits"], "DIRECT=2 OVERLAP=2")
    assert both["ext"]["direct"] > 0 and ov["ext"]["direct"] == 0
    assert 0 <= _early_uploads(both["ext"]) < _early_uploads(ov["ext"]), (_early_uploads(both["ext"]), _early_uploads(ov["ext"]))


# === 0010 GATHER: the device gathers the used experts itself ========================================================


@pytest.mark.parametrize("ub", [32, 128])
def test_gather_copies_what_the_selective_copy_does_without_readbacks(runner, tiny_cfg, assert_logits_match, ub):
    """Patch 0010 (GATHER, on by default where a device has a gather: VDEVs, and CUDA with pyllama_pp's library):
    below the upload-all bar the device copies the experts its routing ids select itself, so the host reads no
    ids back - except at the first expert op of a graph that starts idle, which measures the coverage (ub128, not
    ub32: as DIRECT), and whose up and down ops then take the selective copy with those ids. The same logits as
    the baseline, and exactly the bytes the selective copy moves over each link (the same runs of experts, each
    with the bytes after it that the selective copy leaves there); the scheduler counts none of them as its own
    uploads but estimates them."""
    b, sel, on = _baseline_off_on(runner, DEVS, ub, {"GGML_SCHED_PP_UPLOAD_ALL": 0, **NO_DIRECT},
                                  {"GGML_SCHED_PP_GATHER": -1, **_off("PREFETCH")})   # (a prefetch guesses)
    assert on["schedule"]["pipeline_parallel"] is True and on["ext"]["params"]["GATHER"] == -1
    assert_logits_match(on["logits"], b["logits"], f"GATHER ub{ub}")
    e, s = on["ext"], sel["ext"]
    assert s["gather"] == 0 and s["id_readbacks"] > 0, s
    measures = 1 if ub * tiny_cfg.n_expert_used >= 2 * tiny_cfg.n_expert else 0
    assert e["id_readbacks"] == measures and e["selective"] == 3 * measures and e["direct"] == 0, e
    assert e["gather"] == s["selective"] - 3 * measures > 0, (e["gather"], s["selective"])
    assert _h2d_by_device(on) == _h2d_by_device(sel), (_h2d_by_device(on), _h2d_by_device(sel))
    for name in ("VDEV0", "VDEV1"):
        x, y = _ext_backend(e, name), _ext_backend(s, name)
        assert x["gather_bytes_est"] > 0 and x["weight_bytes"] < y["weight_bytes"], (x, y)


def test_gather_with_overlap_goes_up_on_the_second_stream(runner, assert_logits_match):
    """GATHER with OVERLAP=2: the up and down ops of a layer route by the ids the op before them already routed
    by, so their gathers go up on the device's second stream while that op computes (into copies placed one split
    early); the first expert op of each layer gathers on the compute stream, after its ids. Same logits as the
    baseline on slow links and a slow second device; the same gathers as without OVERLAP, two thirds of them
    early."""
    b, off, on = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", 32,
                                  {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_PREFETCH": 0, **OVERLAP_OFF},
                                  {"GGML_SCHED_PP_OVERLAP": 2})
    assert_logits_match(on["logits"], b["logits"], "GATHER, OVERLAP=2")
    e_on, e_off = on["ext"], off["ext"]
    assert e_on["id_readbacks"] == e_off["id_readbacks"] == 0 and e_on["gather"] == e_off["gather"] > 0, (e_on, e_off)
    early = _early_uploads(e_on)
    assert 3 * early == 2 * e_on["gather"], (early, e_on["gather"])
    assert all(x["overlap_uploads"] == 0 for x in e_off["backends"])
    # with OVERLAP=2 the scheduler flags every gather BESIDE (compute runs beside it: the CUDA gather then copies
    # with a few blocks), without it none
    dev = lambda r: {d["device"]: d for d in r["counters"]["devices"]}
    for name, d in dev(on).items():
        o = dev(off)[name]
        assert d["beside_gathers"] == d["gathers"] > 0 and o["beside_gathers"] == 0 < o["gathers"], (d, o)
    assert sum(d["gathers"] for d in dev(on).values()) == e_on["gather"], (dev(on), e_on["gather"])


# === 0011 PREFETCH: expert copies prefetched with the experts used last time; chained gathers =======================


@pytest.mark.parametrize("ub", [32, 128])
def test_prefetch_brings_last_used_experts_a_split_early(runner, tiny_cfg, assert_logits_match, ub):
    """PREFETCH (patch 0011, on by default, acting with OVERLAP=2 and GATHER): a layer's first expert op (gate)
    cannot gather a split early - its ids are computed in the split before - so its copy is placed early too and the
    device fills it on the second stream with the experts the same weight used at its last gather; the op's own
    split then gathers only the rest (ub128: not the gate that reads its ids back to measure the coverage, the
    graph's first expert op). Same logits as the baseline on slow links and a slow second device (the rest waits for
    the prefetch); the same ops gathered, the prefetches on the second stream as well; no fewer bytes on any link
    than the plain gathers (each used expert still arrives), and less than the prefetches moved; the same compute
    buffers."""
    env = {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_OVERLAP": 2, "GGML_SCHED_PP_PREFETCH": 0}
    b, off, on = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", ub, env, {"GGML_SCHED_PP_PREFETCH": 1})
    assert on["schedule"]["pipeline_parallel"] is True and on["ext"]["params"]["PREFETCH"] == 1
    assert_logits_match(on["logits"], b["logits"], "PREFETCH, OVERLAP=2")
    e_on, e_off = on["ext"], off["ext"]
    assert e_off["prefetch"] == 0 and e_on["gather"] == e_off["gather"] > 0, (e_on, e_off)
    # every gate but the first ubatch's (no last used set yet) of the 6 layers
    assert 0 < e_on["prefetch"] <= e_on["gather"] // 3 - tiny_cfg.n_layer, e_on
    assert _early_uploads(e_on) == _early_uploads(e_off) + e_on["prefetch"], (_early_uploads(e_on), _early_uploads(e_off), e_on["prefetch"])
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    extra = sum(_h2d_by_device(on).values()) - sum(_h2d_by_device(off).values())
    assert all(_h2d_by_device(on)[d] >= _h2d_by_device(off)[d] for d in _h2d_by_device(off)), (_h2d_by_device(on), _h2d_by_device(off))
    assert extra <= e_on["prefetch"] * one_expert_tensor, (extra, e_on["prefetch"])
    # and the rest leaves out what the prefetch brought: a prefetch moves about an average op's bytes (the last
    # used set); had the rest copied every used expert again, all of them would be extra (tiny, ub32: 40% of that)
    per_op = sum(_h2d_by_device(off).values()) / e_off["gather"]
    assert extra < 0.75 * e_on["prefetch"] * per_op, (extra, e_on["prefetch"], per_op)
    # the gate copy placed early is alive while down's is: no more compute memory than OVERLAP=2 without it
    assert _compute_bytes(on) == _compute_bytes(off), (_compute_bytes(on), _compute_bytes(off))


@pytest.mark.parametrize("ub", [32, 128])
def test_prefetch2_moves_up_and_down_two_splits_early(runner, tiny_cfg, assert_logits_match, ub):
    """PREFETCH=2 (opt-in): besides the gate's prefetch, a layer's up copy is prefetched two splits early (beside
    the gate's) and gathers its rest on the second stream beside the gate, and down's copy is gathered there too,
    two splits early; each split waits only for its own copies, a prefetch only for the last split that used its
    memory. Same logits as the baseline on slow links and a slow second device; every expert op still gathered
    once (a rest counts as its op's gather), about twice PREFETCH=1's prefetches, more of the gathers on the
    second stream; three expert copies in lanes of their own instead of two in the compute buffer. Graphs below
    PREFETCH2_MIN_TOKENS go up as with PREFETCH=1, their copies in the same lanes."""
    env = {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_OVERLAP": 2, "GGML_SCHED_PP_PREFETCH": 1}
    b, one, two = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", ub, env,
                                   {"GGML_SCHED_PP_PREFETCH": 2, "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": ub})
    assert two["schedule"]["pipeline_parallel"] is True and two["ext"]["params"]["PREFETCH"] == 2
    assert_logits_match(two["logits"], b["logits"], f"PREFETCH=2 ub{ub}")
    assert_logits_match(one["logits"], b["logits"], f"PREFETCH=1 ub{ub}")
    e1, e2 = one["ext"], two["ext"]
    assert e1["gather"] == e2["gather"] > 0 and e1["id_readbacks"] == e2["id_readbacks"], (e1, e2)
    # up's copies are prefetched too: every gate and up but the first ubatch's (no last used set yet), and those
    # of a graph's measuring op (ub128: its layer's gate and up read back or follow the readback)
    assert 2 * e1["prefetch"] - 2 <= e2["prefetch"] <= 2 * e1["prefetch"] and e1["prefetch"] > 0, (e1["prefetch"], e2["prefetch"])
    # the extra prefetches go up on the second stream; up's rest there instead of its gather, down's gather too
    assert _early_uploads(e2) - _early_uploads(e1) == e2["prefetch"] - e1["prefetch"], (_early_uploads(e1), _early_uploads(e2), e1["prefetch"], e2["prefetch"])
    assert all(_h2d_by_device(two)[d] >= _h2d_by_device(one)[d] for d in _h2d_by_device(one)), (_h2d_by_device(one), _h2d_by_device(two))
    # the copies live in three lanes of their own (gate, up, down in turn), outside the compute buffer, which never
    # grows: at least one expert copy more than PREFETCH=1's two; more where other tensors shared the copies' blocks
    # in PREFETCH=1's compute buffer (the output logits on the last device at ub128)
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    for name in ("VDEV0", "VDEV1"):
        lanes = _ext_backend(e2, name)["ring_bytes"]
        assert lanes == 3 * one_expert_tensor and _ext_backend(e1, name)["ring_bytes"] == 0, (name, lanes)
        c1, c2 = _compute_bytes(one)[name], _compute_bytes(two)[name]
        assert c2 <= c1 and c1 + one_expert_tensor <= c2 + lanes, (name, c1, c2, lanes)
    # below PREFETCH2_MIN_TOKENS (default 1024) the graph goes up as with PREFETCH=1 - the same prefetches and early
    # uploads - with the copies still in the lanes (the same compute buffers as where PREFETCH=2 acts)
    *_, small = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", ub, env, {"GGML_SCHED_PP_PREFETCH": 2})
    assert_logits_match(small["logits"], b["logits"], f"PREFETCH=2 below its tokens ub{ub}")
    e3 = small["ext"]
    assert e3["params"]["PREFETCH2_MIN_TOKENS"] == 1024 > ub and e3["prefetch"] == e1["prefetch"], (e3, e1)
    assert _early_uploads(e3) == _early_uploads(e1) and e3["gather"] == e1["gather"], (_early_uploads(e3), _early_uploads(e1))
    assert _compute_bytes(small) == _compute_bytes(two), (_compute_bytes(small), _compute_bytes(two))
    assert all(_ext_backend(e3, n)["ring_bytes"] == 3 * one_expert_tensor for n in ("VDEV0", "VDEV1")), e3
    # a prompt whose last ubatch is below the threshold keeps the layout of those above it: no more
    # re-reservations (each drains the pipeline) than with PREFETCH=1
    kw = {"devices": "vdev:2x0@0.5,speed=1:3", "placement": HOST_ALL,
          "ctx": {"n_ctx": 512, "n_batch": 4 * ub, "n_ubatch": ub}, "n_tokens": 3 * ub + ub // 2}
    part1 = runner.logits("patched", env=env, **kw)
    part2 = runner.logits("patched", env={**env, "GGML_SCHED_PP_PREFETCH": 2, "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": ub}, **kw)
    assert_logits_match(part2["logits"], part1["logits"], f"PREFETCH=2, a partial last ubatch, ub{ub}")
    assert part2["ext"]["prefetch"] > part1["ext"]["prefetch"], (part2["ext"]["prefetch"], part1["ext"]["prefetch"])
    assert part2["ext"]["reallocs"] == part1["ext"]["reallocs"], (part2["ext"].get("last_realloc"), part1["ext"]["reallocs"])


@pytest.mark.parametrize("ub", [32, 128])
def test_chain_queues_gathers_behind_the_one_before(runner, assert_logits_match, ub):
    """Chaining (patch 0011; with OVERLAP=2 and a gather), here with PREFETCH=2: a gather whose inputs an earlier
    gather of the device in the graph already waited for is flagged CHAINED and goes right behind that gather, not
    after a wait for the second stream - up's prefetch (the gate's waits for its memory's last user too), up's rest and down's gather,
    about three a layer. VDEV runs a device's gathers on a queue of their own, as CUDA on one stream per GPU: each
    waits for its calling queue to get there, a CHAINED one only for the gathers before it. With every gather run
    as CHAINED there, the logits were off by NMSE 3-6e-5 here, so they check the scheduler's bookkeeping. (With
    PREFETCH=1 the gathers of up and down, beside the op before, chain too.)"""
    env = {"GGML_SCHED_PP_UPLOAD_ALL": 0, "GGML_SCHED_PP_OVERLAP": 2, "GGML_SCHED_PP_PREFETCH": 1}
    b, off, on = _baseline_off_on(runner, "vdev:2x0@0.5,speed=1:3", ub, env,
                                  {"GGML_SCHED_PP_PREFETCH": 2, "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": ub})
    assert_logits_match(on["logits"], b["logits"], f"chained gathers ub{ub}")
    assert_logits_match(off["logits"], b["logits"], f"chained gathers, PREFETCH=1, ub{ub}")
    e0, e1 = off["ext"], on["ext"]
    assert e1["gather"] == e0["gather"] and e1["prefetch"] > 0, (e0, e1)
    for r, e in ((on, e1), (off, e0)):
        flagged = [d["chained_gathers"] for d in r["counters"]["devices"]]
        assert e["chained"] == sum(flagged) and all(f > 0 for f in flagged), (e["chained"], flagged)
    # a layer's three expert ops gather once each (a rest counts), its gate and up are prefetched (once there is a
    # last used set); the gate's prefetch and its own gather wait (for its lane's last user, for the router), the
    # rest may chain: up's prefetch, up's rest and down's gather - at least 1.5 a prefetched layer (2 prefetches)
    ops, gate_prefetches = e1["gather"], e1["prefetch"] // 2
    assert e1["prefetch"] <= e1["chained"] <= ops + e1["prefetch"] - ops // 3 - gate_prefetches, (e1["chained"], ops, e1["prefetch"])


def test_bench_reports_the_prefetch_lanes(runner, tiny_cfg):
    """PREFETCH=2's lanes are a level, not a per-rep count: bench results carry them as they stand after the last
    rep (a backend's "ring_bytes", counters.BACKEND_LEVELS: three expert copies per GPU)."""
    on = _bench(runner, {"GGML_SCHED_PP_OVERLAP": 2, "GGML_SCHED_PP_PREFETCH": 2})
    off = _bench(runner, {})
    one_expert_tensor = synth.expert_bytes_per_layer(tiny_cfg) // 3
    assert {r["name"]: r["ring_bytes"] for r in on["ext"]["backends"]} == {"VDEV0": 3 * one_expert_tensor,
                                                                            "VDEV1": 3 * one_expert_tensor, "CPU": 0}
    assert all(r["ring_bytes"] == 0 for r in off["ext"]["backends"])


# === 0015 LAYER_MAJOR: a batch's ubatches through each layer together, a layer's experts up once a group ===========


LAYER_MAJOR = {"GGML_SCHED_PP_LAYER_MAJOR": 1}


def _groups(ub: int, n_ubatches: int, n_tokens: int, devs: str = DEVS, logits: str = "all") -> dict:
    """Logits-job arguments: batches of n_ubatches ubatches of ub tokens, n_tokens tokens."""
    return {"devices": devs, "placement": HOST_ALL, "ctx": {"n_ctx": 512, "n_batch": n_ubatches * ub, "n_ubatch": ub},
            "n_tokens": n_tokens, "logits": logits}


@pytest.mark.parametrize("devs", [DEVS, "vdev:1x0@0"], ids=["two", "one"])
@pytest.mark.parametrize("group,graphs,ubatches", [(1, 2, 8), (2, 4, 8), (3, 2, 6)], ids=["all", "two", "three"])
def test_layer_major_logits_are_the_baselines_bit_for_bit(runner, devs, group, graphs, ubatches):
    """A prompt of two batches of four ubatches of 32 and one of 8 tokens: with LAYER_MAJOR=1 each batch runs as one
    graph of four ubatches (the last batch's one ubatch alone), with 2 as two of two, with 3 as one of three and
    its fourth alone. Each ubatch's ops are the ones it runs alone, on the same devices: every logit is the
    baseline's, to the bit, and without the switch too."""
    kw = _groups(32, 4, 264, devs)
    b = runner.logits("baseline", **kw)
    off = runner.logits("patched", **kw)
    on = runner.logits("patched", env={"GGML_SCHED_PP_LAYER_MAJOR": group}, **kw)
    for name, r in (("off", off), (f"LAYER_MAJOR={group}", on)):
        diff = float(np.max(np.abs(r["logits"] - b["logits"])))
        assert r["logits"].shape == b["logits"].shape and diff == 0.0, f"{name} on {devs}: max abs diff {diff:.3e}"
    assert off["ext"]["layer_major_graphs"] == 0 and off["ext"]["read_again"] == 0, off["ext"]
    e = on["ext"]
    assert e["layer_major_graphs"] == graphs and e["layer_major_ubatches"] == ubatches, e
    # (every copy a group reads went up whole; only the ubatches that ran alone gathered their experts)
    assert e["read_again"] > 0 and (e["gather"] == 0) == (ubatches == 8) and e["selective"] == 0, e


@pytest.mark.parametrize("threads", [1, 3])
def test_layer_major_sets_inputs_on_threads_bit_for_bit(runner, threads):
    """A group's inputs are set on up to n_threads threads, ubatch i by thread i % n_threads (1: on llama_decode's
    thread alone; 3 for the 4 ubatches of a batch: the first and the last on one): every logit is the baseline's
    with the same threads, to the bit."""
    kw = _groups(32, 4, 128, "vdev:1x0@0")
    kw["ctx"] = {**kw["ctx"], "n_threads": threads}
    b = runner.logits("baseline", **kw)
    on = runner.logits("patched", env=LAYER_MAJOR, **kw)
    assert np.array_equal(on["logits"], b["logits"]), threads
    assert on["ext"]["layer_major_graphs"] == 1 and on["ext"]["layer_major_ubatches"] == 4, on["ext"]


_LEAD_IN_FAULTS = """
import resource, sys, pyllama_pp as pp
s = pp.Session(sys.argv[1], devices="vdev:1x0@0", variant="patched", placement=pp.Placement(host_experts="all"),
               ctx=pp.ContextParams(n_ctx=4096, n_batch=4096, n_ubatch=2048, flash_attn=0),
               switches={"LAYER_MAJOR": 1})
toks = [1 + i % 100 for i in range(4096)]
for _ in range(2):
    s.eval(toks, stats=False)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
s.eval(toks, stats=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, s.ext_stats()["layer_major_graphs"])
"""


@pytest.mark.skipif(re.search(r"lib[a-z]*san\.so", os.environ.get("LD_PRELOAD", "")) is not None,
                    reason="under bench/sanitize.sh the sanitizer's shadow memory faults pages of its own")
def test_layer_major_sets_a_groups_inputs_in_its_graphs_memory(tiny_model):
    """A prompt of two ubatches of 2048 tokens, the third in one context: llama sets the group's inputs (f32 KQ
    masks of 2048 x 2048 and 4096 x 2048, 48 MiB) straight into the merged graph's memory, which the prompts before
    touched, so the whole prompt faults in fewer host pages than a quarter of the larger mask's. Held in host memory
    of their own and copied into the graph's, every group allocated (glibc maps a block of 32 MiB or more anew each
    time) and faulted in the larger one again: 8,700 minor faults a prompt, 4 KiB pages (no transparent huge pages,
    as on the test machines)."""
    res = subprocess.run([sys.executable, "-c", _LEAD_IN_FAULTS, tiny_model], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    faults, groups = (int(x) for x in res.stdout.split())
    assert groups == 3, res.stdout
    assert faults < 4096 * 2048 * 4 // 4096 // 4, f"{faults} minor faults in a warm prompt"


def test_layer_major_uploads_each_expert_tensor_once_per_group(runner, tiny_cfg):
    """Every expert tensor uploaded whole (upload-all forced): without the switch each of the 4 ubatches of the
    batch moves each one, with it the group moves each once. Per device the host-weight bytes are exactly a quarter
    (each expert tensor of the tiny model once per device that owns its layer), and the link bytes, which add the
    activations and inputs, about a quarter."""
    kw = _groups(32, 4, 128)
    off = runner.logits("patched", env=FORCE_UPLOAD_ALL, **kw)
    on = runner.logits("patched", env={**FORCE_UPLOAD_ALL, **LAYER_MAJOR}, **kw)
    assert np.array_equal(on["logits"], off["logits"])
    w_off = {b["name"]: b["weight_bytes"] for b in off["ext"]["backends"] if b["name"].startswith("VDEV")}
    w_on = {b["name"]: b["weight_bytes"] for b in on["ext"]["backends"] if b["name"].startswith("VDEV")}
    assert w_on and all(w_off[n] == 4 * w_on[n] > 0 for n in w_on), (w_off, w_on)
    assert sum(w_on.values()) == tiny_cfg.n_layer * synth.expert_bytes_per_layer(tiny_cfg), w_on
    h_off, h_on = _h2d_by_device(off), _h2d_by_device(on)
    assert all(h_on[d] < 0.27 * h_off[d] for d in h_on), (h_off, h_on)
    assert on["ext"]["read_again"] == 3 * tiny_cfg.n_layer, on["ext"]


def test_layer_major_copies_go_up_early_on_the_second_stream(runner, assert_logits_match):
    """OVERLAP=2 (the default): the copy a group reads again goes up whole on the second stream while the split
    before computes - where it is not its device's first split of the graph; with OVERLAP=0 on the split's own
    stream. The same bytes either way."""
    kw = _groups(32, 4, 128)
    on = runner.logits("patched", env=LAYER_MAJOR, **kw)
    no_overlap = runner.logits("patched", env={**LAYER_MAJOR, **OVERLAP_OFF}, **kw)
    assert np.array_equal(on["logits"], no_overlap["logits"])
    assert _early_uploads(on["ext"]) > 0 and _early_uploads(no_overlap["ext"]) == 0
    assert on["ext"]["read_again"] == no_overlap["ext"]["read_again"] > 0
    assert _h2d_by_device(on) == _h2d_by_device(no_overlap)


def test_layer_major_leaves_decode_alone(runner, assert_logits_match):
    """Prompts of 2 and 4 ubatches, then 4 decoded tokens, twice, in one context: the prompts run as groups, each
    decoded token alone, with the bytes and logits of the run without the switch."""
    b = _mixed(runner, "baseline", None)
    off = _mixed(runner, "patched", None)
    on = _mixed(runner, "patched", LAYER_MAJOR)
    assert np.array_equal(on["logits"], b["logits"]), "LAYER_MAJOR, mixed workload"
    for s_on, s_off in zip(on["steps"], off["steps"]):
        assert (s_on["kind"], s_on["n"]) == (s_off["kind"], s_off["n"])
        groups = s_on["ext"]["layer_major_graphs"]
        if s_on["kind"] == "tg":
            assert groups == 0 and s_on["h2d_bytes_per_device"] == s_off["h2d_bytes_per_device"], (s_on, s_off)
        else:
            assert groups == 1, s_on["ext"]


def test_layer_major_needs_host_weights(runner):
    """Every weight in VRAM: nothing to upload, no groups (the graphs stay as they are)."""
    kw = {**_groups(32, 4, 128), "placement": {"host_experts": "none"}}
    on = runner.logits("patched", env=LAYER_MAJOR, **kw)
    assert np.array_equal(on["logits"], runner.logits("baseline", **kw)["logits"])
    assert on["ext"]["layer_major_graphs"] == 0, on["ext"]


def test_layer_major_reserves_a_groups_activations(runner):
    """The reserved worst case is a group of ubatches (n_batch / n_ubatch of them): the devices' compute buffers
    grow by the activations the group keeps and a layer more of expert copies; a batch that uses them re-reserves
    nothing, and fit (with its host experts: 5 MiB devices) plans them."""
    kw = {"devices": DEVS, "placement": HOST_ALL, "ctx": {"n_ctx": 512, "n_batch": 128, "n_ubatch": 32}}
    off = _vdev_compute_buffers(runner.schedule("patched", **kw))
    on = _vdev_compute_buffers(runner.schedule("patched", env=LAYER_MAJOR, **kw))
    assert all(on[n] > 1.5 * off[n] for n in off), (off, on)
    r = runner.logits("patched", env=LAYER_MAJOR, **_groups(32, 4, 128, logits="last"))
    assert r["ext"]["layer_major_graphs"] == 1 and r["ext"]["reallocs"] == 0, r["ext"]
    # fit's dry runs (the switch in its environment, as pyllama_pp.fit passes switches) reserve the same
    job = {"kind": "fit", "devices": "vdev:2x5MiB@0", "ctx": kw["ctx"]}
    fit_off, fit_on = runner.run("patched", job), runner.run("patched", job, env=LAYER_MAJOR)
    assert fit_off["status"] == fit_on["status"] == 0 and fit_on["overrides"], fit_on
    assert sum(d["compute_bytes"] for d in fit_on["devices"]) > 1.5 * sum(d["compute_bytes"] for d in fit_off["devices"])


def test_layer_major_without_room_runs_the_ubatches_one_by_one(runner):
    """4 MiB VDEVs hold a group whose ubatches before the last have no outputs (the reserved worst case, without
    OVERLAP=2's early copies), but not one where every token has logits: that group's graph finds no room, its KV
    cells go again and its ubatches, and the rest of the prompt, run one by one. 3 MiB ones hold no group at all:
    the context reserves without groups, with OVERLAP=2's copies, as without the switch. Same logits each time."""
    for mem, logits, graphs, dropped in (("4MiB", "last", 2, 1), ("4MiB", "all", 0, 1), ("3MiB", "last", 0, 0)):
        kw = {"devices": f"vdev:2x{mem}@0", "placement": HOST_ALL, "ctx": {"n_ctx": 640, "n_batch": 256, "n_ubatch": 64},
              "n_tokens": 512, "logits": logits}
        b = runner.logits("baseline", **kw)
        on = runner.logits("patched", env=LAYER_MAJOR, **kw)
        assert np.array_equal(on["logits"], b["logits"]), (mem, logits)
        e = on["ext"]
        assert e["layer_major_graphs"] == graphs and e["overlap_dropped"] == dropped, (mem, logits, e)
    assert _vdev_compute_buffers(on) == _vdev_compute_buffers(runner.logits("patched", **kw))
