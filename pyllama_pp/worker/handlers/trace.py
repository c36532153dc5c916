"""Job kind "trace": the experts each MoE layer chooses for each token of a prompt and a decode after it, for
hit-rate curves of an expert cache (pyllama_pp.expert_cache_sim)."""
from __future__ import annotations

import numpy as np

from ...jobs import TraceJob
from ...model_file import routes_by_stream, synth_routing
from .base import bench_tokens, open_session


def handle(job: TraceJob) -> dict:
    """Decode the job's tokens with the trace on; the ids as lists [tokens][layers][k], the layers, the tokens; the
    tensors job.capture names go to job.capture_out, one array a name (the names the graph had are returned)."""
    job.check()
    with open_session(job) as s:
        toks = bench_tokens(job.n_prompt + job.n_decode, s.info.n_vocab, job.seed, routes_by_stream(s.path))
        tr = s.trace_experts(toks, job.n_prompt, exclusive=True, capture=job.capture)
        if job.capture:
            np.savez(job.capture_out, **tr.tensors)
        return {"model": s.info.to_dict(), "routing": synth_routing(s.path), "tokens": toks.tolist(),
                "n_prompt": tr.n_prompt, "n_expert": tr.n_expert, "layers": tr.layers.tolist(), "ids": tr.ids.tolist(),
                "captured": sorted(tr.tensors)}
