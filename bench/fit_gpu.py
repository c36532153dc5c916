#!/usr/bin/env python3
"""fit on the GPU machine, both variants: does each plan hold in measured memory, and how fast does it run? A memory
target forces about half of the experts to host RAM.

Steps, each written to --out as soon as it is done (a cut-off call still returns what it measured):
  1. fit time of the preset on VDEVs (patched and baseline), as a user would plan before buying GPUs
  2. per config (n_batch, n_ubatch): each variant's own fit on --devices, the margin chosen so that each device's
     target holds its share of the dense weights and of (1 - host_share) of the experts, plus its KV cache and
     compute buffers (measured by a first fit with no margin)
  3. plan against measured memory per device: a session built from each plan, llama's own memory breakdown per
     device, and the device memory CUDA reports in use before and after (one GPU split in two shows one pool)
  4. `ab --fit`: each variant with its own plan, the patched one with the copies its plan chose

    python bench/fit_gpu.py --devices cuda --out DIR [--preset qwen3-30b-a3b] [--host-share 0.5] [--budget 480]
    python bench/fit_gpu.py --preset tiny --devices "vdev:2x64MiB@4GBps" --configs 512:128 --out DIR   (smoke test)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pyllama_pp import report, runner, synth
from pyllama_pp.config import RunConfig
from pyllama_pp.fit import fit, fit_ubatch
from pyllama_pp.params import ContextParams
from pyllama_pp.plan import Plan

from _clock import left, log   # bench/_clock.py (this script's folder is on sys.path)

MiB = 1024**2


def measure_memory(plan_file: str, variant: str) -> dict:
    """In this process (one variant per process): device memory in use before and after a session from the plan,
    and llama's breakdown per device."""
    from pyllama_pp.devices import list_devices
    from pyllama_pp.session import Session
    plan = Plan.load(plan_file)
    used = lambda: {d["name"]: d["memory_total"] - d["memory_free"] for d in list_devices(variant)
                    if d["memory_total"] > 0}
    before = used()
    with Session(plan.model, plan=plan, variant=variant) as s:
        sched = s.schedule()
        r = s.eval(list(range(1, 257)), logits="last")
        after = used()
        per_dev: dict = {}
        for m in sched.memory:
            if m["buft"] != m["device"]:    # (a device's host buffer type: host RAM)
                continue
            d = per_dev.setdefault(m["device"], {"model": 0, "context": 0, "compute": 0})
            d["model"] += m["model_bytes"]
            d["context"] += m["context_bytes"]
            d["compute"] += m["compute_bytes"]
        return {"variant": variant, "pipeline_parallel": sched.pipeline_parallel,
                "overlap": (r.ext or {}).get("overlap"), "overlap_dropped": (r.ext or {}).get("overlap_dropped"),
                "breakdown": per_dev, "used_before": before, "used_after": after}


