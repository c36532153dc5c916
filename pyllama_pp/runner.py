"""The A/B runner: configurations (pyllama_pp.config) run on the baseline and the patched build.

`ab` runs every configuration in a fresh worker process per variant (same model, placement, batch sizes and load
mode for both; consecutive configs that share a model load share the worker, one job per test), appends each
configuration's rows to JSONL/CSV as soon as a variant measured them (a crash, a dead worker or Ctrl-C loses nothing
already measured) and turns a worker that dies into error rows of the configuration it was measuring. `interleaved` runs the variants round by round instead (one serving worker each,
the model loaded once, ABBA order): drift over time then hits both alike, and each round's ratio gives a paired
speedup with a confidence interval. `mixed_workload` runs a server's mixed load in one context per variant.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from tqdm import tqdm

from . import devices as devspec
from . import switches
from .binding import VARIANTS
from .config import RunConfig, config_key, load_key
from .params import ctx_for
from .counters import ext_add, sum_devices
from .defaults import CONTEXT, PAIRED, RUN
from .errors import ConfigError, WorkerError
from .jobs import MeasureJob, WorkloadJob, test_name
from .row import Row, RowWriter, frame, read_rows
from .rows import error_rows, error_text, meta, rows_from_result, workload_step_row
from .stats import CpuWatch, paired_ci
from .worker.client import ServingWorker, check_switch_env, run_job
from .workload import Workload

SWEEP_FILE = "sweep.json"


def _as_configs(configs) -> list[RunConfig]:
    """One RunConfig or an iterable of them, as a list; anything else is a TypeError that says what is wanted."""
    iterable = hasattr(configs, "__iter__") and not isinstance(configs, (str, bytes, dict))
    cfgs = [configs] if isinstance(configs, RunConfig) else list(configs) if iterable else None
    bad = [c for c in cfgs or [] if not isinstance(c, RunConfig)]
    if cfgs is None or bad:
        what = type(configs).__name__ if cfgs is None else type(bad[0]).__name__
        raise TypeError(f"configs must be a RunConfig or a list of them (pp.RunConfig(model, devices=...)), not {what}")
    return cfgs


def _check_envs(configs: list[RunConfig], variants: Sequence[str]) -> None:
    """check_switch_env once per distinct environment of the configs (each check may start an info worker)."""
    for env in {json.dumps(c.env or {}, sort_keys=True) for c in configs}:
        check_switch_env(variants, json.loads(env))


def save_sweep(out_dir: Union[str, Path], configs: list[RunConfig], variants: Sequence[str]) -> None:
    """DIR/sweep.json: the configs and variants of a sweep, so that `--resume DIR` can finish it."""
    path = Path(out_dir) / SWEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # (the model's absolute path: `--resume DIR` works from any working directory)
    saved = [{**c.to_dict(), "model": str(Path(c.model).resolve())} for c in configs]
    path.write_text(json.dumps({"variants": list(variants), "configs": saved}, indent=1, default=str))


def load_sweep(out_dir: Union[str, Path]) -> tuple[list[RunConfig], list[str]]:
    """The configs and variants saved by save_sweep.

    Raises:
        ConfigError: when DIR holds no sweep, or a damaged one.
    """
    path = Path(out_dir) / SWEEP_FILE
    if not Path(out_dir).is_dir():
        raise ConfigError(f"--resume {out_dir}: no such folder (give the -o folder of the sweep to continue)")
    try:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(RunConfig)}
        configs = [RunConfig(**{k: v for k, v in c.items() if k in names}) for c in data["configs"]]
        variants = [v for v in data["variants"] if v in VARIANTS]
    except OSError:
        raise ConfigError(f"--resume {out_dir}: the folder has no {SWEEP_FILE} (only sweeps written by `pyllama-pp "
                          "run/ab -o DIR` can be resumed)") from None
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        raise ConfigError(f"--resume {out_dir}: {path.name} is damaged ({e}); start the sweep again") from None
    if not configs or not variants:
        raise ConfigError(f"--resume {out_dir}: {path.name} lists no configs or variants; start the sweep again")
    return configs, variants


def _reusable(prev: dict, cfg: RunConfig, variant: str) -> Optional[list[Row]]:
    """A config's rows for `variant` from an earlier run of the sweep when every test has one without an error."""
    got = prev.get((config_key(cfg), variant), {})
    names = [test_name(t) for t in cfg.tests]
    if not all(n in got for n in names):
        return None
    return [got[n].copy() for n in names]


