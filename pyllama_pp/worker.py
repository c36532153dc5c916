"""Worker processes: one variant per process (both variants share library names).

`run_job(job, variant)` starts `python -m pyllama_pp.worker`, sends the job as JSON on stdin and reads one
JSON document back. A worker that crashes, is killed or times out raises WorkerError (with its exit status
and the end of its stderr); the caller decides whether that becomes an error row.

`ServingWorker(variant)` starts `python -m pyllama_pp.worker --serve`, which answers one JSON line per job line
and keeps a bench job's loaded session for the next bench job on the same model, devices, placement and switches
(a 30 GB model loads in ~25 s: bench.interleaved alternates the variants round by round without loading again).
Its environment, and the patched build's switches, are fixed for as long as it runs.

Job kinds: "info", "schedule", "logits" (writes an .npy), "bench" (llama-bench-like pp/tg tests),
"workload" (a mixed sequence in one context, bench/q6), "fit" (pyllama_pp.fit), "soak" (pyllama_pp.soak).
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
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


def _worker_env(env: Optional[dict]) -> dict:
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    full_env.setdefault("PYLLAMA_PP_LOG", "1")
    # an abort's own message ends the worker's stderr (its last words), not a debugger's backtrace of it
    full_env.setdefault("GGML_NO_BACKTRACE", "1")
    full_env["PYLLAMA_PP_PARENT_PID"] = str(os.getpid())
    return full_env


def _died(variant: str, returncode: int, stderr: str) -> WorkerError:
    how = f"killed by signal {_signal_name(-returncode)}" if returncode < 0 else f"exit code {returncode}"
    last = _last_words(stderr)
    return worker_error("WorkerError", f"{variant} worker died ({how}) without a result"
                        + (f"; its last words: {last[:300]}" if last else ""), returncode, stderr[-2000:])


def _answered_error(variant: str, result: dict, code: int, stderr: str) -> WorkerError:
    """The error a worker answered (its class and its one message, here too); code 4: a bug in pyllama_pp."""
    kind, msg = str(result.get("type") or "WorkerError"), str(result["error"])
    if code == 4:
        msg = f"{variant} worker hit an unexpected error (a bug in pyllama_pp, please report it): {msg}"
    return worker_error(kind, msg, code, result.get("traceback") or stderr)


def run_job(job: Union[Job, dict], variant: str, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    """Run `job` (a jobs.Job, or a dict that describes one) in a fresh worker process for `variant`; returns the
    worker's result dict.

    The worker dies with its caller (Linux: PR_SET_PDEATHSIG), does not take SIGINT itself, and a caller
    interrupted while it waits (Ctrl-C) kills and reaps it before the KeyboardInterrupt goes on."""
    payload = as_job(job, variant).to_json()   # a malformed job fails here, before a worker starts
    full_env = _worker_env(env)
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
        raise _answered_error(variant, result, proc.returncode, stderr[-2000:])
    if proc.returncode != 0 or not isinstance(result, dict):
        raise _died(variant, proc.returncode, stderr)
    return result


class ServingWorker:
    """A worker process that runs many jobs: `python -m pyllama_pp.worker --serve`, one JSON line per job each
    way. Bench jobs on the same model, devices, placement and switches share one loaded session (a job with another
    context gets a fresh context on it); any other job drops it first.

    >>> with ServingWorker("patched", env={"GGML_CUDA_DISABLE_GRAPHS": "1"}) as w:
    ...     first = w.run(job, timeout=300)      # loads the model
    ...     again = w.run(job, timeout=60)       # the same session: again["served"]["reused"] is True

    The errors are run_job's: an error the worker answers (the job failed; the worker serves the next one) is raised
    as that class with WorkerError (exit_code 3, or 4 for a bug); a worker that dies, or does not answer within
    `timeout` (it is killed then), raises WorkerError and serves no more. `env` and the switches (ext_params) of its
    first job are fixed for the process: a job with other switches is refused (start another worker). The worker
    dies with the thread that started it (PR_SET_PDEATHSIG)."""

    def __init__(self, variant: str, env: Optional[dict] = None):
        self.variant = variant
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self._proc: Optional[subprocess.Popen] = None
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=400)
        self._threads: list = []
        self._timed_out = False

    # -- lifetime
    def start(self) -> "ServingWorker":
        if self._proc is not None:
            raise WorkerError(f"this {self.variant} worker was started already")
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})   # (as in run_job: see there)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "pyllama_pp.worker", "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          env=_worker_env(self.env), encoding="utf-8", errors="replace", bufsize=1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # both pipes are drained all the time (llama.cpp's log must never fill the stderr pipe and stall the worker)
        for target in (self._read_stdout, self._read_stderr):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _read_stdout(self) -> None:
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        for line in self._proc.stderr:
            self._stderr.append(line)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stderr_tail(self, n: int = 2000) -> str:
        return "".join(self._stderr)[-n:]

    def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            _stop(self._proc)

    def close(self, timeout: float = 30) -> Optional[int]:
        """End of input: the worker frees its session and exits (killed after `timeout` s); its exit status."""
        if self._proc is None:
            return None
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(self._proc)
        for t in self._threads:
            t.join(timeout=5)
        return self._proc.returncode

    def __enter__(self) -> "ServingWorker":
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:   # (Ctrl-C, an error: no waiting for a job in progress)
            self.kill()
        self.close()

    # -- jobs
    def send(self, job: Union[Job, dict]) -> None:
        """Send one job (checked here first, as run_job does); its answer comes from result()."""
        payload = as_job(job, self.variant).to_json()
        if self._proc is None:
            self.start()
        try:
            self._proc.stdin.write(payload + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):   # (a closed pipe: the worker is gone; result() says how it died)
            pass

    def result(self, timeout: Optional[float] = None) -> dict:
        """The answer to the oldest job sent and not yet answered."""
        if self._proc is None:
            raise WorkerError(f"this {self.variant} worker was not started")
        if self._timed_out:
            self._proc.wait()
            raise _died(self.variant, self._proc.returncode, self.stderr_tail(100_000))
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            _stop(self._proc)
            self._timed_out = True   # (an answer that lands now is stale: every later call says the worker died)
            raise worker_error("WorkerError", f"{self.variant} worker timed out after {timeout:.0f} s (killed)",
                               None, self.stderr_tail()) from None
        if line is None:   # EOF: the worker is gone
            self._lines.put(None)   # (for every later call too)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _stop(self._proc)
            self._threads[1].join(timeout=5)
            raise _died(self.variant, self._proc.returncode, self.stderr_tail(100_000))
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            result = None
        if not isinstance(result, dict):
            raise worker_error("WorkerError", f"{self.variant} worker answered something other than a result: "
                               f"{line.strip()[:200]!r}", None, self.stderr_tail())
        if "error" in result:
            raise _answered_error(self.variant, result, result.get("code", 3), self.stderr_tail())
        return result

    def run(self, job: Union[Job, dict], timeout: Optional[float] = None) -> dict:
        """send() then result()."""
        self.send(job)
        return self.result(timeout)


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


def _run_tests(s, tests, reps: int, seed: int, coverage: bool, warmup: int = 1) -> list[dict]:
    """Each test is [kind, n] or [kind, n, depth] (llama-bench's -d: the context first holds `depth` prompt
    tokens, untimed; tg then decodes right after them, its first token included); `warmup` untimed runs, then
    `reps` timed ones."""
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
        for r in range(warmup + reps):
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
            if r < warmup:
                continue
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
    tokens one by one. Each test: `warmup` untimed runs (default one), then `reps` timed runs.

    With "ctx_list" (a list of {"ctx": {...}, "tests": [...]}) the model is loaded once and each entry gets a
    fresh context: the result then has "runs", one {"schedule", "tests"} (or {"error"}) per entry."""
    _check_bench(job)
    with _session(job) as s:
        return _bench(s, job)


