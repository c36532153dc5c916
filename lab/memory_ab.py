#!/usr/bin/env python3
"""Device memory of baseline and patched: are the patched build's compute buffers within the baseline's plus
two expert tensors per device (the transient copies of a pipelined host weight)? Prints one table per model.

Schedule jobs only (no decoding): every expert in host RAM, two unthrottled VDEVs, n_batch = 16 x n_ubatch.
  python lab/memory_ab.py          the tiny preset with 7 layers (ts 3,5, n_ctx 2304), n_ubatch 32 and 128
  python lab/memory_ab.py --more   also the small preset (12 layers, ts 6,7) and the qwen3-30b-a3b geometry with
                                   2 layers (n_batch = 8 x n_ubatch; writes a 1.3 GB model into the cache)
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # bench/_common.py
import _common as C
from pyllama_pp.worker import run_job
from pyllama_pp import synth

# (the naive change - the gate alone, a device copy of each host weight per graph in flight - and upstream's 4
# copies were switches of earlier builds: the rows in docs/results/history-2026-11.md were measured with those)
BUILDS = [("baseline", "baseline", {}), ("patched", "patched", {}),
          ("patched, a device copy of the user inputs per graph (EARLY_INPUTS=0)", "patched",
           {"GGML_SCHED_PP_EARLY_INPUTS": "0"})]


def table(title: str, model: str, cfg, ts, cases, builds=BUILDS) -> str:
    """cases: (n_ubatch, n_batch, n_ctx)."""
    one = synth.expert_bytes_per_layer(cfg) // 3
    lines = [f"### {title}", f"one expert tensor: {one / 2**20:.2f} MiB; bound: baseline + 2 x that per device", "",
             "| build | n_ubatch | n_ctx | PP | n_copies | VDEV0 compute buffer | VDEV1 compute buffer | within the bound |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for ub, nb, n_ctx in cases:
        base = None
        for name, variant, env in builds:
            r = run_job({"kind": "schedule", "model": model, "devices": "vdev:2x0@0",
                         "placement": {"host_experts": "all", "tensor_split": ts},
                         "ctx": {"n_ctx": n_ctx, "n_batch": nb, "n_ubatch": ub}}, variant, env=env, timeout=300)["schedule"]
            bufs = {b["name"]: b["compute_buffer_bytes"] for b in r["backends"]}
            a, b = bufs["VDEV0"], bufs["VDEV1"]
            base = base or (a, b)
            ok = "yes" if a <= base[0] + 2 * one and b <= base[1] + 2 * one else "no"
            lines.append(f"| {name} | {ub} | {n_ctx} | {'on' if r['pipeline_parallel'] else 'off'} | {r['n_copies']} "
                         f"| {a / 2**20:.2f} MiB | {b / 2**20:.2f} MiB | {'' if variant == 'baseline' else ok} |")
    return "\n".join(lines) + "\n"


ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--more", action="store_true", help="also the small preset and the qwen3-30b-a3b geometry")
args = ap.parse_args()
tiny = synth.preset("tiny", seed=1, n_layer=C.N_LAYER)
print(table(f"tiny preset, {C.N_LAYER} layers, ts 3,5", str(C.synth_model()), tiny, [3, 5],
            [(ub, 16 * ub, 2304) for ub in (32, 128)]))
if args.more:
    small = synth.preset("small", seed=1)
    print(table("small preset, 12 layers, ts 6,7", str(C.synth_model(preset="small", n_layer=small.n_layer)), small,
                [6, 7], [(ub, 16 * ub, 2304) for ub in (32, 128)]))
    big = synth.preset("qwen3-30b-a3b", seed=1, n_layer=2)
    print(table("qwen3-30b-a3b geometry, 2 layers, ts 1,1", str(C.synth_model(preset="qwen3-30b-a3b", n_layer=2)),
                big, [1, 1], [(512, 8 * 512, 4352), (1024, 8 * 1024, 16640)], builds=BUILDS[:4]))
