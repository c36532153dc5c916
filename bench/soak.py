#!/usr/bin/env python3
"""The soak: N mixed calls in ONE session and context on two devices (VDEVs, or CUDA's), every expert in host RAM.

Calls mix batch sizes below the op-offload threshold (32 tokens), between it and the upload-all bar (128 tokens
for the tiny model's 64 experts / 2 used; 64 while a graph is in flight) and above it; outputs all / last / none /
a few rows; new prompts (a clear), continuations, rewinds (the cache cut back with llama_memory_seq_rm, decoded
again from there) and context shifts (seq_rm + seq_add: the keys rotated at the next decode). See pyllama_pp.soak.

Checks, each in the worker that holds the session: no crash; host RSS (VmRSS after malloc_trim) grows at most 5%
after the warm-up; the VDEVs' allocated bytes are the same at every checkpoint after the warm-up (on CUDA: the
memory in use as cudaMemGetInfo reports it stays within max(16 MiB, 0.5%) of the first checkpoint after the
warm-up); the logits of every checkpoint recipe equal those of a fresh session (its own worker) from an empty
context (exact, or NMSE <= 1e-6). Exit code 1 when a check fails.

    python bench/soak.py [--calls 1000] [--variant patched|baseline|both] [--devices vdev:2x256MiB@4GBps]
                         [--check-every 50] [--seed 0] [--model M.gguf] [--out soak.json] [--switch NAME=V ...]

`--switch` sets a patched scheduler switch for the patched soak (the baseline has none), e.g. `--switch
EXPERT_CACHE=1`: the device expert cache, whose slots are then part of the judged device memory and must stay within
the switch's MiB per device. The VRAM line after the tables says it in one line per variant: the devices' memory at
the warm-up's end and after the last call, the peak, the expert slots' share and the cache's hits.

On the GPU machine (the tiny preset still: a correctness and leak soak, not a speed test), `--devices cuda` takes
the first two CUDA devices (one if there is one; `cuda:0,1,2` etc. as given), also two devices of one GPU with
GGML_CUDA_DEVICES=2 CUDA_VISIBLE_DEVICES=0:
    python bench/soak.py --devices cuda --calls 300 --variant both --out DIR/soak.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _common as C
from pyllama_pp import report, soak
from pyllama_pp.errors import PyllamaError
from pyllama_pp.planning import check_switches
from pyllama_pp.switches import parse_given as parse_switches

MiB = 1024 * 1024


def cuda_cell(c: dict) -> str:
    """CUDA memory in use per device at the last checkpoint (MiB), flat or not, and the largest drift."""
    used = " / ".join(f"{u / MiB:.1f}" for u in c["used_bytes"][-1])
    drift = max(c["drift_bytes"], key=abs, default=0)
    return f"{used} ({'flat' if c['flat'] else 'MOVED'}, drift {drift / MiB:+.1f})"


def table(results: list) -> str:
    rows = []
    for r in results:
        if r.cuda:
            mem = cuda_cell(r.cuda)
        else:
            alloc = " / ".join(report.fmt_bytes(b) for b in r.alloc_bytes[-1])
            flat = "flat" if all(a == r.alloc_bytes[0] for a in r.alloc_bytes) else "MOVED"
            mem = f"{alloc} ({flat})"
        rows.append([r.variant, r.calls, r.evals, f"{r.shifts} / {r.rewinds} / {r.clears}", f"{r.seconds:.1f}",
                     f"{r.rss_start / MiB:.1f}", f"{r.rss_warm / MiB:.1f}", f"{r.rss_end / MiB:.1f}",
                     f"{100 * r.rss_growth:+.2f}%", f"{r.rss_untrimmed_max / MiB:.1f}", mem,
                     f"{r.matched}/{r.checkpoints} ({r.exact} exact)", "ok" if r.ok else "FAIL"])
    mem = "CUDA in use per device MiB" if any(r.cuda for r in results) else "alloc per VDEV"
    return C.md_table(["variant", "calls", "evals", "shifts / rewinds / clears", "s", "RSS start MiB",
                       "RSS warm MiB", "RSS end MiB", "growth", "RSS untrimmed max MiB", mem,
                       "checkpoints matched", "result"], rows, "lrrlrrrrrrlrl")


def cuda_lines(r) -> list:
    """Each CUDA device's memory in use (MiB): at the start, at the warm-up's end, at every checkpoint after it."""
    def mib(b):
        return "?" if b is None else f"{b / MiB:.1f}"

    c, out = r.cuda, []
    for k, name in enumerate(c["devices"]):
        total, start = c["total_bytes"][k], c["used_start_bytes"][k]
        warm = c["warm_used_bytes"][k] if c["warm_used_bytes"] else None
        out.append(f"{r.variant} {name} in use MiB (of {mib(total)}): start {mib(start)}, warm {mib(warm)}, after: "
                   + " ".join(mib(u[k]) for u in c["used_bytes"])
                   + f"; largest drift {c['drift_bytes'][k] / MiB:+.1f} (at most {c['tolerance_bytes'][k] / MiB:.1f})")
    return out


def vram_line(r) -> str:
    """One line: each VDEV's allocated bytes at the warm-up's end and after the last call, whether every checkpoint
    after the warm-up had the same, the peak, the expert slots among them (EXPERT_CACHE) with the cache's hits over
    the soak, and the host RSS after the warm-up."""
    def per_dev(values) -> str:
        return " / ".join(report.fmt_bytes(v) for v in values)

    flat = all(a == r.alloc_bytes[0] for a in r.alloc_bytes)
    line = (f"{r.variant} VRAM (allocated per VDEV): {per_dev(r.alloc_bytes[0])} at the warm-up's end, "
            f"{per_dev(r.alloc_bytes[-1])} after call {r.calls}, {'the same' if flat else 'MOVED'} at all "
            f"{len(r.alloc_bytes) - 1} checkpoints after the warm-up; peak {per_dev(r.rows[-1]['peak_alloc_bytes'])}")
    if r.cache_buffer_bytes:
        ext = r.ext or {}
        looked = ext.get("cache_hits", 0) + ext.get("cache_misses", 0)
        rate = f" ({100 * ext.get('cache_hits', 0) / looked:.1f}% hits)" if looked else ""
        line += (f"; of it expert slots {per_dev(r.cache_buffer_bytes.values())} (EXPERT_CACHE={r.expert_cache}), "
                 f"which read {ext.get('cache_ops', 0)} expert ops: {ext.get('cache_hits', 0)} hits, "
                 f"{ext.get('cache_misses', 0)} misses{rate}" +
                 (f", of which the host CPU computed {ext['cache_cpu_misses']} (EXPERT_HYBRID)"
                  if ext.get("cache_cpu_misses") else ""))
    return line + (f"; host RSS {r.rss_warm / MiB:.1f} MiB after the warm-up, at most {100 * r.rss_growth:+.2f}% "
                   f"more after it, {r.rss_end / MiB:.1f} MiB at the end")


def band_table(results: list) -> str:
    rows = []
    for r in results:
        for name, b in r.bands.items():
            # (host->device bytes are VDEV counters: CUDA devices have none)
            h2d = "n/a" if r.cuda else report.fmt_bytes(b["h2d_bytes"] / max(b["calls"], 1))
            rows.append([r.variant, name, b["calls"], b["tokens"], h2d])
    return C.md_table(["variant", "batch sizes", "calls", "tokens", "host->device per call"], rows, "llrrr")


def main() -> int:
    ap = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000, help="mixed calls in the one context (default 1000)")
    ap.add_argument("--variant", default="patched", choices=["patched", "baseline", "both"])
    ap.add_argument("--devices", default="vdev:2x256MiB@4GBps",
                    help="device spec (default %(default)s; `cuda`: the first two CUDA devices)")
    ap.add_argument("--check-every", type=int, default=50, help="calls between checkpoints (default 50)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up calls (default 0: one of each batch size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help=f"GGUF model (default: the tiny preset with {C.N_LAYER} layers)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the results (and every checkpoint) as JSON: to this .json file, or to soak.json (and "
                         "the tables to soak.md) in this folder")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    ap.add_argument("--switch", action="append", metavar="NAME=VALUE",
                    help="a patched scheduler switch for the patched soak, repeatable (e.g. EXPERT_CACHE=1)")
    args = ap.parse_args()
    if args.calls < 1 or args.check_every < 1 or args.warmup < 0:
        ap.error("--calls and --check-every must be >= 1, --warmup >= 0")
    out = args.out
    if out is not None and (out.is_dir() or out.suffix != ".json"):   # a folder: made now, not after the soak
        out.mkdir(parents=True, exist_ok=True)
        out = out / "soak.json"
    model = args.model or str(C.synth_model())
    variants = ["baseline", "patched"] if args.variant == "both" else [args.variant]
    results, t0 = [], time.time()
    try:
        switches = parse_switches(args.switch)
        check_switches(switches, variants)
        devices = soak.soak_devices(args.devices, variants[-1])
    except PyllamaError as e:
        print(f"pyllama-pp soak: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if devices != args.devices:
        print(f"{args.devices}: {devices} (the soak's default: two devices where there are two)", flush=True)
    for v in variants:
        print(f"{v}: {args.calls} calls on {devices} ...", flush=True)
        try:
            r = soak.run(model, v, devices=devices, calls=args.calls, seed=args.seed,
                         check_every=args.check_every, warmup=args.warmup, timeout=args.timeout,
                         switches=switches if v == "patched" else None)
        except PyllamaError as e:   # a crash (WorkerError) or an error in the session: the soak failed
            print(f"pyllama-pp soak: {v}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        results.append(r)
    lines = [table(results), band_table(results)]
    for r in results:
        if r.ext:
            lines.append(f"{r.variant} scheduler counters over the soak: "
                         + ", ".join(f"{k} {v}" for k, v in r.ext.items()))
        if r.cuda:
            lines += cuda_lines(r)
        else:
            lines.append(vram_line(r))
        for p in r.problems:
            lines.append(f"{r.variant}: {p}")
    print()
    print("\n".join(lines))
    if out:
        doc = {"command": C.command_line(), "machine": C.machine(), "model": model, "seconds": time.time() - t0,
               "results": [r.to_dict() for r in results]}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=float) + "\n")
        if out != args.out:
            (out.parent / "soak.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
