"""fit: the variant's own common/fit.cpp through the shim (pp_fit), the Plan around it, and patch 0012's spread path.

Budgets are chosen so that about half of the experts of a 12-layer tiny model must stay in host RAM; each fit runs
in a worker process (both variants share library names).
"""
from __future__ import annotations

import dataclasses
import re

import json

import numpy as np
import pytest

from pyllama_pp import synth
from pyllama_pp.cli import main as cli_main
from pyllama_pp.errors import ConfigError, DeviceSpecError, ModelError, OutOfMemoryError
from pyllama_pp.fit import fit
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.plan import Plan, PlanError
from pyllama_pp.worker import run_job

MiB = 1024**2
N_LAYER = 12
CTX = ContextParams(n_ctx=512, n_batch=512, n_ubatch=128)
# measured on the 12-layer tiny model at CTX: each device holds its share of the dense-only layers and a few full
# layers, about half of all experts stay in host RAM
MEM = 8
TWO_EQUAL = f"vdev:2x{MEM}MiB@4GBps"
THREE_EQUAL = f"vdev:3x{MEM - 2}MiB@4GBps"
TWO_TO_ONE = json.dumps({"kind": "vdev", "devices": [{"memory": f"{2 * MEM - 4}MiB", "link_gbps": 4},
                                                     {"memory": f"{MEM - 2}MiB", "link_gbps": 4}]})
SLACK = 64 * MiB   # measured memory within the plan's expectation + 5% + 64 MiB


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(synth.cached_model(tmp_path_factory.mktemp("fit"), "tiny", seed=1, n_layer=N_LAYER))


