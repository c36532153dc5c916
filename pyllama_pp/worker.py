"""Worker processes: one variant per process (both variants share library names).

`run_job(job, variant)` starts `python -m pyllama_pp.worker`, sends the job as JSON on stdin and reads one
JSON document back. A worker that crashes, is killed or times out raises WorkerError (with its exit status
and the end of its stderr); the caller decides whether that becomes an error row.

Job kinds: "info", "schedule", "logits" (writes an .npy), "bench" (llama-bench-like pp/tg tests),
"workload" (a mixed sequence in one context, bench/q6), "fit" (pyllama_pp.fit), "soak" (pyllama_pp.soak).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Optional, Union

import numpy as np

from .errors import ConfigError, PyllamaError, WorkerError, worker_error
from .jobs import BenchJob, FitJob, InfoJob, Job, LogitsJob, ScheduleJob, SoakJob, WorkloadJob, as_job


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _stop(proc: subprocess.Popen) -> None:
    """Kill a worker and reap it: no worker outlives the call that started it (Ctrl-C, a timeout, any error)."""
    try:
        proc.kill()
    except OSError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:   # (SIGKILL cannot be ignored: only a process stuck in the kernel gets here)
        pass


def _last_words(stderr: str) -> str:
    """The line of a dead worker's stderr that says why: ggml's abort message or an error line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    why = [ln for ln in lines if "GGML_ASSERT" in ln or "ggml abort" in ln or "error" in ln.lower() or "fault" in ln]
    return (why or lines or [""])[-1]


def run_job(job: Union[Job, dict], variant: str, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    """Run `job` (a jobs.Job, or a dict that describes one) in a fresh worker process for `variant`; returns the
    worker's result dict.

    The worker dies with its caller (Linux: PR_SET_PDEATHSIG), does not take SIGINT itself, and a caller
    interrupted while it waits (Ctrl-C) kills and reaps it before the KeyboardInterrupt goes on."""
    payload = as_job(job, variant).to_json()   # a malformed job fails here, before a worker starts
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    full_env.setdefault("PYLLAMA_PP_LOG", "1")
    # an abort's own message ends the worker's stderr (its last words), not a debugger's backtrace of it
    full_env.setdefault("GGML_NO_BACKTRACE", "1")
    full_env["PYLLAMA_PP_PARENT_PID"] = str(os.getpid())
    # SIGINT stays blocked while the worker is made, so that a Ctrl-C cannot land between its fork and the `try`
    # that kills it; the worker keeps it blocked (the caller decides what a Ctrl-C does: it kills the worker)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pyllama_pp.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
                                # (llama.cpp logs what it read from a file: a damaged GGUF's bytes must not crash this)
                                encoding="utf-8", errors="replace")
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)   # a Ctrl-C that came meanwhile is raised here
        try:
            stdout, stderr = proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            stdout, stderr = proc.communicate()
            raise worker_error("WorkerError", f"{variant} worker timed out after {timeout:.0f} s (killed)", None,
                               (stderr or "")[-2000:]) from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if proc is not None and proc.returncode is None:
            _stop(proc)
    out = stdout.strip().splitlines()
    result = None
    if out:
        try:
            result = json.loads(out[-1])
        except json.JSONDecodeError:
            result = None
    if isinstance(result, dict) and "error" in result:
        # the worker said what went wrong: its error class and its one message, here too
        kind, msg = str(result.get("type") or "WorkerError"), str(result["error"])
        if proc.returncode == 4:
            msg = f"{variant} worker hit an unexpected error (a bug in pyllama_pp, please report it): {msg}"
        raise worker_error(kind, msg, proc.returncode, result.get("traceback") or stderr[-2000:])
    if proc.returncode != 0 or not isinstance(result, dict):
        how = f"killed by signal {_signal_name(-proc.returncode)}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        last = _last_words(stderr)
        raise worker_error("WorkerError", f"{variant} worker died ({how}) without a result"
                           + (f"; its last words: {last[:300]}" if last else ""), proc.returncode, stderr[-2000:])
    return result


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the process that started it dies (no orphan keeps running)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get("PYLLAMA_PP_PARENT_PID")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        os._exit(137)   # the parent died before the line above


# ---------------------------------------------------------------------------------------------------------
# inside the worker

def _session(job: Job):
    from .session import Session
    if not job.model:
        raise ConfigError(f"a {job.kind} job needs a model")
    if job.plan:   # a fit plan (Plan.to_dict()): its devices, placement and context
        from .fit import Plan
        return Session(job.model, plan=Plan.from_dict(job.plan), variant=job.variant,
                       ext_params=job.ext_params or None)
    return Session(job.model, devices=job.devices, placement=job.placement, ctx=job.ctx, variant=job.variant,
                   ext_params=job.ext_params or None)


def _tokens(n: int, n_vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n, dtype=np.int64)


