"""fit plans the device expert cache (pyllama_pp.expert_cache_plan, `--expert-cache auto|SIZE|Nslots|0`): the slots a layer
and bytes a device gets follow the native allocation's rule (and the device allocates exactly those slots); auto
takes what the plan leaves free, with no device past it, and puts each share into the device's margin; a SIZE is
reserved before fit places the layers, and one that leaves the model no room is a ConfigError naming the device and
its free memory; a cache of 0 leaves the plan as it was; run and ab take the option as fit does, and their rows and
tables show the cache's hit rate where it ran."""
from __future__ import annotations

import itertools
import json

import pandas as pd
import pytest

import pyllama_pp
from pyllama_pp import cli, devices as devspec, model_file, report, synth
from pyllama_pp.defaults import FIT
from pyllama_pp.errors import ConfigError
from pyllama_pp.expert_cache_plan import Layout, auto_switch, layout_of, own_slots
from pyllama_pp.placement import fit  # (auto: the leftover, the memory planner's start: tests/test_memory_plan.py)
from pyllama_pp.placement import reserved_bytes
from pyllama_pp.params import ContextParams
from pyllama_pp.plan import Plan
from pyllama_pp.row import Row, frame
from pyllama_pp.planning import Choices, plan_runs
from pyllama_pp.switches import ExpertCache
from pyllama_pp.worker import run_job

MiB = 1024**2
CTX = ContextParams(n_ctx=512, n_batch=512, n_ubatch=128)
# 12 tiny layers on two 10 MiB VDEVs: 2-3 layers a device keep their experts in host RAM, and the plan leaves
# about 1 MiB free on each
SPEC = "vdev:2x10MiB@4GBps"
# the tiny preset's expert slices: one expert of a layer in gate, up and down
TINY = Layout(slot_bytes=synth.expert_bytes_per_layer(synth.preset("tiny")) / 64, n_expert=64, n_used=2, weights=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(synth.cached_model(tmp_path_factory.mktemp("cacheplan"), "tiny", seed=1, n_layer=12))


@pytest.fixture(scope="module")
def plans(model):
    """expert_cache -> fit's plan on SPEC at CTX, each made once."""
    cache: dict = {}

    def get(value) -> Plan:
        if value not in cache:
            cache[value] = fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=value)
        return cache[value]
    return get


def _without_time(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "seconds"}


# --- the native allocation's rule --------------------------------------------------------------------------------

def test_a_budget_in_mib_holds_and_takes_every_slot_that_fits():
    """EXPERT_CACHE=M: a device's slots never take more than M MiB, one more slot a layer would (unless every expert
    is cached), and more MiB never give fewer slots; -N: N slots a layer (at most every expert); 0 or no host-expert
    layers: none."""
    for mib, layers in itertools.product(range(1, 12), range(1, 7)):
        s = TINY.slots_at(mib, layers)
        assert TINY.bytes_of(s, layers) <= mib * MiB, (mib, layers, s)
        assert s == TINY.n_expert or TINY.bytes_of(s + 1, layers) > mib * MiB, (mib, layers, s)
        assert TINY.slots_at(mib + 1, layers) >= s
    assert [TINY.slots_at(-n, 3) for n in (1, 8, 64, 500)] == [1, 8, 64, 64]
    assert TINY.slots_at(0, 3) == TINY.slots_at(4, 0) == TINY.bytes_of(0, 3) == 0


@pytest.mark.parametrize("layers, room", [([2, 3], [MiB, 1.4 * MiB]), ([1, 6], [3 * MiB, 3 * MiB]),
                                          ([4, 4], [20 * MiB, 0.3 * MiB]), ([0, 5], [0, 2.5 * MiB]),
                                          ([3, 3], [40 * MiB, 40 * MiB])])
def test_auto_stays_within_every_devices_room_and_takes_the_most(layers, room):
    """auto's one switch value: no device's slots past its room, and neither a larger budget in MiB nor one more
    slot a layer would keep every device within its room while caching more experts."""
    room = [int(r) for r in room]
    sw = auto_switch(TINY, layers, room)
    cached = lambda x: sum(n * TINY.slots_at(x, n) for n in layers)
    fits = lambda x: all(TINY.bytes_of(TINY.slots_at(x, n), n) <= r for n, r in zip(layers, room))
    assert sw != 0 and fits(sw), (sw, layers, room)
    mib = max((m for m in range(1, 200) if fits(m)), default=0)   # (the largest budget within every room)
    slots = max(n for n in range(0, TINY.n_expert + 1) if fits(-n))
    assert cached(sw) >= cached(mib) and cached(sw) >= cached(-slots), (sw, mib, slots)
    if sw > 0 and cached(sw + 1) > cached(sw):
        assert not fits(sw + 1)


