"""fit, as users call it: `fit` plans a placement (pyllama_pp.placement) and `fit_ubatch` chooses (n_batch, n_ubatch)
with it (pyllama_pp.planner), the compute of each candidate measured by the probe (pyllama_pp.compute.Probe, handed
in here). With the expert cache asked as auto (the patched build's default) both then weigh each device's memory
between resident expert layers and cache slots for the workload (pyllama_pp.memory_plan), with what a token costs
measured by the decode probe (pyllama_pp.decode_probe) and the hit rates of pyllama_pp.hit_curve. Prediction is
pyllama_pp.predict's and pyllama_pp.decode_model's; each mechanism's plan is its own module (overlap_plan,
layer_major_plan, expert_cache_plan).

>>> plan = fit("tiny.gguf", devices="vdev:2x24MiB@4GBps", ctx=ContextParams(n_ctx=512, n_ubatch=128))
>>> print(plan)
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from statistics import median
from typing import Callable, Optional

from tqdm import tqdm

from . import placement, planner, switches
from .compute import Probe
from .decode_probe import decode_costs
from .defaults import CONTEXT, FIT, UBATCH_MEASURE
from .expert_cache_plan import drop_cache, layout_of
from .hit_curve import HitCurve
from .jobs import MeasureJob
from .layer_major_plan import layer_major_group, plan_layer_major, wants_layer_major
from .memory_plan import plan_memory
from .model_file import layer_counts
from .errors import OutOfMemoryError, PyllamaError
from .params import Placement
from .plan import MiB, Plan
from .placement import measure as measure_placement
from .switches import set_in
from .workload import Workload
from .worker.client import run_job


def _weigh(plan: Plan, model, devices, workload, curve, load_mode: str, n_threads: int, progress: bool,
           refit: Optional[Callable[[int], Plan]]) -> Plan:
    """The plan with its memory weighed between resident expert layers and cache slots, where the cache was asked as
    auto (curve: the trace's hit rates, None: the model's own or the prior); as it is elsewhere. refit None: the
    placement is the user's (no layer moves; no room for a token's slots: no probe)."""
    if plan.variant != "patched" or plan.expert_cache != "auto" or not plan.n_expert:
        return plan
    wl = Workload.parse(workload)

    def none(why: str) -> Plan:
        out = drop_cache(plan)
        out.memory_plan = {"workload": {"name": wl.name, "steps": wl.as_list()}, "why": f"no cache: {why}",
                           "alternatives": []}
        return out
    if not wl.decode_tokens or not any(plan.host_expert_layers):
        return none("the workload decodes no token" if not wl.decode_tokens else "every expert layer is resident")
    layout = layout_of(model, plan.n_expert)
    if refit is None and not _has_room(plan, layout):   # (no layer moves for room: nothing to probe for)
        room = "/".join(f"{(d.target_bytes - d.expected_bytes) / MiB:.1f}" for d in plan.devices)
        return none(f"no room: the placement leaves {room} MiB free on the devices (their target less what the dry "
                    f"run measured), and {layout.n_used} slots a layer (a token's experts) need "
                    f"{_least_bytes(plan, layout) / MiB:.1f} MiB on a device with host-expert layers")
    try:
        costs = decode_costs(model, devices, n_threads=n_threads, load_mode=load_mode, progress=progress)
    except PyllamaError as e:   # (a replica that cannot run there, e.g. on a small RPC server: nothing to weigh by)
        return none(f"the decode probe could not run ({str(e).splitlines()[0]})")
    return plan_memory(plan, layout, costs, curve or HitCurve.for_model(model), wl, refit, load_mode,
                       layer_counts(model)[1])


def _has_room(plan: Plan, layout) -> bool:
    """Whether some device with host-expert layers has room beside the placement for a token's slots a layer."""
    return any(layout.most_slots(d.target_bytes - d.expected_bytes, d.host_expert_layers) >= max(1, layout.n_used)
               for d in plan.devices if d.host_expert_layers)


