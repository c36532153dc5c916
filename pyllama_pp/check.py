"""The logits check: both variants on one placement, their logits compared (`check_logits`, `pyllama-pp check`).

The patched build must give the baseline's logits for the same placement and batch sizes (NMSE <= 1e-6 on CPU and
VDEVs; CUDA's kernels are the same in both, so there too). Each variant runs in its own worker process.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from . import devices as devspec
from .defaults import CHECK
from .errors import ConfigError, DeviceSpecError
from .jobs import LogitsJob
from .params import ContextParams, Placement, as_context, as_placement, check_int, ctx_for
from .stats import max_abs_diff, nmse
from .worker.client import check_switch_env, run_job

NMSE_MAX = 1e-6


@dataclass
class LogitsCheck:
    """Both variants' logits for the same tokens on one placement, compared.

    Fields: the model and devices, n_tokens, nmse (patched against baseline), max_abs_diff, nmse_max (the limit),
    ok (nmse <= nmse_max), each variant's schedule facts (pipeline_parallel, n_splits), and the patched run's device
    expert cache (EXPERT_CACHE): the expert ops that read its slots, with their hits and misses (all 0 where none
    did: the compared path then never read them).
    """

    model: str
    devices: str
    placement: str
    n_tokens: int
    n_ubatch: int
    nmse: float
    max_abs_diff: float
    nmse_max: float
    baseline_pipeline_parallel: bool
    patched_pipeline_parallel: bool
    patched_n_splits: int
    baseline_devices: Optional[str] = None
    patched_cache_ops: int = 0
    patched_cache_hits: int = 0
    patched_cache_misses: int = 0

    @property
    def ok(self) -> bool:
        """Whether the patched logits match the baseline's (nmse <= nmse_max)."""
        return self.nmse <= self.nmse_max

    def to_dict(self) -> dict:
        """The fields and ok, JSON-ready."""
        return {**asdict(self), "ok": self.ok}

    def __str__(self) -> str:
        on = lambda x: "on" if x else "off"
        base = f" (baseline on {self.baseline_devices})" if self.baseline_devices else ""
        return (f"{Path(self.model).name} on {self.devices}{base}, host experts {self.placement}, {self.n_tokens} tokens, "
                f"n_ubatch {self.n_ubatch} (pipelining baseline {on(self.baseline_pipeline_parallel)}, patched "
                f"{on(self.patched_pipeline_parallel)}, {self.patched_n_splits} splits):\n  patched vs baseline "
                f"logits: NMSE {self.nmse:.3g}, max abs difference {self.max_abs_diff:.3g} -> "
                + (f"same (NMSE <= {self.nmse_max:g})" if self.ok else f"MISMATCH (NMSE > {self.nmse_max:g})")
                + (f"; {self.patched_cache_ops} expert ops read the device expert cache ({self.patched_cache_hits} "
                   f"hits, {self.patched_cache_misses} misses)" if self.patched_cache_ops else ""))


def check_context(n_tokens: Optional[int] = None) -> ContextParams:
    """The check's context: CHECK's batch sizes, and n_ctx for `n_tokens` (None: CHECK's n_ctx)."""
    n_ctx = CHECK.n_ctx if n_tokens is None else ctx_for(n_tokens)
    return ContextParams(n_ctx=n_ctx, n_batch=CHECK.n_batch, n_ubatch=CHECK.n_ubatch)


def check_logits(model: Union[str, Path], devices: str = CHECK.devices,
                 placement: Union[Placement, dict, None] = None, ctx: Union[ContextParams, dict, None] = None,
                 n_tokens: int = CHECK.n_tokens, seed: int = CHECK.seed, switches: Optional[dict] = None,
                 nmse_max: float = NMSE_MAX, timeout: Optional[float] = CHECK.timeout,
                 baseline_devices: Optional[str] = None) -> LogitsCheck:
    """Run both variants on one placement and compare every token's logits.

    Args:
        model: the GGUF file.
        devices: a device spec (default: two unthrottled VDEVs).
        baseline_devices: for RPC devices, the baseline's own servers on the same hosts, in the same order (upstream's
            client refuses the patched servers); None: the baseline runs on `devices` too.
        placement: where the weights go (default: every expert in host RAM, the series' case).
        ctx: the context (default: CHECK's sizes, pyllama_pp.defaults: several ubatches in flight).
        n_tokens: how many random tokens (from `seed`) are decoded, all with logits.
        switches: the patched build's switches.
        nmse_max: the limit on the NMSE.
    Returns:
        A LogitsCheck (its `ok` says whether the logits match).
    Raises:
        ConfigError: for n_tokens that do not fit in the context, baseline servers that do not match the devices,
        or GGML_SCHED_PP_* variables the patched build does not accept; the errors of Session (as WorkerError
        subclasses) when a variant cannot run.
        DeviceSpecError: for a spec that does not parse or an RPC server that cannot be reached (before any worker).
    """
    placement = as_placement(placement if placement is not None else Placement(host_experts=CHECK.host_experts))
    ctx = as_context(ctx if ctx is not None else check_context())
    n_tokens = check_int("n_tokens", n_tokens, 1)
    if not 1 <= n_tokens <= ctx.n_ctx:
        raise ConfigError(f"n_tokens must be between 1 and n_ctx ({ctx.n_ctx}), not {n_tokens}")
    if baseline_devices:
        devspec.check_baseline_devices(devices, baseline_devices)
    on = {"patched": devices, "baseline": baseline_devices or devices}
    for spec in dict.fromkeys(on.values()):
        why = devspec.parse(spec).unreachable()
        if why:
            raise DeviceSpecError(why)
    check_switch_env(["patched"])
    got, facts, ext = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in ("baseline", "patched"):
            out = str(Path(tmp) / f"{v}.npy")
            job = LogitsJob(variant=v, model=str(model), devices=on[v], placement=placement, ctx=ctx,
                            switches=dict(switches or {}) if v == "patched" else {}, n_tokens=n_tokens, seed=seed,
                            logits="all", out=out)
            res = run_job(job, v, timeout=timeout)
            facts[v], ext[v] = res["schedule"], res.get("ext") or {}
            got[v] = np.load(out)
    backends = ext["patched"].get("backends", [])
    cache = {k: sum(b.get(f"cache_{k}", 0) for b in backends) for k in ("ops", "hits", "misses")}
    return LogitsCheck(model=str(model), devices=str(devices), placement=placement.label, n_tokens=n_tokens,
                       n_ubatch=ctx.n_ubatch, nmse=nmse(got["patched"], got["baseline"]),
                       max_abs_diff=max_abs_diff(got["patched"], got["baseline"]), nmse_max=nmse_max,
                       baseline_pipeline_parallel=facts["baseline"]["pipeline_parallel"],
                       patched_pipeline_parallel=facts["patched"]["pipeline_parallel"],
                       patched_n_splits=facts["patched"]["n_splits"], baseline_devices=baseline_devices or None,
                       patched_cache_ops=cache["ops"], patched_cache_hits=cache["hits"],
                       patched_cache_misses=cache["misses"])
