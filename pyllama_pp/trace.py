"""`pyllama-pp trace MODEL`: record the experts each MoE layer chooses for each token of a run (any GGUF), for the
hit-rate curves of an expert cache (pyllama_pp.expert_cache_sim, bench/cache_hits.py).

`record(...)` runs one worker job (kind "trace", pyllama_pp.worker.handlers.trace): a prompt of n_prompt tokens, then
n_decode tokens decoded one by one after it, chosen as the bench chooses a test's tokens (random ones; a stream of
consecutive ids for a synthetic model with routing "locality"). `summary` and `describe` are what the command prints.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from .errors import ConfigError
from .expert_cache_sim import locality_summary, simulate
from .expert_trace import ExpertTrace
from .jobs import TraceJob
from .model_file import check_model_path
from .params import ContextParams, Placement, as_placement, ctx_for
from .defaults import TRACE
from .worker.client import run_job

#: the cache sizes (fractions of a layer's experts) whose LRU hit rate the summary shows
SUMMARY_FRACTIONS = (0.125, 0.25)


def record(model: Union[str, Path], n_prompt: int = TRACE.pp[0], n_decode: int = TRACE.tg[0],
           seed: int = TRACE.seed, variant: str = TRACE.variant, devices: Union[str, dict] = TRACE.devices, placement: Union[Placement, dict, None] = None,
           ctx: Optional[ContextParams] = None, out: Union[str, Path, None] = None,
           timeout: Optional[float] = None, capture: Sequence[str] = ()) -> ExpertTrace:
    """The experts each MoE layer of `model` chose for each token of a prompt and a decode after it.

    Args:
        model: the GGUF file.
        n_prompt: prompt tokens, decoded as one prompt (0: none).
        n_decode: tokens decoded one by one after the prompt.
        seed: the tokens' seed (as a measure job's).
        variant: the build that runs it (both route the same).
        devices: a device spec (default: cpu).
        placement: where the weights go (default: every layer on the devices).
        ctx: the context's parameters (default: n_ctx for the tokens, the default batch sizes).
        out: write the trace here too (.npz; checked before the run).
        timeout: seconds the worker may take.
        capture: llama's names of f32 tensors to keep too ("l_out", "ffn_inp", "ffn_norm"; Session.trace_experts).
    Returns:
        ExpertTrace: ids [tokens, MoE layers, k], meta: model, variant, devices, seed, routing, tokens; `tensors`
            the captured ones, [tokens, n_layer, width] each (not written to `out`).
    Raises:
        ModelError: for a missing or damaged model; ConfigError for bad counts or an `out` that is not a .npz in
            an existing folder (before any worker starts); WorkerError (with the worker's own class) when the run
            fails.
    """
    check_model_path(model)
    if out is not None:
        check_out(out)
    ctx = ctx or ContextParams(n_ctx=ctx_for(n_prompt + n_decode))
    with tempfile.TemporaryDirectory(prefix="pp-trace-") as tmp:
        job = TraceJob(variant=variant, model=str(model), devices=devices, placement=as_placement(placement),
                       ctx=ctx, n_prompt=int(n_prompt), n_decode=int(n_decode), seed=int(seed), capture=list(capture),
                       capture_out=str(Path(tmp) / "captured.npz") if capture else "")
        job.check()
        r = run_job(job, variant, timeout=timeout)
        tensors = {}
        if capture:
            with np.load(job.capture_out) as z:
                tensors = {name: z[name] for name in z.files}
    meta = {"model": str(model), "variant": variant, "devices": devices, "seed": int(seed), "routing": r["routing"],
            "tokens": r["tokens"], "arch": r["model"]["arch"]}
    tr = ExpertTrace(r["ids"], r["layers"], r["n_expert"], r["n_prompt"], meta, tensors)
    if out is not None:
        tr.save(out)
    return tr


def check_out(out: Union[str, Path]) -> None:
    """Refuse a trace file name that is not a .npz in an existing folder.

    Raises:
        ConfigError: saying what to give instead.
    """
    out = Path(out)
    if out.suffix != ".npz":
        raise ConfigError(f"a trace is written as .npz (numpy's compressed arrays), not {out.name!r}: give -o FILE.npz")
    if not out.parent.is_dir():
        raise ConfigError(f"cannot write {out}: the folder {out.parent} does not exist")


def summary(trace: ExpertTrace) -> dict:
    """What `pyllama-pp trace` prints: the trace's shape, how much consecutive tokens' experts overlap, and the hit
    rate of a per-layer LRU cache of SUMMARY_FRACTIONS of the experts (after the prompt, or the first quarter)."""
    out = {"model": trace.meta.get("model"), "routing": trace.meta.get("routing") or None, "tokens": trace.n_tokens,
           "n_prompt": trace.n_prompt, "moe_layers": len(trace.layers), "n_expert": trace.n_expert,
           "k": int(trace.ids.shape[2])}
    out.update(locality_summary(trace))
    for f in SUMMARY_FRACTIONS:
        out[f"lru_{f:g}"] = simulate(trace, f, "lru")["hit_rate"]
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}   # (too few tokens)


def _pct(x: Optional[float]) -> str:
    return "n/a (too few tokens)" if x is None else f"{x:.1%}"


def describe(s: dict, out: Optional[Union[str, Path]] = None) -> str:
    """summary() as lines of text."""
    lru = ", ".join(f"{f:.1%} of the experts {_pct(s[f'lru_{f:g}'])}" for f in SUMMARY_FRACTIONS)
    return (f"{Path(str(s['model'])).name}: {s['tokens']} tokens ({s['n_prompt']} prompt), {s['moe_layers']} MoE "
            f"layers, {s['k']} of {s['n_expert']} experts each" + (f", routing {s['routing']}" if s["routing"] else "")
            + f"\n  experts shared with the previous token {_pct(s['overlap_lag1'])}, with a far one "
            f"{_pct(s['overlap_random'])}\n  per-layer LRU cache hits: {lru}"
            + (f"\n  wrote {out}" if out else ""))