def _least_bytes(plan: Plan, layout) -> int:
    """The fewest bytes a token's slots a layer take on a device of the plan with host-expert layers."""
    return min(layout.bytes_of(max(1, layout.n_used), d.host_expert_layers) for d in plan.devices
               if d.host_expert_layers)


def plan_on_placement(model, devices, placement: Placement, ctx, *, workload=None, trace=None, margin=None,
                      env=None, switches=None, load_mode: str = CONTEXT.load_mode, progress: bool = False,
                      cache: bool = True) -> Plan:
    """The patched build's switches that take device memory, planned on a placement the user gave (run / ab without a
    fit) as fit plans them, with no layer moved: one dry run of the placement (pyllama_pp.placement.measure) for each
    device's room; LAYER_MAJOR first, by fit's rule (where the switches do not set it, expert layers are in host RAM
    and the workload's prompts form groups), on where a second dry run with it stays within every device's target
    (free less the margin); then the expert cache in the room left after the groups: the decode probe's costs and the
    hit curve, the alternatives no cache and the slot counts that room holds, the fastest for the workload (a cache
    only where it saves GAIN_MIN), its guard from the costs, EXPERT_HYBRID where it gains.

    Args:
        model: the GGUF file.
        devices: the device spec.
        placement: the run's placement (it is not changed).
        ctx: the run's context.
        workload: what the run does (a Workload, a name of defaults.WORKLOADS, "pp=N,tg=N"; default: FIT's).
        trace: a trace of the model's decode for the hit rates, as fit takes it.
        margin: memory left free per device, as fit takes it.
        env, switches: the run's environment and switches (the dry runs measure with them).
        load_mode: the run's load mode.
        progress: say what the decode probe measures.
        cache: plan the expert cache (False: the user set it; LAYER_MAJOR alone).
    Returns:
        Plan: path "given"; layer_major where LAYER_MAJOR was tried (on: the switch, its group and bytes; off: why),
        memory_plan where the cache was weighed (the alternatives, the choice and why); the switches chosen in
        Plan.run_switches (LAYER_MAJOR; EXPERT_CACHE, its guard and EXPERT_HYBRID).
    Raises:
        As pyllama_pp.placement.measure; ConfigError for a bad workload or trace.
    """
    wl = Workload.parse(workload)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace
    given = dict(switches or {})
    dry_run = lambda sw: measure_placement(model, devices, placement, ctx, margin=margin, env=env, switches=sw)
    plan = dry_run(given)
    plan, off = _with_layer_major(plan, wl, lambda sw: _within_targets(dry_run(sw), sw, plan),
                                  {**set_in(env), **given}, "on: the run's prompts form groups, and their memory "
                                  "fits beside the placement")
    if off:
        plan.layer_major = {"switch": 0, "why": f"off: {off}"}
    if not cache:
        return plan
    plan.expert_cache = "auto"   # (weighed as auto is: no slots in it yet)
    return _weigh(plan, model, devices, wl, curve, load_mode, plan.context_params().n_threads, progress, None)


def _within_targets(lm: Plan, force: dict, without: Plan) -> Plan:
    """A placement's dry run with LAYER_MAJOR (`force`: its switches) as its plan: the switch, the group and each
    device's group bytes over the dry run `without` it (plan_layer_major). No layer may move, so where a device's
    total passes its target (free less the margin) the groups do not fit: OutOfMemoryError naming each such device."""
    plan_layer_major(lm, force, lambda extra: without)
    over = [(d, b) for d, b in zip(lm.devices, without.devices) if d.expected_bytes > d.target_bytes]
    if over:
        raise OutOfMemoryError("; ".join(
            f"{d.name} would hold {d.expected_bytes / MiB:.1f} MiB with a group's buffers ({b.expected_bytes / MiB:.1f} "
            f"without them), over its {d.target_bytes / MiB:.1f} MiB (free less the margin)" for d, b in over)
            + ". Fix: --fit (it moves expert layers for the room), or a smaller -b (smaller groups)")
    return lm


