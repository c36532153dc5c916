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

import dataclasses
import functools
from typing import Callable

from . import placement, planner, switches
from .compute import Probe
from .decode_probe import decode_costs
from .defaults import CONTEXT, FIT
from .expert_cache_plan import drop_cache, layout_of
from .hit_curve import HitCurve
from .layer_major_plan import layer_major_group
from .memory_plan import plan_memory
from .model_file import layer_counts
from .errors import OutOfMemoryError, PyllamaError
from .plan import Plan
from .workload import Workload


def _weigh(plan: Plan, model, devices, workload, curve, load_mode: str, n_threads: int, progress: bool,
           refit: Callable[[int], Plan]) -> Plan:
    """The plan with its memory weighed between resident expert layers and cache slots, where the cache was asked as
    auto (curve: the trace's hit rates, None: the model's own or the prior); as it is elsewhere."""
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
    try:
        costs = decode_costs(model, devices, n_threads=n_threads, load_mode=load_mode, progress=progress)
    except PyllamaError as e:   # (a replica that cannot run there, e.g. on a small RPC server: nothing to weigh by)
        return none(f"the decode probe could not run ({str(e).splitlines()[0]})")
    return plan_memory(plan, layout_of(model, plan.n_expert), costs, curve or HitCurve.for_model(model), wl, refit,
                       load_mode, layer_counts(model)[1])


def _with_layer_major(plan: Plan, workload: Workload, place: Callable[[dict], Plan], given: dict) -> Plan:
    """LAYER_MAJOR, where the user did not set it: on where the workload's prompts form groups of ubatches (two or
    more a batch) over host-expert layers and the groups' memory costs no resident expert layer (where it does,
    prompts upload those layers' experts once a group, decode computes them on the host: measured slower); else the
    plan as it is. `place` makes the plan again with more switches."""
    if plan.variant != "patched" or switches.LAYER_MAJOR in given or not any(plan.host_expert_layers):
        return plan   # (given: the switches and the environment's GGML_SCHED_PP_* variables)
    per_batch = min(plan.ctx["n_batch"], max((n for k, n in workload.steps if k == "pp"), default=0))
    if per_batch < 2 * plan.ctx["n_ubatch"]:
        return plan
    try:
        lm = place({**given, switches.LAYER_MAJOR: 1})
    except OutOfMemoryError:
        return plan   # (its groups' memory leaves the model no placement)
    if lm.host_expert_layers != plan.host_expert_layers or layer_major_group(lm) < 2:
        return plan   # (its groups' memory would move expert layers to host RAM)
    lm.layer_major["why"] = "on: the workload's prompts form groups and their memory costs no resident expert layer"
    return lm


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
    plan = _with_layer_major(plan, wl, lambda sw: placement.fit(model, devices, pinned, variant, switches=sw, **kw),
                             {**switches.set_in(kw.get("env")), **given})
    given = {**given, **({switches.LAYER_MAJOR: 1} if plan.switches.get(switches.LAYER_MAJOR) else {})}
    refit = lambda mib: placement.fit(model, devices, pinned, variant, switches=given,
                                      **{**kw, "expert_cache": f"{mib}MiB"})
    n_threads = placement.fit_context(ctx).n_threads
    return _weigh(plan, model, devices, wl, curve, load_mode, n_threads, progress, refit)


@functools.wraps(planner.fit_ubatch)
def fit_ubatch(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, *, workload=None, trace=None,
               **kw) -> Plan:
    kw.setdefault("probe", Probe)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace   # (a bad trace: an error before any run)
    given = dict(kw.pop("switches", None) or {})
    plan = planner.fit_ubatch(model, devices, ctx, variant, switches=given, **kw)
    if variant == "patched" and switches.LAYER_MAJOR not in {**switches.set_in(kw.get("env")), **given} and \
            any(plan.host_expert_layers):
        # (-ub auto weighs LAYER_MAJOR too: the pair predicted fastest with its groups against the one without)
        try:
            lm = planner.fit_ubatch(model, devices, ctx, variant, switches={**given, switches.LAYER_MAJOR: 1}, **kw)
        except OutOfMemoryError:
            lm = None
        if lm is not None and (lm.predicted_ts or 0) > (plan.predicted_ts or 0):
            lm.layer_major["why"] = (f"on: predicted {lm.predicted_ts:.0f} t/s against {plan.predicted_ts or 0:.0f} "
                                     "without it")
            plan = lm
    kw["switches"] = {**given, **({switches.LAYER_MAJOR: 1} if plan.switches.get(switches.LAYER_MAJOR) else {})}
    fit_kw = {k: v for k, v in kw.items() if k in ("margin", "split_mode", "env", "timeout", "spread", "link_gbps",
                                                 "switches")}
    chosen = dataclasses.replace(placement.fit_context(ctx), n_ctx=plan.n_ctx, n_batch=plan.ctx["n_batch"],
                                 n_ubatch=plan.ctx["n_ubatch"])

    def refit(mib: int) -> Plan:
        out = placement.fit(model, devices, chosen, variant, expert_cache=f"{mib}MiB", **fit_kw)
        out.ubatch_auto = plan.ubatch_auto   # (its predicted_ts was the pair's with fewer host-expert layers: the
        return out                           # alternatives say what the moved layers add to prompts)
    return _weigh(plan, model, devices, workload, curve, kw.get("load_mode", CONTEXT.load_mode), chosen.n_threads,
                  kw.get("progress", False), refit)


__all__ = ["fit", "fit_ubatch"]
