"""Worker of q6_reservation.py: one variant per process (both variants share library names).

Reads a job (JSON) on stdin, runs a mixed workload in ONE session (one context, as a server would) and prints
one JSON document on the last stdout line. Per step it records wall time, bytes moved, host syncs, the VDEV
allocation counters (bytes allocated before/after the step and the peak during it: a compute buffer that is
re-allocated shows up as a change or a peak above the starting level), the scheduler's compute buffer sizes
after the step, and the patched build's counters (graphs, id readbacks, upload-all).
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402


def _sum(devs_list):
    out = []
    for devs in devs_list:
        for i, d in enumerate(devs):
            if i >= len(out):
                out.append({k: 0 for k, v in d.items() if isinstance(v, (int, float))})
            for k, v in d.items():
                if isinstance(v, (int, float)) and k not in ("alloc_bytes", "peak_alloc_bytes"):
                    out[i][k] += v
    return out


def _ext_delta(a, b):
    if not a or not b:
        return None
    return {k: b[k] - a[k] for k in ("graphs", "id_readbacks", "upload_all", "selective", "fallback_syncs",
                                     "input_event_syncs") if k in a and k in b}


def run(job: dict) -> dict:
    from pyllama_pp.session import ContextParams, Placement, Session
    s = Session(job["model"], devices=job["devices"], variant=job["variant"],
                placement=Placement(host_experts=job.get("host_experts", "all"), tensor_split=job.get("tensor_split")),
                ctx=ContextParams(n_ctx=job["n_ctx"], n_batch=job["n_batch"], n_ubatch=job["n_ubatch"]))
    try:
        sched0 = s.schedule()
        cb0 = [b.compute_buffer_bytes for b in sched0.backends]
        rng = np.random.default_rng(int(job.get("seed", 0)))
        steps = []
        for rnd in range(int(job.get("rounds", 2))):
            pos = 0
            for kind, n in job["workload"]:
                s.native.check(s.native.lib.pp_synchronize(s._ctx))
                before = s.device_counters()
                s.reset_counters()        # peak_alloc_bytes := alloc_bytes
                cb_before = [b.compute_buffer_bytes for b in s.schedule().backends]
                e0 = s.ext_stats()
                per = []
                t0 = time.perf_counter()
                if kind == "pp":
                    toks = rng.integers(0, s.info.n_vocab, n)
                    res = s.eval(toks, logits="last", pos0=0, clear=True)
                    per.append(res.counters["devices"])
                    pos = n
                else:
                    for i in range(n):
                        tok = rng.integers(0, s.info.n_vocab, 1)
                        res = s.eval(tok, logits="last", pos0=pos, clear=False)
                        per.append(res.counters["devices"])
                        pos += 1
                dt = time.perf_counter() - t0
                after = s.device_counters()
                cb_after = [b.compute_buffer_bytes for b in s.schedule().backends]
                moved = _sum(per)
                steps.append({
                    "round": rnd, "kind": kind, "n": n, "seconds": dt, "ts": n / dt if dt > 0 else float("nan"),
                    "h2d_bytes_per_device": [d.get("h2d_bytes", 0) for d in moved],
                    "host_syncs": sum(d.get("host_syncs", 0) for d in moved),
                    "alloc_before": [d["alloc_bytes"] for d in before],
                    "alloc_after": [d["alloc_bytes"] for d in after],
                    "peak_alloc": [d["peak_alloc_bytes"] for d in after],
                    "failed_allocs": sum(d["failed_allocs"] for d in after),
                    "compute_buffer_before": cb_before, "compute_buffer_after": cb_after,
                    "ext": _ext_delta(e0, s.ext_stats())})
        return {"model": s.info.to_dict(), "schedule": sched0.to_dict(), "compute_buffer_at_creation": cb0,
                "backend_names": [b.name for b in sched0.backends], "steps": steps}
    finally:
        s.close()


def main() -> int:
    job = json.loads(sys.stdin.read())
    try:
        res = run(job)
    except Exception as e:  # report, don't die silently
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        return 4
    sys.stdout.flush()
    print(json.dumps(res, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
