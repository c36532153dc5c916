"""Paired A/B: the serving worker (`python -m pyllama_pp.worker --serve`) keeps its session between jobs and answers a
broken job without dying."""
from __future__ import annotations

import json

import pytest

from pyllama_pp.errors import ConfigError, ModelError, WorkerError
from pyllama_pp.worker import ServingWorker

CTX = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 32}


def _job(model, **kw):
    return {"kind": "bench", "model": model, "devices": "vdev:2x0@0", "tests": [["tg", 4], ["pp", 32]], "reps": 1,
            "warmup": 0, "ctx": CTX, **kw}


def test_serving_worker_loads_once_for_many_jobs(tiny_model):
    """Three jobs on one model: one process, one load; a job with another context gets a fresh context on the same
    model (its ubatch shows in the schedule), and EOF ends the worker with exit 0."""
    with ServingWorker("patched") as w:
        got = [w.run(_job(tiny_model), timeout=60) for _ in range(3)]
        other = w.run(_job(tiny_model, ctx={**CTX, "n_ubatch": 16}), timeout=60)
        assert w.alive
    assert w.close() == 0 and not w.alive
    served = [r["served"] for r in got + [other]]
    assert {s["pid"] for s in served} == {w.pid}
    assert [s["loads"] for s in served] == [1, 1, 1, 1]
    assert [s["reused"] for s in served] == [False, True, True, True]
    assert served[0]["load_seconds"] > 0 and served[1]["load_seconds"] == 0
    for r in got:   # warmup 0, reps 1: one timed run of each test, in order
        assert [(t["kind"], t["n"], len(t["seconds"])) for t in r["tests"]] == [("tg", 4, 1), ("pp", 32, 1)]
        assert all(t["seconds"][0] > 0 for t in r["tests"])
    assert got[0]["model"] == other["model"]


def test_serving_worker_answers_a_broken_job_and_serves_the_next(tiny_model, tmp_path):
    """A job that fails in the worker (a missing model, a line that is not JSON, other switches than its first
    job's) is raised as run_job raises it (the worker's class with WorkerError, exit code 3) and the same process
    serves the next job; a worker that does not answer in time is killed and says so."""
    with ServingWorker("patched") as w:
        first = w.run(_job(tiny_model), timeout=60)["served"]
        with pytest.raises(ModelError) as e:
            w.run(_job(str(tmp_path / "missing.gguf")), timeout=60)
        assert isinstance(e.value, WorkerError) and e.value.exit_code == 3 and "model file not found" in str(e.value)
        w._proc.stdin.write("{not json\n")
        w._proc.stdin.flush()
        with pytest.raises(ConfigError, match="one JSON object"):
            w.result(timeout=60)
        with pytest.raises(ConfigError, match="switches"):
            w.run(_job(tiny_model, ext_params={"OVERLAP": 2}), timeout=60)
        after = w.run(_job(tiny_model), timeout=60)["served"]
        assert after["pid"] == first["pid"] and w.alive
        assert after["loads"] == 2 and not after["reused"]   # (a failed job drops the session: the next loads afresh)
    slow = ServingWorker("baseline").start()
    try:
        with pytest.raises(WorkerError, match="timed out after 1 s") as e:
            slow.run(_job(tiny_model, devices="vdev:2x0@0.0001GBps", tests=[["pp", 64]], reps=50), timeout=1)
        assert e.value.exit_code is None and not slow.alive
        with pytest.raises(WorkerError, match="died"):
            slow.result(timeout=5)
    finally:
        slow.close()

