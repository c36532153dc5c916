"""Shared helpers of the bench/qN_*.py scripts: arguments, cached synthetic models, device-spec variants,
machine facts, llama-bench-like Markdown tables and bar plots.

Every script runs as `python bench/qN_name.py [--devices SPEC] [--model PATH] [--out DIR] [--reps N] [--quick]`,
defaults to virtual devices (VDEV) with throttled links, and writes results.jsonl/csv, results.md and a PNG
into --out (default bench/out/qN/, git-ignored; results kept in docs/ are written there with an explicit --out).
The scripts in lab/ that use these helpers put bench/ on sys.path first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"   # every bench/ and lab/ script's default output (git-ignored), never docs/
if str(REPO) not in sys.path:  # `python bench/qN.py` from anywhere finds the package of this checkout
    sys.path.insert(0, str(REPO))

from pyllama_pp import devices as devspec  # noqa: E402
from pyllama_pp import synth  # noqa: E402

from pyllama_pp import report  # noqa: E402
from pyllama_pp.config import RunConfig  # noqa: E402
from pyllama_pp.defaults import MAIN_JOB_MODEL  # noqa: E402
from pyllama_pp.params import Placement  # noqa: E402
from pyllama_pp.planning import models_dir  # noqa: E402
from pyllama_pp.row import Row  # noqa: E402

# The open questions' setup (the main job's until fit placed it, kept so their rows compare with the history):
# two virtual devices, 256 MiB each, each on its own 0.1 GB/s host link, every expert in host RAM, so expert uploads
# dominate (the tiny preset has 1.67 MB of experts a layer, 16.7 ms a layer over one link); 7 layers split 3:5
# put 3 MoE layers that stream experts on each device.
DEFAULT_DEVICES = "vdev:2x256MiB@0.1GBps"
DEFAULT_TS = [3.0, 5.0]
N_LAYER = MAIN_JOB_MODEL["n_layer"]
WORKER_TIMEOUT = 600.0


# ---------------------------------------------------------------------------------------------------------
# arguments and output folder

def parser(qname: str, doc: str, reps: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=None,
                    help=f"device spec(s), ';'-separated (default: {DEFAULT_DEVICES} and the script's variants of it; "
                         "e.g. cuda, cuda:0,1, vdev:2x256MiB@0.25GBps, JSON)")
    ap.add_argument("--model", default=None,
                    help=f"GGUF model (default: the tiny synthetic qwen3moe preset with {N_LAYER} layers, written once "
                         "into the cache)")
    ap.add_argument("--ts", default=None,
                    help="tensor split, e.g. 3,5 ('' for llama.cpp's default); default 3,5 with the default model, "
                         "llama.cpp's default with --model")
    ap.add_argument("--out", type=Path, default=OUT / qname.split("_")[0],
                    help=f"output folder (results.jsonl/csv/md and a PNG; default bench/out/{qname.split('_')[0]}); "
                         "old results there are replaced")
    ap.add_argument("--reps", type=int, default=reps, help=f"timed repetitions per test (default {reps})")
    ap.add_argument("--quick", action="store_true", help="a smaller matrix and one repetition (smoke test)")
    ap.add_argument("--timeout", type=float, default=WORKER_TIMEOUT, help="seconds per worker process")
    return ap


def add_trace_options(ap: argparse.ArgumentParser, fractions: Sequence[float]) -> None:
    """The options of the benches that trace decode and simulate a cache on it: the tokens' seed and the cache
    sizes (--fractions, fractions of a layer's experts)."""
    ap.add_argument("--seed", type=int, default=0, help="the tokens' seed (default %(default)s)")
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=list(fractions),
                    help="cache sizes, fractions of a layer's experts (default %(default)s)")


