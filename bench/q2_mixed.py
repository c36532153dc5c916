#!/usr/bin/env python3
"""Q2: does the gain hold on mixed GPUs (unequal compute speed, unequal memory)?

Two VDEVs with their own throttled links, every expert in host RAM, pp2048 with n_batch 2048 / n_ubatch 128
(near-full expert coverage; --reps repetitions) and tg16 (its own worker, at least 10 repetitions):
  - compute speed factors 1:1, 1:2 (second device 2x slower), 2:1 (first device 2x slower) at the fixed
    tensor split (3,5 with the default model);
  - unequal memory budgets (JSON spec, 64 MiB and 256 MiB) with llama.cpp's default split (layers in
    proportion to free memory, as a user who sets no -ts gets) and with the fixed split.
With --devices, a plain `vdev:NxMEM@RATE` spec is varied the same way; any other spec(s) run as given.
"""
from __future__ import annotations

import sys

import _common as C
from pyllama_pp import runner

MEMORIES = ("64MiB", "256MiB")


def plan(args, ts):
    """[(label, devices, tensor_split)]"""
    base = C.device_list(args, [C.DEFAULT_DEVICES])
    if len(base) == 1 and C.vdev_with(base[0], "") is not None:
        b = base[0]
        out = [("speed 1:1", b, ts), ("speed 1:2", C.vdev_with(b, ",speed=1:2"), ts),
               ("speed 2:1", C.vdev_with(b, ",speed=2:1"), ts)]
        js = C.vdev_json(b, MEMORIES)
        if js:
            out += [(f"mem {MEMORIES[0]}/{MEMORIES[1]}, default split", js, None),
                    (f"mem {MEMORIES[0]}/{MEMORIES[1]}, ts {','.join(f'{x:g}' for x in ts)}" if ts else
                     f"mem {MEMORIES[0]}/{MEMORIES[1]}", js, ts)]
        # dedupe (ts None twice)
        seen, uniq = set(), []
        for lab, dev, t in out:
            key = (dev, tuple(t) if t else None)
            if key not in seen:
                seen.add(key)
                uniq.append((lab, dev, t))
        return uniq
    return [(C.short_devices(d), d, ts) for d in base]


def main() -> int:
    args = C.parser("q2_mixed", __doc__, reps=2).parse_args()
    ctx = C.setup(args)
    nb = 1024 if args.quick else 2048
    tg_reps = 3 if args.quick else max(10, args.reps)   # tg16 takes ~20 ms: more repetitions, own worker
    cfgs = []
    for lab, dev, ts in plan(args, ctx["ts"]):
        for tests, reps in (([["pp", nb]], args.reps), ([["tg", 16]], tg_reps)):
            cfgs.append(C.config(ctx["model"], dev, ts=ts, n_batch=nb, n_ubatch=128, tests=tests, reps=reps,
                                 label=lab))
    df = runner.ab(cfgs, out_dir=ctx["out"], timeout=args.timeout)

    # layer placement facts: non-expert weight bytes per device tell how many layers each device owns
    rows = []
    for _, b, p in C.pairs(df):
        ref = p or b
        rows.append([ref.get("label"), ref.get("test"), C.cov(ref), C.fmt_ts(b), C.fmt_ts(p),
                     C.num(C.speedup(b, p), "{:.2f}"), C.pp_onoff(b, p), C.per_dev(b), C.per_dev(p),
                     C.num(b.get("bound_ts") if b else None), C.num(p.get("bound_ts") if p else None),
                     C.syncs(b, p), C.num(p.get("id_readbacks") if p else None)])
    table = C.md_table(["config", "test", "coverage", "baseline t/s", "patched t/s", "speedup", "PP b/p",
                        "bytes/dev baseline", "bytes/dev patched", "bound t/s b", "bound t/s p", "host syncs b / p",
                        "id readbacks p"], rows, "llrrrrllrrrlr")
    specs = "\n".join(f"- {lab}: `{dev}`, tensor split {ts if ts else 'llama.cpp default'}"
                      for lab, dev, ts in plan(args, ctx["ts"]))
    C.ab_plot(df, ctx["out"] / "q2_mixed.png", "Q2: mixed devices, experts on host, b/ub "
              f"{nb}/128", label=lambda r: r.get("label") or "")
    C.finish(ctx, "Q2: mixed GPUs (speed factors, unequal memory)",
             "Every expert in host RAM. Speed factor = compute slow-down of a VDEV (1 = CPU kernels at full speed). "
             "`bytes/dev` = host-to-device bytes per run per device (which device streams how many MoE layers).",
             f"Configurations:\n\n{specs}\n\n{table}", df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
