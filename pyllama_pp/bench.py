"""The A/B runner: llama-bench-like configurations run on the baseline and the patched build.

Configurations are crossed like llama-bench's comma-separated values; every configuration runs in a
fresh worker process per variant (same model, placement, batch sizes and load mode for both), rows are
appended to JSONL/CSV as they come (a crash or Ctrl-C loses nothing already measured), and a worker
that dies becomes an error row.

`interleaved` runs the variants round by round instead (one serving worker each, the model loaded once, ABBA
order): drift over time then hits both alike, and each round's ratio gives a paired speedup with a confidence
interval.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from . import devices as devspec
from .binding import VARIANTS
from .errors import WorkerError
from .jobs import BenchJob, WorkloadJob
from .session import ContextParams, Placement
from .measure import (ROW_FIELDS, _link_bound, _meta, config_key, _per_gpu, _pipe_bound, _test_name, ctx_for, error_rows,   # noqa: F401
                      error_text, nmse, rows_from_result, workload_step_row)
from .report import RowWriter, fmt_bytes, markdown, num, plot, read_rows   # noqa: F401  (bench.markdown etc. as before)
from .worker import ServingWorker, _ext_add, _sum_devices, depth_of, run_job


@dataclass
class BenchConfig:
    """One point of the test matrix (both variants run it)."""

    model: str
    devices: str = "cpu"
    n_batch: int = 512
    n_ubatch: int = 32
    n_ctx: int = 0                      # 0: enough for the longest test
    host_experts: Union[str, int] = "all"
    tensor_split: Optional[list] = None          # layer proportions per device (llama's -ts)
    load_mode: str = "none"
    n_gpu_layers: int = -1
    flash_attn: int = 1
    tests: list = field(default_factory=lambda: [["pp", 512]])
    reps: int = 3
    ext_params: dict = field(default_factory=dict)   # patched-only switches (GGML_SCHED_PP_*)
    env: dict = field(default_factory=dict)          # environment for both workers (e.g. GGML_OP_OFFLOAD_MIN_BATCH)
    label: str = ""
    # host->device bandwidth of each device's link in GB/s, for devices that do not say (CUDA): gives rows a
    # bound; shared_link: all devices share one link (one GPU split in two)
    link_gbps: Optional[list] = None
    shared_link: bool = False
    plans: dict = field(default_factory=dict)        # variant -> placement from a fit plan (run/ab --plan, --fit)

    def __post_init__(self):
        if self.link_gbps is not None:
            if not isinstance(self.link_gbps, (list, tuple)):
                raise ValueError(f"link_gbps takes a list of rates, one per device (e.g. [55, 55]), not {self.link_gbps!r}")
            rates = [devspec.parse_rate(x) for x in self.link_gbps]
            if any(r <= 0 for r in rates):
                raise ValueError(f"link_gbps: every rate must be > 0, got {self.link_gbps!r}")
            self.link_gbps = rates

    def job(self) -> BenchJob:
        """The worker job that runs this config (the patched build's switches are added per variant)."""
        longest = max(int(t[1]) + depth_of(t) for t in self.tests) + 8
        n_ctx = ctx_for(longest, self.n_ctx)
        return BenchJob(model=self.model, devices=self.devices, tests=[list(t) for t in self.tests], reps=self.reps,
                        # ("plan" / "fit": a label; each variant's placement then comes from self.plans)
                        placement=Placement(host_experts="none" if self.plans else self.host_experts,
                                            load_mode=self.load_mode,
                                            n_gpu_layers=self.n_gpu_layers, tensor_split=self.tensor_split),
                        ctx=ContextParams(n_ctx=n_ctx, n_batch=self.n_batch, n_ubatch=min(self.n_ubatch, self.n_batch),
                                          flash_attn=self.flash_attn))


def expand(model: str, devices: Sequence[str] = ("cpu",), n_batch: Sequence[int] = (512,),
           n_ubatch: Sequence[int] = (32,), host_experts: Sequence = ("all",), **common) -> list[BenchConfig]:
    """Cross the given lists like llama-bench; `common` goes to every BenchConfig."""
    out = []
    for dev, nb, nub, he in itertools.product(devices, n_batch, n_ubatch, host_experts):
        if nub > nb:
            continue
        out.append(BenchConfig(model=model, devices=dev, n_batch=nb, n_ubatch=nub, host_experts=he, **common))
    return out


SWEEP_FILE = "sweep.json"


def save_sweep(out_dir: Union[str, Path], configs: list[BenchConfig], variants: Sequence[str]) -> None:
    """DIR/sweep.json: the configs and variants of a sweep, so that `--resume DIR` can finish it."""
    path = Path(out_dir) / SWEEP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"variants": list(variants), "configs": [dataclasses.asdict(c) for c in configs]},
                               indent=1, default=str))


