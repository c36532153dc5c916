#!/usr/bin/env python3
"""Q5: upload all experts (no routing-id readback, no host sync) or copy only the used ones?

Patched-only switch sweep (switches, i.e. GGML_SCHED_PP_*), the baseline build as the reference:
  selective  UPLOAD_ALL=0                                   always read the ids back, copy used experts
  default    thresholds: tokens x used >= 4 x n_expert (2x while a graph is in flight) and measured
             coverage >= the auto bar (110 / host links %: 55 % with two, 85 % on one shared link; patch 0005 - it was 85 %)
  forced     UPLOAD_ALL_MIN=1, UPLOAD_ALL_MIN_COV=0: always upload every expert
at n_ubatch 32 (low coverage; n_batch = pp = 512) and 128 (high coverage; n_batch = pp = 2048), for the
near-uniform model and a skewed-routing one (synth routing="skewed", skew=1.5). Speedup = over the baseline
row of the same model and batch sizes.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # bench/_common.py

import pandas as pd

import _common as C
from pyllama_pp import runner
from pyllama_pp.row import RowWriter

SETTINGS = [("selective", {"UPLOAD_ALL": 0}), ("default", {}),
            ("forced", {"UPLOAD_ALL_MIN": 1, "UPLOAD_ALL_MIN_COV": 0})]
UBATCHES = (32, 128)


def main() -> int:
    ap = C.parser("q5_upload_all", __doc__, reps=2)
    ap.add_argument("--skewed-model", default=None, help="the skewed-routing model (default: synthetic, skew 1.5; "
                                                         "with --model and without this, only --model runs)")
    args = ap.parse_args()
    ctx = C.setup(args)
    models = [("uniform", ctx["model"])]
    if args.skewed_model:
        models.append(("skewed", args.skewed_model))
    elif ctx["default_model"]:
        models.append(("skewed 1.5", str(C.synth_model(routing="skewed", skew=1.5))))
    devs = C.device_list(args, [C.DEFAULT_DEVICES])
    ubs = UBATCHES
    writer = RowWriter(ctx["out"])
    frames = []
    ci = 0
    for dev in devs:
        for mname, model in models:
            for ub in ubs:
                nb = 16 * ub if not args.quick else 8 * ub
                common = dict(ts=ctx["ts"], n_batch=nb, n_ubatch=ub, tests=[["pp", nb]], reps=args.reps)
                runs = [("baseline", "baseline", {})] + [(name, "patched", ext) for name, ext in SETTINGS]
                got = []
                for name, variant, ext in runs:
                    cfg = C.config(model, dev, **common, switches=ext, label=f"{mname} | {name}")
                    d = runner.ab([cfg], variants=[variant], out_dir=None, progress=False, timeout=args.timeout)
                    d["config"] = ci
                    d["model_kind"] = mname
                    d["setting"] = name
                    got.append(d)
                    print(f"{C.short_devices(dev)} {mname} ub{ub} {name}: "
                          f"{d.avg_ts.iloc[0]:.1f} t/s", flush=True)
                g = pd.concat(got, ignore_index=True)
                base = g[g.variant == "baseline"]
                bts = base.avg_ts.iloc[0] if not base.empty else float("nan")
                g["speedup"] = g.avg_ts / bts
                # coverage is measured by the first worker (the baseline); copy it to the patched rows
                if not base.empty:
                    g["coverage"] = base.coverage.iloc[0]
                    g["experts_used"] = base.experts_used.iloc[0]
                writer.write(C.rows_of(g))
                frames.append(g)
                ci += 1
    df = pd.concat(frames, ignore_index=True)

    rows = []
    for r in df.to_dict("records"):
        rows.append([r["model_kind"], r["n_ubatch"], r["test"], C.cov(r), r["setting"], C.fmt_ts(r),
                     C.num(r.get("speedup"), "{:.2f}"), C.per_dev(r), C.fmt_bytes(r.get("h2d_bytes")),
                     C.num(r.get("bound_ts")), C.num(r.get("host_syncs")), C.num(r.get("id_readbacks")),
                     C.num(r.get("upload_all")), "on" if r.get("pipeline_parallel") else "off"])
    table = C.md_table(["model", "n_ubatch", "test", "coverage", "run", "t/s", "speedup vs baseline",
                        "bytes/dev", "bytes total", "bound t/s", "host syncs", "id readbacks", "upload-all", "PP"],
                       rows, "lrlrlrrlrrrrrl")
    # plot: t/s per (model, ub) group, one bar per run
    keys = list(dict.fromkeys(zip(df.model_kind, df.n_ubatch)))
    names = ["baseline"] + [n for n, _ in SETTINGS]
    series = {n: [] for n in names}
    for mk, ub in keys:
        g = df[(df.model_kind == mk) & (df.n_ubatch == ub)]
        for n in names:
            m = g[g.setting == n]
            series[n].append(m.avg_ts.iloc[0] if not m.empty and not C.has_error(m.iloc[0].to_dict()) else float("nan"))
    C.bar_plot([f"{mk}\nub{ub}" for mk, ub in keys], series, ctx["out"] / "q5_upload_all.png",
               "Q5: selective copy vs upload-all (patched switches), baseline as reference")
    C.finish(ctx, "Q5: upload-all vs selective copy",
             "Patched build with three settings of the upload-all switch, baseline as the reference; every expert "
             "in host RAM. Bytes = host-to-device per timed run; id readbacks and upload-all = decisions per run "
             "(patched counters).", table, df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