def _check_bench(job: BenchJob) -> None:
    """Before any model load."""
    if int(job.reps) < 1 or int(job.warmup) < 0:
        raise ConfigError(f"a bench job needs reps >= 1 and warmup >= 0, got reps={job.reps}, warmup={job.warmup}")


def _bench(s, job: BenchJob) -> dict:
    from .session import ContextParams
    reps, seed, coverage, warmup = int(job.reps), int(job.seed), bool(job.coverage), int(job.warmup)
    if job.ctx_list is None:
        sched = s.schedule().to_dict()
        return {"model": s.info.to_dict(), "schedule": sched,
                "tests": _run_tests(s, job.tests, reps, seed, coverage, warmup)}
    runs = []
    for i, entry in enumerate(job.ctx_list):
        try:
            if i > 0:
                s.set_context(ContextParams(**entry["ctx"]))
            runs.append({"schedule": s.schedule().to_dict(),
                         "tests": _run_tests(s, entry["tests"], reps, seed, coverage, warmup)})
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


class _Server:
    """Inside `--serve`: one job at a time; the session of the last bench job stays loaded for the next one."""

    def __init__(self):
        self.session = None
        self.key: Optional[str] = None
        self.loads = 0
        self.ext_params: Optional[dict] = None   # the switches of the first job (a process-wide setting)

    def drop(self) -> None:
        if self.session is not None:
            s, self.session, self.key = self.session, None, None
            s.close()

    @staticmethod
    def _load_key(job: Job) -> str:
        d = job.to_dict()
        return json.dumps([d[k] for k in ("variant", "model", "devices", "placement", "plan", "ext_params")],
                          sort_keys=True, default=str)

    def bench(self, job: BenchJob) -> dict:
        _check_bench(job)
        key = self._load_key(job)
        reused = self.session is not None and key == self.key
        t0 = time.perf_counter()
        if reused:
            if not job.plan and job.ctx != self.session.ctx_params:   # (a plan's context is the plan's)
                self.session.set_context(job.ctx)
        else:
            self.drop()
            self.session, self.key = _session(job), key
            self.loads += 1
        load_s = time.perf_counter() - t0
        result = _bench(self.session, job)
        result["served"] = {"pid": os.getpid(), "loads": self.loads, "reused": reused,
                            "load_seconds": 0.0 if reused else load_s}
        return result

    def run(self, job: Job) -> dict:
        if job.kind == "info":
            return HANDLERS["info"](job)
        if self.ext_params is None:
            self.ext_params = dict(job.ext_params)
        elif dict(job.ext_params) != self.ext_params:
            raise ConfigError(f"this serving worker runs with the switches {self.ext_params} (its first job's: "
                              f"they hold for the process), not {dict(job.ext_params)}: start another worker")
        if job.kind == "bench":
            return self.bench(job)
        self.drop()   # (never two models at once)
        return HANDLERS[job.kind](job)

    def answer(self, line: str) -> dict:
        try:
            try:
                raw = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"a job line must be one JSON object: {e}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"a job line must be one JSON object, not {type(raw).__name__}")
            return self.run(Job.from_dict(raw))
        except Exception as e:   # (a PyllamaError, or a bug: answered with its traceback) the worker serves on
            self.drop()   # (a failed job may leave its session half-used: the next one loads afresh)
            answer, code = _error_answer(e)
            return {**answer, "code": code}


