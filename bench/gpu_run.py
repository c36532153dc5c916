#!/usr/bin/env python3
"""Issue 6 on the GPU machine: correctness and the A/B sweeps on CUDA, within a time budget.

Run by bench/gpu_run.sh after the CUDA build. Steps run in priority order and each is skipped when the
budget left cannot hold it; every finished step's table is written under --out at once, so a cut-off
run still returns what it measured.

  1. devices and build facts
  2. correctness on the tiny preset: patched vs baseline logits, same placement (2 GPUs, experts in host
     RAM), and each vs all weights on the GPUs (NMSE, max abs diff)
  3. the qwen3-30b-a3b preset (near-uniform routing) written to local disk
  4. A/B sweeps on it (both variants, pinned host weights, every expert in host RAM, layer split):
     pp4096/b4096/ub512 + tg32, pp16384/b16384/ub1024, then more if time is left
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np

import gather_timeline   # bench/gather_timeline.py (this script's folder is on sys.path)

from pyllama_pp import bench, synth
from pyllama_pp.errors import PyllamaError
from pyllama_pp.worker import run_job

T0 = time.time()


def left(budget: float) -> float:
    return budget - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# patch 0008 at every expert op but the one that measures coverage: upload-all off, DIRECT=2 (the 30B preset's rows,
# 2048 and 768 values, are whole steps of CUDA's MMQ; the tiny preset's are not, see the patch)
DIRECT_ONLY = {"GGML_SCHED_PP_DIRECT": "2", "GGML_SCHED_PP_UPLOAD_ALL": "0", "GGML_SCHED_PP_GATHER": "0"}
NO_UPLOAD_ALL = {"GGML_SCHED_PP_UPLOAD_ALL": "0"}
GRID_BLOCKS = {"PYLLAMA_PP_GATHER_BLOCKS": "0"}   # the CUDA gather's grid per expert (the default without OVERLAP=2)


def gather_blocks(n: int) -> dict:
    """The CUDA gather's copy kernel with n blocks in all (default: a grid per expert, 16 blocks with OVERLAP=2;
    gather_cuda_kernels.cuh)."""
    return {"PYLLAMA_PP_GATHER_BLOCKS": str(n)}


FEW_BLOCKS = gather_blocks(16)   # the block count that pays with OVERLAP=2 (run 27)


def skewed_patched(name: str, est: int, configs=None, **block) -> dict:
    """A sweep block on the skewed model, patched build only (low coverage: SKEWED_LOW unless `configs`)."""
    return {"name": name, "model": "skewed", "est": est, "variants": ["patched"], "configs": configs or SKEWED_LOW,
            **block}


def correctness(model: str, devices: str, out: Path,
                cases=((64, "none", {}), (512, "none", {}), (512, "mmap", {}), (512, "none", {"GGML_SCHED_PP_OVERLAP": "1"}),
                       (64, "none", {"GGML_SCHED_PP_OVERLAP": "2"}), (512, "none", {"GGML_SCHED_PP_OVERLAP": "2"}),
                       (64, "none", {"GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "1", **NO_UPLOAD_ALL}),
                       (64, "none", {"GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "2",
                                     "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": "1", **NO_UPLOAD_ALL}),
                       (64, "none", {"GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "2", **NO_UPLOAD_ALL})),
                n_tokens: int = 512, all_on_gpu: bool = True, timeout: float = 300) -> list[dict]:
    """(n_ubatch, load mode, patched build's environment) cases; mmap: host weights in pageable memory (the
    patched build stages them); OVERLAP=1: the opt-in upload ring of patch 0009; OVERLAP=2: patch 0009's early
    uploads inside the compute buffer; PREFETCH (0010) with upload-all off, so that every expert op gathers, and
    PREFETCH=2 (0010: up and down two splits early, the copies in three lanes).
    `timeout`: seconds a worker may take (a hang costs no more)."""
    rows = []
    refs: dict = {}   # baseline and all-on-GPU logits per (name, n_ubatch, load mode): the cases share them

    def logits(name: str, variant: str, he: str, ub: int, mode: str, env: Optional[dict]) -> tuple:
        path = out / f"logits_{name}_ub{ub}.npy"
        res = run_job({"kind": "logits", "model": model, "devices": devices,
                       "placement": {"host_experts": he, "load_mode": mode},
                       "ctx": {"n_ctx": n_tokens + 64, "n_batch": n_tokens, "n_ubatch": ub},
                       "n_tokens": n_tokens, "seed": 7, "logits": "all", "out": str(path)}, variant, timeout=timeout, env=env)
        arr = np.load(path)
        path.unlink()
        return arr, res

    for ub, mode, penv in cases:
        got = {}
        for name, variant, he in (("baseline", "baseline", "all"), ("all_on_gpu", "baseline", "none"))[:2 if all_on_gpu else 1]:
            if (name, ub, mode) not in refs:
                arr, res = logits(name, variant, he, ub, mode, None)
                refs[(name, ub, mode)] = (arr, res["schedule"])
            got[name] = refs[(name, ub, mode)]
        arr, res = logits("patched", "patched", "all", ub, mode, penv)
        got["patched"] = (arr, res["schedule"])
        ext = {k: (res.get("ext") or {}).get(k) for k in ("id_readbacks", "selective", "upload_all", "direct", "gather", "prefetch", "chained")}
        b, p = got["baseline"][0], got["patched"][0]
        g = got["all_on_gpu"][0] if all_on_gpu else None
        rows.append({"model": Path(model).name, "devices": devices, "n_ubatch": ub, "load_mode": mode, "patched_env": penv,
                     "n_tokens": n_tokens,
                     "nmse_patched_vs_baseline": bench.nmse(p, b), "maxabs_patched_vs_baseline": float(np.abs(p - b).max()),
                     "nmse_baseline_vs_all_on_gpu": bench.nmse(b, g) if g is not None else None,
                     "nmse_patched_vs_all_on_gpu": bench.nmse(p, g) if g is not None else None, "patched_ext": ext,
                     "pp_baseline": got["baseline"][1]["pipeline_parallel"],
                     "pp_patched": got["patched"][1]["pipeline_parallel"]})
        log(f"correctness ub={ub}: {rows[-1]}")
    return rows


PP4096 = [["pp", 4096]]
PP16K = [["pp", 16384]]
PP512 = [["pp", 512]]
# Blocks of configs that share one loaded model per variant (bench.ab groups them); in priority order, each
# skipped when the budget left is below its estimate (seconds, both variants, model loads included; measured
# on 2xH200 on 2026-11-30 before STABLE_DEPS (patch 0007), so with the re-reservations: faster runs will take less).
UNIFORM = {"name": "uniform", "est": 185, "configs": [(4096, 512, PP4096 + [["tg", 32]]), (16384, 1024, PP16K)]}
ONE_GPU = {"name": "one-gpu", "devices": "cuda:0", "est": 90, "configs": [(4096, 512, PP4096 + [["tg", 32]])]}
ONE_H200_AS_TWO = {"name": "one-h200-as-two", "devices": "cuda", "est": 85,
                   "env": {"CUDA_VISIBLE_DEVICES": "0", "GGML_CUDA_DEVICES": "2"}, "configs": [(4096, 512, PP4096)]}
SKEWED = {"name": "skewed", "model": "skewed", "est": 180,
          "configs": [(4096, 512, PP4096), (16384, 1024, PP16K), (512, 128, PP512)]}
MMAP = {"name": "mmap", "load_mode": "mmap", "est": 250, "configs": [(4096, 512, PP4096)]}
TG32 = [(4096, 512, [["tg", 32]])]
DECODE = {"name": "decode", "est": 70, "reps": 6, "configs": TG32}
DECODE_ONE_GPU = {"name": "decode-one-gpu", "devices": "cuda:0", "est": 70, "reps": 6, "configs": TG32}
DECODE_AGAIN = [{**DECODE_ONE_GPU, "est": 60}, {**DECODE, "est": 60}, {**DECODE_ONE_GPU, "name": "decode-one-gpu-2", "est": 60}]
TG32_D2048 = [(4096, 512, [["tg", 32, 2048]])]   # tg32 right after 2048 tokens
SKEWED_ONE_LINK = {**ONE_H200_AS_TWO, "name": "one-h200-as-two-skewed", "model": "skewed"}
DECODE_DEPTH = [{"name": "decode-depth", "est": 75, "reps": 6, "configs": TG32_D2048},
                {"name": "decode-depth-patched-first", "est": 75, "reps": 6, "variants": ["patched", "baseline"],
                 "configs": TG32_D2048},
                {**DECODE_ONE_GPU, "name": "decode-depth-one-gpu", "est": 75, "configs": TG32_D2048}]
OVERLAP2 = {"OVERLAP": 2, "PREFETCH": 0}   # OVERLAP=2 as runs 16-29 measured it (before PREFETCH, on since run 31)
PREFETCH_ON = {**OVERLAP2, "PREFETCH": 1}   # patch 0010 acts with OVERLAP=2 only
ONE_SWITCH = {"OVERLAP": 2}   # since run 31: with PREFETCH (default on) and 16-block gathers (BESIDE)
PREFETCH2 = {"OVERLAP": 2, "PREFETCH": 2}   # patch 0010 (opt-in): up prefetched, up's rest and down two splits early
SKEWED_LOW = [(4096, 512, PP4096), (4096, 256, PP4096)]   # 37% / 34% coverage
DECODE_LONG = {"name": "decode-long", "est": 130, "reps": 5, "configs": [(4096, 512, [["tg", 128, 2048]])]}   # tg128 @ d2048
DECODE_LONG_ONE_GPU = {**DECODE_LONG, "name": "decode-long-one-gpu", "devices": "cuda:0", "est": 110}
SWEEPS = {
    "main": [
        UNIFORM,
        {"name": "uniform-best", "est": 130, "configs": [(16384, 4096, PP16K), (4096, 256, PP4096)]},
    ],
    "more": [ONE_GPU, ONE_H200_AS_TWO, SKEWED, MMAP],
    "quick": [{**UNIFORM, "est": 95, "configs": [(4096, 512, PP4096)]}],
    # patch 0004's default keeps one graph in flight per GPU; upstream's count for comparison
    "copies": [{"name": "copies4", "est": 45, "ext": {"COPIES": 4}, "variants": ["patched"],
                "configs": [(4096, 512, PP4096)]}],
    # single blocks, to combine in one call: --sweep mmap,skewed,quick
    "mmap": [{**MMAP, "est": 150, "reps": 1}],
    "skewed": [SKEWED],
    "one-gpu": [ONE_GPU],
    "one-h200-as-two": [ONE_H200_AS_TWO],
    # patch 0009 (OVERLAP, opt-in): the same configs as uniform-best and uniform, patched only, ring on
    "overlap": [{"name": "overlap", "est": 110, "ext": {"OVERLAP": 1}, "variants": ["patched"],
                 "configs": [(16384, 4096, PP16K), (4096, 512, PP4096), (16384, 1024, PP16K)]}],
    # patch 0005: coverage in real models' band (skew 1.0: 58% at ub512): the auto bar (55%) vs the old 85%
    "band": [{"name": "band", "model": "skewed", "skew": 1.0, "est": 120,
              "configs": [(4096, 512, PP4096), (16384, 1024, PP16K)]},
             {"name": "band-bar85", "model": "skewed", "skew": 1.0, "est": 60, "ext": {"UPLOAD_ALL_MIN_COV": 85},
              "variants": ["patched"], "configs": [(4096, 512, PP4096), (16384, 1024, PP16K)]}],
    # patch 0008 (DIRECT, opt-in): below the coverage bar the GPU reads the used experts from pinned host memory
    # itself (no readback per layer): the skewed A/B (37% coverage), then the same configs with DIRECT=2, and at
    # 100% coverage with upload-all off (the kernel's read rate vs the copy engine's)
    "direct": [{**SKEWED, "est": 130, "configs": SKEWED["configs"][:2]},
               {"name": "direct-skewed", "model": "skewed", "est": 50, "ext": {"DIRECT": 2}, "variants": ["patched"],
                "configs": SKEWED["configs"][:2]},
               {"name": "direct-uniform", "est": 45, "ext": {"DIRECT": 2, "UPLOAD_ALL": 0}, "variants": ["patched"],
                "configs": [(4096, 512, PP4096)]}],
    # patch 0008 after its review (DIRECT_MAX_TOKENS: ub1024 at 40% coverage should fall back to the selective copy),
    # with ub256 (about 50 tokens per used expert) added; both variants, then patched with DIRECT=2
    "direct-again": [{**SKEWED, "est": 150, "configs": SKEWED["configs"][:2] + [(4096, 256, PP4096)]},
                     {"name": "direct-skewed", "model": "skewed", "est": 70, "ext": {"DIRECT": 2}, "variants": ["patched"],
                      "configs": SKEWED["configs"][:2] + [(4096, 256, PP4096)]},
                     {"name": "direct-not-first", "model": "skewed", "est": 50, "ext": {"DIRECT": 2, "DIRECT_FIRST": 0},
                      "variants": ["patched"], "configs": SKEWED_LOW}],
    # patches 0007 (PLANS) and 0008 (DIRECT by default, not on the first GPU): the skewed A/B with the defaults
    # (run 12 has ub512/ub256 selective, DIRECT_FIRST=1 and =0), a small batch, one shared link, and a near-uniform
    # check (above the coverage bar: upload-all, unchanged); with PP_Q6=1 for the mixed workload
    "defaults": [{**SKEWED, "name": "skewed-defaults", "est": 150,
                  "configs": [(4096, 512, PP4096), (4096, 256, PP4096), (512, 128, PP512)]},
                 {**SKEWED_ONE_LINK, "est": 90},
                 {**UNIFORM, "name": "uniform-defaults", "est": 95, "configs": [(4096, 512, PP4096)]}],
    # patch 0008 after run 13: DIRECT's default (auto) stays off on one shared link; the mixed workload's decode and
    # the decode rows once more (with PP_Q6=1 PP_Q6_ROUNDS=3)
    "defaults-again": [{**SKEWED_ONE_LINK, "est": 75}] + DECODE_AGAIN,
    # decode right after a filled context (llama-bench's -d; the mixed workload's tg16 after pp2048 swung 0.66-1.32x
    # on one sample per round): tg32 at depth 2048, 6 reps each, the variants' order both ways, 2 GPUs and 1 GPU
    "decode-depth": DECODE_DEPTH,
    # the same with OVERLAP=2 (the candidate default after run 16)
    "decode-depth-overlap2": [{**b, "name": b["name"] + "-overlap2", "ext": OVERLAP2} for b in DECODE_DEPTH],
    # low coverage with the defaults: the second GPU reads its experts in its kernels (~half the copy engine's rate)
    # and became the slower stage at ub512 (run 13): fewer layers for it (llama's -ts), both variants alike
    "skewed-balance": [{**SKEWED, "name": f"skewed-ts{a}-{b}", "est": 100, "tensor_split": [a, b],
                        "configs": SKEWED_LOW} for a, b in ((28, 20), (32, 16))],
    # patch 0009 (OVERLAP=2, opt-in): the uploads overlap compute inside the compute buffer, within issue 4's memory
    # bound - the candidate default if it matches OVERLAP=1's rows (run 8: 1567.9 / 3279.1 / 9310.7 t/s); both
    # variants, near-uniform routing; the correctness step checks it on the tiny preset (ub64, ub512)
    "overlap2": [{"name": "overlap2", "est": 200, "ext": OVERLAP2,
                  "configs": [(4096, 512, PP4096), (16384, 1024, PP16K), (16384, 4096, PP16K)]},
                 # low coverage: the first GPU's selective copies of up and down go up early too (patched only;
                 # compare with the skewed rows of runs 12-13: 2622.4 / 1812.0 t/s with the defaults)
                 {"name": "skewed-overlap2", "model": "skewed", "est": 60, "ext": OVERLAP2,
                  "variants": ["patched"], "configs": SKEWED_LOW}],
    # OVERLAP=2 at low coverage in one call (run 16's patched-only 2477.6 t/s at ub512 vs run 13's 2622.4 with
    # OVERLAP off came from different calls): the A/B with OVERLAP=2, then patched with OVERLAP off
    "overlap2-low": [{**SKEWED, "name": "skewed-overlap2", "est": 130, "ext": OVERLAP2, "configs": SKEWED_LOW},
                     {"name": "skewed-overlap0", "model": "skewed", "est": 50, "ext": {"OVERLAP": 0}, "variants": ["patched"],
                      "configs": SKEWED_LOW}],
    # OVERLAP=2 by default (patch 0009): what runs 16-17 did not cover - near-uniform ub256 (the 85% target starts
    # there), mmap (pageable weights: staged, not early), one shared link, and a small batch at low coverage
    # (run 18 ran it while OVERLAP=2 was the default; the ext makes it measure the same now that it is not)
    "overlap2-default": [{**UNIFORM, "name": "uniform-ub256", "est": 70, "ext": OVERLAP2, "configs": [(4096, 256, PP4096)]},
                         {**MMAP, "est": 150, "reps": 1, "ext": OVERLAP2},
                         {**ONE_H200_AS_TWO, "est": 85, "ext": OVERLAP2},
                         {**SKEWED, "name": "skewed-small", "est": 45, "ext": OVERLAP2,
                          "configs": [(512, 128, PP512)]}],
    # patch 0009 (OVERLAP_POOL) on CUDA: OVERLAP=2's compute buffers should drop from 648.3 / 732.5 / 1670.1 MiB per
    # GPU (runs 16 and 18) to about the default's plus one expert copy (VDEVs with CUDA's padding: 484.8 at ub512,
    # 1118.1 at ub4096) at the same speed (1503.7 / 3159.8 / 9434.9 t/s); then unpooled at ub512 as the control
    "overlap2-pool": [{"name": "overlap2-pooled", "est": 170, "ext": OVERLAP2,
                       "configs": [(4096, 512, PP4096), (16384, 1024, PP16K), (16384, 4096, PP16K)]},
                      {"name": "overlap2-unpooled", "est": 40, "ext": {**OVERLAP2, "OVERLAP_POOL": 0},
                       "variants": ["patched"], "configs": [(4096, 512, PP4096)]}],
    # decode after a filled context with more tokens per sample (tg16/tg32 single samples swung 0.66-1.32x): tg128
    # at depth 2048, 5 reps, both variant orders, 2 GPUs
    "decode-long": [DECODE_LONG, {**DECODE_LONG, "name": "decode-long-patched-first", "variants": ["patched", "baseline"]}],
    # patch 0010 (GATHER, on by default where pyllama_pp's CUDA gather library loads): low coverage, where the
    # selective copy's readbacks (first GPU) and DIRECT's slow kernel reads (second GPU) gave 62% / 75% of the bound
    # (runs 13, 17): the A/B with the defaults, then patched with OVERLAP=2 (up and down gathered on the second
    # stream while the op before computes), then patched with GATHER=0 (the old defaults) in the same call
    "gather": [{**SKEWED, "name": "skewed-gather", "est": 130, "configs": SKEWED_LOW},
               {"name": "skewed-gather-overlap2", "model": "skewed", "est": 50, "ext": OVERLAP2, "variants": ["patched"],
                "configs": SKEWED_LOW},
               {"name": "skewed-gather0", "model": "skewed", "est": 50, "ext": {"GATHER": 0}, "variants": ["patched"],
                "configs": SKEWED_LOW}],
    # GATHER where runs 12-13 had the selective copy or DIRECT: low coverage at ub1024 (DIRECT_MAX_TOKENS kept the
    # selective copy there: 3049.8 t/s, 37% of the bound) and a small batch (pp512 / ub128)
    "gather-more": [{**SKEWED, "name": "skewed-gather-more", "est": 110,
                     "configs": [(16384, 1024, PP16K), (512, 128, PP512)]}],
    # after the review of the CUDA gather (one stream per GPU, no false return once queued): low coverage again,
    # patched only (run 22: 3162.8 t/s), and one H200 as two devices (one shared link, where DIRECT's auto rule
    # kept DIRECT off) at low coverage, both variants, then patched with GATHER=0
    "gather-check": [{"name": "skewed-gather-again", "model": "skewed", "est": 35, "variants": ["patched"],
                      "configs": [(4096, 512, PP4096)]},
                     {**SKEWED_ONE_LINK, "name": "one-h200-as-two-skewed-gather", "est": 85},
                     {**SKEWED_ONE_LINK, "name": "one-h200-as-two-skewed-gather0", "est": 45, "ext": {"GATHER": 0},
                      "variants": ["patched"]}],
    # what compute alone allows at low coverage (every weight in VRAM, upstream pipelines it): the compute part of
    # the bound of the skewed rows (runs 22-24)
    "compute-skewed": [{"name": "all-on-gpu-skewed", "model": "skewed", "host_experts": "none", "variants": ["baseline"],
                        "est": 60, "configs": SKEWED_LOW}],
    # the CUDA gather's copy kernel with a few blocks in all (PYLLAMA_PP_GATHER_BLOCKS) against its grid per expert
    # (the default; run 27's probe: the grid takes every SM while it waits on the link, 16 blocks copy as fast and
    # leave compute beside them): low coverage against upstream, with OVERLAP=2, the grid as the same-call control
    # (runs 22/24: 3162.8 / 3166.5 t/s at ub512), and 8 / 32 blocks. PP_GATHER_PROBE=1 adds bench/gather_probe.cu.
    # Run 27: 16 blocks pay only with OVERLAP=2 (RESULTS 2h)
    "gather-few": [{"name": "skewed-gather-few", "model": "skewed", "est": 60, "env": FEW_BLOCKS, "configs": SKEWED_LOW},
                   skewed_patched("skewed-gather-few-overlap2", 30, ext=OVERLAP2, env=FEW_BLOCKS),
                   skewed_patched("skewed-gather-grid", 30, env=GRID_BLOCKS),
                   skewed_patched("skewed-gather-8-blocks", 30, env=gather_blocks(8)),
                   skewed_patched("skewed-gather-32-blocks", 30, env=gather_blocks(32))],
    # 16 blocks where runs 23-24 measured the grid: low coverage at ub1024 and pp512 / ub128, the A/B, then patched
    # with OVERLAP=2; and one H200 as two devices (one shared link), the A/B (run 28)
    "gather-few-more": [{**SKEWED, "name": "skewed-gather-few-more", "est": 110, "env": FEW_BLOCKS,
                         "configs": [(16384, 1024, PP16K), (512, 128, PP512)]},
                        skewed_patched("skewed-gather-few-more-overlap2", 60, [(16384, 1024, PP16K), (512, 128, PP512)],
                                       ext=OVERLAP2, env=FEW_BLOCKS),
                        {**SKEWED_ONE_LINK, "name": "one-h200-as-two-skewed-gather-few", "est": 85,
                         "env": {**SKEWED_ONE_LINK.get("env", {}), **FEW_BLOCKS}}],
    # the final check of session 8's build on CUDA (the grid by default again): the tiny preset's correctness cases
    # run first; then low coverage at ub512, patched with the default and with 16 blocks + OVERLAP=2
    "gather-final": [skewed_patched("skewed-gather-final", 35, [(4096, 512, PP4096)]),
                     skewed_patched("skewed-gather-final-few-overlap2", 35, [(4096, 512, PP4096)], ext=OVERLAP2,
                                    env=FEW_BLOCKS)],
    # patch 0010 (PREFETCH, opt-in, experimental): with OVERLAP=2 and 16-block gathers (run 27's best: 3314.1 /
    # 1929.1 t/s), the gate copies prefetched by the last used set a split early; low coverage at ub512 / ub256 and
    # ub1024, patched, then the same without PREFETCH as the same-call control. The correctness step checks it
    "prefetch": [skewed_patched("skewed-prefetch", 40, ext=PREFETCH_ON, env=FEW_BLOCKS),
                 skewed_patched("skewed-prefetch-control", 40, ext=OVERLAP2, env=FEW_BLOCKS),
                 skewed_patched("skewed-prefetch-ub1024", 45, [(16384, 1024, PP16K)], ext=PREFETCH_ON, env=FEW_BLOCKS),
                 # a small batch ("never below 0.97x"; upstream 522.9-563.7 t/s in runs 23 / 28) and the default
                 # settings at ub512 (counted gather bytes beside the estimate, where runs 22-29 had only it)
                 skewed_patched("skewed-prefetch-small", 35, [(512, 128, PP512)], ext=PREFETCH_ON, env=FEW_BLOCKS),
                 skewed_patched("skewed-defaults-counted", 35, [(4096, 512, PP4096)]),
                 # near-uniform (above the upload-all bar: no gathers, so no prefetches): unchanged from
                 # OVERLAP=2 pooled (run 21: 1579.3 t/s)
                 {"name": "uniform-prefetch", "est": 45, "ext": PREFETCH_ON, "variants": ["patched"],
                  "configs": [(4096, 512, PP4096)]}],
    # OVERLAP=2 alone since run 31 brings PREFETCH (on by default, acting with OVERLAP=2 only) and 16-block gathers
    # (the scheduler flags OVERLAP=2's gathers BESIDE; runs 32-33 had a one-kernel gather, not kept): run 30's best
    # rows with one switch - low coverage at ub1024 against upstream, at ub512 against upstream, at ub256 - with
    # the CUDA gather's timeline ("timeline":
    # PYLLAMA_PP_GATHER_TIMELINE, bench/gather_timeline.py: where the link waits); the ub1024 control without
    # PREFETCH; what compute alone allows at ub1024; the grid and 32 blocks for the gathers with ids at ub1024 (the
    # prefetches keep 16); the default settings at ub512 (run 30: 3199.7 t/s)
    "timeline": [{**skewed_patched("overlap2-ub1024-tl", 90, [(16384, 1024, PP16K)], ext=ONE_SWITCH, timeline=True),
                  "variants": bench.VARIANTS},
                 {**skewed_patched("overlap2-ub512-tl", 60, [(4096, 512, PP4096)], ext=ONE_SWITCH, timeline=True),
                  "variants": bench.VARIANTS},
                 skewed_patched("overlap2-ub256", 35, [(4096, 256, PP4096)], ext=ONE_SWITCH),
                 skewed_patched("overlap2-no-prefetch-ub1024-tl", 45, [(16384, 1024, PP16K)], ext=OVERLAP2,
                                env=FEW_BLOCKS, timeline=True),
                 {"name": "all-on-gpu-skewed-ub1024", "model": "skewed", "host_experts": "none", "variants": ["baseline"],
                  "est": 45, "configs": [(16384, 1024, PP16K)]},
                 skewed_patched("overlap2-ub1024-grid", 45, [(16384, 1024, PP16K)], ext=ONE_SWITCH, env=GRID_BLOCKS),
                 skewed_patched("overlap2-ub1024-32", 45, [(16384, 1024, PP16K)], ext=ONE_SWITCH, env=gather_blocks(32)),
                 skewed_patched("defaults-ub512", 35, [(4096, 512, PP4096)]),
                 # one H200 as two, OVERLAP=2 alone (run 31, two kernels a gather: 1993.4 t/s)
                 {**SKEWED_ONE_LINK, "name": "one-link-skewed-overlap2-tl-2", "est": 45, "ext": ONE_SWITCH,
                  "variants": ["patched"], "timeline": True}],
    # one H200 as two devices (one shared link; the machine kind with one H200), low coverage: the A/B with the
    # defaults at ub512 (runs 24 / 28: 1889.5 / 1861.4 vs 1806.3 / 1803.5 t/s), then OVERLAP=2 alone (PREFETCH and
    # 16-block gathers since run 31) with the gather timeline, and the A/B with OVERLAP=2 at ub1024
    "one-link-overlap2": [{**SKEWED_ONE_LINK, "name": "one-link-skewed-defaults", "est": 85},
                          {**SKEWED_ONE_LINK, "name": "one-link-skewed-overlap2-tl", "est": 45, "ext": ONE_SWITCH,
                           "variants": ["patched"], "timeline": True},
                          {**SKEWED_ONE_LINK, "name": "one-link-skewed-overlap2-ub1024", "est": 110, "ext": ONE_SWITCH,
                           "configs": [(16384, 1024, PP16K)]}],
    # the last check of session 9 (run 33, OVERLAP=2 alone: PREFETCH, 16-block gathers - there one kernel a gather,
    # not kept: the two kernels of run 30 / 31 are the build): the 30B preset's correctness with it (step
    # correctness_overlap2), low coverage at ub512 / ub1024 without the timeline, near-uniform A/B with tg32 (no
    # gathers there: OVERLAP=2's uploads; decode)
    "final-overlap2": [skewed_patched("overlap2-final-ub512", 35, [(4096, 512, PP4096)], ext=ONE_SWITCH),
                       skewed_patched("overlap2-final-ub1024", 35, [(16384, 1024, PP16K)], ext=ONE_SWITCH),
                       {"name": "uniform-overlap2", "est": 95, "ext": ONE_SWITCH,
                        "configs": [(4096, 512, PP4096 + [["tg", 32]])]}],
    # patch 0010 (PREFETCH=2, opt-in): low coverage at ub1024 - the one row OVERLAP=2 left below 85% of the bound
    # (run 30: 80.5%) - against upstream with the gather timeline, then OVERLAP=2 alone (PREFETCH=1) as the
    # same-call control; ub512 / ub256 with each; near-uniform (upload-all: whole copies two splits early) with it
    "prefetch2": [{**skewed_patched("prefetch2-ub1024-tl", 90, [(16384, 1024, PP16K)], ext=PREFETCH2, timeline=True),
                   "variants": bench.VARIANTS},
                  skewed_patched("overlap2-ub1024-control", 40, [(16384, 1024, PP16K)], ext=ONE_SWITCH),
                  skewed_patched("prefetch2-low", 40, ext=PREFETCH2),
                  skewed_patched("overlap2-low-control", 40, ext=ONE_SWITCH),
                  {"name": "uniform-prefetch2", "est": 45, "ext": PREFETCH2, "variants": ["patched"],
                   "configs": [(4096, 512, PP4096)]}],
    # PREFETCH=2 against OVERLAP=2 alone (PREFETCH=1) at ub1024, low coverage, twice each, interleaved (runs 34-35
    # measured them in different calls and orders)
    "prefetch2-ub1024": [skewed_patched("overlap2-ub1024-a", 45, [(16384, 1024, PP16K)], ext=ONE_SWITCH),
                         skewed_patched("prefetch2-ub1024-a", 45, [(16384, 1024, PP16K)], ext=PREFETCH2),
                         skewed_patched("overlap2-ub1024-b", 45, [(16384, 1024, PP16K)], ext=ONE_SWITCH),
                         skewed_patched("prefetch2-ub1024-b", 45, [(16384, 1024, PP16K)], ext=PREFETCH2)],
    # patch 0010 as it ends session 10 (lanes set up with the upload ring's code, PREFETCH2_MIN_TOKENS 1024): ub1024
    # with PREFETCH=2, then ub512 / ub256 where it now goes up as PREFETCH=1 (its copies in the lanes) and the same
    # with OVERLAP=2 alone
    "prefetch2-final": [skewed_patched("prefetch2-final-ub1024", 40, [(16384, 1024, PP16K)], ext=PREFETCH2),
                        skewed_patched("prefetch2-final-low", 40, ext=PREFETCH2),
                        skewed_patched("overlap2-final-low", 40, ext=ONE_SWITCH)],
    # the last fix of session 10 (PREFETCH=2's copies placed two splits early by the setting, below
    # PREFETCH2_MIN_TOKENS uploaded one split early): ub512 / ub256, then OVERLAP=2 alone
    "prefetch2-small": [skewed_patched("prefetch2-small-low", 40, ext=PREFETCH2),
                        skewed_patched("overlap2-small-low", 40, ext=ONE_SWITCH)],
    # patch 0010 (CHAIN, on by default): PREFETCH=2 at ub1024, low coverage, with a gather timeline, then CHAIN=0
    # against CHAIN=1 twice, interleaved
    "chain": [skewed_patched("chain-ub1024-tl", 50, [(16384, 1024, PP16K)], ext=PREFETCH2, timeline=True),
              skewed_patched("chain0-ub1024-a", 45, [(16384, 1024, PP16K)], ext={**PREFETCH2, "CHAIN": 0}),
              skewed_patched("chain-ub1024-a", 45, [(16384, 1024, PP16K)], ext=PREFETCH2),
              skewed_patched("chain0-ub1024-b", 45, [(16384, 1024, PP16K)], ext={**PREFETCH2, "CHAIN": 0}),
              skewed_patched("chain-ub1024-b", 45, [(16384, 1024, PP16K)], ext=PREFETCH2)],
    # CHAIN at ub512 / ub256, low coverage: OVERLAP=2 alone (PREFETCH=1) with and without CHAIN, and PREFETCH=2
    # acting there (PREFETCH2_MIN_TOKENS=1: -3% / -4% in run 34, before CHAIN), interleaved
    "chain-low": [skewed_patched("chain-low-overlap2-a", 40, ext=ONE_SWITCH),
                  skewed_patched("chain-low-prefetch2-a", 40, ext={**PREFETCH2, "PREFETCH2_MIN_TOKENS": 1}),
                  skewed_patched("chain0-low-overlap2", 40, ext={**ONE_SWITCH, "CHAIN": 0}),
                  skewed_patched("chain-low-overlap2-b", 40, ext=ONE_SWITCH),
                  skewed_patched("chain-low-prefetch2-b", 40, ext={**PREFETCH2, "PREFETCH2_MIN_TOKENS": 1})],
    # the series as session 11 ends (the whole series), against upstream in the same call: low coverage at ub1024
    # with OVERLAP=2 + PREFETCH=2 (CHAIN on) and with the defaults, near-uniform at ub1024 with OVERLAP=2 + PREFETCH=2
    "final-chain": [{**skewed_patched("final-chain-low-ub1024", 90, [(16384, 1024, PP16K)], ext=PREFETCH2),
                     "variants": bench.VARIANTS},
                    skewed_patched("final-defaults-low-ub1024", 40, [(16384, 1024, PP16K)]),
                    {"name": "final-chain-uniform-ub1024", "est": 100, "ext": PREFETCH2,
                     "configs": [(16384, 1024, PP16K)]}],
    # near-uniform at ub1024: OVERLAP=2 alone against OVERLAP=2 + PREFETCH=2 in one call (run 41: 3049.4 t/s, 91.6%
    # of the bound, with PREFETCH=2; run 21, OVERLAP=2 alone, 3321.1 - another call and build)
    "uniform-prefetch2-ub1024": [
        {"name": f"uniform-{n}-ub1024", "est": 55, "ext": ext, "variants": ["patched"], "configs": [(16384, 1024, PP16K)]}
        for n, ext in (("overlap2-a", ONE_SWITCH), ("prefetch2", PREFETCH2), ("overlap2-b", ONE_SWITCH))],
    # 2 GPUs vs 1 GPU in decode in one call (runs 19-20 compared them across calls: 35.7 vs 37.3 t/s patched)
    "decode-same-call": [DECODE_LONG, DECODE_LONG_ONE_GPU],
    "decode-long-one-gpu": [DECODE_LONG_ONE_GPU],
    # what compute alone allows: every weight in VRAM (upstream pipelines that itself)
    "compute": [{"name": "all-on-gpu", "host_experts": "none", "variants": ["baseline"], "est": 60,
                 "configs": [(4096, 512, PP4096), (16384, 1024, PP16K), (16384, 4096, PP16K)]}],
    # decode with more repetitions (tg32 is ~1 s): 2 GPUs and 1 GPU
    "decode": [DECODE, DECODE_ONE_GPU],
    # decode once more, one GPU twice around two GPUs (run-to-run spread of the CPU-bound decode: experts on the CPU)
    "decode-again": DECODE_AGAIN,
    "final": [
        UNIFORM,
        {"name": "no-stable-reserve", "est": 50, "ext": {"STABLE_RESERVE": 0}, "variants": ["patched"],
         "configs": [(4096, 512, PP4096)]},
        MMAP,
        {**ONE_GPU, "est": 60, "configs": TG32},
    ],
    "diag": [
        {"name": "no-cuda-graphs", "est": 80, "env": {"GGML_CUDA_DISABLE_GRAPHS": "1"}, "configs": [(4096, 512, PP4096)]},
        {"name": "no-upload-all", "est": 80, "ext": {"UPLOAD_ALL": 0}, "configs": [(4096, 512, PP4096)]},
    ],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--budget", type=float, default=480, help="seconds for this script")
    ap.add_argument("--devices", default="cuda")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pp_models"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="synthetic model preset (tiny: a local smoke test)")
    ap.add_argument("--link-gbps", type=float, default=55.0,
                    help="host->GPU bandwidth per link for the rows' bound (pinned, measured: 54.9 / 55.1 GB/s on the "
                         "2xH200 box, bench/cuda_queue.py, 2026-11-30)")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: correctness,synth,correctness-direct,correctness-gather,correctness-prefetch,correctness-prefetch2,"
                                                "sweep")
    ap.add_argument("--sweep", default="main", help="comma-separated: " + ", ".join(SWEEPS))
    args = ap.parse_args()
    sweeps = args.sweep.split(",")
    unknown = [n for n in sweeps if n not in SWEEPS]
    if unknown:   # before any GPU time is spent
        raise SystemExit(f"unknown sweep(s) {unknown}; choose from {sorted(SWEEPS)}")
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "devices": args.devices, "steps": {}}

    def save():
        (args.out / "gpu_summary.json").write_text(json.dumps(summary, indent=1, default=float))

    info = run_job({"kind": "info"}, "patched", timeout=120)
    summary["devices_seen"] = [d["name"] + ": " + d["description"] for d in info["devices"]]
    log(f"devices: {summary['devices_seen']}")
    save()

    if "correctness" not in skip:
        tiny = synth.cached_model(args.model_dir, "tiny", seed=1, n_layer=7)
        try:
            summary["steps"]["correctness_tiny"] = correctness(str(tiny), args.devices, args.out)
        except PyllamaError as e:
            summary["steps"]["correctness_tiny"] = {"error": str(e)}
        save()

    big = args.model_dir / f"{args.preset}-uniform.gguf"
    if "synth" not in skip and not big.exists() and left(args.budget) > 30:  # ~20 s on the H200 box
        t = time.time()
        s = synth.write_gguf(big, synth.preset(args.preset, seed=1, routing="uniform"))
        summary["steps"]["synth"] = {k: s[k] for k in ("bytes", "expert_bytes_per_layer", "seconds")}
        log(f"wrote {big}: {s['bytes'] / 1e9:.1f} GB in {time.time() - t:.0f} s")
        save()

    def correctness_30b(step: str, env: dict, env2: dict) -> None:
        """The 30B preset, 4 ubatches of 256, patched with `env`, then with `env` + `env2` (~60 s a case: two loads)."""
        if step.replace("_", "-") in skip or not big.exists() or left(args.budget) <= 150:
            return
        try:
            # (a worker loads the 32 GB preset in about 25 s and runs in a few more: 150 s, so that a hang - as graph
            # mode's with OVERLAP=2 in run 26 - does not take the call)
            summary["steps"][step] = correctness(str(big), args.devices, args.out, n_tokens=1024, all_on_gpu=False,
                                                 cases=((256, "none", env), (256, "none", {**env, **env2})), timeout=150)
        except PyllamaError as e:
            summary["steps"][step] = {"error": str(e)}
        save()

    if "prefetch" in sweeps:
        # patch 0010 on the 30B preset: every gate but the first ubatch's prefetched, the rest gathered (grid), then
        # with 16-block gathers
        correctness_30b("correctness_prefetch", {**NO_UPLOAD_ALL, "GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "1",
                                                 **GRID_BLOCKS},
                        FEW_BLOCKS)
    if "prefetch2" in sweeps or "prefetch2-final" in sweeps:
        # patch 0010 on the 30B preset, upload-all off: gate and up prefetched, their rests and down gathered, the
        # copies in three lanes; then PREFETCH=1 (OVERLAP=2 alone)
        # (PREFETCH2_MIN_TOKENS=1: at ub256 PREFETCH=2 would act as PREFETCH=1 by default)
        correctness_30b("correctness_prefetch2", {**NO_UPLOAD_ALL, "GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "2",
                                                  "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": "1"},
                        {"GGML_SCHED_PP_PREFETCH": "1"})
    if "chain" in sweeps:
        # patch 0010 on the 30B preset: PREFETCH=2 acting (upload-all off), its gathers chained, then CHAIN=0
        correctness_30b("correctness_chain", {**NO_UPLOAD_ALL, "GGML_SCHED_PP_OVERLAP": "2", "GGML_SCHED_PP_PREFETCH": "2",
                                              "GGML_SCHED_PP_PREFETCH2_MIN_TOKENS": "1"},
                        {"GGML_SCHED_PP_CHAIN": "0"})
    if "final-overlap2" in sweeps:
        # OVERLAP=2 alone on the 30B preset, upload-all off (every expert op but one gathers; PREFETCH and 16-block
        # gathers come with it - in run 33 one kernel a gather, since reverted), then the same without PREFETCH
        correctness_30b("correctness_overlap2", {**NO_UPLOAD_ALL, "GGML_SCHED_PP_OVERLAP": "2"},
                        {"GGML_SCHED_PP_PREFETCH": "0"})
    if any(n.startswith("gather") for n in sweeps):
        # patch 0010: upload-all off, so every expert op but the one that measures coverage gathers (the tiny
        # preset's ub64 case above covers a few); then with OVERLAP=2's early gathers on the second stream
        correctness_30b("correctness_gather", NO_UPLOAD_ALL, {"GGML_SCHED_PP_OVERLAP": "2"})
    if any(n.startswith("direct") for n in sweeps):
        # patch 0008 on the model it is measured with, upload-all off; then with the first GPU keeping the
        # selective copy (DIRECT_FIRST=0)
        correctness_30b("correctness_direct", DIRECT_ONLY, {"GGML_SCHED_PP_DIRECT_FIRST": "0"})

    if "sweep" not in skip:   # (each block checks its own model: a skewed-only call may skip the uniform one)
        for block in [b for n in sweeps for b in SWEEPS[n]]:
            if block.get("model") == "skewed":
                # skew 2.0: ~47 of 128 experts a layer at ub512 (37%); 1.0: ~74 (58%, like real models' 56-74%)
                skew = float(block.get("skew", 2.0))
                model = args.model_dir / f"{args.preset}-skew{skew:g}.gguf"
                if not model.exists() and left(args.budget) > block["est"] + 30:
                    t = time.time()
                    synth.write_gguf(model, synth.preset(args.preset, seed=1, routing="skewed", skew=skew))
                    log(f"wrote {model} in {time.time() - t:.0f} s")
            else:
                model = big
            if left(args.budget) < block["est"] or not model.exists():
                log(f"skip {block['name']}: {left(args.budget):.0f} s left, needs ~{block['est']}")
                continue
            devices = block.get("devices", args.devices)
            env = dict(block.get("env", {}))
            timeline = args.out / "timeline" / block["name"]
            if block.get("timeline"):   # the CUDA gather's timeline, one file per worker (bench/gather_timeline.py)
                timeline.parent.mkdir(parents=True, exist_ok=True)
                for old in timeline.parent.glob(timeline.name + ".*.csv"):   # (an earlier call's, same --out)
                    old.unlink()
                env["PYLLAMA_PP_GATHER_TIMELINE"] = str(timeline)
            shared = env.get("GGML_CUDA_DEVICES") is not None   # one GPU split in two: one link
            cfgs = [bench.BenchConfig(model=str(model), devices=devices, n_batch=nb,
                                      n_ubatch=ub, tests=tests, reps=block.get("reps", args.reps),
                                      host_experts=block.get("host_experts", "all"),
                                      tensor_split=block.get("tensor_split"),
                                      load_mode=block.get("load_mode", "none"), env=env,
                                      ext_params=block.get("ext", {}), label=f"{block['name']} b{nb} ub{ub}",
                                      # one entry per device at most (rows cut the list to their devices)
                                      link_gbps=[args.link_gbps] * 16 if devices.startswith("cuda") else None,
                                      shared_link=shared)
                    for nb, ub, tests in block["configs"]]
            t = time.time()
            df = bench.ab(cfgs, variants=block.get("variants", bench.VARIANTS), out_dir=args.out / "ab",
                          # (a worker: at most three times its block's estimate, so that a hang leaves the
                          # blocks after it their time)
                          progress=False, timeout=max(60, min(left(args.budget) - 10, 3 * block["est"])))
            log(f"{block['name']}: {time.time() - t:.0f} s (estimated {block['est']})\n{bench.markdown(df)}")
            files = sorted(timeline.parent.glob(timeline.name + ".*.csv")) if block.get("timeline") else []
            if files:
                try:   # (a diagnosis: it must not stop the rest of the call)
                    tl = gather_timeline.summarize(gather_timeline.read(files))
                    (args.out / "timeline" / f"{block['name']}.json").write_text(json.dumps(tl, indent=1))
                    log(f"{block['name']}: the gather timeline\n{gather_timeline.markdown(tl)}")
                except Exception as e:   # noqa: BLE001
                    log(f"{block['name']}: the gather timeline could not be read: {e!r}")
            summary["steps"].setdefault("sweeps", []).append(json.loads(df.to_json(orient="records")))
            save()
    md = args.out / "ab" / "results.jsonl"
    if md.exists():
        import pandas as pd
        df = pd.read_json(md, lines=True)
        df["config"] = df["label"]   # config numbers restart in each block's bench.ab call; labels do not
        (args.out / "gpu_results.md").write_text(bench.markdown(df))
        print(bench.markdown(df))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
