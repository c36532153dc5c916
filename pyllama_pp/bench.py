"""A/B benchmark library: llama-bench-like rows for the baseline and the patched build.

Configurations are crossed like llama-bench's comma-separated values; every configuration runs in a
fresh worker process per variant (same model, placement, batch sizes and load mode for both), rows are
appended to JSONL/CSV as they come (a crash or Ctrl-C loses nothing already measured), and a worker
that dies becomes an error row.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from . import devices as devspec
from .binding import VARIANTS, backend_modules, build_info
from .errors import WorkerError
from .jobs import BenchJob, WorkloadJob
from .session import ContextParams, Placement
from .worker import run_job, depth_of

ROW_FIELDS = [
    "variant", "model", "model_size", "model_n_params", "n_expert", "n_expert_used", "devices", "n_gpu_layers",
    "split_mode", "tensor_split", "tensor_buft_overrides", "load_mode", "n_ctx", "n_batch", "n_ubatch", "test", "n_prompt", "n_gen", "n_depth",
    "avg_ts", "stddev_ts", "samples_ts", "avg_ns", "speedup", "pipeline_parallel", "n_copies", "n_splits",
    "experts_used", "coverage", "h2d_bytes", "h2d_bytes_per_device", "link_gbps", "bound_ts", "bound_frac", "bound_pipe_ts", "bound_pipe_frac",
    "host_syncs", "id_readbacks", "upload_all", "direct_reads", "gathers", "prefetches", "chained", "re_reservations", "plan_switches", "realloc_reason", "realloc_log", "graph_nodes", "host_wait_s", "host_submit_s", "host_sched_s", "staged_bytes_per_device", "gather_bytes_est_per_device", "compute_buffer_bytes", "ring_bytes_per_device", "label", "config_key", "env",
    "ext_params", "error", "build", "machine", "date",
]


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


def config_key(cfg: BenchConfig) -> str:
    """What a config measures (model, devices, placement, batch sizes, tests, reps, switches, environment, label) as a
    short hash: rows with the same key and variant measure the same thing (`ab(..., resume=True)` reuses them)."""
    what = [cfg.job(), cfg.ext_params, cfg.env, cfg.label]
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def expand(model: str, devices: Sequence[str] = ("cpu",), n_batch: Sequence[int] = (512,),
           n_ubatch: Sequence[int] = (32,), host_experts: Sequence = ("all",), **common) -> list[BenchConfig]:
    """Cross the given lists like llama-bench; `common` goes to every BenchConfig."""
    out = []
    for dev, nb, nub, he in itertools.product(devices, n_batch, n_ubatch, host_experts):
        if nub > nb:
            continue
        out.append(BenchConfig(model=model, devices=dev, n_batch=nb, n_ubatch=nub, host_experts=he, **common))
    return out


def _env_knobs(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(("GGML_SCHED_PP_", "GGML_OP_OFFLOAD", "GGML_CUDA_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _link_bound(cfg: BenchConfig, h2d: list[int], n_tokens: int) -> tuple[list[float], float]:
    """Per-device link bandwidth (GB/s) and the tokens/s bound the bytes moved imply (links in parallel,
    a shared link carries the bytes of all its devices). VDEVs know their links; other devices take
    cfg.link_gbps (e.g. measured host->GPU bandwidth)."""
    spec = devspec.parse(cfg.devices)
    if spec.kind == "vdev":
        gbps = [v.link_gbps for v in spec.vdevs]
        groups = [("g", v.link_group) if v.link_group >= 0 else ("d", i) for i, v in enumerate(spec.vdevs)]
    elif cfg.link_gbps:
        gbps = [float(x) for x in cfg.link_gbps][:len(h2d)]
        groups = [("g", 0) if cfg.shared_link else ("d", i) for i in range(len(gbps))]
    else:
        return [], float("nan")
    if not h2d or not gbps or min(gbps) <= 0:
        return gbps, float("nan")
    per_link: dict = {}
    for i, (g, key) in enumerate(zip(gbps, groups)):
        t = h2d[i] / (g * 1e9) if i < len(h2d) else 0.0
        per_link[key] = per_link.get(key, 0.0) + t
    worst = max(per_link.values())
    return gbps, (n_tokens / worst if worst > 0 else float("nan"))


def _pipe_bound(cfg: BenchConfig, h2d: list[int], gbps: list[float], n_tokens: int,
                link_bound: Optional[float] = None) -> float:
    """The tokens/s bound of a prompt pipelined in ubatches through the devices in order, when each device's
    stage takes the time of its own uploads (bytes / link speed, spread evenly over the ubatches): the first
    ubatch goes through every stage, each later one adds the slowest stage (pipeline fill), and no link can
    carry more than its bytes. Compute is not in it (see all-on-GPU rows for that). link_bound: _link_bound's
    bound for these bytes, when the caller has it."""
    if not h2d or not gbps or min(gbps) <= 0:
        return float("nan")
    n_ub = max(1, -(-n_tokens // max(1, min(cfg.n_ubatch, cfg.n_batch))))
    stages = [h2d[i] / n_ub / (g * 1e9) for i, g in enumerate(gbps) if i < len(h2d) and h2d[i] > 0]
    if not stages:
        return float("nan")
    fill = sum(stages) + (n_ub - 1) * max(stages)
    if link_bound is None:
        link_bound = _link_bound(cfg, h2d, n_tokens)[1]
    links = n_tokens / link_bound    # busiest link, all its bytes (shared links add up)
    return n_tokens / max(fill, links)


def _per_gpu(ext: dict, key: str, reps: int = 1, plus: tuple = ()) -> Optional[list]:
    """One value per device backend (the CPU left out) from the patched scheduler's per-backend stats, per rep
    (with the keys in `plus` added where the stats have them); None where they do not have `key` (baseline, older
    builds)."""
    backends = ext.get("backends") or []
    if not backends or key not in backends[0]:
        return None
    return [int((b[key] + sum(b.get(k, 0) for k in plus)) / reps) for b in backends if b["name"] != "CPU"]


def num(x, fmt: str = "{:.0f}") -> str:
    """A number for a table cell: empty for None and NaN."""
    return "" if x is None or x != x else fmt.format(x)


def ctx_for(n_tokens: int, n_ctx: int = 0) -> int:
    """n_ctx for runs of up to n_tokens positions: `n_ctx` when set, else n_tokens rounded up to 256 (at least 256)."""
    return n_ctx or max(256, int(math.ceil(n_tokens / 256.0)) * 256)


def nmse(a, b) -> float:
    """Normalized mean squared error of logits `a` against the reference `b` (float64)."""
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-30))


def _test_name(kind: str, n: int, depth: int) -> str:
    return f"{kind}{n}" + (f" @ d{depth}" if depth else "")   # llama-bench's naming


def rows_from_result(cfg: BenchConfig, variant: str, res: dict, meta: dict) -> list[dict]:
    rows = []
    model = res["model"]
    sched = res["schedule"]
    for t in res["tests"]:
        n_tok = t["n"]
        secs = t["seconds"]
        ts = [n_tok / s for s in secs if s > 0]
        devs = t["devices"]
        reps = max(len(secs), 1)
        h2d = [int(d["h2d_bytes"] / reps) for d in devs]
        ext = t.get("ext") or {}
        if not h2d and ext.get("backends"):
            # no device counters (CUDA): the patched scheduler's own count of host-weight bytes per device. DIRECT's
            # kernel reads (patch 0008) and GATHER's device copies (0010) are not in it: DIRECT's estimate (measured
            # coverage x tensor bytes) is added, and GATHER's bytes as the device counted them where it does (CUDA's
            # library; prefetches included), else their estimate
            counted = any("gather_bytes" in b for b in ext["backends"])
            h2d = _per_gpu(ext, "weight_bytes", reps,
                           plus=("direct_bytes_est", "gather_bytes" if counted else "gather_bytes_est")) or []
        gbps, bound = _link_bound(cfg, h2d, n_tok)
        pipe = _pipe_bound(cfg, h2d, gbps, n_tok, bound) if t["kind"] == "pp" else float("nan")
        avg = statistics.fmean(ts) if ts else float("nan")
        cov = t.get("coverage") or {}
        rows.append({
            "variant": variant, "model": Path(model["path"]).name, "model_size": model["size_bytes"],
            "model_n_params": model["n_params"], "n_expert": model["n_expert"], "n_expert_used": model["n_expert_used"],
            "devices": cfg.devices, "n_gpu_layers": cfg.n_gpu_layers, "split_mode": "layer",
            "tensor_split": cfg.tensor_split,
            "tensor_buft_overrides": f"host_experts={cfg.host_experts}", "load_mode": cfg.load_mode,
            "n_ctx": cfg.job().ctx.n_ctx, "n_batch": cfg.n_batch, "n_ubatch": min(cfg.n_ubatch, cfg.n_batch),
            "test": _test_name(t["kind"], n_tok, t.get("depth", 0)), "n_prompt": n_tok if t["kind"] == "pp" else 0,
            "n_gen": n_tok if t["kind"] == "tg" else 0, "n_depth": t.get("depth", 0), "avg_ts": avg,
            "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0, "samples_ts": ts,
            "avg_ns": int(statistics.fmean(secs) * 1e9) if secs else 0, "speedup": float("nan"),
            "pipeline_parallel": sched["pipeline_parallel"], "n_copies": sched["n_copies"],
            "n_splits": sched["n_splits"], "experts_used": cov.get("experts_used_per_layer_ubatch"),
            "coverage": cov.get("coverage"), "h2d_bytes": sum(h2d), "h2d_bytes_per_device": h2d, "link_gbps": gbps,
            "bound_ts": bound, "bound_frac": avg / bound if bound and bound == bound else float("nan"),
            "bound_pipe_ts": pipe, "bound_pipe_frac": avg / pipe if pipe and pipe == pipe else float("nan"),
            "host_syncs": int(sum(d["host_syncs"] for d in devs) / reps) if devs else None,
            "id_readbacks": int(ext["id_readbacks"] / reps) if "id_readbacks" in ext else None,
            "upload_all": int(ext["upload_all"] / reps) if "upload_all" in ext else None,
            "direct_reads": int(ext["direct"] / reps) if "direct" in ext else None,
            "gathers": int(ext["gather"] / reps) if "gather" in ext else None,
            "prefetches": int(ext["prefetch"] / reps) if "prefetch" in ext else None,
            "chained": int(ext["chained"] / reps) if "chained" in ext else None,
            "re_reservations": int(ext["reallocs"] / reps) if "reallocs" in ext else None,
            "plan_switches": int(ext["plan_switches"] / reps) if "plan_switches" in ext else None,
            "realloc_reason": ext.get("last_realloc") if ext.get("reallocs") else None,
            "realloc_log": ext.get("realloc_log") or None,
            "graph_nodes": [ext["graph_nodes_min"], ext["graph_nodes_max"]] if "graph_nodes_min" in ext else None,
            "host_wait_s": ({c: us / 1e6 / reps for c, us in ext["host_wait_us"].items()}
                            if "host_wait_us" in ext else None),
            "host_submit_s": ([b["submit_us"] / 1e6 / reps for b in ext["backends"]]
                              if ext.get("backends") and "submit_us" in ext["backends"][0] else None),
            "host_sched_s": ({k[:-3]: ext[k] / 1e6 / reps for k in ("compute_async_us", "alloc_us", "synchronize_us",
                                                                  "stage_wait_us") if k in ext}
                             if "compute_async_us" in ext else None),
            # host-weight bytes that went through pinned staging (pageable host weights; patch 0006)
            "staged_bytes_per_device": _per_gpu(ext, "staged_bytes", reps),
            # GATHER's estimate beside the count the bytes above take where the device counts them (CUDA)
            "gather_bytes_est_per_device": _per_gpu(ext, "gather_bytes_est", reps),
            "compute_buffer_bytes": [b["compute_buffer_bytes"] for b in sched["backends"]],
            # PREFETCH=2's lanes per device (patch 0010; VRAM outside the compute buffers; a level, not a delta)
            "ring_bytes_per_device": _per_gpu({"backends": t.get("ext_ring")}, "ring_bytes"),
            "label": cfg.label, "config_key": config_key(cfg),
            "ext_params": cfg.ext_params if variant == "patched" else {}, **meta})
    return rows


def error_text(e: BaseException) -> str:
    """One line for a row's `error`: the worker's error class and message (ModelError: model file not found: ...)."""
    kind = getattr(e, "error_type", None) or type(e).__name__
    return f"{kind}: {e}"


def error_rows(cfg: BenchConfig, variant: str, err: str, meta: dict) -> list[dict]:
    return [{"variant": variant, "model": Path(cfg.model).name, "devices": cfg.devices, "n_batch": cfg.n_batch,
             "n_ubatch": cfg.n_ubatch, "tensor_buft_overrides": f"host_experts={cfg.host_experts}",
             "load_mode": cfg.load_mode, "test": _test_name(t[0], int(t[1]), depth_of(t)), "n_depth": depth_of(t),
             "avg_ts": float("nan"), "label": cfg.label, "config_key": config_key(cfg), "error": err[:2000], **meta}
            for t in cfg.tests]


class RowWriter:
    """Appends rows to results.jsonl and results.csv as they come."""

    def __init__(self, out_dir: Optional[Path]):
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = self.out_dir / "results.jsonl"
            self.csv = self.out_dir / "results.csv"
            self._csv_started = self.csv.exists() and self.csv.stat().st_size > 0

    def write(self, rows: list[dict]) -> None:
        if not self.out_dir:
            return
        with open(self.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(r, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with open(self.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
            if not self._csv_started:
                w.writeheader()
                self._csv_started = True
            for r in rows:
                w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()})

    def rewrite(self, rows: list[dict]) -> None:
        """Replace results.jsonl and results.csv with `rows` (a resumed sweep's final set), each file at once."""
        if not self.out_dir:
            return
        for f in (self.jsonl, self.csv):
            tmp = f.with_name(f.name + ".tmp")
            tmp.unlink(missing_ok=True)
        part = RowWriter(None)
        part.out_dir, part.jsonl, part.csv, part._csv_started = (self.out_dir, self.jsonl.with_name("results.jsonl.tmp"),
                                                                 self.csv.with_name("results.csv.tmp"), False)
        part.write(rows)
        os.replace(part.jsonl, self.jsonl)
        os.replace(part.csv, self.csv)
        self._csv_started = True


SWEEP_FILE = "sweep.json"


def read_rows(out_dir: Union[str, Path]) -> list[dict]:
    """The rows of a sweep's results.jsonl (a line torn by a crash mid-write is left out)."""
    path = Path(out_dir) / "results.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict):
                rows.append(r)
    return rows


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


def _meta(cfg: BenchConfig) -> dict:
    info = build_info()
    # "cuda": how the package was configured; the CUDA module may also have been dropped into the backends folder
    # afterwards (bench/gpu_run.sh with a carried module): "cuda_module" says whether it is there
    return {"env": _env_knobs(cfg.env), "build": {"cuda": info.get("cuda"), "compiler": info.get("compiler"),
                                                  "cuda_module": "CUDA" in backend_modules()},
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d %H:%M:%S")}


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
            for vi, v in enumerate(variants):
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
                    job = dataclasses.replace(
                        lead.job(), ext_params=dict(lead.ext_params) if v == "patched" else {},
                        coverage=not any(per_cfg[k] for k in todo),
                        ctx_list=[{"ctx": cfg.job().ctx.to_dict(), "tests": cfg.tests} for _, cfg in sub]
                        if len(sub) > 1 else None)
                    if v in lead.plans:   # --plan / --fit: the variant's own placement
                        job = dataclasses.replace(
                            job, placement=Placement(**{**lead.plans[v], "load_mode": lead.load_mode}))
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


# a server's mixed load in one context (bench/q6; `pyllama-pp run/ab --workload mixed`): prompts of alternating
# lengths, each from an empty cache, then decoding right after the last one
MIXED_WORKLOAD = [["pp", 64], ["pp", 512], ["pp", 128], ["pp", 2048], ["tg", 16]]


def workload_ctx(workload: list, n_ctx: int = 0) -> int:
    """n_ctx for a workload: a prompt starts from an empty cache, decode steps continue after the last prompt (or
    from position 0), so the longest prompt plus every decoded token."""
    return ctx_for(max((n for k, n in workload if k == "pp"), default=0) + sum(n for k, n in workload if k == "tg") + 8,
                   n_ctx)


def workload_step_row(st: dict, res: dict) -> dict:
    """The fields of one step of a worker "workload" result (`res["steps"]`) that every workload table shows."""
    ext = st.get("ext") or {}
    return {"round": st["round"] + 1, "test": f"r{st['round'] + 1} {st['kind']}{st['n']}",
            "n_prompt": st["n"] if st["kind"] == "pp" else 0, "n_gen": st["n"] if st["kind"] == "tg" else 0,
            "avg_ts": st["ts"], "pipeline_parallel": res["schedule"]["pipeline_parallel"], "host_syncs": st["host_syncs"],
            "h2d_bytes_per_device": st["h2d_bytes_per_device"], "re_reservations": ext.get("reallocs"),
            "plan_switches": ext.get("plan_switches"), "id_readbacks": ext.get("id_readbacks")}


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


def fmt_bytes(b) -> str:
    try:
        b = float(b)
    except (TypeError, ValueError):
        return ""
    if b != b:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


def markdown(df) -> str:
    """A compare-llama-bench-like table: one line per config and test, baseline vs patched."""
    if df.empty:
        return "(no rows)\n"
    lines = ["| devices | host experts | n_batch | n_ubatch | test | coverage | baseline t/s | patched t/s | speedup "
             "| PP b/p | bytes/dev baseline | bytes/dev patched | bound t/s (patched): links, with fill | patched: re-reservations, host waits (largest cause) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | --- |"]
    for (cfg, test), g in df.groupby(["config", "test"], sort=True):
        b = g[g.variant == "baseline"].iloc[0] if (g.variant == "baseline").any() else None
        p = g[g.variant == "patched"].iloc[0] if (g.variant == "patched").any() else None
        ref = p if p is not None else b

        def ts(r):
            if r is None:
                return ""
            if isinstance(r.get("error"), str) and r.get("error"):
                return "error"
            return f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f}"

        def per_dev(r):
            if r is None or not isinstance(r.get("h2d_bytes_per_device"), list):
                return ""
            return " / ".join(fmt_bytes(x) for x in r["h2d_bytes_per_device"])

        def pp(r):
            return "" if r is None or r.get("pipeline_parallel") != r.get("pipeline_parallel") else \
                ("on" if r.get("pipeline_parallel") else "off")

        def blocked(r):
            # where the patched host thread waited (per run): re-reservations (each drains the pipeline), total wait
            # and its largest cause (input_events = the host ran ahead and waits for the pipeline: expected)
            if r is None or not isinstance(r.get("host_wait_s"), dict):
                return ""
            waits = r["host_wait_s"]
            total = sum(waits.values())
            top = max(waits, key=waits.get) if waits else ""
            return f"{num(r.get('re_reservations')) or '?'}, {total:.2f} s" + (f" ({top})" if total > 0 else "")

        cov = ref.get("coverage")
        cov_s = f"{100 * cov:.0f}%" if isinstance(cov, float) and cov == cov else ""
        sp = p.get("speedup") if p is not None else None
        bound = "" if p is None else ", ".join(filter(None, (num(p.get("bound_ts")), num(p.get("bound_pipe_ts")))))
        lines.append(
            f"| {ref['devices']} | {str(ref['tensor_buft_overrides']).replace('host_experts=', '')} | {ref['n_batch']} "
            f"| {ref['n_ubatch']} | {test} | {cov_s} | {ts(b)} | {ts(p)} "
            f"| {'' if sp is None or sp != sp else f'{sp:.2f}'} | {pp(b)}/{pp(p)} | {per_dev(b)} | {per_dev(p)} "
            f"| {bound} | {blocked(p)} |")
    return "\n".join(lines) + "\n"


def plot(df, path: Union[str, Path], title: str = "pyllama_pp A/B") -> Optional[Path]:
    """Bar chart of avg_ts per config/test for both variants (error bars = stddev), with speedups on top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["avg_ts"].notna()] if "avg_ts" in df else df
    if ok.empty:
        return None
    groups = list(ok.groupby(["config", "test"], sort=True))
    labels = [f"{g.iloc[0]['devices']}\nub={g.iloc[0]['n_ubatch']} {test}" for (c, test), g in groups]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    width = 0.38
    for k, v in enumerate(("baseline", "patched")):
        vals = [g[g.variant == v]["avg_ts"].mean() if (g.variant == v).any() else 0 for _, g in groups]
        errs = [g[g.variant == v]["stddev_ts"].mean() if (g.variant == v).any() else 0 for _, g in groups]
        xs = [i + (k - 0.5) * width for i in range(len(groups))]
        ax.bar(xs, vals, width, yerr=errs, label=v, color=("#8c8c8c", "#1f77b4")[k], capsize=3)
    for i, (_, g) in enumerate(groups):
        sp = g[g.variant == "patched"]["speedup"].mean() if (g.variant == "patched").any() else float("nan")
        top = g["avg_ts"].max()
        if sp == sp:
            ax.text(i + 0.5 * width, top * 1.02, f"{sp:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("tokens / s (avg_ts)")
    ax.set_title(title)
    ax.legend()
    ax.margins(y=0.15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
