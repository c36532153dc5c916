"""Paired A/B: the serving worker (`python -m pyllama_pp.worker --serve`) keeps its session between jobs and answers a
broken job without dying; runner.interleaved runs the variants in ABBA rounds and gives the paired speedup's interval."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyllama_pp import cli, report, runner
from pyllama_pp.config import RunConfig
from pyllama_pp.errors import ConfigError, ModelError, WorkerError
from pyllama_pp.stats import paired_ci, t_quantile
from pyllama_pp.worker import ServingWorker

CTX = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 32}


def _job(model, **kw):
    return {"kind": "measure", "model": model, "devices": "vdev:2x0@0", "tests": [["tg", 4], ["pp", 32]], "reps": 1,
            "warmup": 0, "ctx": CTX, **kw}


def test_progress_is_one_named_step_per_round(tiny_model, progress_bars):
    """`--paired 4`: four steps per config, each named by its round and the config's tests (the warm-up is no step)."""
    cfg = RunConfig(tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["pp", 32]])
    runner.interleaved([cfg, cfg], rounds=4, progress=True)
    bar, = progress_bars
    assert bar.total == 8 and [n for n, _ in bar.steps] == [1] * 8, bar.steps
    assert [name.split(" ")[:2] for _, name in bar.steps] == [["round", f"{r}/4"] for r in (1, 2, 3, 4)] * 2
    assert all("ub=32 pp32" in name for _, name in bar.steps), bar.steps


def test_serving_worker_loads_once_for_many_jobs(tiny_model):
    """Three jobs on one model: one process, one load; a job with another context gets a fresh context on the same
    model (its ubatch shows in the schedule), and EOF ends the worker with exit 0."""
    with ServingWorker("patched") as w:
        got = [w.run(_job(tiny_model), timeout=60) for _ in range(3)]
        other = w.run(_job(tiny_model, ctx={**CTX, "n_ubatch": 16}), timeout=60)
        assert w.alive
    assert w.close() == 0 and not w.alive
    served = [r["served"] for r in got + [other]]
    assert {s["pid"] for s in served} == {w.pid}
    assert [s["loads"] for s in served] == [1, 1, 1, 1]
    assert [s["reused"] for s in served] == [False, True, True, True]
    assert served[0]["load_seconds"] > 0 and served[1]["load_seconds"] == 0
    for r in got:   # warmup 0, reps 1: one timed run of each test, in order
        assert [(t["kind"], t["n"], len(t["seconds"])) for t in r["tests"]] == [("tg", 4, 1), ("pp", 32, 1)]
        assert all(t["seconds"][0] > 0 for t in r["tests"])
    assert got[0]["model"] == other["model"]


def test_serving_worker_answers_a_broken_job_and_serves_the_next(tiny_model, tmp_path):
    """A job that fails in the worker (a missing model, a line that is not JSON, other switches than its first
    job's) is raised as run_job raises it (the worker's class with WorkerError, exit code 3) and the same process
    serves the next job; a worker that does not answer in time is killed and says so."""
    with ServingWorker("patched") as w:
        first = w.run(_job(tiny_model), timeout=60)["served"]
        with pytest.raises(ModelError) as e:
            w.run(_job(str(tmp_path / "missing.gguf")), timeout=60)
        assert isinstance(e.value, WorkerError) and e.value.exit_code == 3 and "model file not found" in str(e.value)
        w._proc.stdin.write("{not json\n")
        w._proc.stdin.flush()
        with pytest.raises(ConfigError, match="one JSON object"):
            w.result(timeout=60)
        with pytest.raises(ConfigError, match="switches"):
            w.run(_job(tiny_model, switches={"OVERLAP": 2}), timeout=60)
        after = w.run(_job(tiny_model), timeout=60)["served"]
        assert after["pid"] == first["pid"] and w.alive
        assert after["loads"] == 2 and not after["reused"]   # (a failed job drops the session: the next loads afresh)
    slow = ServingWorker("baseline").start()
    try:
        with pytest.raises(WorkerError, match="timed out after 1 s") as e:
            slow.run(_job(tiny_model, devices="vdev:2x0@0.0001GBps", tests=[["pp", 64]], reps=50), timeout=1)
        assert e.value.exit_code is None and not slow.alive
        with pytest.raises(WorkerError, match="died"):
            slow.result(timeout=5)
    finally:
        slow.close()