def test_auto_prefers_mib_where_slots_a_layer_would_hold_a_device_back():
    """One device of 1 host-expert layer beside one of 6, the same room: MiB a device gives the small one all it can
    hold, while N slots a layer would give it only what the big one has room for."""
    sw = auto_switch(TINY, [1, 6], [3 * MiB, 3 * MiB])
    assert sw > 0 and TINY.slots_at(sw, 1) > TINY.slots_at(sw, 6)


def test_auto_without_room_for_a_tokens_experts_plans_none():
    assert auto_switch(TINY, [3, 3], [TINY.bytes_of(TINY.n_used, 3) - 1, 50 * MiB]) == 0
    assert auto_switch(TINY, [0, 0], [50 * MiB, 50 * MiB]) == 0


def test_unequal_devices_take_their_own_slots_where_one_value_would_waste_room():
    """own_slots: equal devices (or unequal ones whose one value already fills each room) keep one value (None); a
    device with more room than one value uses takes the most its own room allows; one without room for a token's
    experts takes none while the other still caches (one value would have given both none)."""
    assert own_slots(TINY, auto_switch(TINY, [3, 3], [2 * MiB] * 2), [3, 3], [2 * MiB] * 2) is None
    small, big = TINY.bytes_of(TINY.n_used, 3) - 1, 3 * MiB
    assert auto_switch(TINY, [3, 3], [small, big]) == 0
    assert own_slots(TINY, 0, [3, 3], [small, big]) == [0, TINY.most_slots(big, 3)]
    sw = auto_switch(TINY, [3, 3], [MiB, 3 * MiB])
    own = own_slots(TINY, sw, [3, 3], [MiB, 3 * MiB])
    assert own == [TINY.most_slots(MiB, 3), TINY.most_slots(3 * MiB, 3)] and own[1] > TINY.slots_at(sw, 3)
    assert all(TINY.bytes_of(n, 3) <= r for n, r in zip(own, [MiB, 3 * MiB]))


# two VDEVs of unequal memory: fit leaves them unequal room and host-expert layers
UNEQUAL = json.dumps({"kind": "vdev", "devices": [{"memory": "10MiB", "link_gbps": 4},
                                                  {"memory": "14MiB", "link_gbps": 4}]})


def test_auto_on_unequal_devices_gives_each_its_own_slots(model, tmp_path):
    """auto where one value would leave a device's room unused: the switch is a list, one value per device, each
    device's slots the most its own room allows (within it), more than one value gives it on at least one; the plan's
    text says so; each device allocates its own slots."""
    p0 = fit(model, devices=UNEQUAL, ctx=CTX, timeout=120, expert_cache=0)
    pa = fit(model, devices=UNEQUAL, ctx=CTX, timeout=120, expert_cache="auto")
    layers = [d.host_expert_layers for d in p0.devices]
    room = [d.target_bytes - d.expected_bytes for d in p0.devices]
    one = auto_switch(TINY, layers, room)
    sw = pa.switches["EXPERT_CACHE"]
    assert sw == ",".join(str(-d.cache_slots) for d in pa.devices), sw
    assert [d.cache_slots for d in pa.devices] == [TINY.most_slots(r, n) for r, n in zip(room, layers)]
    assert all(0 < d.cache_bytes <= r for d, r in zip(pa.devices, room))
    assert any(d.cache_slots > TINY.slots_at(one, n) for d, n in zip(pa.devices, layers))
    assert "one value per device" in pa.cache_text and ExpertCache.of_switch(sw).text in pa.cache_text
    job = {"kind": "logits", "model": model, "devices": UNEQUAL, "placement": pa.placement().to_dict(),
           "ctx": {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}, "n_tokens": 4, "logits": "last", "seed": 0,
           "out": str(tmp_path / "logits.npy"), "switches": pa.switches}
    res = run_job(job, "patched", timeout=120)
    got = {b["name"]: b["cache_slots"] for b in res["ext"]["backends"]}
    assert [got[d.name] for d in pa.devices] == [d.cache_slots for d in pa.devices]