def _do_info(job: InfoJob) -> dict:
    from . import binding
    from .session import list_devices
    native = binding.load(job.variant)
    switches = []
    if native.lib.pp_ext_version() > 0:
        ffi = native.ffi
        name, desc, val = ffi.new("char[64]"), ffi.new("char[512]"), ffi.new("int64_t *")
        typ, values, lo, hi, dflt = ffi.new("char[16]"), ffi.new("char[64]"), ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int64_t *")
        for i in range(64):
            if native.lib.pp_ext_param_info(i, name, 64, val, desc, 512) != 0:
                break
            native.check(native.lib.pp_ext_param_spec(i, typ, 16, dflt, lo, hi, values, 64))
            accepted = [int(v) for v in native.str(values).split(",") if v]
            switches.append({"name": native.str(name), "type": native.str(typ), "default": int(dflt[0]),
                             "min": int(lo[0]), "max": int(hi[0]), "values": accepted or None,
                             "meaning": native.str(desc), "value": int(val[0]), "description": native.str(desc)})
    return {"variant": native.variant, "ext_version": native.lib.pp_ext_version(), "switches": switches,
            "system_info": native.str(native.lib.pp_system_info()), "devices": list_devices()}


def _do_schedule(job: ScheduleJob) -> dict:
    with _session(job) as s:
        sched = s.schedule_detail() if job.detail else s.schedule()
        return {"model": s.info.to_dict(), "schedule": sched.to_dict()}


def _do_logits(job: LogitsJob) -> dict:
    if not job.out:
        raise ConfigError("a logits job needs `out`, the .npy file for the logits")
    with _session(job) as s:
        toks = job.tokens or _tokens(job.n_tokens, s.info.n_vocab, job.seed).tolist()
        r = s.eval(toks, logits=job.logits)
        np.save(job.out, r.logits)
        return {"shape": list(r.logits.shape), "seconds": r.seconds, "schedule": s.schedule().to_dict(),
                "counters": r.counters, "ext": r.ext}


def _sum_devices(per_eval: list[list[dict]]) -> list[dict]:
    """Add up per-device counter deltas over several evals."""
    from .session import LEVEL_FIELDS
    out: list[dict] = []
    for devs in per_eval:
        for i, d in enumerate(devs):
            if i >= len(out):
                out.append({k: (0 if isinstance(v, (int, float)) else v) for k, v in d.items()})
            for k, v in d.items():
                if isinstance(v, (int, float)) and k not in LEVEL_FIELDS:
                    out[i][k] += v
                elif k == "peak_alloc_bytes":
                    out[i][k] = max(out[i][k], v)
                elif k in LEVEL_FIELDS:
                    out[i][k] = v      # a level: as it stands after the last eval
    return out


_EXT_LEVELS = ("n_copies", "n_splits", "transient_inputs", "graph_nodes_min", "graph_nodes_max", "links")


