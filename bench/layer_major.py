#!/usr/bin/env python3
"""LAYER_MAJOR (patch 0015): a batch's ubatches run through each layer together, so a layer's host experts go up
once per group of ubatches instead of once per ubatch. Does one upload serving several ubatches beat the same
n_ubatch without it, and are the logits still the baseline's?

The patched build with every expert in host RAM, at each n_ubatch, with n_batch = --batches x n_ubatch: without the
switch and with GGML_SCHED_PP_LAYER_MAJOR=--group (1: every ubatch of a batch in one group); t/s, the speedup, the
host -> device bytes per run of each device and their ratio; then the logits of the baseline and of the patched
build with the switch on the same placement (NMSE, max abs difference; --check-tokens 0 skips it, --check-ubatch
sets its n_ubatch). Defaults: the tiny preset on throttled VDEVs (one device, and two, each on a 0.2 GB/s link of
its own), where the expert uploads dominate. Rows into bench/out/layer/ (results.jsonl, results.csv, results.md)
unless --out says.

    python bench/layer_major.py [--reps N] [--ubatch 32,64]
    python bench/layer_major.py --devices cuda --model M --ubatch 2048,4096 --batches 4 --pp 16384 \
        --check-tokens 4096 --check-ubatch 512
"""
from __future__ import annotations

import time

import _common as C
from pyllama_pp import runner
from pyllama_pp.check import check_logits
from pyllama_pp.params import ContextParams, Placement

DEFAULT_DEVICES = ("vdev:1x0@0.2GBps", "vdev:2x0@0.2GBps")


def main() -> int:
    ap = C.parser("layer_major", __doc__, reps=2)
    ap.add_argument("--ubatch", default="64", help="n_ubatch values, comma-separated (default 64)")
    ap.add_argument("--batches", type=int, default=4, help="ubatches per batch: n_batch = BATCHES x n_ubatch (default 4)")
    ap.add_argument("--pp", type=int, default=0, help="prompt tokens (default: 4 batches)")
    ap.add_argument("--group", type=int, default=1,
                    help="GGML_SCHED_PP_LAYER_MAJOR with the switch on (1: all the ubatches of a batch; default 1)")
    ap.add_argument("--check-tokens", type=int, default=-1,
                    help="tokens of the logits check, every one with logits (default: two batches with the default "
                         "model, none with --model; 0: no check)")
    ap.add_argument("--check-ubatch", type=int, default=0,
                    help="n_ubatch of the logits check, in batches of --batches ubatches (default: each row's; a "
                         "smaller one keeps a large vocabulary's logits small)")
    args = ap.parse_args()
    ctx = C.setup(args)
    ubatches = [int(x) for x in args.ubatch.split(",") if x.strip()]
    on = {"LAYER_MAJOR": args.group}
    cfgs = []
    for devices in C.device_list(args, DEFAULT_DEVICES):
        for ub in ubatches:
            nb = args.batches * ub
            pp = args.pp or 4 * nb
            for name, switches in (("off", {}), (f"LAYER_MAJOR={args.group}", on)):
                cfgs.append(C.config(ctx["model"], devices, ts=ctx["ts"], n_batch=nb, n_ubatch=ub, n_ctx=pp + 256,
                                     tests=[["pp", pp]], reps=args.reps, switches=switches,
                                     label=f"{C.short_devices(devices)} | ub{ub} | {name}"))
    df = runner.ab(cfgs, variants=("patched",), out_dir=ctx["out"], progress=True, timeout=args.timeout)

    rows = []
    for i in range(0, len(cfgs), 2):
        off, lm = (df[df.label == cfgs[j].label].iloc[0] for j in (i, i + 1))
        cfg = cfgs[i + 1]
        check = ""
        check_ub = args.check_ubatch or cfg.n_ubatch
        n_check = (2 * args.batches * check_ub if ctx["default_model"] else 0) if args.check_tokens < 0 else args.check_tokens
        if n_check > 0:
            c = check_logits(cfg.model, devices=cfg.devices,
                             placement=Placement(host_experts="all", tensor_split=cfg.placement.tensor_split),
                             ctx=ContextParams(n_ctx=n_check + 256, n_batch=args.batches * check_ub, n_ubatch=check_ub),
                             n_tokens=n_check, switches=on, timeout=args.timeout)
            check = f"{c.nmse:.1e} / {c.max_abs_diff:.1e}"
        h_off, h_on = off.get("h2d_bytes_per_device") or [], lm.get("h2d_bytes_per_device") or []
        ratio = ", ".join(f"{a / b:.2f}" for a, b in zip(h_off, h_on) if b)
        rows.append([C.short_devices(cfg.devices), cfg.n_ubatch, cfg.n_batch, C.fmt_ts(off), C.fmt_ts(lm),
                     f"{lm.avg_ts / off.avg_ts:.2f}x" if off.avg_ts > 0 else "", C.per_dev(off), C.per_dev(lm), ratio,
                     C.cov(off), check])
    table = C.md_table(["devices", "n_ubatch", "n_batch", "t/s off", f"t/s LAYER_MAJOR={args.group}", "speedup",
                        "h2d/run off", "h2d/run on", "off/on bytes", "coverage off", "NMSE / max abs vs baseline"],
                       rows, "lrrrrrlllrl")
    m = ctx["machine"]
    text = (f"# LAYER_MAJOR: one expert upload per group of ubatches\n\n- command: `{ctx['command']}`\n"
            f"- model: `{ctx['model']}`, every expert in host RAM, pp{args.pp or '4 batches'}, "
            f"n_batch = {args.batches} x n_ubatch\n"
            f"- machine: {m['cpu']}, nproc {m['nproc']}\n"
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n\n"
            "The patched build without the switch and with it, at the same n_ubatch; h2d: host -> device bytes per "
            "run of each device; the logits check compares the baseline with the patched build with the switch "
            "(every token's logits).\n\n" + table)
    (ctx["out"] / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
