"""The CLI's planning is the library's: for the same choices, `pyllama-pp run/ab`'s options and
`planning.plan_runs(Choices(...))` give equal, frozen configs (defaults filled in from pyllama_pp.defaults, plan
sizes, --fit and --plan placements), and switches are parsed once, into ConfigErrors."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pyllama_pp import ConfigError, cli, defaults
from pyllama_pp.params import ContextParams
from pyllama_pp.planning import Choices, plan_runs
from pyllama_pp.switches import parse_given as parse_switches


def from_cli(argv: list[str]):
    return plan_runs(cli.choices_from_args(cli.build_parser().parse_args(cli._join_dash_values(argv))))


@pytest.fixture(scope="module")
def plan_path(tiny_model, tmp_path_factory):
    from pyllama_pp import fit
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    fit(tiny_model, devices="vdev:2x4MiB@4GBps", ctx=ContextParams(n_ctx=512, n_batch=2048, n_ubatch=128)).save(path)
    return str(path)


CASES = {
    "run, swept batch sizes": (["run", "{m}", "-p", "64", "-n", "4", "-b", "64", "-ub", "32,64,128"],
                               dict(command="run", model="{m}", pp=(64,), tg=(4,), n_batch=(64,), n_ubatch=(32, 64, 128))),
    "ab, two specs, host experts, depth": (["ab", "{m}", "--devices", "vdev:2x0@0;cpu", "--host-experts", "all,2",
                                           "-d", "0,32", "-n", "0", "-p", "32", "-r", "2"],
                                          dict(model="{m}", devices=("vdev:2x0@0", "cpu"), host_experts=("all", "2"),
                                               depth=(0, 32), tg=(), pp=(32,), reps=2)),
    "run baseline, defaults": (["run", "{m}", "--variant", "baseline", "--offload-min-batch", "64"],
                               dict(command="run", model="{m}", variant="baseline", offload_min_batch=64)),
    "ab with a plan and no model": (["ab", "--plan", "{plan}", "-n", "0"], dict(plan="{plan}", tg=())),
    "ab, each variant's fit": (["ab", "{m}", "--devices", "vdev:2x4MiB@0.1GBps", "--fit", "-n", "0", "-p", "64",
                                "-ub", "64", "-b", "256", "--switch", "upload_all=0"],
                               dict(model="{m}", devices=("vdev:2x4MiB@0.1GBps",), fit="each", tg=(), pp=(64,),
                                    n_ubatch=(64,), n_batch=(256,), switches={"UPLOAD_ALL": 0})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_cli_and_the_api_give_equal_configs(case, tiny_model, plan_path):
    argv, kw = CASES[case]
    fill = lambda v: v.format(m=tiny_model, plan=plan_path) if isinstance(v, str) else v
    by_cli = from_cli([fill(a) for a in argv])
    by_api = plan_runs(Choices(**{k: fill(v) for k, v in kw.items()}))
    assert by_cli.configs == by_api.configs and by_cli.variants == by_api.variants, case
    assert by_cli.choices == by_api.choices and len(by_cli.plans) == len(by_api.plans), case
    cfg = by_api.configs[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_ubatch = 1


def test_defaults_and_placements_come_through(tiny_model, plan_path):
    run = from_cli(["run", tiny_model])
    assert [(c.devices, c.n_batch, c.n_ubatch, c.reps) for c in run.configs] == \
        [(defaults.RUN.devices, defaults.RUN.n_batch, defaults.RUN.n_ubatch, defaults.RUN.reps)]
    assert run.configs[0].tests == [["pp", n] for n in defaults.RUN.pp] + [["tg", n] for n in defaults.RUN.tg]
    assert run.variants == ("patched",) and run.plans == ()
    planned = from_cli(["ab", "--plan", plan_path, "-n", "0"])
    cfg = planned.configs[0]
    assert (cfg.model, cfg.n_batch, cfg.n_ubatch, cfg.n_ctx) == (tiny_model, 2048, 128, 512), cfg
    assert cfg.devices == "vdev:2x4MiB@4GBps" and set(cfg.plans) == {"baseline", "patched"}
    assert all(p.source == "plan" for p in cfg.plans.values()) and cfg.switches.get("OVERLAP") is not None
    fitted = from_cli(["ab", tiny_model, "--devices", "vdev:2x4MiB@0.1GBps", "--fit", "same", "-n", "0", "-p", "64",
                       "-ub", "64", "-b", "256"])
    cfg = fitted.configs[0]
    assert len(fitted.plans) == 1 and cfg.plans["baseline"] == cfg.plans["patched"] and \
        cfg.plans["patched"].source == "fit"


def test_skipped_pairs_and_cpu_only_runs_are_notes(tiny_model):
    notes = from_cli(["ab", tiny_model, "-b", "64", "-ub", "32,128", "-n", "0", "-p", "32"]).notes
    assert any("skipping -b 64 -ub 128" in n for n in notes) and any("no mechanism" in n for n in notes), notes


def test_switches_are_parsed_once_into_config_errors():
    assert parse_switches(["upload_all=0", "OVERLAP=2"]) == {"UPLOAD_ALL": 0, "OVERLAP": 2}
    assert parse_switches(None) == {}
    for bad, words in (("UPLOAD_ALL", "takes NAME=VALUE"), ("=1", "takes NAME=VALUE"),
                       ("UPLOAD_ALL=yes", "must be an integer")):
        with pytest.raises(ConfigError, match=words):
            parse_switches([bad])


def test_choices_refused_before_any_worker(plan_path, no_worker, tiny_model):
    for kw, words in ((dict(command="run"), "run needs a MODEL"),
                      (dict(model=tiny_model, workload="mixed", paired=4), "--workload has rounds"),
                      (dict(model=tiny_model, loads=2), "--loads 2 repeats paired rounds"),
                      (dict(model=tiny_model, fit="each", plan=plan_path), "not both"),
                      (dict(model=tiny_model, n_ubatch="auto", devices=("cpu", "vdev:2x0@0")), "-ub auto plans")):
        with pytest.raises(ConfigError, match=words):
            plan_runs(Choices(**kw))


def test_ub_auto_takes_a_pair_within_the_prompt_and_n_batch(tiny_model):
    """ab -ub auto -b 1024 -p 1000 (which picked n_ubatch 1024 and stopped at "n_ubatch (1024) cannot exceed
    n_batch (1000)"): the pair is within the prompt and the -b given, and every config holds it; without -b the
    n_batch is chosen up to the prompt."""
    planned = from_cli(["ab", tiny_model, "--devices", "vdev:2x64MiB@1GBps,speed=3:3", "-ub", "auto", "-b", "1024",
                        "-p", "1000", "-n", "0"])
    (plan,) = planned.plans
    pair = (plan.ctx["n_batch"], plan.ctx["n_ubatch"])
    assert pair[1] <= pair[0] <= 1000, pair
    assert all((c.n_batch, c.n_ubatch) == pair for c in planned.configs), planned.configs
    assert all(r["n_ubatch"] <= r["n_batch"] <= 1000 for r in plan.ubatch_auto), plan.ubatch_auto
    assert planned.choices.n_batch == (pair[0],) and planned.choices.n_ubatch == (pair[1],)
    unbounded = plan_runs(Choices(model=tiny_model, devices=("vdev:2x64MiB@1GBps,speed=3:3",), n_ubatch="auto",
                                  pp=(600,), tg=()))
    assert all(r["n_ubatch"] <= r["n_batch"] <= 600 for r in unbounded.plans[0].ubatch_auto)


def test_a_run_with_its_fit_plan_has_room_for_its_groups(tiny_model, tmp_path):
    """run --fit --switch LAYER_MAJOR=1 on devices with little room: fit plans with the run's switches, so the
    group's buffers are in the plan and the run computes its batches as groups. The plan made without them (before
    fit got the run's switches) leaves no room: that run cannot create its context."""
    from pyllama_pp import fit
    from pyllama_pp.errors import OutOfMemoryError
    from pyllama_pp.worker import run_job
    devices = "vdev:2x6MiB@0"
    planned = plan_runs(Choices(command="run", model=tiny_model, variant="patched", devices=(devices,), fit="each",
                                switches={"LAYER_MAJOR": 1}, n_batch=(128,), n_ubatch=(32,), pp=(512,), tg=()))
    (cfg,), (plan,) = planned.configs, planned.plans
    assert plan.switches["LAYER_MAJOR"] == 1 and plan.layer_major["group"] == 4, plan.layer_major
    assert cfg.switches["LAYER_MAJOR"] == 1

    def run(placement):
        return run_job({"kind": "logits", "model": tiny_model, "devices": devices, "placement": placement.to_dict(),
                        "ctx": cfg.context().to_dict(), "n_tokens": 512, "logits": "last",
                        "out": str(tmp_path / "l.npy"), "switches": cfg.switches}, "patched", timeout=120)

    ext = run(cfg.plans["patched"])["ext"]
    assert ext["layer_major_graphs"] == 4 and ext["layer_major_ubatches"] == 16, ext
    unplanned = fit(tiny_model, devices=devices, ctx=cfg.context(), timeout=120)
    assert sum(unplanned.host_expert_layers) < sum(plan.host_expert_layers)
    with pytest.raises(OutOfMemoryError, match="could not create the context"):
        run(unplanned.placement())


def test_ub_auto_plans_the_switches_it_runs_with(tiny_model, fake_compute):
    """ab -ub auto --switch LAYER_MAJOR=1: the planner's candidates are planned with the switch (their groups'
    memory, their predictions), and the configs run the winner's pair with it."""
    fake_compute(lambda u: 1e-6)
    planned = from_cli(["ab", tiny_model, "--devices", "vdev:2x6MiB@0.2GBps", "-ub", "auto", "-p", "512", "-n", "0",
                        "--switch", "LAYER_MAJOR=1"])
    (plan,) = planned.plans
    assert plan.switches["LAYER_MAJOR"] == 1 and plan.layer_major["group"] == plan.ctx["n_batch"] // plan.ctx["n_ubatch"]
    assert plan.layer_major["group"] > 1 and any(r.get("group", 1) > 1 for r in plan.ubatch_auto)
    assert all(c.switches["LAYER_MAJOR"] == 1 and (c.n_batch, c.n_ubatch) == (plan.ctx["n_batch"], plan.ctx["n_ubatch"])
               for c in planned.configs)


def test_rows_show_the_layer_major_groups_a_run_formed(tiny_model, capsys, tmp_path):
    """run with LAYER_MAJOR=1: each row counts the groups a run formed (pp512 in batches of 128: four groups of four
    ubatches) and the table shows the column; without the switch the rows hold None and the column is left out;
    ab's markdown names the groups beside the switch."""
    argv = ["run", tiny_model, "--devices", "vdev:2x0@0", "-b", "128", "-ub", "32", "-p", "512", "-n", "0", "-r", "1"]
    assert cli.main(argv + ["--switch", "LAYER_MAJOR=1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["layer_major_groups"] == 4, row
    assert cli.main(argv + ["--switch", "LAYER_MAJOR=1"]) == 0
    assert "layer_major_groups" in capsys.readouterr().out.splitlines()[0]
    assert cli.main(argv + ["--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["layer_major_groups"] is None, row
    assert cli.main(argv) == 0
    assert "layer_major_groups" not in capsys.readouterr().out
    out = tmp_path / "ab"
    assert cli.main(["ab"] + argv[1:] + ["--switch", "LAYER_MAJOR=1", "-o", str(out)]) == 0
    capsys.readouterr()
    line = next(x for x in (out / "results.md").read_text().splitlines() if "pp512" in x)
    assert "LAYER_MAJOR=1 (4 layer-major groups a run)" in line, line
