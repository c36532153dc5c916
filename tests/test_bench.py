"""The A/B runner: rows on disk as they come, a killed worker becomes an error row, tables and plots."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyllama_pp import report, runner
from pyllama_pp.config import RunConfig, expand
from pyllama_pp.counters import ext_delta
from pyllama_pp.expert_cache_sim import simulate
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.params import Placement
from pyllama_pp.rows import link_bound, pipe_bound, rows_from_result


def _cfgs(model, **kw):
    common = dict(devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["pp", 64]], reps=1, **kw)
    return [RunConfig(model=model, label="quick", **common),
            # far too long for the timeout below: its worker is killed mid-run
            RunConfig(model=model, label="killed", devices="vdev:2x0@0.0001GBps", n_batch=64, n_ubatch=32,
                      tests=[["pp", 64]], reps=50)]


def test_progress_is_one_named_step_per_row(tiny_model, progress_bars):
    """`-ub 16,32` with a prompt and a decode test: a step per row as it is measured, with the row's name (not one
    jump per worker, not a step per variant of a group)."""
    cfgs = expand(str(tiny_model), devices=["vdev:2x0@0"], n_batch=[64], n_ubatch=[16, 32],
                  tests=[["pp", 32], ["tg", 2]], reps=1)
    df = runner.ab(cfgs, progress=True, timeout=120)
    bar, = progress_bars
    assert bar.total == len(df) == 8 and [n for n, _ in bar.steps] == [1] * 8, bar.steps
    for r in df.to_dict("records"):
        assert sum(r["variant"] in name and f"ub={r['n_ubatch']}" in name and name.endswith(r["test"])
                   for _, name in bar.steps) == 1, (r["variant"], r["n_ubatch"], r["test"], bar.steps)


def test_killed_worker_leaves_error_row_and_finished_rows(tiny_model, tmp_path):
    # 4 s: the quick config needs well under one, the killed one far more (two variants: 8 s in all)
    df = runner.ab(_cfgs(str(tiny_model)), out_dir=tmp_path, progress=False, timeout=4)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    quick = [r for r in rows if r["label"] == "quick"]
    killed = [r for r in rows if r["label"] == "killed"]
    assert {r["variant"] for r in quick} == {"baseline", "patched"}
    assert all(r["avg_ts"] > 0 and not r.get("error") for r in quick)
    assert killed and all("timed out" in r["error"] for r in killed)
    assert len(df) == len(rows)
    csv = pd.read_csv(tmp_path / "results.csv")
    assert len(csv) == len(rows)


def test_speedup_markdown_and_plot(tiny_model, tmp_path):
    cfg = RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=64, n_ubatch=32,
                    tests=[["pp", 64], ["tg", 4]], reps=1)
    df = runner.ab([cfg], out_dir=tmp_path, progress=False, timeout=120)
    p = df[df.variant == "patched"].set_index("test")
    b = df[df.variant == "baseline"].set_index("test")
    for test in ("pp64", "tg4"):
        assert abs(p.loc[test, "speedup"] - p.loc[test, "avg_ts"] / b.loc[test, "avg_ts"]) < 1e-9
    md = report.markdown(df)
    rows = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(rows) == 2 + 2 and "pp64" in md and "tg4" in md   # header, rule, one line per test; the legend below
    png = report.plot(df, tmp_path / "ab.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # llama-bench's column names are there
    for col in ("n_batch", "n_ubatch", "avg_ts", "stddev_ts", "samples_ts", "test", "model", "coverage",
                "h2d_bytes_per_device", "pipeline_parallel"):
        assert col in df.columns


def test_expand_crosses_like_llama_bench(tiny_model):
    cfgs = expand(str(tiny_model), devices=["cpu", "vdev:2x0@0"], n_batch=[64, 128], n_ubatch=[32, 128],
                  placements=[Placement(host_experts="all")])
    # ubatch 128 > batch 64 is skipped, as llama-bench skips impossible combinations
    assert len(cfgs) == 2 * 3
    assert all(c.n_ubatch <= c.n_batch for c in cfgs)
    assert all(c.placement.host_experts == "all" for c in cfgs)


def test_grouped_configs_share_one_worker_and_match_separate_runs(tiny_model, tmp_path, monkeypatch):
    """Configs differing only in batch sizes run in one worker per variant (model loaded once); each still
    gets its own schedule, rows and speedup, and an impossible context becomes an error row of its own."""
    calls = []
    real = runner.ServingWorker.run

    def counting(self, job, timeout=None):   # (each worker's jobs, one per config here, and its model loads)
        res = real(self, job, timeout=timeout)
        if calls and calls[-1][0] == self.pid:
            calls[-1] = (self.pid, self.variant, calls[-1][2] + 1, res["served"]["loads"])
        else:
            calls.append((self.pid, self.variant, 1, res["served"]["loads"]))
        return res

    monkeypatch.setattr(runner.ServingWorker, "run", counting)
    cfgs = [RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=nb, n_ubatch=ub,
                      tests=[["pp", 64]], reps=1, label=f"ub{ub}") for nb, ub in ((64, 16), (64, 64))]
    df = runner.ab(cfgs, progress=False, timeout=120)
    assert [c[1:] for c in calls] == [("baseline", 2, 1), ("patched", 2, 1)]
    assert len(df) == 4 and df.error.isna().all()
    assert sorted(df[df.variant == "patched"].n_ubatch) == [16, 64]
    p = df[df.variant == "patched"].set_index("n_ubatch")
    # each config's schedule comes from its own context (PP on in both; ub16 is below the offload threshold,
    # so it offloads nothing and uploads no host weights, ub64 uploads them)
    assert p.loc[16, "pipeline_parallel"] and p.loc[64, "pipeline_parallel"]
    assert p.loc[16, "h2d_bytes"] < p.loc[64, "h2d_bytes"]
    assert pd.notna(p.loc[16, "re_reservations"]) and isinstance(p.loc[16, "host_wait_s"], dict)
    calls.clear()
    sep = runner.ab(cfgs, progress=False, timeout=120, group=False)
    assert [c[1:] for c in calls] == [("baseline", 1, 1), ("patched", 1, 1)] * 2
    assert list(sep.n_ubatch) == list(df.n_ubatch)


def test_set_context_changes_batch_sizes_and_keeps_the_model(tiny_model):
    # in its own process: the test process never loads a variant (conftest.py)
    code = f"""
