"""A/B configurations: one point of the test matrix (`RunConfig`: model, devices, placement, batch sizes, tests,
switches), crossed like llama-bench's comma-separated values (`expand`), and what decides that two configurations
measure the same thing (`config_key`) or can share one model load (`load_key`)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from . import devices as devspec
from .defaults import CONTEXT, RUN
from .devices import check_baseline_devices
from .errors import ConfigError
from .jobs import MeasureJob, depth_of
from .params import ContextParams, Placement, as_placement, check_int, ctx_for

TEST_KINDS = ("pp", "tg")


def check_tests(tests) -> list:
    """Tests as lists [kind, n] or [kind, n, depth]: kind "pp" or "tg", n >= 1, depth >= 0.

    Raises:
        ConfigError: naming the test that is not of that form (e.g. "pp512" instead of ["pp", 512]).
    """
    if isinstance(tests, (str, bytes)) or not isinstance(tests, (list, tuple)) or not tests:
        raise ConfigError(f"tests takes a non-empty list of [kind, n] or [kind, n, depth] (e.g. [['pp', 512]]), "
                          f"not {tests!r}")
    out = []
    for t in tests:
        if not isinstance(t, (list, tuple)) or len(t) not in (2, 3) or t[0] not in TEST_KINDS:
            raise ConfigError(f"tests: {t!r} is not [kind, n] or [kind, n, depth] with kind pp or tg "
                              "(e.g. ['pp', 512], ['tg', 32, 1024])")
        out.append([t[0], check_int(f"tests: {t!r}: n", t[1], 1)] +
                   ([check_int(f"tests: {t!r}: depth", t[2], 0)] if len(t) == 3 else []))
    return out


@dataclass(frozen=True)
class RunConfig:
    """One point of the test matrix; both variants run it (the A/B runner, pyllama_pp.runner). Frozen: a change is a
    new config (`dataclasses.replace`). Defaults: pyllama_pp.defaults.RUN.

    Args:
        model: the GGUF file.
        devices: a device spec (pyllama_pp.devices): "cpu", "cuda:0,1", "vdev:2x768MiB@4GBps", ...
        n_batch, n_ubatch: llama's batch sizes (n_ubatch above n_batch runs at n_batch).
        n_ctx: 0: enough for the longest test.
        placement: where the weights go (default: every expert in host RAM).
        tests: [kind, n] or [kind, n, depth] each (llama-bench's -p / -n / -d).
        reps: timed repetitions per test (after one untimed).
        flash_attn: llama's flash-attention mode.
        switches: the patched build's switches (GGML_SCHED_PP_*), NAME -> value.
        env: environment for both variants' workers (e.g. GGML_OP_OFFLOAD_MIN_BATCH).
        label: a free-form name carried into the rows.
        link_gbps: each device's host link in GB/s, for devices that do not say (CUDA): gives the rows a bound.
        shared_link: all devices share one link (one GPU split in two).
        plans: variant -> Placement from a fit plan (run/ab --plan, --fit); a variant without one runs `placement`.
        baseline_devices: for RPC devices, the baseline's own servers on the same hosts, in the same order ("": the
            same devices). Upstream's client speaks RPC protocol 7.0 and refuses the patched servers (7.1), so an A/B
            over RPC needs a server of each variant per host.
        notes: what planning says of the patched runs (the expert cache planned on this placement without a fit, or
            why none); their rows carry them.
    Raises:
        ConfigError: for tests, batch sizes, reps or link rates out of range, or switches / env that are not dicts.
        DeviceSpecError: for a link rate that is not a rate ("4GBps", a number).
        TypeError: for a placement or plan that is neither a Placement nor a dict.
    """

    model: str
    devices: str = RUN.devices
    n_batch: int = RUN.n_batch
    n_ubatch: int = RUN.n_ubatch
    n_ctx: int = RUN.n_ctx
    placement: Placement = field(default_factory=lambda: Placement(host_experts=RUN.host_experts))
    tests: list = field(default_factory=lambda: [["pp", n] for n in RUN.pp])
    reps: int = RUN.reps
    flash_attn: int = CONTEXT.flash_attn
    switches: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    label: str = ""
    link_gbps: Optional[list] = None
    shared_link: bool = False
    plans: dict = field(default_factory=dict)
    baseline_devices: str = ""
    notes: tuple = ()

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        set_("model", str(self.model))
        set_("devices", json.dumps(self.devices) if isinstance(self.devices, dict) else str(self.devices))
        check_int("n_batch", self.n_batch, 1)
        check_int("n_ubatch", self.n_ubatch, 1)
        check_int("n_ctx", self.n_ctx, 0)
        check_int("reps", self.reps, 1)
        set_("tests", check_tests(self.tests))
        set_("placement", as_placement(self.placement))
        set_("plans", {v: as_placement(p) for v, p in self.plans.items()})
        set_("notes", tuple(self.notes))
        if not isinstance(self.switches, dict) or not isinstance(self.env, dict):
            raise ConfigError("switches and env take dicts, NAME -> value")
        if self.baseline_devices:
            check_baseline_devices(self.devices, self.baseline_devices)
        if self.link_gbps is not None:
            if not isinstance(self.link_gbps, (list, tuple)):
                raise ConfigError(f"link_gbps takes a list of rates, one per device (e.g. [55, 55]), not {self.link_gbps!r}")
            rates = [devspec.parse_rate(x) for x in self.link_gbps]
            if any(r <= 0 for r in rates):
                raise ConfigError(f"link_gbps: every rate must be > 0, got {self.link_gbps!r}")
            set_("link_gbps", rates)

    def placement_for(self, variant: str) -> Placement:
        """The placement a variant runs.

        Args:
            variant: "patched" or "baseline".
        Returns:
            Placement: the variant's plan's, else the configuration's `placement`.
        """
        return self.plans.get(variant, self.placement)

    def devices_for(self, variant: str) -> str:
        """The device spec a variant runs on.

        Args:
            variant: "patched" or "baseline".
        Returns:
            str: baseline_devices for the baseline where given, else `devices`.
        """
        return self.baseline_devices if variant == "baseline" and self.baseline_devices else self.devices

    def context(self) -> ContextParams:
        """The context every test of this configuration runs in.

        Returns:
            ContextParams: n_ctx (given, else enough for the longest test), n_batch, n_ubatch (at most n_batch) and
            flash_attn.
        """
        longest = max(int(t[1]) + depth_of(t) for t in self.tests) + 8
        return ContextParams(n_ctx=ctx_for(longest, self.n_ctx), n_batch=self.n_batch,
                             n_ubatch=min(self.n_ubatch, self.n_batch), flash_attn=self.flash_attn)

    def job(self, variant: str = CONTEXT.variant, **fields) -> MeasureJob:
        """The worker job that runs this configuration on a variant.

        Args:
            variant: "patched" (default) or "baseline"; the switches go to the patched build only.
            **fields: MeasureJob fields to set or override (reps, warmup, coverage, ctx_list, ...).
        Returns:
            MeasureJob: the job.
        Raises:
            TypeError: for a name that is not a MeasureJob field.
        """
        base = dict(variant=variant, model=self.model, devices=self.devices_for(variant),
                    placement=self.placement_for(variant),
                    ctx=self.context(), tests=[list(t) for t in self.tests], reps=self.reps,
                    switches=dict(self.switches) if variant == "patched" else {})
        return MeasureJob(**{**base, **fields})

    def to_dict(self) -> dict:
        """The configuration as JSON-ready data; RunConfig(**d) makes it again.

        Returns:
            dict: the fields, placements as dicts.
        """
        d = dataclasses.asdict(self)
        d["placement"] = self.placement.to_dict()
        d["plans"] = {v: p.to_dict() for v, p in self.plans.items()}
        return d


def expand(model: str, devices: Sequence[str] = (RUN.devices,), n_batch: Sequence[int] = (RUN.n_batch,),
           n_ubatch: Sequence[int] = (RUN.n_ubatch,),
           placements: Sequence[Placement] = (Placement(host_experts=RUN.host_experts),),
           **common) -> list[RunConfig]:
    """Cross the given lists like llama-bench's comma-separated values: one RunConfig per combination.

    Args:
        model: the GGUF file.
        devices: device specs, one per point.
        n_batch: n_batch values.
        n_ubatch: n_ubatch values; a pair with n_ubatch > n_batch is left out.
        placements: Placements (or their dicts).
        **common: more RunConfig fields, the same for every point (tests, reps, switches, env, label, ...).
    Returns:
        list[RunConfig]: devices x n_batch x n_ubatch x placements, in that nesting order.
    Raises:
        ConfigError: for values out of range (RunConfig's checks).
        DeviceSpecError: for a link rate that is not a rate.
        TypeError: for a name in `common` that is not a RunConfig field, or a placement of the wrong type.
    """
    out = []
    for dev, nb, nub, pl in itertools.product(devices, n_batch, n_ubatch, placements):
        if nub > nb:
            continue
        out.append(RunConfig(model=model, devices=dev, n_batch=nb, n_ubatch=nub, placement=pl, **common))
    return out


def config_key(cfg: RunConfig) -> str:
    """What a config measures (model, devices, placements, batch sizes, tests, reps, switches, environment, label) as
    a short hash: rows with the same key and variant measure the same thing (a resumed sweep reuses them). The model
    counts as the file it names, however its path was written (relative to any working directory, or absolute)."""
    what = [{**cfg.job().to_dict(), "model": str(Path(cfg.model).resolve())}, {v: p.to_dict() for v, p in sorted(cfg.plans.items())}, cfg.switches, cfg.env,
            cfg.label] + ([cfg.baseline_devices] if cfg.baseline_devices else [])
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_key(cfg: RunConfig) -> str:
    """Configs with the same key can share one loaded model per variant (they differ only in context and tests)."""
    return json.dumps([cfg.job().load_key(), {v: p.to_dict() for v, p in sorted(cfg.plans.items())}, cfg.env,
                       cfg.baseline_devices], sort_keys=True, default=str)
