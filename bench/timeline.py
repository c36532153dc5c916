"""A timeline of one long prompt on a GPU: the copy stream beside the compute stream, and what stays exposed.

One Session (patched by default, every expert in pinned host RAM or, `--host-experts none`, every weight in VRAM;
patched switches as `GGML_SCHED_PP_<NAME>` variables), a warm-up prompt, then one prompt traced by
PyTorch's profiler (CUPTI activity records: every kernel and copy of the process, ggml's included, with its stream,
start, end and bytes). From the trace:

- `timeline.png`: one lane per CUDA stream (kernels blue, host-to-device copies orange, other copies grey), the
  whole prompt above and a few layers of the first ubatch below;
- `timeline.json`: per stream its kernel and copy time; for the prompt: the compute stream's busy time, the time
  host-to-device copies ran beside compute (hidden) and without it (exposed), the time neither ran, and the link's
  effective rate while it copied;
- `trace.json.gz`: the profiler's Chrome trace (chrome://tracing, Perfetto).

The compute stream is the one with the most kernel time; "exposed" copy time is copy time during which the compute
stream ran no kernel.

    python bench/timeline.py --preset qwen3-30b-a3b --devices cuda:0 -p 16384 -ub 8192 --out DIR
        (GPU machine; needs PyTorch with CUDA in the same Python: its profiler reads CUPTI)
    python bench/timeline.py --trace DIR/trace.json.gz --out DIR     (analyse and draw a trace again)
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two merged, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def gpu_events(trace: dict) -> list[dict]:
    """Kernels and copies of a Chrome trace: kind (kernel, htod, copy), stream, start and end (us), bytes, name."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args", {})
        if e["cat"] == "kernel":
            kind = "kernel"
        elif e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            kind = "htod"
        else:
            kind = "copy"
        t0 = float(e["ts"])
        out.append({"kind": kind, "stream": int(args.get("stream", e.get("tid", 0))), "t0": t0,
                    "t1": t0 + float(e.get("dur", 0)), "bytes": int(args.get("bytes", 0)), "name": e.get("name", "")})
    return out


def analyse(events: list[dict]) -> dict:
    """Per stream and for the whole traced prompt: compute, copies hidden under it and exposed, idle time."""
    if not events:
        raise SystemExit("the trace holds no GPU kernels or copies: was the profiler given CUDA activities?")
    t_start, t_end = min(e["t0"] for e in events), max(e["t1"] for e in events)
    streams = {}
    for e in events:
        s = streams.setdefault(e["stream"], {"kernel_us": 0.0, "htod_us": 0.0, "copy_us": 0.0, "htod_bytes": 0,
                                             "kernels": 0})
        s[f"{e['kind']}_us"] += e["t1"] - e["t0"]
        s["kernels"] += e["kind"] == "kernel"
        if e["kind"] == "htod":
            s["htod_bytes"] += e["bytes"]
    compute = max(streams, key=lambda k: streams[k]["kernel_us"])
    busy = union([(e["t0"], e["t1"]) for e in events if e["kind"] == "kernel" and e["stream"] == compute])
    htod = union([(e["t0"], e["t1"]) for e in events if e["kind"] == "htod"])
    hidden = length(intersect(htod, busy))
    wall = t_end - t_start
    htod_bytes = sum(e["bytes"] for e in events if e["kind"] == "htod")
    either = length(union(busy + htod))
    return {
        "wall_s": wall / 1e6, "compute_stream": compute,
        "compute_busy_s": length(busy) / 1e6, "compute_busy_share": length(busy) / wall,
        "htod_s": length(htod) / 1e6, "htod_hidden_s": hidden / 1e6, "htod_exposed_s": (length(htod) - hidden) / 1e6,
        "idle_s": (wall - either) / 1e6, "htod_bytes": htod_bytes,
        "htod_gbps_while_copying": htod_bytes / (length(htod) / 1e6) / 1e9 if htod else 0.0,
        "streams": {str(k): v for k, v in sorted(streams.items())},
    }