from pyllama_pp.params import ContextParams
from pyllama_pp.session import Session
with Session({str(tiny_model)!r}, ctx=ContextParams(n_ctx=256, n_batch=64, n_ubatch=32), variant="patched") as s:
    a = s.eval(list(range(1, 41)), logits="all").logits
    s.set_context(ContextParams(n_ctx=256, n_batch=64, n_ubatch=8))
    assert s.ctx_params.n_ubatch == 8
    b = s.eval(list(range(1, 41)), logits="all").logits
    assert a.shape == b.shape and float(abs(a - b).max()) < 1e-3
    try:
        s.set_context(ContextParams(n_ctx=256, n_batch=8, n_ubatch=64))
        raise AssertionError("n_ubatch > n_batch was accepted")
    except ValueError:
        pass
    assert s.ctx_params.n_ubatch == 8  # the session still works with its previous context
    c = s.eval(list(range(1, 41)), logits="all").logits
    assert float(abs(c - b).max()) == 0.0
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]


def test_link_bound_for_devices_that_do_not_know_their_links(tiny_model):
    """CUDA rows get a bound from configured link bandwidths: two links in parallel, or one shared link."""
    h2d = [110_000_000_000, 100_000_000_000]           # bytes per run to each device
    two = RunConfig(model=str(tiny_model), devices="cuda", link_gbps=[55.0, 55.0])
    gbps, bound = link_bound(two, h2d, 4096)
    assert gbps == [55.0, 55.0] and bound == pytest.approx(4096 / (110 / 55.0))
    shared = RunConfig(model=str(tiny_model), devices="cuda", link_gbps=[55.0, 55.0], shared_link=True)
    assert link_bound(shared, h2d, 4096)[1] == pytest.approx(4096 / (210 / 55.0))
    none = RunConfig(model=str(tiny_model), devices="cuda")
    # with pipeline fill: 8 ubatches of 512, stages of 110/8 and 100/8 GB at 55 GB/s: the first ubatch passes
    # both stages, the 7 others add the slower one
    two_ub = RunConfig(model=str(tiny_model), devices="cuda", n_batch=4096, n_ubatch=512, link_gbps=[55.0, 55.0])
    fill = (110 / 8 + 100 / 8 + 7 * 110 / 8) / 55.0
    assert pipe_bound(two_ub, h2d, [55.0, 55.0], 4096) == pytest.approx(4096 / fill)
    assert pipe_bound(two_ub, h2d, [55.0, 55.0], 4096) < bound
    # one shared link: its 210 GB bind more than the fill does
    shared_ub = RunConfig(model=str(tiny_model), devices="cuda", n_batch=4096, n_ubatch=512,
                          link_gbps=[55.0, 55.0], shared_link=True)
    assert pipe_bound(shared_ub, h2d, [55.0, 55.0], 4096) == pytest.approx(4096 / (210 / 55.0))
    gbps, bound = link_bound(none, h2d, 4096)
    assert gbps == [] and bound != bound   # unknown links: no bound (NaN)
    vdev = RunConfig(model=str(tiny_model), devices="vdev:2x0@1GBps")
    assert link_bound(vdev, h2d, 4096)[1] == pytest.approx(4096 / 110)


