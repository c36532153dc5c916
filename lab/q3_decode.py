#!/usr/bin/env python3
"""Q3: small batches and decode around the op-offload threshold.

n_batch = n_ubatch = B for B in (1, 8, 16, 31, 32, 33, 64); tests tg16 and a pp test of whole ubatches of B
tokens (B x ceil(128 / B) tokens, so every ubatch has exactly B tokens). Upstream offloads a host-weight op to
a device only from GGML_OP_OFFLOAD_MIN_BATCH = 32 tokens on; below it the experts run on the CPU where they
live (no transfer). With n_batch = n_ubatch a decode call holds one ubatch, so nothing can pipeline inside a
call: this is where the patched build must not cost anything.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # bench/_common.py

import _common as C
from pyllama_pp import runner

BATCHES = (1, 8, 16, 31, 32, 33, 64)


def main() -> int:
    args = C.parser("q3_decode", __doc__, reps=8).parse_args()
    ctx = C.setup(args)
    bs = (1, 31, 32, 33) if args.quick else BATCHES
    devs = C.device_list(args, [C.DEFAULT_DEVICES])
    cfgs = []
    for dev in devs:
        for B in bs:
            n = B * -(-128 // B)
            cfgs.append(C.config(ctx["model"], dev, ts=ctx["ts"], n_batch=B, n_ubatch=B,
                                 tests=[["pp", n], ["tg", 16]], reps=args.reps, label=f"B={B}"))
    df = runner.ab(cfgs, out_dir=ctx["out"], timeout=args.timeout)

    body = []
    for dev in devs:
        d = df[df.devices == dev]
        for kind, what in (("pp", "pp (whole ubatches of B tokens)"), ("tg", "tg16")):
            rows = []
            for _, b, p in C.pairs(d[d.test.astype(str).str.startswith(kind)]):
                ref = p or b
                rows.append([ref.get("n_ubatch"), ref.get("test"), C.cov(ref), C.fmt_ts(b), C.fmt_ts(p),
                             C.num(C.speedup(b, p), "{:.2f}"), C.pp_onoff(b, p), C.per_dev(b), C.per_dev(p),
                             C.syncs(b, p), C.num(p.get("id_readbacks") if p else None),
                             C.num(p.get("upload_all") if p else None)])
            body.append(f"## {what}, n_batch = n_ubatch = B ({C.short_devices(dev)})\n\n" + C.md_table(
                ["B", "test", "coverage", "baseline t/s", "patched t/s", "speedup", "PP b/p", "bytes/dev baseline",
                 "bytes/dev patched", "host syncs b / p", "id readbacks p", "upload-all p"], rows, "rlrrrrlllrrr"))
    C.ab_plot(df, ctx["out"] / "q3_decode.png", "Q3: small batches, n_batch = n_ubatch = B, experts on host",
              label=lambda r: f"B={r['n_ubatch']}")
    C.finish(ctx, "Q3: small-batch decode around the op-offload threshold (32)",
             "Every expert in host RAM; B = n_batch = n_ubatch. Host syncs, bytes and readbacks are per timed run "
             "(one pp test, or 16 single-token decodes).", "\n".join(body), df)
    return 0


if __name__ == "__main__":
    sys.exit(main())
