#!/usr/bin/env python3
"""`fit --ubatch auto` against measurement: every candidate n_ubatch's predicted prompt t/s (bytes per link and the
probe's compute) beside the patched build measured on that candidate's plan, and the same devices with every weight
resident ("all in VRAM": for VDEVs the same devices without a memory limit) at the same n_ubatch.

Answers: is each prediction within 10% of its measurement, is the chosen n_ubatch within 5% of the best measured
one, and how close does the patched build come to all-in-VRAM at each n_ubatch (with every expert in host RAM where
fit put it)?

    python bench/ubatch_auto.py                                  # CPU: tiny preset on a compute-bound VDEV pair
    python bench/ubatch_auto.py --preset qwen3-30b-a3b --devices cuda:0 -c 16384 --out DIR   (GPU machine)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd

from pyllama_pp import devices as devspec
from pyllama_pp import runner, synth
from pyllama_pp.compute import probe
from pyllama_pp.config import RunConfig
from pyllama_pp.fit import fit, fit_ubatch
from pyllama_pp.predict import link_rates, predict
from pyllama_pp.switches import in_force as switches_in_force
from pyllama_pp.model_file import block_count, embedding_length, expert_bytes_per_layer, expert_layout
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.planning import models_dir
from pyllama_pp.switches import parse_given

# two VDEVs whose memory holds about half of the tiny preset's experts, on 1 GB/s links, computing 3x slower than
# a CPU thread: at n_ubatch 512 and above a layer's compute takes longer than moving its experts
DEFAULT_DEVICES = "vdev:2x6MiB@1GBps,speed=3:3"


def resident(devices: str) -> str:
    """The same devices with every weight resident: VDEVs without a memory limit (links and speeds kept); other
    devices as they are (they hold the model)."""
    spec = devspec.parse(devices)
    if not spec.vdevs:
        return devices
    d = spec.to_dict()
    return json.dumps({"kind": "vdev", "devices": [{**v, "memory": 0} for v in d["devices"]]})


def host_share_margins(model: str, devices: str, n_tokens: int, n_ubatch: int, share: float) -> list:
    """Margins that leave each device its share of the dense weights and of (1 - share) of the experts, plus its KV
    cache and compute buffers (measured by a fit with no margin at the largest candidate)."""
    n_ubatch = min(n_ubatch, n_tokens)
    probe_plan = fit(model, devices=devices, margin=0, check=False,
                     ctx=ContextParams(n_ctx=n_tokens + 256, n_batch=n_tokens // n_ubatch * n_ubatch, n_ubatch=n_ubatch))
    experts = expert_bytes_per_layer(model) * block_count(model)
    dense = Path(model).stat().st_size - experts
    n = len(probe_plan.devices)
    return [max(0, int(d.free_bytes - ((dense + (1 - share) * experts) / n + d.context_bytes + d.compute_bytes)))
            for d in probe_plan.devices]


def table(df: pd.DataFrame) -> str:
    """The rows as a Markdown table (numbers to one decimal)."""
    cols = list(df.columns)
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
                     + ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in df.to_dict("records")])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="synth preset (default: tiny)")
    ap.add_argument("--model", help="a GGUF instead of a preset")
    ap.add_argument("--devices", default=DEFAULT_DEVICES, help=f"device spec (default: {DEFAULT_DEVICES})")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="n_ctx = the prompt's length (default: 4096)")
    ap.add_argument("--candidates", default="", help="n_ubatch values, comma-separated (default: fit_ubatch's)")
    ap.add_argument("--margin", default=None, help="fit's margin per device (e.g. 1GiB)")
    ap.add_argument("--link-gbps", default=None, help="each device's host link rate, comma-separated (CUDA)")
    ap.add_argument("--shared-link", action="store_true", help="the devices share one link (one GPU split in two)")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per run (default: 2)")
    ap.add_argument("--host-experts-all", action="store_true",
                    help="every expert in host RAM at every candidate (fit's context and split, its experts moved to "
                         "host): the long-prompt case on a GPU that could hold them")
    ap.add_argument("--load-mode", default="none", choices=["none", "mmap"],
                    help="host weights pinned (none, the default) or pageable through mmap (staged by the series)")
    ap.add_argument("--host-share", type=float, default=None,
                    help="margins that leave this share of the experts in host RAM (as bench/fit_gpu.py does), for "
                         "devices that could hold the model")
    ap.add_argument("--baseline", action="store_true",
                    help="also run upstream (the baseline build) on each candidate's placement: best against best")
    ap.add_argument("--switch", action="append", metavar="NAME=VALUE",
                    help="a patched switch planned and run with, e.g. LAYER_MAJOR=1 (repeatable)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit); candidates "
                    "are measured largest first while time is left")
    ap.add_argument("--out", type=Path, default=Path("bench/out/ubatch_auto"), help="folder for rows and summary")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(synth.cached_model(models_dir(), args.preset, seed=1))
    n = args.ctx
    kw = {}
    if args.candidates:
        kw["candidates"] = [int(x) for x in args.candidates.split(",")]
    t0 = time.time()
    if args.host_share is not None:
        args.margin = host_share_margins(model, args.devices, n, max(kw.get("candidates") or [n]), args.host_share)
        print(f"margins for a host share of {args.host_share:g}: {[m // 2**20 for m in args.margin]} MiB",
              file=sys.stderr)
    links = [float(x) for x in args.link_gbps.split(",")] if args.link_gbps else None
    given = parse_given(args.switch)
    plan = fit_ubatch(model, devices=args.devices, ctx=ContextParams(n_ctx=n + 256), margin=args.margin,
                      link_gbps=links, shared_link=args.shared_link, n_tokens=n, load_mode=args.load_mode,
                      skip=False, progress=not args.json, switches=given, **kw)
    fit_s = time.time() - t0
    print(plan, file=sys.stderr)
    spec = devspec.parse(args.devices)
    placed = [c for c in plan.ubatch_auto if c.get("predicted_ts")]
    for cand in placed:
        cand["plan"] = fit(model, devices=args.devices, margin=args.margin, check=False, switches=given,
                           ctx=ContextParams(n_ctx=n + 256, n_batch=cand["n_batch"], n_ubatch=cand["n_ubatch"]))
    if args.host_experts_all:
        # every expert on host: each candidate's plan keeps fit's split and context, all its layers host-expert,
        # predicted with the planner's rates (measured links, the staging copy) and its probe (cached)
        rates = link_rates(spec, links, len(plan.devices), [d.link for d in plan.devices])
        probed = probe(model, args.devices, [c["n_ubatch"] for c in placed], n)
        eb, hidden = expert_bytes_per_layer(model), embedding_length(model) if spec.remote else 0
        n_used, switches = expert_layout(model)[0], {**switches_in_force("patched"), **given}
        for cand in placed:
            p = cand["plan"]
            for d in p.devices:
                d.host_expert_layers, d.full_layers = d.n_layers, 0
            pred = predict(p, eb, rates, args.shared_link, probed, n, hidden,
                           staging_gbps=plan.host_copy_gbps if args.load_mode == "mmap" else None,
                           n_used=n_used, switches=switches)
            cand.update(predicted_ts=pred.ts, bound=pred.bound, host_expert_layers=[d.n_layers for d in p.devices])
    rows, t_start = [], time.time()
    for cand in sorted(plan.ubatch_auto, key=lambda c: -c["n_ubatch"]):
        if not cand.get("predicted_ts"):
            continue
        if args.budget and time.time() - t0 > args.budget - 60:
            print(f"(budget spent: ub{cand['n_ubatch']} not measured)", file=sys.stderr)
            continue
        ub, nb = cand["n_ubatch"], cand["n_batch"]
        p = cand["plan"]
        ctx = dict(n_batch=nb, n_ubatch=ub, n_ctx=n + 256, tests=[["pp", n]], reps=args.reps)
        placement = p.placement(args.load_mode, source="fit")
        if args.host_experts_all:
            placement = Placement(n_gpu_layers=placement.n_gpu_layers, tensor_split=placement.tensor_split,
                                  host_experts="all", load_mode=args.load_mode)
        host = RunConfig(model, devices=args.devices, switches=dict(p.switches), plans={"patched": placement}, **ctx)
        vram = RunConfig(model, devices=resident(args.devices), placement=Placement(host_experts="none"), **ctx)
        got = {}
        for name, cfg in (("host", host), ("vram", vram)):
            variants = ["baseline", "patched"] if args.baseline and name == "host" else ["patched"]
            if args.baseline:
                cfg = dataclasses.replace(cfg, plans={v: cfg.plans.get("patched", cfg.placement) for v in variants}
                                          if cfg.plans else {})
            df = runner.ab([cfg], variants=variants, out_dir=args.out / f"ub{ub}-{name}", progress=False)
            ts = {r["variant"]: r["avg_ts"] for r in df.to_dict("records")}
            got[name] = float(ts.get("patched", float("nan")))
            if name == "host" and "baseline" in ts:
                got["baseline"] = float(ts["baseline"])
        rows.append({"n_ubatch": ub, "n_batch": nb, "group": cand.get("group", 1),
                     "host_expert_layers": cand["host_expert_layers"],
                     "compute": cand.get("compute", ""), "bound": cand["bound"], "predicted_ts": cand["predicted_ts"],
                     "measured_ts": got["host"],
                     "error_pct": 100 * (cand["predicted_ts"] / got["host"] - 1),
                     "all_in_vram_ts": got["vram"], "of_vram_pct": 100 * got["host"] / got["vram"],
                     **({"baseline_ts": got["baseline"], "speedup": got["host"] / got["baseline"]}
                        if "baseline" in got else {})})
        print(f"ub{ub}: predicted {cand['predicted_ts']:.0f}, measured {got['host']:.0f}, all in VRAM "
              f"{got['vram']:.0f} t/s", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows).sort_values("n_ubatch") if rows else pd.DataFrame(rows)
    best = df.loc[df["measured_ts"].idxmax()] if len(df) else None
    # (every expert on host: the candidate predicted fastest with them; else the planner's own choice)
    chosen = max(placed, key=lambda c: (c["predicted_ts"], c["n_ubatch"]))["n_ubatch"] if args.host_experts_all \
        and placed else plan.ctx["n_ubatch"]
    chosen_ts = float(df.loc[df["n_ubatch"] == chosen, "measured_ts"].iloc[0]) if chosen in set(df["n_ubatch"]) else None
    configured = spec.link_rates() or []
    summary = {"model": model, "devices": args.devices, "n_tokens": n, "fit_seconds": fit_s, "chosen_n_ubatch": chosen,
               "chosen_n_batch": plan.ctx["n_batch"], "load_mode": args.load_mode,
               "links_measured": [d.link for d in plan.devices], "links_configured": configured,
               "host_copy_gbps": plan.host_copy_gbps,
               "host_experts_all": args.host_experts_all, "measure_seconds": time.time() - t_start,
               "best_measured_n_ubatch": int(best["n_ubatch"]) if best is not None else None,
               "chosen_of_best_pct": 100 * chosen_ts / float(best["measured_ts"]) if chosen_ts else None,
               "max_abs_error_pct": float(df["error_pct"].abs().max()) if len(df) else None,
               "best_vs_best": (float(df["measured_ts"].max() / df["baseline_ts"].max())
                                if len(df) and "baseline_ts" in df else None),
               "rows": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(table(df) if len(df) else "(no candidate with a placement)")
        print(f"\nchosen n_ubatch {chosen}: {summary['chosen_of_best_pct'] or float('nan'):.1f}% of the best measured "
              f"(ub{summary['best_measured_n_ubatch']}); largest prediction error "
              f"{summary['max_abs_error_pct'] or float('nan'):.1f}%"
              + (f"; best against best (upstream at its own best n_ubatch): {summary['best_vs_best']:.2f}x"
                 if summary["best_vs_best"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
