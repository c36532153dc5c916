#!/usr/bin/env python3
"""The soak: N mixed calls in ONE session and context on two virtual devices, every expert in host RAM.

Calls mix batch sizes below the op-offload threshold (32 tokens), between it and the upload-all bar (128 tokens
for the tiny model's 64 experts / 2 used; 64 while a graph is in flight) and above it; outputs all / last / none /
a few rows; new prompts (a clear), continuations, rewinds (the cache cut back with llama_memory_seq_rm, decoded
again from there) and context shifts (seq_rm + seq_add: the keys rotated at the next decode). See pyllama_pp.soak.

Checks, each in the worker that holds the session: no crash; host RSS (VmRSS after malloc_trim) grows at most 5%
after the warm-up; the VDEVs' allocated bytes are the same at every checkpoint after the warm-up; the logits of
every checkpoint recipe equal those of a fresh session (its own worker) from an empty context (exact, or NMSE
<= 1e-6). Exit code 1 when a check fails.

    python bench/soak.py [--calls 1000] [--variant patched|baseline|both] [--devices vdev:2x256MiB@4GBps]
                         [--check-every 50] [--seed 0] [--model M.gguf] [--out soak.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _common as C
from pyllama_pp import bench, soak
from pyllama_pp.errors import PyllamaError

MiB = 1024 * 1024


def table(results: list) -> str:
    rows = []
    for r in results:
        alloc = " / ".join(bench.fmt_bytes(b) for b in r.alloc_bytes[-1])
        flat = "flat" if all(a == r.alloc_bytes[0] for a in r.alloc_bytes) else "MOVED"
        rows.append([r.variant, r.calls, r.evals, f"{r.shifts} / {r.rewinds} / {r.clears}", f"{r.seconds:.1f}",
                     f"{r.rss_start / MiB:.1f}", f"{r.rss_warm / MiB:.1f}", f"{r.rss_end / MiB:.1f}",
                     f"{100 * r.rss_growth:+.2f}%", f"{r.rss_untrimmed_max / MiB:.1f}", f"{alloc} ({flat})",
                     f"{r.matched}/{r.checkpoints} ({r.exact} exact)", "ok" if r.ok else "FAIL"])
    return C.md_table(["variant", "calls", "evals", "shifts / rewinds / clears", "s", "RSS start MiB",
                       "RSS warm MiB", "RSS end MiB", "growth", "RSS untrimmed max MiB", "alloc per VDEV",
                       "checkpoints matched", "result"], rows, "lrrlrrrrrrlrl")


def band_table(results: list) -> str:
    rows = []
    for r in results:
        for name, b in r.bands.items():
            rows.append([r.variant, name, b["calls"], b["tokens"], bench.fmt_bytes(b["h2d_bytes"] / max(b["calls"], 1))])
    return C.md_table(["variant", "batch sizes", "calls", "tokens", "host->device per call"], rows, "llrrr")


def main() -> int:
    ap = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="mixed calls in the one context (default 1000)")
    ap.add_argument("--variant", default="patched", choices=["patched", "baseline", "both"])
    ap.add_argument("--devices", default="vdev:2x256MiB@4GBps", help="device spec (default %(default)s)")
    ap.add_argument("--check-every", type=int, default=50, help="calls between checkpoints (default 50)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up calls (default 0: one of each batch size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help=f"GGUF model (default: the tiny preset with {C.N_LAYER} layers)")
    ap.add_argument("--out", type=Path, default=None, help="write the results (and every checkpoint) as JSON")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    args = ap.parse_args()
    if args.calls < 1 or args.check_every < 1 or args.warmup < 0:
        ap.error("--calls and --check-every must be >= 1, --warmup >= 0")
    model = args.model or str(C.synth_model())
    variants = ["baseline", "patched"] if args.variant == "both" else [args.variant]
    results, t0 = [], time.time()
    for v in variants:
        print(f"{v}: {args.calls} calls on {args.devices} ...", flush=True)
        try:
            r = soak.run(model, v, devices=args.devices, calls=args.calls, seed=args.seed,
                         check_every=args.check_every, warmup=args.warmup, timeout=args.timeout)
        except PyllamaError as e:   # a crash (WorkerError) or an error in the session: the soak failed
            print(f"pyllama-pp soak: {v}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        results.append(r)
    print()
    print(table(results))
    print(band_table(results))
    for r in results:
        if r.ext:
            print(f"{r.variant} scheduler counters over the soak: " + ", ".join(f"{k} {v}" for k, v in r.ext.items()))
        for p in r.problems:
            print(f"{r.variant}: {p}")
    if args.out:
        doc = {"command": C.command_line(), "machine": C.machine(), "model": model, "seconds": time.time() - t0,
               "results": [r.to_dict() for r in results]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=float) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
