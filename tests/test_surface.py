"""What a new user meets beyond bad input: a plan keeps its sizes and its model, Ctrl-C in a paired run keeps its
complete rounds, fit says which device it left idle, layer ranges read first..last, tables and plots carry a legend,
readable device names and failed runs marked, and `ab` on the CPU alone says that no mechanism acts there."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from pyllama_pp import Placement, RunConfig, cli, fit, report, runner, switches, synth
from pyllama_pp.check import check_logits
from pyllama_pp.plan import DevicePlan

UNEQUAL = json.dumps({"kind": "vdev", "devices": [{"memory": "8MiB", "link_gbps": 1}, {"memory": "6MiB", "link_gbps": 1},
                                                  {"memory": "5MiB", "link_gbps": 1}]})


@pytest.fixture(scope="module")
def plan_file(tiny_model, tmp_path_factory):
    """A plan without an expert cache (a module's fixture is made before the stated decode costs apply: the cache is
    left out, not weighed by this machine's measured costs)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main(["fit", tiny_model, "--devices", "vdev:2x4MiB@4GBps", "-c", "512", "-ub", "128", "-o", str(path),
                     "--expert-cache", "0", "--json"]) == 0
    return path


def _rows(capsys) -> list[dict]:
    return json.loads(capsys.readouterr().out)["rows"]


def test_a_plan_keeps_its_sizes_and_refuses_larger_ones(plan_file, tiny_model, capsys, usage_error):
    capsys.readouterr()
    assert cli.main(["run", tiny_model, "--plan", str(plan_file), "-p", "128", "-n", "0", "-r", "1", "--json"]) == 0
    rows = _rows(capsys)
    assert [(r["n_batch"], r["n_ubatch"]) for r in rows] == [(2048, 128)], rows
    assert rows[0]["host_experts"].startswith("plan: ") and rows[0]["pipeline_parallel"], rows
    line = usage_error(["run", tiny_model, "--plan", str(plan_file), "-ub", "256", "-b", "512"])
    assert "was made for n_batch 2048, n_ubatch 128 and n_ctx 512" in line, line