def test_paired_ci_numbers():
    assert paired_ci([1.0] * 8) == (1.0, 1.0, 1.0)
    # rounds pair up (AB, BA): geometric means 1.0 (0.9 * 1.111..), 1.3 (1.3 * 1.3); the unmatched fifth is left out
    med, lo, hi = paired_ci([0.9, 1 / 0.9, 1.3, 1.3, 0.5])
    assert med == pytest.approx(1.15) and lo == pytest.approx(1.0) and hi == pytest.approx(1.3)
    assert paired_ci([0.9, 1 / 0.9, 1.3, 1.3, 0.5]) == (med, lo, hi)   # a fixed seed
    # 40 rounds of a 3% gain with 1% noise per round: the interval excludes 1.00 and is well under 2% wide
    r = 1.03 + 0.01 * np.random.default_rng(5).standard_normal(40)
    med, lo, hi = paired_ci(r)
    assert 1.0 < lo <= med <= hi and hi - lo < 0.02
    assert all(x != x for x in paired_ci([])) and all(x != x for x in paired_ci([1.1]))


def test_paired_ci_cancels_an_order_effect():
    """Whichever variant runs first in a round gains 8%: per round the ratios alternate 0.92x / 1.08x around a true
    1.00x. Pairing each AB round with its BA round cancels that (a median of the rounds alone would not: it lands
    on either side); an odd number of rounds does not tip it either."""
    g = np.random.default_rng(7)
    r = [(0.92 if k % 2 == 0 else 1 / 0.92) * (1 + 0.002 * g.standard_normal()) for k in range(41)]
    med, lo, hi = paired_ci(r)
    assert lo <= 1.0 <= hi and hi - lo < 0.01 and abs(med - 1.0) < 0.003
    assert abs(float(np.median(r)) - 1.0) > 0.05   # (what the per-round median would have said)


@pytest.fixture
def started(monkeypatch) -> list:
    """The variants of the serving workers started, in order (each start still runs)."""
    names: list = []
    real = ServingWorker.start

    def counting(self):
        names.append(self.variant)
        return real(self)

    monkeypatch.setattr(ServingWorker, "start", counting)
    return names


def test_t_quantile_matches_the_tables():
    for df, want in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)
    assert t_quantile(0.05, 3) == pytest.approx(-2.3534, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_paired_ci_counts_each_load_once():
    """Four loads whose memory placement shifts the ratio by -3..+3% around a true 1.00x, 0.2% noise within a load:
    the estimate is the geometric mean of the loads' medians and the interval Student's t over them, wider than a
    bootstrap over the pooled pairs. A pair never spans two loads; labels must cover every round."""
    g = np.random.default_rng(3)
    offs = [1.03, 0.97, 1.02, 0.98]
    r = [offs[k] * (1 + 0.002 * g.standard_normal()) for k in range(4) for _ in range(10)]
    groups = [k for k in range(4) for _ in range(10)]
    med, lo, hi = paired_ci(r, groups=groups)
    meds = np.log([np.median(np.sqrt(np.array(r[10 * k:10 * k + 10:2]) * np.array(r[10 * k + 1:10 * k + 10:2])))
                   for k in range(4)])
    half = t_quantile(0.975, 3) * meds.std(ddof=1) / 2
    assert (med, lo, hi) == pytest.approx((np.exp(meds.mean()), np.exp(meds.mean() - half), np.exp(meds.mean() + half)))
    _, lo1, hi1 = paired_ci(r)
    assert lo <= 1.0 <= hi and hi - lo > 2 * (hi1 - lo1)
    # odd rounds per load: the last of each load is left out rather than paired with the next load's first
    assert paired_ci([1.0, 1.0, 2.0, 1.0, 1.0, 2.0], groups=[0, 0, 0, 1, 1, 1]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="label every round"):
        paired_ci([1.0, 1.0], groups=[0])


def test_paired_ci_over_three_loads_covers_at_its_level():
    """Three loads with a 2% spread between them and 0.3% noise within: the 95% interval holds the true ratio in
    about 95% of such runs (a bootstrap over the loads held it in about 78%)."""
    g = np.random.default_rng(11)
    hits = 0
    for _ in range(300):
        r = [np.exp(off) * (1 + 0.003 * g.standard_normal())
             for off in 0.02 * g.standard_normal(3) for _ in range(16)]
        _, lo, hi = paired_ci(r, groups=[k for k in range(3) for _ in range(16)])
        hits += lo <= 1.0 <= hi
    assert 0.90 <= hits / 300 <= 0.99, hits


def test_interleaved_loads_start_fresh_workers_in_alternating_order(tiny_model, started):
    """loads=2: the workers are started for every load of every config, the second load's in the other order (which
    also runs first in that load's round 0); rows pool every load's rounds and say how many loads."""
    cfg = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["tg", 2]])
    df = runner.interleaved(cfg, rounds=2, loads=2, progress=False, timeout=60)
    assert started == ["baseline", "patched", "patched", "baseline"]
    assert df.attrs["order"] == [[0, -1, "baseline"], [0, -1, "patched"], [0, 0, "baseline"], [0, 0, "patched"],
                                 [0, 1, "patched"], [0, 1, "baseline"],
                                 [0, -1, "patched"], [0, -1, "baseline"], [0, 2, "patched"], [0, 2, "baseline"],
                                 [0, 3, "baseline"], [0, 3, "patched"]]
    rows = df.set_index("variant")
    assert (df["rounds"] == 4).all() and (df["loads"] == 2).all()
    assert len(rows.loc["patched", "ratios"]) == 4 and rows.loc["patched", "speedup_ci_lo"] <= \
        rows.loc["patched", "speedup_median"] <= rows.loc["patched", "speedup_ci_hi"]
    assert "in 2 loads" in report.markdown(df)
    started.clear()   # a second config (the same workers' key): fresh workers for its first load too
    cfg2 = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=16, tests=[["tg", 2]])
    df = runner.interleaved([cfg, cfg2], rounds=2, loads=2, progress=False, timeout=60)
    assert started == ["baseline", "patched", "patched", "baseline"] * 2 and df.error.isna().all()
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="loads must be"):
            runner.interleaved(cfg, rounds=2, loads=bad)