def test_cuda_rows_count_direct_reads_and_the_overlap_ring(tiny_model):
    """On CUDA (no device counters) a row's bytes are the scheduler's uploads plus its estimate of DIRECT's reads;
    the direct-read count and PREFETCH=2's lanes (a level, CPU left out) are per row."""
    cfg = RunConfig(model=str(tiny_model), devices="cuda", n_batch=4096, n_ubatch=512, link_gbps=[55.0, 55.0])
    backends = [{"name": "CUDA0", "weight_bytes": 2_000, "direct_bytes_est": 6_000, "ring_bytes": 7},
                {"name": "CUDA1", "weight_bytes": 4_000, "direct_bytes_est": 0, "ring_bytes": 7},
                {"name": "CPU", "weight_bytes": 0, "ring_bytes": 0}]
    res = {"model": {"path": "m.gguf", "size_bytes": 1, "n_params": 1, "n_expert": 128, "n_expert_used": 8},
           "schedule": {"pipeline_parallel": True, "n_copies": 2, "n_splits": 9, "backends": []},
           "tests": [{"kind": "pp", "n": 4096, "seconds": [1.0, 1.0], "devices": [],
                      "ext": {"id_readbacks": 2, "upload_all": 0, "direct": 10, "backends": backends}}]}
    (row,) = rows_from_result(cfg, "patched", res, {})
    assert row.h2d_bytes_per_device == [4_000, 2_000]          # per rep: (uploads + direct estimate) / 2
    assert row.direct_reads == 5 and row.ring_bytes_per_device == [7, 7]
    res["tests"][0].pop("ext")   # (the baseline: no extension)
    assert rows_from_result(cfg, "patched", res, {})[0].ring_bytes_per_device is None


def test_cuda_rows_take_the_gather_bytes_the_device_counted(tiny_model):
    """GATHER on CUDA: where the gather library counts the bytes it read (gather_bytes per backend, prefetches
    included) a row takes them instead of the scheduler's estimate; where no backend has a count, the estimate.
    The deltas between two stats snapshots keep a count that appears only in the later one (the first gather)."""
    cfg = RunConfig(model=str(tiny_model), devices="cuda", n_batch=4096, n_ubatch=512, link_gbps=[55.0, 55.0])
    before = {"backends": [{"name": "CUDA0", "weight_bytes": 0, "gather_bytes_est": 0},
                           {"name": "CUDA1", "weight_bytes": 0, "gather_bytes_est": 0}, {"name": "CPU", "weight_bytes": 0}]}
    after = {"backends": [{"name": "CUDA0", "weight_bytes": 1_000, "gather_bytes_est": 8_000, "gather_bytes": 9_000},
                          {"name": "CUDA1", "weight_bytes": 2_000, "gather_bytes_est": 4_000, "gather_bytes": 5_000},
                          {"name": "CPU", "weight_bytes": 0}]}
    ext = ext_delta(before, after)
    assert ext["backends"][0]["gather_bytes"] == 9_000 and "gather_bytes" not in ext["backends"][2]
    res = {"model": {"path": "m.gguf", "size_bytes": 1, "n_params": 1, "n_expert": 128, "n_expert_used": 8},
           "schedule": {"pipeline_parallel": True, "n_copies": 2, "n_splits": 9, "backends": []},
           "tests": [{"kind": "pp", "n": 4096, "seconds": [1.0, 1.0], "devices": [], "ext": ext}]}
    (row,) = rows_from_result(cfg, "patched", res, {})
    assert row.h2d_bytes_per_device == [5_000, 3_500] and row.gather_bytes_est_per_device == [4_000, 2_000]
    for b in after["backends"]:
        b.pop("gather_bytes", None)
    res["tests"][0]["ext"] = ext_delta(before, after)
    assert rows_from_result(cfg, "patched", res, {})[0].h2d_bytes_per_device == [4_500, 3_000]


def test_tests_at_a_depth_start_after_a_filled_context(tiny_model, tmp_path):
    """llama-bench's -d: [kind, n, depth] first fills the context with `depth` tokens (untimed), then times the test
    right after them. The rows say so (n_depth, "tg4 @ d300"); the KQ mask of a deeper context is larger, so each
    token uploads more bytes than at depth 0."""
    cfg = RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=128, n_ubatch=32,
                    tests=[["tg", 4], ["tg", 4, 300], ["pp", 32, 300]], reps=1)
    assert cfg.context().n_ctx >= 332 and cfg.job().ctx.n_ctx == cfg.context().n_ctx   # room for the depth
    df = runner.ab([cfg], out_dir=tmp_path, progress=False, timeout=120, variants=["patched"])
    r = df.set_index("test")
    assert list(r.index) == ["tg4", "tg4 @ d300", "pp32 @ d300"], list(r.index)
    assert list(r["n_depth"]) == [0, 300, 300] and (r["avg_ts"] > 0).all()
    h2d = lambda t: sum(r.loc[t, "h2d_bytes_per_device"])
    assert h2d("tg4 @ d300") > h2d("tg4"), (h2d("tg4 @ d300"), h2d("tg4"))


