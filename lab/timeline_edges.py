"""Where a traced prompt's compute stream waits: a closer reading of bench/timeline.py's trace.json.gz.

For each trace (one pp prompt, PyTorch profiler / CUPTI):
- the compute stream's gaps (no kernel on it), each split into the part a host-to-device copy ran (exposed copy) and
  the part nothing ran (idle), and classified by when the kernel after the gap was submitted: after the stream went
  idle ("host late": the host thread had not launched it yet) or before ("queued": it waited on an event of another
  stream, or on nothing seen here);
- the gaps by the kernels on either side, and by segment of the graph (a segment ends at each occurrence of a
  kernel that runs once per layer and ubatch: with LAYER_MAJOR the segments run layer by layer, ubatch by ubatch
  inside a layer; without it ubatch by ubatch, layer by layer inside a ubatch);
- kernel time per kernel name, and for each name the mean time of its launches that ran beside a host-to-device
  copy against those that did not (memory bandwidth taken by the copy engine);
- the host thread's CUDA runtime calls by name (synchronisations, event waits, launches).

    python lab/timeline_edges.py DIR/trace.json.gz [...] --out DIR [--compact]
        (--compact also writes events.npz: every kernel and copy, names as indices, for reading again)
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import importlib.util
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("timeline", HERE.parent / "bench" / "timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


def short(name: str) -> str:
    """A kernel's name without return type, template arguments and parameters."""
    n = re.sub(r"^void ", "", name)
    n = re.split(r"[<(]", n, maxsplit=1)[0]
    return n.strip() or name[:40]


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def runtime_events(trace: dict) -> list[dict]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            t0 = float(e["ts"])
            out.append({"name": e.get("name", ""), "t0": t0, "t1": t0 + float(e.get("dur", 0)), "tid": e.get("tid"),
                        "corr": (e.get("args") or {}).get("correlation")})
    return out


class Cover:
    """Length of [a, b] under merged, sorted intervals."""

    def __init__(self, iv: list[tuple[float, float]]):
        self.iv, self.starts = iv, [x[0] for x in iv]

    def __call__(self, a: float, b: float) -> float:
        if b <= a or not self.iv:
            return 0.0
        i, tot = max(0, bisect.bisect_right(self.starts, a) - 1), 0.0
        while i < len(self.iv) and self.iv[i][0] < b:
            lo, hi = max(a, self.iv[i][0]), min(b, self.iv[i][1])
            tot += max(0.0, hi - lo)
            i += 1
        return tot