def test_interleaved_keeps_the_loads_before_a_failed_reload(tiny_model, monkeypatch):
    """The patched worker fails to start for the second load (out of memory on reloading, say): the rows keep the
    first load's rounds for both variants, with their ratio, and say one load; no error rows."""
    starts = {"patched": 0}
    real = ServingWorker.start

    def failing(self):
        if self.variant == "patched":
            starts["patched"] += 1
            if starts["patched"] == 2:
                raise WorkerError("no memory left for a second load")
        return real(self)

    monkeypatch.setattr(ServingWorker, "start", failing)
    cfg = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["tg", 2]])
    df = runner.interleaved(cfg, rounds=2, loads=3, progress=False, timeout=60)
    assert df.error.isna().all() and (df["rounds"] == 2).all() and (df["loads"] == 1).all()
    p = df.set_index("variant").loc["patched"]
    assert len(p["ratios"]) == 2 and p["speedup_ci_lo"] <= p["speedup_median"] <= p["speedup_ci_hi"]


def test_interleaved_runs_abba_rounds_and_pairs_them(tiny_model, tmp_path, monkeypatch):
    """One warm-up per variant, then rounds in ABBA order (the order recorded at each job sent); every row has one
    sample per round, and the patched rows' ratios are the per-round t/s ratios with a CI around their median."""
    sent = []
    real = ServingWorker.run

    def recording(self, job, timeout=None):
        sent.append((self.variant, job.warmup, job.coverage))
        return real(self, job, timeout=timeout)

    monkeypatch.setattr(ServingWorker, "run", recording)
    cfg = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32,
                    tests=[["pp", 64], ["tg", 4]], reps=9, label="paired")
    df = runner.interleaved(cfg, rounds=6, out_dir=tmp_path, progress=False, timeout=60)
    b, p = ("baseline", 0, False), ("patched", 0, False)
    assert sent == [("baseline", 1, True), ("patched", 1, False), b, p, p, b, b, p, p, b, b, p, p, b]
    assert df.attrs["order"] == [[0, -1, "baseline"], [0, -1, "patched"]] + [
        [0, r, v] for r in range(6) for v in (("baseline", "patched") if r % 2 == 0 else ("patched", "baseline"))]
    assert len(df) == 4 and df.error.isna().all() and (df["rounds"] == 6).all()
    assert all(len(s) == 6 for s in df.samples_ts)                       # rounds, not the config's 9 reps
    rows = {(r.variant, r.test): r for r in df.itertuples()}
    for test in ("pp64", "tg4"):
        bs, ps = rows["baseline", test], rows["patched", test]
        want = [x / y for x, y in zip(ps.samples_ts, bs.samples_ts)]
        assert ps.ratios == pytest.approx(want)
        pairs = np.sqrt(np.array(want[0::2]) * np.array(want[1::2]))   # (AB with BA)
        assert ps.speedup_median == pytest.approx(float(np.median(pairs)))
        assert ps.speedup_ci_lo <= ps.speedup_median <= ps.speedup_ci_hi
        assert ps.speedup == pytest.approx(ps.avg_ts / bs.avg_ts) and bs.speedup_ci_lo != bs.speedup_ci_lo
        assert bs.avg_ts == pytest.approx(np.mean(bs.samples_ts))
    # coverage measured once (the baseline's warm-up) is on every pp row; the rows on disk are these
    assert rows["baseline", "pp64"].coverage == rows["patched", "pp64"].coverage > 0
    disk = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["test"], len(r["samples_ts"])) for r in disk] == \
        [("baseline", "pp64", 6), ("baseline", "tg4", 6), ("patched", "pp64", 6), ("patched", "tg4", 6)]
    assert "paired" in report.markdown(df) and "6 rounds" in report.markdown(df)