def test_cli_depth_option_builds_tests_per_depth():
    from pyllama_pp import cli, planning
    from pyllama_pp.errors import PyllamaError

    choices = lambda argv: cli.choices_from_args(cli.build_parser().parse_args(argv))
    assert planning.tests_of(choices(["ab", "-p", "64", "-n", "8", "-d", "0,512"])) == \
        [["pp", 64], ["tg", 8], ["pp", 64, 512], ["tg", 8, 512]]
    with pytest.raises(PyllamaError, match="n-depth"):
        planning.tests_of(choices(["ab", "-d", "-1"]))


def test_depth_positions_and_clears():
    """The exact evals of a test at a depth: the prefix at positions 0..d-1 from a cleared cache, then the timed
    tokens at d, d+1, ... without clearing; at depth 0, tg keeps its untimed position-0 token (as before)."""
    from types import SimpleNamespace

    from pyllama_pp.worker.handlers.measure import run_tests

    calls = []

    class FakeSession:
        info = SimpleNamespace(n_vocab=100, n_expert=0)

        def reset_counters(self):
            pass

        def ext_stats(self):
            return None

        def eval(self, toks, logits="last", pos0=0, clear=True, stats=True):
            calls.append((len(toks), pos0, clear))
            return SimpleNamespace(seconds=0.01, counters={"devices": []})

    def run(test):
        calls.clear()
        run_tests(FakeSession(), [test], reps=1, seed=0, coverage=False)
        return calls[len(calls) // 2:]   # the timed rep (the first is the warm-up)

    assert run(["tg", 3, 10]) == [(10, 0, True), (1, 10, False), (1, 11, False), (1, 12, False)]
    assert run(["pp", 5, 10]) == [(10, 0, True), (5, 10, False)]
    assert run(["tg", 3]) == [(1, 0, True), (1, 1, False), (1, 2, False), (1, 3, False)]
    assert run(["pp", 5]) == [(5, 0, True)]


def test_mixed_workload_rows(tiny_model):
    """runner.mixed_workload (`pyllama-pp run/ab --workload mixed`): a row per variant and step of each round, the
    patched build's re-reservations (0: the patched scheduler keeps its plans) and plan switches (the decode steps),
    speedups."""
    cfg = RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=128, n_ubatch=32)
    df = runner.mixed_workload(cfg, rounds=2, workload=[["pp", 64], ["tg", 2]], timeout=120)
    assert list(df[df.variant == "patched"]["test"]) == ["r1 pp64", "r1 tg2", "r2 pp64", "r2 tg2"]
    assert len(df[df.variant == "baseline"]) == 4 and (df["avg_ts"] > 0).all()
    p = df[df.variant == "patched"].set_index("test")
    assert (p["re_reservations"] == 0).all() and p.loc["r1 tg2", "plan_switches"] == 1, p
    assert p["speedup"].notna().all() and df[df.variant == "baseline"]["speedup"].isna().all()


def test_cli_workload_option(capsys):
    from pyllama_pp import cli

    assert cli.build_parser().parse_args(["ab", "--workload", "mixed", "-r", "2"]).workload == "mixed"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["run", "m.gguf", "--workload", "bogus"])
    # no repetitions or rounds: an error that says so, not an empty table and exit 0
    for reps in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(["ab", "--workload", "mixed", "-r", reps])
        assert e.value.code == 2
        assert "at least 1" in capsys.readouterr().err