def test_ab_with_a_plan_and_no_model_takes_the_plans_model(plan_file, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # (another working directory than the one the plan was made in)
    capsys.readouterr()
    assert cli.main(["ab", "--plan", str(plan_file), "-p", "128", "-n", "0", "-r", "1", "-o", str(tmp_path / "o"),
                     "--json"]) == 0
    rows = _rows(capsys)
    assert {r["variant"] for r in rows} == {"baseline", "patched"} and not any(r.get("error") for r in rows), rows
    assert {r["model"].rsplit("/", 1)[-1] for r in rows} == {"tiny.gguf"}


def test_ctrl_c_in_a_paired_run_keeps_its_complete_rounds(tiny_model, tmp_path, monkeypatch):
    """Ctrl-C after a few rounds: the rows hold the complete AB/BA pairs measured so far, with their interval."""
    real, calls = runner.ServingWorker.run, []

    def run(self, job, timeout=None):
        calls.append(1)
        if len(calls) == 2 + 5 * 2 + 1:   # the warm-ups, five rounds of both variants, then one job more
            raise KeyboardInterrupt
        return real(self, job, timeout=timeout)
    monkeypatch.setattr(runner.ServingWorker, "run", run)
    cfg = RunConfig(tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32,
                    placement=Placement(host_experts="all"), tests=[["pp", 64]])
    with pytest.raises(KeyboardInterrupt):
        runner.interleaved(cfg, rounds=20, out_dir=tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["variant"]: r["rounds"] for r in rows} == {"baseline": 4, "patched": 4}, rows
    patched = [r for r in rows if r["variant"] == "patched"][0]
    assert patched["speedup_ci_lo"] <= patched["speedup_median"] <= patched["speedup_ci_hi"], patched


def test_fit_names_a_device_it_left_idle(tmp_path):
    model = tmp_path / "ds.gguf"
    synth.write_gguf(model, synth.preset("deepseek2-tiny"))
    plan = fit(model, devices=UNEQUAL, ctx={"n_ctx": 512, "n_ubatch": 128})
    idle = plan.idle_devices
    # the model fits without host experts, and llama's default split (by free memory) leaves the last device only
    # the output layer: the plan says so, and how to use it
    assert plan.path == "upstream" and idle == ["VDEV2"], (plan.path, [d.layers for d in plan.devices])
    assert any("VDEV2 holds no repeating layer" in n and "-ts 1,1,1" in n for n in plan.notes), plan.notes
    assert "note: VDEV2 holds no repeating layer" in str(plan)
    assert [d.layers_text for d in plan.devices][-1] == "out"


def test_layer_ranges_read_first_to_last():
    d = DevicePlan(name="VDEV1", layers=[3, 6], full_layers=0, host_expert_layers=3, model_bytes=0, context_bytes=0,
                   compute_bytes=0, free_bytes=0, target_bytes=0, output_layer=True)
    assert d.layers_text == "3..5 +out" and d.n_layers == 3
    d.layers, d.output_layer = [0, 0], False
    assert d.layers_text == "-" and d.n_layers == 0


def _frame(error: bool) -> pd.DataFrame:
    base = {"config": 0, "devices": UNEQUAL, "n_batch": 64, "n_ubatch": 32, "host_experts": "all", "coverage": 0.5,
            "pipeline_parallel": True, "stddev_ts": 1.0}
    return pd.DataFrame([
        {**base, "variant": "baseline", "test": "pp64", "avg_ts": 100.0, "error": None, "speedup": None},
        {**base, "variant": "patched", "test": "pp64", "avg_ts": None if error else 150.0,
         "error": "patched worker died (killed by signal SIGKILL)" if error else None, "speedup": None if error else 1.5},
        {**base, "variant": "baseline", "test": "tg16", "avg_ts": 20.0, "error": None, "speedup": None},
        {**base, "variant": "patched", "test": "tg16", "avg_ts": 21.0, "error": None, "speedup": 1.05}])


def test_tables_and_plots_explain_themselves(tmp_path):
    md = report.markdown(_frame(error=True))
    assert "vdev:8MiB@1GBps,6MiB@1GBps,5MiB@1GBps" in md and '{"kind"' not in md   # a JSON spec, written short
    assert "**error**" in md and "**PP b/p**" in md and "**speedup**" in md
    assert "tg rows without `--paired`" in md   # an unpaired decode row says what it is
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (matplotlib's tight_layout warning on long labels, for one)
        png = report.plot(_frame(error=True), tmp_path / "ab.png")
    assert png is not None and png.stat().st_size > 0


def test_the_main_jobs_table_fits_a_terminal_and_shows_the_reps():
    """The main job's line (the columns it fills; no switch off its default) stays within 200 characters, the text under the table within 120;
    the repetitions have a column; a column empty on every line (no bound, no coverage) is left out."""
    from pyllama_pp.defaults import MAIN_JOB
    base = {"config": 0, "devices": MAIN_JOB.devices, "n_batch": 2048, "n_ubatch": 128, "host_experts": "fit: 6 overrides",
            "test": "pp2048", "coverage": None, "pipeline_parallel": True, "stddev_ts": 71.0, "error": None,
            "samples_ts": [1000.0, 1001.0, 1002.0], "host_wait_s": {"input_events": 0.86}, "re_reservations": 0}
    df = pd.DataFrame([
        {**base, "variant": "baseline", "avg_ts": 971.2, "speedup": None, "pipeline_parallel": False,
         "h2d_bytes_per_device": [130.6 * 2 ** 20, 4.5 * 2 ** 20]},
        {**base, "variant": "patched", "avg_ts": 1942.6, "speedup": 2.0, "switches": {},
         "h2d_bytes_per_device": [82.0 * 2 ** 20, 55.6 * 2 ** 20]}])
    md = report.markdown(df)
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert max(map(len, table)) <= 200, table
    assert max(len(ln) for ln in md.splitlines() if not ln.startswith("|")) <= 120, md
    cols = [c.strip() for c in table[0].split("|")]
    assert [c.strip() for c in table[2].split("|")][cols.index("reps")] == "3", table
    assert "bound t/s" not in cols and "coverage" not in cols and "patched switches" not in cols, cols


def _legend_entries(md: str) -> set[str]:
    """The column names the legend under a table explains (its "- **name**:" items)."""
    import re
    return set(re.findall(r"^- \*\*([^*]+)\*\*:", md, flags=re.M))


def test_the_legend_lists_only_the_columns_printed():
    """Every column of the table that needs a word has its legend entry, and the legend has no entry for a column the
    table left out (no bound, no coverage, no switches, no cache; then all of them); **error** only where a run
    failed."""
    def columns(md):
        return {c.strip() for c in md.splitlines()[0].split("|") if c.strip()}

    named = {"t/s": {"baseline t/s", "patched t/s"}, "bytes/dev b, p": {"bytes/dev b", "bytes/dev p"},
             "cache hits": {"cache hits (patched)"}}
    plain = {"devices", "host experts", "n_batch", "n_ubatch", "test"}
    df = _frame(error=False).assign(coverage=None, pipeline_parallel=None)
    full = _frame(error=False).assign(bound_ts=900.0, h2d_bytes_per_device=[[2 ** 20]] * 4, samples_ts=[[1.0, 2.0]] * 4,
                                      host_wait_s=[{"ids": 0.1}] * 4, re_reservations=0, expert_cache_hit_rate=0.5,
                                      switches=[{"GATHER": 0}] * 4)
    for frame in (df, full):
        md = report.markdown(frame)
        notes = {"tg rows without `--paired`"}   # (a word on the rows, not a column)
        explained = set().union(*(named.get(e, {e}) for e in _legend_entries(md) - notes))
        assert explained == columns(md) - plain, (explained ^ (columns(md) - plain), md)
        assert "**error**" not in md
    assert {"bound t/s", "coverage", "reps", "PP b/p"} <= _legend_entries(report.markdown(full))
    assert "**error**" in report.markdown(_frame(error=True))


def test_the_plot_marks_a_failed_run(tmp_path, monkeypatch):
    import matplotlib.axes   # (the plot's own import, here to watch its text calls)
    texts = []
    real = matplotlib.axes.Axes.text
    monkeypatch.setattr(matplotlib.axes.Axes, "text", lambda self, x, y, s, *a, **k: texts.append(s) or
                        real(self, x, y, s, *a, **k))
    report.plot(_frame(error=True), tmp_path / "a.png")
    assert "failed" in texts
    texts.clear()
    report.plot(_frame(error=False), tmp_path / "b.png")
    assert "failed" not in texts and "1.50x" in texts


def test_ab_on_the_cpu_alone_says_no_mechanism_acts(tiny_model, capsys):
    assert cli.main(["ab", tiny_model, "-p", "32", "-n", "0", "-r", "1", "-b", "32", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("no mechanism of the series acts" in n for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize("call,kind,words", [
    (lambda m: runner.ab([{"model": m}]), TypeError, "configs must be a RunConfig"),
    (lambda m: runner.interleaved("not a config"), TypeError, "configs must be a RunConfig"),
    (lambda m: fit(m, devices=5), TypeError, "devices must be a device spec"),
    (lambda m: fit(m, devices="vdev:2x4MiB@1GBps", ctx=5), TypeError, "ctx must be a ContextParams"),
    (lambda m: check_logits(m, n_tokens="x"), ValueError, "n_tokens must be a whole number"),
    (lambda m: RunConfig(m, n_batch="x"), ValueError, "n_batch must be a whole number"),
])
def test_wrong_argument_types_name_the_argument(no_worker, tiny_model, call, kind, words):
    with pytest.raises(kind, match=words):
        call(tiny_model)


def test_ab_ubatch_auto_runs_the_plan_it_predicts_fastest(tiny_model, capsys):
    """`ab -ub auto`: fit --ubatch auto (compute counted) for the prompt, then both variants on its plan at its
    n_ubatch and n_batch."""
    capsys.readouterr()
    assert cli.main(["ab", tiny_model, "--devices", "vdev:2x8MiB@4GBps", "-ub", "auto", "-p", "512", "-n", "0",
                     "-r", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["variant"] for r in rows} == {"baseline", "patched"} and not any(r.get("error") for r in rows), rows
    assert len({(r["n_ubatch"], r["n_batch"]) for r in rows}) == 1 and rows[0]["n_ubatch"] in (64, 128, 256, 512)
    assert all(r["host_experts"].startswith("fit: ") for r in rows), rows


def test_ab_ubatch_auto_needs_one_spec_and_a_prompt(usage_error, no_worker, tiny_model):
    assert "-ub auto plans for one --devices spec" in usage_error(
        ["ab", tiny_model, "--devices", "vdev:2x8MiB@4GBps;vdev:2x6MiB@4GBps", "-ub", "auto"])
    assert "give -p N" in usage_error(["ab", tiny_model, "--devices", "vdev:2x8MiB@4GBps", "-ub", "auto", "-p", "0"])


def test_the_legend_explains_every_host_wait_cause_and_the_table_shows_the_switches():
    """Every cause the patched scheduler names for a host wait (its source's list) is in the legend where the table
    shows it; the switches a run used are in the table (its own column), none when no switch was set."""
    from pathlib import Path
    import re
    src = (Path(report.__file__).parent / "native" / "sched" / "ggml-backend-pp.cpp").read_text()
    causes = re.findall(r'"(\w+)"', re.search(r"ggml_sched_pp_wait_names\[[^]]*\] = \{([^}]*)\}", src).group(1))
    assert "fallback" in causes and len(causes) >= 7, causes
    for cause in causes:
        df = _frame(error=False)
        df["host_wait_s"] = [{cause: 0.5}] * len(df)
        md = report.markdown(df)
        assert f"0.50 s ({cause})" in md and f"*{cause}*" in md.split("\n\n", 1)[1], (cause, md)
    df = _frame(error=False)
    df["switches"] = [{} if v == "baseline" else {"OVERLAP": 0} for v in df["variant"]]
    md = report.markdown(df)
    assert "patched switches" in md.splitlines()[0] and "| OVERLAP=0 |" in md, md
    df["switches"] = [{}] * len(df)
    assert "switches" not in report.markdown(df).splitlines()[0]


def _groups_frame(n: int, devices: str, paired: bool = False, baseline_devices: str = "") -> pd.DataFrame:
    """n configs (ub 16, 32, ...) of one pp test on `devices`; noisy baseline samples (stddev above the mean)."""
    rows = []
    for i in range(n):
        base = {"config": i, "n_batch": 2048, "n_ubatch": 16 << i, "host_experts": "all", "test": "pp512",
                "coverage": 0.5, "pipeline_parallel": True, "error": None}
        rows.append({**base, "variant": "baseline", "devices": baseline_devices or devices, "avg_ts": 100.0,
                     "stddev_ts": 150.0, "speedup": None})
        rows.append({**base, "variant": "patched", "devices": devices, "avg_ts": 91.0, "stddev_ts": 5.0,
                     "speedup": 0.91, **({"speedup_median": 0.865, "speedup_ci_lo": 0.80, "speedup_ci_hi": 0.93,
                                          "rounds": 6, "loads": 1} if paired else {})})
    return pd.DataFrame(rows)


def _drawn(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def test_plot_labels_of_four_groups_do_not_overlap():
    import matplotlib.pyplot as plt   # (the plot's own import)
    spec = "vdev:2x256MiB@0.1GBps,speed=1:2,direct=0.5"
    df = pd.concat([_groups_frame(2, spec), _groups_frame(2, spec.replace("256", "128")).assign(
        config=lambda d: d["config"] + 2)])
    fig = report.plot_figure(df)
    r = _drawn(fig)
    ax = fig.axes[-1]   # (the labels sit under the lower panel)
    boxes = sorted((t.get_window_extent(r) for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    assert len(boxes) == 4 and all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [(b.x0, b.x1) for b in boxes]
    plt.close(fig)


def test_paired_plot_shows_the_tables_estimate_bounded_error_bars_and_the_tables_devices():
    """With --paired the speedup drawn is the table's (the paired median, 0.865, with its interval), not the ratio of
    the means (0.91); no error bar reaches below 0 t/s; with the baseline on its own servers, the plot names the
    devices as the table does."""
    import matplotlib.pyplot as plt
    df = _groups_frame(3, "rpc://127.0.0.1:50052", paired=True, baseline_devices="rpc://127.0.0.1:50053")
    md = report.markdown(df)
    cell = "rpc://127.0.0.1:50052 (baseline: rpc://127.0.0.1:50053)"
    assert f"| {cell} |" in md and "paired 0.865 [0.800, 0.930]" in md, md
    fig = report.plot_figure(df)
    _drawn(fig)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts + ax.get_xticklabels() + [ax.title]]
    texts += [fig._suptitle.get_text()] if fig._suptitle else []
    assert any("0.865x" in t for t in texts) and not any("0.91x" in t for t in texts), texts
    assert any(cell in t.replace("\n", "") for t in texts), texts
    lows = [seg[:, 1].min() for ax in fig.axes for c in ax.collections for seg in c.get_segments()]
    assert lows and min(lows) >= 0, lows
    speed = fig.axes[1]   # the speedup's panel: the median's bar and its interval
    bars = [p.get_height() for p in speed.patches]
    assert np.allclose(bars, 0.865), bars
    whiskers = [seg[:, 1] for c in speed.collections for seg in c.get_segments()]
    assert any(np.allclose(sorted(w), [0.80, 0.93]) for w in whiskers), whiskers
    plt.close(fig)


def test_coverage_is_shown_only_where_experts_are_in_host_ram():
    """Coverage is the share of the host-resident experts a ubatch used: a placement that keeps none there (fit put
    every layer in VRAM) shows none."""
    df = _frame(error=False)
    df["host_experts"], df["tensor_buft_overrides"] = "fit: 0 overrides", ""
    assert "| 50% |" not in report.markdown(df)
    df["host_experts"], df["tensor_buft_overrides"] = "fit: 3 overrides", "blk\\.3\\.ffn_(up|down|gate)_exps=CPU"
    assert "| 50% |" in report.markdown(df)


# -- a switch that cannot act says so, errors whole, the expert cache's options, noise in any A/B -------------------
def test_a_switch_at_its_default_is_not_listed_as_set(tiny_model, capsys, tmp_path):
    """OVERLAP=2 is the switch table's default (a plan's copies name it so): the rows and the table list only the
    switches whose value differs from the defaults the run's own worker returned."""
    assert cli.main(["ab", tiny_model, "--devices", "vdev:2x0@0", "-p", "64", "-n", "0", "-b", "64", "-ub", "32",
                     "-r", "1", "--switch", "OVERLAP=2", "--switch", "GATHER=0", "-o", str(tmp_path), "--json"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["patched"]["switches"] == {"GATHER": 0} and rows["baseline"]["switches"] == {}, rows["patched"]
    table = "\n".join(ln for ln in (tmp_path / "results.md").read_text().splitlines() if ln.startswith("|"))
    assert "GATHER=0" in table and "OVERLAP=2" not in table, table
    assert switches.off_defaults({"OVERLAP": 2, "LAYER_MAJOR": 1}, {"OVERLAP": 2, "LAYER_MAJOR": 0}) == \
        {"LAYER_MAJOR": 1}
    assert switches.off_defaults({"OVERLAP": 2}, None) == {"OVERLAP": 2}   # (defaults unknown: as given)


def test_a_switch_variable_at_its_default_is_not_listed_as_set(tiny_model, capsys, tmp_path, monkeypatch):
    """The environment's switch variables go through the rule `--switch` and plan switches do (switches.of_run): one
    at its default is not listed, one off it is, in the rows and the table, for a measured A/B and a workload; a
    `--switch` wins over the variable of the same name."""
    assert switches.of_run({switches.var("GATHER"): "1"}, {"LAYER_MAJOR": 0}, {"GATHER": 1, "LAYER_MAJOR": 0}) == {}
    monkeypatch.setenv(switches.var(switches.OVERLAP), "2")
    monkeypatch.setenv(switches.var("GATHER"), "0")
    monkeypatch.setenv(switches.var(switches.UPLOAD_ALL), "0")
    common = [tiny_model, "--devices", "vdev:2x0@0", "-b", "64", "-ub", "32", "--switch", "UPLOAD_ALL=1", "--json"]
    for argv, out in ((["ab", "-p", "64", "-n", "0", "-r", "1"], tmp_path / "ab"),
                      (["ab", "--workload", "mixed", "-r", "1"], tmp_path / "mixed")):
        assert cli.main(argv[:1] + common + argv[1:] + ["-o", str(out)]) == 0
        rows = _rows(capsys)
        assert rows and all(r["switches"] == ({"GATHER": 0} if r["variant"] == "patched" else {}) for r in rows), \
            [(r["variant"], r["switches"]) for r in rows]
        table = "\n".join(ln for ln in (out / "results.md").read_text().splitlines() if ln.startswith("|"))
        assert "GATHER=0" in table and "OVERLAP" not in table and "UPLOAD_ALL" not in table, table


def test_a_switch_that_cannot_act_says_why_in_the_row_and_on_stderr(tiny_model, capsys):
    """LAYER_MAJOR with one ubatch a batch, on devices without room for a group, and on the CPU alone, and
    EXPERT_CACHE on the CPU alone and on a prompt (its ubatches at op offload's threshold): each row's notes say the
    switch did not act and why, and stderr says it once; a run where the switch acts has no note."""
    def notes(argv):   # (the switches' notes; planning's on the expert cache and LAYER_MAJOR aside)
        assert cli.main(["run", tiny_model, "-p", "512", "-n", "0", "-r", "1", "--json"] + argv) == 0
        return [n for r in _rows(capsys) for n in r["notes"] or [] if not n.startswith(("expert cache (",
                                                                                         "layer major ("))]

    lm = ["--switch", "LAYER_MAJOR=1"]
    one, = notes(["--devices", "vdev:2x256MiB@0.2GBps", "-b", "32", "-ub", "32"] + lm)
    assert one.startswith("LAYER_MAJOR=1 did not act") and "is one ubatch (n_batch 32, n_ubatch 32)" in one, one
    room, = notes(["--devices", "vdev:2x3MiB@0.2GBps", "-b", "512", "-ub", "32"] + lm)
    assert "16 ubatches" in room and "no room for a group's graph" in room and "--fit" in room, room
    cpu = notes(["--devices", "cpu", "-b", "512", "-ub", "32", "--switch", "EXPERT_CACHE=1"] + lm)
    assert [n.split(":")[0] for n in cpu] == ["LAYER_MAJOR=1 did not act", "EXPERT_CACHE=1MiB did not act"], cpu
    assert all("the CPU alone" in n for n in cpu), cpu
    prompt, = notes(["--devices", "vdev:2x256MiB@0.2GBps", "-b", "512", "-ub", "32", "--switch", "EXPERT_CACHE=1"])
    assert "below op offload's threshold (32 tokens: decode)" in prompt and "ubatches of 32 tokens" in prompt, prompt
    assert notes(["--devices", "vdev:2x256MiB@0.2GBps", "-b", "512", "-ub", "32"] + lm) == []   # (it acts: groups)
    assert cli.main(["run", tiny_model, "--devices", "vdev:2x256MiB@0.2GBps", "-b", "32", "-ub", "32", "-p", "512",
                     "-n", "0", "-r", "1"] + lm) == 0
    err = capsys.readouterr().err
    assert err.count("pyllama-pp: note: LAYER_MAJOR=1 did not act: a batch of pp512 is one ubatch") == 1, err


def test_an_error_prints_whole_with_its_reasons(tiny_model, usage_error):
    """fit -ub auto with no candidate placed: the message lists each candidate's reason under its first line, and the
    CLI prints all of it (it kept the first line only, which ended at its colon)."""
    err = usage_error(["fit", tiny_model, "--devices", "vdev:2x1MiB@4GBps", "-c", "512", "-ub", "auto", "--json"])
    first, *reasons = err.splitlines()
    assert first.endswith("(n_ctx 512):") and reasons, err
    assert reasons[0].startswith("  n_ubatch 64 (n_batch 512): leaves all 6 layers") and "Fix:" in reasons[0], err


def test_expert_cache_options_name_the_real_cause(plan_file, tiny_model, usage_error, no_worker):
    """A cache larger than the devices without --fit is refused (it ran, and reported all hits); a size that fits is
    run with a note that no plan left room for it; --expert-cache beside a plan made without a cache, and -ub auto
    beside --fit, name what is wrong (they named a cache planned already, and several device specs)."""
    from pyllama_pp.planning import Choices, plan_runs
    line = usage_error(["run", tiny_model, "--devices", "vdev:2x5MiB@4GBps", "--expert-cache", "99GiB", "-p", "0"])
    assert "more than a device of --devices vdev:2x5MiB@4GBps has (5 MiB)" in line, line
    notes = plan_runs(Choices(command="run", model=tiny_model, devices=("vdev:2x256MiB@4GBps",), expert_cache="1MiB",
                              pp=(), tg=(4,))).notes
    assert any("1MiB without --fit sets the cache (EXPERT_CACHE) as it is: no plan left room" in n for n in notes), notes
    line = usage_error(["run", "--plan", str(plan_file), "--expert-cache", "auto"])
    assert "was made without an expert cache" in line and "already" not in line, line
    line = usage_error(["ab", tiny_model, "--devices", "vdev:2x8MiB@4GBps", "-ub", "auto", "--fit", "each", "-p", "256"])
    assert "takes no --fit" in line and "one spec" not in line, line
    line = usage_error(["ab", tiny_model, "--devices", "vdev:2x8MiB@4GBps;cpu", "-ub", "auto", "-p", "256"])
    assert "2 were given" in line, line


def _ab_frame(samples: dict, devices: str):
    import statistics
    from pyllama_pp.row import Row, frame
    return frame([Row(variant=v, devices=devices, n_batch=512, n_ubatch=32, test="pp128", n_prompt=128,
                      avg_ts=statistics.fmean(xs), stddev_ts=statistics.stdev(xs), samples_ts=xs, config=0)
                  for v, xs in samples.items()])


def test_an_unpaired_ab_whose_spread_is_wide_is_warned_of():
    """A prompt A/B (not only paired decode): variants whose samples spread 20% cannot show a 10% gap; on the CPU
    alone both variants run one path, so 1.43x there is noise; steady rows on VDEVs give no warning."""
    wide = report.noise_warnings(_ab_frame({"baseline": [1000.0, 1250.0, 800.0], "patched": [1100.0, 1105.0, 1095.0]},
                                           "vdev:2x256MiB@0.1GBps"))
    assert len(wide) == 1 and "spread more than 5%" in wide[0] and "pp128" in wide[0] and "--paired" in wide[0], wide
    cpu = report.noise_warnings(_ab_frame({"baseline": [1000.0, 1005.0, 995.0], "patched": [1430.0, 1435.0, 1425.0]},
                                          "cpu"))
    assert len(cpu) == 1 and "same CPU path" in cpu[0] and "1.43x" in cpu[0], cpu
    assert report.noise_warnings(_ab_frame({"baseline": [1000.0, 1005.0, 995.0], "patched": [1430.0, 1435.0, 1425.0]},
                                           "vdev:2x256MiB@0.1GBps")) == []


def test_results_md_names_its_command_and_a_finished_sweep_resumed_says_nothing_was_left(tiny_model, tmp_path, capsys):
    """results.md starts with the command, machine and date that made it; `ab --resume` of a sweep with every row
    there says that nothing was left to run (it said nothing)."""
    out = tmp_path / "sweep"
    argv = ["ab", tiny_model, "--devices", "vdev:2x0@0", "-b", "64", "-ub", "32", "-p", "64", "-n", "0", "-r", "1",
            "-o", str(out)]
    assert cli.main(argv) == 0
    head = (out / "results.md").read_text().splitlines()[:3]
    assert head[0] == f"- command: `pyllama-pp {' '.join(argv)}`" and head[1].startswith("- machine: ") \
        and "cores" in head[1] and head[2].startswith("- date: 20"), head
    capsys.readouterr()
    assert cli.main(["ab", "--resume", str(out)]) == 0
    assert "nothing was left to run" in capsys.readouterr().err


def test_help_names_every_command_and_layer_major():
    """The top-level help's description names every subcommand (it left out trace); run's and ab's --switch help
    names LAYER_MAJOR (they never did)."""
    ap = cli.build_parser()
    sub = next(a for a in ap._actions if a.dest == "cmd")
    assert all(name in ap.description.split(".")[0] for name in sub.choices), ap.description.split(".")[0]
    for cmd in ("run", "ab"):
        assert "LAYER_MAJOR=1" in " ".join(sub.choices[cmd].format_help().split())


def test_a_value_not_measured_reads_the_same_in_every_table():
    """A decode row's coverage (None from a worker, NaN once in a frame) is "-" in run's table, never None in one
    table and NaN in another."""
    from pyllama_pp.row import Row, frame
    df = frame([Row(variant="patched", test="pp32", avg_ts=10.0, coverage=0.5),
                Row(variant="patched", test="tg16", avg_ts=5.0, coverage=None)])
    table = report.text_table(df, ["variant", "test", "avg_ts", "coverage"])
    assert "NaN" not in table and "None" not in table and table.splitlines()[2].split()[-1] == "-", table


def test_the_cache_takes_the_switchs_slot_form_and_prints_one_form(tiny_model, capsys, tmp_path):
    """`--expert-cache 16slots`, `--expert-cache -16` and `--switch EXPERT_CACHE=-16` ask the same: fit plans the
    same cache from each (the switch was dropped from the plan), and help, plan text, the table and a row's note
    name it as 4slots, never as the switch's -4; a slot count on devices the model does not fit names the model,
    not the cache."""
    from pyllama_pp.planning import Choices
    fit_argv = ["fit", tiny_model, "--devices", "vdev:2x11MiB@4GBps", "-c", "512", "--json"]
    plans = []
    for asked in (["--expert-cache", "4slots"], ["--expert-cache", "-4"], ["--switch", "EXPERT_CACHE=-4"]):
        assert cli.main(fit_argv + asked) == 0
        d = json.loads(capsys.readouterr().out)
        plans.append((d["expert_cache"], d["switches"], [x["cache_slots"] for x in d["devices"]]))
    assert plans[0][0] == "4slots" and plans[0][1]["EXPERT_CACHE"] == -4 and len(set(map(str, plans))) == 1, plans
    assert cli.main(fit_argv[:-1] + ["--switch", "EXPERT_CACHE=-4"]) == 0
    text = capsys.readouterr().out
    assert "expert cache 4slots (EXPERT_CACHE" in text and "=-4" not in text, text
    c = Choices(command="ab", model=tiny_model, devices=("vdev:2x11MiB@4GBps",), fit="each", tg=(4,),
                switches={"EXPERT_CACHE": -4, "GATHER": 0})
    assert c.expert_cache.text == "4slots" and c.switches == {"GATHER": 0}
    small = ["fit", tiny_model, "--devices", "vdev:2x8MiB@4GBps", "-c", "512", "--expert-cache", "16slots"]
    assert cli.main(small) == 2 and "does not fit" in capsys.readouterr().err
    helps = []
    for cmd in ("fit", "run", "ab"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        helps.append(" ".join(capsys.readouterr().out.split()))
    assert all("auto|SIZE|Nslots|0" in h and "such as 16slots" in h and "-16" not in h for h in helps)
    assert cli.main(["ab", tiny_model, "--devices", "cpu", "-p", "0", "-n", "4", "-r", "1", "--expert-cache", "-4",
                     "-o", str(tmp_path), "--json"]) == 0
    notes = [n for r in _rows(capsys) for n in r["notes"] or []]
    assert notes and all(n.startswith("EXPERT_CACHE=4slots did not act") for n in notes), notes
    table = "\n".join(ln for ln in (tmp_path / "results.md").read_text().splitlines() if ln.startswith("|"))
    assert "EXPERT_CACHE=4slots" in table and "=-4" not in table, table
