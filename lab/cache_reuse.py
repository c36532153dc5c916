#!/usr/bin/env python3
"""Why a replacement policy does or does not beat LRU on a routing trace: the reuse structure of its lookups.

  python lab/cache_reuse.py TRACE.npz [TRACE.npz ...] [--slots 16] [--out FILE.md]

For each trace (`bench/cache_hits.py` writes them as trace-<i>.npz), over the tokens after the warm-up (a quarter):

- the LRU stack: before each token, each layer's experts ordered by their last lookup (most recent first; never
  looked up: last); the chance that the expert at depth d is looked up by the token, per band of depths. Under the
  LRU stack model, LRU is the optimal online policy when this chance does not rise with depth (Coffman & Denning,
  "Operating Systems Theory", 1973, ch. 6): a cache of c slots then holds the c likeliest experts.
- the same chance at the depths around the eviction point of `--slots` slots (the LRU victim and its neighbours),
  split by what a frequency-aware policy sees: the expert's lookups in the last 64 tokens (LFU-like), and whether it
  had a lookup before its last within 64 tokens (LRU-2-like). A policy that keeps the "frequent" half instead of
  the LRU order wins only as far as those halves differ in chance at the same depth.
- each policy's sensitivity to its knob at `--slots` slots (slru's protected share, 2q's Kin, tinylfu's sample,
  lfu_aged's half-life), against LRU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pyllama_pp import expert_cache_sim as sim
from pyllama_pp.expert_trace import ExpertTrace

BANDS = ((1, 8), (9, 12), (13, 16), (17, 20), (21, 24), (25, 32), (33, 48), (49, 64), (65, 128))
WINDOW = 64


def stack_chances(tr: ExpertTrace, slots: int, warmup: int) -> dict:
    """Per depth (1-based) the lookups and the visits, and at depths slots-3 .. slots+4 the same split by frequency."""
    E = tr.n_expert
    looked = np.zeros(E + 1)
    seen = np.zeros(E + 1)
    split = {k: np.zeros(2) for k in ("freq_hi", "freq_lo", "two_hi", "two_lo")}
    for c in range(len(tr.layers)):
        steps = sim._steps(tr, c)
        last = np.full(E, -10 ** 9)
        prev = np.full(E, -10 ** 9)
        hist = []
        for t, ids in enumerate(steps):
            order = np.lexsort((np.arange(E), -last))   # most recent first (ties: the lower id)
            if t >= warmup:
                used = np.zeros(E, bool)
                used[ids] = True
                depth_used = used[order]
                looked[1:] += depth_used
                seen[1:] += 1
                band = order[max(0, slots - 4):slots + 4]   # depths slots-3 .. slots+4
                recent = np.zeros(E)
                for r in hist[-WINDOW:]:
                    recent[r] += 1
                med = np.median(recent[band])
                for e in band:
                    hi = recent[e] > med
                    split["freq_hi" if hi else "freq_lo"] += (used[e], 1)
                    two = t - prev[e] <= WINDOW
                    split["two_hi" if two else "two_lo"] += (used[e], 1)
            prev[ids] = last[ids]
            last[ids] = t
            hist.append(ids)
    return {"chance": looked[1:] / np.maximum(seen[1:], 1), "split": split}


def knob_sweep(tr: ExpertTrace, slots: int, warmup: int) -> list:
    """(policy, knob, value, hit rate) at `slots` slots, each knob of the module's constants varied."""
    fraction = slots / tr.n_expert
    lookups = int((tr.ids[warmup:] >= 0).sum())

    def rate(make) -> float:
        h = 0
        for c in range(len(tr.layers)):
            cache = make()
            h += sum(x for t, x in enumerate(cache.step(ids) for ids in sim._steps(tr, c)) if t >= warmup)
        return h / lookups

    E = tr.n_expert
    rows = [("lru", "", "", sim.simulate(tr, fraction, "lru", warmup)["hit_rate"])]
    rows += [("slru", "protected", v, rate(lambda v=v: sim._SLRU(slots, protected=v))) for v in (0.25, 0.5, 0.8, 0.9)]
    rows += [("2q", "Kin", v, rate(lambda v=v: sim._TwoQ(slots, k_in=v))) for v in (0.1, 0.25, 0.5)]
    rows += [("tinylfu", "sample", v, rate(lambda v=v: sim._TinyLFU(slots, E, sample=v))) for v in (1, 2, 10, 40)]
    rows += [("lfu_aged", "half-life", v, sim.simulate(tr, fraction, "lfu_aged", warmup, half_life=v)["hit_rate"])
             for v in (1.0, 2.0, 4.0, 16.0)]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--slots", type=int, default=16, help="the cache whose eviction point is examined (default 16)")
    ap.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = ap.parse_args()
    out = []
    for path in args.traces:
        tr = ExpertTrace.load(path)
        warmup = sim.default_warmup(tr)
        s = stack_chances(tr, args.slots, warmup)
        ch = s["chance"]
        out.append(f"### {path}\n\n{tr.n_tokens} tokens, {len(tr.layers)} layers, {tr.ids.shape[2]} of {tr.n_expert} "
                   f"experts a token, warm-up {warmup}\n\nChance that the expert at LRU depth d is looked up by the "
                   f"next token (LRU with c slots hits the sum over d <= c, about):\n")
        out.append("| depth | " + " | ".join(f"{a}-{b}" for a, b in BANDS) + " |")
        out.append("| --- |" + " ---: |" * len(BANDS))
        out.append("| chance a depth | " + " | ".join(f"{ch[a - 1:b].mean():.3f}" for a, b in BANDS) + " |")
        out.append("| share of lookups | " + " | ".join(f"{ch[a - 1:b].sum() / ch.sum():.1%}" for a, b in BANDS)
                   + " |")
        means = [ch[a - 1:b].mean() for a, b in BANDS]
        rises = [f"{BANDS[i][0]}-{BANDS[i][1]}" for i in range(1, len(BANDS)) if means[i] > means[i - 1]]
        out.append(f"\nBands whose chance is above the band before: {', '.join(rises) or 'none'}.\n")
        sp = s["split"]
        out.append(f"At depths {args.slots - 3}-{args.slots + 4} (around {args.slots} slots' LRU victim), chance of "
                   f"a lookup by the next token:\n")
        out.append("| split | chance | share of those entries |")
        out.append("| --- | ---: | ---: |")
        n = sp["freq_hi"][1] + sp["freq_lo"][1]
        for k, label in (("freq_hi", f"lookups in the last {WINDOW} tokens above the band's median"),
                         ("freq_lo", "at or below it"),
                         ("two_hi", f"a lookup before the last within {WINDOW} tokens (LRU-2 keeps)"),
                         ("two_lo", "none (LRU-2 evicts first)")):
            hit, m = sp[k]
            out.append(f"| {label} | {hit / max(m, 1):.3f} | {m / n:.0%} |")
        out.append(f"\nKnobs at {args.slots} slots (hit rate):\n")
        out.append("| policy | knob | value | hit rate |")
        out.append("| --- | --- | ---: | ---: |")
        for p, k, v, r in knob_sweep(tr, args.slots, warmup):
            out.append(f"| {p} | {k} | {v} | {r:.1%} |")
        out.append("")
        print("\n".join(out[-40:]), flush=True)
    if args.out:
        args.out.write_text("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