def _groups(configs: list[RunConfig], group: bool) -> list[list[tuple[int, RunConfig]]]:
    out: list[list[tuple[int, RunConfig]]] = []
    for ci, cfg in enumerate(configs):
        if group and out and load_key(out[-1][0][1]) == load_key(cfg):
            out[-1].append((ci, cfg))
        else:
            out.append([(ci, cfg)])
    return out


def _finish_config(per_variant: dict[str, list[Row]]) -> None:
    """Coverage measured by the first variant goes to every row; speedup = patched / baseline per test."""
    first = {r.test: r for r in next(iter(per_variant.values()), [])}
    for rows in per_variant.values():
        for r in rows:
            f = first.get(r.test)
            if f is not None and r.coverage is None:
                r.experts_used, r.coverage = f.experts_used, f.coverage
    base = {r.test: r for r in per_variant.get("baseline", [])}
    for rows in per_variant.values():
        for r in rows:
            b = base.get(r.test)
            if b and b.avg_ts and b.avg_ts == b.avg_ts and r.avg_ts == r.avg_ts:
                r.speedup = r.avg_ts / b.avg_ts


def _warn(progress: bool, e: WorkerError, then: str) -> None:
    """A worker that died or was killed (not one that reported an error): a warning on stderr, the run goes on."""
    if progress and (e.exit_code is None or e.exit_code < 0):
        print(f"\npyllama-pp: warning: {error_text(e)}; {then}", file=sys.stderr)


# -- ab: every config in a fresh worker per variant ---------------------------------------------------------------
@dataclass
class _Sweep:
    """`ab` in progress: its settings, the rows of an earlier run it may reuse, the rows so far, the progress bar."""

    variants: list[str]
    writer: RowWriter
    prev: dict                 # (config_key, variant) -> {test: Row} of an earlier run without an error (resume)
    timeout: Optional[float]
    progress: bool
    bar: Optional[tqdm]
    rows: list[Row] = field(default_factory=list)


def step_name(cfg: RunConfig, variant: str, tests: list) -> str:
    """How the progress bar names what it measures: the variant's devices, the batch sizes and the tests."""
    return (f"{devspec.parse(cfg.devices_for(variant)).label} b={cfg.n_batch} ub={min(cfg.n_ubatch, cfg.n_batch)} "
            + ",".join(test_name(t) for t in tests))


@dataclass
class _Worker:
    """The serving worker a variant measures a group's configs on (started at the first config; after one dies, a
    fresh one takes the next config)."""

    variant: str
    env: dict
    worker: Optional[ServingWorker] = None

    def run(self, job: MeasureJob, timeout: Optional[float]) -> dict:
        if self.worker is None or not self.worker.alive:
            self.close()
            self.worker = ServingWorker(self.variant, env=self.env)   # (held before it starts: a Ctrl-C kills it)
            self.worker.start()
        return self.worker.run(job, timeout=timeout)

    @property
    def pid(self) -> Optional[int]:
        return self.worker.pid if self.worker is not None else None

    def close(self, kill: bool = False) -> None:
        if self.worker is not None:
            if kill:
                self.worker.kill()
            self.worker.close()
            self.worker = None   # (only once closed: a Ctrl-C while it closes leaves it to close(kill=True))


