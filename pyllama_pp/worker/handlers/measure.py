"""Job kind "measure": llama-bench-like tests (pp: a prompt in n_batch chunks; tg: tokens one by one), with the
device counters, the patched scheduler's stats and the expert coverage of each."""
from __future__ import annotations

import time

from ...counters import ext_add, ext_delta, sum_devices
from ...defaults import RUN
from ...errors import ConfigError, PyllamaError
from ...jobs import MeasureJob, depth_of
from ...model_file import routes_by_stream
from ...params import ContextParams
from .base import bench_tokens, open_session, switch_defaults


def run_tests(s, tests, reps: int, seed: int, coverage: bool, warmup: int = RUN.warmup,
              stream: bool = False) -> list[dict]:
    """Each test is [kind, n] or [kind, n, depth] (llama-bench's -d: the context first holds `depth` prompt
    tokens, untimed; tg then decodes right after them, its first token included); `warmup` untimed runs, then
    `reps` timed ones. Tokens: random ones, or with `stream` consecutive ids (base.bench_tokens: for a model whose
    routing follows such a stream)."""
    results = []
    for test in tests:
        test_type, n = test[0], int(test[1])
        depth = depth_of(test)
        toks = bench_tokens(n, s.info.n_vocab, seed, stream)
        prefix = bench_tokens(depth, s.info.n_vocab, seed + 1, stream) if depth else None
        cov = None
        if test_type == "pp" and coverage and s.info.n_expert > 0:
            cov = s.coverage(toks, exclusive=True)   # (never two contexts at once: a plan sized one)
        times, devs, ext = [], [], None
        for r in range(warmup + reps):
            s.reset_counters()
            if depth:
                s.eval(prefix, logits="last", stats=False)   # the context's depth (not timed, not counted)
                s.reset_counters()
            e0 = s.ext_stats()
            if test_type == "pp":
                res = s.eval(toks, logits="last", pos0=depth, clear=not depth, stats=False)   # stats read around it
                dt, dev = res.seconds, res.counters["devices"]
            else:
                first = depth
                if not depth:
                    s.eval(toks[:1], logits="last")  # position 0 (not timed, as llama-bench's tg starts empty)
                    e0 = s.ext_stats()                # nor counted in the extension's deltas
                    first = 1
                t0 = time.perf_counter()
                per = []
                for i in range(first, first + n):
                    j = (i - first + 1) % len(toks)
                    res = s.eval(toks[j: j + 1], logits="last", pos0=i, clear=False, stats=False)
                    per.append(res.counters["devices"])
                dt = time.perf_counter() - t0
                dev = sum_devices(per)
            e1 = s.ext_stats()
            if r < warmup:
                continue
            times.append(dt)
            devs.append(dev)
            ext = ext_add(ext, ext_delta(e0, e1))  # the timed window of each rep only
        results.append({"kind": test_type, "n": n, "depth": depth, "seconds": times, "devices": sum_devices(devs),
                        "ext": ext, "coverage": cov, "reps": reps})
    return results


def handle(job: MeasureJob) -> dict:
    """Run llama-bench-like tests: ("pp", n) decodes n prompt tokens in n_batch chunks; ("tg", n) decodes n
    tokens one by one. Each test: `warmup` untimed runs (default one), then `reps` timed runs.

    With "ctx_list" (a list of {"ctx": {...}, "tests": [...]}) the model is loaded once and each entry gets a
    fresh context: the result then has "runs", one {"schedule", "tests"} (or {"error"}) per entry."""
    check(job)
    with open_session(job) as s:
        return measure(s, job)


def check(job: MeasureJob) -> None:
    """A measure job's own checks, before any model load.

    Raises:
        ConfigError: for reps < 1 or warmup < 0.
    """
    if int(job.reps) < 1 or int(job.warmup) < 0:
        raise ConfigError(f"a measure job needs reps >= 1 and warmup >= 0, got reps={job.reps}, warmup={job.warmup}")


def measure(s, job: MeasureJob) -> dict:
    """Run the job's tests (or its contexts' tests) on the loaded session s; with the variant's switch defaults (the
    rows report a switch as set only where its value differs from them)."""
    reps, seed, coverage, warmup = int(job.reps), int(job.seed), bool(job.coverage), int(job.warmup)
    stream = routes_by_stream(s.path)   # (a locality model's tests decode consecutive ids)
    if job.ctx_list is None:
        sched = s.schedule().to_dict()
        return {"model": s.info.to_dict(), "schedule": sched, "switch_defaults": switch_defaults(s.native),
                "tests": run_tests(s, job.tests, reps, seed, coverage, warmup, stream)}
    runs = []
    for i, entry in enumerate(job.ctx_list):
        try:
            if i > 0:
                s.set_context(ContextParams(**entry["ctx"]))
            runs.append({"schedule": s.schedule().to_dict(),
                         "tests": run_tests(s, entry["tests"], reps, seed, coverage, warmup, stream)})
        except PyllamaError as e:
            runs.append({"error": f"{type(e).__name__}: {e}"})
    return {"model": s.info.to_dict(), "switch_defaults": switch_defaults(s.native), "runs": runs}