def test_interleaved_order_reversed_variants_and_a_failing_variant(tiny_model):
    """variants=("patched", "baseline"): round 0 starts with patched. A variant whose worker refuses the job (an
    unknown switch) gets error rows; the other's rounds still run and keep their rows, without a paired ratio."""
    cfg = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["tg", 2]],
                    switches={"NO_SUCH_SWITCH": 1})
    df = runner.interleaved(cfg, variants=("patched", "baseline"), rounds=4, progress=False, timeout=60)
    assert df.attrs["order"] == [[0, -1, "baseline"]] + [[0, r, "baseline"] for r in range(4)]
    rows = df.set_index("variant")
    assert "NO_SUCH_SWITCH" in rows.loc["patched", "error"]
    assert rows.loc["baseline", "rounds"] == 4 and len(rows.loc["baseline", "samples_ts"]) == 4
    ok = RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["tg", 2]])
    df = runner.interleaved(ok, variants=("patched", "baseline"), rounds=2, progress=False, timeout=60)
    assert df.attrs["order"] == [[0, -1, "patched"], [0, -1, "baseline"], [0, 0, "patched"], [0, 0, "baseline"],
                                 [0, 1, "baseline"], [0, 1, "patched"]]
    for bad in (0, 1, 3):
        with pytest.raises(ValueError, match="rounds must be an even whole number"):
            runner.interleaved(ok, rounds=bad)
    with pytest.raises(ValueError, match="variants"):
        runner.interleaved(ok, variants=("patched", "patched"))


def test_interleaved_configs_share_the_workers(tiny_model, started):
    """Configs with the same environment and switches run in the same two workers; a config that differs only in
    batch sizes reuses the loaded model (a fresh context)."""
    cfgs = [RunConfig(model=tiny_model, devices="vdev:2x0@0", n_batch=64, n_ubatch=ub, tests=[["pp", 64]])
            for ub in (16, 64)]
    df = runner.interleaved(cfgs, rounds=2, progress=False, timeout=60)
    assert started == ["baseline", "patched"]
    assert sorted(df.n_ubatch) == [16, 16, 64, 64] and df.error.isna().all()
    assert list(df.config) == [0, 0, 1, 1]