def _measure(sweep: _Sweep, w: _Worker, cfg: RunConfig, v: str, cfg_meta: dict, coverage: bool) -> list[Row]:
    """One config's rows for `v`, test by test on the group's worker (one job and one progress step per test, in one
    context); a test that fails gives the config error rows, and a worker that dies loses no other config's rows."""
    tests, res, watch = [], None, CpuWatch()
    for i, t in enumerate(cfg.tests):
        if sweep.bar:
            sweep.bar.set_postfix_str(f"{v} {step_name(cfg, v, [t])}")
        try:
            # coverage is a property of model, tokens and ubatch, not of the variant: measured by the first one
            res = w.run(cfg.job(v, tests=[list(t)], coverage=coverage), sweep.timeout)
        except WorkerError as e:
            _warn(sweep.progress, e, "carrying on with the next run")
            if sweep.bar:
                sweep.bar.update(len(cfg.tests) - i)
            return error_rows(cfg, v, error_text(e), cfg_meta)
        tests += res["tests"]
        if sweep.bar:
            sweep.bar.update(1)
    return _watched(rows_from_result(cfg, v, {**res, "tests": tests}, cfg_meta), cfg, watch, [w.pid])


def _watched(rows: list[Row], cfg: RunConfig, watch: CpuWatch, workers: list) -> list[Row]:
    """Rows of a config run on this machine's CPU, with what other processes took of it meanwhile (not watched for
    RPC devices, whose servers' work is the measurement's)."""
    if not devspec.parse(cfg.devices).remote:
        seen = watch.stop(exclude=[pid for pid in workers if pid]).to_dict()
        for r in rows:
            r.contention = seen
    return rows


def _run_group(sweep: _Sweep, items: list[tuple[int, RunConfig]]) -> None:
    """Every variant on one group of configs that share a model load, in one serving worker per variant; each
    config's rows are written as soon as the variant measured them (Ctrl-C or a dead worker keeps them)."""
    metas = [meta(cfg) for _, cfg in items]
    per_cfg: list[dict[str, list[Row]]] = [{} for _ in items]
    for v in sweep.variants:
        w = _Worker(v, items[0][1].env)
        try:
            for k, (ci, cfg) in enumerate(items):
                old = _reusable(sweep.prev, cfg, v)
                if old is not None:
                    per_cfg[k][v] = old
                    if sweep.bar:
                        sweep.bar.update(len(cfg.tests))
                else:
                    per_cfg[k][v] = _measure(sweep, w, cfg, v, metas[k], coverage=not per_cfg[k])
                _finish_config(per_cfg[k])
                for r in per_cfg[k][v]:
                    r.config = ci
                if old is None:
                    sweep.writer.write(per_cfg[k][v])
            w.close()
        except BaseException:
            w.close(kill=True)   # (Ctrl-C, an error, even while it was closing: no waiting for a job in progress)
            raise
    for per_variant in per_cfg:
        for rows in per_variant.values():
            sweep.rows.extend(rows)


def _previous(out_dir, resume: bool) -> tuple[list[Row], dict]:
    """An earlier run's rows in out_dir (resume), and those without an error by (config_key, variant) and test."""
    prev_rows = read_rows(out_dir) if (resume and out_dir) else []
    prev: dict = {}
    for r in prev_rows:
        if r.config_key and not r.error:
            prev.setdefault((r.config_key, r.variant), {})[r.test] = r
    return prev_rows, prev


def left_to_run(configs: Sequence[RunConfig], variants: Sequence[str], out_dir: Union[str, Path]) -> int:
    """How many of the configs' runs (a config on a variant) `ab(..., resume=True)` would measure: those whose rows in
    out_dir are not all there without an error."""
    _, prev = _previous(out_dir, True)
    return sum(_reusable(prev, cfg, v) is None for cfg in configs for v in variants)