def _error_answer(e: Exception) -> tuple:
    """A failed job's answer and exit code: 3 with the error's class for a PyllamaError, 4 with the traceback for
    anything else (a bug)."""
    if isinstance(e, PyllamaError):
        return {"error": str(e), "type": type(e).__name__}, 3
    return {"error": f"{type(e).__name__}: {e}", "type": "WorkerError", "traceback": traceback.format_exc()}, 4


def _serve() -> int:
    """`--serve`: a job per line on stdin, an answer per line (a result, or {"error", "type", "code"}); EOF ends it."""
    # the answers get the stdout pipe to themselves: anything else written to stdout (native code) goes to stderr
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    server = _Server()
    try:
        while True:
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            answers.write(json.dumps(server.answer(line), default=float) + "\n")
            answers.flush()
    except KeyboardInterrupt:   # (SIGINT stays blocked, as in a one-job worker; the caller kills it)
        return 130
    finally:
        server.drop()


def _main() -> int:
    _die_with_parent()
    if "--serve" in sys.argv[1:]:
        return _serve()
    try:
        raw = sys.stdin.read()
    except KeyboardInterrupt:
        return 130
    try:
        job = Job.from_dict(json.loads(raw))
        result = HANDLERS[job.kind](job)
    except KeyboardInterrupt:   # Ctrl-C reaches the whole process group: the caller reports it
        return 130
    except Exception as e:  # a PyllamaError, or a bug: reported with its traceback rather than dying silently
        answer, code = _error_answer(e)
        print(json.dumps(answer))
        return code
    sys.stdout.flush()
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
