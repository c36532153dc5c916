"""Job kind "trace": the experts each MoE layer chooses for each token of a prompt and a decode after it, for
hit-rate curves of an expert cache (pyllama_pp.expert_cache_sim)."""
from __future__ import annotations

from ...errors import ConfigError
from ...jobs import TraceJob
from ...model_file import routes_by_stream, synth_routing
from .base import bench_tokens, open_session


def check(job: TraceJob) -> None:
    """A trace job's own checks, before any model load.

    Raises:
        ConfigError: for negative counts, no token at all, or more tokens than the context holds.
    """
    n_prompt, n_decode = int(job.n_prompt), int(job.n_decode)
    if n_prompt < 0 or n_decode < 0 or n_prompt + n_decode == 0:
        raise ConfigError(f"a trace needs n_prompt >= 0 and n_decode >= 0, not both 0; got {n_prompt} and {n_decode}")
    if n_prompt + n_decode > job.ctx.n_ctx:
        raise ConfigError(f"{n_prompt} + {n_decode} tokens do not fit in n_ctx={job.ctx.n_ctx}: raise --ctx")


def handle(job: TraceJob) -> dict:
    """Decode the job's tokens with the trace on; the ids as lists [tokens][layers][k], the layers, the tokens."""
    check(job)
    with open_session(job) as s:
        toks = bench_tokens(job.n_prompt + job.n_decode, s.info.n_vocab, job.seed, routes_by_stream(s.path))
        tr = s.trace_experts(toks, job.n_prompt, exclusive=True)
        return {"model": s.info.to_dict(), "routing": synth_routing(s.path), "tokens": toks.tolist(),
                "n_prompt": tr.n_prompt, "n_expert": tr.n_expert, "layers": tr.layers.tolist(), "ids": tr.ids.tolist()}
