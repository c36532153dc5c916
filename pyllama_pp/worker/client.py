"""The parent's side of a worker process: `run_job` (one job, one fresh process) and `ServingWorker` (many jobs, one
process that keeps a loaded model between measure jobs).

One variant per process (both variants share library names). `run_job(job, variant)` starts
`python -m pyllama_pp.worker`, sends the job as JSON on stdin and reads one JSON document back. A worker that
crashes, is killed or times out raises WorkerError (with its exit status and the end of its stderr); the caller
decides whether that becomes an error row. The worker process itself is pyllama_pp.worker.loop.
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
from typing import Optional, Union

from .. import devices as devspec
from .. import switches
from ..defaults import TIMEOUTS
from ..errors import ConfigError, PyllamaError, WorkerError, worker_error
from ..jobs import Job, as_job
from ..rpc.client import tcp_probe


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
        proc.wait(timeout=TIMEOUTS.worker_exit)
    except subprocess.TimeoutExpired:   # (SIGKILL cannot be ignored: only a process stuck in the kernel gets here)
        pass


def _last_words(stderr: str) -> str:
    """The line of a dead worker's stderr that says why: ggml's abort message or an error line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    why = [ln for ln in lines if "GGML_ASSERT" in ln or "ggml abort" in ln or "error" in ln.lower() or "fault" in ln]
    return (why or lines or [""])[-1]


def _worker_env(env: Optional[dict]) -> dict:
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items() if v is not None})
    for k in [k for k, v in (env or {}).items() if v is None]:   # (None: unset for the worker)
        full_env.pop(k, None)
    full_env.setdefault("PYLLAMA_PP_LOG", "1")
    # an abort's own message ends the worker's stderr (its last words), not a debugger's backtrace of it
    full_env.setdefault("GGML_NO_BACKTRACE", "1")
    full_env["PYLLAMA_PP_PARENT_PID"] = str(os.getpid())
    return full_env


# what ggml-rpc's client says when a server's connection breaks mid-run; upstream's (the baseline's) then aborts the
# process from its dispatcher thread, where no abort callback can turn it into an error; the patched one (patch 0013)
# fails the caller's call, which the worker answers as a DeviceError
RPC_LOST = ("Remote RPC server crashed", "RPC handshake failed")


def _lost_server(variant: str, devices, said: str, how: str = "") -> Optional[str]:
    """Where a worker died or failed because an RPC server of `devices` went away (ggml-rpc's message in `said`):
    which server no longer answers, and what to do; None for anything else."""
    if not devices or not any(m in said for m in RPC_LOST):
        return None
    try:
        spec = devspec.parse(devices)
    except (PyllamaError, ValueError, OSError):
        return None
    servers = list(dict.fromkeys(e.split("/")[0] for e in spec.endpoints))
    gone = [ep for ep in servers if tcp_probe(ep)]
    which = (f"lost the RPC server at {', '.join(gone)}: it went away" if gone else
             f"lost an RPC server of {', '.join(servers)}: one closed its connection (each answers again now)")
    return (f"{variant} worker {which} during the run{f' (ggml RPC then ends the worker: {how})' if how else ''}. "
            "Fix: restart `pyllama-pp rpc-server` there, then measure the rest again (`--resume DIR` keeps the "
            "finished rows)")


def _died(variant: str, returncode: int, stderr: str, devices=None) -> WorkerError:
    how = f"killed by signal {_signal_name(-returncode)}" if returncode < 0 else f"exit code {returncode}"
    lost = _lost_server(variant, devices, stderr, how)
    if lost:
        return worker_error("DeviceError", lost, returncode, stderr[-2000:])
    last = _last_words(stderr)
    return worker_error("WorkerError", f"{variant} worker died ({how}) without a result"
                        + (f"; its last words: {last[:300]}" if last else ""), returncode, stderr[-2000:])


def _answered_error(variant: str, result: dict, code: int, stderr: str, devices=None) -> WorkerError:
    """The error a worker answered (its class and its one message, here too); code 4: a bug in pyllama_pp."""
    kind, msg = str(result.get("type") or "WorkerError"), str(result["error"])
    lost = _lost_server(variant, devices, msg)
    if lost:
        kind, msg = "DeviceError", lost
    elif code == 4:
        msg = f"{variant} worker hit an unexpected error (a bug in pyllama_pp, please report it): {msg}"
    return worker_error(kind, msg, code, result.get("traceback") or stderr)