def test_ab_workload_gives_the_outputs_of_every_ab(tiny_model, tmp_path, monkeypatch, capsys):
    """`ab --workload mixed`: the Markdown table with its legend, the results folder (pyllama_pp_out/ab-* without
    -o) with results.{jsonl,csv,md} and the plot, as every `ab` gives them."""
    from pyllama_pp import cli
    monkeypatch.chdir(tmp_path)
    argv = ["ab", tiny_model, "--devices", "vdev:2x0@0", "--workload", "mixed", "-r", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| devices | host experts |" in out and "| r1 pp2048 |" in out and "**re-reservations" in out, out
    folder, = (tmp_path / "pyllama_pp_out").iterdir()
    assert {p.name for p in folder.iterdir()} >= {"results.jsonl", "results.csv", "results.md", "ab.png"}
    assert len((folder / "results.jsonl").read_text().splitlines()) == 2 * len(runner.MIXED_WORKLOAD)
    assert cli.main(argv + ["-o", str(tmp_path / "o"), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert all(Path(files[k]).exists() for k in ("jsonl", "csv", "markdown", "plot")), files


def test_mixed_workload_rejects_bad_steps_before_any_run(tiny_model):
    """A custom workload or round count that cannot run is a ValueError naming the problem, raised before a
    worker starts."""
    cfg = RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=128, n_ubatch=32)
    for workload, what in (([], "got []"), ([["pp", 0]], "['pp', 0]"), ([["decode", 4]], "decode"),
                           ([["pp", 64, 1]], "['pp', 64, 1]"), ([["tg", 2.5]], "2.5")):
        with pytest.raises(ValueError, match="a workload is") as e:
            runner.mixed_workload(cfg, workload=workload)
        assert what in str(e.value), (workload, str(e.value))
    for rounds in (0, -2, 1.5):
        with pytest.raises(ValueError, match="rounds must be"):
            runner.mixed_workload(cfg, rounds=rounds, workload=[["pp", 64]])


def test_mixed_workload_without_a_prompt(tiny_model):
    """Decode steps alone start from an empty cache (before, the context size came from the longest prompt and a
    workload without one failed with a bare max() error)."""
    cfg = RunConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=128, n_ubatch=32)
    df = runner.mixed_workload(cfg, variants=["baseline"], rounds=2, workload=[["tg", 3]], timeout=120)
    assert list(df["test"]) == ["r1 tg3", "r2 tg3"] and (df["avg_ts"] > 0).all(), df


def _bench_script(name: str):
    """A script of bench/ (not part of the package), as a module."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    if str(path.parent) not in sys.path:   # (as `python bench/X.py` has it: its helpers, e.g. _common, import)
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # (a dataclass in it looks its module up)
    spec.loader.exec_module(mod)
    return mod


def test_gather_timeline_puts_each_idle_gap_on_the_gather_that_ends_it(tmp_path, capsys):
    """bench/gather_timeline.py: runs are cut where the link idled longer than --split-ms; in a run, busy and idle
    time, and each idle gap counted before the kind of gather that ends it; bad files are clear errors."""
    gt = _bench_script("gather_timeline")
    ms = 1_000_000
    T = 1000 * ms   # (the GPU's timer: never 0)
    # GPU 0: prefetch 0-2 ms, rest 3-4 (1 ms idle before it), up 4-6, down 6-8; then 100 ms of nothing and a
    # second run: up 108-110, down 111-113 (1 ms idle). GPU 1: one run, never idle. A gather that never ran (t0 0)
    # is left out.
    lines = ["gpu,seq,mode,weight,t0_ns,t1_ns,bytes",
             f"0,0,1,blk.0.ffn_gate_exps.weight,{T + 0 * ms},{T + 2 * ms},100",
             f"0,1,2,blk.0.ffn_gate_exps.weight,{T + 3 * ms},{T + 4 * ms},50",
             f"0,2,0,blk.0.ffn_up_exps.weight,{T + 4 * ms},{T + 6 * ms},100",
             f"0,3,0,blk.0.ffn_down_exps.weight,{T + 6 * ms},{T + 8 * ms},100",
             f"0,4,0,blk.1.ffn_up_exps.weight,{T + 108 * ms},{T + 110 * ms},100",
             f"0,5,0,blk.1.ffn_down_exps.weight,{T + 111 * ms},{T + 113 * ms},100",
             "0,6,0,blk.1.ffn_gate_exps.weight,0,0,0",
             f"1,0,0,blk.2.ffn_up_exps.weight,{T + 5 * ms},{T + 7 * ms},300"]
    f = tmp_path / "tl.123.csv"
    f.write_text("\n".join(lines) + "\n")
    s = gt.summarize(gt.read([f]), split_ms=20, min_gathers=1)
    assert [(x["gpu"], x["burst"], x["gathers"]) for x in s] == [(0, 0, 4), (0, 1, 2), (1, 0, 1)]
    first = s[0]
    assert first["span_ms"] == pytest.approx(8) and first["busy_ms"] == pytest.approx(7)
    assert first["idle_ms"] == pytest.approx(1) and first["busy_frac"] == pytest.approx(7 / 8)
    assert first["kinds"]["rest:gate"]["gap_before_ms"] == pytest.approx(1)
    assert first["kinds"]["prefetch:gate"]["gap_before_ms"] == 0 and first["kinds"]["used:up"]["gap_before_ms"] == 0
    assert first["kinds"]["rest:gate"]["gbps"] == pytest.approx(50 / 1e6)
    assert s[1]["kinds"]["used:down"]["gap_before_ms"] == pytest.approx(1)
    assert s[2]["busy_frac"] == pytest.approx(1.0) and s[2]["bytes"] == 300
    assert gt.main([str(f), "--min-gathers", "3"]) == 0
    table = capsys.readouterr().out
    assert "rest:gate 1.0 (1" in table and "| 1 |" not in table   # (GPU 1's single gather is below 3)
    assert gt.main([str(tmp_path / "missing.csv")]) == 2
    assert "no such file" in capsys.readouterr().err
    # a gather that took no time (span 0: no busy fraction) prints "-", and a cut-off file is a clear error
    one = tmp_path / "one.1.csv"
    one.write_text(lines[0] + f"\n0,0,0,blk.0.ffn_up_exps.weight,{T},{T},0\n")
    assert gt.main([str(one), "--min-gathers", "1"]) == 0 and "| - |" in capsys.readouterr().out
    cut = tmp_path / "cut.1.csv"
    cut.write_text(lines[0] + "\n0,0,0,blk.0.ffn_up_exps.weight\n")
    assert gt.main([str(cut)]) == 2 and "not a gather timeline" in capsys.readouterr().err
    # the median gap before each kind, and (files with queued_ns) how long before its start the host queued each
    # gather: here 5, 1, 3 ms, so p10 1 ms and p50 3 ms; a file without the column has no host lead
    assert first["kinds"]["rest:gate"]["gap_p50_us"] == pytest.approx(1000) and first["host_lead_ms_p50"] is None
    queued = tmp_path / "q.1.csv"
    queued.write_text("gpu,seq,mode,weight,t0_ns,t1_ns,bytes,queued_ns\n"
                      f"0,0,0,blk.0.ffn_up_exps.weight,{T + 10 * ms},{T + 11 * ms},10,{T + 5 * ms}\n"
                      f"0,1,0,blk.0.ffn_down_exps.weight,{T + 12 * ms},{T + 13 * ms},10,{T + 11 * ms}\n"
                      f"0,2,1,blk.1.ffn_gate_exps.weight,{T + 13 * ms},{T + 14 * ms},10,{T + 10 * ms}\n")
    q = gt.summarize(gt.read([queued]), min_gathers=1)[0]
    assert q["host_lead_ms_p10"] == pytest.approx(1) and q["host_lead_ms_p50"] == pytest.approx(3), q
    assert q["kinds"]["used:down"]["gap_p50_us"] == pytest.approx(1000) and q["kinds"]["used:up"]["gap_p50_us"] is None
    assert gt.main([str(queued), "--min-gathers", "1"]) == 0 and "| 1.0 / 3.0 |" in capsys.readouterr().out


def test_stream_timeline_splits_copies_into_hidden_and_exposed(tmp_path):
    """bench/timeline.py: the compute stream is the one with the most kernel time; host-to-device copy time is
    hidden where that stream ran a kernel and exposed elsewhere; the picture and the table are written from a
    profiler trace."""
    tl = _bench_script("timeline")
    ev = []
    for i in range(4):   # per 10 ms: a kernel 0-8 ms on stream 7, a copy 1-11 ms on stream 20, a short kernel on 20
        t = i * 10_000.0
        ev += [{"ph": "X", "cat": "kernel", "name": "mm", "ts": t, "dur": 8000, "args": {"stream": 7}},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t + 1000,
                "dur": 10_000, "args": {"stream": 20, "bytes": 500_000_000}},
               {"ph": "X", "cat": "kernel", "name": "gather", "ts": t + 9000, "dur": 500, "args": {"stream": 20}},
               {"ph": "X", "cat": "cpu_op", "name": "host", "ts": t, "dur": 100}]
    stats = tl.analyse(tl.gpu_events({"traceEvents": ev}))
    assert stats["compute_stream"] == 7 and stats["wall_s"] == pytest.approx(0.041)
    # hidden per step: 1-8 ms, and 10-11 under the next kernel (not after the last): 4 * 7 + 3 * 1 = 31 ms of 40
    assert stats["htod_hidden_s"] == pytest.approx(0.031) and stats["htod_exposed_s"] == pytest.approx(0.009)
    assert stats["htod_gbps_while_copying"] == pytest.approx(50.0) and stats["idle_s"] == pytest.approx(0.0)
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": ev, "pyllama_pp": {"title": "four steps", "n_layer": 2,
                                                                     "args": {"p": 64, "ubatch": 32}}}))
    assert tl.main(["--trace", str(trace), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "timeline.json").read_text())["title"] == "four steps"
    with pytest.raises(SystemExit, match="no GPU kernels"):
        tl.analyse([])


def test_a_closed_session_says_so(tiny_model):
    """After close() every call that needs the model raises PyllamaError saying the session is closed (coverage used
    to create a context on the freed model)."""
    code = f"""
from pyllama_pp.errors import PyllamaError
from pyllama_pp.params import ContextParams
from pyllama_pp.session import Session
s = Session({str(tiny_model)!r}, ctx=ContextParams(n_ctx=256, n_batch=64, n_ubatch=32))
s.close()
calls = [lambda: s.eval([1, 2]), lambda: s.coverage([1, 2], exclusive=True), lambda: s.schedule(),
         lambda: s.set_context(ContextParams(n_ctx=256, n_batch=64, n_ubatch=16)), lambda: s.kv_pos_max(),
         lambda: s.ext_stats()]
for call in calls:
    try:
        call()
        raise AssertionError("a closed session answered")
    except PyllamaError as e:
        assert "is closed" in str(e), e
s.close()   # (twice: nothing happens)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]


def test_cache_hits_writes_the_simulator_s_rates(tmp_path):
    """bench/cache_hits.py on a saved trace: hits.csv holds expert_cache_sim's numbers, with the table and a plot."""
    g = np.random.default_rng(0)
    ids = np.stack([np.stack([g.choice(16, 2, replace=False) for _ in range(40)]) for _ in range(3)], axis=1)
    tr = ExpertTrace(ids, [0, 1, 2], 16, 8)
    tr.save(tmp_path / "t.npz")
    res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "cache_hits.py"),
                          str(tmp_path / "t.npz"), "--fractions", "0.25,0.5", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    df = pd.read_csv(tmp_path / "o" / "hits.csv")
    assert set(df.fraction) == {0.0625, 0.125, 0.25, 0.5}
    for r in df.itertuples():
        assert r.hits == simulate(tr, r.fraction, r.policy)["hits"], r
    assert (tmp_path / "o" / "hits-0.png").stat().st_size > 0
    assert "belady_12.5%" in (tmp_path / "o" / "results.md").read_text()


