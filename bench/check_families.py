#!/usr/bin/env python3
"""The logits check on every synth family's tiny preset: both variants on one placement (every expert in host RAM,
pipelined in the patched build), the NMSE and the largest absolute difference of every token's logits.

Exit 1 when any family's logits differ (NMSE above the limit). Default devices: three unequal VDEVs (memory, link
rate and compute speed all differ); on the GPU machine `--devices cuda` (e.g. one H200 split in two with
GGML_CUDA_DEVICES=2).

With `--cache N` (the device expert cache, EXPERT_CACHE=N: MiB per device, -N slots a layer) it checks decode
instead, token by token (every token a batch of its own, below op offload's threshold: the expert ops read the
slots on their layer's device), for each family with its routed experts in each of `--types`, and writes the
logits tolerance table: the NMSE and max abs difference against the baseline (its experts on the host CPU) beside
the NMSE upstream's test-backend-ops allows a MUL_MAT_ID on a backend against the CPU (MUL_MAT_ID_NMSE). Where the
devices compute with the host's kernels (VDEVs) the two are the same arithmetic on the same bytes: expect 0.

    python bench/check_families.py --cache -8 --devices "vdev:2x0@4GBps" --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pyllama_pp import synth
from pyllama_pp.check import check_logits
from pyllama_pp.params import ContextParams

FAMILIES = ("tiny", "mixtral-tiny", "qwen2moe-tiny", "glm4moe-tiny", "deepseek2-tiny", "gptoss-tiny")
UNEQUAL_VDEVS = json.dumps({"kind": "vdev", "devices": [
    {"memory": "96MiB", "link_gbps": 4, "speed": 1.0},
    {"memory": "64MiB", "link_gbps": 2, "speed": 1.5},
    {"memory": "48MiB", "link_gbps": 1, "speed": 2.0}]})
# the pinned tree's tests/test-backend-ops.cpp, test_mul_mat_id::max_nmse_err(): a MUL_MAT_ID of any expert type on a
# backend against the CPU's (2e-2 only for MXFP4 / NVFP4 on Blackwell's native FP4 with low-precision activations)
MUL_MAT_ID_NMSE = 5e-4
DECODE = ContextParams(n_ctx=64, n_batch=1, n_ubatch=1)   # every token a batch of its own
Q4_K_ROW = 256   # Q4_K's block: expert rows (n_embd, n_ff_exp) a multiple of it
TIES_HEAD_DIM = ("llama", "qwen2moe")   # arches whose n_head * head_dim must be n_embd (synth.SynthConfig)


def family_config(family: str, expert_type: str | None) -> synth.SynthConfig:
    """`family`'s tiny preset with its routed experts in `expert_type` (None: the preset's own); for Q4_K the expert
    rows are widened to its block (n_embd and n_ff_exp 256; head_dim follows n_embd where the arch ties them).

    Raises:
        ValueError: where synth cannot write that type for the family.
    """
    cfg = synth.preset(family, seed=1)
    over = {} if expert_type is None else {"expert_type": expert_type}
    if expert_type == "q4_k":
        over.update(n_embd=Q4_K_ROW, n_ff_exp=Q4_K_ROW)
        if cfg.arch in TIES_HEAD_DIM:
            over["head_dim"] = Q4_K_ROW // cfg.n_head
    return synth.preset(family, seed=1, **over)


def check_all(args) -> int:
    """Both variants' logits on the default batch sizes, family by family."""
    rows, t0, failed = [], time.time(), False
    print("| family | placement | tokens | n_ubatch | PP baseline/patched | splits | NMSE | max abs diff | same |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for fam in args.families.split(","):
        if args.budget and time.time() - t0 > args.budget - 30:
            print(f"(budget spent: {fam} and later not run)")
            break
        model = args.out / f"{fam}.gguf"
        synth.write_gguf(model, synth.preset(fam, seed=1))
        r = check_logits(model, devices=args.devices)
        rows.append({"family": fam, **r.to_dict()})
        failed |= not r.ok
        print(f"| {fam} | {r.placement} | {r.n_tokens} | {r.n_ubatch} | "
              f"{'on' if r.baseline_pipeline_parallel else 'off'}/{'on' if r.patched_pipeline_parallel else 'off'} | "
              f"{r.patched_n_splits} | {r.nmse:.3g} | {r.max_abs_diff:.3g} | {'yes' if r.ok else 'NO'} |", flush=True)
        model.unlink()
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


def check_cache(args) -> int:
    """Decode with the device expert cache against the baseline, family by family and expert type by type: the
    logits tolerance table (results.md) and its rows (results.json)."""
    switches = {"EXPERT_CACHE": args.cache, "EXPERT_CACHE_MIN_HIT": 0}   # (no guard: every op reads the slots)
    head = ("| family | arch | expert type | tokens | ops read the cache | hits / misses | NMSE | max abs diff | "
            "test-backend-ops MUL_MAT_ID NMSE limit | within |")
    lines = [head, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    rows, t0, failed = [], time.time(), False
    for fam in args.families.split(","):
        for etype in args.types.split(","):
            if args.budget and time.time() - t0 > args.budget - 30:
                print(f"(budget spent: {fam} {etype} and later not run)")
                break
            try:
                cfg = family_config(fam, etype)
            except ValueError as e:
                lines.append(f"| {fam} | | {etype} | not written: {e} | | | | | | |")
                print(lines[-1], flush=True)
                continue
            model = args.out / f"{fam}-{etype}.gguf"
            synth.write_gguf(model, cfg)
            r = check_logits(model, devices=args.devices, ctx=DECODE, n_tokens=args.tokens, switches=switches,
                             nmse_max=MUL_MAT_ID_NMSE)
            model.unlink()
            ok = r.ok and r.patched_cache_ops > 0
            failed |= not ok
            rows.append({"family": fam, "arch": cfg.arch, "expert_type": cfg.experts_type, "cache": args.cache,
                         **r.to_dict()})
            lines.append(f"| {fam} | {cfg.arch} | {cfg.experts_type} | {r.n_tokens} | {r.patched_cache_ops} | "
                         f"{r.patched_cache_hits} / {r.patched_cache_misses} | {r.nmse:.3g} | {r.max_abs_diff:.3g} | "
                         f"{MUL_MAT_ID_NMSE:g} | {'yes' if ok else 'NO'} |")
            print(lines[-1], flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=UNEQUAL_VDEVS, help="device spec (default: three unequal VDEVs)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="synth presets, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench/out/check_families"), help="folder for results.json")
    ap.add_argument("--budget", type=float, default=0, help="seconds (bench/gpu_run.sh passes it; 0: no limit)")
    ap.add_argument("--cache", type=int, default=None, metavar="N",
                    help="check decode with EXPERT_CACHE=N (MiB per device, -N slots a layer) against the baseline")
    ap.add_argument("--types", default=",".join(synth.EXPERT_TYPES),
                    help="with --cache: the routed experts' types, comma-separated (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="with --cache: tokens decoded (default %(default)s)")
    args = ap.parse_args()
    if args.cache == 0:
        ap.error("--cache 0 is the path without the cache: give a size (MiB per device, or -N slots a layer)")
    args.out.mkdir(parents=True, exist_ok=True)
    return check_all(args) if args.cache is None else check_cache(args)


if __name__ == "__main__":
    sys.exit(main())