def run_job(job: Union[Job, dict], variant: str, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    """Run one job in a fresh worker process for a variant (`python -m pyllama_pp.worker`).

    The worker dies with its caller (Linux: PR_SET_PDEATHSIG), does not take SIGINT itself, and a caller
    interrupted while it waits (Ctrl-C) kills and reaps it before the KeyboardInterrupt goes on.

    Args:
        job: a jobs.Job, or a dict that describes one ({"kind": "measure", "model": ..., ...}; kind defaults to
            measure).
        variant: "patched" or "baseline"; it overrides the job's own.
        timeout: seconds the worker may take (None: no limit); it is killed after that.
        env: more environment for the worker, NAME -> value (None: the variable unset there).
    Returns:
        dict: the worker's result (its keys depend on the job's kind).
    Raises:
        ConfigError: for a malformed job (an unknown kind or field, a bad placement or context), before a worker
            starts.
        TypeError: for a placement or context of the wrong type.
        WorkerError: when the job fails in the worker (the raised object is also an instance of the worker's own
            error class: ModelError, OutOfMemoryError, ...), or the worker dies or times out.
    """
    job = as_job(job, variant)
    payload = job.to_json()   # a malformed job fails here, before a worker starts
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
        raise _answered_error(variant, result, proc.returncode, stderr[-2000:], job.devices)
    if proc.returncode != 0 or not isinstance(result, dict):
        raise _died(variant, proc.returncode, stderr, job.devices)
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
    `timeout` (it is killed then), raises WorkerError and serves no more. `env` and the switches of its
    first job are fixed for the process: a job with other switches is refused (start another worker). The worker
    dies with the thread that started it (PR_SET_PDEATHSIG).

    Args:
        variant: "patched" or "baseline": the build every job of this worker runs.
        env: more environment for the worker process, NAME -> value (fixed for its life).
    """

    def __init__(self, variant: str, env: Optional[dict] = None):
        self.variant = variant
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self._proc: Optional[subprocess.Popen] = None
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=400)
        self._threads: list = []
        self._timed_out = False
        self._devices: collections.deque = collections.deque()   # each job sent and not answered yet: its devices

    # -- lifetime
    def start(self) -> "ServingWorker":
        """Start the worker process (a with-block or the first send() does it too).

        Returns:
            ServingWorker: this worker, started.
        Raises:
            WorkerError: when it was started already.
        """
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
        """int | None: the worker process's id (None before start())."""
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        """bool: whether the worker process was started and is still running."""
        return self._proc is not None and self._proc.poll() is None

    def stderr_tail(self, n: int = 2000) -> str:
        """The end of what the worker wrote to stderr (llama.cpp's log, warnings).

        Args:
            n: at most this many characters.
        Returns:
            str: the last n characters of its recent stderr lines.
        """
        return "".join(self._stderr)[-n:]

    def kill(self) -> None:
        """Kill the worker process now and reap it (a job in progress is lost); close() still joins its readers."""
        if self._proc is not None and self._proc.returncode is None:
            _stop(self._proc)

    def close(self, timeout: float = TIMEOUTS.worker_exit) -> Optional[int]:
        """End the worker's input: it frees its session and exits.

        Args:
            timeout: seconds to wait for it to exit; it is killed after that.
        Returns:
            int | None: its exit status (negative: killed by that signal); None when it was never started.
        """
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
            t.join(timeout=TIMEOUTS.reader_join)
        return self._proc.returncode

    def __enter__(self) -> "ServingWorker":
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:   # (Ctrl-C, an error: no waiting for a job in progress)
            self.kill()
        self.close()

    # -- jobs
    def send(self, job: Union[Job, dict]) -> None:
        """Send one job (starting the worker if needed); its answer comes from result().

        Args:
            job: a jobs.Job or a dict that describes one, as run_job takes it; it runs on this worker's variant.
        Raises:
            ConfigError: for a malformed job (checked here, before it is sent).
            TypeError: for a placement or context of the wrong type.
        """
        job = as_job(job, self.variant)
        payload = job.to_json()
        if self._proc is None:
            self.start()
        self._devices.append(job.devices)
        try:
            self._proc.stdin.write(payload + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):   # (a closed pipe: the worker is gone; result() says how it died)
            pass

    def result(self, timeout: Optional[float] = None) -> dict:
        """The answer to the oldest job sent and not yet answered.

        Args:
            timeout: seconds to wait (None: no limit); the worker is killed after that and serves no more.
        Returns:
            dict: the worker's result for that job.
        Raises:
            WorkerError: when the worker was not started, the job failed (an instance of the worker's own error
                class too; the worker serves the next job), or the worker died, timed out or answered garbage.
        """
        if self._proc is None:
            raise WorkerError(f"this {self.variant} worker was not started")
        devices = self._devices.popleft() if self._devices else None
        if self._timed_out:
            self._proc.wait()
            raise _died(self.variant, self._proc.returncode, self.stderr_tail(100_000), devices)
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
                self._proc.wait(timeout=TIMEOUTS.worker_exit)
            except subprocess.TimeoutExpired:
                _stop(self._proc)
            self._threads[1].join(timeout=TIMEOUTS.reader_join)
            raise _died(self.variant, self._proc.returncode, self.stderr_tail(100_000), devices)
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            result = None
        if not isinstance(result, dict):
            raise worker_error("WorkerError", f"{self.variant} worker answered something other than a result: "
                               f"{line.strip()[:200]!r}", None, self.stderr_tail())
        if "error" in result:
            raise _answered_error(self.variant, result, result.get("code", 3), self.stderr_tail(), devices)
        return result

    def run(self, job: Union[Job, dict], timeout: Optional[float] = None) -> dict:
        """Run one job on this worker: send() then result().

        Args:
            job: a jobs.Job or a dict that describes one.
            timeout: seconds to wait for the answer (None: no limit).
        Returns:
            dict: the worker's result.
        Raises:
            ConfigError: for a malformed job.
            TypeError: for a placement or context of the wrong type.
            WorkerError: as result() raises it.
        """
        self.send(job)
        return self.result(timeout)


def check_switch_env(variants, env: Optional[dict] = None) -> None:
    """Refuse GGML_SCHED_PP_* variables (of this process's environment, or `env`) that the patched build's switch
    table does not accept, before any measuring worker starts: a misspelled name would otherwise be found by every
    patched run in turn. Costs one short worker only when such a variable is set and the patched build is in
    `variants`.

    Args:
        variants: the variants about to run ("baseline", "patched"); the baseline reads no switches.
        env: extra environment variables the workers will get (as RunConfig.env).

    Raises:
        ConfigError: naming each variable the table refuses, and how to list the switches.
    """
    if "patched" not in variants or not switches.set_in(env):
        return
    problems = run_job({"kind": "info"}, "patched", timeout=TIMEOUTS.info, env=env).get("env_problems") or []
    if problems:
        raise ConfigError("the patched scheduler does not accept " + "; ".join(problems)
                          + ". Fix: unset or correct the variable (`pyllama-pp info` lists the switches)")