def edges(trace: dict, gap_min_us: float = 2.0) -> dict:
    events = timeline.gpu_events(trace)
    # kernels' correlation ids (gpu_events drops them)
    corr = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            corr[(float(e["ts"]), int((e.get("args") or {}).get("stream", e.get("tid", 0))))] = \
                (e.get("args") or {}).get("correlation")
    stats = timeline.analyse(events)
    meta = trace.get("pyllama_pp", {})
    run = meta.get("args", {})
    n_layer = int(meta.get("n_layer", 48))
    n_ub = max(1, -(-int(run.get("p", 16384)) // int(run.get("ubatch", 4096))))
    cs = stats["compute_stream"]
    ks = sorted((e for e in events if e["kind"] == "kernel" and e["stream"] == cs), key=lambda e: e["t0"])
    htod = Cover(timeline.union([(e["t0"], e["t1"]) for e in events if e["kind"] == "htod"]))
    other_k = Cover(timeline.union([(e["t0"], e["t1"]) for e in events if e["kind"] == "kernel" and e["stream"] != cs]))
    rt = runtime_events(trace)
    launch_end = {r["corr"]: r["t1"] for r in rt if r["corr"] is not None and "Launch" in r["name"]}

    # per kernel name: time, and beside a copy or not
    names: dict = defaultdict(lambda: {"n": 0, "us": 0.0, "n_beside": 0, "us_beside": 0.0})
    for k in ks:
        d = k["t1"] - k["t0"]
        s = names[short(k["name"])]
        s["n"] += 1
        s["us"] += d
        if d > 0 and htod(k["t0"], k["t1"]) > 0.5 * d:
            s["n_beside"] += 1
            s["us_beside"] += d
    kernels = {}
    for n, s in sorted(names.items(), key=lambda x: -x[1]["us"]):
        alone_n, alone_us = s["n"] - s["n_beside"], s["us"] - s["us_beside"]
        kernels[n] = {"n": s["n"], "total_ms": s["us"] / 1e3, "mean_us": s["us"] / s["n"],
                      "n_beside_copy": s["n_beside"],
                      "mean_us_beside_copy": s["us_beside"] / s["n_beside"] if s["n_beside"] else None,
                      "mean_us_alone": alone_us / alone_n if alone_n else None}

    # a segment marker: a kernel name that runs once per layer and ubatch (the earliest-starting such name)
    counts = {n: s["n"] for n, s in names.items()}
    cands = [n for n, c in counts.items() if c == n_layer * n_ub]
    marker = None
    if cands:
        first = {}
        for k in ks:
            first.setdefault(short(k["name"]), k["t0"])
        marker = min(cands, key=lambda n: first[n])

    # gaps
    gaps = []
    end = ks[0]["t1"] if ks else 0.0
    seg = 0
    for i in range(1, len(ks)):
        prev, k = ks[i - 1], ks[i]
        if marker and short(prev["name"]) == marker:
            seg += 1
        g0, g1 = end, k["t0"]
        end = max(end, k["t1"])
        if g1 - g0 < gap_min_us:
            continue
        le = launch_end.get(corr.get((k["t0"], k["stream"])))
        cp = htod(g0, g1)
        gaps.append({"t0": g0, "t1": g1, "us": g1 - g0, "copy_us": cp, "idle_us": (g1 - g0) - cp,
                     "other_kernel_us": other_k(g0, g1),
                     "host_late": (le is not None and le >= g0), "launch_known": le is not None,
                     "prev": short(prev["name"]), "next": short(k["name"]), "seg": seg})
    tot = lambda xs, key="us": sum(x[key] for x in xs) / 1e6
    by_pair: dict = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
    for g in gaps:
        b = by_pair[f"{g['prev']} -> {g['next']}"]
        b[0] += 1
        b[1] += g["us"]
        b[2] += g["copy_us"]
        b[3] += g["idle_us"]
        b[4] += g["host_late"]
    pairs = [{"pair": p, "n": b[0], "s": b[1] / 1e6, "copy_s": b[2] / 1e6, "idle_s": b[3] / 1e6, "n_host_late": b[4]}
             for p, b in sorted(by_pair.items(), key=lambda x: -x[1][1])][:20]
    hist = {}
    for lo, hi in ((gap_min_us, 10), (10, 100), (100, 1000), (1000, 1e12)):
        sel = [g for g in gaps if lo <= g["us"] < hi]
        hist[f"{lo:g}-{hi:g}us" if hi < 1e12 else f">={lo:g}us"] = {"n": len(sel), "s": tot(sel)}
    # segments: the gap time in each segment position (layer-major: seg = layer * n_ub + ub)
    seg_gap = defaultdict(float)
    seg_copy = defaultdict(float)
    for g in gaps:
        seg_gap[g["seg"]] += g["us"]
        seg_copy[g["seg"]] += g["copy_us"]
    by_ub_pos = defaultdict(float)   # layer-major: the position of the ubatch inside its layer
    by_layer_pos = defaultdict(float)   # ubatch-major: the layer inside its ubatch
    for s, us in seg_gap.items():
        by_ub_pos[s % n_ub] += us
        by_layer_pos[s % n_layer] += us
    rt_by: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rt:
        b = rt_by[r["name"]]
        b[0] += 1
        b[1] += r["t1"] - r["t0"]
        b[2] = max(b[2], r["t1"] - r["t0"])
    runtime = {n: {"n": b[0], "total_ms": b[1] / 1e3, "max_ms": b[2] / 1e3}
               for n, b in sorted(rt_by.items(), key=lambda x: -x[1][1])[:15]}
    wall = stats["wall_s"]
    host_late = [g for g in gaps if g["host_late"]]
    return {
        "title": meta.get("title"), "n_layer": n_layer, "n_ubatch_per_prompt": n_ub, "marker": marker,
        "wall_s": wall, "compute_busy_s": stats["compute_busy_s"], "kernel_sum_s": sum(s["us"] for s in names.values()) / 1e6,
        "htod_s": stats["htod_s"], "htod_hidden_s": stats["htod_hidden_s"], "htod_exposed_s": stats["htod_exposed_s"],
        "idle_s": stats["idle_s"], "htod_bytes": stats["htod_bytes"],
        "htod_gbps_while_copying": stats["htod_gbps_while_copying"],
        "lead_in_s": (ks[0]["t0"] - min(e["t0"] for e in events)) / 1e6 if ks else 0.0,
        "tail_s": (max(e["t1"] for e in events) - max(k["t1"] for k in ks)) / 1e6 if ks else 0.0,
        "gaps": {"n": len(gaps), "s": tot(gaps), "copy_s": tot(gaps, "copy_us"), "idle_s": tot(gaps, "idle_us"),
                 "host_late_n": len(host_late), "host_late_s": tot(host_late),
                 "host_late_idle_s": tot(host_late, "idle_us"),
                 "queued_s": tot([g for g in gaps if not g["host_late"] and g["launch_known"]]),
                 "launch_unknown_s": tot([g for g in gaps if not g["launch_known"]]),
                 "by_size": hist, "by_pair": pairs,
                 "by_ubatch_position_in_layer_s": {k: v / 1e6 for k, v in sorted(by_ub_pos.items())},
                 "by_layer_position_in_ubatch_s": {k: v / 1e6 for k, v in sorted(by_layer_pos.items())},
                 "largest": sorted(({"ms": g["us"] / 1e3, "copy_ms": g["copy_us"] / 1e3, "prev": g["prev"],
                                     "next": g["next"], "seg": g["seg"], "host_late": g["host_late"],
                                     "at_ms": (g["t0"] - min(e["t0"] for e in events)) / 1e3}
                                    for g in gaps), key=lambda x: -x["ms"])[:15]},
        "kernels": kernels, "runtime": runtime,
    }


def compact(trace: dict, path: Path) -> None:
    ev = timeline.gpu_events(trace)
    names = sorted({e["name"] for e in ev})
    idx = {n: i for i, n in enumerate(names)}
    kinds = ["kernel", "htod", "copy"]
    arr = np.array([(kinds.index(e["kind"]), e["stream"], e["t0"], e["t1"], e["bytes"], idx[e["name"]]) for e in ev],
                   dtype=np.float64)
    np.savez_compressed(path, events=arr, names=np.array(names), columns=np.array(
        ["kind(0 kernel,1 htod,2 copy)", "stream", "t0_us", "t1_us", "bytes", "name"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compact", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for t in args.traces:
        trace = load(t)
        name = Path(t).parent.name or Path(t).stem
        r = edges(trace)
        (out / f"edges_{name}.json").write_text(json.dumps(r, indent=1))
        if args.compact:
            compact(trace, out / f"events_{name}.npz")
        g = r["gaps"]
        print(f"{name}: {r['title']}\n  wall {r['wall_s']:.3f} s, compute busy {r['compute_busy_s']:.3f}, kernel sum "
              f"{r['kernel_sum_s']:.3f}, htod {r['htod_s']:.3f} (exposed {r['htod_exposed_s']:.3f}), idle {r['idle_s']:.3f}"
              f"\n  gaps {g['n']}: {g['s']:.3f} s (copy {g['copy_s']:.3f}, idle {g['idle_s']:.3f}; host late "
              f"{g['host_late_n']}: {g['host_late_s']:.3f} s), lead-in {r['lead_in_s']:.3f}, tail {r['tail_s']:.3f}, "
              f"marker {r['marker']}")
        for p in g["by_pair"][:6]:
            print(f"    {p['pair']}: {p['n']} gaps, {p['s'] * 1e3:.1f} ms (copy {p['copy_s'] * 1e3:.1f}, host late {p['n_host_late']})")
        for n, k in list(r["kernels"].items())[:8]:
            print(f"    {n}: {k['n']} x {k['mean_us']:.1f} us = {k['total_ms']:.1f} ms; beside copy "
                  f"{k['mean_us_beside_copy'] or 0:.1f} us ({k['n_beside_copy']}), alone {k['mean_us_alone'] or 0:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
