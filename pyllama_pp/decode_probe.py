"""The decode probe: what a decoded token costs on a device, measured with the model's own layers, for fit's planner
(pyllama_pp.decode_model, pyllama_pp.memory_plan).

As the compute probe (pyllama_pp.compute) does for prompts, it runs two replicas of the model (the first leading-dense
+ 2 and + 10 MoE layers) and takes their difference as eight MoE layers, the rest of the shorter as the cost outside
the layers - three times: every weight resident on the device; every expert in host RAM on the host CPU (upstream's
decode path); every expert in host RAM read from the device's slots (EXPERT_CACHE with a slot for every expert, the
guard off: after the untimed run every lookup hits, as the runs decode the same tokens). A fourth run, the longer
replica with the fewest slots (a token's experts), prices a miss: the seconds it adds over the hits' run against the
bytes its misses copied (the run's counters), as a rate (DecodeCosts.miss_gbps). The link's measured rate leaves out
what each miss costs beside its bytes: its copies' calls, and from an mmap-ed model the copy into pinned staging before
the link takes it (on one H100 an mmap-ed model's misses went up at about 13 GB/s against the link's 55; from pinned
memory the link's rate predicted decode 11% fast on one device, 19% split in two). The patched build runs them,
on the probe's devices (pyllama_pp.compute.probe_devices), at the run's thread count and load mode. Results are cached
per model (by content), spec, threads and load mode (PYLLAMA_PP_CACHE/compute/).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from statistics import median
from typing import Optional, Union

from .compute import REPLICA_LAYERS, cache_dir, model_key, moe_layers, probe_devices, replica
from .counters import all_gpus
from .decode_model import DecodeCosts
from .defaults import CONTEXT, PROBE, threads
from .jobs import MeasureJob
from .model_file import expert_layout, expert_tensor_shape
from .params import ContextParams, Placement, ctx_for
from .switches import EXPERT_CACHE, EXPERT_CACHE_MIN_HIT
from .worker.client import run_job

# tokens each timed run decodes (one untimed run first fills the slots)
DECODE_TOKENS = 32
# where a probe run keeps the experts: (placement's host_experts, the cache switch as a function of n_expert)
_PATHS = {"resident": ("none", None), "cpu": ("all", lambda n: 0), "cached": ("all", lambda n: -n)}


def _run(model, spec: str, path: str, n_layers: int, n_expert: int, n_threads: int, load_mode: str,
         reps: int, timeout, slots: Optional[int] = None) -> dict:
    """The measure job's test of tg DECODE_TOKENS on the replica of n_layers MoE layers with its experts where
    `path` keeps them (with `slots` slots a layer instead, where given)."""
    host, cache = _PATHS[path]
    switches = {} if cache is None else {EXPERT_CACHE: -slots if slots else cache(n_expert), EXPERT_CACHE_MIN_HIT: 0}
    job = MeasureJob(variant="patched", model=str(replica(model, n_layers)), devices=spec,
                     placement=Placement(host_experts=host, load_mode=load_mode), switches=switches,
                     tests=[["tg", DECODE_TOKENS]], reps=reps, warmup=1, coverage=False,
                     ctx=ContextParams(n_ctx=ctx_for(DECODE_TOKENS + 8), n_batch=DECODE_TOKENS,
                                       n_ubatch=DECODE_TOKENS, n_threads=n_threads))
    return run_job(job, "patched", timeout=timeout)["tests"][0]


def _seconds(model, spec: str, path: str, n_layers: int, n_expert: int, n_threads: int, load_mode: str,
             reps: int, timeout) -> float:
    """Median seconds a token on the replica of n_layers MoE layers with its experts where `path` keeps them."""
    test = _run(model, spec, path, n_layers, n_expert, n_threads, load_mode, reps, timeout)
    return median(test["seconds"]) / DECODE_TOKENS


def _miss_gbps(model, spec: str, n_layers: int, n_expert: int, n_used: int, n_threads: int, load_mode: str,
               reps: int, timeout, cached_s: float) -> Optional[float]:
    """A miss's bytes over the seconds it adds (GB/s): the replica of n_layers MoE layers with n_used slots a layer
    against `cached_s` (its seconds a token with every lookup a hit); None where nothing missed or nothing was
    added (a rate the link's bounds anyway)."""
    test = _run(model, spec, "cached", n_layers, n_expert, n_threads, load_mode, reps, timeout, slots=n_used)
    moved = (all_gpus(test.get("ext") or {}, "cache_bytes", max(1, reps)) or 0) / DECODE_TOKENS   # (bytes a token)
    added = median(test["seconds"]) / DECODE_TOKENS - cached_s
    return round(moved / added / 1e9, 3) if moved > 0 and added > 0 else None


def _costs_on(model, spec: str, n_threads: int, load_mode: str, reps: int, timeout, cache: bool,
              progress: bool) -> DecodeCosts:
    n_hi = min(REPLICA_LAYERS[1], moe_layers(model))
    n_lo = max(1, min(REPLICA_LAYERS[0], n_hi - 1))
    key = hashlib.sha1(json.dumps([model_key(model), spec, os.environ.get("GGML_CUDA_DEVICES", ""), "decode",
                                   n_threads, load_mode, n_lo, n_hi, DECODE_TOKENS, "miss"]).encode()).hexdigest()[:16]
    path = cache_dir() / f"decode-{key}.json"
    if cache and path.exists():
        return DecodeCosts(**json.loads(path.read_text()))
    if progress:
        print(f"decode probe: {len(_PATHS) * 2 + 1} runs of tg{DECODE_TOKENS} on replicas of {n_lo} and {n_hi} MoE "
              f"layers on {spec}; cached in {path.parent}", file=sys.stderr)
    n_expert = expert_tensor_shape(model)[3]
    t = {p: [_seconds(model, spec, p, n, n_expert, n_threads, load_mode, reps, timeout) for n in (n_lo, n_hi)]
         for p in _PATHS}
    layer = {p: max((hi - lo) / (n_hi - n_lo) if n_hi > n_lo else lo / n_lo, 0.0) for p, (lo, hi) in t.items()}
    outside = max(t["resident"][0] - n_lo * layer["resident"], 0.0)
    n_used = expert_layout(model)[0]
    miss = _miss_gbps(model, spec, n_hi, n_expert, n_used, n_threads, load_mode, reps, timeout, t["cached"][1]) \
        if 0 < n_used < n_expert else None
    costs = DecodeCosts(device=spec, outside_s=outside, resident_s=layer["resident"], cpu_s=layer["cpu"],
                        cached_s=layer["cached"], threads=n_threads, load_mode=load_mode, miss_gbps=miss)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs.to_dict()))
    return costs


