#!/usr/bin/env python3
"""Q1: how much throughput does pipelining recover against non-pipelined host offload?

Every expert stays in host RAM (host experts all); the baseline build does not pipeline (upstream switches it
off under tensor overrides), the patched build does. Matrix: n_ubatch in (32, 64, 128) x prompt length in
(512, 1024, 2048), n_batch = prompt length, so one pp test is one llama_decode call.

- Table 1, the n_ubatch sweep: the diagonal n_batch = 16 x n_ubatch, pp = n_batch (16 ubatches per batch).
- Table 2, users tune n_ubatch: for each prompt length, each variant at its best n_ubatch (and the patched
  build at the baseline's best n_ubatch).
"""
from __future__ import annotations

import sys

import _common as C
from pyllama_pp import runner

UBATCHES = (32, 64, 128)
PROMPTS = (512, 1024, 2048)


def main() -> int:
    args = C.parser("q1_recovered", __doc__, reps=2).parse_args()
    ctx = C.setup(args)
    ubs, pps = (UBATCHES, (512, 1024)) if args.quick else (UBATCHES, PROMPTS)
    devs = C.device_list(args, [C.DEFAULT_DEVICES])
    cfgs = []
    for dev in devs:
        for pp in pps:
            for ub in ubs:
                if ub > pp:
                    continue
                cfgs.append(C.config(ctx["model"], dev, ts=ctx["ts"], n_batch=pp, n_ubatch=ub, tests=[["pp", pp]],
                                     reps=args.reps, label=f"ub{ub} b{pp}"))
    df = runner.ab(cfgs, out_dir=ctx["out"], timeout=args.timeout)

    body = []
    for dev in devs:
        d = df[df.devices == dev]
        diag = d[(d.n_batch == 16 * d.n_ubatch)]
        body.append(f"## n_ubatch sweep, n_batch = 16 x n_ubatch, pp = n_batch ({C.short_devices(dev)})\n\n"
                    + C.ab_table(diag, label=lambda r: f"ub{r['n_ubatch']}"))
        # best n_ubatch per prompt length, per variant
        rows, best_plot = [], {"groups": [], "baseline": [], "patched": [], "notes": []}
        for pp in pps:
            g = d[(d.test == f"pp{pp}") & d.avg_ts.notna()]
            best = {}
            for v in ("baseline", "patched"):
                gv = g[g.variant == v]
                if not gv.empty:
                    best[v] = gv.loc[gv.avg_ts.idxmax()].to_dict()
            b, p = best.get("baseline"), best.get("patched")
            p_at_b = None
            if b is not None:
                m = g[(g.variant == "patched") & (g.n_ubatch == b["n_ubatch"])]
                p_at_b = m.iloc[0].to_dict() if not m.empty else None
            sp = C.speedup(b, p)
            sp2 = C.speedup(b, p_at_b)
            best_plot["groups"].append(f"pp{pp}\nbest ub b={b and b['n_ubatch']} p={p and p['n_ubatch']}")
            best_plot["baseline"].append(b["avg_ts"] if b else float("nan"))
            best_plot["patched"].append(p["avg_ts"] if p else float("nan"))
            best_plot["notes"].append(f"{sp:.2f}x" if sp else "")
            rows.append([f"pp{pp}", pp, b and b["n_ubatch"], C.fmt_ts(b), p and p["n_ubatch"], C.fmt_ts(p),
                         C.num(sp, "{:.2f}"), C.num(sp2, "{:.2f}"), C.cov(p), C.num(p.get("bound_ts") if p else None),
                         C.syncs(b, p), C.num(p.get("id_readbacks") if p else None)])
        body.append(f"## each variant at its best n_ubatch (of {', '.join(map(str, ubs))}), n_batch = prompt length "
                    f"({C.short_devices(dev)})\n\n" + C.md_table(
                        ["test", "n_batch", "baseline best ub", "baseline t/s", "patched best ub", "patched t/s",
                         "speedup best/best", "speedup at baseline's ub", "coverage (patched's ub)",
                         "bound t/s p", "host syncs b / p", "id readbacks p"], rows, "lrrrrrrrrrlr"))
        if dev == devs[0]:
            C.bar_plot(best_plot["groups"], {"baseline": best_plot["baseline"], "patched": best_plot["patched"]},
                       ctx["out"] / "q1_best_ubatch.png", "Q1: each variant at its best n_ubatch, n_batch = prompt "
                       "length, experts on host", notes=best_plot["notes"])
        body.append(f"## all runs ({C.short_devices(dev)})\n\n" + C.ab_table(d, label=lambda r: f"ub{r['n_ubatch']}"))
    C.ab_plot(df[df.n_batch == 16 * df.n_ubatch], ctx["out"] / "q1_recovered.png",
              "Q1: baseline (no pipelining) vs patched, experts on host, n_batch = 16 x n_ubatch",
              label=lambda r: f"ub{r['n_ubatch']} b{r['n_batch']}")
    C.finish(ctx, "Q1: throughput recovered vs non-pipelined host offload",
             "Every expert in host RAM; baseline = upstream (pipelining off), patched = pipelining on. "
             "Columns: coverage = experts used per layer per ubatch / n_expert; bound = tokens/s the bytes moved "
             "allow over the links; host syncs per run (VDEV counter); id readbacks and upload-all decisions per "
             "run (patched counters).", "\n".join(body), df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
