#!/usr/bin/env python3
"""Decode cost of the patched scheduler's switches, in ONE process: the model is loaded once and each switch set
gets its own llama context beside the others (the scheduler copies the switches when a context is created), so
the sets share the model's memory and differ only in the scheduler. Rounds run every set once, the order reversed
every other round; each set's paired speedup over the first set is the median over pairs of rounds with its
bootstrap interval (pyllama_pp.stats.paired_ci). The patched scheduler's host waits and submit times per token come with
each set.

    python bench/decode_probe.py --preset qwen3-30b-a3b --devices cuda --sets GATE=0 "" EARLY_INPUTS=0 --out DIR
    python bench/decode_probe.py --model tiny.gguf --devices "vdev:1x256MiB@0.1GBps" --sets GATE=0 "" --rounds 40

A set is a comma-separated list of NAME=VALUE switches ("" = the defaults). Only the patched build has switches,
so this measures the mechanisms' cost against the patched build's own GATE=0 (upstream's single-device path);
`pyllama-pp ab --paired` gives the figure against the baseline build.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional
from pathlib import Path

import numpy as np

from pyllama_pp import synth
from pyllama_pp.jobs import InfoJob
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.session import Session
from pyllama_pp.stats import paired_ci
from pyllama_pp.worker.handlers import HANDLERS

from _clock import left, log   # bench/_clock.py (this script's folder is on sys.path)


def parse_set(text: str) -> dict:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"decode_probe: switch {item!r} needs NAME=VALUE")
        out[name.strip().upper()] = int(value)
    return out


def tg_run(s: Session, toks: np.ndarray, n: int, prefix: Optional[np.ndarray] = None) -> float:
    """llama-bench's tg: from an empty cache, position 0 untimed, then n single-token decodes; with `prefix` (its
    -d), the prefix in one eval first (untimed), then n decodes after it."""
    s.eval(toks[:1] if prefix is None else prefix, logits="last", stats=False)
    first = 1 if prefix is None else len(prefix)
    t0 = time.perf_counter()
    for i in range(n):
        j = (i + 1) % len(toks) if prefix is None else i
        s.eval(toks[j: j + 1], logits="last", pos0=first + i, clear=False, stats=False)
    return time.perf_counter() - t0


def switch_contexts(s: Session, sets: list, ctxp: ContextParams) -> list:
    """A context of s's model per switch set (each from the switches as they are now: the defaults, or what the
    environment set), all at once; the session's own context is closed and the sets' take its place in turn."""
    base = {sw["name"]: sw["value"] for sw in HANDLERS["info"](InfoJob(variant="patched"))["switches"]}
    ctxs = []
    for sw in sets:
        s._apply_switches({**base, **sw})
        ctxs.append(s._model.context(ctxp, coverage=False))
    s._apply_switches(base)
    s._ctx.close()
    return ctxs


def close_contexts(s: Session, ctxs: list) -> None:
    """Free switch_contexts' contexts, then the session."""
    for c in ctxs:
        c.close()
    s._ctx = None
    s.close()


def waits(ext: dict) -> dict:
    """Host wait (us) by cause, and submit time (us) per backend, from the patched counters."""
    out = {f"wait_{k}": v for k, v in (ext.get("host_wait_us") or {}).items()}
    for b in ext.get("backends", []):
        out[f"submit_{b['name']}"] = b.get("submit_us", 0)
    out["graphs"] = ext.get("graphs", 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--devices", default="cuda")
    ap.add_argument("--sets", nargs="+", default=["GATE=0", ""])
    ap.add_argument("-n", type=int, default=32, help="tokens per tg run")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0, help="stop starting rounds after this many seconds")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "decode_probe"),
                    help="output folder for decode_probe.json / .md (default bench/out/decode_probe, git-ignored)")
    args = ap.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        ap.error(f"--rounds must be an even number of at least 2 (rounds pair up), got {args.rounds}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = f"/tmp/pp_models/{args.preset}-uniform.gguf"
        if not Path(model).exists():
            Path(model).parent.mkdir(parents=True, exist_ok=True)
            synth.write_gguf(model, synth.preset(args.preset, seed=1, routing="uniform"))
            log(f"wrote {model}")
    sets = [parse_set(t) for t in args.sets]
    names = [t or "defaults" for t in args.sets]
    ctxp = ContextParams(n_ctx=args.n_ctx, n_batch=512, n_ubatch=512)
    s = Session(model, devices=args.devices, placement=Placement(host_experts="all"), ctx=ctxp, variant="patched")
    log(f"loaded {model}")
    ctxs = switch_contexts(s, sets, ctxp)
    toks = np.random.default_rng(1).integers(0, s.info.n_vocab, args.n + 1, dtype=np.int64)
    pp = []
    for c in ctxs:
        s._ctx = c
        pp.append(s.schedule().pipeline_parallel)
        tg_run(s, toks, args.n)  # warm-up
    samples = [[] for _ in sets]
    counters = [[] for _ in sets]
    per_round = None
    for r in range(args.rounds):
        if args.budget and per_round and left(args.budget) < 2 * per_round and r % 2 == 0:   # (a pair: two rounds)
            log(f"budget: stopping after {r} rounds")
            break
        t_r = time.time()
        order = range(len(sets)) if r % 2 == 0 else reversed(range(len(sets)))
        for i in order:
            s._ctx = ctxs[i]
            e0 = s.ext_stats()
            dt = tg_run(s, toks, args.n)
            e1 = s.ext_stats()
            samples[i].append(args.n / dt)
            w0, w1 = waits(e0), waits(e1)
            counters[i].append({k: (w1[k] - w0.get(k, 0)) / args.n for k in w1})
        per_round = time.time() - t_r
    rows = []
    for i, name in enumerate(names):
        ts = np.asarray(samples[i])
        med, lo, hi = paired_ci(ts / np.asarray(samples[0])) if i else (1.0, 1.0, 1.0)
        keys = sorted({k for c in counters[i] for k in c})
        per_tok = {k: float(np.mean([c.get(k, 0) for c in counters[i]])) for k in keys}
        rows.append({"set": name, "pipeline_parallel": pp[i], "avg_ts": float(ts.mean()), "stddev_ts": float(ts.std(ddof=1)),
                     "paired": med, "paired_lo": lo, "paired_hi": hi, "rounds": len(ts), "per_token": per_tok,
                     "samples_ts": ts.tolist()})
    (out / "decode_probe.json").write_text(json.dumps({"model": model, "devices": args.devices, "n": args.n,
                                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                        "rows": rows}, indent=1))
    lines = [f"| set | PP | avg_ts | stddev_ts | vs {names[0]} (paired, 95%) | host waits us/token (largest) |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    for row in rows:
        w = sorted(((v, k) for k, v in row["per_token"].items() if k.startswith("wait_")), reverse=True)[:3]
        lines.append(f"| {row['set']} | {'on' if row['pipeline_parallel'] else 'off'} | {row['avg_ts']:.2f} | "
                     f"{row['stddev_ts']:.2f} | {row['paired']:.3f} [{row['paired_lo']:.3f}, {row['paired_hi']:.3f}] "
                     f"({row['rounds']}) | " + ", ".join(f"{k[5:]} {v:.0f}" for v, k in w) + " |")
    table = "\n".join(lines)
    (out / "decode_probe.md").write_text(f"{model} on {args.devices}, tg{args.n}\n\n{table}\n")
    print(table)
    close_contexts(s, ctxs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