def ab(configs: Union[RunConfig, Iterable[RunConfig]], variants: Sequence[str] = VARIANTS,
       out_dir: Optional[Union[str, Path]] = None, progress: bool = True, timeout: Optional[float] = None, group: bool = True, resume: bool = False):
    """Run every config on every variant, each variant in its own worker process.

    Rows go to out_dir's results.jsonl/csv as each config's variant finishes (a crash or Ctrl-C keeps them); a
    worker that fails or dies becomes error rows of the config it was measuring and the sweep carries on (a fresh
    worker takes the next config). The progress bar steps once per row, named by its variant, devices, batch sizes
    and test.

    Args:
        configs: the RunConfigs (e.g. from `expand`).
        variants: which builds run them, in that order (default: baseline, then patched).
        out_dir: a folder for results.jsonl, results.csv and sweep.json (None: nothing written).
        progress: show a progress bar and warnings on stderr.
        timeout: seconds per worker job, one test of a config (the first of a worker includes its model load; None:
            no limit).
        group: consecutive configs that differ only in batch sizes and tests share one serving worker per variant,
            which loads the model once (a 30 GB model takes longer to load than to benchmark); each config gets a
            fresh context on it.
        resume: a config whose rows for a variant are all in out_dir's results.jsonl without an error is not
            measured again (error rows are), and the files are rewritten at the end with each row once.
    Returns:
        pandas.DataFrame: one row per config, variant and test (Row's columns), with `speedup` = patched avg_ts /
        baseline avg_ts for the same config and test; a failed run has `error` set and NaN times.
    Raises:
        OSError: when out_dir cannot be written.
        TypeError: when configs are not RunConfig objects.
    """
    configs = _as_configs(configs)
    _check_envs(configs, variants)
    prev_rows, prev = _previous(out_dir, resume)
    if out_dir:
        save_sweep(out_dir, configs, variants)
    bar = tqdm(total=sum(len(c.tests) for c in configs) * len(variants), desc="A/B" if len(variants) > 1 else
               variants[0], unit="row", dynamic_ncols=True) if progress else None
    sweep = _Sweep(list(variants), RowWriter(Path(out_dir) if out_dir else None), prev, timeout, progress, bar)
    try:
        for items in _groups(configs, group):
            _run_group(sweep, items)
    finally:
        if bar:
            bar.close()
    if resume and prev_rows:
        # each row once: this sweep's rows (reused or new), then earlier rows of configs no longer in it
        keys = {config_key(cfg) for cfg in configs}
        sweep.writer.rewrite(sweep.rows + [r for r in prev_rows if r.config_key not in keys])
    return frame(sweep.rows)


# -- interleaved: paired rounds in one serving worker per variant ---------------------------------------------------
def _merge_rounds(results: list[dict], coverage: Optional[list] = None) -> dict:
    """One variant's round results (bench jobs of one rep each) as one result of len(results) reps: times in round
    order, counters added up (rows divide them by the reps), levels as after the last round."""
    last = results[-1]
    tests = []
    for i, t in enumerate(last["tests"]):
        per = [r["tests"][i] for r in results]
        ext = functools.reduce(ext_add, (p.get("ext") for p in per), None)
        tests.append({**t, "seconds": [x for p in per for x in p["seconds"]],
                      "devices": sum_devices([p["devices"] for p in per]), "ext": ext, "reps": len(results),
                      "coverage": coverage[i] if coverage else None})
    return {"model": last["model"], "schedule": last["schedule"], "switch_defaults": last.get("switch_defaults"),
            "tests": tests}


@dataclass
class _Rounds:
    """One config's paired rounds so far: its rows are made of them, and Ctrl-C keeps their complete AB / BA pairs."""

    index: int
    cfg: RunConfig
    meta: dict
    got: dict[str, list[dict]]                              # variant -> each round's result, in order
    failed: dict[str, str] = field(default_factory=dict)    # variant -> why its worker failed
    coverage: Optional[list] = None   # per test, from the first warm-up that ran (None: none ran yet)
    groups: list[int] = field(default_factory=list)        # each round's load
    done_loads: int = 0                                     # loads whose rounds every variant ran


@dataclass
class _Paired:
    """`interleaved` in progress: its settings, one serving worker per variant, the runs in the order they happened,
    the config in progress and the rows so far."""

    variants: list[str]
    rounds: int
    warmup: int
    loads: int
    timeout: Optional[float]
    progress: bool
    seed: int
    writer: RowWriter
    bar: Optional[tqdm]
    servers: dict[str, tuple[str, ServingWorker]] = field(default_factory=dict)
    order: list[list] = field(default_factory=list)        # [config, round, variant]; round -1: a warm-up
    current: Optional[_Rounds] = None
    rows: list[Row] = field(default_factory=list)