def load_sweep(out_dir: Union[str, Path]) -> tuple[list[BenchConfig], list[str]]:
    """The configs and variants saved by save_sweep (a ConfigError when DIR holds no sweep)."""
    from .errors import ConfigError
    path = Path(out_dir) / SWEEP_FILE
    if not Path(out_dir).is_dir():
        raise ConfigError(f"--resume {out_dir}: no such folder (give the -o folder of the sweep to continue)")
    try:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(BenchConfig)}
        configs = [BenchConfig(**{k: v for k, v in c.items() if k in names}) for c in data["configs"]]
        variants = [v for v in data["variants"] if v in VARIANTS]
    except OSError:
        raise ConfigError(f"--resume {out_dir}: the folder has no {SWEEP_FILE} (only sweeps written by `pyllama-pp "
                          "run/ab -o DIR` can be resumed)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {out_dir}: {path.name} is damaged ({e}); start the sweep again") from None
    if not configs or not variants:
        raise ConfigError(f"--resume {out_dir}: {path.name} lists no configs or variants; start the sweep again")
    return configs, variants


def _reusable(prev: dict, cfg: BenchConfig, variant: str) -> Optional[list[dict]]:
    """A config's rows for `variant` from an earlier run of the sweep when every test has one without an error."""
    got = prev.get((config_key(cfg), variant), {})
    names = [_test_name(t[0], int(t[1]), depth_of(t)) for t in cfg.tests]
    if not all(n in got for n in names):
        return None
    return [dict(got[n]) for n in names]


def _load_key(cfg: BenchConfig) -> str:
    """Configs with the same key can share one loaded model (they differ only in context and tests)."""
    job = {k: v for k, v in cfg.job().to_dict().items() if k not in ("ctx", "tests")}
    return json.dumps([job, cfg.env, cfg.ext_params, cfg.plans], sort_keys=True, default=str)


def _groups(configs: list[BenchConfig], group: bool) -> list[list[tuple[int, BenchConfig]]]:
    out: list[list[tuple[int, BenchConfig]]] = []
    for ci, cfg in enumerate(configs):
        if group and out and _load_key(out[-1][0][1]) == _load_key(cfg):
            out[-1].append((ci, cfg))
        else:
            out.append([(ci, cfg)])
    return out


def _finish_config(per_variant: dict[str, list[dict]]) -> None:
    """Coverage measured by the first variant goes to every row; speedup = patched / baseline per test."""
    first = {r["test"]: r for r in next(iter(per_variant.values()), [])}
    for rows in per_variant.values():
        for r in rows:
            f = first.get(r["test"])
            if f is not None and r.get("coverage") is None:
                r["experts_used"], r["coverage"] = f.get("experts_used"), f.get("coverage")
    base = {r["test"]: r for r in per_variant.get("baseline", [])}
    for rows in per_variant.values():
        for r in rows:
            b = base.get(r["test"])
            if b and b.get("avg_ts") and b["avg_ts"] == b["avg_ts"] and r.get("avg_ts") == r.get("avg_ts"):
                r["speedup"] = r["avg_ts"] / b["avg_ts"]


