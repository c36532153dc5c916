#!/usr/bin/env python3
"""Expert-cache hit rates: for a trace of routing decisions (`pyllama-pp trace -o T.npz`), the hit rate of a
per-layer cache of each policy (LRU, LFU, aged LFU, LRU-2, SLRU, 2Q, ARC, LRU behind a TinyLFU admission filter,
static top-N, Belady's optimum) against its size, a fraction of each layer's experts (pyllama_pp.expert_cache_sim
defines the policies and what a hit is).

  python bench/cache_hits.py TRACE.npz --out DIR
  python bench/cache_hits.py --model MODEL [-p N] [-n M] [--devices SPEC] --out DIR     (traces first)
  python bench/cache_hits.py --synth small --set routing=locality --set locality=0.75,0.83 --out DIR

--synth PRESET writes synthetic models (the cache, as the CLI's) with each combination of the --set values
(FIELD=V[,V...]: any SynthConfig field) and traces each. Writes hits.csv (every policy x fraction per trace),
results.md (the summary table: LRU at 12.5% and 25%, static top 6.25% and its multiple of its share, Belady at
12.5%; then each trace's table), hits-<i>.png (hit rate vs cache fraction, a line per policy) and the traces
(trace-<i>.npz) into --out (default pyllama_pp_out/cache_hits-DATE-TIME in the current folder, as `pyllama-pp ab`
writes its rows: never into the checkout the script is in). A bad input (a missing or broken trace, a file that is
not a GGUF, a model without experts) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import _common as C
import pandas as pd

from pyllama_pp import synth
from pyllama_pp import trace as tracing
from pyllama_pp.expert_cache_sim import DEFAULT_FRACTIONS, DEFAULT_HALF_LIFE, POLICIES, hit_rates, locality_summary
from pyllama_pp.errors import PyllamaError
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.model_file import check_model_path
from pyllama_pp.planning import models_dir

# the published anchors the summary sets beside each trace (llama.cpp PR #27861, a 512-expert model)
ANCHORS = {"lru_12.5%": 0.67, "lru_25%": 0.81}


def _value(s: str):
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def synth_models(preset: str, sets: list[str]) -> list[tuple[str, Path]]:
    """(label, path) of a synthetic model for each combination of the --set values, written once into the cache."""
    fields, choices = [], []
    for item in sets:
        name, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"cache_hits.py: --set takes FIELD=V[,V...], got {item!r}")
        fields.append(name)
        choices.append([_value(v) for v in values.split(",")])
    out = []
    for combo in itertools.product(*choices):
        kw = dict(zip(fields, combo))
        label = f"{preset} " + " ".join(f"{k}={v}" for k, v in kw.items())
        out.append((label.strip(), synth.cached_model(models_dir(), preset, **kw)))
    return out


def plot(df: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib   # (late: only the plot needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # (late: as above)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, g in df.groupby("policy", sort=False):
        ax.plot(g.fraction * 100, g.hit_rate * 100, marker="o", label=policy)
    for (name, y), x in zip(ANCHORS.items(), (12.5, 25.0)):
        ax.scatter([x], [y * 100], marker="x", color="black", zorder=3)
    ax.scatter([], [], marker="x", color="black", label="LRU, PR #27861 (512 experts)")
    ax.set_xlabel("cache size (% of each layer's experts)")
    ax.set_ylabel("hit rate (% of expert lookups)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_row(label: str, tr: ExpertTrace, df: pd.DataFrame) -> dict:
    def rate(policy: str, fraction: float) -> float:
        return float(df[(df.policy == policy) & (df.fraction == fraction)].hit_rate.iloc[0])
    loc = locality_summary(tr)
    static = rate("static", 0.0625)
    return {"trace": label, "tokens": tr.n_tokens, "layers": len(tr.layers), "experts": f"{tr.ids.shape[2]}/{tr.n_expert}",
            "shared_lag1": loc["overlap_lag1"], "shared_far": loc["overlap_random"],
            "lru_12.5%": rate("lru", 0.125), "lru_25%": rate("lru", 0.25), "static_6.25%": static,
            "static_x_share": static / 0.0625, "lfu_aged_12.5%": rate("lfu_aged", 0.125),
            "belady_12.5%": rate("belady", 0.125)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", type=Path, help="trace files (.npz from `pyllama-pp trace -o`)")
    ap.add_argument("--model", action="append", default=[], help="a GGUF to trace first (repeatable)")
    ap.add_argument("--synth", metavar="PRESET", help="trace synthetic models of this preset (with --set)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=V[,V...]",
                    help="with --synth: a SynthConfig field's values (each combination is a model)")
    ap.add_argument("-p", "--pp", type=int, default=0, help="prompt tokens of a trace made here (default 0)")
    ap.add_argument("-n", "--tg", type=int, default=512, help="decoded tokens of a trace made here (default 512)")
    C.add_trace_options(ap, DEFAULT_FRACTIONS)
    ap.add_argument("--devices", default="cpu", help="device spec of a trace made here (default cpu)")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES),
                    help=f"policies (default: {','.join(POLICIES)})")
    ap.add_argument("--warmup", type=int, default=None,
                    help="tokens that warm the caches uncounted (default: the prompt, or the first quarter)")
    ap.add_argument("--half-life", type=float, default=DEFAULT_HALF_LIFE, help="lfu_aged's half-life in tokens")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: pyllama_pp_out/cache_hits-DATE-TIME in the current folder)")
    args = ap.parse_args()
    try:
        return run(ap, args)
    except (PyllamaError, ValueError, OSError) as e:   # (one line: what is wrong; no traceback)
        kind = getattr(e, "error_type", None) or type(e).__name__
        print(f"cache_hits.py: error: {kind}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def run(ap: argparse.ArgumentParser, args) -> int:
    """Trace (where asked), simulate, write the files; errors go up to main."""
    args.out = args.out or Path("pyllama_pp_out") / time.strftime("cache_hits-%Y%m%d-%H%M%S")
    fractions = sorted(set(args.fractions) | {0.0625, 0.125, 0.25})   # (the summary's columns)
    policies = list(dict.fromkeys(args.policies + ["lru", "static", "lfu_aged", "belady"]))
    t0 = time.time()
    sources = [(p.name, p) for p in args.traces] + [(Path(m).name, Path(m)) for m in args.model]
    if args.synth:
        sources += synth_models(args.synth, args.set)
    if not sources:
        ap.error("give a trace, --model or --synth")
    for _, src in sources:   # (before the output folder is made)
        if not src.is_file():
            raise FileNotFoundError(f"{src}: no such file (a trace from `pyllama-pp trace -o T.npz`, or a GGUF)")
        if src.suffix == ".gguf":
            check_model_path(src)
    traces = {src: ExpertTrace.load(src) for _, src in sources if src.suffix != ".gguf"}
    args.out.mkdir(parents=True, exist_ok=True)
    frames, rows, sections = [], [], []
    for i, (label, src) in enumerate(sources):
        if src.suffix == ".gguf":
            print(f"tracing {label}: -p {args.pp} -n {args.tg} on {args.devices}", flush=True)
            tr = tracing.record(src, n_prompt=args.pp, n_decode=args.tg, seed=args.seed, devices=args.devices)
            tr.save(args.out / f"trace-{i}.npz")
        else:
            tr = traces[src]
        df = hit_rates(tr, fractions, policies, args.warmup, args.half_life)
        df.insert(0, "trace", label)
        frames.append(df)
        rows.append(summary_row(label, tr, df))
        plot(df, args.out / f"hits-{i}.png", label)
        wide = df.pivot(index="fraction", columns="policy", values="hit_rate")[policies]
        sections.append(f"### {label}\n\n{tr.n_tokens} tokens ({tr.n_prompt} prompt), {len(tr.layers)} MoE layers, "
                        f"warm-up {int(df.warmup.iloc[0])} tokens; hit rate per policy (plot: hits-{i}.png)\n\n"
                        + C.md_table(["cache"] + policies,
                                     [[f"{f:.2%} ({int(df[df.fraction == f].capacity.iloc[0])})"]
                                      + [f"{wide.loc[f, p]:.1%}" for p in policies] for f in wide.index],
                                     "l" + "r" * len(policies)))
    pd.concat(frames).to_csv(args.out / "hits.csv", index=False)
    m = C.machine()
    cols = ["trace", "tokens", "layers", "experts", "shared_lag1", "shared_far", "lru_12.5%", "lru_25%",
            "static_6.25%", "static_x_share", "lfu_aged_12.5%", "belady_12.5%"]
    body = C.md_table(cols, [[r[c] if not isinstance(r[c], float) else
                              (f"{r[c]:.2f}x" if c == "static_x_share" else f"{r[c]:.1%}") for c in cols]
                             for r in rows], "llll" + "r" * (len(cols) - 4))
    md = (f"# Expert-cache hit rates\n\n- command: `{C.command_line()}`\n- machine: {m['host']}, nproc {m['nproc']}, "
          f"{m['cpu']}\n- date: {m['date_utc']}\n- wall time: {time.time() - t0:.0f} s\n\n"
          f"Anchors (llama.cpp PR #27861, 512 experts): LRU 12.5% -> {ANCHORS['lru_12.5%']:.0%}, 25% -> "
          f"{ANCHORS['lru_25%']:.0%}; a static top list weak (top 6.25% about 1.5x its share).\n\n"
          + body + "\n" + "\n".join(sections))
    (args.out / "results.md").write_text(md)
    print(md)
    print(f"files: {args.out}/results.md, hits.csv, hits-*.png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