def test_run_plan_replays_a_per_device_cache(model, capsys, tmp_path):
    """run --plan with a plan whose cache is a list: the run sets the plan's list (its rows' switches in
    --expert-cache's form), each device reads its own slots, and the rows give each device's hit rate."""
    path = tmp_path / "plan.json"
    assert cli.main(["fit", model, "--devices", UNEQUAL, "-c", "512", "-b", "512", "-ub", "128", "--expert-cache",
                     "6slots,2slots", "-o", str(path)]) == 0
    capsys.readouterr()
    assert Plan.load(str(path)).switches["EXPERT_CACHE"] == "-6,-2"
    assert cli.main(["run", model, "--plan", str(path), "-p", "0", "-n", "16", "-r", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["switches"]["EXPERT_CACHE"] == "-6,-2", row["switches"]
    rates = row["expert_cache_hit_rate_per_device"]
    assert len(rates) == 2 and all(r is not None and 0 <= r <= 1 for r in rates), rates


def test_a_list_asks_each_device_its_own(plans):
    """--expert-cache 3slots,5slots: each device's slots as given, each share in its own margin; the switch -3,-5."""
    p0, pl = plans(0), plans("3slots,5slots")
    assert pl.switches["EXPERT_CACHE"] == "-3,-5" and [d.cache_slots for d in pl.devices] == [3, 5]
    assert pl.margins == [m + d.cache_bytes for m, d in zip(p0.margins, pl.devices)]
    assert plans("4slots,4slots").switches["EXPERT_CACHE"] == -4   # (equal devices: one value)


# --- fit -------------------------------------------------------------------------------------------------------

def test_auto_takes_what_the_plan_leaves_free(plans):
    """The same placement as without the cache; each device's share within what that plan left free, added to its
    margin (its target lowered by as much); the switch in the plan's switches; the plan's text, table and JSON show
    each device's share."""
    p0, pa = plans(0), plans("auto")
    assert (pa.tensor_overrides, pa.n_gpu_layers, pa.tensor_split) == (p0.tensor_overrides, p0.n_gpu_layers,
                                                                      p0.tensor_split)
    assert all(h > 0 for h in pa.host_expert_layers), pa.host_expert_layers
    for d0, d in zip(p0.devices, pa.devices):
        assert 0 < d.cache_bytes <= d0.target_bytes - d0.expected_bytes, (d.name, d.cache_bytes)
        assert d.cache_slots >= 2 and d.target_bytes == d0.target_bytes - d.cache_bytes
        assert d.expected_bytes <= d.target_bytes
    assert pa.margins == [m + d.cache_bytes for m, d in zip(p0.margins, pa.devices)]
    sw = pa.switches["EXPERT_CACHE"]
    assert sw != 0 and {k: v for k, v in pa.switches.items() if not k.startswith("EXPERT_CACHE")} == p0.switches
    assert pa.switches["EXPERT_CACHE_MIN_HIT"] == pa.cache_guard["min_hit"]["none"]   # (its guard, from costs)
    line = next(ln for ln in str(pa).splitlines() if "(asked: auto)" in ln)
    assert f"expert cache {ExpertCache.of_switch(sw).text} (asked: auto)" in line and all(f"{d.name} {d.cache_bytes / MiB:.2f} MiB, {d.cache_slots} slots"
                                                in line for d in pa.devices), line
    assert "margin" not in line and "kept free on each device beside its layers" in line, line   # (the margin is 0)
    d = pa.to_dict()
    assert d["expert_cache"] == "auto" and [x["cache_slots"] for x in d["devices"]] == [x.cache_slots for x in pa.devices]
    assert Plan.from_dict(json.loads(json.dumps(d))).to_dict() == d
    assert list(pa.to_frame()["cache_bytes"]) == [x.cache_bytes for x in pa.devices]


def test_the_device_allocates_the_planned_slots(plans, model, tmp_path):
    """Decode with the plan's placement and switches: each device's cache holds the slots the plan says, in no more
    memory than the plan gave it, and its lookups run."""
    for value in ("auto", "2MiB"):
        plan = plans(value)
        job = {"kind": "logits", "model": model, "devices": SPEC, "placement": plan.placement().to_dict(),
               "ctx": {"n_ctx": 64, "n_batch": 1, "n_ubatch": 1}, "n_tokens": 8, "logits": "last", "seed": 0,
               "out": str(tmp_path / "logits.npy")}
        res = run_job(job, "patched", timeout=120, env={f"GGML_SCHED_PP_{k}": str(v) for k, v in plan.switches.items()})
        got = {b["name"]: b for b in res["ext"]["backends"]}
        for d in plan.devices:
            b = got[d.name]
            assert b["cache_slots"] == d.cache_slots and 0 < b["cache_buffer_bytes"] <= d.cache_bytes, (value, b)
            assert b["cache_hits"] + b["cache_misses"] > 0


def test_a_size_is_reserved_before_placing(plans, model):
    """--expert-cache 2MiB: fit keeps 2 MiB free on every device (reserved_bytes' expert_cache, in the margins), so
    more layers keep their experts in host RAM than without it, and each device's slots fit in it."""
    p0, ps = plans(0), plans("2MiB")
    spec = devspec.parse(SPEC)
    assert reserved_bytes(model, spec, "patched", {}, 2 * MiB) == {"expert_cache": 2 * MiB}
    assert ps.margins == [m + 2 * MiB for m in p0.margins] and ps.switches["EXPERT_CACHE"] == 2
    assert sum(ps.host_expert_layers) > sum(p0.host_expert_layers), (ps.host_expert_layers, p0.host_expert_layers)
    for d in ps.devices:
        assert 0 < d.cache_bytes <= 2 * MiB and d.expected_bytes <= d.target_bytes == d.free_bytes - 2 * MiB


def test_a_slot_count_gets_its_room_before_placing(plans, model):
    """--expert-cache 16slots where the placement without it leaves no room for them: fit reserves the slots' bytes
    over the host-expert layers it places and places again (more layers' experts on host, each with its slots), so
    every device holds its slots and stays within its target; the switch is the slot count, as asked."""
    p0, ps = plans(0), plans("16slots")
    layout = layout_of(model, p0.n_expert)
    assert any(layout.bytes_of(16, d.host_expert_layers) > d.target_bytes - d.expected_bytes for d in p0.devices)
    assert ps.switches["EXPERT_CACHE"] == -16 and sum(ps.host_expert_layers) > sum(p0.host_expert_layers)
    for d, m0, m in zip(ps.devices, p0.margins, ps.margins):
        assert d.cache_slots == 16 and d.cache_bytes == layout.bytes_of(16, d.host_expert_layers) > 0
        assert d.expected_bytes + d.cache_bytes <= d.free_bytes - m0 and m == m0 + d.cache_bytes
    # (more slots than any placement holds: the last clean placement stays, and the error names the device and the fix)
    with pytest.raises(ConfigError, match=r"--expert-cache 64slots: VDEV\d has [\d.]+ MiB free after the plan.*Fix: "):
        fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="64slots")


def test_prefetch_lanes_are_reserved_before_placing(model):
    """PREFETCH=2 allocates its lanes (three copies of a split's first expert weight a GPU, outside the compute
    buffers) at the first graph, after fit's dry run: fit keeps them free on every device beside the margin, for the
    patched variant only."""
    spec = devspec.parse(SPEC)
    lanes = 3 * model_file.expert_tensor_bytes(model)
    assert lanes > 0 and reserved_bytes(model, spec, "patched", {"PREFETCH": 2}) == {"prefetch_lanes": lanes}
    assert reserved_bytes(model, spec, "patched", {"PREFETCH": 1}) == {} == reserved_bytes(model, spec, "baseline",
                                                                                        {"PREFETCH": 2})
    p1 = fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=0)
    p2 = fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=0, switches={"PREFETCH": 2})
    assert p2.margins == [m + lanes for m in p1.margins], (p1.margins, p2.margins)