def _variant_job(cfg: BenchConfig, variant: str, **fields) -> BenchJob:
    """cfg's job as `variant` runs it: the switches are the patched build's; --plan / --fit: its own placement."""
    job = dataclasses.replace(cfg.job(), ext_params=dict(cfg.ext_params) if variant == "patched" else {}, **fields)
    if variant in cfg.plans:
        job = dataclasses.replace(job, placement=Placement(**{**cfg.plans[variant], "load_mode": cfg.load_mode}))
    return job


def ab(configs: Iterable[BenchConfig], variants: Sequence[str] = VARIANTS, out_dir: Optional[Union[str, Path]] = None,
       progress: bool = True, timeout: Optional[float] = None, group: bool = True, resume: bool = False):
    """Run every config on every variant (each in its own worker); return a pandas DataFrame of rows with
    `speedup` = patched avg_ts / baseline avg_ts for the same config and test.

    With `group` (default), consecutive configs that differ only in batch sizes and tests share one worker
    per variant, which loads the model once (a 30 GB model takes longer to load than to benchmark).

    Rows go to out_dir's results.jsonl/csv as each variant finishes (a crash or Ctrl-C keeps them); a worker that
    dies becomes error rows and the sweep carries on. With `resume`, a config whose rows for a variant are all in
    out_dir's results.jsonl without an error is not measured again (error rows are), and the files are rewritten
    at the end with each row once."""
    import pandas as pd

    configs = list(configs)
    writer = RowWriter(Path(out_dir) if out_dir else None)
    prev_rows = read_rows(out_dir) if (resume and out_dir) else []
    prev: dict = {}
    for r in prev_rows:
        if r.get("config_key") and not r.get("error"):
            prev.setdefault((r["config_key"], r.get("variant")), {})[r.get("test")] = r
    if out_dir:
        save_sweep(out_dir, configs, variants)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(configs) * len(variants), desc="A/B" if len(variants) > 1 else variants[0],
                       unit="run", dynamic_ncols=True)
        except ImportError:
            bar = None
    all_rows: list[dict] = []
    try:
        for grp in _groups(configs, group):
            metas = [_meta(cfg) for _, cfg in grp]
            per_cfg: list[dict[str, list[dict]]] = [{} for _ in grp]
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
                    job = _variant_job(
                        lead, v, coverage=not any(per_cfg[k] for k in todo),
                        ctx_list=[{"ctx": cfg.job().ctx.to_dict(), "tests": cfg.tests} for _, cfg in sub]
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
                        r["config"] = ci
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
        writer.rewrite(all_rows + [r for r in prev_rows if r.get("config_key") not in keys])
    df = pd.DataFrame(all_rows)
    for col in ROW_FIELDS:
        if col not in df.columns:
            df[col] = None
    return df


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (m * (b - m) * x / ((a - 1.0 + 2 * m) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 1.0 + 2 * m))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return h


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p in (0, 1), df >= 1), by bisection on its CDF (the regularized incomplete beta
    function): the paired interval over few loads needs it, and numpy has no t distribution."""
    import math
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p!r}, df={df!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    a, b = df / 2.0, 0.5

    def cdf(t: float) -> float:
        x = df / (df + t * t)
        front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
        ibeta = front * _betacf(a, b, x) / a if x < (a + 1.0) / (a + b + 2.0) else 1.0 - front * _betacf(b, a, 1.0 - x) / b
        return 1.0 - 0.5 * ibeta

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def paired_ci(ratios: Sequence[float], level: float = 0.95, n_boot: int = 10_000, seed: int = 0,
              groups: Optional[Sequence] = None) -> tuple:
    """The median speedup of ABBA rounds and its confidence interval: (median, lo, hi).

    `ratios` are per round, in round order; rounds 2k and 2k+1 ran the variants in opposite orders, so an advantage
    of running first falls on both: each such pair counts as one sample, the geometric mean of its two ratios (an
    unmatched last round is left out). The interval resamples those pairs (`n_boot` times, percentile method,
    fixed seed). NaN for no complete pair.

    `groups` (one label per round, e.g. the model load the round ran in), two or more of them: what differs between
    loads (where each process's memory landed) is shared by every pair of a load, so each load counts once: the
    estimate is the geometric mean of the loads' medians and the interval Student's t over them (K - 1 degrees of
    freedom; a bootstrap over 2-5 loads would be about as wide as their spread, far below its nominal level). A pair
    never spans two groups."""
    import math

    import numpy as np
    r = np.asarray(list(ratios), dtype=np.float64)
    g = np.zeros(r.size, dtype=np.int64) if groups is None else np.unique(np.asarray(list(groups)), return_inverse=True)[1]
    if g.size != r.size:
        raise ValueError(f"groups must label every round: {g.size} labels for {r.size} rounds")
    xs = []
    for k in np.unique(g):
        rk = r[g == k]
        n = rk.size // 2
        x = np.sqrt(rk[0:2 * n:2] * rk[1:2 * n:2])
        x = x[np.isfinite(x)]
        if x.size:
            xs.append(x)
    if not xs:
        return float("nan"), float("nan"), float("nan")
    if len(xs) >= 2:
        m = np.log([float(np.median(x)) for x in xs])
        half = t_quantile((1 + level) / 2, m.size - 1) * float(m.std(ddof=1)) / math.sqrt(m.size)
        return float(np.exp(m.mean())), float(np.exp(m.mean() - half)), float(np.exp(m.mean() + half))
    x = xs[0]
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, (n_boot, x.size))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(x)), float(lo), float(hi)


def _merge_rounds(results: list[dict], coverage: Optional[list] = None) -> dict:
    """One variant's round results (bench jobs of one rep each) as one result of len(results) reps: times in round
    order, counters added up (rows divide them by the reps), levels as after the last round."""
    last = results[-1]
    tests = []
    for i, t in enumerate(last["tests"]):
        per = [r["tests"][i] for r in results]
        ext = functools.reduce(_ext_add, (p.get("ext") for p in per), None)
        tests.append({**t, "seconds": [x for p in per for x in p["seconds"]],
                      "devices": _sum_devices([p["devices"] for p in per]), "ext": ext, "reps": len(results),
                      "coverage": coverage[i] if coverage else None})
    return {"model": last["model"], "schedule": last["schedule"], "tests": tests}


def interleaved(configs: Union[BenchConfig, Iterable[BenchConfig]], variants: Sequence[str] = VARIANTS,
                rounds: int = 20, out_dir: Optional[Union[str, Path]] = None, progress: bool = True,
                timeout: Optional[float] = None, seed: int = 0, warmup: int = 0, loads: int = 1):
    """A/B in paired rounds: per variant one serving worker (the model loaded once), one warm-up, then `rounds`
    rounds, each one rep of every test per variant, the order alternating ABBA (round r: `variants` in order when
    r is even, reversed when odd). Drift over time (clocks, heat, the machine's other load) then falls on both
    variants alike.

    Returns `ab`'s rows (samples_ts: one sample per round, in order; avg_ts, stddev_ts, speedup = ratio of the
    averages) plus `rounds`, and on each variant's rows other than the baseline's the paired statistics of its
    tests: `ratios` (per round, variant t/s over baseline t/s), `speedup_median` (over the AB / BA pairs of rounds)
    and its bootstrap 95% interval `speedup_ci_lo` / `speedup_ci_hi` (paired_ci, `seed`). df.attrs["order"] lists
    the runs as they happened, [config, round, variant] (round -1: the warm-up). `reps` of the configs is not used; `timeout` holds for each
    job (the first of a worker includes its model load). A worker that fails gives its variant error rows for that
    config; the others go on.

    In a round each test follows the one before it (the last round's last test for the first): with several tests,
    `warmup` untimed runs of each test before its timed one give each the state llama-bench's warm-up gives it (a
    plan switch of the patched build, say), for that many times the time.

    `loads` > 1 repeats all that with fresh workers (the model loaded again) `loads` times, the variants' order
    (of loading, and in round 0) reversed every other load: where each process's memory lands moves decode speed by
    a few percent on the GPU machine, more than the variants differ there. The rows then pool the rounds of every
    load (`rounds` = loads x rounds) and the estimate and its interval count each load once (paired_ci's groups:
    the geometric mean of the loads' medians, Student's t over them; use 5 or more loads for an interval narrower
    than the loads' spread); `loads` on the rows is the number of complete loads (a load that fails after the
    first ends the run: the rows hold the loads before it)."""
    import pandas as pd

    cfgs = [configs] if isinstance(configs, BenchConfig) else list(configs)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be an even whole number of at least 2 (AB and BA pairs), got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of at least 0, got {warmup!r}")
    if isinstance(loads, bool) or not isinstance(loads, int) or loads < 1:
        raise ValueError(f"loads must be a whole number of at least 1, got {loads!r}")
    variants = list(variants)
    if not variants or len(set(variants)) != len(variants) or not set(variants) <= set(VARIANTS):
        raise ValueError(f"variants must be distinct names of {list(VARIANTS)}, got {variants!r}")
    writer = RowWriter(Path(out_dir) if out_dir else None)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(cfgs) * loads * (rounds + 1), desc="paired A/B", unit="round", dynamic_ncols=True)
        except ImportError:
            bar = None
    servers: dict[str, tuple[str, ServingWorker]] = {}
    order: list[list] = []
    all_rows: list[dict] = []
    done = False

    def server(cfg: BenchConfig, v: str) -> ServingWorker:
        """The variant's worker for cfg: the one running, when its environment and switches are cfg's."""
        key = json.dumps([cfg.env, cfg.ext_params if v == "patched" else {}], sort_keys=True, default=str)
        old = servers.get(v)
        if old and old[0] == key and old[1].alive:
            return old[1]
        if old:
            old[1].close()
        servers[v] = (key, ServingWorker(v, env=cfg.env))   # (in `servers` before it starts: a Ctrl-C kills it)
        return servers[v][1].start()

    try:
        for ci, cfg in enumerate(cfgs):
            meta = _meta(cfg)
            failed: dict[str, str] = {}
            got: dict[str, list[dict]] = {v: [] for v in variants}
            coverage = None

            def run(v: str, r: int, job: BenchJob) -> Optional[dict]:
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

            jobs = {v: _variant_job(cfg, v, reps=1, warmup=warmup, coverage=False) for v in variants}
            groups: list[int] = []
            done_loads = 0   # loads whose rounds every variant ran
            for load in range(loads):
                if loads > 1 and servers:   # fresh workers for every load: the model loaded again, the other variant first
                    for _, w in servers.values():
                        w.close()
                    servers.clear()
                vs = variants if load % 2 == 0 else variants[::-1]
                for v in vs:   # the warm-up (and the model load); coverage measured once
                    res = run(v, -1, _variant_job(cfg, v, reps=1, warmup=1, coverage=coverage is None))
                    if res is not None and coverage is None:
                        coverage = [t.get("coverage") for t in res["tests"]]
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
            merged = {v: _merge_rounds(got[v], coverage) for v in variants if v not in failed}
            per_v = {v: rows_from_result(cfg, v, merged[v], meta) if v in merged else
                     error_rows(cfg, v, failed[v], meta) for v in variants}
            _finish_config(per_v)
            for v, rows in per_v.items():
                for i, row in enumerate(rows):
                    row["config"] = ci
                    if v not in merged:
                        continue
                    row["rounds"] = len(got[v])
                    row["loads"] = max(done_loads, 1)
                    if v == "baseline" or "baseline" not in merged:
                        continue
                    sb, sv = merged["baseline"]["tests"][i]["seconds"], merged[v]["tests"][i]["seconds"]
                    ratios = [x / y if y > 0 else float("nan") for x, y in zip(sb, sv)]   # (t/s: n/y over n/x)
                    # (both variants ran every round while neither failed: groups line up with the ratios)
                    med, lo, hi = paired_ci(ratios, seed=seed, groups=groups[:len(ratios)] if done_loads > 1 else None)
                    row.update({"ratios": ratios, "speedup_median": med, "speedup_ci_lo": lo, "speedup_ci_hi": hi})
            for v in variants:
                writer.write(per_v[v])
                all_rows.extend(per_v[v])
        done = True
    finally:
        for _, w in servers.values():
            if not done:   # (Ctrl-C, an error: no waiting for a job in progress)
                w.kill()
            w.close()
        if bar:
            bar.close()
    df = pd.DataFrame(all_rows)
    for col in ROW_FIELDS:
        if col not in df.columns:
            df[col] = None
    df.attrs["order"] = order
    return df


# a server's mixed load in one context (bench/q6; `pyllama-pp run/ab --workload mixed`): prompts of alternating
# lengths, each from an empty cache, then decoding right after the last one
MIXED_WORKLOAD = [["pp", 64], ["pp", 512], ["pp", 128], ["pp", 2048], ["tg", 16]]


def workload_ctx(workload: list, n_ctx: int = 0) -> int:
    """n_ctx for a workload: a prompt starts from an empty cache, decode steps continue after the last prompt (or
    from position 0), so the longest prompt plus every decoded token."""
    return ctx_for(max((n for k, n in workload if k == "pp"), default=0) + sum(n for k, n in workload if k == "tg") + 8,
                   n_ctx)


def mixed_workload(cfg: BenchConfig, variants: Sequence[str] = VARIANTS, rounds: int = 3,
                   workload: Optional[list] = None, timeout: Optional[float] = None):
    """Run `workload` (default MIXED_WORKLOAD) `rounds` times in one context per variant (its own worker) and
    return a DataFrame with a row per variant and step: `test` ("r2 pp512"), `avg_ts`, `speedup` (patched over
    baseline, same step), `re_reservations` and `plan_switches` (patched build), `host_syncs`, bytes per device."""
    import pandas as pd

    workload = MIXED_WORKLOAD if workload is None else workload
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number of at least 1, got {rounds!r}")
    bad = [st for st in workload if not (isinstance(st, (list, tuple)) and len(st) == 2 and st[0] in ("pp", "tg")
                                         and isinstance(st[1], int) and not isinstance(st[1], bool) and st[1] >= 1)]
    if not workload or bad:
        raise ValueError(f"a workload is a non-empty list of steps [\"pp\" or \"tg\", tokens >= 1], such as "
                         f"{MIXED_WORKLOAD}; got {bad[0] if bad else workload!r}")
    bj = cfg.job()
    job = WorkloadJob(model=bj.model, devices=bj.devices, placement=bj.placement,
                      ctx=dataclasses.replace(bj.ctx, n_ctx=workload_ctx(workload, cfg.n_ctx)),
                      workload=[list(st) for st in workload], rounds=rounds)
    meta = _meta(cfg)
    rows: list[dict] = []
    for v in variants:
        vjob = dataclasses.replace(job, ext_params=dict(cfg.ext_params) if v == "patched" else {})
        try:
            res = run_job(vjob, v, timeout=timeout, env=cfg.env)
        except WorkerError as e:
            rows.append({"variant": v, "devices": cfg.devices, "test": "workload", "avg_ts": float("nan"),
                         "error": error_text(e)[:2000], **meta})
            continue
        for st in res["steps"]:
            rows.append({
                "variant": v, "model": Path(cfg.model).name, "devices": cfg.devices, "n_ctx": job.ctx.n_ctx,
                "n_batch": cfg.n_batch, "n_ubatch": min(cfg.n_ubatch, cfg.n_batch), **workload_step_row(st, res),
                "seconds": st["seconds"], "ext_params": cfg.ext_params if v == "patched" else {}, **meta})
    df = pd.DataFrame(rows)
    if not df.empty and {"baseline", "patched"} <= set(df["variant"]):
        base = df[df.variant == "baseline"].set_index("test")["avg_ts"]
        df["speedup"] = [r.avg_ts / base[r.test] if r.variant == "patched" and r.test in base.index and base[r.test] > 0
                         else float("nan") for r in df.itertuples()]
    return df