def plan_table(plans: dict, mem: dict) -> str:
    lines = ["| config | variant | path | copies | device | layers | full | host | expected MiB | llama's MiB | "
             "target MiB | fit s |", "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, p in plans.items():
        m = mem.get(key, {})
        for d in p.devices:
            got = m.get("breakdown", {}).get(d.name)
            have = sum(got.values()) / MiB if got else float("nan")
            lines.append(f"| {key[0]} | {p.variant} | {p.path} | {p.switches or '-'} | {d.name} | "
                         f"{d.layers[0]}-{d.layers[1]} | {d.full_layers} | {d.host_expert_layers} | "
                         f"{d.expected_bytes / MiB:.0f} | {have:.0f} | {d.target_bytes / MiB:.0f} | {p.seconds:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cuda")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pp_models"))
    ap.add_argument("--configs", default="4096:512,16384:2048", help="n_batch:n_ubatch,... (pp = n_batch)")
    ap.add_argument("--host-share", type=float, default=0.5, help="share of the experts the target leaves to host RAM")
    ap.add_argument("--vdevs", default="vdev:2x9GiB@55GBps", help="VDEV spec of step 1 (fit time)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--steps", default="vdev,plans,memory,ab",
                    help="of vdev, plans, memory, ab, auto (fit --ubatch auto with the first config's margins, then "
                         "the patched build on its plan: predicted against measured)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--measure-memory", nargs=2, metavar=("PLAN", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_memory:
        print(json.dumps(measure_memory(*args.measure_memory)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"devices": args.devices, "preset": args.preset, "host_share": args.host_share, "steps": {}}
    save = lambda: (args.out / "fit_summary.json").write_text(json.dumps(summary, indent=1, default=str))

    cfg = synth.preset(args.preset, seed=1, routing="uniform")
    model = args.model_dir / f"{args.preset}-uniform.gguf"
    if not model.exists():
        args.model_dir.mkdir(parents=True, exist_ok=True)
        synth.write_gguf(model, cfg)
        log(f"wrote {model}")
    experts = synth.expert_bytes_per_layer(cfg) * cfg.n_layer
    dense = model.stat().st_size - experts
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]

    steps = set(args.steps.split(","))
    # 1. fit time on VDEVs
    shared = os.environ.get("GGML_CUDA_DEVICES") is not None   # one GPU split in two: one link
    for v in ("patched", "baseline") if "vdev" in steps else ():
        ctx = ContextParams(n_ctx=configs[0][0] + 256, n_batch=configs[0][0], n_ubatch=configs[0][1])
        t = time.time()
        p = fit(model, devices=args.vdevs, ctx=ctx, variant=v, check=False)
        summary["steps"].setdefault("vdev_fit", []).append({"variant": v, "wall_s": time.time() - t, "fit_s": p.seconds,
                                                             "host_expert_layers": p.host_expert_layers, "path": p.path})
        log(f"VDEV fit ({v}): {time.time() - t:.1f} s wall, {p.seconds:.1f} s in fit\n{p}")
    save()

    # 2. each variant's fit per config, with a target forcing host_share of the experts to host
    plans: dict = {}

    def bench_config(nb: int, ub: int, plans_by_variant: Optional[dict] = None) -> RunConfig:
        """The A/B config of steps 4 and 5; with plans, each variant runs its plan (the patched one's switches)."""
        c = RunConfig(model=str(model), devices=args.devices, n_batch=nb, n_ubatch=ub, tests=[["pp", nb]],
                      reps=args.reps, label=f"fit b{nb} ub{ub}",
                      link_gbps=[55] * 16 if args.devices.startswith("cuda") else None, shared_link=shared)
        if plans_by_variant:
            # each variant's placement comes from its plan (the rows label it "fit: N overrides")
            c = dataclasses.replace(c, plans={v: p.placement(source="fit") for v, p in plans_by_variant.items()},
                                    switches=dict(plans_by_variant["patched"].switches))
        return c


    def target_margins(ctx) -> list:
        """Margins that leave each device its share of the dense weights and of (1 - host_share) of the experts,
        plus its KV cache and compute (measured by a fit with no margin)."""
        probe = fit(model, devices=args.devices, ctx=ctx, variant="patched", margin=0, check=False)
        n = len(probe.devices)
        return [max(0, int(d.free_bytes - ((dense + (1 - args.host_share) * experts) / n + d.context_bytes
                                           + d.compute_bytes))) for d in probe.devices]

    for nb, ub in configs if steps & {"plans", "memory", "ab"} else ():
        # (the n_ctx the runs of step 4 use, as `ab --fit` plans)
        ctx = ContextParams(n_ctx=bench_config(nb, ub).context().n_ctx, n_batch=nb, n_ubatch=ub)
        margins = target_margins(ctx)
        for v in ("patched", "baseline"):
            t = time.time()
            p = fit(model, devices=args.devices, ctx=ctx, variant=v, margin=margins, check=False)
            plans[(f"b{nb} ub{ub}", v)] = p
            p.save(args.out / f"plan-{v}-b{nb}-ub{ub}.json")
            log(f"fit ({v}, b{nb} ub{ub}, margins {[m // MiB for m in margins]} MiB): {time.time() - t:.1f} s\n{p}")
        summary["steps"]["plans"] = {f"{k[0]} {k[1]}": p.to_dict() for k, p in plans.items()}
        save()

    # 3. plan against measured memory (the first config: one session per variant)
    mem: dict = {}
    nb, ub = configs[0]
    for v in ("patched", "baseline") if "memory" in steps else ():
        if left(args.budget) < 120:
            log("skip the memory step: no time left")
            break
        f = args.out / f"plan-{v}-b{nb}-ub{ub}.json"
        r = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--measure-memory", str(f), v],
                           capture_output=True, text=True, timeout=300)
        try:
            mem[(f"b{nb} ub{ub}", v)] = json.loads(r.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            mem[(f"b{nb} ub{ub}", v)] = {"error": r.stderr[-2000:]}
        log(f"memory ({v}): {mem[(f'b{nb} ub{ub}', v)]}")
    summary["steps"]["memory"] = {f"{k[0]} {k[1]}": m for k, m in mem.items()}
    (args.out / "plans.md").write_text(plan_table(plans, mem) + "\n")
    print(plan_table(plans, mem))
    save()

    # 4. each variant with its own plan
    for nb, ub in configs if "ab" in steps else ():
        remaining = left(args.budget)
        if remaining < 120:
            log(f"skip ab b{nb} ub{ub}: {remaining:.0f} s left")
            continue
        key = f"b{nb} ub{ub}"
        c = bench_config(nb, ub, {v: plans[(key, v)] for v in ("patched", "baseline")})
        df = runner.ab([c], out_dir=args.out / "ab", progress=False, timeout=max(60, remaining - 20))
        log(f"ab --fit {key}\n{report.markdown(df)}")
        summary["steps"].setdefault("ab", []).append(json.loads(df.to_json(orient="records")))
        save()

    # 5. --ubatch auto: the plan the bytes bound predicts fastest, then the patched build on it
    if "auto" in steps:
        nb, ub = configs[0]
        n_ctx = max(nb for nb, _ in configs) + 256
        margins = target_margins(ContextParams(n_ctx=n_ctx, n_batch=nb, n_ubatch=ub))
        t = time.time()
        p = fit_ubatch(model, devices=args.devices, ctx=ContextParams(n_ctx=n_ctx, n_batch=nb, n_ubatch=ub),
                       margin=margins, shared_link=shared, check=False)
        p.save(args.out / "plan-auto.json")
        log(f"fit --ubatch auto ({time.time() - t:.1f} s, margins {[m // MiB for m in margins]} MiB)\n{p}")
        summary["steps"]["auto"] = {"plan": p.to_dict(), "seconds": time.time() - t}
        save()
        c = dataclasses.replace(bench_config(p.ctx["n_batch"], p.ctx["n_ubatch"], {"patched": p}), label="ubatch auto")
        remaining = left(args.budget)
        if remaining > 60:
            df = runner.ab([c], variants=["patched"], out_dir=args.out / "ab-auto", progress=False,
                           timeout=max(60, remaining - 15))
            got = float(df["avg_ts"].iloc[0]) if len(df) else float("nan")
            log(f"ubatch auto: n_ubatch {p.ctx['n_ubatch']}, n_batch {p.ctx['n_batch']}: predicted "
                f"{p.predicted_ts or float('nan'):.1f} t/s, measured {got:.1f}\n{report.markdown(df)}")
            summary["steps"]["auto"]["measured_ts"] = got
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