def test_a_size_too_large_names_the_device_and_its_free_memory(model, usage_error):
    with pytest.raises(ConfigError, match=r"--expert-cache 9MiB: no room .* on VDEV\d, which has 10\.0 MiB free"):
        fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache="9MiB")
    line = usage_error(["fit", model, "--devices", SPEC, "-c", "512", "-b", "512", "-ub", "128",
                        "--expert-cache", "9MiB"])
    assert "VDEV" in line and "10.0 MiB free" in line and "Fix:" in line, line


def test_no_cache_leaves_the_plan_as_it_was(plans, model):
    """0 and "0" give the same plan, its JSON without a cache field, its text without a cache line, no reservation;
    the default is auto (FIT's); the baseline's fit takes no cache."""
    p0, default = plans(0), fit(model, devices=SPEC, ctx=CTX, timeout=120)
    assert default.expert_cache == "auto" == FIT.expert_cache
    for p in (plans("0"),):
        assert _without_time(p.to_dict()) == _without_time(p0.to_dict())
        assert str(p).split("\n", 2)[2] == str(p0).split("\n", 2)[2]
    d = p0.to_dict()
    assert "expert_cache" not in d and not any(k.startswith("cache_") for x in d["devices"] for k in x)
    assert "expert cache" not in str(p0) and "cache_bytes" not in p0.to_frame()
    assert "EXPERT_CACHE" not in p0.switches and "expert_cache" not in reserved_bytes(model, devspec.parse(SPEC),
                                                                                      "patched", {})
    with pytest.raises(ConfigError, match="baseline build has no expert cache"):
        fit(model, devices=SPEC, ctx=CTX, variant="baseline", expert_cache="auto")


