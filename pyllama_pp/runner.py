"""The A/B runner: configurations (pyllama_pp.config) run on the baseline and the patched build.

`ab` runs every configuration in a fresh worker process per variant (same model, placement, batch sizes and load
mode for both), appends rows to JSONL/CSV as they come (a crash or Ctrl-C loses nothing already measured) and turns
a worker that dies into error rows. `interleaved` runs the variants round by round instead (one serving worker each,
the model loaded once, ABBA order): drift over time then hits both alike, and each round's ratio gives a paired
speedup with a confidence interval. `mixed_workload` runs a server's mixed load in one context per variant.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from tqdm import tqdm

from .binding import VARIANTS
from .config import RunConfig, config_key, load_key
from .params import ctx_for
from .counters import ext_add, sum_devices
from .defaults import CONTEXT, PAIRED, RUN
from .errors import ConfigError, WorkerError
from .jobs import MeasureJob, WorkloadJob, test_name
from .row import Row, RowWriter, frame, read_rows
from .rows import error_rows, error_text, meta, rows_from_result, workload_step_row
from .stats import paired_ci
from .worker.client import ServingWorker, check_switch_env, run_job

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


def ab(configs: Union[RunConfig, Iterable[RunConfig]], variants: Sequence[str] = VARIANTS, out_dir: Optional[Union[str, Path]] = None,
       progress: bool = True, timeout: Optional[float] = None, group: bool = True, resume: bool = False):
    """Run every config on every variant, each variant in its own worker process.

    Rows go to out_dir's results.jsonl/csv as each variant finishes (a crash or Ctrl-C keeps them); a worker that
    fails or dies becomes error rows and the sweep carries on.

    Args:
        configs: the RunConfigs (e.g. from `expand`).
        variants: which builds run them, in that order (default: baseline, then patched).
        out_dir: a folder for results.jsonl, results.csv and sweep.json (None: nothing written).
        progress: show a progress bar and warnings on stderr.
        timeout: seconds per worker job (None: no limit).
        group: consecutive configs that differ only in batch sizes and tests share one worker per variant, which
            loads the model once (a 30 GB model takes longer to load than to benchmark).
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
    writer = RowWriter(Path(out_dir) if out_dir else None)
    prev_rows = read_rows(out_dir) if (resume and out_dir) else []
    prev: dict = {}
    for r in prev_rows:
        if r.config_key and not r.error:
            prev.setdefault((r.config_key, r.variant), {})[r.test] = r
    if out_dir:
        save_sweep(out_dir, configs, variants)
    bar = tqdm(total=len(configs) * len(variants), desc="A/B" if len(variants) > 1 else variants[0],
               unit="run", dynamic_ncols=True) if progress else None
    all_rows: list[Row] = []
    try:
        for grp in _groups(configs, group):
            metas = [meta(cfg) for _, cfg in grp]
            per_cfg: list[dict[str, list[Row]]] = [{} for _ in grp]
            for v in variants:
                todo = []
                for k, (_, cfg) in enumerate(grp):
                    old = _reusable(prev, cfg, v)
                    if old is None:
                        todo.append(k)
                    else:
                        per_cfg[k][v] = old
                if todo:
                    sub = [grp[k] for k in todo]
                    lead = sub[0][1]
                    if bar:
                        bar.set_postfix_str(f"{v} {lead.devices} ub={','.join(str(c.n_ubatch) for _, c in sub)}")
                    # the switches are the patched build's; coverage is a property of model, tokens and ubatch,
                    # not of the variant: measure it once
                    job = lead.job(v, coverage=not any(per_cfg[k] for k in todo),
                                   ctx_list=[{"ctx": cfg.context().to_dict(), "tests": cfg.tests} for _, cfg in sub]
                                   if len(sub) > 1 else None)
                    try:
                        res = run_job(job, v, timeout=timeout, env=lead.env)
                        runs = res["runs"] if len(sub) > 1 else [res]
                        for j, k in enumerate(todo):
                            cfg, run = grp[k][1], runs[j]
                            per_cfg[k][v] = (error_rows(cfg, v, run["error"], metas[k]) if "error" in run else
                                             rows_from_result(cfg, v, {"model": res["model"], **run}, metas[k]))
                    except WorkerError as e:
                        if progress and (e.exit_code is None or e.exit_code < 0):
                            print(f"\npyllama-pp: warning: {error_text(e)}; carrying on with the next run",
                                  file=sys.stderr)
                        for k in todo:
                            per_cfg[k][v] = error_rows(grp[k][1], v, error_text(e), metas[k])
                if bar:
                    bar.update(len(grp))
                for k, (ci, _) in enumerate(grp):
                    _finish_config(per_cfg[k])
                    for r in per_cfg[k][v]:
                        r.config = ci
                    if k in todo:
                        writer.write(per_cfg[k][v])   # as soon as measured: Ctrl-C in the next variant keeps them
            for k in range(len(grp)):
                for rows in per_cfg[k].values():
                    all_rows.extend(rows)
    finally:
        if bar:
            bar.close()
    if resume and prev_rows:
        # each row once: this sweep's rows (reused or new), then earlier rows of configs no longer in it
        keys = {config_key(cfg) for cfg in configs}
        writer.rewrite(all_rows + [r for r in prev_rows if r.config_key not in keys])
    return frame(all_rows)


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
    return {"model": last["model"], "schedule": last["schedule"], "tests": tests}


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
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be an even whole number of at least 2 (AB and BA pairs), got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of at least 0, got {warmup!r}")
    if isinstance(loads, bool) or not isinstance(loads, int) or loads < 1:
        raise ValueError(f"loads must be a whole number of at least 1, got {loads!r}")
    variants = list(variants)
    if not variants or len(set(variants)) != len(variants) or not set(variants) <= set(VARIANTS):
        raise ValueError(f"variants must be distinct names of {list(VARIANTS)}, got {variants!r}")
    _check_envs(cfgs, variants)
    writer = RowWriter(Path(out_dir) if out_dir else None)
    bar = tqdm(total=len(cfgs) * loads * (rounds + 1), desc="paired A/B", unit="round",
               dynamic_ncols=True) if progress else None
    servers: dict[str, tuple[str, ServingWorker]] = {}
    order: list[list] = []
    all_rows: list[Row] = []
    done = False
    current = None   # the config in progress (for Ctrl-C: its complete rounds are kept)

    def server(cfg: RunConfig, v: str) -> ServingWorker:
        """The variant's worker for cfg: the one running, when its environment and switches are cfg's."""
        key = json.dumps([cfg.env, cfg.switches if v == "patched" else {}], sort_keys=True, default=str)
        old = servers.get(v)
        if old and old[0] == key and old[1].alive:
            return old[1]
        if old:
            old[1].close()
        servers[v] = (key, ServingWorker(v, env=cfg.env))   # (in `servers` before it starts: a Ctrl-C kills it)
        return servers[v][1].start()

    try:
        for ci, cfg in enumerate(cfgs):
            cfg_meta = meta(cfg)
            failed: dict[str, str] = {}
            got: dict[str, list[dict]] = {v: [] for v in variants}
            coverage = None

            def run(v: str, r: int, job: MeasureJob) -> Optional[dict]:
                if v in failed:
                    return None
                try:
                    res = server(cfg, v).run(job, timeout=timeout)
                except WorkerError as e:
                    failed[v] = error_text(e)
                    if progress and (e.exit_code is None or e.exit_code < 0):
                        print(f"\npyllama-pp: warning: {error_text(e)}; carrying on without {v}", file=sys.stderr)
                    return None
                order.append([ci, r, v])
                return res

            jobs = {v: cfg.job(v, reps=1, warmup=warmup, coverage=False) for v in variants}
            groups: list[int] = []
            done_loads = 0   # loads whose rounds every variant ran
            current = (ci, cfg, cfg_meta, got, groups)
            for load in range(loads):
                if loads > 1 and servers:   # fresh workers for every load: the model loaded again, the other variant first
                    for _, w in servers.values():
                        w.close()
                    servers.clear()
                vs = variants if load % 2 == 0 else variants[::-1]
                for v in vs:   # the warm-up (and the model load); coverage measured once
                    res = run(v, -1, cfg.job(v, reps=1, warmup=1, coverage=coverage is None))
                    if res is not None and coverage is None:
                        coverage = [t.get("coverage") for t in res["tests"]]
                        current = (ci, cfg, cfg_meta, got, groups, coverage)
                if bar:
                    bar.update(1)
                for r in range(rounds):
                    for v in (vs if r % 2 == 0 else vs[::-1]):
                        res = run(v, load * rounds + r, jobs[v])
                        if res is not None:
                            got[v].append(res)
                    groups.append(load)
                    if bar:
                        bar.update(1)
                    if len(failed) == len(variants):
                        break
                if failed and done_loads:
                    # a later load failed (out of memory on reloading, say): keep the loads before it whole
                    if progress:
                        print(f"\npyllama-pp: warning: load {load + 1} of {loads} failed "
                              f"({'; '.join(failed.values())}); the rows hold the {done_loads} loads before it",
                              file=sys.stderr)
                    for v in variants:
                        got[v] = got[v][:done_loads * rounds]
                    groups = groups[:done_loads * rounds]
                    failed.clear()
                    break
                if failed:   # (in the first load: the variant that failed gets error rows, the other its rounds)
                    break
                done_loads += 1
            per_v = _paired_rows(ci, cfg, cfg_meta, variants, got, failed, coverage, groups, done_loads, seed)
            current = None
            for v in variants:
                writer.write(per_v[v])
                all_rows.extend(per_v[v])
        done = True
    except KeyboardInterrupt:
        # Ctrl-C: the config in progress keeps its complete AB/BA pairs (rounds both variants ran), as rows
        if current is not None and len(current) == 6:
            ci, cfg, cfg_meta, got, groups, coverage = current
            n = min(len(got[v]) for v in variants) // 2 * 2
            if n >= 2:
                kept = {v: got[v][:n] for v in variants}
                per_v = _paired_rows(ci, cfg, cfg_meta, variants, kept, {}, coverage, groups[:n],
                                     len(set(groups[:n])) if len(set(groups[:n])) > 1 else 0, seed)
                for v in variants:   # (`rounds` on the rows says how many were kept)
                    writer.write(per_v[v])
        raise
    finally:
        for _, w in servers.values():
            if not done:   # (Ctrl-C, an error: no waiting for a job in progress)
                w.kill()
            w.close()
        if bar:
            bar.close()
    df = frame(all_rows)
    df.attrs["order"] = order
    return df


