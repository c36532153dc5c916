"""The contract between the parent and a worker process: one dataclass per kind of job.

A job names the variant that runs it, the model, the devices, the placement and the context, plus what the kind
needs (tests and repetitions for `measure`, tokens for `logits`, steps for `workload`). The parent builds a job (or
passes a dict, as scripts and tests do: `Job.from_dict` checks it), `worker.run_job` sends it as JSON, and the worker turns
it back into the same dataclass before it runs. Unknown kinds and unknown fields are refused on both sides, so a
misspelled field is an error, not a silently ignored key.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from .defaults import CONTEXT, RUN, SOAK, TRACE
from .errors import ConfigError
from .params import ContextParams, Placement, as_context, as_placement

Test = list   # ["pp", n] or ["tg", n] or [kind, n, depth] (llama-bench's -d)


def depth_of(test: Test) -> int:
    """Tokens already in the context before a test ([kind, n] or [kind, n, depth], llama-bench's -d)."""
    return int(test[2]) if len(test) > 2 else 0


def test_name(test: Test) -> str:
    """A test as llama-bench names it: pp512, tg32, "tg32 @ d1024"."""
    return f"{test[0]}{int(test[1])}" + (f" @ d{depth_of(test)}" if depth_of(test) else "")


@dataclass
class Job:
    """Fields every job has. `model` is a GGUF path (not needed by `info`)."""

    kind: ClassVar[str] = ""
    variant: str = CONTEXT.variant
    model: Optional[str] = None
    devices: Union[str, dict] = CONTEXT.devices      # a device spec, or its dict form (devices.DeviceSpec.to_dict)
    placement: Placement = field(default_factory=Placement)
    ctx: ContextParams = field(default_factory=ContextParams)
    switches: dict = field(default_factory=dict)     # the patched build's switches, NAME -> value
    plan: Optional[dict] = None                       # a fit plan (fit.Plan.to_dict()): devices, placement, context

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["placement"], d["ctx"] = self.placement.to_dict(), self.ctx.to_dict()
        d["kind"] = self.kind
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_dict(d: Union[dict, "Job"], variant: Optional[str] = None) -> "Job":
        """The job a dict describes ({"kind": ..., fields}); `variant` fills in or overrides its variant."""
        if isinstance(d, Job):
            return dataclasses.replace(d, variant=variant) if variant else d
        d = dict(d)
        kind = d.pop("kind", "measure")
        cls = KINDS.get(kind)
        if cls is None:
            raise ConfigError(f"unknown job kind {kind!r}; kinds: {', '.join(KINDS)}")
        if variant:
            d["variant"] = variant
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"a {kind} job has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(names))}")
        if "placement" in d:
            d["placement"] = as_placement(d["placement"])
        if "ctx" in d:
            d["ctx"] = as_context(d["ctx"])
        return cls(**d)

    def load_key(self) -> str:
        """Jobs with the same key can share one loaded model: the same variant, model, devices, placement, plan and
        switches (they may differ in context and tests)."""
        d = self.to_dict()
        return json.dumps([d[k] for k in ("variant", "model", "devices", "placement", "plan", "switches")],
                          sort_keys=True, default=str)


@dataclass
class InfoJob(Job):
    """The variant's extension version, switch table, system info and devices (no model)."""

    kind: ClassVar[str] = "info"


@dataclass
class ScheduleJob(Job):
    """Load, create the context and report the schedule (pipeline_parallel, copies, splits, buffers)."""

    kind: ClassVar[str] = "schedule"
    detail: bool = False


@dataclass
class LogitsJob(Job):
    """Decode `tokens` (or `n_tokens` random ones from `seed`) and save the logits to `out` (.npy)."""

    kind: ClassVar[str] = "logits"
    tokens: Optional[list] = None
    n_tokens: int = CONTEXT.n_tokens
    seed: int = CONTEXT.seed
    logits: str = "all"
    out: Optional[str] = None