def _server(run: _Paired, cfg: RunConfig, v: str) -> ServingWorker:
    """The variant's worker for cfg: the one running, when its environment and switches are cfg's."""
    key = json.dumps([cfg.env, cfg.switches if v == "patched" else {}], sort_keys=True, default=str)
    old = run.servers.get(v)
    if old and old[0] == key and old[1].alive:
        return old[1]
    if old:
        old[1].close()
    run.servers[v] = (key, ServingWorker(v, env=cfg.env))   # (in `servers` before it starts: a Ctrl-C kills it)
    return run.servers[v][1].start()


def _close_servers(run: _Paired, kill: bool = False) -> None:
    """Every serving worker closed (kill: first killed, no waiting for a job in progress)."""
    for _, w in run.servers.values():
        if kill:
            w.kill()
        w.close()


def _run_once(run: _Paired, cur: _Rounds, v: str, r: int, job: MeasureJob) -> Optional[dict]:
    """One job of round r (-1: the warm-up) on v's worker; None when v has failed (now or before)."""
    if v in cur.failed:
        return None
    try:
        res = _server(run, cur.cfg, v).run(job, timeout=run.timeout)
    except WorkerError as e:
        cur.failed[v] = error_text(e)
        _warn(run.progress, e, f"carrying on without {v}")
        return None
    run.order.append([cur.index, r, v])
    return res


def _warm_up(run: _Paired, cur: _Rounds, vs: list[str]) -> None:
    """Each variant's warm-up (and its model load), in the load's order; coverage measured by the first that runs."""
    if run.bar:
        run.bar.set_postfix_str(f"warm-up {step_name(cur.cfg, vs[0], cur.cfg.tests)}")
    for v in vs:
        res = _run_once(run, cur, v, -1, cur.cfg.job(v, reps=1, warmup=1, coverage=cur.coverage is None))
        if res is not None and cur.coverage is None:
            cur.coverage = [t.get("coverage") for t in res["tests"]]


def _run_rounds(run: _Paired, cur: _Rounds, load: int, vs: list[str]) -> None:
    """The load's rounds, the order alternating (vs, then vs reversed); stops early when every variant failed."""
    jobs = {v: cur.cfg.job(v, reps=1, warmup=run.warmup, coverage=False) for v in run.variants}
    of_load = f" load {load + 1}/{run.loads}" if run.loads > 1 else ""
    for r in range(run.rounds):
        if run.bar:
            run.bar.set_postfix_str(f"round {r + 1}/{run.rounds}{of_load} {step_name(cur.cfg, vs[0], cur.cfg.tests)}")
        for v in (vs if r % 2 == 0 else vs[::-1]):
            res = _run_once(run, cur, v, load * run.rounds + r, jobs[v])
            if res is not None:
                cur.got[v].append(res)
        cur.groups.append(load)
        if run.bar:
            run.bar.update(1)
        if len(cur.failed) == len(run.variants):
            break


def _end_of_load(run: _Paired, cur: _Rounds, load: int) -> bool:
    """After a load: True to go on with the next. A failure in a later load keeps the loads before it whole (a
    reload out of memory, say); in the first, the variant that failed gets error rows, the other its rounds."""
    if cur.failed and cur.done_loads:
        if run.progress:
            print(f"\npyllama-pp: warning: load {load + 1} of {run.loads} failed ({'; '.join(cur.failed.values())}); "
                  f"the rows hold the {cur.done_loads} loads before it", file=sys.stderr)
        for v in run.variants:
            cur.got[v] = cur.got[v][:cur.done_loads * run.rounds]
        cur.groups = cur.groups[:cur.done_loads * run.rounds]
        cur.failed.clear()
        return False
    if cur.failed:
        return False
    cur.done_loads += 1
    return True


