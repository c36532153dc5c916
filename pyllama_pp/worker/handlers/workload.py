"""Job kind "workload": a mixed sequence of prompts and decode steps in ONE context, as a server runs them."""
from __future__ import annotations

import time

import numpy as np

from ...counters import ext_delta, sum_devices
from ...jobs import WorkloadJob
from .base import open_session, switch_defaults


def handle(job: WorkloadJob) -> dict:
    """A mixed workload in ONE session (one context, as a server would): per step its time, bytes moved, host
    syncs, VDEV allocation counters, compute buffers before/after and the patched counters; with the variant's switch
    defaults (as a measure job's). With
    "out", the logits of every step's last token (and of each decoded token) are saved there, in order."""
    s = open_session(job)
    keep = bool(job.out)
    last_logits: list[np.ndarray] = []
    try:
        sched0 = s.schedule()
        cb0 = [b.compute_buffer_bytes for b in sched0.backends]
        rng = np.random.default_rng(int(job.seed))
        steps = []
        for rnd in range(int(job.rounds)):
            pos = 0
            for test_type, n in job.workload:
                s.synchronize()
                before = s.device_counters()
                s.reset_counters()        # peak_alloc_bytes := alloc_bytes
                cb_before = [b.compute_buffer_bytes for b in s.schedule().backends]
                e0 = s.ext_stats()
                per = []
                t0 = time.perf_counter()
                if test_type == "pp":
                    toks = rng.integers(0, s.info.n_vocab, n)
                    res = s.eval(toks, logits="last", pos0=0, clear=True, stats=False)   # read around it (e0, ext)
                    per.append(res.counters["devices"])
                    if keep:
                        last_logits.append(res.logits[-1])
                    pos = n
                else:
                    for i in range(n):
                        tok = rng.integers(0, s.info.n_vocab, 1)
                        # (a round that starts with decode starts from an empty cache, as a prompt does)
                        res = s.eval(tok, logits="last", pos0=pos, clear=pos == 0, stats=False)
                        per.append(res.counters["devices"])
                        if keep:
                            last_logits.append(res.logits[-1])
                        pos += 1
                dt = time.perf_counter() - t0
                after = s.device_counters()
                cb_after = [b.compute_buffer_bytes for b in s.schedule().backends]
                moved = sum_devices(per)
                steps.append({
                    "round": rnd, "kind": test_type, "n": n, "seconds": dt, "ts": n / dt if dt > 0 else float("nan"),
                    "h2d_bytes_per_device": [d.get("h2d_bytes", 0) for d in moved],
                    "host_syncs": sum(d.get("host_syncs", 0) for d in moved),
                    "alloc_before": [d["alloc_bytes"] for d in before],
                    "alloc_after": [d["alloc_bytes"] for d in after],
                    "peak_alloc": [d["peak_alloc_bytes"] for d in after],
                    "failed_allocs": sum(d["failed_allocs"] for d in after),
                    "compute_buffer_before": cb_before, "compute_buffer_after": cb_after,
                    "ext": ext_delta(e0, s.ext_stats())})
        if keep:
            np.save(job.out, np.stack(last_logits))
        return {"model": s.info.to_dict(), "schedule": sched0.to_dict(), "compute_buffer_at_creation": cb0,
                "backend_names": [b.name for b in sched0.backends], "steps": steps,
                "switch_defaults": switch_defaults(s.native)}
    finally:
        s.close()