@dataclass
class MeasureJob(Job):
    """llama-bench-like tests, each `warmup` untimed runs then `reps` timed runs. With `ctx_list` ([{"ctx", "tests"}])
    the model is loaded once and each entry gets a fresh context."""

    kind: ClassVar[str] = "measure"
    tests: list = field(default_factory=lambda: [["pp", n] for n in RUN.pp])
    reps: int = RUN.reps
    warmup: int = RUN.warmup   # untimed runs of each test first (0: a paired round of runner.interleaved, warmed up before)
    seed: int = CONTEXT.seed
    coverage: bool = True
    ctx_list: Optional[list] = None


@dataclass
class WorkloadJob(Job):
    """A mixed workload in one context: `rounds` times the `workload` steps ([kind, n]); `out` saves logits."""

    kind: ClassVar[str] = "workload"
    workload: list = field(default_factory=list)
    rounds: int = RUN.reps
    seed: int = CONTEXT.seed
    out: Optional[str] = None


@dataclass
class TraceJob(Job):
    """Record the experts each MoE layer chooses for each token: a prompt of `n_prompt` tokens, then `n_decode` tokens
    decoded one by one after it, the tokens chosen as a measure job's are (`seed`; a stream for a locality model).
    `capture` names f32 tensors to keep too (Session.trace_experts), written as arrays of that name into `capture_out`
    (.npz)."""

    kind: ClassVar[str] = "trace"
    n_prompt: int = TRACE.pp[0]
    n_decode: int = TRACE.tg[0]
    seed: int = TRACE.seed
    capture: list = field(default_factory=list)
    capture_out: str = ""

    def check(self) -> None:
        """The job's own checks, before any model load (the parent's and the worker's).

        Raises:
            ConfigError: for negative counts, no token at all, or more tokens than the context holds.
        """
        n_prompt, n_decode = int(self.n_prompt), int(self.n_decode)
        if n_prompt < 0 or n_decode < 0 or n_prompt + n_decode == 0:
            raise ConfigError(f"a trace needs prompt and decode tokens >= 0, not both 0; got {n_prompt} and "
                              f"{n_decode}")
        if n_prompt + n_decode > self.ctx.n_ctx:
            raise ConfigError(f"{n_prompt} + {n_decode} tokens do not fit in n_ctx={self.ctx.n_ctx}: raise the "
                              "context size")
        if self.capture and not self.capture_out:
            raise ConfigError("a trace that captures tensors needs capture_out (the .npz they are written to)")


@dataclass
class FitJob(Job):
    """Run the variant's fit (common/fit.cpp) for the model on the devices; per-device margins in bytes. With
    `measure`, no fit: the job's placement's memory per device, as fit's dry run measures a placement."""

    kind: ClassVar[str] = "fit"
    split_mode: str = CONTEXT.split_mode
    margins: list = field(default_factory=list)
    n_ctx_min: int = 0
    rates: list = field(default_factory=list)   # also measure: "links" (each device's host link), "host_copy"
    measure: bool = False   # no fit: the job's placement measured as it is (a run's own placement, without --fit)


@dataclass
class SoakJob(Job):
    """The soak job (run by pyllama_pp.soak.run, the soak tool's API): `calls` mixed calls in one context with checkpoints every `check_every` calls
    after `warmup` (0: auto), their logits compared with the reference's in `out` (.npz); with `reference`, only the
    checkpoint recipes, once each, in this fresh session, their logits written to `out`."""

    kind: ClassVar[str] = "soak"
    calls: int = SOAK.calls
    seed: int = CONTEXT.seed
    check_every: int = SOAK.check_every
    warmup: int = SOAK.warmup
    reference: bool = False
    out: Optional[str] = None


KINDS: dict[str, type] = {c.kind: c for c in (InfoJob, ScheduleJob, LogitsJob, MeasureJob, WorkloadJob, TraceJob, FitJob,
                                              SoakJob)}


def as_job(job: Union[Job, dict, Any], variant: Optional[str] = None) -> Job:
    """The job `job` describes (a Job, or its dict form), for `variant` when given.

    Raises:
        ConfigError: for an unknown kind or field, or a bad placement or context.
    """
    return Job.from_dict(job, variant)
