#!/usr/bin/env python3
"""Q4: PCIe topology: does the gain survive when both devices hang off ONE host link?

Same bandwidth per link (0.1 GB/s by default): two dedicated links (vdev:2x256MiB@0.1GBps) vs one link shared
by both devices (the same spec plus ",shared"; a switch behind one upstream port). Every expert in host RAM,
n_batch = 16 x n_ubatch, pp = n_batch, n_ubatch 64 and 128. "Gain left" = (shared speedup - 1) / (dedicated
speedup - 1): the share of the patched build's gain that remains on a shared link.
With --devices, a plain `vdev:NxMEM@RATE` spec gets its ",shared" twin; any other spec(s) run as given.
"""
from __future__ import annotations

import sys

import _common as C
from pyllama_pp import runner

UBATCHES = (64, 128)


def main() -> int:
    args = C.parser("q4_topology", __doc__, reps=2).parse_args()
    ctx = C.setup(args)
    base = C.device_list(args, [C.DEFAULT_DEVICES])
    if len(base) == 1 and C.vdev_with(base[0], "") is not None:
        specs = [("dedicated", base[0]), ("shared", C.vdev_with(base[0], ",shared"))]
    else:
        specs = [(C.short_devices(d), d) for d in base]
    ubs = (128,) if args.quick else UBATCHES
    cfgs = [C.config(ctx["model"], dev, ts=ctx["ts"], n_batch=16 * ub, n_ubatch=ub, tests=[["pp", 16 * ub]],
                     reps=args.reps, label=lab)
            for ub in ubs for lab, dev in specs]
    df = runner.ab(cfgs, out_dir=ctx["out"], timeout=args.timeout)

    body = [C.ab_table(df, label=lambda r: r.get("label") or "")]
    if len(specs) == 2:
        rows = []
        for ub in ubs:
            got = {}
            for _, b, p in C.pairs(df[df.n_ubatch == ub]):
                got[(p or b)["label"]] = (b, p)
            (bd, pd_), (bs, ps) = got.get(specs[0][0], (None, None)), got.get(specs[1][0], (None, None))
            sd, ss = C.speedup(bd, pd_), C.speedup(bs, ps)
            left = (ss - 1) / (sd - 1) if C.isnum(sd) and C.isnum(ss) and sd and abs(sd - 1) > 1e-9 else None
            rows.append([ub, f"pp{16 * ub}", C.fmt_ts(bd), C.fmt_ts(pd_), C.num(sd, "{:.2f}"), C.fmt_ts(bs),
                         C.fmt_ts(ps), C.num(ss, "{:.2f}"), C.num(100 * left if left is not None else None, "{:.0f}%"),
                         C.num(C.speedup(bd, bs), "{:.2f}"), C.num(C.speedup(pd_, ps), "{:.2f}")])
        body.insert(0, "## what is left of the gain on one shared link\n\n" + C.md_table(
            ["n_ubatch", "test", "baseline dedicated", "patched dedicated", "speedup dedicated", "baseline shared",
             "patched shared", "speedup shared", "gain left", "baseline shared/dedicated",
             "patched shared/dedicated"], rows, "rlrrrrrrrrr") + "\n## all runs\n")
    C.ab_plot(df, ctx["out"] / "q4_topology.png", "Q4: dedicated links vs one shared link, experts on host",
              label=lambda r: f"{r.get('label')} ub{r['n_ubatch']}")
    C.finish(ctx, "Q4: PCIe topology (dedicated links vs one shared link)",
             "Specs: " + "; ".join(f"{lab} = `{dev}`" for lab, dev in specs) + ". The bound column adds the bytes "
             "of all devices on a shared link.", "\n".join(body), df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
