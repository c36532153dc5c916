"""The table of defaults: one frozen `Defaults` per context whose defaults legitimately differ, as llama-bench keeps
one `cmd_params_defaults`. Every command, the Python API and the worker read their defaults here, and the CLI's help
prints them from here; tests/test_defaults.py fails on a literal default for one of these knobs anywhere else in the
package.

    CONTEXT    a llama context: ContextParams(), Session, fit's context, worker jobs (llama.cpp's own sizes)
    RUN        `run` / `ab` with a model: RunConfig, expand, the CLI
    MAIN_JOB   `ab` with no model: the tiny synthetic MoE on two small, throttled VDEVs, placed by fit
    FIT        `fit` / `fit_ubatch` and `pyllama-pp fit`
    CHECK      the logits check (`check_logits`, `pyllama-pp check`)
    PAIRED     paired rounds (`runner.interleaved`, `ab --paired`)
    PROBE      the compute probe (`compute.probe`)
    SOAK       the soak (`soak.run`, the soak job)
    TRACE      an expert trace (`trace.record`, `pyllama-pp trace`)
Beside them: memory margins per device kind (`MARGINS`, read by each kind's class), the timeouts of the small worker
jobs (`TIMEOUTS`), the cores this process may use (`usable_cores`, the default thread count), and `fit_ubatch`'s
candidates.
Also here: where pyllama_pp keeps what it writes once and reuses (`cache_dir`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

GiB = 1024**3


@dataclass(frozen=True)
class Defaults:
    """One context's defaults; a field a context does not use is None.

    Attributes:
        variant: the build that runs ("patched" or "baseline").
        devices: the device spec ("cpu", "vdev:2x7MiB@0.1GBps", ...).
        host_experts: experts kept in host RAM: "all", "none" or N (the first N layers).
        n_gpu_layers: layers on the devices (-1: every layer).
        split_mode: llama's split mode ("layer", "none" or "row").
        load_mode: "none" (no mmap: host weights pinned where the device offers it) or "mmap".
        n_ctx: context size in positions (0: what the tests need, or for fit: fit chooses it).
        n_batch: tokens per llama_decode call (the logical batch).
        n_ubatch: tokens per graph (the physical batch).
        n_threads: CPU threads (0: every core this process may use, `usable_cores()`).
        flash_attn: llama's flash-attention mode (1: on).
        pp: prompt lengths of pp tests (llama-bench's -p).
        tg: generation lengths of tg tests (llama-bench's -n; empty: none).
        depth: tokens already in the context before each test (llama-bench's -d).
        reps: timed repetitions per test (after one untimed), or a workload's rounds.
        warmup: untimed runs of each test before the timed ones.
        rounds: paired rounds (even: AB and BA pairs).
        loads: fresh model loads of a paired run.
        n_tokens: tokens decoded (the logits check; a logits job).
        timeout: seconds one worker job may take (None: no limit).
        fit: how `ab` places by fit when no placement is given: "same" (the patched plan for both variants), "each"
            (each variant's own plan) or None (no fit).
        calls: the soak's calls in one context.
        check_every: the soak's calls between logits checkpoints.
        seed: the seed of random tokens (and of the paired interval's bootstrap).
        budget: seconds a probe may spend measuring before it estimates the rest (the compute probe).
        expert_cache: the patched build's device expert cache fit plans (EXPERT_CACHE): "auto" (fit weighs cache slots
            against resident expert layers for the workload), a size ("512MiB": that much a device, reserved), slots
            a layer ("16slots") or 0 (none).
        workload: what fit plans the memory for (pyllama_pp.workload.Workload: a name of WORKLOADS or "pp=N,tg=N").
    """

    variant: Optional[str] = None
    devices: Optional[str] = None
    host_experts: Optional[str] = None
    n_gpu_layers: Optional[int] = None
    split_mode: Optional[str] = None
    load_mode: Optional[str] = None
    n_ctx: Optional[int] = None
    n_batch: Optional[int] = None
    n_ubatch: Optional[int] = None
    n_threads: Optional[int] = None
    flash_attn: Optional[int] = None
    pp: Optional[tuple] = None
    tg: Optional[tuple] = None
    depth: Optional[tuple] = None
    reps: Optional[int] = None
    warmup: Optional[int] = None
    rounds: Optional[int] = None
    loads: Optional[int] = None
    n_tokens: Optional[int] = None
    timeout: Optional[float] = None
    fit: Optional[str] = None
    calls: Optional[int] = None
    check_every: Optional[int] = None
    seed: Optional[int] = None
    budget: Optional[float] = None
    expert_cache: Optional[Union[str, int]] = None
    workload: Optional[str] = None


# llama.cpp's own context defaults (llama_context_default_params, common's n_batch / n_ubatch); threads: every
# usable core (llama's default, 4, oversubscribes small machines and starves big ones; llama-bench uses the cores);
# every layer on the devices, weights where llama puts them, no mmap; a logits job decodes 64 tokens
CONTEXT = Defaults(variant="patched", devices="cpu", host_experts="none", n_gpu_layers=-1, split_mode="layer",
                   load_mode="none", n_ctx=4096, n_batch=2048, n_ubatch=512, n_threads=0, flash_attn=1, n_tokens=64,
                   seed=0)

# `run` / `ab` with a model: llama-bench-like tests (pp512, tg16, 3 reps after 1 untimed) with every expert in host RAM,
# n_ubatch 32 (op offload's minimum batch, OFFLOAD_MIN_BATCH) and n_batch 512 (16 ubatches); n_ctx 0: what the tests
# need
RUN = Defaults(variant="patched", devices="cpu", host_experts="all", n_gpu_layers=-1, load_mode="none", n_ctx=0,
               n_batch=512, n_ubatch=32, pp=(512,), tg=(16,), depth=(0,), reps=3, warmup=1)

# `ab` with no model: the tiny preset with 7 layers on 2 virtual devices of 7 MiB each, too small for its 12 MiB, whose
# links are throttled so that transfers dominate. The patched build's fit places it (6 of the 7 layers' experts in
# host RAM, 3 per device) and both variants run that one placement (fit "same"); n_ubatch 128 uses ~98% of the
# experts; n_batch = 16 x n_ubatch. No decode test: one load per variant leaves decode to where each process's memory
# landed (a few percent either way, more than the variants differ there); decode claims are paired (--paired N).
MAIN_JOB = Defaults(devices="vdev:2x7MiB@0.1GBps", n_ctx=0, n_batch=2048, n_ubatch=128, pp=(2048,), tg=(),
                    depth=(0,), reps=3, fit="same")
MAIN_JOB_MODEL = {"preset": "tiny", "seed": 1, "n_layer": 7}   # its model: synth.cached_model(DIR, **MAIN_JOB_MODEL)

# fit plans for llama's context sizes; its API's devices are two VDEVs (each needs a memory budget to be planned)
FIT = Defaults(variant="patched", devices="vdev:2x0@0", split_mode="layer", n_ctx=4096, n_batch=2048, n_ubatch=512,
               timeout=600, expert_cache="auto", workload="chat")

# what fit plans memory for and `run` / `ab --workload` run in one context: steps ("pp" | "tg", tokens). chat: a turn
# of a chat with a long system prompt and history (a 2048-token prompt, then 256 tokens decoded); prompt: one long
# prompt (llama-bench-like pp16384, the prompt sweeps' length); decode: 128 tokens decoded (the decode tables' tg128);
# mixed: a server's load, prompts of alternating lengths each from an empty
# cache, then decoding right after the last one
WORKLOADS = {"chat": (("pp", 2048), ("tg", 256)), "prompt": (("pp", 16384),), "decode": (("tg", 128),),
             "mixed": (("pp", 64), ("pp", 512), ("pp", 128), ("pp", 2048), ("tg", 16))}

# the logits check: two unthrottled VDEVs, several ubatches in flight (n_batch 4 x n_ubatch)
CHECK = Defaults(devices="vdev:2x0@0", host_experts="all", n_ctx=512, n_batch=256, n_ubatch=64, n_tokens=256, seed=0,
                 timeout=600)

# paired rounds: 20 rounds of one rep each (10 AB / BA pairs), no untimed run in a round (each variant's worker warms
# up once first), one load
PAIRED = Defaults(rounds=20, loads=1, warmup=0)

# the compute probe: the baseline build (every weight resident: both variants compute alike), the median of 3 timed runs
# per replica and n_ubatch; a short prompt of 512 tokens (or one ubatch)
# where the prompt itself does not fit the budget of 40 s (the planner's first run stays near a minute on a small CPU:
# RESULTS "Planner on a 2-core CPU")
PROBE = Defaults(variant="baseline", reps=3, timeout=600, n_tokens=512, budget=40)

# the soak: two VDEVs with links, every expert in host RAM, a context of 1024, long enough for its edits
SOAK = Defaults(devices="vdev:2x256MiB@4GBps", host_experts="all", n_ctx=1024, n_batch=512, n_ubatch=128, calls=1000,
                check_every=50, warmup=0, timeout=3600)


# an expert trace: no prompt, 128 tokens decoded one by one, on the CPU
TRACE = Defaults(variant="patched", devices="cpu", pp=(0,), tg=(128,), seed=0)


@dataclass(frozen=True)
class Timeouts:
    """Seconds the small jobs and waits may take.

    Attributes:
        info: an info job (the switch table, the devices, the environment's switch problems).
        worker_exit: a serving worker's exit after its input is closed (it is killed after that).
        reader_join: a worker's stdout / stderr reader thread after the worker exited.
        rpc_connect: a TCP connection to an rpc-server (as the shim's own probe before ggml RPC connects).
    """

    info: float = 120
    worker_exit: float = 30
    reader_join: float = 5
    rpc_connect: float = 3


TIMEOUTS = Timeouts()

# memory fit leaves free on each device, by device kind (each kind's DeviceSpec.default_margin): upstream's 1 GiB
# (common/common.h fit_params_target); none on VDEVs, whose budgets are exact; "other": any other kind (an rpc
# server's device)
MARGINS = {"cuda": 1 * GiB, "vdev": 0, "other": 1 * GiB}

RPC_HOST, RPC_PORT = "127.0.0.1", 50052   # rpc-server's address: loopback (the protocol has no authentication)
CUDA_LINK_GBPS = 55.0   # a PCIe 5 x16 link's measured host -> device rate (docs/RESULTS.md), where none is given
# a GPU reading expert weights in its own memory in a decode expert op (GB/s): stated, about 60% of an H100's HBM3,
# not measured; it only has to be far above the host CPU's rate for the expert cache's break-even to be right
CUDA_EXPERT_READ_GBPS = 2000.0
UBATCH_CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)   # fit_ubatch's n_ubatch values


@dataclass(frozen=True)
class UbatchMeasure:
    """`-ub auto`'s last step: the candidates predicted close to the best are run as planned and the fastest measured
    wins (the probe's replicas order near pairs wrongly: on one H100, 30B-A3B shape, pp16384 with LAYER_MAJOR=1, it
    put ub1024 18% above ub2048 (23,791 against 20,111 t/s, carried from a 1024-token prompt), which measured 19,747
    against 21,817: the best predicted was 20% high, the runner-up 8% low).

    Attributes:
        band: a candidate predicted within this share below the best is measured (wider than the probe's errors
            measured together: 20% + 8% above and below).
        most: at most this many (the best included; below 2: none is measured).
        reps: timed prompts each, after `warmup` untimed (one model load per placement).
        warmup: untimed prompts first.
    """

    band: float = 0.3
    most: int = 3
    reps: int = 2
    warmup: int = 1


UBATCH_MEASURE = UbatchMeasure()
OFFLOAD_MIN_BATCH = 32   # llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH (upstream's value; shown in the CLI's help)


def cache_dir() -> Path:
    """Where pyllama_pp keeps what it writes once (synthetic models, compute probes): PYLLAMA_PP_CACHE, else
    ~/.cache/pyllama_pp."""
    return Path(os.environ.get("PYLLAMA_PP_CACHE") or Path.home() / ".cache" / "pyllama_pp")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a container's cpuset), at least 1: the default
    thread count of a context, of fit and of an RPC server."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):   # (no sched_getaffinity outside Linux)
        return max(1, os.cpu_count() or 1)


def threads(n: Optional[int] = 0) -> int:
    """`n` threads when it is positive, else every core this process may use (usable_cores)."""
    return n if n and n > 0 else usable_cores()