def draw(events: list[dict], stats: dict, path: Path, title: str, zoom: tuple[float, float]) -> None:
    """Lanes per stream: the whole prompt, and a window of a few layers below it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = min(e["t0"] for e in events)
    streams = sorted({e["stream"] for e in events}, key=lambda s: (s != stats["compute_stream"], s))
    colors = {"kernel": "tab:blue", "htod": "tab:orange", "copy": "tab:gray"}
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 0.9 * len(streams)), constrained_layout=True)
    for ax, (lo, hi) in zip(axes, [(0.0, stats["wall_s"] * 1e3), zoom]):
        for row, s in enumerate(streams):
            for kind, color in colors.items():
                bars = [((e["t0"] - t0) / 1e3, (e["t1"] - e["t0"]) / 1e3) for e in events
                        if e["stream"] == s and e["kind"] == kind and (e["t1"] - t0) / 1e3 >= lo and (e["t0"] - t0) / 1e3 <= hi]
                if bars:
                    ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color, label=kind if row == 0 or kind != "kernel" else None)
        ax.set_yticks(range(len(streams)))
        ax.set_yticklabels([("compute " if s == stats["compute_stream"] else "") + f"stream {s}" for s in streams])
        ax.set_xlim(lo, hi)
        ax.set_xlabel("ms from the prompt's first GPU operation")
        ax.invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    seen = {}
    for h, lab in zip(handles, labels):
        seen.setdefault({"kernel": "kernels", "htod": "host-to-device copies", "copy": "other copies"}[lab], h)
    axes[0].legend(seen.values(), seen.keys(), loc="upper right", ncol=3)
    axes[0].set_title(f"{title}\ncompute busy {stats['compute_busy_share']:.0%}, copies {stats['htod_s']:.2f} s "
                      f"({stats['htod_hidden_s']:.2f} s beside compute, {stats['htod_exposed_s']:.2f} s exposed), "
                      f"{stats['htod_gbps_while_copying']:.1f} GB/s while copying")
    axes[1].set_title("a few layers of the first ubatch")
    fig.savefig(path, dpi=110)


def trace_prompt(args) -> tuple[dict, str]:
    """Run the Session and trace one prompt; returns the Chrome trace and a title."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise SystemExit("bench/timeline.py traces with PyTorch's profiler (CUPTI): run it with a Python that has "
                         "PyTorch with CUDA, or give --trace FILE to analyse a trace")
    from pyllama_pp import synth
    from pyllama_pp.planning import models_dir
    from pyllama_pp.params import ContextParams, Placement
    from pyllama_pp.session import Session
    model = args.model or str(synth.cached_model(models_dir(), args.preset, seed=1))
    ctx = ContextParams(n_ctx=args.p + 8, n_batch=args.p, n_ubatch=args.ubatch)
    placement = Placement(host_experts=args.host_experts, load_mode=args.load_mode)
    with Session(model, devices=args.devices, placement=placement, ctx=ctx, variant=args.variant) as s:
        prompt = np.random.default_rng(0).integers(0, s.info.n_vocab, args.p).tolist()
        warm = s.eval(prompt, logits="none", stats=False).seconds
        n_layer = s.info.n_layer
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = s.eval(prompt, logits="none", stats=False)
            torch.cuda.synchronize()
        tmp = Path(args.out) / "trace.json"
        prof.export_chrome_trace(str(tmp))
        trace = json.loads(tmp.read_text())
        tmp.unlink()
    where = "every weight in VRAM" if args.host_experts == "none" else \
        f"{args.load_mode if args.load_mode != 'none' else 'pinned'} host experts"
    title = (f"{Path(model).stem}, {args.devices}, pp{args.p} / ub{args.ubatch}, {args.variant}, "
             f"{where}: {args.p / res.seconds:.0f} t/s "
             f"traced ({args.p / warm:.0f} warm-up)")
    trace["pyllama_pp"] = {"title": title, "n_layer": n_layer, "seconds": res.seconds, "warmup_seconds": warm, "args": vars(args),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    return trace, title


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="synth preset (default: qwen3-30b-a3b)")
    ap.add_argument("--model", help="a GGUF instead of a preset")
    ap.add_argument("--devices", default="cuda:0", help="device spec (default: cuda:0)")
    ap.add_argument("--variant", default="patched", choices=["patched", "baseline"])
    ap.add_argument("--load-mode", default="none", choices=["none", "mmap"])
    ap.add_argument("--host-experts", default="all", choices=["all", "none"],
                    help="experts in host RAM (default: all) or none (every weight in VRAM, the reference)")
    ap.add_argument("-p", type=int, default=16384, help="prompt tokens (default: 16384)")
    ap.add_argument("-ub", "--ubatch", type=int, default=8192, help="n_ubatch (default: 8192)")
    ap.add_argument("--layers-shown", type=int, default=4, help="layers in the lower, zoomed panel (default: 4)")
    ap.add_argument("--trace", help="analyse and draw this trace (trace.json.gz) instead of running")
    ap.add_argument("--out", default=str(HERE / "out" / "timeline"), help="folder for the picture and tables")
    ap.add_argument("--budget", type=float, default=0, help=argparse.SUPPRESS)   # (gpu_run.sh passes one)
    ap.add_argument("--json", action="store_true", help="the figures as one JSON document on stdout")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        opener = gzip.open if args.trace.endswith(".gz") else open
        with opener(args.trace, "rt") as f:
            trace = json.load(f)
        title = trace.get("pyllama_pp", {}).get("title", Path(args.trace).name)
    else:
        trace, title = trace_prompt(args)
        with gzip.open(out / "trace.json.gz", "wt") as f:
            json.dump(trace, f)
    events = gpu_events(trace)
    stats = analyse(events)
    meta = trace.get("pyllama_pp", {})
    run = meta.get("args", vars(args))
    n_ubatch = max(1, -(-run["p"] // run["ubatch"]))
    per_layer_ms = stats["wall_s"] * 1e3 / (n_ubatch * meta.get("n_layer", 48))
    lo = 0.25 * stats["wall_s"] * 1e3 / n_ubatch   # (a quarter into the first ubatch)
    draw(events, stats, out / "timeline.png", title, (lo, lo + args.layers_shown * per_layer_ms))
    stats = {"title": title, **{k: v for k, v in meta.items() if k != "title"}, **stats}
    (out / "timeline.json").write_text(json.dumps(stats, indent=1))
    if args.json:
        print(json.dumps(stats))
    else:
        print(title)
        for k in ("wall_s", "compute_busy_s", "compute_busy_share", "htod_s", "htod_hidden_s", "htod_exposed_s",
                  "idle_s", "htod_gbps_while_copying"):
            print(f"  {k}: {stats[k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