def _paired_rows(ci: int, cfg: RunConfig, cfg_meta: dict, variants: Sequence[str], got: dict, failed: dict,
                 coverage, groups: list, done_loads: int, seed: int) -> dict[str, list[Row]]:
    """One config's rows of a paired run: each variant's rounds merged, the paired speedup with its interval
    (`groups`: the load of each round; with done_loads > 1 the interval counts each load once)."""
    merged = {v: _merge_rounds(got[v], coverage) for v in variants if v not in failed}
    per_v = {v: rows_from_result(cfg, v, merged[v], cfg_meta) if v in merged else
             error_rows(cfg, v, failed[v], cfg_meta) for v in variants}
    _finish_config(per_v)
    for v, rows in per_v.items():
        for i, row in enumerate(rows):
            row.config = ci
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


# a server's mixed load in one context (`pyllama-pp run/ab --workload mixed`): prompts of alternating
# lengths, each from an empty cache, then decoding right after the last one
MIXED_WORKLOAD = [["pp", 64], ["pp", 512], ["pp", 128], ["pp", 2048], ["tg", 16]]


def workload_ctx(workload: list, n_ctx: Optional[int] = None) -> int:
    """n_ctx for a workload: a prompt starts from an empty cache, decode steps continue after the last prompt (or
    from position 0), so the longest prompt plus every decoded token."""
    return ctx_for(max((n for k, n in workload if k == "pp"), default=0) + sum(n for k, n in workload if k == "tg") + 8,
                   n_ctx)