def setup(args) -> dict:
    """Resolve model, tensor split and output folder; returns a context dict for the script."""
    if args.quick:
        args.reps = 1
    default_model = args.model is None
    model = args.model or synth_model()
    if args.ts is None:
        ts = list(DEFAULT_TS) if default_model else None
    else:
        ts = [float(x) for x in args.ts.split(",") if x.strip()] or None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("results.jsonl", "results.csv"):   # RowWriter appends: start from an empty file
        (out / name).unlink(missing_ok=True)
    return {"model": str(model), "default_model": default_model, "ts": ts, "out": out,
            "command": command_line(), "machine": machine(), "t0": time.time()}


def device_list(args, default: Sequence[str]) -> list[str]:
    if not args.devices:
        return list(default)
    return [x for x in args.devices.split(";") if x.strip()]


def command_line() -> str:
    try:
        script = str(Path(sys.argv[0]).resolve().relative_to(REPO))
    except ValueError:
        script = sys.argv[0]
    return " ".join(["python", shlex.quote(script)] + [shlex.quote(a) for a in sys.argv[1:]])


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "host": platform.node(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


# ---------------------------------------------------------------------------------------------------------
# models

def synth_model(routing: str = "uniform", skew: Optional[float] = None, seed: int = 1, n_layer: int = N_LAYER,
                preset: str = "tiny") -> Path:
    """A synthetic model in the cache, shared with the CLI (written once; same config -> same bytes).
    routing="skewed" without a skew takes synth.DEFAULT_SKEW."""
    return synth.cached_model(models_dir(), preset, seed=seed, n_layer=n_layer, routing=routing, skew=skew)


# ---------------------------------------------------------------------------------------------------------
# configurations

def config(model, devices: str, ts: Optional[Sequence[float]] = None, host_experts="all", load_mode: str = "none",
           **kw) -> RunConfig:
    """A RunConfig whose placement keeps `host_experts` in host RAM with tensor split `ts` (None: llama.cpp's
    default) and `load_mode`; `kw` goes to RunConfig (n_batch, n_ubatch, tests, reps, switches, env, label, ...)."""
    return RunConfig(model=str(model), devices=devices,
                     placement=Placement(host_experts=host_experts, load_mode=load_mode,
                                         tensor_split=tuple(ts) if ts else None), **kw)


def rows_of(df) -> list[Row]:
    """A DataFrame of rows (runner.ab's) as Rows for a RowWriter; columns that are not Row fields are left out."""
    return [Row.from_dict(r) for r in df.to_dict("records")]


# ---------------------------------------------------------------------------------------------------------
# device spec variants

def vdev_with(spec: str, option: str) -> Optional[str]:
    """`vdev:NxMEM@RATE` plus an option (",shared", ",speed=1:2"); None when spec is not a plain VDEV string."""
    s = spec.strip()
    if not s.lower().startswith("vdev:") or "," in s:
        return None
    return s + option


def vdev_json(spec: str, memories: Sequence[str]) -> Optional[str]:
    """The same VDEVs as `spec` (rate), with per-device memory budgets, as a JSON spec."""
    try:
        p = devspec.parse(spec)
    except Exception:
        return None
    if not p.vdevs or len(p.vdevs) != len(memories):
        return None
    return json.dumps({"kind": "vdev", "devices": [{"memory": m, "link_gbps": v.link_gbps}
                                                    for m, v in zip(memories, p.vdevs)]}, separators=(",", ":"))


def short_devices(spec: str) -> str:
    s = str(spec)
    if s.startswith("{"):
        try:
            d = json.loads(s)
            return "vdev json: " + ", ".join(f"{x.get('memory', 0)}@{x.get('link_gbps', 0)}GBps"
                                             + (f" g{x['link_group']}" if x.get("link_group", -1) >= 0 else "")
                                             + (f" x{x['speed']:g}" if x.get("speed", 1) != 1 else "")
                                             for x in d.get("devices", []))
        except (ValueError, TypeError, AttributeError):
            return s
    return s


# ---------------------------------------------------------------------------------------------------------
# formatting

def isnum(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and not math.isinf(x)


def fmt_bytes(b) -> str:
    return report.fmt_bytes(b) if isnum(b) else ""


def fmt_ts(r) -> str:
    if r is None:
        return ""
    if has_error(r):
        return "error"
    a, s = r.get("avg_ts"), r.get("stddev_ts")
    if not isnum(a):
        return ""
    return f"{a:.1f} ± {s:.1f}" if isnum(s) else f"{a:.1f}"


def has_error(r) -> bool:
    e = r.get("error") if r is not None else None
    return isinstance(e, str) and bool(e)


def per_dev(r) -> str:
    v = r.get("h2d_bytes_per_device") if r is not None else None
    if not isinstance(v, list) or not v:
        return ""
    return " / ".join(fmt_bytes(x) for x in v)


def cov(r) -> str:
    c = r.get("coverage") if r is not None else None
    return f"{100 * c:.0f}%" if isnum(c) else ""


def num(x, fmt="{:.0f}") -> str:
    return fmt.format(x) if isnum(x) else ""


def md_table(header: Sequence[str], rows: Iterable[Sequence], align: Optional[str] = None) -> str:
    header = list(header)
    align = align or ("l" * len(header))
    sep = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    for r in rows:
        out.append("| " + " | ".join("" if c is None else str(c) for c in r) + " |")
    return "\n".join(out) + "\n"


def pairs(df, keys=("config", "test")) -> list[tuple]:
    """[(key, baseline row dict or None, patched row dict or None)] per config and test, in run order."""
    out = []
    if df is None or df.empty:
        return out
    order = {}
    for i, r in enumerate(df.to_dict("records")):
        k = tuple(r.get(x) for x in keys)
        order.setdefault(k, {"i": i})
        order[k][r["variant"]] = r
    for k, d in sorted(order.items(), key=lambda kv: kv[1]["i"]):
        out.append((k, d.get("baseline"), d.get("patched")))
    return out


def syncs(b, p) -> str:
    f = lambda r: "" if r is None or not isnum(r.get("host_syncs")) else f"{r['host_syncs']:.0f}"
    return f"{f(b)} / {f(p)}"


def pp_onoff(b, p) -> str:
    f = lambda r: "" if r is None or r.get("pipeline_parallel") is None or r.get("pipeline_parallel") != \
        r.get("pipeline_parallel") else ("on" if r.get("pipeline_parallel") else "off")
    return f"{f(b)}/{f(p)}"


def speedup(b, p) -> Optional[float]:
    if b is None or p is None or has_error(b) or has_error(p):
        return None
    if isnum(b.get("avg_ts")) and isnum(p.get("avg_ts")) and b["avg_ts"] > 0:
        return p["avg_ts"] / b["avg_ts"]
    return None


def errors_note(df) -> str:
    if df is None or df.empty or "error" not in df:
        return ""
    lines = []
    for r in df.to_dict("records"):
        if has_error(r):
            first = r["error"].strip().splitlines()[0][:300]
            lines.append(f"- ERROR {r.get('variant')} {short_devices(r.get('devices'))} ub={r.get('n_ubatch')} "
                         f"{r.get('test')} {r.get('label') or ''}: {first}")
    return ("\n" + "\n".join(lines) + "\n") if lines else ""


def ab_table(df, label: Callable[[dict], str] = None) -> str:
    """The main A/B table: one line per config and test."""
    rows = []
    for _, b, p in pairs(df):
        ref = p or b
        sp = speedup(b, p)
        bf = p.get("bound_frac") if p is not None else None
        rows.append([label(ref) if label else short_devices(ref.get("devices")), ref.get("n_batch"), ref.get("n_ubatch"),
                     ref.get("test"), cov(ref), fmt_ts(b), fmt_ts(p), num(sp, "{:.2f}"), pp_onoff(b, p), per_dev(b),
                     per_dev(p), num(b.get("bound_ts") if b else None), num(p.get("bound_ts") if p else None),
                     num(100 * bf if isnum(bf) else None, "{:.0f}%"), syncs(b, p),
                     num(p.get("id_readbacks") if p else None), num(p.get("upload_all") if p else None)])
    return md_table(["config", "n_batch", "n_ubatch", "test", "coverage", "baseline t/s", "patched t/s", "speedup",
                     "PP b/p", "bytes/dev baseline", "bytes/dev patched", "bound t/s b", "bound t/s p", "p % of bound",
                     "host syncs b / p", "id readbacks p", "upload-all p"], rows, "lrrlrrrrlllrrrlrr")


# ---------------------------------------------------------------------------------------------------------
# plots

def bar_plot(groups: Sequence[str], series: dict, path: Path, title: str, ylabel: str = "tokens / s",
             errs: Optional[dict] = None, notes: Optional[Sequence[str]] = None, colors: Optional[dict] = None,
             log: bool = False) -> Path:
    """Grouped bars: `series` maps a legend name to one value per group; `notes` go on top of each group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(series)
    n = max(len(names), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.5, 1.25 * len(groups) * max(1, n / 2)), 4.8))
    palette = ["#8c8c8c", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    for k, name in enumerate(names):
        vals = [v if isnum(v) else 0 for v in series[name]]
        e = [v if isnum(v) else 0 for v in (errs or {}).get(name, [0] * len(groups))]
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, vals, width, yerr=e, capsize=2, label=name,
               color=(colors or {}).get(name, palette[k % len(palette)]))
    if notes:
        for i, t in enumerate(notes):
            if t:
                top = max([series[nm][i] for nm in names if isnum(series[nm][i])] or [0])
                ax.text(i, top * (1.15 if log else 1.03), t, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.margins(y=0.18)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ab_plot(df, path: Path, title: str, label: Callable[[dict], str]) -> Optional[Path]:
    ps = pairs(df)
    if not ps:
        return None
    groups = [label(p or b) + f"\n{(p or b).get('test')}" for _, b, p in ps]
    val = lambda r: r.get("avg_ts") if r is not None and not has_error(r) else float("nan")
    sd = lambda r: r.get("stddev_ts") if r is not None and not has_error(r) else 0
    series = {"baseline": [val(b) for _, b, _ in ps], "patched": [val(p) for _, _, p in ps]}
    errs = {"baseline": [sd(b) for _, b, _ in ps], "patched": [sd(p) for _, _, p in ps]}
    notes = [(f"{speedup(b, p):.2f}x" if speedup(b, p) else "") for _, b, p in ps]
    return bar_plot(groups, series, path, title, errs=errs, notes=notes)


# ---------------------------------------------------------------------------------------------------------
# report

def header(ctx: dict, title: str, what: str) -> str:
    m = ctx["machine"]
    return (f"# {title}\n\n{what}\n\n- command: `{ctx['command']}`\n- model: `{Path(ctx['model']).name}`"
            f"{' (synthetic tiny preset, ' + str(N_LAYER) + ' layers, seed 1)' if ctx['default_model'] else ''}, "
            f"tensor split {ctx['ts'] if ctx['ts'] else 'llama.cpp default'}\n"
            f"- machine: {m['host']}, nproc {m['nproc']}, {m['cpu']}\n- date: {m['date_utc']}\n")


def finish(ctx: dict, title: str, what: str, body: str, df=None) -> str:
    """Write results.md (header + body + errors) and print it; returns the Markdown."""
    md = header(ctx, title, what) + f"- wall time: {time.time() - ctx['t0']:.0f} s\n\n" + body + errors_note(df)
    (ctx["out"] / "results.md").write_text(md)
    print(md)
    print(f"files: {ctx['out']}/results.jsonl, results.csv, results.md and the PNG", flush=True)
    return md