def _run_config(run: _Paired, ci: int, cfg: RunConfig) -> None:
    """One config: `loads` times a warm-up and the rounds (fresh workers for every load, the variants' order reversed
    every other load), then its rows, written."""
    cur = run.current = _Rounds(ci, cfg, meta(cfg), {v: [] for v in run.variants})
    watch = CpuWatch()
    for load in range(run.loads):
        if run.loads > 1 and run.servers:   # the model loaded again, the other variant first
            _close_servers(run)
            run.servers.clear()
        vs = run.variants if load % 2 == 0 else run.variants[::-1]
        _warm_up(run, cur, vs)
        _run_rounds(run, cur, load, vs)
        if not _end_of_load(run, cur, load):
            break
    per_v = _paired_rows(cur, run.variants, cur.got, cur.failed, cur.groups, cur.done_loads, run.seed)
    _watched([r for rows in per_v.values() for r in rows], cfg, watch, [w.pid for _, w in run.servers.values()])
    run.current = None
    for v in run.variants:
        run.writer.write(per_v[v])
        run.rows.extend(per_v[v])


def _keep_interrupted(run: _Paired) -> None:
    """Ctrl-C: the config in progress keeps its complete AB / BA pairs (rounds every variant ran) as rows, once a
    warm-up has run (`rounds` on the rows says how many were kept)."""
    cur = run.current
    if cur is None or cur.coverage is None:
        return
    n = min(len(cur.got[v]) for v in run.variants) // 2 * 2
    if n < 2:
        return
    kept = {v: cur.got[v][:n] for v in run.variants}
    loads = len(set(cur.groups[:n]))
    per_v = _paired_rows(cur, run.variants, kept, {}, cur.groups[:n], loads if loads > 1 else 0, run.seed)
    for v in run.variants:
        run.writer.write(per_v[v])