def _with_layer_major(plan: Plan, workload: Workload, place: Callable[[dict], Plan], given: dict,
                      why: str) -> tuple[Plan, str]:
    """LAYER_MAJOR where the user did not set it, by wants_layer_major's rule: on where the workload's prompts form
    groups of ubatches (two or more a batch) over host-expert layers and `place`, which makes the plan again with more
    switches, places the groups with the same host-expert layers (fit: their memory costs no resident expert layer;
    where it does, prompts upload those layers' experts once a group, decode computes them on the host: measured
    slower) and an OutOfMemoryError where they do not fit. Returns the plan (`why` in its layer_major where the
    switch is on) and why the switch stayed off after a trial ("" where it is on or was not tried)."""
    host = any(plan.host_expert_layers)   # (given: the switches and the environment's GGML_SCHED_PP_* variables)
    if not wants_layer_major(plan.variant, given, host, workload, plan.ctx["n_batch"], plan.ctx["n_ubatch"]):
        return plan, ""
    try:
        lm = place({**given, switches.LAYER_MAJOR: 1})
    except OutOfMemoryError as e:
        return plan, f"its groups' memory has no room: {str(e).splitlines()[0]}"
    if lm.host_expert_layers != plan.host_expert_layers:
        return plan, "its groups' memory would move expert layers to host RAM"
    if layer_major_group(lm) < 2:
        return plan, "no group forms here (op offload off)"
    lm.layer_major["why"] = why
    return lm, ""


def fit(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, *, workload=None, trace=None,
        load_mode: str = CONTEXT.load_mode, progress: bool = False, **kw) -> Plan:
    """pyllama_pp.placement.fit; then for the patched build, LAYER_MAJOR where the workload's prompts gain from it
    and it costs no resident layer (unless switches set it), and (expert cache auto, the default) each device's memory
    weighed between resident expert layers and the cache's slots for the workload (pyllama_pp.memory_plan).

    Args:
        model, devices, ctx, variant, **kw: as pyllama_pp.placement.fit takes them (margin, expert_cache, switches, ...).
        workload: what the plan is for: a Workload, a name of defaults.WORKLOADS or "pp=N,tg=N" (default: FIT's).
        trace: a trace of the model's decode (`pyllama-pp trace` writes it) for the cache's hit rates (default: a
            synthetic model's own routing, else the published prior, pyllama_pp.hit_curve).
        load_mode: how the run keeps host weights ("mmap": the cache's misses cross the pageable link).
        progress: say what the decode probe measures.
    Returns:
        Plan: the plan (with memory_plan where the cache was weighed).
    Raises:
        As pyllama_pp.placement.fit; ConfigError for a bad workload or trace.
    """
    wl = Workload.parse(workload)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace   # (a bad trace: an error before any run)
    given = dict(kw.pop("switches", None) or {})
    plan = placement.fit(model, devices, ctx, variant, switches=given, **kw)
    pinned = dataclasses.replace(placement.fit_context(ctx), n_ctx=plan.n_ctx)   # (fit chose it: keep it)
    plan, _ = _with_layer_major(plan, wl, lambda sw: placement.fit(model, devices, pinned, variant, switches=sw, **kw),
                                {**switches.set_in(kw.get("env")), **given}, "on: the workload's prompts form groups "
                                "and their memory costs no resident expert layer")
    given = {**given, **({switches.LAYER_MAJOR: 1} if plan.switches.get(switches.LAYER_MAJOR) else {})}
    refit = lambda mib: placement.fit(model, devices, pinned, variant, switches=given,
                                      **{**kw, "expert_cache": f"{mib}MiB"})
    n_threads = placement.fit_context(ctx).n_threads
    return _weigh(plan, model, devices, wl, curve, load_mode, n_threads, progress, refit)