@pytest.fixture(scope="module")
def plans(model):
    """(variant, spec) -> Plan, each fitted once."""
    cache: dict = {}

    def get(variant: str, spec: str, **kw) -> Plan:
        key = (variant, spec, json.dumps(kw, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = fit(model, devices=spec, ctx=kw.pop("ctx", CTX), variant=variant, timeout=120, **kw)
        return cache[key]
    return get


def _share_ok(plan: Plan) -> None:
    host = plan.host_expert_layers
    share = sum(host) / len(host)
    assert all(abs(h - share) <= 1 for h in host), f"host-expert layers {host} are not within 1 of {share:.2f}"


def _within_targets(plan: Plan) -> None:
    for d in plan.devices:
        assert d.expected_bytes <= d.target_bytes, f"{d.name}: {d.expected_bytes} > target {d.target_bytes}"


def _covers_model(plan: Plan) -> None:
    """Contiguous slices [first, end) that cover every repeating layer, full + host = the slice."""
    assert plan.n_gpu_layers == N_LAYER + 1
    assert plan.devices[0].layers[0] == 0 and plan.devices[-1].layers[1] == N_LAYER
    for a, b in zip(plan.devices, plan.devices[1:]):
        assert a.layers[1] == b.layers[0]
    for d in plan.devices:
        assert d.full_layers + d.host_expert_layers == d.layers[1] - d.layers[0]


@pytest.mark.parametrize("spec", [TWO_EQUAL, THREE_EQUAL, TWO_TO_ONE], ids=["2-equal", "3-equal", "2-to-1"])
def test_patched_spreads_host_experts(plans, spec):
    p = plans("patched", spec)
    assert p.status == "success" and p.path == "spread", (p.path, p.reasons)
    assert p.reasons == []
    _covers_model(p)
    _share_ok(p)
    _within_targets(p)
    n_host = sum(p.host_expert_layers)
    assert N_LAYER // 4 <= n_host <= 3 * N_LAYER // 4, f"{n_host} host-expert layers: the budget does not force ~half"
    # the overrides keep exactly those layers' experts in host RAM, whole: no partial layers, and none names a
    # block the model does not have (upstream's override writer adds one for the output layer: dropped)
    assert len(p.tensor_overrides) == n_host
    assert all(int(re.match(r"blk\\\.(\d+)", ov).group(1)) < N_LAYER for ov in p.tensor_overrides)
    assert [d.partial_layers for d in p.devices] == [0] * len(p.devices)


@pytest.mark.parametrize("spec", [TWO_EQUAL, THREE_EQUAL, TWO_TO_ONE], ids=["2-equal", "3-equal", "2-to-1"])
def test_baseline_plan_beside_the_patched_one(plans, spec):
    """Upstream fills devices back to front: its host experts sit on the trailing devices (never fewer there than
    on the first), and it keeps at least as many layers full as the spread plan does (it is not constrained)."""
    b, p = plans("baseline", spec), plans("patched", spec)
    assert b.status == "success" and b.path == "upstream"
    assert b.reasons == ["the baseline build has upstream's fit only"]
    _covers_model(b)
    _within_targets(b)
    hb, hp = b.host_expert_layers, p.host_expert_layers
    # upstream's overflow of part of a layer (not just its experts) shows as a partial layer, one per such override
    n_part = sum(1 for o in b.tensor_overrides if "exps" not in o.rpartition("=")[0])
    assert sum(d.partial_layers for d in b.devices) == n_part
    assert hb[-1] >= hb[0], hb
    assert sum(hb) <= sum(hp) + len(hp), (hb, hp)
    if max(hb) - min(hb) > 1:
        # where they differ: upstream piles the host experts up, the patched plan spreads them
        assert hb.index(max(hb)) > 0 and max(hp) - min(hp) <= 1, (hb, hp)


def test_two_to_one_gives_the_big_device_more_full_layers(plans):
    p = plans("patched", TWO_TO_ONE)
    assert p.devices[0].full_layers > p.devices[1].full_layers, p.to_frame()


@pytest.mark.parametrize("spec,kw,reason", [
    (f"vdev:1x{MEM}MiB@4GBps", {}, "only one device"),
    (TWO_EQUAL, {"ctx": ContextParams(n_ctx=512, n_batch=512, n_ubatch=128, op_offload=False)}, "op offload is off"),
    (TWO_EQUAL, {"ctx": ContextParams(n_ctx=512, n_batch=512, n_ubatch=128, offload_kqv=False)}, "K/Q/V offload is off"),
    (TWO_EQUAL, {"split_mode": "none"}, "split mode is not layer"),
    (TWO_EQUAL, {"env": {"LLAMA_FIT_SPREAD": "0"}}, "LLAMA_FIT_SPREAD=0"),
], ids=["one-device", "no-op-offload", "no-kqv-offload", "split-none", "switched-off"])
def test_false_precondition_takes_upstreams_path(plans, spec, kw, reason):
    p = plans("patched", spec, check=False, **kw)
    assert p.path == "upstream" and reason in p.reasons, (p.path, p.reasons)


def test_switched_off_patched_fit_piles_host_experts_as_upstream(plans):
    """LLAMA_FIT_SPREAD=0: upstream's steps 3 and 4 on the patched build's own memory figures (its pipeline keeps
    other buffers than the baseline's, so the split itself may differ): host experts on the trailing device."""
    off = plans("patched", TWO_EQUAL, check=False, env={"LLAMA_FIT_SPREAD": "0"})
    on = plans("patched", TWO_EQUAL)
    h_off, h_on = off.host_expert_layers, on.host_expert_layers
    assert off.status == "success" and h_off[0] < h_off[-1] and max(h_off) - min(h_off) > 1, h_off
    assert max(h_on) - min(h_on) <= 1, h_on
    _within_targets(off)


def test_split_mode_row_is_refused(model):
    """Upstream's fit refuses row split (not implemented); VDEVs cannot hold split buffers at all: said up front."""
    with pytest.raises(DeviceSpecError, match="split mode row"):
        fit(model, devices=TWO_EQUAL, ctx=CTX, variant="patched", split_mode="row", timeout=120)


# room for each device's share of the dense-only layers, but not for that and OVERLAP=2's early expert copies
# (measured: with the copies fit takes upstream's path and piles the host experts on one device)
NO_ROOM = "vdev:2x4352KiB@4GBps"


def test_the_plan_chooses_the_copies_it_has_room_for(plans):
    """The patched plan is measured with OVERLAP=2's early copies (the default) where they fit, and without them
    where they do not - saying so; the baseline's plan has no switches."""
    room, tight = plans("patched", TWO_EQUAL), plans("patched", NO_ROOM)
    assert room.switches == {"OVERLAP": 2} and "OVERLAP=2" in room.copies and "copies" in str(room)
    assert tight.switches == {"OVERLAP": 0} and "no room" in tight.copies, tight.copies
    assert tight.n_gpu_layers == N_LAYER + 1 and tight.path == "spread"
    _share_ok(tight)
    _within_targets(tight)
    assert plans("baseline", TWO_EQUAL).switches == {}


def test_a_switch_the_user_set_is_planned_as_set(model):
    p = fit(model, devices=TWO_EQUAL, ctx=CTX, env={"GGML_SCHED_PP_OVERLAP": "0"}, timeout=120)
    assert p.switches == {"OVERLAP": 0} and "as set" in p.copies
    with_copies = fit(model, devices=TWO_EQUAL, ctx=CTX, timeout=120)
    assert sum(d.compute_bytes for d in p.devices) < sum(d.compute_bytes for d in with_copies.devices)


@pytest.mark.parametrize("variant,spec", [("patched", TWO_EQUAL), ("baseline", TWO_EQUAL), ("patched", NO_ROOM)],
                         ids=["patched", "baseline", "patched-no-room-for-copies"])
def test_session_from_a_plan_stays_within_it(plans, model, tmp_path, variant, spec):
    """Each device's measured memory is within the plan's expectation + 5% + 64 MiB, with and without room for
    the overlap copies; the session runs with the copies the plan chose, and needs no fallback at run time."""
    p = plans(variant, spec)
    res = run_job({"kind": "logits", "model": model, "plan": p.to_dict(), "n_tokens": 256, "logits": "last",
                   "out": str(tmp_path / "l.npy")}, variant, timeout=120)
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape[0] == 1 and np.all(np.isfinite(logits))
    assert res["schedule"]["pipeline_parallel"] is (variant == "patched")
    if variant == "patched":
        assert res["ext"]["overlap"] == p.switches["OVERLAP"] and res["ext"]["overlap_dropped"] == 0, res["ext"]
    devs = res["counters"]["devices"]
    assert len(devs) == 2
    for d, want in zip(devs, p.devices):
        assert d["failed_allocs"] == 0
        assert 0.9 * want.expected_bytes <= d["peak_alloc_bytes"] <= want.expected_bytes * 1.05 + SLACK, (d, want)
        assert d["peak_alloc_bytes"] <= want.free_bytes


def test_plan_json_round_trip(plans, tmp_path):
    p = plans("patched", TWO_TO_ONE)
    q = Plan.load(p.save(tmp_path / "plan.json"))
    assert q == p and q.to_dict() == p.to_dict()
    pl = q.placement()
    assert isinstance(pl, Placement) and pl.overrides == tuple(p.tensor_overrides) and pl.source == "plan"
    assert pl.n_gpu_layers == p.n_gpu_layers and pl.load_mode == "none" and pl.host_experts == "none"
    assert pl.label == f"plan: {len(p.tensor_overrides)} overrides"
    assert q.placement(load_mode="mmap", source="fit").label.startswith("fit: ")
    df = q.to_frame()
    assert list(df["host_expert_layers"]) == p.host_expert_layers
    assert "spread" in str(q)


def test_a_plan_for_another_model_or_devices_is_refused(plans, model, tmp_path):
    p = plans("patched", TWO_EQUAL)
    other = synth.cached_model(tmp_path, "tiny", seed=2, n_layer=N_LAYER + 1)
    with pytest.raises(PlanError, match="another model"):
        p.check(other)
    with pytest.raises(PlanError, match="other devices"):
        p.check(model, f"vdev:2x{MEM + 1}MiB@4GBps")
    p.check(model, TWO_EQUAL)
    path = p.save(tmp_path / "plan.json")
    assert cli_main(["run", str(other), "--plan", str(path), "-p", "64", "-n", "0", "--json"]) == 2
    with pytest.raises(PlanError, match="not a pyllama_pp plan"):
        Plan.load(tmp_path / "x.json") if (tmp_path / "x.json").write_text("{}") else None


def test_errors_a_user_can_act_on(model):
    with pytest.raises(DeviceSpecError, match="has none"):
        fit(model, devices="cpu")
    with pytest.raises(DeviceSpecError, match="memory budget"):
        fit(model, devices="vdev:2x0@0")
    with pytest.raises(OutOfMemoryError, match="even with every expert in host RAM"):
        fit(model, devices="vdev:2x1MiB@4GBps", ctx=CTX, timeout=120)


def test_cli_fit_json_and_run_with_the_plan(model, tmp_path, capsys):
    out = tmp_path / "plan.json"
    # (a margin: the run also measures expert coverage in a second context beside the timed one)
    assert cli_main(["fit", model, "--devices", TWO_EQUAL, "-c", "512", "-b", "512", "-ub", "128", "-o", str(out),
                     "--margin", "3MiB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == "spread" and doc["pyllama_pp_plan"] == 1
    assert Plan.load(out).host_expert_layers == [d["host_expert_layers"] for d in doc["devices"]]
    assert cli_main(["run", model, "--plan", str(out), "-p", "128", "-n", "0", "-b", "512", "-ub", "128", "-r", "1",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r.get("pipeline_parallel") for r in rows) and not any(r.get("error") for r in rows)
    n_ov = len(Plan.load(out).tensor_overrides)
    assert all(r["host_experts"] == f"plan: {n_ov} overrides" for r in rows), [r["host_experts"] for r in rows]


def test_a_plan_over_its_target_is_an_error(tmp_path_factory):
    """7 layers on 2 x 5.5 MiB at the main job's batch sizes: the last device cannot hold an equal share of the
    dense-only layers, so the patched fit takes upstream's steps, which measure that device while the first is
    still empty (no pipeline, so no pipeline copies) and end over its target once both hold layers."""
    m7 = str(synth.cached_model(tmp_path_factory.mktemp("fit7"), "tiny", seed=1, n_layer=7))
    ctx = ContextParams(n_ctx=2304, n_batch=2048, n_ubatch=128)
    spec = "vdev:2x5.5MiB@0.1GBps"
    with pytest.raises(OutOfMemoryError, match="over its target"):
        fit(m7, devices=spec, ctx=ctx, variant="patched", timeout=120)
    p = fit(m7, devices=spec, ctx=ctx, variant="patched", check=False, timeout=120)
    assert p.path == "upstream" and p.reasons == ["device VDEV1 cannot hold its share of the dense-only layers"]
    assert p.devices[1].expected_bytes > p.devices[1].target_bytes


def test_a_broken_gguf_is_a_model_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelError):
        fit(bad, devices=TWO_EQUAL, ctx=CTX, timeout=120)


def test_cli_run_with_fit(model, capsys):
    """run --fit: the variant's own plan for the run's batch sizes, then the run (pipelined, without errors)."""
    assert cli_main(["run", model, "--fit", "--devices", TWO_EQUAL, "--margin", "3MiB", "-p", "128", "-n", "0",
                     "-b", "512", "-ub", "128", "-r", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r.get("pipeline_parallel") for r in rows) and not any(r.get("error") for r in rows)
    assert all(r["tensor_buft_overrides"] and "exps=CPU" in r["tensor_buft_overrides"] for r in rows)   # the plan's
    # the rows name the placement by where it came from and how many overrides it has
    assert all(r["host_experts"] == f"fit: {len(r['tensor_buft_overrides'].split(';'))} overrides" for r in rows), \
        [(r["host_experts"], r["tensor_buft_overrides"]) for r in rows]


def test_one_margin_is_every_devices_margin(plans, model):
    """A margin for a spec that names no device count ("cuda": every GPU fit finds) applies to each device found,
    in the plan and in what fit is given (checking one margin against a count of 1 would refuse every GPU found
    beyond the first)."""
    from pyllama_pp import devices as devspec
    from pyllama_pp.placement import _margins
    assert _margins("1GiB", devspec.parse("cuda")) == [1024**3]
    assert _margins(["1GiB", "2GiB"], devspec.parse("cuda")) == [1024**3, 2 * 1024**3]
    with pytest.raises(ConfigError, match="3 margins for 2 devices"):
        _margins(["1MiB"] * 3, devspec.parse(TWO_EQUAL))
    p = fit(model, devices=TWO_EQUAL, ctx=CTX, margin="1MiB", timeout=120)
    assert [d.free_bytes - d.target_bytes for d in p.devices] == [MiB, MiB]
    assert all(d.expected_bytes <= d.target_bytes for d in p.devices)


@pytest.mark.parametrize("how", ["each", "same"])
def test_cli_ab_with_fit_at_the_plans_own_memory(model, capsys, how):
    """ab --fit (each variant's own plan) and --fit same (the patched plan for both) on devices with no margin: every
    run fits the memory its plan measured (a measure job's coverage measurement holds no second context), the baseline
    runs unpipelined, the patched build pipelined with the copies its plan chose, and with --fit same both variants
    run the same layers and overrides."""
    assert cli_main(["ab", model, "--fit", how, "--devices", TWO_EQUAL, "-p", "256", "-n", "0", "-b", "512",
                     "-ub", "128", "-r", "1", "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"baseline", "patched"} and not any(r.get("error") for r in rows.values()), rows
    assert rows["patched"]["pipeline_parallel"] and not rows["baseline"]["pipeline_parallel"]
    # (the plan's copies are OVERLAP=2, the switch's default: a row lists only switches off their defaults)
    assert rows["patched"]["switches"] == {}, rows["patched"]["switches"]
    placement = lambda r: (r["n_gpu_layers"], r["tensor_split"], r["tensor_buft_overrides"])
    assert all("exps=CPU" in r["tensor_buft_overrides"] for r in rows.values())
    if how == "same":
        assert placement(rows["baseline"]) == placement(rows["patched"])
    else:               # upstream's plan piles the host experts on the last device: not the patched one's placement
        assert placement(rows["baseline"]) != placement(rows["patched"])


# two 8 MiB VDEVs whose host links are 3:1 in rate
LINKS_3_TO_1 = json.dumps({"kind": "vdev", "devices": [{"memory": f"{MEM}MiB", "link_gbps": 3},
                                                        {"memory": f"{MEM}MiB", "link_gbps": 1}]})


def test_spread_by_links_weighs_the_shares(plans):
    """spread="links": each device's share of the host-expert layers follows its host link (3:1 here), within one
    layer, every device within its target; equal shares on the same devices by default; weights given directly."""
    by_links = plans("patched", LINKS_3_TO_1, spread="links")
    equal = plans("patched", LINKS_3_TO_1)
    assert by_links.path == "spread" and by_links.spread_weights == [3.0, 1.0]
    host = by_links.host_expert_layers
    assert all(abs(h - sum(host) * w / 4) <= 1 for h, w in zip(host, (3, 1))), host
    assert host[0] > host[1] + 1, host
    _within_targets(by_links)
    _covers_model(by_links)
    assert equal.spread_weights == [] and abs(equal.host_expert_layers[0] - equal.host_expert_layers[1]) <= 1
    given = plans("patched", TWO_EQUAL, spread=[1, 3])
    assert given.host_expert_layers[1] > given.host_expert_layers[0] + 1, given.host_expert_layers


def test_bad_spreads_are_config_errors(model):
    for spread, kw, what in [("wide", {}, "spread takes"), ([1, 0], {}, "spread takes"), ([1, 2, 3], {}, "spread takes"),
                             ("links", {"devices": "vdev:2x8MiB@0"}, "unthrottled"),
                             ("links", {"devices": "cuda"}, "link_gbps"),
                             ("links", {"link_gbps": [4, 0]}, "rate of 0"),
                             ("links", {"link_gbps": [4]}, "1 link rates for 2 devices")]:
        with pytest.raises(ConfigError, match=what):
            fit(model, **{"devices": TWO_EQUAL, **kw}, ctx=CTX, spread=spread, timeout=60)


def test_ubatch_auto_refuses_link_rates_it_cannot_use(model):
    """--ubatch auto predicts from each device's link: a 0 rate or fewer rates than devices is a ConfigError, not a
    division by zero or a prediction from the devices that had a rate."""
    from pyllama_pp.fit import fit_ubatch
    ctx = ContextParams(n_ctx=256, n_batch=256, n_ubatch=128)
    for rates, what in (([4, 0], "rate of 0"), ([4], "1 link rates for 2 devices")):
        with pytest.raises(ConfigError, match=what):
            fit_ubatch(model, devices=TWO_EQUAL, ctx=ctx, link_gbps=rates, candidates=(64,), timeout=60)


def test_expert_bytes_per_layer_counts_every_expert_tensor(tmp_path):
    """gguf-py's names for experts include the shared-expert-channel form (`ffn_*_chexps`): counted like `_exps`."""
    import gguf
    from pyllama_pp.model_file import expert_bytes_per_layer
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "qwen3moe")
    for name in ("blk.0.ffn_up_exps.weight", "blk.0.ffn_down_chexps.weight", "blk.0.attn_q.weight"):
        w.add_tensor(name, np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert expert_bytes_per_layer(tmp_path / "x.gguf") == 2 * 4 * 8 * 4


def test_ubatch_auto_picks_the_fastest_pair_the_bytes_bound_predicts(model):
    """fit_ubatch plans every n_ubatch up to the prompt at the largest n_batch; the first without a placement ends
    the search upward, and it and every larger one is named with why and a fix; each placed candidate takes the
    n_batch of batch_choices its prediction puts first, and the pair predicted fastest wins. Without compute a
    prediction is the bytes bound."""
    from pyllama_pp.fit import fit_ubatch
    from pyllama_pp.predict import batch_choices, predict, predicted_ts
    from pyllama_pp.model_file import expert_bytes_per_layer
    ctx = ContextParams(n_ctx=1024, n_batch=256, n_ubatch=128)
    p = fit_ubatch(model, devices=TWO_EQUAL, ctx=ctx, timeout=120, count_compute=False, switches={"LAYER_MAJOR": 0},
                   expert_cache=0)   # (the search alone: no groups, no cache, whose guard keeps the links first kept)
    tried = {c["n_ubatch"]: c for c in p.ubatch_auto}
    assert sorted(tried) == [64, 128, 256, 512, 1024]
    ok = {u: c for u, c in tried.items() if c.get("predicted_ts")}
    out = {u: c for u, c in tried.items() if not c.get("predicted_ts")}
    assert ok and out and max(ok) < min(out), tried   # 8 MiB: the largest ubatches do not fit
    first_out = out[min(out)]
    assert "on the CPU" in first_out["why"] or "over its target" in first_out["why"], first_out
    assert first_out["fix"] and all(c["fix"] == first_out["fix"] for c in out.values()), out
    assert all("not planned" in c["why"] for u, c in out.items() if u > min(out)), out
    eb = expert_bytes_per_layer(model)
    chosen = (p.ctx["n_ubatch"], p.ctx["n_batch"])
    for u, c in ok.items():   # each candidate's n_batch: the best of its choices (ties: the larger)
        p.ctx["n_ubatch"] = u
        preds = {nb: predict(p, eb, [d.link["pinned_gbps"] for d in p.devices], n_tokens=1024, n_batch=nb).ts
                 for nb in batch_choices(u, 1024)}
        assert c["n_batch"] == max(preds, key=lambda nb: (preds[nb], nb)) and c["n_batch"] <= 1024, (u, c, preds)
    best = max(ok.values(), key=lambda c: (c["predicted_ts"], c["n_ubatch"]))
    assert chosen == (best["n_ubatch"], best["n_batch"]), (chosen, best)
    p.ctx["n_ubatch"] = best["n_ubatch"]
    rates = [d.link["pinned_gbps"] for d in p.devices]   # (each link as measured)
    assert p.predicted_ts == pytest.approx(predicted_ts(p, eb, rates))
    # by hand: each stage moves its host experts once per ubatch over its link; a batch of k ubatches takes k - 1
    # times the slowest stage and every stage once (the pipeline's fill)
    ub, nb = p.ctx["n_ubatch"], p.ctx["n_batch"]
    stages = [h * eb / (r * 1e9) for h, r in zip(p.host_expert_layers, rates)]
    chunks = 1024 // nb
    assert p.predicted_ts == pytest.approx(1024 / (chunks * ((-(-nb // ub) - 1) * max(stages) + sum(stages))))
    text = str(p)
    assert f"n_batch {nb}, n_ubatch {ub} predicted fastest" in text and first_out["fix"] in text
    # one line per candidate, those with the same outcome and fix in one
    assert sum(1 for line in text.splitlines() if "Fix:" in line) == 2, text


def _all_host_plan(n_batch: int) -> Plan:
    """A patched plan of six layers on two devices, every layer's experts in host RAM, n_ubatch 1000, OVERLAP=0."""
    from pyllama_pp.plan import DevicePlan
    dev = lambda first, end: DevicePlan(name="VDEV", layers=[first, end], full_layers=0, host_expert_layers=end - first,
                                        model_bytes=0, context_bytes=0, compute_bytes=0, free_bytes=0, target_bytes=0)
    return Plan(variant="patched", model="m", model_size=0, devices_spec={}, ctx={"n_ubatch": 1000, "n_batch": n_batch},
                status="success", path="spread", reasons=[], n_gpu_layers=7, tensor_split=[], tensor_overrides=[],
                n_ctx=8000, n_layer=6, n_expert=8, margins=[0, 0], devices=[dev(0, 3), dev(3, 6)],
                switches={"OVERLAP": 0})


def test_batch_choices_and_the_fill_per_batch():
    """n_batch choices are n_ubatch times powers of two below the cap, and the cap; a batch's fill is paid once per
    batch, so the prediction rises with n_batch and one ubatch a batch pipelines nothing; a last short ubatch counts
    as a whole one."""
    from pyllama_pp.predict import batch_choices, predict
    assert batch_choices(64, 1000) == [64, 128, 256, 512, 1000]
    assert batch_choices(512, 512) == [512] and batch_choices(300, 1000) == [300, 600, 1000]
    plan = _all_host_plan(n_batch=1000)
    x = 1e6 / 1e9   # 1 ms a layer's copy
    ts = {nb: predict(plan, 1e6, [1.0, 1.0], n_tokens=8000, n_batch=nb).ts for nb in (1000, 2000, 4000, 8000)}
    assert ts[1000] == pytest.approx(8000 / (8 * 6 * x))                 # one ubatch a batch: the stages in turn
    assert ts[8000] == pytest.approx(8000 / (7 * 3 * x + 6 * x))         # one batch: one fill
    assert ts[1000] < ts[2000] < ts[4000] < ts[8000]
    assert predict(plan, 1e6, [1.0, 1.0], n_tokens=8000, n_batch=1500).ts == pytest.approx(
        8000 / (5 * (3 * x + 6 * x) + 6 * x))   # batches of 1000 + 500 tokens: two ubatches each; the tail: one


def test_no_candidate_above_the_prompt_or_n_batch(model):
    """The candidates stop at the prompt and at the n_batch given (the prompt itself is one); every row's n_ubatch is
    within its n_batch, and the winner's pair runs as a context (ab -ub auto -b 1024 -p 1000 ran n_ubatch 1024)."""
    from pyllama_pp.fit import fit_ubatch
    p = fit_ubatch(model, devices="vdev:2x64MiB@1GBps", ctx=ContextParams(n_ctx=1256), n_tokens=1000, n_batch=1024,
                   count_compute=False, timeout=120)
    assert sorted(c["n_ubatch"] for c in p.ubatch_auto) == [64, 128, 256, 512, 1000]
    assert all(c["n_ubatch"] <= c["n_batch"] <= 1000 for c in p.ubatch_auto), p.ubatch_auto
    ContextParams(n_ctx=1256, n_batch=p.ctx["n_batch"], n_ubatch=p.ctx["n_ubatch"])
    q = fit_ubatch(model, devices="vdev:2x64MiB@1GBps", ctx=ContextParams(n_ctx=1256), n_tokens=1000, n_batch=300,
                   count_compute=False, timeout=120)
    assert sorted(c["n_ubatch"] for c in q.ubatch_auto) == [64, 128, 256, 300]
    assert all(c["n_ubatch"] <= c["n_batch"] <= 300 for c in q.ubatch_auto), q.ubatch_auto


def test_every_failing_candidate_is_named_with_its_fix(model):
    """With no candidate placed, the error names each (n_batch, n_ubatch) with why, one line per outcome, and a fix
    that fit checked (a smaller n_ctx that places the first) or a smaller margin."""
    from pyllama_pp.fit import fit_ubatch
    with pytest.raises(OutOfMemoryError) as e:
        fit_ubatch(model, devices="vdev:2x10MiB@4GBps", ctx=ContextParams(n_ctx=8192), count_compute=False,
                   candidates=(256, 512, 1024), timeout=120)
    lines = str(e.value).splitlines()
    assert "no candidate has a placement" in lines[0] and len(lines) == 3, lines
    assert lines[1].strip().startswith("n_ubatch 256 (n_batch 8192): leaves") and "Fix: n_ctx " in lines[1], lines
    n = int(re.search(r"Fix: n_ctx (\d+) places it", lines[1]).group(1))   # (a fit at that n_ctx places it)
    assert n < 8192
    fit(model, devices="vdev:2x10MiB@4GBps", ctx=ContextParams(n_ctx=n, n_batch=n, n_ubatch=256), timeout=120)
    assert lines[2].strip().startswith("n_ubatch 512..1024 (n_batch 8192): not planned"), lines
    with pytest.raises(OutOfMemoryError, match=r"a smaller --margin \(now 64 MiB a device\)"):
        fit_ubatch(model, devices="vdev:2x66MiB@4GBps", ctx=ContextParams(n_ctx=512), margin="64MiB",
                   count_compute=False, candidates=(256,), timeout=120)


def test_prediction_counts_compute_beside_the_copies():
    """With OVERLAP=2 a stage's copies hide under the compute of the layer before: the first copy is exposed, then
    each host-expert layer takes the longer of its copy and its compute; with OVERLAP=0 they add up; the larger of
    the slowest stage's two names the bound."""
    from pyllama_pp.compute import LayerCompute
    from pyllama_pp.predict import predict
    from pyllama_pp.plan import DevicePlan, Plan
    dev = lambda first, end, h: DevicePlan(name="VDEV", layers=[first, end], full_layers=end - first - h,
                                           host_expert_layers=h, model_bytes=0, context_bytes=0, compute_bytes=0,
                                           free_bytes=0, target_bytes=0)
    plan = Plan(variant="patched", model="m", model_size=0, devices_spec={}, ctx={"n_ubatch": 1000, "n_batch": 4000},
                status="success", path="spread", reasons=[], n_gpu_layers=7, tensor_split=[], tensor_overrides=[],
                n_ctx=4000, n_layer=6, n_expert=8, margins=[0, 0], devices=[dev(0, 3, 2), dev(3, 6, 3)],
                switches={"OVERLAP": 2})
    lc = LayerCompute("vdev", n_tokens=4000, layer_s={1000: 0.008}, outside_s={1000: 0.0})   # 2 ms a layer a ubatch
    slow_link = predict(plan, expert_bytes=3e6, link_gbps=[1.0, 1.0], compute={-1: lc})        # 3 ms a copy
    assert slow_link.bound == "transfer"
    assert slow_link.stage_s == pytest.approx([0.003 + 0.002 + 0.003 + 0.002, 0.003 + 0.002 + 2 * 0.003])
    fast_link = predict(plan, expert_bytes=1e6, link_gbps=[1.0, 1.0], compute={-1: lc})        # 1 ms a copy
    assert fast_link.bound == "compute" and fast_link.stage_s == pytest.approx([0.001 + 3 * 0.002, 0.001 + 3 * 0.002])
    assert fast_link.ts == pytest.approx(4000 / (3 * 0.007 + 2 * 0.007))   # one batch of 4 ubatches, 2 stages
    plan.switches = {"OVERLAP": 0}
    assert predict(plan, 1e6, [1.0, 1.0], compute={-1: lc}).stage_s == pytest.approx([0.002 + 0.006, 0.003 + 0.006])
    # parts of one GPU (the probe ran them together): a ubatch takes all six layers' compute or all five copies on
    # its one link, whichever is longer, and the first copy is exposed once; parts with links of their own (VDEVs
    # sharing a CPU's cores) wait for the longest device's copies
    plan.switches = {"OVERLAP": 2}
    shared = LayerCompute("cuda", n_tokens=4000, layer_s={1000: 0.008}, outside_s={1000: 0.0}, shared=True)
    one_link = lambda eb: predict(plan, eb, [1.0, 1.0], shared_link=True, compute={-1: shared}).ts
    assert one_link(1e6) == pytest.approx(4000 / (4 * 0.012 + 0.001))
    assert one_link(3e6) == pytest.approx(4000 / (4 * 0.015 + 0.003))
    assert predict(plan, 3e6, [1.0, 1.0], compute={-1: shared}).ts == pytest.approx(4000 / (4 * 0.012 + 0.003))


def test_prediction_counts_each_servers_network():
    """RPC devices whose network fit measured: a server's cycle per ubatch is its inputs up, its devices' stages and
    its output down, one after the other (the client relays a device's output to the next); the pipeline runs at the
    slowest cycle, a network slower than every stage names the bound, and the same plan without the rates (or
    without the model's hidden size) is the plan without a network."""
    from pyllama_pp.rpc import network
    from pyllama_pp.compute import LayerCompute
    from pyllama_pp.predict import predict
    from pyllama_pp.plan import DevicePlan, Plan
    net = {"up_gbps": 0.01, "down_gbps": 0.02, "rtt_s": 1e-4}
    dev = lambda first, end, server, last: DevicePlan(
        name="RPC", layers=[first, end], full_layers=end - first, host_expert_layers=0, model_bytes=0,
        context_bytes=0, compute_bytes=0, free_bytes=0, target_bytes=0, output_layer=last, server=server,
        server_net=dict(net))
    plan = Plan(variant="patched", model="m", model_size=0, devices_spec={}, ctx={"n_ubatch": 1000, "n_batch": 4000},
                status="success", path="upstream", reasons=[], n_gpu_layers=7, tensor_split=[], tensor_overrides=[],
                n_ctx=4000, n_layer=6, n_expert=8, margins=[0, 0],
                devices=[dev(0, 3, "a:1", False), dev(3, 6, "b:2", True)], switches={"OVERLAP": 2})
    lc = LayerCompute("vdev", n_tokens=4000, layer_s={1000: 0.008}, outside_s={1000: 0.0})   # 2 ms a layer a ubatch
    hidden, n_kv = 64, network.n_kv_mean(4000, 1000)
    up0, down0 = network.device_bytes(hidden, 1000, n_kv, 3)
    up1, down1 = network.device_bytes(hidden, 1000, n_kv, 3, act_out=False)
    assert down1 == 0 < down0 < up0 and up0 == up1
    p = predict(plan, 0, [1.0, 1.0], compute={-1: lc}, hidden=hidden)
    cycle0 = up0 / 0.01e9 + 0.006 + down0 / 0.02e9
    assert p.network_s == pytest.approx({"a:1": cycle0, "b:2": up1 / 0.01e9 + 0.006})
    assert p.bound == "network"
    fill = 0.012 + cycle0 - 0.006 + up1 / 0.01e9
    assert p.ts == pytest.approx(4000 / (3 * cycle0 + fill))
    assert predict(plan, 0, [1.0, 1.0], compute={-1: lc}).ts == pytest.approx(4000 / (3 * 0.006 + 0.012))
    for d in plan.devices:
        d.server_net = {"up_gbps": 1e3, "down_gbps": 1e3, "rtt_s": 1e-4}   # a fast network: compute binds again
    assert predict(plan, 0, [1.0, 1.0], compute={-1: lc}, hidden=hidden).bound == "compute"
    # both devices on one server: the boundary between them stays there (the server copies it), so only the
    # embeddings go up as hidden state and nothing comes down but logits
    for d in plan.devices:
        d.server, d.server_net = "a:1", dict(net)
    first, _ = network.device_bytes(hidden, 1000, n_kv, 3, act_out=False)
    second, _ = network.device_bytes(hidden, 1000, n_kv, 3, act_in=False, act_out=False)
    p = predict(plan, 0, [1.0, 1.0], compute={-1: lc}, hidden=hidden)
    assert second < first and p.network_s == pytest.approx({"a:1": (first + second) / 0.01e9 + 0.012})
    # the baseline's client computes an RPC device's host experts: a round trip of the hidden state a layer
    plan.variant = "baseline"
    plan.devices[0].host_expert_layers = 3
    act = 1000 * hidden * network.ACT_BYTES
    with_trips = predict(plan, 0, [1.0, 1.0], compute={-1: lc}, hidden=hidden)
    assert with_trips.ts == pytest.approx(4000 / (4 * (0.012 + (first + second + 3 * act) / 0.01e9 + 3 * act / 0.02e9)))


def test_compute_probe_replicas_and_a_compute_bound_choice(tmp_path, monkeypatch):
    """The probe runs the model's own layers (a replica with fewer of them loads and runs), finds a positive compute
    time per layer, and on slow devices with fast links --ubatch auto chooses a candidate that compute binds."""
    from pyllama_pp import compute
    from pyllama_pp.fit import fit_ubatch
    monkeypatch.setenv("PYLLAMA_PP_CACHE", str(tmp_path / "cache"))
    model = str(synth.cached_model(tmp_path, "tiny", seed=1))
    import gguf
    rep = compute.replica(model, 1)
    r = gguf.GGUFReader(str(rep))
    assert int(r.fields["qwen3moe.block_count"].contents()) == 1
    assert not [t.name for t in r.tensors if t.name.startswith("blk.1.")]
    p = fit_ubatch(model, devices="vdev:2x12MiB@8GBps,speed=6:6", ctx=ContextParams(n_ctx=512, n_batch=512),
                   candidates=(64, 128), timeout=120)
    tried = [c for c in p.ubatch_auto if c.get("predicted_ts")]
    assert tried and all(c["compute_s"] and min(c["compute_s"]) > 0 for c in tried), p.ubatch_auto
    chosen = [c for c in tried if c["n_ubatch"] == p.ctx["n_ubatch"]][0]
    assert chosen["bound"] == "compute"
    # the best prediction, unless a close one measured faster when both ran as planned
    best = max(tried, key=lambda c: c["predicted_ts"])
    assert chosen is best or p.ubatch_measured and p.ctx["n_ubatch"] == max(
        p.ubatch_measured, key=lambda r: r["measured_ts"])["n_ubatch"], (p.ubatch_auto, p.ubatch_measured)
    assert list((tmp_path / "cache" / "compute").glob("compute-*.json"))   # cached for the next plan
    # the chosen plan computes what the baseline computes on it
    from pyllama_pp.check import check_logits
    res = check_logits(model, devices="vdev:2x12MiB@8GBps,speed=6:6", placement=p.placement(),
                       ctx=ContextParams(n_ctx=512, n_batch=p.ctx["n_batch"], n_ubatch=p.ctx["n_ubatch"]),
                       n_tokens=256, switches=p.switches)
    assert res.ok and res.patched_pipeline_parallel, res


def test_cli_fit_ubatch_auto_json(model, capsys):
    assert cli_main(["fit", model, "--devices", TWO_EQUAL, "-c", "256", "-b", "256", "-ub", "auto", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ubatch_auto"] and d["predicted_ts"] > 0 and d["ctx"]["n_ubatch"] in [c["n_ubatch"] for c in d["ubatch_auto"]]


def test_one_device_plan_includes_its_copies(plans, model, tmp_path):
    """One device is pipelined too (patch 0002): its plan is measured with OVERLAP=2's copy, and a session from it
    runs pipelined with the copy, allocating what the plan expected (VDEV budgets are exact)."""
    p = plans("patched", "vdev:1x9MiB@4GBps")
    assert p.switches == {"OVERLAP": 2} and p.host_expert_layers[0] > 0
    res = run_job({"kind": "logits", "model": model, "plan": p.to_dict(), "n_tokens": 256, "logits": "last",
                   "out": str(tmp_path / "l.npy")}, "patched", timeout=120)
    assert res["schedule"]["pipeline_parallel"] is True
    assert res["ext"]["overlap"] == 2 and res["ext"]["overlap_dropped"] == 0
    (dev,) = res["counters"]["devices"]
    assert dev["failed_allocs"] == 0 and dev["peak_alloc_bytes"] <= p.devices[0].expected_bytes * 1.05 + SLACK
    assert dev["peak_alloc_bytes"] <= p.devices[0].free_bytes


# each family's tiny preset (6 layers) and a budget per VDEV that holds its attention, routers, shared experts and
# dense layers and the experts of only some layers (measured at FAMILY_CTX: spread, host experts on both devices)
FAMILY_BUDGETS = {"tiny": "5MiB", "mixtral-tiny": "3MiB", "qwen2moe-tiny": "5MiB", "glm4moe-tiny": "3.5MiB",
                  "deepseek2-tiny": "3.5MiB", "gptoss-tiny": "3.5MiB"}
FAMILY_CTX = ContextParams(n_ctx=512, n_batch=256, n_ubatch=64)


@pytest.mark.parametrize("name", sorted(FAMILY_BUDGETS))
def test_fit_places_every_synth_family(tmp_path_factory, name):
    """fit plans each family's tiny preset on 2 VDEVs too small for all its experts: the patched plan spreads the
    host-expert layers over both devices, keeps some MoE layers full, and a session from the plan runs pipelined
    within each device's memory."""
    cfg = synth.preset(name, seed=1)
    model = str(synth.cached_model(tmp_path_factory.mktemp("fit-" + name), name, seed=1))
    p = fit(model, devices=f"vdev:2x{FAMILY_BUDGETS[name]}@0.1GBps", ctx=FAMILY_CTX, variant="patched", timeout=60)
    assert p.status == "success" and p.path == "spread", (p.path, p.reasons)
    assert p.n_layer == cfg.n_layer and p.n_gpu_layers == cfg.n_layer + 1
    host, moe = p.host_expert_layers, cfg.n_layer - cfg.n_layer_dense_lead
    assert all(h > 0 for h in host) and sum(host) < moe, (host, moe)
    assert all("exps" in o for o in p.tensor_overrides), p.tensor_overrides
    res = run_job({"kind": "logits", "model": model, "plan": p.to_dict(), "n_tokens": 128, "logits": "last",
                   "out": str(tmp_path_factory.mktemp("fit-" + name + "-run") / "l.npy")}, "patched", timeout=60)
    assert res["schedule"]["pipeline_parallel"] is True
    for d, want in zip(res["counters"]["devices"], p.devices):
        assert d["failed_allocs"] == 0 and d["peak_alloc_bytes"] <= want.free_bytes, (d, want)


def test_parts_of_one_gpu_are_probed_together(monkeypatch):
    """GGML_CUDA_DEVICES splits a GPU: its parts compute on the same multiprocessors, so the probe runs them
    together; separate GPUs are probed on the first one."""
    from pyllama_pp import compute
    monkeypatch.delenv("GGML_CUDA_DEVICES", raising=False)
    assert compute.probe_devices("cuda") == [([-1], "cuda:0")]
    assert not compute.shares_one_gpu("cuda:0,1")
    monkeypatch.setenv("GGML_CUDA_DEVICES", "2")
    assert compute.probe_devices("cuda") == [([-1], "cuda")]
    assert compute.probe_devices("cuda:0,1") == [([0, 1], "cuda:0,1")]
    assert compute.probe_devices("cuda:1") == [([0], "cuda:1")] and not compute.shares_one_gpu("cuda:1")


def test_vdevs_outnumbering_the_cores_are_probed_together(monkeypatch):
    """VDEVs compute on this machine's CPU: where their threads outnumber its cores they take turns on them, so the
    probe runs them together (as parts of one GPU), speeds kept; with a core each, one VDEV of each speed stands for
    its kind; VDEVs of one link group copy over one link."""
    from pyllama_pp import compute
    from pyllama_pp import devices as devspec
    from pyllama_pp.devices import vdev
    monkeypatch.setattr(vdev, "usable_cores", lambda: 2)
    assert compute.shares_one_gpu("vdev:3x0@0") and not compute.shares_one_gpu("vdev:2x0@0")
    ((idx, spec),) = compute.probe_devices("vdev:3x8MiB@1GBps,speed=1:3:3")
    assert idx == [0, 1, 2] and [(d["speed"], d["memory"], d["link_gbps"]) for d in json.loads(spec)["devices"]] == \
        [(1.0, 0, 0), (3.0, 0, 0), (3.0, 0, 0)]
    assert [idx for idx, _ in compute.probe_devices("vdev:2x8MiB@1GBps,speed=1:3")] == [[0], [1]]
    assert devspec.parse("vdev:2x8MiB@1GBps,shared").one_link and not devspec.parse("vdev:2x8MiB@1GBps").one_link


def test_links_are_measured_and_predictions_use_them(model, tmp_path, monkeypatch):
    """fit_ubatch measures each device's host link once (pinned and pageable copies) and, for an mmap-ed model, the
    host's staging copy (cached for later plans, by the copier threads STAGING sets: a plan with other threads
    measures its own); a rate given wins, then the measured one, then the spec's own."""
    from pyllama_pp import devices as devspec
    from pyllama_pp.fit import fit_ubatch
    from pyllama_pp.placement import cached_rate, host_copy_key
    from pyllama_pp.predict import link_rates
    monkeypatch.setenv("PYLLAMA_PP_CACHE", str(tmp_path))
    p = fit_ubatch(model, devices=TWO_EQUAL, ctx=ContextParams(n_ctx=512), count_compute=False, load_mode="mmap",
                   candidates=(64, 128), timeout=120)
    assert all(d.link and d.link["pinned_gbps"] > 0 and d.link["pageable_gbps"] > 0 for d in p.devices), p.devices
    assert p.host_copy_gbps and cached_rate("host_copy_gbps", host_copy_key({})) == p.host_copy_gbps
    assert cached_rate("host_copy_gbps", host_copy_key({"STAGING": 2})) is None
    two = fit_ubatch(model, devices=TWO_EQUAL, ctx=ContextParams(n_ctx=512), count_compute=False, load_mode="mmap",
                     candidates=(64,), timeout=120, switches={"STAGING": 2})
    assert two.host_copy_gbps and cached_rate("host_copy_gbps", host_copy_key({"STAGING": 2})) == two.host_copy_gbps
    assert host_copy_key({"STAGING": 1}) == host_copy_key({}) != host_copy_key({"STAGING": 2})
    assert "links (measured" in str(p) and "host staging copy" in str(p)
    spec = devspec.parse(TWO_EQUAL)
    measured = [{"pinned_gbps": 3.0, "pageable_gbps": 2.0}, None]
    assert link_rates(spec, None, 2, measured) == [3.0, 4.0]            # (the second: the spec's own)
    assert link_rates(spec, None, 2, measured, "pageable") == [2.0, 4.0]
    assert link_rates(spec, [5, 6], 2, measured) == [5.0, 6.0]


def test_an_mmap_ed_models_copies_wait_for_the_staging_copy():
    """The patched build stages an mmap-ed model's experts through pinned slots: a copy moves at the slower of the
    link and the host's copy, and one copier serves every device (each ubatch waits for all devices' bytes)."""
    from pyllama_pp.predict import predict
    plan = _all_host_plan(n_batch=4000)
    pinned = predict(plan, 1e6, [1.0, 1.0], n_tokens=4000)
    assert pinned.ts == pytest.approx(4000 / (3 * 3e-3 + 6e-3))
    fast_copy = predict(plan, 1e6, [1.0, 1.0], n_tokens=4000, staging_gbps=10.0)   # 6 MB a ubatch at 10 GB/s: 0.6 ms
    assert fast_copy.ts == pytest.approx(pinned.ts)
    slow_copy = predict(plan, 1e6, [1.0, 1.0], n_tokens=4000, staging_gbps=0.5)   # each copy at 0.5 GB/s: 2 ms
    assert slow_copy.stage_s == pytest.approx([6e-3, 6e-3])
    assert slow_copy.ts == pytest.approx(4000 / (3 * 12e-3 + 12e-3))              # all six copies through one copier


# -- LAYER_MAJOR (patch 0015): a batch's ubatches in groups, one expert upload a group ------------------------------
LM_CTX = ContextParams(n_ctx=512, n_batch=128, n_ubatch=32)
LM_SLOW = f"vdev:2x{MEM}MiB@0.2GBps"


def _layer_major(v) -> dict:
    return {"GGML_SCHED_PP_LAYER_MAJOR": str(v)}


def test_layer_major_group_size():
    """K = min(LAYER_MAJOR, n_batch / n_ubatch), 1 meaning every ubatch of a batch, as llama forms the groups; none
    (1) without the switch, for the baseline, with one ubatch a batch or no host experts."""
    from pyllama_pp.layer_major_plan import layer_major_group
    plan = _all_host_plan(n_batch=4000)
    assert layer_major_group(plan) == 1
    for v, nb, k in ((1, 4000, 4), (1, 3500, 4), (2, 4000, 2), (8, 4000, 4), (1, 1000, 1), (3, 2000, 2)):
        plan.switches["LAYER_MAJOR"] = v
        assert layer_major_group(plan, nb) == k, (v, nb)
    assert layer_major_group(dataclasses.replace(plan, variant="baseline")) == 1
    for d in plan.devices:
        d.host_expert_layers = 0
    assert layer_major_group(plan) == 1


def test_prediction_with_groups_moves_a_layers_experts_once_a_group():
    """With LAYER_MAJOR a group moves each expert tensor once for its K ubatches: bytes per token fall by K. A
    batch that is one group (LAYER_MAJOR=1) runs its stages in turn (groups, not ubatches, pipeline); two groups a
    batch pipeline; with compute, a group computes K ubatches beside its copies (OVERLAP=2)."""
    from pyllama_pp.compute import LayerCompute
    from pyllama_pp.predict import predict
    plan = _all_host_plan(n_batch=4000)   # six host-expert layers, 3 a device, n_ubatch 1000, OVERLAP=0
    x = 1e6 / 1e9
    off = predict(plan, 1e6, [1.0, 1.0], n_tokens=8000)
    plan.switches["LAYER_MAJOR"] = 1
    on = predict(plan, 1e6, [1.0, 1.0], n_tokens=8000)
    per_token = lambda p: sum(p.transfer_s) / (p.group * 1000)
    assert off.group == 1 and on.group == 4 and per_token(on) == pytest.approx(per_token(off) / 4)
    assert off.ts == pytest.approx(8000 / (2 * (3 * 3 * x + 6 * x)))   # four ubatches a batch, pipelined
    assert on.ts == pytest.approx(8000 / (2 * 6 * x))                  # one group a batch: the two stages in turn
    plan.switches["LAYER_MAJOR"] = 2
    two = predict(plan, 1e6, [1.0, 1.0], n_tokens=8000)
    assert two.group == 2 and two.ts == pytest.approx(8000 / (2 * (3 * x + 6 * x)))
    lc = LayerCompute("vdev", n_tokens=8000, layer_s={1000: 0.016}, outside_s={1000: 0.0})   # 2 ms a layer a ubatch
    plan.switches = {"OVERLAP": 2, "LAYER_MAJOR": 1}
    p = predict(plan, 3e6, [1.0, 1.0], n_tokens=8000, compute={-1: lc})   # 3 ms a copy, 8 ms a layer's group
    assert p.bound == "compute" and p.stage_s == pytest.approx([0.003 + 3 * 0.008] * 2)
    assert p.ts == pytest.approx(8000 / (2 * 2 * 0.027))
    plan.variant = "baseline"
    assert predict(plan, 1e6, [1.0, 1.0], n_tokens=8000).group == 1


def test_fit_plans_a_groups_memory(model, capsys):
    """The patched fit's dry runs reserve a group's worst case (its ubatches' activations, its whole expert copies)
    with the switch in their environment: each device's compute buffer grows with K, the placement makes room for
    it, and the plan says the group and its bytes a device (a dry run without the switch). LAYER_MAJOR=0 plans
    exactly what no switch plans; the CLI's --switch is the API's env."""
    plain = fit(model, devices=TWO_EQUAL, ctx=LM_CTX, timeout=120)
    off = fit(model, devices=TWO_EQUAL, ctx=LM_CTX, env=_layer_major(0), timeout=120)
    same = lambda p: json.dumps({**p.to_dict(), "seconds": 0}, sort_keys=True)
    assert same(off) == same(plain) and "layer_major" not in off.to_dict() and "layer major" not in str(off)
    two = fit(model, devices=TWO_EQUAL, ctx=LM_CTX, env=_layer_major(2), timeout=120)
    four = fit(model, devices=TWO_EQUAL, ctx=LM_CTX, env=_layer_major(1), timeout=120)
    assert (two.layer_major["group"], four.layer_major["group"]) == (2, 4)
    assert two.switches == {"OVERLAP": 2, "LAYER_MAJOR": 2} and four.switches == {"OVERLAP": 2, "LAYER_MAJOR": 1}
    for p0, p2, p4 in zip(plain.devices, two.devices, four.devices):
        assert p0.compute_bytes < p2.compute_bytes < p4.compute_bytes, (p0, p2, p4)
    assert all(0 < a < b for a, b in zip(two.layer_major["bytes"], four.layer_major["bytes"])), (two.layer_major,
                                                                                                four.layer_major)
    _within_targets(four)
    # (room for the group's buffers: more of the experts stay in host RAM than without the switch)
    assert sum(four.host_expert_layers) > sum(plain.host_expert_layers)
    assert four.layer_major["without"]["host_expert_layers"] == plain.host_expert_layers
    assert "groups of 4 ubatches (n_batch 128 / n_ubatch 32)" in str(four) and "MiB a device" in str(four)
    assert Plan.from_dict(four.to_dict()).layer_major == four.layer_major
    assert cli_main(["fit", model, "--devices", TWO_EQUAL, "-c", "512", "-b", "128", "-ub", "32",
                     "--switch", "LAYER_MAJOR=1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["switches"] == four.switches and d["layer_major"] == four.layer_major
    assert d["tensor_overrides"] == four.tensor_overrides


def test_ubatch_auto_with_groups_takes_a_smaller_ubatch(model, fake_compute):
    """On slow links without the switch every ubatch moves the experts again, so the largest placed n_ubatch wins;
    with LAYER_MAJOR=1 a group moves them once, the copies no longer bind, and the smaller ubatch's cheaper compute
    wins. Where the prompt's n_batch leaves no room for a group, the candidate takes the largest n_batch that has
    (named with the larger one's reason); the winner's plan is made at its own pair and carries the switch. With the
    switch not set, a prompt-only workload takes the groups by the prediction; FIT's chat workload, weighed on its
    decode too (the stated costs: no cache pays), takes them as well."""
    from pyllama_pp.fit import fit_ubatch
    from pyllama_pp.layer_major_plan import layer_major_group
    fake_compute(lambda u: 1e-6 + 1e-8 * u)   # (seconds a layer a token rise with n_ubatch, as a GPU's past its best)
    kw = dict(devices=LM_SLOW, ctx=ContextParams(n_ctx=1280), n_tokens=1024, candidates=(32, 128), timeout=120)
    without = fit_ubatch(model, env=_layer_major(0), **kw)
    assert without.ctx["n_ubatch"] == 128 and not without.switches.get("LAYER_MAJOR") and not without.layer_major
    p = fit_ubatch(model, env=_layer_major(1), **kw)
    default = fit_ubatch(model, workload="prompt", **kw)   # (the switch not set: -ub auto weighs it, and takes it here)
    assert default.switches["LAYER_MAJOR"] == 1 and default.ctx == p.ctx and "predicted" in default.layer_major["why"]
    chat = fit_ubatch(model, **kw)   # (FIT's workload decodes too: weighed on it, its prompts gain more than decode)
    assert chat.switches["LAYER_MAJOR"] == 1 and chat.ctx == p.ctx and chat.layer_major["weighed"]["chosen"] == "on"
    rows = {r["n_ubatch"]: r for r in p.ubatch_auto}
    assert p.ctx["n_ubatch"] == 32 and p.predicted_ts == max(r["predicted_ts"] for r in rows.values())
    assert p.switches["LAYER_MAJOR"] == 1 and p.layer_major["group"] == rows[32]["group"] == layer_major_group(p) > 1
    assert p.ctx["n_batch"] == rows[32]["n_batch"] and all(r["n_ubatch"] <= r["n_batch"] <= 1024 for r in rows.values())
    _within_targets(p)
    capped = [r for r in rows.values() if r.get("larger_batch")]
    assert capped and all(r["n_batch"] < 1024 and r["larger_batch"].startswith("n_batch 1024: ") for r in capped)
    r = capped[0]   # (its larger n_batch has no placement indeed)
    with pytest.raises(OutOfMemoryError):
        fit(model, devices=LM_SLOW, ctx=ContextParams(n_ctx=1280, n_batch=1024, n_ubatch=r["n_ubatch"]),
            env=_layer_major(1), timeout=120)
    assert f"groups of {p.layer_major['group']}" in str(p) and "n_batch 1024: " in str(p)


def test_upload_share_is_the_coverage_below_the_upload_all_bar():
    """An upload moves the share of a layer's experts its tokens use (near-uniform routing: 1 - (1 - k/E)^n, rising
    with n) below UPLOAD_ALL's bar, whole tensors at or above it (selections at UPLOAD_ALL_MIN, coverage at
    UPLOAD_ALL_MIN_COV: auto 110 / links within 30..85); the baseline and UPLOAD_ALL=0 copy the used experts alone."""
    from pyllama_pp.predict import expected_coverage, upload_share
    covs = [expected_coverage(n, 2, 64) for n in (1, 8, 32, 64, 128, 512)]
    assert covs[0] == pytest.approx(2 / 64) and all(a < b for a, b in zip(covs, covs[1:])) and covs[-1] < 1.0
    share = lambda n, sw=None, links=1, in_flight=True, variant="patched": upload_share(n, 2, 64, variant, sw or {},
                                                                                        links, in_flight)
    assert share(32) == pytest.approx(expected_coverage(32, 2, 64)) and share(32) < 0.85   # ub32: ~63% used
    assert share(64) == 1.0 and share(128) == 1.0                               # ~87%: at the one-link bar of 85%
    assert share(64, in_flight=False) < 1.0 and share(128, in_flight=False) == 1.0   # (4 x E selections when idle)
    assert share(64, {"UPLOAD_ALL_MIN_COV": 90}) < 1.0 and share(128, {"UPLOAD_ALL_MIN_COV": 90}) == 1.0
    assert share(32, {"UPLOAD_ALL_MIN": 1, "UPLOAD_ALL_MIN_COV": 0}) == 1.0      # forced: always whole
    low_min = {"UPLOAD_ALL_MIN": 1}
    assert share(40, low_min, links=2) == 1.0 > share(40, low_min)               # two links: the 55% bar (~72%)
    assert share(40, {**low_min, "LINKS": 1}, links=2) == share(40, low_min)     # LINKS set: its count
    for kw in ({"sw": {"UPLOAD_ALL": 0}}, {"variant": "baseline"}):
        assert share(512, **kw) == pytest.approx(expected_coverage(512, 2, 64)), kw
    assert upload_share(32, 0, 64, "patched", {}, 1, True) == 1.0                 # experts used not known: whole


def test_ubatch_auto_takes_the_fastest_measured_of_the_closest_pairs(model, fake_compute, monkeypatch):
    """Compute alike at every n_ubatch: the predictions of the largest pairs lie close, and -ub auto runs the closest
    (at most UBATCH_MEASURE.most, each within its band of the best) and takes the fastest measured, not the best
    predicted; with measure=1 the prediction alone decides. The plan says what it measured, and keeps it in its
    JSON."""
    import sys
    from pyllama_pp.defaults import UBATCH_MEASURE
    fit_mod = sys.modules["pyllama_pp.fit"]   # (the package's `fit` is the function)
    fake_compute(lambda u: 1e-4)   # (compute binds, alike a token at every n_ubatch)
    asked = []

    def slowest_predicted_fastest(plans, **kw):   # (measured in the reverse order of the predictions)
        asked.append([(p.ctx["n_ubatch"], p.predicted_ts) for p in plans])
        return [1e6 / p.predicted_ts for p in plans]
    monkeypatch.setattr(fit_mod, "measure_prompts", slowest_predicted_fastest)
    kw = dict(devices=TWO_EQUAL, ctx=ContextParams(n_ctx=512), n_tokens=256, candidates=(32, 64, 128),
              timeout=120, env=_layer_major(0))
    alone = fit_mod.fit_ubatch(model, measure=1, **kw)
    assert not asked and not alone.ubatch_measured
    p = fit_mod.fit_ubatch(model, **kw)
    (ran,) = asked
    best = max(ts for _, ts in ran)
    assert 2 <= len(ran) <= UBATCH_MEASURE.most and ran[0] == (alone.ctx["n_ubatch"], best)
    assert all(ts >= (1 - UBATCH_MEASURE.band) * best for _, ts in ran)
    slowest = min(ran, key=lambda r: r[1])
    assert p.ctx["n_ubatch"] == slowest[0] != alone.ctx["n_ubatch"] and p.predicted_ts == slowest[1]
    assert [(r["n_ubatch"], r["predicted_ts"]) for r in p.ubatch_measured] == ran
    assert "ran the closest predictions as planned" in str(p) and f"* n_ubatch {slowest[0]}," in str(p)
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).ubatch_measured == p.ubatch_measured


def test_measure_prompts_runs_a_plan_as_planned(plans, model, monkeypatch):
    """What -ub auto measures a close pair with: the plan's placement, pair and switches in a worker, a positive t/s
    for each plan; pairs with the same placement share one load (a fresh context each)."""
    import sys
    fit_mod = sys.modules["pyllama_pp.fit"]
    p = plans("patched", TWO_EQUAL)
    q = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    q.ctx = {**q.ctx, "n_ubatch": p.ctx["n_ubatch"] // 2}
    jobs = []
    real = fit_mod.run_job
    monkeypatch.setattr(fit_mod, "run_job", lambda job, *a, **kw: jobs.append(job) or real(job, *a, **kw))
    got = fit_mod.measure_prompts([p, q], model, TWO_EQUAL, 128, "none", timeout=120)
    assert len(got) == 2 and min(got) > 0
    (job,) = jobs
    assert [e["ctx"]["n_ubatch"] for e in job.ctx_list] == [p.ctx["n_ubatch"], p.ctx["n_ubatch"] // 2]


def test_prediction_moves_the_used_experts_of_a_small_ubatch():
    """predict's copies at a small n_ubatch fall by the coverage against whole tensors; a LAYER_MAJOR group of K
    ubatches is one upload for K x n_ubatch tokens (past the bar: whole); a big ubatch stays whole."""
    from pyllama_pp.predict import expected_coverage, predict
    plan = dataclasses.replace(_all_host_plan(n_batch=1024), n_expert=64, ctx={"n_ubatch": 32, "n_batch": 1024})
    whole = predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024)
    used = predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024, n_used=2)
    cov = expected_coverage(32, 2, 64)
    assert used.transfer_s == pytest.approx([t * cov for t in whole.transfer_s]) and used.ts > whole.ts
    assert predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024, n_used=2,
                   switches={"UPLOAD_ALL_MIN": 1, "UPLOAD_ALL_MIN_COV": 0}).transfer_s == whole.transfer_s
    plan.switches["LAYER_MAJOR"] = 4   # four ubatches, 128 tokens, an upload: ~98% of the experts, whole
    group = predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024, n_used=2)
    assert group.group == 4 and group.transfer_s == whole.transfer_s
    plan.switches["LAYER_MAJOR"] = 0
    plan.ctx["n_ubatch"] = 512
    assert predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024, n_used=2).transfer_s == \
        predict(plan, 1e6, [1.0, 1.0], shared_link=True, n_tokens=1024).transfer_s


def test_a_given_placement_is_measured_as_fit_measures_its_own(plans, model):
    """placement.measure (a run's own placement, no fit): fit's plan applied as a given placement measures the same
    layers, host-expert layers and bytes per device as fit's dry run did; the patched build's rates come with it (the
    expert cache prices misses at the links)."""
    from pyllama_pp.placement import measure
    fitted = plans("patched", TWO_EQUAL)
    got = measure(model, TWO_EQUAL, fitted.placement(), CTX, switches=fitted.switches)
    assert got.path == "given" and got.host_expert_layers == fitted.host_expert_layers
    assert [(d.layers, d.model_bytes, d.context_bytes, d.compute_bytes, d.target_bytes) for d in got.devices] == \
        [(d.layers, d.model_bytes, d.context_bytes, d.compute_bytes, d.target_bytes) for d in fitted.devices]
    assert all(d.link and d.link["pinned_gbps"] > 0 for d in got.devices)
    every = measure(model, TWO_EQUAL, Placement(host_experts="all"), CTX, switches=fitted.switches)
    assert sum(every.host_expert_layers) == N_LAYER and sum(d.model_bytes for d in every.devices) < \
        sum(d.model_bytes for d in fitted.devices)


def test_layer_major_stays_off_where_its_groups_would_lower_what_a_device_keeps():
    """fit's LAYER_MAJOR trial (_with_layer_major) keeps the switch off where the groups' buffers would cost device
    memory that held experts: more host-expert layers on a device, or a layer with part of its FFN moved to the CPU
    (the same host-expert counts); with the same residency the groups are taken."""
    from pyllama_pp.fit import _with_layer_major
    from pyllama_pp.plan import DevicePlan
    from pyllama_pp.workload import Workload

    def plan(host: int, partial: int = 0, lm: int = 0) -> Plan:
        dev = lambda first, end: DevicePlan(name="VDEV", layers=[first, end], full_layers=end - first - host,
                                            host_expert_layers=host, partial_layers=partial, model_bytes=0,
                                            context_bytes=0, compute_bytes=0, free_bytes=0, target_bytes=0)
        return Plan(variant="patched", model="m", model_size=0, devices_spec={}, ctx={"n_ubatch": 64, "n_batch": 512},
                    status="success", path="spread", reasons=[], n_gpu_layers=7, tensor_split=[], tensor_overrides=[],
                    n_ctx=512, n_layer=6, n_expert=8, margins=[0, 0], devices=[dev(0, 3), dev(3, 6)],
                    switches={"LAYER_MAJOR": lm} if lm else {})
    wl = Workload.parse("pp=512,tg=0")
    taken, why = _with_layer_major(plan(2), wl, lambda sw: plan(2, lm=1), {}, "groups")
    assert taken.switches.get("LAYER_MAJOR") == 1 and why == "" and taken.layer_major["why"] == "groups"
    for worse in (plan(3, lm=1), plan(2, partial=1, lm=1)):
        kept, why = _with_layer_major(plan(2), wl, lambda sw: worse, {}, "groups")
        assert "LAYER_MAJOR" not in kept.switches and "host RAM" in why, why
