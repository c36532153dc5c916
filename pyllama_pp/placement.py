"""fit's placement: where a model's layers and experts go on a device spec, with the variant's own common/fit.cpp (a dry
run in a worker process), and the patched build's mechanisms planned into it (pyllama_pp.overlap_plan,
pyllama_pp.layer_major_plan, pyllama_pp.expert_cache_plan).

The baseline's plan is upstream's (its steps 3 and 4: host experts piled onto the trailing devices, or its refusal
and why); the patched build's fit spreads the host-expert layers over the devices when pipeline parallelism can use
them (path "spread"), else it takes upstream's steps and says why (path "upstream"). The result is a `Plan`
(pyllama_pp.plan). The choice of (n_batch, n_ubatch) by predicted throughput is pyllama_pp.planner's.

>>> plan = fit("tiny.gguf", devices="vdev:2x24MiB@4GBps", ctx=ContextParams(n_ctx=512, n_ubatch=128))
>>> print(plan)
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from . import devices as devspec
from . import expert_cache_plan, switches
from .defaults import FIT, cache_dir, threads, usable_cores
from .errors import ConfigError, DeviceSpecError
from .layer_major_plan import plan_layer_major
from .model_file import check_model_path, expert_bytes_per_layer, expert_layout, expert_tensor_bytes, expert_tensor_shape
from .overlap_plan import plan_copies
from .params import SPLIT_MODES, ContextParams, Placement, as_context
from .plan import MiB, Plan, plan_from_result, plan_problem
from .predict import checked_rates
from .servers.planning import check_server_host_memory, server_copy_bytes
from .switches import ExpertCache
from .worker.client import check_switch_env, run_job


def fit_context(ctx) -> ContextParams:
    """The context fit plans for: `ctx` (a ContextParams or its dict), or FIT's sizes (pyllama_pp.defaults).

    Raises:
        TypeError: for a ctx that is neither a ContextParams nor a dict.
    """
    if ctx is None:
        return ContextParams(n_ctx=FIT.n_ctx, n_batch=FIT.n_batch, n_ubatch=FIT.n_ubatch)
    return as_context(ctx)


def _margins(margin, spec: devspec.DeviceSpec) -> list[int]:
    n = spec.n_devices or 1
    if margin is None:
        return [spec.default_margin] * n
    vals = list(margin) if isinstance(margin, (list, tuple)) else [margin]
    negative = [v for v in vals if str(v).strip().startswith("-")]
    if negative:
        raise ConfigError(f"margin {','.join(map(str, negative))}: a margin is memory fit leaves free on a device, "
                          "0 or more (e.g. 256MiB); to let fit use more of a device, lower the margin to 0")
    try:
        vals = [devspec.parse_size(v) for v in vals]
    except DeviceSpecError as e:
        raise ConfigError(f"bad margin {margin!r}: {e}") from None
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n and spec.n_devices:   # ("cuda" names no count: the devices fit finds)
        raise ConfigError(f"{len(vals)} margins for {n} devices: give one, or one per device")
    return vals


def spread_weights(spread, spec: devspec.DeviceSpec, link_gbps=None) -> list:
    """The patched fit's share weights (LLAMA_FIT_SPREAD_WEIGHTS): [] for equal shares; "links": each device's host
    link rate (a VDEV's own, split among the devices of a link group; on CUDA the rates given as link_gbps), so that
    every stage streams its host experts in about the same time; or the weights given."""
    if spread in (None, "equal"):
        return []
    if spread == "links":
        rates = [devspec.parse_rate(x) for x in link_gbps] if link_gbps is not None else spec.link_shares()
        if rates is None:   # (the spec gives no links: CUDA's are the machine's)
            raise ConfigError("spread='links' on CUDA needs each GPU's host link rate: link_gbps=[55, 25] "
                              "(CLI: --link-gbps 55,25; nvidia-smi shows each link's generation and width)")
        return checked_rates(rates, spec, "spread='links'", link_gbps is not None, spec.n_devices or 0)
    if isinstance(spread, (list, tuple)):
        try:
            w = [float(x) for x in spread]
        except (TypeError, ValueError):
            w = []
        if w and all(x > 0 for x in w) and (not spec.n_devices or len(w) == spec.n_devices):
            return w
    raise ConfigError(f"spread takes 'equal', 'links' or one positive weight per device, not {spread!r}")


def fit(model: Union[str, os.PathLike], devices=FIT.devices, ctx=None, variant: str = FIT.variant,
        margin=None, split_mode: str = FIT.split_mode, n_ctx_min: int = 0, check: bool = True,
        env: Optional[dict] = None, timeout: Optional[float] = FIT.timeout, spread="equal", link_gbps=None,
        expert_cache=None, switches: Optional[dict] = None) -> Plan:
    """Plan the placement of `model` on `devices` with `variant`'s fit (run in a worker process).

    Args:
        model: the GGUF file.
        devices: a device spec with accelerators ("cuda", "cuda:0,1", "vdev:2x768MiB@4GBps", a dict, a DeviceSpec);
            each VDEV needs a memory budget.
        ctx: the context to plan for, a ContextParams or its dict (default: FIT's sizes, pyllama_pp.defaults); n_ctx
            0: fit chooses it, down to n_ctx_min.
        variant: "patched" (default: the series' fit, which spreads host experts) or "baseline" (upstream's).
        margin: bytes to leave free on each device (an int or a size such as "256MiB"), one value or one per
            device; default: upstream's 1 GiB on CUDA, none on VDEVs, whose budgets are exact.
        split_mode: "layer" (default), "none" or "row" (CUDA only).
        n_ctx_min: the smallest n_ctx fit may choose when ctx.n_ctx is 0.
        check: refuse a plan that leaves whole layers on the CPU or a device over its target (False: return it).
        env: environment for the worker, NAME -> value.
        timeout: seconds the worker may take (None: no limit).
        spread: patched: "equal" (default) shares of the host-expert layers, "links" (shares by each device's host
            link rate: a VDEV's own, on CUDA link_gbps) or one positive weight per device.
        link_gbps: each device's host link rate in GB/s (numbers or "55GBps"), for spread="links" on CUDA.
        expert_cache: the patched build's device expert cache for decode (EXPERT_CACHE): "auto" (what the plan leaves
            free on each device, at most every expert of its host-expert layers), a size such as "512MiB" (that much
            a device, reserved before placing), slots a layer such as "16slots" (their bytes over the host-expert
            layers fit places, reserved and placed again until they fit), an ExpertCache, or 0 (none;
            None: FIT's, auto, which a switch that sets EXPERT_CACHE leaves out), or a comma list of sizes, slot
            counts and 0s, one per device ("16slots,32slots"). The plan shows each device's share
            (pyllama_pp.expert_cache_plan); auto gives unequal devices their own slots. Here auto is what the
            placement leaves free: pyllama_pp.fit.fit then weighs it against resident layers.
        switches: the patched build's switches the dry runs measure with, NAME -> value (as a run gets them; a
            GGML_SCHED_PP_* variable in env or this process's environment counts as one of these, which win:
            switches.user_set); EXPERT_CACHE among them, where expert_cache is not given, is planned as that
            expert_cache would be (MiB a device, -N slots).
    Returns:
        Plan: the plan (its devices, layers, host-expert layers, overrides, expected memory and switches).
    Raises:
        ModelError: for a missing or bad model file.
        DeviceSpecError: for a spec that does not parse, has no accelerators, has a VDEV without a memory budget,
            or asks for split mode row on VDEVs.
        ConfigError: for a bad split_mode, margin, spread or expert_cache, link rates of 0 or of the wrong count, a
            fit that refuses the given parameters, or an expert cache of a size that leaves the model no room (naming
            the device and its free memory).
        TypeError: for a ctx that is neither a ContextParams nor a dict.
        OutOfMemoryError: when fit finds no placement, or (unless check=False) leaves whole layers on the CPU or
            plans a device over its target.
        WorkerError: when the worker dies or times out.
    """
    plan = _fit_plan(model, devices, ctx, variant, margin, split_mode, n_ctx_min, check, env, timeout, spread,
                     link_gbps, expert_cache=expert_cache, given=switches)
    problem = plan_problem(plan, check)
    if problem is not None:
        raise expert_cache_plan.room_error(plan, problem)
    return plan


def measure(model: Union[str, os.PathLike], devices, placement: Placement, ctx, margin=None, env: Optional[dict] = None,
            timeout: Optional[float] = FIT.timeout, switches: Optional[dict] = None) -> Plan:
    """A placement given as it is (a run's own, without fit) as the patched build's plan: no layer moved, its layers
    and host-expert layers, the memory one dry run measures on each device with the run's switches, each device's free
    memory and target (free less the margin, as fit keeps it), and the rates the expert cache's plan prices with
    (each device's link, the host CPU's expert op, the staging copy: measured once on this machine, then read back).

    Args:
        model: the GGUF file.
        devices: a device spec with accelerators, as fit takes it.
        placement: the run's placement (host experts, -ngl, -ts or overrides).
        ctx: the run's context (ContextParams or its dict).
        margin: as fit takes it (default: the spec's).
        env: environment for the worker, NAME -> value.
        timeout: seconds the worker may take.
        switches: the patched build's switches the run has (the dry run's scheduler reads them).
    Returns:
        Plan: path "given"; a device over its target is left as it is (the plan says so by its room).
    Raises:
        As fit, but no OutOfMemoryError for a placement that fit would not make.
    """
    return _fit_plan(model, devices, ctx, "patched", margin, check=False, env=env, timeout=timeout, expert_cache=0,
                     given=switches, placement=placement)


def check_inputs(model, variant: str, env: Optional[dict] = None) -> None:
    """What fit checks once before its dry runs: the model file, and the GGML_SCHED_PP_* variables of env and this
    process's environment against the patched build's switch table (ModelError, ConfigError)."""
    check_model_path(model)
    check_switch_env([variant], env)


def reserved_bytes(model, spec: devspec.DeviceSpec, variant: str, force: dict,
                   cache_bytes: int = 0) -> dict[str, int]:
    """Memory fit keeps free on each device beside its margin, by what it is for: what a mechanism needs there that
    the dry run does not see (one entry per mechanism; each is added to every device's margin).

    Args:
        model: the GGUF file.
        spec: the parsed device spec.
        variant: "patched" or "baseline".
        force: the switches set, NAME -> value (in_force's names).
        cache_bytes: the device expert cache's size a device, where one was given (--expert-cache SIZE).
    Returns:
        name -> bytes per device; empty where nothing is kept.
    """
    out = {}
    copies = server_copy_bytes(model, spec, variant, str(force.get(switches.RPC_HOST, 1)) != "0")
    if copies:
        out["rpc_server_copies"] = copies
    out.update({"expert_cache": cache_bytes} if cache_bytes else {})
    if variant == "patched" and switches.value_of(force.get(switches.PREFETCH, 0)) == 2:
        # (its lanes are allocated at the first graph that uses them, after the dry run: the largest expert weight a
        # lane; where they find no memory the copies stay in the compute buffers)
        out["prefetch_lanes"] = switches.PREFETCH_LANES * expert_tensor_bytes(model)
    return out


def _fit_plan(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, margin=None,
              split_mode: str = FIT.split_mode, n_ctx_min: int = 0, check: bool = True, env: Optional[dict] = None,
              timeout: Optional[float] = FIT.timeout, spread="equal", link_gbps=None, checked: bool = False,
              rates: Sequence[str] = (), expert_cache=None, group_bytes: bool = True,
              given: Optional[dict] = None, placement: Optional[Placement] = None) -> Plan:
    """fit's plan before its check (`check` decides whether the patched build plans again without OVERLAP=2's
    copies where they leave no room); `checked`: the caller ran check_inputs (fit_ubatch, once for all its
    candidates); `rates`: what the fit job also measures (FitJob.rates), into the plan; `group_bytes`: with
    LAYER_MAJOR, a dry run without it tells the group's bytes per device (plan_layer_major); `given`: the switches
    the dry runs get (FitJob.switches, as a run's); `placement`: no fit, this placement measured as it is (`measure`),
    with the expert cache's rates and nothing planned into it."""
    if not checked:
        check_model_path(model)
    spec = devspec.parse(devices)
    spec.fit_check(split_mode)   # (no accelerators, a device without a budget, a split its devices lack)
    if split_mode not in SPLIT_MODES:
        raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {split_mode!r}")
    ctx = fit_context(ctx)
    margins = _margins(margin, spec)
    # (the user's switches, a GGML_SCHED_PP_* variable's as --switch's; EXPERT_CACHE among them planned alike)
    given = switches.user_set(given, env, variant) if variant == "patched" else {}
    if expert_cache is None or expert_cache == FIT.expert_cache:
        taken, given = switches.take_expert_cache(given)
        expert_cache = expert_cache if taken is None else taken
    cache = _expert_cache(expert_cache, variant, given)
    cache.check_devices(spec.n_devices, spec.label)
    switches.check_device_lists(given, spec.n_devices, spec.label)
    reserved = reserved_bytes(model, spec, variant, given, cache.bytes)
    # (a per-device list's sizes: each on its own device)
    margins = [m + sum(reserved.values()) + (cache.at(i).bytes if cache.devices else 0) for i, m in enumerate(margins)]
    server_copies = reserved.get("rpc_server_copies", 0)
    weights = spread_weights(spread, spec, link_gbps)
    if weights:
        env = {**(env or {}), "LLAMA_FIT_SPREAD_WEIGHTS": ",".join(f"{w:g}" for w in weights)}
    if not checked:
        check_switch_env([variant], env)
    env = switches.unset(env)   # (the variables' switches are in `given`, the jobs')
    job = {"kind": "fit", "model": str(model), "devices": spec.to_dict(), "ctx": ctx.to_dict(),
           "split_mode": split_mode, "margins": margins, "n_ctx_min": n_ctx_min,
           **({"placement": placement.to_dict(), "measure": True} if placement is not None else {})}

    # the expert cache's guard weighs the host CPU's expert op against each device's link (expert_cache_plan.guard):
    # measured once on this machine, then read back
    guard_rates = _guard_rates(model, spec, ctx, given) if (cache or placement) and variant == "patched" else None
    if guard_rates is not None:
        rates = list(dict.fromkeys([*rates, *guard_rates.missing]))

    def once(extra: dict, measure: bool = True) -> Plan:
        res = run_job({**job, "rates": rates if measure and not extra else [], "switches": {**given, **extra}},
                      variant, timeout=timeout, env=env or None)
        return plan_from_result(res, variant, str(model), spec, {**ctx.to_dict(), "split_mode": split_mode},
                                job["margins"])

    plan = once({})
    slot_room = [0] * len(plan.devices)
    if variant == "patched" and placement is None and _slot_counts(cache) and plan_problem(plan, True) is None:
        plan, slot_room = _room_for_slots(plan, cache, model, job, once)
    if guard_rates is not None:
        guard_rates.fill(plan)
    if placement is not None:
        plan.path, plan.reasons = "given", ["the run's own placement, measured as it is (no fit)"]
    elif variant == "patched":
        if plan.devices:   # (one device is pipelined too, GATE)
            plan = plan_copies(plan, once, check, given)
        plan_layer_major(plan, given, once if group_bytes else None)
        plan.spread_weights = weights
        if server_copies:
            plan.copies += (f"; on each server, {server_copies / MiB:.1f} MiB of its device kept for its own expert "
                            f"copies (two expert tensors: RPC_HOST with OVERLAP=2), in the margin")
            plan.copies += check_server_host_memory(plan, expert_bytes_per_layer(model))
        for i, d in enumerate(plan.devices):   # (the slots' room, held while placing, is theirs again: plan_cache)
            plan.margins[i] -= slot_room[i]
            d.target_bytes += slot_room[i]
        plan = _plan_expert_cache(plan, cache, model)
    return plan


#: dry runs fit may add to make room for a slot count's cache (each moves more layers' experts to host RAM, whose
#: slots then need more room: the reserve grows until the placement holds it)
SLOT_ROOM_TRIES = 6


def _slot_counts(cache: ExpertCache) -> bool:
    """Whether any device's cache is asked as slots a layer (whose bytes depend on the placement's host layers)."""
    return any(cache.at(i).slots for i in range(max(1, len(cache.devices))))


def _room_for_slots(plan: Plan, cache: ExpertCache, model, job: dict,
                    once: Callable[..., Plan]) -> tuple[Plan, list[int]]:
    """A placement with room for a slot count's cache: each device's slots' bytes over the host-expert layers the plan
    leaves it are reserved in its margin and fit places again, until the reserve holds them (or SLOT_ROOM_TRIES). A
    reserve fit finds no clean placement for (whole layers on the CPU, a device over its target) is not taken: the
    last clean plan stays, and plan_cache names the device without room.

    Args:
        plan: fit's plan without the reserve (a clean one).
        cache: what was asked (a slot count for some devices).
        model: the GGUF file.
        job: the fit job (its margins are raised in place: one a device).
        once: places with the job (measure=False: the first plan's rates are kept).
    Returns:
        (the plan, each device's reserve in bytes).
    """
    layout = expert_cache_plan.layout_of(model, plan.n_expert)
    base = list(job["margins"]) * len(plan.devices) if len(job["margins"]) == 1 else list(job["margins"])
    reserve = [0] * len(plan.devices)
    for _ in range(SLOT_ROOM_TRIES):
        need = [layout.bytes_of(layout.slots_at(cache.at(i).switch, d.host_expert_layers), d.host_expert_layers)
                if cache.at(i).slots else 0 for i, d in enumerate(plan.devices)]
        if all(n <= r + max(0, d.target_bytes - d.expected_bytes) for n, r, d in zip(need, reserve, plan.devices)):
            break
        more = [max(r, n) for r, n in zip(reserve, need)]
        job["margins"] = [m + r for m, r in zip(base, more)]
        again = once({}, measure=False)
        if plan_problem(again, True) is not None:
            job["margins"] = [m + r for m, r in zip(base, reserve)]
            break
        again.take_rates(plan)
        plan, reserve = again, more
    return plan, reserve


def _expert_cache(value, variant: str, force: dict) -> ExpertCache:
    """expert_cache as ExpertCache.parse gives it (None: FIT's default for the patched build); beside an EXPERT_CACHE
    the switches set, none planned where it is the default (the switch is kept as set, as OVERLAP's is), refused
    where one was asked."""
    default = value is None
    if default and variant != "patched":
        return ExpertCache()   # (the baseline has none to plan)
    cache = ExpertCache.parse(FIT.expert_cache if value is None else value, variant)
    if cache and force.get(switches.EXPERT_CACHE) is not None:
        if default:
            return ExpertCache()
        raise ConfigError(f"--expert-cache {cache.text} plans EXPERT_CACHE, which EXPERT_CACHE="
                          f"{force[switches.EXPERT_CACHE]} (a switch or {switches.var(switches.EXPERT_CACHE)}) sets "
                          "already. Fix: drop one of them")
    return cache


def _plan_expert_cache(plan: Plan, cache: ExpertCache, model) -> Plan:
    """The device expert cache written into a patched plan (expert_cache_plan.plan_cache), from the model's experts."""
    if not cache or not plan.n_expert:
        return plan
    return expert_cache_plan.plan_cache(plan, cache, expert_cache_plan.layout_of(model, plan.n_expert))


def _rates_path() -> Path:
    return cache_dir() / "rates.json"


class _GuardRates:
    """The rates the expert cache's guard needs (the host CPU's expert op at the run's thread count; each device's
    link; the host's copy into the staging slots, which an mmap-ed model's misses go through), as cached on this
    machine, and what a dry run must measure (`missing`)."""

    def __init__(self, cpu_key: str, link_keys: list, copy_key: str):
        self.cpu_key, self.link_keys, self.copy_key = cpu_key, link_keys, copy_key
        self.cpu = cached_rate("cpu_expert_gbps", cpu_key)
        self.links = [cached_rate("links", k) for k in link_keys]
        self.copy = cached_rate("host_copy_gbps", copy_key)
        self.missing = ([] if self.cpu else ["cpu_expert"]) + ([] if self.links and all(self.links) else ["links"]) \
            + ([] if self.copy else ["host_copy"])

    def fill(self, plan: Plan) -> None:
        """The plan's rates: measured ones kept for later plans, cached ones filled in."""
        if plan.cpu_expert_gbps:
            plan.cpu_expert_gbps = keep_rate("cpu_expert_gbps", plan.cpu_expert_gbps, self.cpu_key)
        plan.cpu_expert_gbps = plan.cpu_expert_gbps or self.cpu or {}
        if plan.host_copy_gbps and not self.copy:
            plan.host_copy_gbps = keep_rate("host_copy_gbps", plan.host_copy_gbps, self.copy_key)
        plan.host_copy_gbps = plan.host_copy_gbps or self.copy
        for d, key, known in zip(plan.devices, self.link_keys, self.links):
            d.link = keep_rate("links", d.link, key) if d.link and not known else d.link or known


def _guard_rates(model, spec: devspec.DeviceSpec, ctx: ContextParams, given: dict) -> _GuardRates:
    """The guard's rates for a model on a spec: the CPU's by the expert tensor's shape, its experts a token and the
    run's threads; the links by the spec's devices (none where the spec does not count them, as "cuda": measured);
    the staging copy by the switches' copier threads (host_copy_key)."""
    shape, n_used = expert_tensor_shape(model), expert_layout(model)[0]
    return _GuardRates(f":{shape}:{n_used}:{threads(ctx.n_threads)}",
                       [f":{spec}#{i}" for i in range(spec.n_devices or 0)], host_copy_key(given))


def host_copy_key(given: Optional[dict]) -> str:
    """The staging copy's key in rates.json within this machine's: the copier threads the switches `given` set (0:
    the build's default, switches.staging_threads), which the rate depends on."""
    return f":staging{switches.staging_threads(given)}"


def cached_rate(section: str, key: str = ""):
    """A rate measured before on this machine (PYLLAMA_PP_CACHE/rates.json, by host name and usable cores, then
    `key` within `section`), or None."""
    try:
        return json.loads(_rates_path().read_text()).get(section, {}).get(_host_key() + key)
    except (OSError, ValueError):
        return None


def keep_rate(section: str, value, key: str = ""):
    """Keep a measured rate for later plans on this machine (cached_rate reads it), unless one is kept already (by
    another process that measured at the same time: the first kept wins, so that plans made together agree).

    Returns:
        The rate kept: `value`, or the one found.
    """
    path = _rates_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # (released when the file closes)
        f.seek(0)
        try:
            d = json.loads(f.read() or "{}")
        except ValueError:
            d = {}
        kept = d.setdefault(section, {}).setdefault(_host_key() + key, value)
        if kept is value:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(d, indent=1))
    return kept


def _host_key() -> str:
    return f"{socket.gethostname()}:{usable_cores()}"


__all__ = ["fit", "measure", "check_inputs", "fit_context", "spread_weights", "reserved_bytes", "cached_rate",
           "keep_rate", "host_copy_key"]