def measure_prompts(plans: list[Plan], model, devices, n_tokens: int, load_mode: str, env=None,
                    timeout=FIT.timeout, progress: bool = False) -> list[float]:
    """Each plan's prompt measured as it runs: UBATCH_MEASURE's untimed then timed prompts of n_tokens (at most the
    plan's context), the decode cache left out (fit weighs it after the pair). Plans with the same placement and
    switches share one load (a fresh context each).

    Args:
        plans: fit_ubatch's plans (each with its pair and switches).
        model, devices: the model and device spec they were made for.
        n_tokens: the prompt's length.
        load_mode: how the runs keep host weights ("none": pinned, "mmap").
        env: more environment for the runs' workers (fit's env).
        timeout: seconds one load's runs may take.
        progress: a progress bar on stderr.
    Returns:
        Each plan's prompt t/s (the median of its timed runs; 0 where its context failed).
    Raises:
        WorkerError: when a load fails (its worker's error: ModelError, OutOfMemoryError, ...).
    """
    loads: dict = {}
    for i, p in enumerate(plans):
        run = drop_cache(copy.deepcopy(p))
        n = min(n_tokens, run.n_ctx)
        job = MeasureJob(variant=run.variant, model=str(model), devices=devices, placement=run.placement(load_mode),
                         ctx=run.context_params(), switches=run.run_switches(load_mode), tests=[["pp", n]],
                         reps=UBATCH_MEASURE.reps, warmup=UBATCH_MEASURE.warmup, coverage=False)
        loads.setdefault(job.load_key(), []).append((i, job))
    out = [0.0] * len(plans)
    for same in tqdm(loads.values(), desc="--ubatch auto: measuring", unit="load", file=sys.stderr,
                     disable=not progress, leave=False):
        job = dataclasses.replace(same[0][1], ctx_list=[{"ctx": j.ctx.to_dict(), "tests": j.tests} for _, j in same])
        runs = run_job(job, job.variant, timeout=timeout, env=env)["runs"]
        for (i, j), r in zip(same, runs):
            if "tests" in r:
                out[i] = j.tests[0][1] / median(r["tests"][0]["seconds"])
    return out


def _measured_best(best: Plan, near: list[Plan], measure: Callable, most: int) -> Plan:
    """Of `best` and the candidates predicted close to it (`near`, both searches': with and without LAYER_MAJOR), the
    `most` closest measured with measure(plans) -> t/s each, and the fastest measured returned, every measured pair
    in its ubatch_measured; `best` where there is nothing to measure."""
    bar = (1 - UBATCH_MEASURE.band) * (best.predicted_ts or 0)
    pick = [best] + sorted((p for p in near if p is not best and (p.predicted_ts or 0) >= bar),
                           key=lambda p: -p.predicted_ts)[:max(0, most - 1)]
    if len(pick) < 2 or not best.predicted_ts:
        return best
    got = measure(pick)
    if max(got) <= 0:   # (no context ran: the prediction decides)
        return best
    rows = [{"n_ubatch": p.ctx["n_ubatch"], "n_batch": p.ctx["n_batch"], "layer_major": int(bool(p.layer_major)),
             "predicted_ts": p.predicted_ts, "measured_ts": ts} for p, ts in zip(pick, got)]
    won = pick[max(range(len(pick)), key=lambda i: got[i])]
    won.ubatch_measured = rows
    return won