def test_cli_ab_paired(tiny_model, tmp_path, capsys, usage_error, no_worker):
    rc = cli.main(["ab", tiny_model, "--devices", "vdev:2x0@0", "-b", "64", "-ub", "32", "-p", "0", "-n", "2",
                   "--paired", "4", "-o", str(tmp_path / "out"), "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["variant"], r["rounds"], len(r["samples_ts"])) for r in rows] == [("baseline", 4, 4), ("patched", 4, 4)]
    assert rows[1]["speedup_ci_lo"] <= rows[1]["speedup_median"] <= rows[1]["speedup_ci_hi"]
    assert "--workload has rounds" in usage_error(["ab", tiny_model, "--workload", "mixed", "--paired", "4"])
    assert "drop --paired" in usage_error(["ab", "--resume", str(tmp_path / "out"), "--paired", "4"])
    assert "add --paired N" in usage_error(["ab", tiny_model, "--loads", "2"])
    assert "drop --loads" in usage_error(["ab", tiny_model, "--workload", "mixed", "--loads", "2"])
    with pytest.raises(SystemExit) as e:   # (argparse: its usage and the error line)
        cli.main(["ab", tiny_model, "--paired", "3"])
    assert e.value.code == 2 and "expected an even number of rounds" in capsys.readouterr().err


def _decode_frame(samples: dict, contention=None) -> "object":
    """Rows of one decode config: variant -> its samples (t/s)."""
    import statistics
    from pyllama_pp.row import Row, frame
    rows = [Row(variant=v, devices="vdev:2x256MiB@0.1GBps", n_batch=512, n_ubatch=32, test="tg32", n_gen=32,
                avg_ts=statistics.fmean(xs), stddev_ts=statistics.stdev(xs), samples_ts=xs, config=0,
                contention=contention) for v, xs in samples.items()]
    return frame(rows)


def test_noisy_decode_and_a_contended_cpu_are_warned_of_with_the_advice_to_rerun():
    """The issue's samples (5 to 1,540 t/s) spread more than their mean; another process held a core while they ran:
    each is one warning that says so and to rerun; steady samples on an idle machine give none."""
    from pyllama_pp.stats import Contention
    noisy = _decode_frame({"baseline": [5.0, 12.0, 1540.0, 8.0, 20.0, 3.0], "patched": [300.0, 310.0, 305.0]})
    warnings = report.noise_warnings(noisy)
    assert len(warnings) == 1 and "baseline tg32" in warnings[0] and "rerun" in warnings[0], warnings
    busy = Contention(cores=2, cpus=2, load_1m=3.2, others_cores=1.0, busy=[["spin", 4242, 0.98]])
    steady = {"baseline": [300.0, 302.0, 301.0], "patched": [310.0, 309.0, 311.0]}
    warnings = report.noise_warnings(_decode_frame(steady, busy.to_dict()))
    assert len(warnings) == 1 and "spin (pid 4242" in warnings[0] and "2 usable cores" in warnings[0] \
        and "rerun" in warnings[0], warnings
    idle = Contention(cores=2, cpus=2, load_1m=1.9, others_cores=0.05, busy=[])
    assert report.noise_warnings(_decode_frame(steady, idle.to_dict())) == []


def test_a_process_that_holds_a_core_is_found():
    """CpuWatch over a window in which another process spins: it is named with its share of a core; this process
    and those it is told to leave out are not."""
    import subprocess
    import sys
    import time
    from pyllama_pp.stats import CpuWatch
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        watch = CpuWatch()
        time.sleep(1.0)
        seen = watch.stop(busy_share=0.1)
        left_out = CpuWatch()
        time.sleep(0.5)
        quiet = left_out.stop(exclude=[spin.pid], busy_share=0.1)
    finally:
        spin.kill()
        spin.wait()
    assert [b for b in seen.busy if b[1] == spin.pid] and seen.others_cores > 0.1, seen
    assert not [b for b in quiet.busy if b[1] == spin.pid], quiet
    assert seen.cores >= 1 and seen.load_1m >= 0


def test_the_cli_prints_the_warnings_under_the_table(tiny_model, tmp_path, monkeypatch, capsys):
    noisy = _decode_frame({"baseline": [5.0, 12.0, 1540.0, 8.0], "patched": [300.0, 310.0, 305.0]})
    monkeypatch.setattr(runner, "ab", lambda *a, **k: noisy)
    assert cli.main(["ab", tiny_model, "--devices", "vdev:2x0@0", "-p", "0", "-n", "32", "-o", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "pyllama-pp: warning: " in err and "rerun" in err, err
    assert cli.main(["ab", tiny_model, "--devices", "vdev:2x0@0", "-p", "0", "-n", "32", "-o", str(tmp_path),
                     "--json"]) == 0
    assert any("rerun" in w for w in json.loads(capsys.readouterr().out)["warnings"])