def test_cache_hits_errors_are_one_line_and_it_writes_outside_the_checkout(tmp_path):
    """bench/cache_hits.py on a missing trace, a file that is not a GGUF and one that is not a trace: one line on
    stderr and exit 2 (they were tracebacks); without --out it writes into the current folder, never the checkout's
    bench/out/."""
    script = Path(__file__).parents[1] / "bench" / "cache_hits.py"
    (tmp_path / "junk.gguf").write_bytes(b"junk")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    for arg, what in (("nothere.npz", "nothere.npz: no such file"), ("junk.gguf", "ModelError: junk.gguf is not a GGUF"),
                      ("junk.npz", "junk.npz is not an expert trace")):
        res = subprocess.run([sys.executable, str(script), arg], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and lines[-1].startswith("cache_hits.py: error: ") and what in lines[-1], res.stderr
        assert "Traceback" not in res.stderr and len([ln for ln in lines if "error" in ln]) == 1, res.stderr
    g = np.random.default_rng(0)
    ids = np.stack([np.stack([g.choice(16, 2, replace=False) for _ in range(40)]) for _ in range(3)], axis=1)
    ExpertTrace(ids, [0, 1, 2], 16, 8).save(tmp_path / "t.npz")
    checkout_out = Path(__file__).parents[1] / "bench" / "out" / "cache_hits"
    before = sorted(checkout_out.rglob("*")) if checkout_out.exists() else []
    stamp = {p: p.stat().st_mtime_ns for p in before}
    res = subprocess.run([sys.executable, str(script), "t.npz", "--fractions", "0.25"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    written, = (tmp_path / "pyllama_pp_out").glob("cache_hits-*")
    assert (written / "hits.csv").exists() and (written / "results.md").exists()
    after = sorted(checkout_out.rglob("*")) if checkout_out.exists() else []
    assert after == before and all(p.stat().st_mtime_ns == stamp[p] for p in after)


def test_cache_decode_logits_check_reads_the_slots(tiny_model, tmp_path):
    """bench/cache_decode.py's logits check (an NMSE of 0 against size 0 on VDEVs): it decodes its 16 tokens through
    the slots - every expert op of each token read them - so it compares the cached path with the CPU path, not the
    CPU path with itself, and says where it did not: with the guard's floor at 100, 8 slots a layer have left for the
    CPU by then (a full cache never does)."""
    res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "cache_decode.py"), "--model",
                          tiny_model, "--sizes", "0,-64,-8", "--min-hit", "0,100", "-n", "48", "--rounds", "2",
                          "--no-baseline", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {(r["expert_cache"], r["min_hit"]): r for r in json.loads((tmp_path / "cache_decode.json").read_text())["rows"]}
    ops = 3 * 6 * 16   # (the tiny model: 6 layers of 3 expert ops; the check decodes min(n, 16) tokens)
    off = next(r for k, r in rows.items() if k[0] == 0)
    assert off["logits_cache_ops"] == off["logits_cpu_ops"] == 0
    for mh in (0, 100):
        assert rows[-64, mh]["logits_cache_ops"] == ops and rows[-64, mh]["nmse_vs_off"] == 0.0
    assert rows[-8, 0]["logits_cache_ops"] == ops
    assert rows[-8, 100]["logits_cache_ops"] == 0 and rows[-8, 100]["logits_cpu_ops"] == ops


def test_check_families_writes_the_logits_tolerance_table(tmp_path):
    """bench/check_families.py --cache: two families, each with its experts in two types (Q4_K's rows widened to its
    block), decoded token by token on two VDEVs with 8 slots a layer against the baseline: every expert op of every
    token read the slots, and the logits equal the baseline's, well within test-backend-ops' MUL_MAT_ID limit, which
    the table shows beside them."""
    res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "check_families.py"), "--cache",
                          "-8", "--families", "tiny,glm4moe-tiny", "--types", "q8_0,q4_k", "--tokens", "4",
                          "--devices", "vdev:2x0@4GBps", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["family"], r["expert_type"]) for r in rows] == \
        [("tiny", "q8_0"), ("tiny", "q4_k"), ("glm4moe-tiny", "q8_0"), ("glm4moe-tiny", "q4_k")]
    moe_layers = {"tiny": 6, "glm4moe-tiny": 5}   # (glm4moe-tiny's first layer is dense)
    for r in rows:
        assert r["patched_cache_ops"] == 3 * moe_layers[r["family"]] * 4, r
        assert r["patched_cache_hits"] + r["patched_cache_misses"] > 0 and r["nmse_max"] == 5e-4
        assert r["nmse"] == 0.0 and r["max_abs_diff"] == 0.0 and r["ok"], r
    table = (tmp_path / "results.md").read_text()
    assert "| test-backend-ops MUL_MAT_ID NMSE limit |" in table and table.count("| 0.0005 | yes |") == 4, table