def test_the_cli_gives_the_apis_plan(model, capsys):
    """fit on the CLI is pyllama_pp.fit: the same plan, auto weighed for the same workload (the decode probe's costs
    cached between them), a slot count as given."""
    for cache in ("auto", "8slots"):
        assert cli.main(["fit", model, "--devices", SPEC, "-c", "512", "-b", "512", "-ub", "128", "--expert-cache",
                         cache, "--workload", "pp=64,tg=16", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        api = pyllama_pp.fit(model, devices=SPEC, ctx=CTX, timeout=120, expert_cache=cache, workload="pp=64,tg=16")
        assert doc.pop("pyllama_pp_plan") == 1 and _without_time(doc) == _without_time(api.to_dict())
        assert bool(api.memory_plan) == (cache == "auto")


# --- run and ab -------------------------------------------------------------------------------------------------

def test_run_and_ab_take_it_as_fit_does(model):
    """--expert-cache on run / ab is fit's: the CLI and Choices give equal configs; with --fit each only the patched
    plan has the cache (the baseline never gets the switch); a size without a fit is the switch as it is."""
    argv = ["ab", model, "--devices", SPEC, "--fit", "--expert-cache", "8slots", "-p", "0", "-n", "8"]
    by_cli = plan_runs(cli.choices_from_args(cli.build_parser().parse_args(argv)))
    by_api = plan_runs(Choices(model=model, devices=(SPEC,), fit="each", expert_cache="8slots", pp=(), tg=(8,)))
    assert by_cli.configs == by_api.configs
    patched, baseline = sorted(by_api.plans, key=lambda p: p.variant != "patched")
    assert patched.expert_cache == "8slots" and patched.switches["EXPERT_CACHE"] == -8
    assert baseline.expert_cache == "" and "EXPERT_CACHE" not in baseline.switches
    cfg = by_api.configs[0]
    assert cfg.switches["EXPERT_CACHE"] == patched.switches["EXPERT_CACHE"] and cfg.job("baseline").switches == {}
    sized = plan_runs(Choices(command="run", model=model, devices=(SPEC,), expert_cache="3MiB", pp=(), tg=(8,)))
    assert sized.configs[0].switches == {"EXPERT_CACHE": 3} and sized.plans == ()


def test_choices_refused_before_any_worker(model, no_worker, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    for kw, words in ((dict(expert_cache="1MiB", switches={"EXPERT_CACHE": 4}), "set the same switch"),
                      (dict(expert_cache="auto", fit="each", command="run", variant="baseline"), "baseline build"),
                      (dict(expert_cache="much", fit="each"), "give auto"),
                      (dict(expert_cache="1slots,2slots,3slots"), r"3 values for the 2 devices of vdev:2x10MiB"),
                      (dict(switches={"EXPERT_CACHE": "-1,-2,-3"}), "3 values for the 2 devices"),
                      (dict(expert_cache="2slots,lots"), r"its value 2 \('lots'\): give auto"),
                      (dict(expert_cache="auto,2slots", fit="each"), "auto plans every device")):
        with pytest.raises(ConfigError, match=words):
            plan_runs(Choices(model=model, devices=(SPEC,), pp=(), tg=(8,), **kw))
    with pytest.raises(ConfigError, match="sets already"):
        fit(model, devices=SPEC, expert_cache="8slots", env={"GGML_SCHED_PP_EXPERT_CACHE": "4"})


def test_run_shows_the_hit_rate_beside_ts(model, capsys):
    """run --fit --expert-cache auto on a decode test: each row's hit rate is the devices' hits over their lookups,
    and the table shows it beside t/s; without a cache the column is left out."""
    argv = ["run", model, "--fit", "--devices", SPEC, "-p", "0", "-n", "16", "-r", "1"]
    assert cli.main(argv + ["--expert-cache", "8slots", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for r in rows:
        lookups = r["expert_cache_hits"] + r["expert_cache_misses"]
        assert lookups > 0 and r["expert_cache_hit_rate"] == pytest.approx(r["expert_cache_hits"] / lookups), r
    assert cli.main(argv + ["--expert-cache", "8slots"]) == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[head.index("stddev_ts") + 1] == "expert_cache_hit_rate", head
    assert cli.main(argv + ["--expert-cache", "0"]) == 0
    out = capsys.readouterr().out
    assert "expert_cache_hit_rate" not in out and "stddev_ts" in out


def test_ab_markdown_shows_the_patched_hit_rate(model, capsys, tmp_path):
    assert cli.main(["ab", model, "--fit", "same", "--devices", SPEC, "--expert-cache", "8slots", "-p", "0", "-n", "16",
                     "-r", "1", "-o", str(tmp_path), "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["baseline"]["expert_cache_hit_rate"] is None and rows["baseline"]["switches"] == {}
    md = (tmp_path / "results.md").read_text()
    head, _, line = [ln for ln in md.splitlines() if ln.startswith("|")][:3]   # (under the command, machine, date)
    cols = [c.strip() for c in head.split("|")]
    cell = [c.strip() for c in line.split("|")][cols.index("cache hits (patched)")]
    assert cols.index("cache hits (patched)") == cols.index("patched t/s") + 1
    assert cell == f"{rows['patched']['expert_cache_hit_rate']:.0%}", (cell, line)
    df = frame([Row.from_dict({**r, "expert_cache_hit_rate": None, "expert_cache_hits": None,
                               "expert_cache_misses": None}) for r in rows.values()])
    assert "cache hits" not in report.markdown(df)   # (no lookups: no column)


def test_a_hit_rate_from_a_few_lookups_is_not_shown_as_a_rate():
    """Two lookups give no rate (a prompt row read 1.000 from them): the row keeps the counts, the table says how
    many lookups there were; from rows.MIN_HIT_RATE_LOOKUPS on it is a rate again."""
    from pyllama_pp import rows as rows_mod
    ext = lambda hits, misses: {"backends": [{"name": "VDEV0", "cache_hits": hits, "cache_misses": misses},
                                             {"name": "CPU", "cache_hits": 0, "cache_misses": 0}]}
    assert rows_mod.cache_hit_rate(ext(2, 0)) is None and rows_mod.cache_hit_rate(ext(0, 0)) is None
    n = rows_mod.MIN_HIT_RATE_LOOKUPS
    assert n > 2 and rows_mod.cache_hit_rate(ext(n, 0)) == 1.0 and rows_mod.cache_hit_rate(ext(n - 1, 0)) is None
    base = {"config": 0, "devices": SPEC, "n_batch": 64, "n_ubatch": 32, "host_experts": "all", "test": "pp64",
            "stddev_ts": 1.0, "error": None}
    df = pd.DataFrame([{**base, "variant": "baseline", "avg_ts": 100.0, "speedup": None},
                       {**base, "variant": "patched", "avg_ts": 150.0, "speedup": 1.5, "expert_cache_hits": 2,
                        "expert_cache_misses": 0, "expert_cache_hit_rate": rows_mod.cache_hit_rate(ext(2, 0))}])
    md = report.markdown(df)
    head, _, line = [ln for ln in md.splitlines() if ln.startswith("|")][:3]
    cell = [c.strip() for c in line.split("|")][[c.strip() for c in head.split("|")].index("cache hits (patched)")]
    assert cell == "2 lookups" and "100%" not in line, line
    assert f"fewer than {n} times" in md


# --- the guard: costs, not hits -----------------------------------------------------------------------------------

def test_the_break_even_weighs_the_cpus_read_against_a_miss_over_the_link():
    """A layer's cached path (the device's read, plus a copy of each miss) costs what the CPU path does at
    h* = 1 - link (1/cpu - 1/dev): a GPU that reads far faster than the host with a link near the CPU's rate pays
    from a low hit rate; a slow (pageable) link needs many hits; a device no faster than the host never pays."""
    from pyllama_pp.expert_cache_plan import percent, break_even_hit
    h = break_even_hit(cpu_gbps=60, link_gbps=50, dev_gbps=2000)
    assert h == pytest.approx(1 - 50 * (1 / 60 - 1 / 2000)) and 0.15 < h < 0.25
    assert break_even_hit(60, 10, 2000) > 0.8 > h                       # (pageable: the same cache needs more hits)
    assert break_even_hit(60, 50, 60) == 1.0 and break_even_hit(60, 50, 30) > 1.0   # (a VDEV: the host's kernels)
    assert break_even_hit(10, 200, 2000) < 0                            # (a miss costs less than the CPU's read)
    assert (percent(h), percent(1.3), percent(-2.0), percent(0.5)) == (20, 100, 1, 50)


def test_a_cache_on_vdevs_is_guarded_back_to_the_cpu_path(plans, model):
    """VDEVs compute with the host's kernels: their read is no faster than the CPU path's, so the plan's guard is at
    100 (each layer goes back to the CPU path once its window is seen) and the plan says the cache does not pay;
    from pageable memory it needs at least as many hits as from pinned."""
    p = plans("2MiB")
    g = p.cache_guard
    assert g and p.cpu_expert_gbps and set(g["min_hit"]) == {"none", "mmap"}, g
    assert all(h >= 1.0 for h in g["break_even"]["pinned"]) and g["min_hit"]["none"] == 100
    assert g["min_hit"]["mmap"] >= g["min_hit"]["none"]
    assert p.switches["EXPERT_CACHE_MIN_HIT"] == 100 and "does not pay" in str(p)
    assert p.run_switches("mmap")["EXPERT_CACHE_MIN_HIT"] == g["min_hit"]["mmap"]
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).cache_guard == g
    p0 = plans(0)
    assert not p0.cache_guard and "cache_guard" not in p0.to_dict() and "EXPERT_CACHE_MIN_HIT" not in p0.switches


def test_the_guard_sends_a_cache_that_does_not_pay_back_to_the_cpu(model, capsys):
    """Decode with the plan's cache on VDEVs: once a layer's window of tokens is seen, the guard (at the plan's
    break-even) runs its expert ops on the CPU path, as upstream does; the rows count them."""
    assert cli.main(["run", model, "--fit", "--devices", SPEC, "--expert-cache", "2MiB", "-p", "0", "-n", "48",
                     "-r", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["switches"]["EXPERT_CACHE_MIN_HIT"] == 100, row["switches"]
    assert row["expert_cache_cpu_ops"] > 0 and row["expert_cache_ops"] > 0, row


def test_a_plan_made_again_without_early_copies_keeps_the_guards_rates(plans):
    """Where fit plans again with OVERLAP=0 (no room for OVERLAP=2's copies), the plan it keeps still carries the rates
    its first dry run measured, so the cache's guard is set on it."""
    from pyllama_pp.overlap_plan import plan_copies
    d = plans(0).to_dict()
    assert d["path"] == "spread"
    first = Plan.from_dict({**d, "cpu_expert_gbps": {"2": 9.0}, "host_copy_gbps": 3.0, "path": "upstream"})
    again = Plan.from_dict(d)
    kept = plan_copies(first, lambda extra: again, True, {})
    assert kept is again and kept.switches == {"OVERLAP": 0}
    assert kept.cpu_expert_gbps == {"2": 9.0} and kept.host_copy_gbps == 3.0
