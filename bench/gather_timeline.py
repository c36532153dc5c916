"""Where the link waits: the CUDA gather's timeline (PYLLAMA_PP_GATHER_TIMELINE=PREFIX, gather_cuda.cu).

With that variable set, pyllama_pp's CUDA gather library stamps each gather's start and end on its GPU's gather
stream (the device's global timer) and the bytes it read, and writes them at exit to PREFIX.<pid>.csv. One stream
per GPU carries every gather, so the gaps between one gather's end and the next one's start are the time the link
sat idle - and the gather that ends a gap says what it waited for:

- `rest:gate` / `used:gate`: a layer's first expert op, which waits for the router computed just before it;
- `used:up` / `used:down`: OVERLAP=2's early gathers (ids known), placed one split early;
- `prefetch:gate`: PREFETCH's copy of the gate's last used experts, a split early.

Each gap is given as a sum and as the median gap before that kind (sums hide whether every gap is short or a few
are long). Where the file has the `queued_ns` column (files written since the library stamps when the host queued each gather), "host lead" is how long before a gather
started the host had queued it (the library's CLOCK_REALTIME against the GPU's global timer, the same clock on the
H200 machine): milliseconds mean the GPU had the work long before it ran, so its gaps were GPU-side waits; near 0
means the host queued just in time.

A run is a burst of gathers: a gap longer than --split-ms starts a new one (the bench's warm-up and repetitions).
Only gathers are stamped: the link may carry other uploads in a gap (upload-all copies, activations, on a shared
link the other device's copies), so "idle" means "no gather", which is the link's idle time only where every
expert op gathers (low coverage).

    python bench/gather_timeline.py out/timeline/overlap2-ub1024-tl.*.csv [--json]   (.csv.gz as well)
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import sys
from pathlib import Path

MODES = {0: "used", 1: "prefetch", 2: "rest"}   # gather_abi.h


def weight_kind(name: str) -> str:
    m = re.search(r"ffn_(gate|up|down)", name)
    return m.group(1) if m else "other"


def read(paths) -> list[dict]:
    rows = []
    for p in paths:
        with (gzip.open(p, "rt", newline="") if str(p).endswith(".gz") else open(p, newline="")) as f:
            for r in csv.DictReader(f):
                rows.append({"gpu": int(r["gpu"]), "seq": int(r["seq"]),
                             "kind": f"{MODES.get(int(r['mode']), r['mode'])}:{weight_kind(r['weight'])}",
                             "t0": int(r["t0_ns"]), "t1": int(r["t1_ns"]), "bytes": int(r["bytes"]), "file": str(p),
                             "queued": int(r["queued_ns"]) if r.get("queued_ns") else None})
    return rows


def bursts(recs: list[dict], split_ns: float) -> list[list[dict]]:
    """One GPU's completed gathers (in stream order) cut where the link idled longer than split_ns."""
    out: list[list[dict]] = []
    for r in recs:
        if out and r["t0"] - out[-1][-1]["t1"] <= split_ns:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def quantile(xs: list, q: float):
    """The q-quantile of xs (the element at floor(q * n) of the sorted list); None for none."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def summarize_burst(b: list[dict]) -> dict:
    span = b[-1]["t1"] - b[0]["t0"]
    busy = sum(r["t1"] - r["t0"] for r in b)
    kinds: dict = {}
    gaps: dict = {}
    for i, r in enumerate(b):
        k = kinds.setdefault(r["kind"], {"count": 0, "busy_ms": 0.0, "gap_before_ms": 0.0, "bytes": 0})
        k["count"] += 1
        k["busy_ms"] += (r["t1"] - r["t0"]) / 1e6
        k["bytes"] += r["bytes"]
        if i > 0:
            gap = max(0, r["t0"] - b[i - 1]["t1"]) / 1e6
            k["gap_before_ms"] += gap
            gaps.setdefault(r["kind"], []).append(gap)
    for name, k in kinds.items():
        k["gbps"] = k["bytes"] / (k["busy_ms"] * 1e6) if k["busy_ms"] > 0 else None
        med = quantile(gaps.get(name, []), 0.5)
        k["gap_p50_us"] = med * 1e3 if med is not None else None
    total = sum(r["bytes"] for r in b)
    lead = [(r["t0"] - r["queued"]) / 1e6 for r in b if r.get("queued")]
    return {"gathers": len(b), "span_ms": span / 1e6, "busy_ms": busy / 1e6, "idle_ms": (span - busy) / 1e6,
            "busy_frac": busy / span if span > 0 else None, "bytes": total,
            "gbps_busy": total / busy if busy > 0 else None,
            "host_lead_ms_p10": quantile(lead, 0.1), "host_lead_ms_p50": quantile(lead, 0.5), "kinds": kinds}


def summarize(rows: list[dict], split_ms: float = 20.0, min_gathers: int = 50) -> list[dict]:
    """Per file and GPU, per burst of at least min_gathers completed gathers: link busy / idle time, and the idle
    time before each kind of gather."""
    out = []
    for key in sorted({(r["file"], r["gpu"]) for r in rows}):
        recs = sorted((r for r in rows if (r["file"], r["gpu"]) == key and r["t0"] > 0 and r["t1"] >= r["t0"]),
                      key=lambda r: r["seq"])
        for i, b in enumerate(x for x in bursts(recs, split_ms * 1e6) if len(x) >= min_gathers):
            out.append({"file": Path(key[0]).name, "gpu": key[1], "burst": i, **summarize_burst(b)})
    return out


def markdown(summary: list[dict]) -> str:
    lines = ["| file | gpu | burst | gathers | span ms | link busy | GB/s busy | host lead ms p10 / p50 | idle ms " +
             "before: kind (count, median gap us, GB/s) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def kind(k: str, v: dict) -> str:
        inner = [str(v["count"])]
        if v.get("gap_p50_us") is not None:
            inner.append(f"{v['gap_p50_us']:.0f} us")
        if v["gbps"]:
            inner.append(f"{v['gbps']:.1f} GB/s")
        return f"{k} {v['gap_before_ms']:.1f} ({', '.join(inner)})"

    for s in summary:
        gaps = ", ".join(kind(k, v) for k, v in sorted(s["kinds"].items()))
        busy = f"{s['busy_frac']:.1%}" if s["busy_frac"] is not None else "-"
        gbps = f"{s['gbps_busy']:.1f}" if s["gbps_busy"] is not None else "-"
        lead = (f"{s['host_lead_ms_p10']:.1f} / {s['host_lead_ms_p50']:.1f}" if s.get("host_lead_ms_p50") is not None
                else "-")
        lines.append(f"| {s['file']} | {s['gpu']} | {s['burst']} | {s['gathers']} | {s['span_ms']:.1f} | {busy} | "
                     f"{gbps} | {lead} | {gaps} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--split-ms", type=float, default=20.0, help="an idle link longer than this starts a new run")
    ap.add_argument("--min-gathers", type=int, default=50, help="runs with fewer gathers are left out")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    missing = [str(p) for p in a.files if not p.is_file()]
    if missing:
        print(f"gather_timeline: no such file: {', '.join(missing)} (PYLLAMA_PP_GATHER_TIMELINE=PREFIX writes "
              "PREFIX.<pid>.csv at exit)", file=sys.stderr)
        return 2
    try:
        s = summarize(read(a.files), a.split_ms, a.min_gathers)
    except (KeyError, ValueError, TypeError) as e:
        print(f"gather_timeline: not a gather timeline ({e}); expected the columns gpu,seq,mode,weight,t0_ns,t1_ns,"
              "bytes (and queued_ns)", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=1) if a.json else markdown(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
