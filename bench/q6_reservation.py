#!/usr/bin/env python3
"""Q6: graph reservation under a mixed workload.

One session per variant (its own worker process, job kind "workload" of pyllama_pp.worker) runs a mixed workload in one context, as
a server would: prompts of alternating lengths pp64, pp512, pp128, pp2048 (each from an empty cache), then tg16
continuing after the last prompt; the workload repeats for --rounds rounds (round 1 includes the first use of
every graph shape). Every expert in host RAM, n_batch 2048, n_ubatch 128.

Reported per step: throughput, host syncs, bytes moved, and as a proxy for re-reservations (compute buffers
re-allocated) the VDEV allocation counters: a step "re-allocates" when a device's allocated bytes after the
step differ from before it or its peak during the step exceeds the starting level; plus the scheduler's compute
buffer sizes before/after. The patched build also reports its own count of re-reservations and of graphs it
allocated from a kept plan instead (patch 0007, PLANS), with how many of those had graphs in flight.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import _common as C
import numpy as np
import json

from pyllama_pp import runner, switches
from pyllama_pp.binding import VARIANTS, build_info
from pyllama_pp.errors import WorkerError
from pyllama_pp.params import Placement
from pyllama_pp.row import Row, RowWriter
from pyllama_pp.rows import workload_step_row
from pyllama_pp.stats import nmse
from pyllama_pp.worker import run_job

WORKLOAD = runner.MIXED_WORKLOAD
PLACEMENT = Placement(host_experts="all")


def run_variant(job: dict, variant: str, timeout: float) -> dict:
    try:
        return run_job({**job, "kind": "workload"}, variant, timeout=timeout)
    except WorkerError as e:
        return {"error": str(e)}


def changed(st: dict) -> bool:
    b, a, pk = st["alloc_before"], st["alloc_after"], st["peak_alloc"]
    return any(x != y for x, y in zip(b, a)) or any(p > x for x, p in zip(b, pk))


def main() -> int:
    ap = C.parser("q6_reservation", __doc__, reps=3)
    ap.add_argument("--rounds", type=int, default=None, help="workload repetitions (default: --reps)")
    ap.add_argument("--n-batch", type=int, default=2048)
    ap.add_argument("--n-ubatch", type=int, default=128)
    ap.add_argument("--order", default=",".join(VARIANTS),
                    help="the order the variants run in, one after the other (default: baseline,patched)")
    ap.add_argument("--logits", action="store_true",
                    help="also compare the logits of every step (each prompt's last token, every decoded token)")
    args = ap.parse_args()
    order = [v.strip() for v in args.order.split(",") if v.strip()]
    if sorted(order) != sorted(VARIANTS):
        ap.error(f"--order must name {' and '.join(VARIANTS)} once each, got {args.order!r}")
    ctx = C.setup(args)
    rounds = args.rounds or args.reps
    workload = [["pp", 64], ["pp", 512], ["pp", 128], ["tg", 16]] if args.quick else WORKLOAD
    n_ctx = runner.workload_ctx(workload)
    devs = C.device_list(args, [C.DEFAULT_DEVICES])
    writer = RowWriter(ctx["out"])
    steps_file = ctx["out"] / "steps.jsonl"   # every step with the fields that are not Row fields (alloc counters)
    steps_file.unlink(missing_ok=True)
    info = build_info()
    results = {}
    all_rows = []
    # switches of the patched build set in the environment (the baseline has none)
    pp_env = {k: v for k, v in os.environ.items() if k.startswith(switches.PREFIX)}
    for dev in devs:
        job = {"model": ctx["model"], "devices": dev,
               "placement": {**PLACEMENT.to_dict(), "tensor_split": ctx["ts"]},
               "ctx": {"n_ctx": n_ctx, "n_batch": args.n_batch, "n_ubatch": min(args.n_ubatch, args.n_batch)},
               "workload": workload, "rounds": rounds, "seed": 0}
        for v in order:
            print(f"{C.short_devices(dev)} {v}: {rounds} round(s) of {workload}", flush=True)
            vjob = {**job, "out": str(ctx["out"] / f"logits-{len(results)}-{v}.npy")} if args.logits else job
            res = run_variant(vjob, v, args.timeout)
            if args.logits and "error" not in res:
                res["logits"] = np.load(vjob["out"])
                os.remove(vjob["out"])   # compared below; a 150k vocabulary makes them large
            results[(dev, v)] = res
            meta = {"machine": f"{ctx['machine']['host']} ({ctx['machine']['nproc']} cores)",
                    "date": ctx["machine"]["date_utc"], "build": {"cuda": info.get("cuda")},
                    "env": pp_env if v == "patched" else {},   # the baseline has no switches
                    "order": ",".join(order)}
            if "error" in res:
                rows = [{"variant": v, "devices": dev, "test": "workload", "avg_ts": float("nan"),
                         "error": res["error"][:2000], "label": "q6", **meta}]
            else:
                rows = []
                for st in res["steps"]:
                    ext = st.get("ext") or {}
                    rows.append({
                        "variant": v, "model": Path(ctx["model"]).name, "devices": dev, "split_mode": "layer",
                        "tensor_split": ctx["ts"], "host_experts": PLACEMENT.label,
                        "tensor_buft_overrides": ";".join(PLACEMENT.all_overrides()), "load_mode": "none",
                        "n_ctx": n_ctx, "n_batch": job["ctx"]["n_batch"], "n_ubatch": job["ctx"]["n_ubatch"],
                        **workload_step_row(st, res), "stddev_ts": 0.0, "samples_ts": [st["ts"]],
                        "avg_ns": int(st["seconds"] * 1e9),
                        "n_copies": res["schedule"]["n_copies"], "n_splits": res["schedule"]["n_splits"],
                        "h2d_bytes": sum(st["h2d_bytes_per_device"]), "upload_all": ext.get("upload_all"),
                        "plan_switch_drains": ext.get("plan_switch_drains"), "alloc_changed": int(changed(st)),
                        "compute_buffer_bytes": st["compute_buffer_after"], "label": "q6 mixed workload",
                        "alloc_before": st["alloc_before"], "alloc_after": st["alloc_after"],
                        "peak_alloc": st["peak_alloc"], "compute_buffer_before": st["compute_buffer_before"],
                        "graphs": ext.get("graphs"), "step": f"{st['kind']}{st['n']}", **meta})
            writer.write(Row.from_dict(r) for r in rows)
            with open(steps_file, "a") as f:
                f.writelines(json.dumps(r, default=float) + "\n" for r in rows)
            all_rows.extend(rows)

    body = []
    plot_groups, plot_series, plot_notes = [], {"baseline": [], "patched": []}, []
    for dev in devs:
        res_b, res_p = results.get((dev, "baseline")), results.get((dev, "patched"))
        ok = {v: r for v, r in (("baseline", res_b), ("patched", res_p)) if r and "error" not in r}
        names = next(iter(ok.values()))["backend_names"] if ok else []
        steps = [f"{k}{n}" for k, n in workload]
        rows = []
        for step in steps:
            cells = {}
            for v, r in ok.items():
                sts = [s for s in r["steps"] if f"{s['kind']}{s['n']}" == step]
                first = sts[0]["ts"] if sts else float("nan")
                later = [s["ts"] for s in sts[1:]] or [first]
                cells[v] = {"first": first, "later": statistics.fmean(later),
                            "sd": statistics.stdev(later) if len(later) > 1 else 0.0,
                            "syncs": statistics.fmean(s["host_syncs"] for s in sts),
                            "re": sum(changed(s) for s in sts), "n": len(sts),
                            "cb": any(s["compute_buffer_after"] != s["compute_buffer_before"] for s in sts),
                            "rb": statistics.fmean((s.get("ext") or {}).get("id_readbacks", 0) for s in sts),
                            # the scheduler's own count of re-reservations (patched build only)
                            "rr": sum((s.get("ext") or {}).get("reallocs", 0) for s in sts),
                            # graphs allocated from a kept plan instead (patch 0007), and of those with graphs in flight
                            "ps": sum((s.get("ext") or {}).get("plan_switches", 0) for s in sts),
                            "pd": sum((s.get("ext") or {}).get("plan_switch_drains", 0) for s in sts)}
            b, p = cells.get("baseline"), cells.get("patched")
            f = lambda c, k, fmt="{:.1f}": C.num(c[k], fmt) if c else ""
            sp = p["later"] / b["later"] if b and p and b["later"] > 0 else None
            rows.append([step, f(b, "first"), f(p, "first"),
                         (f"{b['later']:.1f} ± {b['sd']:.1f}" if b else ""), (f"{p['later']:.1f} ± {p['sd']:.1f}" if p else ""),
                         C.num(sp, "{:.2f}"), f"{f(b, 'syncs', '{:.0f}')} / {f(p, 'syncs', '{:.0f}')}",
                         f"{b['re'] if b else ''}/{b['n'] if b else ''} / {p['re'] if p else ''}/{p['n'] if p else ''}",
                         f"{'yes' if b and b['cb'] else 'no'} / {'yes' if p and p['cb'] else 'no'}",
                         f(p, "rb", "{:.0f}"), f(p, "rr", "{:.0f}"), f"{f(p, 'ps', '{:.0f}')} / {f(p, 'pd', '{:.0f}')}"])
            plot_groups.append(f"{step}")
            plot_series["baseline"].append(b["later"] if b else float("nan"))
            plot_series["patched"].append(p["later"] if p else float("nan"))
            plot_notes.append(f"{sp:.2f}x" if sp else "")
        if args.logits and len(ok) == 2:
            lb, lp = ok["baseline"]["logits"], ok["patched"]["logits"]
            kinds = [f"{s['kind']}{s['n']}" for s in ok["patched"]["steps"] for _ in range(s["n"] if s["kind"] == "tg" else 1)]
            lrows = []
            for step in dict.fromkeys(kinds):
                idx = [i for i, k in enumerate(kinds) if k == step]
                a, b = lp[idx].astype(np.float64), lb[idx].astype(np.float64)
                lrows.append([step, len(idx), f"{nmse(a, b):.3g}",
                              f"{float(np.abs(a - b).max()):.3g}"])
            body.append("## logits, patched vs baseline (each prompt's last token, every decoded token; all rounds)\n\n"
                        + C.md_table(["step", "rows", "NMSE", "max abs diff"], lrows, "lrrr"))
        # whole workload per round
        tot = []
        for v, r in ok.items():
            for rnd in range(rounds):
                sts = [s for s in r["steps"] if s["round"] == rnd]
                tot.append((v, rnd + 1, sum(s["n"] for s in sts), sum(s["seconds"] for s in sts),
                            sum(s["host_syncs"] for s in sts), sum(changed(s) for s in sts)))
        tot_rows = [[v, rnd, ntok, f"{sec:.3f}", f"{ntok / sec:.1f}", hs, re] for v, rnd, ntok, sec, hs, re in tot]
        mem_rows = []
        for v, r in ok.items():
            last = r["steps"][-1]
            mem_rows.append([v, " / ".join(f"{n}: {C.fmt_bytes(x)}" for n, x in zip(names, r["compute_buffer_at_creation"])),
                             " / ".join(f"{n}: {C.fmt_bytes(x)}" for n, x in zip(names, last["compute_buffer_after"])),
                             " / ".join(C.fmt_bytes(x) for x in r["steps"][0]["alloc_before"]),
                             " / ".join(C.fmt_bytes(x) for x in last["alloc_after"]),
                             " / ".join(C.fmt_bytes(max(s["peak_alloc"][i] for s in r["steps"]))
                                        for i in range(len(last["peak_alloc"]))),
                             r["schedule"]["n_copies"], "on" if r["schedule"]["pipeline_parallel"] else "off"])
        body.append(f"## per step ({C.short_devices(dev)}; n_batch {args.n_batch}, n_ubatch {args.n_ubatch}, "
                    f"{rounds} round(s))\n\n" + C.md_table(
                        ["step", "baseline t/s round 1", "patched t/s round 1", "baseline t/s later rounds",
                         "patched t/s later rounds", "speedup (later)", "host syncs/step b / p",
                         "steps with alloc change b / p", "compute buffer changed b / p", "id readbacks/step p",
                         "re-reservations p (all rounds)", "plan switches / with drain p (all rounds)"],
                        rows, "lrrrrrllllrl"))
        body.append("## whole workload per round\n\n" + C.md_table(
            ["variant", "round", "tokens", "seconds", "t/s", "host syncs", "steps with alloc change"], tot_rows,
            "lrrrrrr"))
        body.append("## device memory (VDEV counters) and compute buffers\n\n" + C.md_table(
            ["variant", "compute buffers at creation", "compute buffers at the end", "VDEV alloc at start",
             "VDEV alloc at the end", "VDEV peak alloc", "n_copies", "PP"], mem_rows, "llllllrl"))
        for v in ("baseline", "patched"):
            r = results.get((dev, v))
            if r and "error" in r:
                body.append(f"\nERROR {v}: {r['error'].splitlines()[0][:300]}\n")
    C.bar_plot(plot_groups, plot_series, ctx["out"] / "q6_reservation.png",
               "Q6: mixed workload in one context, t/s per step (rounds after the first)", notes=plot_notes)
    import pandas as pd
    C.finish(ctx, "Q6: graph reservation under a mixed workload",
             "One context per variant runs the workload " + ", ".join(f"{k}{n}" for k, n in workload)
             + f" {rounds} time(s); each pp starts from an empty cache, tg continues after the last prompt. "
             "`steps with alloc change` = steps during which a VDEV's allocated bytes changed or peaked above the "
             "starting level (proxy for a compute-buffer re-allocation), as count/steps.", "\n".join(body),
             pd.DataFrame(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