def _check_paired_args(rounds, warmup, loads, variants) -> list[str]:
    """interleaved's arguments checked; its variants as a list."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be an even whole number of at least 2 (AB and BA pairs), got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of at least 0, got {warmup!r}")
    if isinstance(loads, bool) or not isinstance(loads, int) or loads < 1:
        raise ValueError(f"loads must be a whole number of at least 1, got {loads!r}")
    variants = list(variants)
    if not variants or len(set(variants)) != len(variants) or not set(variants) <= set(VARIANTS):
        raise ValueError(f"variants must be distinct names of {list(VARIANTS)}, got {variants!r}")
    return variants


def interleaved(configs: Union[RunConfig, Iterable[RunConfig]], variants: Sequence[str] = VARIANTS,
                rounds: int = PAIRED.rounds, out_dir: Optional[Union[str, Path]] = None, progress: bool = True,
                timeout: Optional[float] = None, seed: int = CONTEXT.seed, warmup: int = PAIRED.warmup,
                loads: int = PAIRED.loads):
    """A/B in paired rounds: per variant one serving worker (the model loaded once), one warm-up, then `rounds`
    rounds, each one rep of every test per variant, the order alternating ABBA (round r: `variants` in order when
    r is even, reversed when odd). Drift over time (clocks, heat, the machine's other load) then falls on both
    variants alike. A worker that fails gives its variant error rows for that config; the others go on.

    Args:
        configs: one RunConfig or several; their `reps` is not used.
        variants: distinct variant names (default: baseline, patched).
        rounds: an even number >= 2 (AB and BA pairs).
        out_dir: a folder for results.jsonl and results.csv (None: nothing written).
        progress: show a progress bar and warnings on stderr.
        timeout: seconds per job (the first of a worker includes its model load; None: no limit).
        seed: the bootstrap's seed for the confidence interval.
        warmup: untimed runs of each test before its timed one in every round (>= 0): with several tests, each
            then starts from the state llama-bench's warm-up gives it (a plan switch of the patched build, say).
        loads: >= 1; above 1, all of it is repeated with fresh workers (the model loaded again), the variants'
            order reversed every other load: where each process's memory lands moves decode speed by a few percent
            on the GPU machine. The estimate and its interval then count each load once (the geometric mean of the
            loads' medians, Student's t over them; use 5 or more loads for an interval narrower than their spread).
    Returns:
        pandas.DataFrame: `ab`'s rows (samples_ts: one sample per round, in order; avg_ts, stddev_ts, speedup =
        ratio of the averages) plus `rounds` and `loads` (complete loads: a load that fails after the first ends
        the run), and on each non-baseline variant's rows `ratios` (per round, variant t/s over baseline t/s),
        `speedup_median` and its bootstrap 95% interval `speedup_ci_lo` / `speedup_ci_hi`. df.attrs["order"]
        lists the runs as they happened, [config, round, variant] (round -1: a warm-up).
    Raises:
        TypeError: when configs are not RunConfig objects.
        ValueError: for rounds that is not even and >= 2, warmup < 0, loads < 1, or variants that are not
            distinct known names.
        OSError: when out_dir cannot be written.
    """
    cfgs = _as_configs(configs)
    variants = _check_paired_args(rounds, warmup, loads, variants)
    _check_envs(cfgs, variants)
    bar = tqdm(total=len(cfgs) * loads * rounds, desc="paired A/B", unit="round", dynamic_ncols=True) \
        if progress else None
    run = _Paired(variants, rounds, warmup, loads, timeout, progress, seed,
                  RowWriter(Path(out_dir) if out_dir else None), bar)
    done = False
    try:
        for ci, cfg in enumerate(cfgs):
            _run_config(run, ci, cfg)
        done = True
    except KeyboardInterrupt:
        _keep_interrupted(run)
        raise
    finally:
        _close_servers(run, kill=not done)   # (Ctrl-C, an error: no waiting for a job in progress)
        if bar:
            bar.close()
    df = frame(run.rows)
    df.attrs["order"] = run.order
    return df


def _paired_rows(cur: _Rounds, variants: Sequence[str], got: dict, failed: dict, groups: list, done_loads: int,
                 seed: int) -> dict[str, list[Row]]:
    """One config's rows of a paired run: each variant's rounds merged, the paired speedup with its interval
    (`groups`: the load of each round; with done_loads > 1 the interval counts each load once)."""
    merged = {v: _merge_rounds(got[v], cur.coverage) for v in variants if v not in failed}
    per_v = {v: rows_from_result(cur.cfg, v, merged[v], cur.meta) if v in merged else
             error_rows(cur.cfg, v, failed[v], cur.meta) for v in variants}
    _finish_config(per_v)
    for v, rows in per_v.items():
        for i, row in enumerate(rows):
            row.config = cur.index
            if v not in merged:
                continue
            row.rounds = len(got[v])
            row.loads = max(done_loads, 1)
            if v == "baseline" or "baseline" not in merged:
                continue
            sb, sv = merged["baseline"]["tests"][i]["seconds"], merged[v]["tests"][i]["seconds"]
            ratios = [x / y if y > 0 else float("nan") for x, y in zip(sb, sv)]   # (t/s: n/y over n/x)
            # (both variants ran every round while neither failed: groups line up with the ratios)
            med, lo, hi = paired_ci(ratios, seed=seed, groups=groups[:len(ratios)] if done_loads > 1 else None)
            row.ratios, row.speedup_median, row.speedup_ci_lo, row.speedup_ci_hi = ratios, med, lo, hi
    return per_v


# a server's mixed load in one context (`pyllama-pp run/ab --workload mixed`, defaults.WORKLOADS)
MIXED_WORKLOAD = Workload.parse("mixed").as_list()


def workload_ctx(workload: list, n_ctx: Optional[int] = None) -> int:
    """n_ctx for a workload: a prompt starts from an empty cache, decode steps continue after the last prompt (or
    from position 0), so the longest prompt plus every decoded token."""
    return ctx_for(max((n for k, n in workload if k == "pp"), default=0) + sum(n for k, n in workload if k == "tg") + 8,
                   n_ctx)


def mixed_workload(configs: Union[RunConfig, Iterable[RunConfig]], variants: Sequence[str] = VARIANTS,
                   rounds: int = RUN.reps, workload: Optional[list] = None, timeout: Optional[float] = None,
                   out_dir: Optional[Union[str, Path]] = None):
    """Run `workload` `rounds` times in one context per variant (its own worker), for each configuration.

    Args:
        configs: one RunConfig or several (their tests are not used; the context is sized for the workload).
        variants: which builds run it.
        rounds: how many times the workload runs in the one context.
        workload: a Workload, or steps ["pp" or "tg", tokens] (default MIXED_WORKLOAD).
        timeout: seconds per worker.
        out_dir: a folder for results.jsonl and results.csv, written as each variant finishes (None: nothing).
    Returns:
        pandas.DataFrame: Row's columns, one row per config, variant and step: `config` (its index), `test`
        ("r2 pp512"), `avg_ts`, `speedup` (patched over baseline, same step), `re_reservations` and `plan_switches`
        (patched build), `host_syncs`, bytes per device; a variant whose worker failed has one row with `error` set.
    Raises:
        ConfigError: for rounds < 1 or a malformed workload.
        TypeError: when configs are not RunConfig objects.
        OSError: when out_dir cannot be written.
    """
    cfgs = _as_configs(configs)
    workload = MIXED_WORKLOAD if workload is None else workload.as_list() if isinstance(workload, Workload) else workload
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be a whole number of at least 1, got {rounds!r}")
    bad = [st for st in workload if not (isinstance(st, (list, tuple)) and len(st) == 2 and st[0] in ("pp", "tg")
                                         and isinstance(st[1], int) and not isinstance(st[1], bool) and st[1] >= 1)]
    if not workload or bad:
        raise ConfigError(f"a workload is a non-empty list of steps [\"pp\" or \"tg\", tokens >= 1], such as "
                          f"{MIXED_WORKLOAD}; got {bad[0] if bad else workload!r}")
    _check_envs(cfgs, variants)
    writer, rows = RowWriter(Path(out_dir) if out_dir else None), []
    for ci, cfg in enumerate(cfgs):
        rows += _workload_rows(ci, cfg, variants, rounds, workload, timeout, writer)
    return frame(rows)


def _workload_rows(ci: int, cfg: RunConfig, variants: Sequence[str], rounds: int, workload: list,
                   timeout: Optional[float], writer: RowWriter) -> list[Row]:
    """One config's workload rows, each variant's written as soon as it ran."""
    ctx = dataclasses.replace(cfg.context(), n_ctx=workload_ctx(workload, cfg.n_ctx))
    cfg_meta = meta(cfg)
    rows: list[Row] = []
    for v in variants:
        bj = cfg.job(v)
        job = WorkloadJob(variant=v, model=bj.model, devices=bj.devices, placement=bj.placement, ctx=ctx,
                          switches=bj.switches, workload=[list(st) for st in workload], rounds=rounds)
        pl = cfg.placement_for(v)
        common = dict(variant=v, model=Path(cfg.model).name, devices=cfg.devices_for(v), host_experts=pl.label,
                      tensor_buft_overrides=";".join(pl.all_overrides()), n_ctx=ctx.n_ctx, n_batch=cfg.n_batch,
                      n_ubatch=ctx.n_ubatch, config=ci, **cfg_meta)
        try:
            res = run_job(job, v, timeout=timeout, env=cfg.env)
        except WorkerError as e:
            mine = [Row(test="workload", error=error_text(e)[:2000], **common)]
        else:
            set_ = switches.of_run(cfg.env, bj.switches, res.get("switch_defaults")) if v == "patched" else {}
            mine = [Row(**common, **workload_step_row(st, res), seconds=st["seconds"], switches=set_)
                    for st in res["steps"]]
        base = {r.test: r.avg_ts for r in rows if r.variant == "baseline" and not r.error}
        for r in mine:
            if r.variant == "patched" and base.get(r.test):
                r.speedup = r.avg_ts / base[r.test]
        writer.write(mine)
        rows += mine
    return rows