def decode_costs(model: Union[str, os.PathLike], devices, n_threads: int = CONTEXT.n_threads,
                 load_mode: str = CONTEXT.load_mode,
                 reps: int = PROBE.reps, timeout=PROBE.timeout, cache: bool = True,
                 progress: bool = False) -> dict[int, DecodeCosts]:
    """What a decoded token costs on each device of a spec, per MoE layer by where its experts are.

    Args:
        model: the GGUF file (a MoE model).
        devices: the device spec (its devices' compute and the host's are measured; memory limits play no part).
        n_threads: host CPU threads (0: every core this process may use).
        load_mode: "none" (pinned host weights) or "mmap".
        reps: timed runs per replica and path (the median counts).
        timeout: seconds one run may take.
        cache: read and write results under cache_dir().
        progress: say what it measures on stderr.
    Returns:
        device index -> DecodeCosts (-1: every device, for "cuda" without ids).
    Raises:
        ConfigError: when the model has too few layers or a replica cannot run on a device.
        WorkerError: when a run's worker dies or times out.
    """
    n = threads(n_threads)
    out = {}
    for idx, spec in probe_devices(devices):
        costs = _costs_on(model, spec, n, load_mode, reps, timeout, cache, progress)
        for i in idx:
            out[i] = costs
    return out


__all__ = ["decode_costs", "DECODE_TOKENS"]