def test_prefetch_accuracy_predicts_exactly_from_the_router_s_input(tiny_model):
    """bench/prefetch_accuracy.py on the tiny model: the router applied to the captured router input (source "exact")
    names the actual experts (recall 1.0, every miss predicted, nothing wasted); from the previous layer's states the
    recall and the share of misses predicted lie in [0, 1]."""
    pa = _bench_script("prefetch_accuracy")
    from pyllama_pp import trace
    tr = trace.record(tiny_model, n_prompt=8, n_decode=40, seed=1, capture=pa.CAPTURE)
    router = pa.Router(tiny_model)
    gain = pa.Gain(**pa.H100)
    cols = list(range(1, len(tr.layers)))   # (the layers with one before them, as run() counts every source)
    exact = pa.evaluate(tr, pa.predictions(tr, router, "exact", router.k), router.k, [0.125], gain, cols)
    assert exact["recall"] == 1.0 and exact["0.125"]["misses_predicted"] == 1.0
    assert exact["0.125"]["wasted_per_token"] == 0 and exact["0.125"]["speedup"] > 1.0
    for source in ("ffn_inp", "l_out"):
        r = pa.evaluate(tr, pa.predictions(tr, router, source, router.k), router.k, [0.125], gain, cols)
        assert r["layer_pairs"] == len(tr.layers) - 1 and 0.0 <= r["recall"] <= 1.0, r
        assert 0.0 <= r["0.125"]["misses_predicted"] <= 1.0 and r["0.125"]["speedup"] <= exact["0.125"]["speedup_perfect"]


