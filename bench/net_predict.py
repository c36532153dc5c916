#!/usr/bin/env python3
"""`fit --ubatch auto` over ggml RPC against measurement: each candidate n_ubatch's predicted prompt t/s (the network
to each server as fit measured it, each server's devices' stages) beside the patched build measured on that
candidate's plan, at each network rate given.

Two patched rpc-servers, each serving --server-devices, sit behind a `pyllama_pp.rpc.relay.Link` that paces both ways at
the rate; fit measures that network itself (DevicePlan.server_net), the run uses the plan it made. Servers, relays
and the client share this machine's cores: where the network is fast, their CPU time, which the prediction does not
count, is what the measurement shows.

    python bench/net_predict.py                                   # CPU: tiny preset, 0.01 and 0.002 GB/s
    python bench/net_predict.py --rates 0.05,0.01 --candidates 32,64,128 --out DIR --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import pandas as pd

from pyllama_pp import runner, synth
from pyllama_pp.planning import models_dir
from pyllama_pp.config import RunConfig
from pyllama_pp.fit import fit, fit_ubatch
from pyllama_pp.params import ContextParams
from pyllama_pp.rpc.relay import Link
from pyllama_pp.servers.serve import spawn_server, wait_listening
from ubatch_auto import table   # (bench/: the same Markdown table)

HOST = "127.0.0.1"


def measure(model: str, rate: Optional[float], args) -> list[dict]:
    """Two patched servers behind Links at `rate` GB/s (None: connected directly, loopback as it is): fit_ubatch's
    candidates, each measured on its own plan."""
    started = [spawn_server(args.server_devices, "patched", HOST) for _ in range(2)]
    links = []
    try:
        for port, proc in started:
            wait_listening(port, proc, HOST)
        links = [Link(port, gbps=rate) for port, _ in started] if rate is not None else []
        spec = "rpc://" + ",".join(f"{HOST}:{x.port}" for x in links) if links else \
            "rpc://" + ",".join(f"{HOST}:{port}" for port, _ in started)
        ctx = ContextParams(n_ctx=args.p + 256)
        plan = fit_ubatch(model, devices=spec, ctx=ctx, candidates=args.candidates, n_tokens=args.p, skip=False,
                          margin=args.margin, timeout=300, progress=not args.json)
        print(plan, file=sys.stderr, flush=True)
        rows = []
        for cand in plan.ubatch_auto:
            if not cand.get("predicted_ts"):
                continue
            ub, nb = cand["n_ubatch"], cand["n_batch"]
            p = fit(model, devices=spec, ctx=ContextParams(n_ctx=args.p + 256, n_batch=nb, n_ubatch=ub),
                    margin=args.margin, timeout=300)
            cfg = RunConfig(model, devices=spec, switches=dict(p.switches),
                            plans={"patched": p.placement("none", source="fit")}, n_batch=nb, n_ubatch=ub,
                            n_ctx=args.p + 256, tests=[["pp", args.p]], reps=args.reps)
            df = runner.ab([cfg], variants=["patched"], out_dir=args.out / f"net{rate or 0:g}-ub{ub}", progress=False)
            got = float(df["avg_ts"].iloc[0])
            net = p.devices[0].server_net or {}
            rows.append({"net_MBps": 1e3 * rate if rate is not None else "direct",
                         "fit_measured_up_MBps": 1e3 * net.get("up_gbps", 0),
                         "fit_measured_rtt_ms": 1e3 * net.get("rtt_s", 0),
                         "n_ubatch": ub, "n_batch": nb, "bound": cand["bound"], "predicted_ts": cand["predicted_ts"],
                         "measured_ts": got, "error_pct": 100 * (cand["predicted_ts"] / got - 1)})
            print(f"{rate if rate is not None else 'direct'} GB/s ub{ub}: predicted {cand['predicted_ts']:.0f}, "
                  f"measured {got:.0f} t/s", file=sys.stderr, flush=True)
        return rows
    finally:
        for x in links:
            x.close()
        for _, proc in started:
            proc.kill()
            proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="synth preset (default: tiny)")
    ap.add_argument("--model", help="a GGUF instead of a preset")
    ap.add_argument("--server-devices", default="vdev:1x0@4GBps", help="each server's devices (default: %(default)s)")
    ap.add_argument("--rates", default="0.01,0.002", help="network rates per direction, GB/s, comma-separated; "
                    "direct: no relay (loopback as it is)")
    ap.add_argument("--margin", default=None, help="fit's margin per device (default: an RPC device's, 1 GiB)")
    ap.add_argument("--candidates", default="32,64,128", help="n_ubatch values, comma-separated")
    ap.add_argument("-p", type=int, default=1024, help="prompt tokens (default: 1024)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per run (default: 3)")
    ap.add_argument("--out", type=Path, default=Path("bench/out/net_predict"), help="folder for rows and summary")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    args.candidates = tuple(int(x) for x in args.candidates.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(synth.cached_model(models_dir(), args.preset, seed=1))
    rates = [None if x == "direct" else float(x) for x in args.rates.split(",")]
    rows = [r for rate in rates for r in measure(model, rate, args)]
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    (args.out / "results.md").write_text(table(pd.DataFrame(rows)) + "\n")
    if args.json:
        print(json.dumps({"model": model, "rows": rows}, indent=1))
    else:
        print(table(pd.DataFrame(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