def mixed_workload(cfg: RunConfig, variants: Sequence[str] = VARIANTS, rounds: int = RUN.reps,
                   workload: Optional[list] = None, timeout: Optional[float] = None):
    """Run `workload` `rounds` times in one context per variant (its own worker).

    Args:
        cfg: the configuration (its tests are not used; its context is sized for the workload).
        variants: which builds run it.
        rounds: how many times the workload runs in the one context.
        workload: steps ["pp" or "tg", tokens] (default MIXED_WORKLOAD).
        timeout: seconds per worker.
    Returns:
        pandas.DataFrame: Row's columns, one row per variant and step: `test` ("r2 pp512"), `avg_ts`, `speedup`
        (patched over baseline, same step), `re_reservations` and `plan_switches` (patched build), `host_syncs`,
        bytes per device; a variant whose worker failed has one row with `error` set.
    Raises:
        ConfigError: for rounds < 1 or a malformed workload.
    """
    workload = MIXED_WORKLOAD if workload is None else workload
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be a whole number of at least 1, got {rounds!r}")
    bad = [st for st in workload if not (isinstance(st, (list, tuple)) and len(st) == 2 and st[0] in ("pp", "tg")
                                         and isinstance(st[1], int) and not isinstance(st[1], bool) and st[1] >= 1)]
    if not workload or bad:
        raise ConfigError(f"a workload is a non-empty list of steps [\"pp\" or \"tg\", tokens >= 1], such as "
                          f"{MIXED_WORKLOAD}; got {bad[0] if bad else workload!r}")
    _check_envs([cfg], variants)
    ctx = dataclasses.replace(cfg.context(), n_ctx=workload_ctx(workload, cfg.n_ctx))
    cfg_meta = meta(cfg)
    rows: list[Row] = []
    for v in variants:
        bj = cfg.job(v)
        job = WorkloadJob(variant=v, model=bj.model, devices=bj.devices, placement=bj.placement, ctx=ctx,
                          switches=bj.switches, workload=[list(st) for st in workload], rounds=rounds)
        pl = cfg.placement_for(v)
        try:
            res = run_job(job, v, timeout=timeout, env=cfg.env)
        except WorkerError as e:
            rows.append(Row(variant=v, devices=cfg.devices_for(v), host_experts=pl.label, test="workload",
                            error=error_text(e)[:2000], **cfg_meta))
            continue
        for st in res["steps"]:
            rows.append(Row(variant=v, model=Path(cfg.model).name, devices=cfg.devices_for(v), host_experts=pl.label,
                            n_ctx=ctx.n_ctx, n_batch=cfg.n_batch, n_ubatch=ctx.n_ubatch, **workload_step_row(st, res),
                            seconds=st["seconds"], switches=bj.switches, **cfg_meta))
    base = {r.test: r.avg_ts for r in rows if r.variant == "baseline" and not r.error}
    for r in rows:
        if r.variant == "patched" and base.get(r.test):
            r.speedup = r.avg_ts / base[r.test]
    return frame(rows)