def _ext_delta(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    if not a or not b:
        return None
    d = {k: b[k] - a[k] for k in b if isinstance(b[k], int) and k not in _EXT_LEVELS}
    d.update({k: b[k] for k in _EXT_LEVELS + ("last_realloc", "realloc_log") if k in b})
    for k in ("host_wait_us", "host_waits"):  # per-cause host waits (extension v2)
        if isinstance(b.get(k), dict):
            d[k] = {c: v - a.get(k, {}).get(c, 0) for c, v in b[k].items()}
    # (a key may appear in the later stats only: gather_bytes once the device's first gather is counted)
    d["backends"] = [{"name": y["name"], **{k: y[k] - x.get(k, 0) for k in y if k != "name"}}
                     for x, y in zip(a["backends"], b["backends"])]
    d["params"] = b.get("params")
    return d


def _ext_add(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Sum of two _ext_delta results (levels and logs: the later one's)."""
    if a is None or b is None:
        return a or b
    out = dict(b)
    for k, v in b.items():
        if isinstance(v, int) and isinstance(a.get(k), int) and k not in _EXT_LEVELS:
            out[k] = a[k] + v
        elif isinstance(v, dict) and k != "params":
            out[k] = {c: a.get(k, {}).get(c, 0) + x for c, x in v.items()}
    out["backends"] = [{"name": y["name"], **{k: x.get(k, 0) + y[k] for k in y if k != "name"}}
                       for x, y in zip(a["backends"], b["backends"])]
    return out


def depth_of(test) -> int:
    """A test is [kind, n] or [kind, n, depth] (tokens already in the context, llama-bench's -d)."""
    return int(test[2]) if len(test) > 2 else 0


def _run_tests(s, tests, reps: int, seed: int, coverage: bool) -> list[dict]:
    """Each test is [kind, n] or [kind, n, depth] (llama-bench's -d: the context first holds `depth` prompt
    tokens, untimed; tg then decodes right after them, its first token included)."""
    results = []
    for test in tests:
        kind, n = test[0], int(test[1])
        depth = depth_of(test)
        toks = _tokens(n, s.info.n_vocab, seed)
        prefix = _tokens(depth, s.info.n_vocab, seed + 1) if depth else None
        cov = None
        if kind == "pp" and coverage and s.info.n_expert > 0:
            cov = s.coverage(toks, exclusive=True)   # (never two contexts at once: a plan sized one)
        times, devs, ext = [], [], None
        for r in range(reps + 1):
            s.reset_counters()
            if depth:
                s.eval(prefix, logits="last", stats=False)   # the context's depth (not timed, not counted)
                s.reset_counters()
            e0 = s.ext_stats()
            if kind == "pp":
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
                dev = _sum_devices(per)
            e1 = s.ext_stats()
            if r == 0:
                continue  # warm-up
            times.append(dt)
            devs.append(dev)
            ext = _ext_add(ext, _ext_delta(e0, e1))  # the timed window of each rep only
        # PREFETCH=2's lanes per backend are a level (in the deltas above it subtracts to 0): as it stands after the last rep
        ring = [{"name": b["name"], "ring_bytes": b["ring_bytes"]} for b in e1["backends"]] \
            if e1 and e1.get("backends") and "ring_bytes" in e1["backends"][0] else None
        results.append({"kind": kind, "n": n, "depth": depth, "seconds": times, "devices": _sum_devices(devs),
                        "ext": ext, "ext_ring": ring, "coverage": cov, "reps": reps})
    return results


def _do_bench(job: BenchJob) -> dict:
    """Run llama-bench-like tests: ("pp", n) decodes n prompt tokens in n_batch chunks; ("tg", n) decodes n
    tokens one by one. Each test: one warm-up, then `reps` timed runs.

    With "ctx_list" (a list of {"ctx": {...}, "tests": [...]}) the model is loaded once and each entry gets a
    fresh context: the result then has "runs", one {"schedule", "tests"} (or {"error"}) per entry."""
    from .session import ContextParams
    reps, seed, coverage = int(job.reps), int(job.seed), bool(job.coverage)
    with _session(job) as s:
        if job.ctx_list is None:
            sched = s.schedule().to_dict()
            return {"model": s.info.to_dict(), "schedule": sched,
                    "tests": _run_tests(s, job.tests, reps, seed, coverage)}
        runs = []
        for i, entry in enumerate(job.ctx_list):
            try:
                if i > 0:
                    s.set_context(ContextParams(**entry["ctx"]))
                runs.append({"schedule": s.schedule().to_dict(),
                             "tests": _run_tests(s, entry["tests"], reps, seed, coverage)})
            except PyllamaError as e:
                runs.append({"error": f"{type(e).__name__}: {e}"})
        return {"model": s.info.to_dict(), "runs": runs}


def _do_workload(job: WorkloadJob) -> dict:
    """A mixed workload in ONE session (one context, as a server would): per step its time, bytes moved, host
    syncs, VDEV allocation counters, compute buffers before/after and the patched counters (bench/q6). With
    "out", the logits of every step's last token (and of each decoded token) are saved there, in order."""
    s = _session(job)
    keep = bool(job.out)
    last_logits: list[np.ndarray] = []
    try:
        sched0 = s.schedule()
        cb0 = [b.compute_buffer_bytes for b in sched0.backends]
        rng = np.random.default_rng(int(job.seed))
        steps = []
        for rnd in range(int(job.rounds)):
            pos = 0
            for kind, n in job.workload:
                s.native.check(s.native.lib.pp_synchronize(s._ctx))
                before = s.device_counters()
                s.reset_counters()        # peak_alloc_bytes := alloc_bytes
                cb_before = [b.compute_buffer_bytes for b in s.schedule().backends]
                e0 = s.ext_stats()
                per = []
                t0 = time.perf_counter()
                if kind == "pp":
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
                moved = _sum_devices(per)
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
        if keep:
            np.save(job.out, np.stack(last_logits))
        return {"model": s.info.to_dict(), "schedule": sched0.to_dict(), "compute_buffer_at_creation": cb0,
                "backend_names": [b.name for b in sched0.backends], "steps": steps}
    finally:
        s.close()


def _do_soak(job: SoakJob) -> dict:
    from . import soak
    if not job.out:
        raise ConfigError("a soak job needs `out`, the .npz file of the reference's logits")
    if job.calls < 1 or job.check_every < 1 or job.warmup < 0:
        raise ConfigError("a soak job needs calls >= 1, check_every >= 1 and warmup >= 0")
    with _session(job) as s:
        if job.reference:
            return soak.reference_job(s, job.out)
        return soak.soak_job(s, job.calls, job.seed, job.check_every, job.warmup, job.out)


def _do_fit(job: FitJob) -> dict:
    from .fit import do_fit_job
    return do_fit_job(job)


HANDLERS = {"info": _do_info, "schedule": _do_schedule, "logits": _do_logits, "bench": _do_bench,
            "workload": _do_workload, "fit": _do_fit, "soak": _do_soak}


def _main() -> int:
    _die_with_parent()
    try:
        raw = sys.stdin.read()
    except KeyboardInterrupt:
        return 130
    try:
        job = Job.from_dict(json.loads(raw))
        result = HANDLERS[job.kind](job)
    except PyllamaError as e:
        print(json.dumps({"error": str(e), "type": type(e).__name__}))
        return 3
    except KeyboardInterrupt:   # Ctrl-C reaches the whole process group: the caller reports it
        return 130
    except Exception as e:  # a bug: report it with its traceback rather than dying silently
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "type": "WorkerError",
                          "traceback": traceback.format_exc()}))
        return 4
    sys.stdout.flush()
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
