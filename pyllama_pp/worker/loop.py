"""The worker process: `python -m pyllama_pp.worker` runs one job read from stdin and prints its result as one JSON
document; `--serve` answers one JSON line per job line and keeps a measure job's loaded session for the next
measure job that can share it (Job.load_key): a 30 GB model loads in ~25 s, and the paired A/B runner alternates
the variants round by round without loading again. Its environment, and the patched build's switches, are fixed
for as long as it runs. A failed job is answered with its error's class and message (exit code 3), a bug with its
traceback (exit code 4); the parent's side is pyllama_pp.worker.client.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from typing import Optional

from ..errors import ConfigError, PyllamaError
from ..jobs import InfoJob, Job, MeasureJob
from .handlers import HANDLERS, measure
from .handlers.base import open_session


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the process that started it dies (no orphan keeps running)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get("PYLLAMA_PP_PARENT_PID")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        os._exit(137)   # the parent died before the line above


class _Server:
    """Inside `--serve`: one job at a time; the session of the last measure job stays loaded for the next one."""

    def __init__(self):
        self.session = None
        self.key: Optional[str] = None
        self.loads = 0
        self.switches: Optional[dict] = None   # the switches of the first job (a process-wide setting)

    def drop(self) -> None:
        if self.session is not None:
            s, self.session, self.key = self.session, None, None
            s.close()

    def measure(self, job: MeasureJob) -> dict:
        measure.check(job)
        key = job.load_key()
        reused = self.session is not None and key == self.key
        t0 = time.perf_counter()
        if reused:
            if not job.plan and job.ctx != self.session.ctx_params:   # (a plan's context is the plan's)
                self.session.set_context(job.ctx)
        else:
            self.drop()
            self.session, self.key = open_session(job), key
            self.loads += 1
        load_s = time.perf_counter() - t0
        result = measure.measure(self.session, job)
        result["served"] = {"pid": os.getpid(), "loads": self.loads, "reused": reused,
                            "load_seconds": 0.0 if reused else load_s}
        return result

    def run(self, job: Job) -> dict:
        if isinstance(job, InfoJob):
            return HANDLERS["info"](job)
        if self.switches is None:
            self.switches = dict(job.switches)
        elif dict(job.switches) != self.switches:
            raise ConfigError(f"this serving worker runs with the switches {self.switches} (its first job's: "
                              f"they hold for the process), not {dict(job.switches)}: start another worker")
        if isinstance(job, MeasureJob):
            return self.measure(job)
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


def main() -> int:
    """The worker process's entry point: one job from stdin, or `--serve`; returns the exit code."""
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