def fit_ubatch(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, *, workload=None, trace=None,
               measure: int = UBATCH_MEASURE.most, **kw) -> Plan:
    """pyllama_pp.planner.fit_ubatch with the compute probe (pyllama_pp.compute.Probe); for the patched build where
    switches do not set LAYER_MAJOR, the search with it too; then the candidates of both predicted within
    UBATCH_MEASURE.band of the best run as planned (at most `measure`, the best included) and the fastest measured
    taken; then, expert cache auto, the memory weighed for the workload at the chosen pair (as fit does).

    Args:
        model, devices, ctx, variant, **kw: as pyllama_pp.planner.fit_ubatch takes them (n_tokens, n_batch, margin,
            switches, load_mode, count_compute, progress, ...).
        workload, trace: as fit takes them.
        measure: how many of the closest predictions to run, at most UBATCH_MEASURE.most (0 or 1: the prediction
            alone decides; nothing is measured where compute is not counted).
    Returns:
        Plan: the chosen pair's plan; ubatch_measured holds what was measured.
    Raises:
        As pyllama_pp.planner.fit_ubatch; WorkerError where a measured run fails.
    """
    kw.setdefault("probe", Probe)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace   # (a bad trace: an error before any run)
    given = dict(kw.pop("switches", None) or {})
    measuring = measure >= 2 and kw.get("count_compute", True) and kw["probe"] is not None
    near: list[Plan] = []
    contenders = near if measuring else None   # (each made final costs a dry run: only those to be measured)
    plan = planner.fit_ubatch(model, devices, ctx, variant, switches=given, contenders=contenders, **kw)
    if variant == "patched" and switches.LAYER_MAJOR not in {**switches.set_in(kw.get("env")), **given} and \
            any(plan.host_expert_layers):
        # (-ub auto weighs LAYER_MAJOR too: the pair predicted fastest with its groups against the one without)
        try:
            lm = planner.fit_ubatch(model, devices, ctx, variant, switches={**given, switches.LAYER_MAJOR: 1},
                                    contenders=contenders, **kw)
        except OutOfMemoryError:
            lm = None
        if lm is not None:
            lm.layer_major["why"] = (f"on: predicted {lm.predicted_ts or 0:.0f} t/s against "
                                     f"{plan.predicted_ts or 0:.0f} without it")
            first, other = (lm, plan) if (lm.predicted_ts or 0) > (plan.predicted_ts or 0) else (plan, lm)
            plan, near = first, near + [other]
    load_mode = kw.get("load_mode", CONTEXT.load_mode)
    if measuring:
        plan = _measured_best(plan, near, functools.partial(
            measure_prompts, model=model, devices=devices, n_tokens=kw.get("n_tokens") or plan.n_ctx,
            load_mode=load_mode, env=kw.get("env"), timeout=kw.get("timeout") or FIT.timeout,
            progress=kw.get("progress", False)), measure)
        off = [r["measured_ts"] for r in plan.ubatch_measured if not r["layer_major"]]
        if plan.layer_major.get("why") and off:   # (LAYER_MAJOR weighed here, and measured against a pair without)
            plan.layer_major["why"] = (f"on: measured {max(r['measured_ts'] for r in plan.ubatch_measured):.0f} t/s "
                                       f"against {max(off):.0f} without it")
    kw["switches"] = {**given, **({switches.LAYER_MAJOR: 1} if plan.switches.get(switches.LAYER_MAJOR) else {})}
    fit_kw = {k: v for k, v in kw.items() if k in ("margin", "split_mode", "env", "timeout", "spread", "link_gbps",
                                                 "switches")}
    chosen = dataclasses.replace(placement.fit_context(ctx), n_ctx=plan.n_ctx, n_batch=plan.ctx["n_batch"],
                                 n_ubatch=plan.ctx["n_ubatch"])

    def refit(mib: int) -> Plan:
        out = placement.fit(model, devices, chosen, variant, expert_cache=f"{mib}MiB", **fit_kw)
        out.ubatch_auto, out.ubatch_measured = plan.ubatch_auto, plan.ubatch_measured   # (its predicted_ts was the
        return out   # pair's with fewer host-expert layers: the alternatives say what the moved layers add to prompts)
    return _weigh(plan, model, devices, workload, curve, load_mode, chosen.n_threads,
                  kw.get("progress", False), refit)


__all__ = ["fit", "fit_ubatch", "plan_on_placement"]