def test_prefetch_saves_what_the_window_fits():
    """The gain model's window: predicted copies best first, cached ones skipped, a right one in flight saves the part
    done and a wrong one in flight costs its rest."""
    pa = _bench_script("prefetch_accuracy")
    cached = np.zeros(8, dtype=bool)
    cached[3] = True
    assert pa.saved_experts([3, 1, 2], {1, 2}, cached, 1.5) == 1.5    # 3 cached: 1 whole, half of 2
    assert pa.saved_experts([5, 1], {1}, cached, 0.25) == -0.75         # 5 wrong, cut a quarter in
    assert pa.Gain(0.1, 50.0, 5.0).speedup(2.0, 0.0) == 1.0


def test_prefetch_accuracy_bad_paths_are_one_line(tmp_path):
    """A missing model, a file that is not a GGUF and an --out without its parent: one line on stderr, exit 2."""
    script = Path(__file__).parents[1] / "bench" / "prefetch_accuracy.py"
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    for argv, what in [([str(tmp_path / "none.gguf")], "no such model"), ([str(junk)], "junk.gguf"),
                       (["--synth", "tiny", "--out", str(tmp_path / "a" / "b")], "does not exist")]:
        res = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and lines[-1].startswith("prefetch_accuracy.py: error: ") and what in lines[-1], \
            res.stderr
    assert not (tmp_path / "a").exists()


def test_archs_paired_ab_gives_each_model_its_interval(tiny_model, tmp_path):
    """bench/archs.py --ab --paired N --loads K: a model of the folder (named as test-llama-archs writes them) runs in
    both variants with the same logits, then its prompt A/B in paired rounds over fresh loads (runner.interleaved):
    the row and the table carry the median ratio inside its 95% interval, from N rounds of each of K loads."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-moe.gguf").symlink_to(tiny_model)
    res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "archs.py"), "--out",
                          str(tmp_path / "out"), "--models", str(models), "--ab", "vdev:2x0@0", "--paired", "2",
                          "--loads", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-2000:]
    row, = json.loads((tmp_path / "out" / "archs.json").read_text())
    assert row["ok"] and row["nmse"] == 0.0 and (row["ab_rounds"], row["ab_loads"]) == (4, 2), row
    assert row["speedup_ci_lo"] <= row["speedup_median"] <= row["speedup_ci_hi"], row
    table = (tmp_path / "out" / "archs.md").read_text()
    assert "| paired speedup [95%] |" in table and f"| {row['speedup_median']:.3f} [" in table, table


def test_archs_refuses_loads_without_paired(tmp_path):
    """--loads without --paired (and an odd --paired) is refused before anything is built or run."""
    for extra in (["--ab", "--loads", "2"], ["--ab", "--paired", "3"], ["--paired", "2"]):
        res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "bench" / "archs.py"), "--out",
                              str(tmp_path), *extra], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and ("--loads" in res.stderr or "--paired" in res.stderr), res.stderr
        assert not (tmp_path / "writer").exists()
