"""fit, as users call it: `fit` plans a placement (pyllama_pp.placement) and `fit_ubatch` chooses (n_batch, n_ubatch)
with it (pyllama_pp.planner), the compute of each candidate measured by the probe (pyllama_pp.compute.Probe, handed
in here). With the expert cache asked as auto (the patched build's default) both then weigh each device's memory
between resident expert layers and cache slots for the workload (pyllama_pp.memory_plan), with what a token costs
measured by the decode probe (pyllama_pp.decode_probe) and the hit rates of pyllama_pp.hit_curve; where the workload
both prompts in groups and decodes, LAYER_MAJOR's groups are weighed against the slots their room would hold (the
prompts' link time as pyllama_pp.planner.prompt_seconds predicts it, against the memory plan's choice). Prediction is
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
from .memory_plan import GAIN_MIN, alternatives, choose, plan_memory, refill_free
from .model_file import layer_counts
from .errors import ConfigError, OutOfMemoryError, PyllamaError
from .params import Placement
from .plan import MiB, Plan
from .placement import measure as measure_placement
from .switches import user_set
from .workload import Workload
from .worker.client import run_job


#: the cache's switches the memory planner sets after its choice; one the user gave stays the user's in the plan
#: (and so in `run --plan`'s replay), as run and ab run it over a plan
_USER_WINS = (switches.EXPERT_CACHE_MIN_HIT, switches.EXPERT_HYBRID, switches.EXPERT_REFILL)


def _weigh(plan: Plan, model, devices, workload, curve, load_mode: str, n_threads: int, progress: bool,
           refit: Optional[Callable[[int], Plan]], probed: Optional[dict] = None, given: Optional[dict] = None) -> Plan:
    """The plan with its memory weighed between resident expert layers and cache slots, where the cache was asked as
    auto (curve: the trace's hit rates, None: the model's own or the prior); as it is elsewhere. refit None: the
    placement is the user's (no layer moves; no room for a token's slots: no probe). `probed`: the decode probe's
    costs (or its error), kept for another plan of the same model and devices. `given`: the user's switches (the
    guard's and the split's win over the planned values, _USER_WINS)."""
    out = _weighed(plan, model, devices, workload, curve, load_mode, n_threads, progress, refit, probed,
                   refill_free(given))
    kept = {k: v for k, v in (given or {}).items() if k in _USER_WINS and out.switches.get(switches.EXPERT_CACHE)}
    if kept and any(out.switches.get(k) != v for k, v in kept.items()):
        out = copy.copy(out)
        out.switches = {**out.switches, **kept}
    return out


def _refit_switches(given: dict, plan: Plan) -> dict:
    """The switches a plan's memory is placed again with (its refit for N MiB of cache): the user's, and LAYER_MAJOR
    where the plan took its groups (their buffers stay in the placement)."""
    return {**given, **({switches.LAYER_MAJOR: 1} if plan.switches.get(switches.LAYER_MAJOR) else {})}


def _weighed(plan: Plan, model, devices, workload, curve, load_mode: str, n_threads: int, progress: bool,
             refit: Optional[Callable[[int], Plan]], probed: Optional[dict], refill: bool = True) -> Plan:
    """_weigh's plan before the user's switches go over it (`refill`: memory_plan.refill_free)."""
    if plan.variant != "patched" or plan.expert_cache != "auto" or not plan.n_expert:
        return plan
    wl = Workload.parse(workload)
    got = _memory_inputs(plan, model, devices, wl, load_mode, n_threads, progress, refit is not None, probed)
    if isinstance(got, str):
        out = drop_cache(plan)
        out.memory_plan = {"workload": {"name": wl.name, "steps": wl.as_list()}, "why": f"no cache: {got}",
                           "alternatives": []}
        return out
    layout, costs = got
    return plan_memory(plan, layout, costs, curve or HitCurve.for_model(model), wl, refit, load_mode,
                       layer_counts(model)[1], refill)


def _priced(plan: Plan, model, devices, workload: Workload, curve, load_mode: str, n_threads: int, progress: bool,
            move: bool, probed: dict, refill: bool = True) -> Optional[tuple]:
    """What _weigh would choose for a plan, priced and not placed (the plan is not changed, no dry run): (the chosen
    Alternative, the no-cache one), or None where it weighs nothing (no cache, as _weigh says why). `refill`:
    memory_plan.refill_free."""
    got = _memory_inputs(plan, model, devices, workload, load_mode, n_threads, progress, move, probed)
    if isinstance(got, str):
        return None
    alts = alternatives(plan, got[0], got[1], curve or HitCurve.for_model(model), workload, load_mode,
                        layer_counts(model)[1], move, refill)
    return alts[choose(alts)[0]], alts[0]


def _memory_inputs(plan: Plan, model, devices, wl: Workload, load_mode: str, n_threads: int, progress: bool,
                   move: bool, probed: Optional[dict]):
    """What the memory planner weighs a plan by, (the model's slots, the decode probe's costs: measured once into
    `probed`), or why it weighs nothing (a str). move False: no layer may move (no room beside the placement for a
    token's slots: no probe)."""
    if not wl.decode_tokens or not any(plan.host_expert_layers):
        return "the workload decodes no token" if not wl.decode_tokens else "every expert layer is resident"
    layout = layout_of(model, plan.n_expert)
    if not move and not _has_room(plan, layout):   # (no layer moves for room: nothing to probe for)
        room = "/".join(f"{(d.target_bytes - d.expected_bytes) / MiB:.1f}" for d in plan.devices)
        return (f"no room: the placement leaves {room} MiB free on the devices (their target less what the dry run "
                f"measured), and {layout.n_used} slots a layer (a token's experts) need "
                f"{_least_bytes(plan, layout) / MiB:.1f} MiB on a device with host-expert layers")
    probed = {} if probed is None else probed
    if "costs" not in probed:
        try:
            probed["costs"] = decode_costs(model, devices, n_threads=n_threads, load_mode=load_mode, progress=progress)
        except PyllamaError as e:   # (a replica that cannot run there, e.g. on a small RPC server: nothing to weigh by)
            probed["costs"] = e
    if isinstance(probed["costs"], PyllamaError):
        return f"the decode probe could not run ({str(probed['costs']).splitlines()[0]})"
    return layout, probed["costs"]


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
    only where it saves GAIN_MIN), its guard from the costs, EXPERT_HYBRID where it gains. Where the groups fit and
    the workload decodes too, they are weighed against the slots their room would hold (_weighed_layer_major: the
    groups and the cache in what they leave, against no groups and the cache in the whole room; the first dry run is
    the second's, so no dry run more).

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
        Plan: path "given"; layer_major where LAYER_MAJOR was tried (on: the switch, its group and bytes; off: why;
        "weighed": both plans' predictions, where weighed against the cache), memory_plan where the cache was weighed
        (the alternatives, the choice and why); the switches chosen in Plan.run_switches (LAYER_MAJOR; EXPERT_CACHE,
        its guard, EXPERT_HYBRID and EXPERT_REFILL: switches.CACHE_SWITCHES).
    Raises:
        As pyllama_pp.placement.measure; ConfigError for a bad workload or trace.
    """
    wl = Workload.parse(workload)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace
    given = user_set(switches, env)   # (a GGML_SCHED_PP_* variable as a switch given)
    dry_run = lambda sw: measure_placement(model, devices, placement, ctx, margin=margin, env=env, switches=sw)
    plan = dry_run(given)
    lm, off = _with_layer_major(plan, wl, lambda sw: _within_targets(dry_run(sw), sw, plan), given,
                                "on: the run's prompts form groups, and their memory fits beside the placement")
    if off:
        lm.layer_major = {"switch": 0, "why": f"off: {off}"}
    if not cache:
        return lm
    plan.expert_cache = lm.expert_cache = "auto"   # (weighed as auto is: no slots in it yet)
    probed: dict = {}
    n_threads = plan.context_params().n_threads
    weigh = lambda p: _weigh(p, model, devices, wl, curve, load_mode, n_threads, progress, None, probed, given)
    if lm is plan or not _decodes(plan, wl):
        return weigh(lm)
    # (the groups weighed against the slots their room would hold: no dry run more, the plan without them is `plan`)
    price = lambda p: _priced(p, model, devices, wl, curve, load_mode, n_threads, progress, False, probed,
                              refill_free(given))
    return _weighed_layer_major(lm, plan, price, weigh, lambda p: planner.prompt_seconds(p, model, wl, load_mode, given))


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
    if _residency(lm) != _residency(plan):
        return plan, "its groups' memory would move expert layers (or part of one) to host RAM"
    if layer_major_group(lm) < 2:
        return plan, "no group forms here (op offload off)"
    lm.layer_major["why"] = why
    return lm, ""


def _residency(plan: Plan) -> list[tuple[int, int]]:
    """Per device, (host-expert layers, layers with part of their FFN moved to the CPU): what a plan keeps of the
    experts in device memory, which LAYER_MAJOR's groups may not lower."""
    return [(d.host_expert_layers, d.partial_layers) for d in plan.devices]


def _decodes(plan: Plan, workload: Workload) -> bool:
    """Whether the memory planner weighs a plan's cache for the workload (the patched build, the cache auto, a MoE
    model, tokens decoded): where it does, LAYER_MAJOR's groups are weighed against the slots their room would hold."""
    return plan.variant == "patched" and plan.expert_cache == "auto" and bool(plan.n_expert) and \
        bool(workload.decode_tokens)


def _slots_text(alt) -> str:
    """A priced Alternative's cache in words (None: no cache)."""
    if alt is None or not alt.slots:
        return "no cache"
    return f"{'/'.join(map(str, alt.device_slots)) if alt.device_slots else alt.slots} slots a layer"


def _weighed_layer_major(on: Plan, off: Plan, price: Callable[[Plan], Optional[tuple]],
                         weigh: Callable[[Plan], Plan], prompts: Callable[[Plan], float], keep: str = "on") -> Plan:
    """LAYER_MAJOR weighed against the cache's slots for a workload that prompts and decodes: `on` (the switch, its
    groups' buffers placed) and `off` (without it, the groups' room free), each priced as its prompts (`prompts`: fit
    and a run without a fit, the seconds they spend on the links, planner.prompt_seconds; -ub auto, the candidate's
    prompt t/s) plus what the memory planner would choose for it (`price`: _priced; Alternative.seconds, its decode
    and the prompt bytes of layers it moves; where it prices nothing, the other plan's no cache: the same host-expert
    layers). The plan `keep` names (fit's: "on", the groups its rule turned on; -ub auto's: the side whose prompts ran
    faster) stays unless the other predicts GAIN_MIN less time, as a cache must. Only the winner's memory is then
    placed (`weigh`: its one dry run where layers move; where the other's cache then has no placement, `keep` after
    all). Both predictions are kept in its layer_major ("weighed"), which won and by how much in its "why"; `off`
    taken keeps LAYER_MAJOR=0 in its switches (a run with the plan replays it)."""
    try:
        p_on, p_off = prompts(on), prompts(off)
    except ConfigError:   # (an unthrottled VDEV link: no link time to save)
        p_on = p_off = 0.0
    a, b = price(on), price(off)
    d_on = a[0].seconds if a else b[1].seconds if b else 0.0
    d_off = b[0].seconds if b else a[1].seconds if a else 0.0
    t = {"on": p_on + d_on, "off": p_off + d_off}
    other = "off" if keep == "on" else "on"
    took = other if t[other] < t[keep] * (1 - GAIN_MIN) else keep
    slots_on, slots_off = _slots_text(a[0] if a else None), _slots_text(b[0] if b else None)
    weighed = {"on": {"prompt_s": round(p_on, 4), "memory_s": round(d_on, 4), "seconds": round(t["on"], 4),
                      "cache": slots_on},
               "off": {"prompt_s": round(p_off, 4), "memory_s": round(d_off, 4), "seconds": round(t["off"], 4),
                       "cache": slots_off},
               "chosen": took}
    plans, priced = {"on": on, "off": off}, {"on": a, "off": b}
    note = f" (less than {GAIN_MIN:.0%} apart: {'the groups stay' if keep == 'on' else 'no groups'})" \
        if t[other] < t[keep] else ""
    out = weigh(plans[took])
    if took != keep and priced[took] and priced[took][0].slots and not out.switches.get(switches.EXPERT_CACHE):
        # (its cache had no placement after all: the plan without it would lose on both phases)
        note = f", whose cache then had no placement ({out.memory_plan['why']})"
        took = weighed["chosen"] = keep
        out = weigh(plans[keep])
    if took == "off":
        out.switches[switches.LAYER_MAJOR] = 0
        out.layer_major = {"switch": 0, "weighed": weighed,
                           "why": f"off: the workload in {t['off']:.2f} s against {t['on']:.2f} s with it"
                                  f"{note if keep == 'off' else ''}; the cache: {slots_off} in the groups' room, "
                                  f"{slots_on} beside them; prompts {p_off:.2f} s against {p_on:.2f} s"}
        return out
    out.layer_major.update(weighed=weighed, why=f"on: the workload in {t['on']:.2f} s against {t['off']:.2f} s without "
                                                f"it{note if keep == 'on' else ''}; the cache: {slots_on} beside the "
                                                f"groups, {slots_off} in their room; prompts {p_on:.2f} s against "
                                                f"{p_off:.2f} s")
    return out


def fit(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, *, workload=None, trace=None,
        load_mode: str = CONTEXT.load_mode, progress: bool = False, **kw) -> Plan:
    """pyllama_pp.placement.fit; then for the patched build, LAYER_MAJOR where the workload's prompts gain from it
    and it costs no resident layer (unless switches set it), and (expert cache auto, the default) each device's memory
    weighed between resident expert layers and the cache's slots for the workload (pyllama_pp.memory_plan). Where
    both apply and the workload decodes, the plan with the groups (the cache in what they leave) is weighed against
    the one without them (the cache in their room too) by the workload's predicted seconds (_weighed_layer_major).

    Args:
        model, devices, ctx, variant, **kw: as pyllama_pp.placement.fit takes them (margin, expert_cache, switches, ...).
        workload: what the plan is for: a Workload, a name of defaults.WORKLOADS or "pp=N,tg=N" (default: FIT's).
        trace: a trace of the model's decode (`pyllama-pp trace` writes it) for the cache's hit rates (default: a
            synthetic model's own routing, else the published prior, pyllama_pp.hit_curve).
        load_mode: how the run keeps host weights ("mmap": the cache's misses cross the pageable link).
        progress: say what the decode probe measures.
    Returns:
        Plan: the plan (with memory_plan where the cache was weighed; layer_major["weighed"] where the groups were
        weighed against the slots).
    Raises:
        As pyllama_pp.placement.fit; ConfigError for a bad workload or trace.
    """
    wl = Workload.parse(workload)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace   # (a bad trace: an error before any run)
    # (a GGML_SCHED_PP_* variable as a switch given: EXPERT_CACHE's planned as --expert-cache, in the trial too)
    given = user_set(kw.pop("switches", None), kw.get("env"), variant)
    plan = placement.fit(model, devices, ctx, variant, switches=given, **kw)
    pinned = dataclasses.replace(placement.fit_context(ctx), n_ctx=plan.n_ctx)   # (fit chose it: keep it)
    lm, _ = _with_layer_major(plan, wl, lambda sw: placement.fit(model, devices, pinned, variant, switches=sw, **kw),
                              given, "on: the workload's prompts form groups and their memory costs no resident "
                              "expert layer")
    n_threads = placement.fit_context(ctx).n_threads
    probed: dict = {}

    def weigh(p: Plan) -> Plan:
        sw = _refit_switches(given, p)
        refit = lambda mib: placement.fit(model, devices, pinned, variant, switches=sw,
                                          **{**kw, "expert_cache": f"{mib}MiB"})
        return _weigh(p, model, devices, wl, curve, load_mode, n_threads, progress, refit, probed, given)
    if lm is plan or not _decodes(plan, wl):
        return weigh(lm)
    # (the groups weighed against the slots their room would hold: the plan without them is the one made before the
    # trial, and only the winner is placed again where its memory moves layers)
    price = lambda p: _priced(p, model, devices, wl, curve, load_mode, n_threads, progress, True, probed,
                              refill_free(given))
    return _weighed_layer_major(lm, plan, price, weigh,
                                lambda p: planner.prompt_seconds(p, model, wl, load_mode, given))


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


def _measured_best(best: Plan, near: list[Plan], measure: Callable, most: int) -> tuple[Plan, list]:
    """Of `best` and the candidates predicted close to it (`near`, both searches': with and without LAYER_MAJOR), the
    `most` closest measured with measure(plans) -> t/s each: (the fastest measured, every measured pair in its
    ubatch_measured; [(plan, t/s)] of those measured). `best` and [] where there is nothing to measure."""
    bar = (1 - UBATCH_MEASURE.band) * (best.predicted_ts or 0)
    pick = [best] + sorted((p for p in near if p is not best and (p.predicted_ts or 0) >= bar),
                           key=lambda p: -p.predicted_ts)[:max(0, most - 1)]
    if len(pick) < 2 or not best.predicted_ts:
        return best, []
    got = measure(pick)
    if max(got) <= 0:   # (no context ran: the prediction decides)
        return best, []
    rows = [{"n_ubatch": p.ctx["n_ubatch"], "n_batch": p.ctx["n_batch"], "layer_major": int(bool(p.layer_major)),
             "predicted_ts": p.predicted_ts, "measured_ts": ts} for p, ts in zip(pick, got)]
    won = pick[max(range(len(pick)), key=lambda i: got[i])]
    won.ubatch_measured = rows
    return won, list(zip(pick, got))


def _side_best(winner: Plan, measured: list) -> Optional[tuple]:
    """One side's (with LAYER_MAJOR or without) best candidate for the workload's weighing: the fastest of its pairs
    measured (plan, t/s, "measured"), else its search's winner at its prediction; None where every pair of the side
    measured failed to run."""
    side = [(p, ts) for p, ts in measured if bool(p.layer_major) == bool(winner.layer_major)]
    ran = [(p, ts, "measured") for p, ts in side if ts > 0]
    if ran:
        return max(ran, key=lambda r: r[1])
    return None if side else (winner, winner.predicted_ts or 0.0, "predicted")


def _one_basis(sides: list) -> list:
    """The two sides' (plan, prompt t/s, how) on one basis: as they are where both were measured or both predicted;
    where one side ran and the other did not, both at their predictions (a measured t/s against a predicted one
    would weigh the predictor's error, not the sides)."""
    if None in sides or len({how for _, _, how in sides}) < 2:
        return sides
    return [(p, p.predicted_ts or 0.0, "predicted") for p, _, _ in sides]


def fit_ubatch(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, *, workload=None, trace=None,
               measure: int = UBATCH_MEASURE.most, **kw) -> Plan:
    """pyllama_pp.planner.fit_ubatch with the compute probe (pyllama_pp.compute.Probe); for the patched build where
    switches do not set LAYER_MAJOR, the search with it too; then the candidates of both predicted within
    UBATCH_MEASURE.band of the best run as planned (at most `measure`, the best included) and the fastest measured
    taken; then, expert cache auto, the memory weighed for the workload at the chosen pair (as fit does). Where both
    searches placed a pair and the workload decodes too (the cache auto), the two sides' best (with LAYER_MAJOR and
    without: the fastest measured, else the search's winner at its prediction; both at their predictions where only
    one side ran: _one_basis) are weighed on the whole workload as
    fit weighs its groups (_weighed_layer_major: each one's prompts at its t/s plus the memory plan priced at its
    placement; the side whose prompts ran faster stays unless the other saves GAIN_MIN).

    Args:
        model, devices, ctx, variant, **kw: as pyllama_pp.planner.fit_ubatch takes them (n_tokens, n_batch, margin,
            switches, load_mode, count_compute, progress, ...).
        workload, trace: as fit takes them.
        measure: how many of the closest predictions to run, at most UBATCH_MEASURE.most (0 or 1: the prediction
            alone decides; nothing is measured where compute is not counted).
    Returns:
        Plan: the chosen pair's plan; ubatch_measured holds what was measured; layer_major["weighed"] both sides'
        predictions where they were weighed on the workload.
    Raises:
        As pyllama_pp.planner.fit_ubatch; WorkerError where a measured run fails.
    """
    kw.setdefault("probe", Probe)
    wl = Workload.parse(workload)
    curve = HitCurve.for_model(model, trace) if trace is not None else trace   # (a bad trace: an error before any run)
    given = user_set(kw.pop("switches", None), kw.get("env"), variant)   # (a GGML_SCHED_PP_* variable as a switch)
    measuring = measure >= 2 and kw.get("count_compute", True) and kw["probe"] is not None
    near: list[Plan] = []
    contenders = near if measuring else None   # (each made final costs a dry run: only those to be measured)
    plan = planner.fit_ubatch(model, devices, ctx, variant, switches=given, contenders=contenders, **kw)
    winners = [plan]
    if variant == "patched" and switches.LAYER_MAJOR not in given and \
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
            plan, near, winners = first, near + [other], [lm, plan]
    load_mode = kw.get("load_mode", CONTEXT.load_mode)
    measured: list = []
    if measuring:
        plan, measured = _measured_best(plan, near, functools.partial(
            measure_prompts, model=model, devices=devices, n_tokens=kw.get("n_tokens") or plan.n_ctx,
            load_mode=load_mode, env=kw.get("env"), timeout=kw.get("timeout") or FIT.timeout,
            progress=kw.get("progress", False)), measure)
        without = [r["measured_ts"] for r in plan.ubatch_measured if not r["layer_major"]]
        if plan.layer_major.get("why") and without:   # (LAYER_MAJOR weighed here, and measured against a pair without)
            plan.layer_major["why"] = (f"on: measured {max(r['measured_ts'] for r in plan.ubatch_measured):.0f} t/s "
                                       f"against {max(without):.0f} without it")
    n_threads, progress = placement.fit_context(ctx).n_threads, kw.get("progress", False)
    probed: dict = {}

    def weigh(p: Plan) -> Plan:
        """The memory weighed at p's pair and switches (its refit keeps them, and p's rows)."""
        fit_kw = {k: v for k, v in kw.items() if k in ("margin", "split_mode", "env", "timeout", "spread",
                                                     "link_gbps")}
        fit_kw["switches"] = _refit_switches(given, p)
        chosen = dataclasses.replace(placement.fit_context(ctx), n_ctx=p.n_ctx, n_batch=p.ctx["n_batch"],
                                     n_ubatch=p.ctx["n_ubatch"])

        def refit(mib: int) -> Plan:
            out = placement.fit(model, devices, chosen, variant, expert_cache=f"{mib}MiB", **fit_kw)
            # (its predicted_ts was the pair's with fewer host-expert layers: the alternatives say what the moved
            # layers add to prompts)
            out.ubatch_auto, out.ubatch_measured = p.ubatch_auto, p.ubatch_measured
            return out
        return _weigh(p, model, devices, wl, curve, load_mode, n_threads, progress, refit, probed, given)
    sides = _one_basis([_side_best(w, measured) for w in winners])
    if len(winners) < 2 or None in sides or not _decodes(plan, wl):
        return weigh(plan)
    # (the workload decodes: the groups' side weighed against the one whose cache may take their room)
    (on, on_ts, on_how), (off, off_ts, off_how) = sides
    for p in (on, off):
        p.ubatch_measured = plan.ubatch_measured
    rate = {id(on): on_ts, id(off): off_ts}
    price = lambda p: _priced(p, model, devices, wl, curve, load_mode, n_threads, progress, True, probed,
                              refill_free(given))
    out = _weighed_layer_major(on, off, price, weigh, lambda p: wl.prompt_tokens / rate[id(p)] if rate[id(p)] else 0.0,
                               keep="on" if plan is on else "off")
    for side, ts, how in (("on", on_ts, on_how), ("off", off_ts, off_how)):
        out.layer_major["weighed"][side].update(prompt_ts=round(ts, 1), prompt_from=how)
    return out


__all__ = ["fit", "fit_ubatch", "plan_on_placement"]
