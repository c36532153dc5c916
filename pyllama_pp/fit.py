"""`fit`: plan where a model's layers and experts go on a device spec, with the variant's own common/fit.cpp (run in
a worker process), and `fit_ubatch`: the same with n_ubatch chosen.

The baseline's plan is upstream's (its steps 3 and 4: host experts piled onto the trailing devices, or its refusal
and why); the patched build's fit spreads the host-expert layers over the devices when pipeline parallelism can use
them (path "spread"), else it takes upstream's steps and says why (path "upstream"). The result is a `Plan`
(pyllama_pp.plan).

>>> plan = fit("tiny.gguf", devices="vdev:2x24MiB@4GBps", ctx=ContextParams(n_ctx=512, n_ubatch=128))
>>> print(plan)
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from tqdm import tqdm

from . import devices as devspec
from . import expert_cache_plan
from .compute import Probe, compute_for
from .defaults import CONTEXT, FIT, PROBE, TIMEOUTS, UBATCH_CANDIDATES, cache_dir, usable_cores
from .errors import ConfigError, DeviceSpecError, OutOfMemoryError
from .model_file import check_model_path, embedding_length, expert_bytes_per_layer, expert_layout
from .params import SPLIT_MODES, ContextParams, as_context
from .plan import MiB, Plan, grouped_rows, plan_from_result, plan_problem
from .rpc.planning import check_server_host_memory, network_seconds, server_copy_bytes
from .worker.client import SWITCH_ENV_PREFIX, check_switch_env, run_job


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



def _checked_rates(rates: list, spec: devspec.DeviceSpec, what: str, given: bool, n_devices: int = 0) -> list:
    """Each device's host link rate (GB/s), refused where one is 0 (an unthrottled VDEV, or a 0 given) or where there
    are not as many rates as devices (n_devices: 0 when not known yet)."""
    if any(r <= 0 for r in rates):
        raise ConfigError(f"{what} weighs each device by its host link, and " +
                          (f"link_gbps {list(rates)} has a rate of 0: give each device's rate in GB/s, e.g. 55,25"
                           if given else f"{spec} has an unthrottled VDEV link (0): give every device a rate, "
                                         "e.g. vdev:2x8MiB@4GBps"))
    if n_devices and len(rates) != n_devices:
        raise ConfigError(f"{what}: {len(rates)} link rates for {n_devices} devices: give one per device")
    return [float(r) for r in rates]


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
        return _checked_rates(rates, spec, "spread='links'", link_gbps is not None, spec.n_devices or 0)
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
        expert_cache=FIT.expert_cache) -> Plan:
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
            a device, reserved before placing), or 0 (none; default: FIT's). The switch takes one value for every
            device: the plan shows each device's share (pyllama_pp.expert_cache_plan).
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
    return _fit(model, devices, ctx, variant, margin, split_mode, n_ctx_min, check, env, timeout, spread, link_gbps,
                expert_cache=expert_cache)


def _fit(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, margin=None,
         split_mode: str = FIT.split_mode, n_ctx_min: int = 0, check: bool = True, env: Optional[dict] = None,
         timeout: Optional[float] = FIT.timeout, spread="equal", link_gbps=None, checked: bool = False,
         expert_cache=FIT.expert_cache) -> Plan:
    """fit's work; `checked`: the caller has checked the model file and the switch environment (fit_ubatch, once
    for all its candidates)."""
    plan = _fit_plan(model, devices, ctx, variant, margin, split_mode, n_ctx_min, check, env, timeout, spread,
                     link_gbps, checked, expert_cache=expert_cache)
    problem = plan_problem(plan, check)
    if problem is not None:
        raise expert_cache_plan.room_error(plan, problem)
    return plan


def reserved_bytes(model, spec: devspec.DeviceSpec, variant: str, env: Optional[dict],
                   cache_bytes: int = 0) -> dict[str, int]:
    """Memory fit keeps free on each device beside its margin, by what it is for: what a mechanism needs there that
    the dry run does not see (one entry per mechanism; each is added to every device's margin).

    Args:
        model: the GGUF file.
        spec: the parsed device spec.
        variant: "patched" or "baseline".
        env: the workers' environment, NAME -> value (the switches in force).
        cache_bytes: the device expert cache's size a device, where one was given (--expert-cache SIZE).
    Returns:
        name -> bytes per device; empty where nothing is kept.
    """
    out = {}
    copies = server_copy_bytes(model, spec, variant, str(_switch_set("GGML_SCHED_PP_RPC_HOST", env)) != "0")
    if copies:
        out["rpc_server_copies"] = copies
    out.update({"expert_cache": cache_bytes} if cache_bytes else {})
    return out


def _fit_plan(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, margin=None,
              split_mode: str = FIT.split_mode, n_ctx_min: int = 0, check: bool = True, env: Optional[dict] = None,
              timeout: Optional[float] = FIT.timeout, spread="equal", link_gbps=None, checked: bool = False,
              rates: Sequence[str] = (), expert_cache=FIT.expert_cache, group_bytes: bool = True) -> Plan:
    """fit's plan before its check (`check` decides whether the patched build plans again without OVERLAP=2's
    copies where they leave no room); `rates`: what the fit job also measures (FitJob.rates), into the plan;
    `group_bytes`: with LAYER_MAJOR, a dry run without it tells the group's bytes per device (plan_layer_major)."""
    if not checked:
        check_model_path(model)
    spec = devspec.parse(devices)
    spec.fit_check(split_mode)   # (no accelerators, a device without a budget, a split its devices lack)
    if split_mode not in SPLIT_MODES:
        raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {split_mode!r}")
    ctx = fit_context(ctx)
    margins = _margins(margin, spec)
    cache = _expert_cache(expert_cache, variant, env)
    reserved = reserved_bytes(model, spec, variant, env, cache if cache != "auto" else 0)
    margins = [m + sum(reserved.values()) for m in margins]
    server_copies = reserved.get("rpc_server_copies", 0)
    weights = spread_weights(spread, spec, link_gbps)
    if weights:
        env = {**(env or {}), "LLAMA_FIT_SPREAD_WEIGHTS": ",".join(f"{w:g}" for w in weights)}
    if not checked:
        check_switch_env([variant], env)
    job = {"kind": "fit", "model": str(model), "devices": spec.to_dict(), "ctx": ctx.to_dict(),
           "split_mode": split_mode, "margins": margins, "n_ctx_min": n_ctx_min}

    def once(extra: dict) -> Plan:
        res = run_job({**job, "rates": list(rates) if not extra else []}, variant, timeout=timeout,
                      env={**(env or {}), **extra} or None)
        return plan_from_result(res, variant, str(model), spec, {**ctx.to_dict(), "split_mode": split_mode}, margins)

    plan = once({})
    if variant == "patched":
        if plan.devices:   # (one device is pipelined too, GATE)
            plan = _plan_copies(plan, once, check, env)
        plan_layer_major(plan, env, once if group_bytes else None)
        plan.spread_weights = weights
        if server_copies:
            plan.copies += (f"; on each server, {server_copies / MiB:.1f} MiB of its device kept for its own expert "
                            f"copies (two expert tensors: RPC_HOST with OVERLAP=2), in the margin")
            plan.copies += check_server_host_memory(plan, expert_bytes_per_layer(model))
        plan = _plan_expert_cache(plan, cache, model)
    return plan


def _expert_cache(value, variant: str, env: Optional[dict]):
    """expert_cache as expert_cache_plan.parse gives it; beside an EXPERT_CACHE the environment sets, none planned
    where it is the default (the environment's is kept as set, as OVERLAP's is), refused where one was asked."""
    cache = expert_cache_plan.parse(value, variant)
    if cache and _switch_set(CACHE_VAR, env) is not None:
        if value is None or value == FIT.expert_cache:
            return 0
        raise ConfigError(f"--expert-cache {value} plans EXPERT_CACHE, which {CACHE_VAR} sets already. Fix: drop one "
                          "of them")
    return cache


def _plan_expert_cache(plan: Plan, cache, model) -> Plan:
    """The device expert cache written into a patched plan (expert_cache_plan.plan_cache), from the model's experts."""
    if not cache or not plan.n_expert:
        return plan
    n_used, weights = expert_layout(model)
    layout = expert_cache_plan.Layout(slot_bytes=expert_bytes_per_layer(model) / plan.n_expert,
                                      n_expert=plan.n_expert, n_used=n_used, weights=weights)
    return expert_cache_plan.plan_cache(plan, cache, layout)




@dataclass
class Prediction:
    """What a plan's prompt throughput is predicted to be, and what binds it.

    Attributes:
        ts: prompt tokens per second.
        stage_s: each device's seconds per ubatch (its copies and its compute, as they overlap).
        transfer_s: each device's seconds of host-expert copies per ubatch.
        compute_s: each device's seconds of compute per ubatch (None: compute not counted).
        bound: "transfer" or "compute": which of the slowest stage's two is larger; "network" where a server's
            network is slower than every stage.
        network_s: each RPC server's cycle per ubatch: its network both ways and its devices' stages (empty: not
            counted).
        group: ubatches per group (LAYER_MAJOR: they run through each layer together, one expert upload for all);
            with more than 1 the seconds above are a group's, not a ubatch's.
    """

    ts: float
    stage_s: list
    transfer_s: list
    compute_s: Optional[list]
    bound: str
    network_s: dict = field(default_factory=dict)
    group: int = 1


def link_rates(spec: devspec.DeviceSpec, link_gbps, n_devices: int, measured: Optional[Sequence] = None,
               source: str = "pinned") -> list[float]:
    """Each device's host link rate in GB/s: the ones given, else as fit measured it (DevicePlan.link), else the
    spec's own (a VDEV's) or its kind's default (DeviceSpec.default_link_gbps: a PCIe 5 x16 link's 55 GB/s).

    Args:
        spec: the parsed device spec.
        link_gbps: rates given (numbers or "55GBps"), or None.
        n_devices: how many devices the plan has.
        measured: each device's measured link ({"pinned_gbps", "pageable_gbps"}, or None: not measured).
        source: which measured rate: "pinned" (host weights in pinned memory, or staged into it) or "pageable"
            (copies straight from an mmap-ed model: the baseline's).
    Returns:
        One rate per device.
    Raises:
        ConfigError: for a rate of 0 or a count other than n_devices.
    """
    if link_gbps is not None:
        return _checked_rates([devspec.parse_rate(x) for x in link_gbps], spec, "--ubatch auto", True, n_devices)
    own = spec.link_rates() or [spec.default_link_gbps] * n_devices
    if measured is not None and len(measured) == len(own):
        own = [(m or {}).get(f"{source}_gbps") or r for m, r in zip(measured, own)]
    return _checked_rates(own, spec, "--ubatch auto", False, n_devices)


def switches_in_force(variant: str, env: Optional[dict] = None) -> dict:
    """The patched switches the environment sets (this process's, then `env` over it), NAME -> int value; {} for the
    baseline (no switches). A switch not set takes its table default where it is read (upload_share); the values were
    checked against the switch table before any planning (check_switch_env), so no worker is asked again.

    Args:
        variant: "patched" or "baseline".
        env: extra environment of the workers, NAME -> value.
    """
    if variant != "patched":
        return {}
    out = {}
    for k, v in {**os.environ, **(env or {})}.items():
        if k.startswith(SWITCH_ENV_PREFIX) and re.fullmatch(r"-?\d+", str(v).strip()):
            out[k[len(SWITCH_ENV_PREFIX):]] = int(v)
    return out


def expected_coverage(n_tokens: int, n_used: int, n_expert: int) -> float:
    """The expected share of a layer's experts that n_tokens tokens use, each picking n_used of n_expert at random
    (near-uniform routing): 1 - (1 - n_used / n_expert) ** n_tokens. Real routing favours some experts and covers
    less."""
    return 1.0 - (1.0 - n_used / n_expert) ** n_tokens


def upload_share(n_tokens: int, n_used: int, n_expert: int, variant: str, switches: dict, n_links: int,
                 in_flight: bool) -> float:
    """The share of a layer's expert bytes one upload moves for an expert op over n_tokens tokens: 1.0 where the
    patched build uploads whole tensors (UPLOAD_ALL: its selections, tokens x n_used, at or above UPLOAD_ALL_MIN
    and the coverage at or above UPLOAD_ALL_MIN_COV percent), else the used experts' share (the selective copy,
    GATHER: expected_coverage); the baseline always copies the used experts alone.

    Args:
        n_tokens: the tokens the upload serves (n_ubatch, or a LAYER_MAJOR group's K x n_ubatch).
        n_used: experts a token uses (0: not known: whole tensors).
        n_expert: experts a layer has.
        variant: "patched" or "baseline".
        switches: the patched switches in force, NAME -> value (switches_in_force, the plan's over them); one
            missing takes its table default: UPLOAD_ALL 1, UPLOAD_ALL_MIN and UPLOAD_ALL_MIN_COV -1 (auto), LINKS 0.
        n_links: the host links the devices upload over (LINKS 0, auto, counts them so).
        in_flight: another graph is in flight (pipelined ubatches): the lower auto UPLOAD_ALL_MIN.
    Returns:
        A share in (0, 1].
    """
    if n_used <= 0 or n_expert <= 0:
        return 1.0
    cov = expected_coverage(n_tokens, n_used, n_expert)
    if variant != "patched" or not int(switches.get("UPLOAD_ALL", 1)):
        return cov
    min_sel = int(switches.get("UPLOAD_ALL_MIN", -1))
    min_sel = (2 if in_flight else 4) * n_expert if min_sel < 0 else min_sel
    links = int(switches.get("LINKS", 0)) or n_links
    min_cov = int(switches.get("UPLOAD_ALL_MIN_COV", -1))
    min_cov = min(85, max(30, 110 // max(1, links))) if min_cov < 0 else min_cov   # (the native auto bar)
    return 1.0 if n_tokens * n_used >= min_sel and cov * 100 >= min_cov else cov


def predict(plan: Plan, expert_bytes: float, link_gbps: Sequence[float], shared_link: bool = False,
            compute: Optional[dict] = None, n_tokens: Optional[int] = None, hidden: int = 0,
            n_batch: Optional[int] = None, staging_gbps: Optional[float] = None, n_used: int = 0,
            switches: Optional[dict] = None) -> Optional[Prediction]:
    """A plan's prompt throughput from the bytes each link moves and, with `compute`, each device's compute.

    Per ubatch a device moves its host-expert layers' experts over its link, x seconds a layer: the share of a
    layer's expert bytes upload_share gives for the tokens one upload serves (n_ubatch; with LAYER_MAJOR K x
    n_ubatch): whole tensors where the patched build's UPLOAD_ALL bar is met, else the experts those tokens use at
    near-uniform routing. Real routing covers less than uniform, so below the bar the bytes are an upper bound.
    Each device computes its layers, c seconds a layer (the probe's). Devices that are parts of one processor (a probe that ran them together: LayerCompute.shared) do not compute side by side as separate devices
    do: each ubatch takes the longer of all their layers' compute and their copies (all of them on one link, the
    longest device's otherwise; beside the compute, the first one exposed). The patched build copies a layer's
    experts beside the compute of the layer before (OVERLAP=2): the first copy is exposed, then each layer takes the
    longer of its copy and the compute before it (x + c + (h - 1) max(x, c) + (n - h) c); with OVERLAP=0 copies and
    compute add up. With LAYER_MAJOR a group of K ubatches (layer_major_group) runs through each layer together on
    one upload of its experts: per group a device moves its experts once and computes K ubatches (c above is then
    K c), so bytes per token fall by K; groups, not ubatches, are what the pipeline's stages pass on. Pipelined stages overlap: a batch of k ubatches takes (k - 1) times the slowest stage plus every
    stage once (the fill; a batch's last ubatch may be shorter, and counts as a whole one); devices on one link also
    wait for the link's total. The baseline's stages and copies run one after the other. With `hidden`, RPC devices whose network fit measured (DevicePlan.server_net) also
    wait for their server's network (network_seconds): ggml RPC copies a device's output to the next device through
    the client, which waits for it before it sends that server the next ubatch, so a server's cycle per ubatch is
    its inputs up, its devices' stages and its output down, one after the other; the pipeline runs at the slowest
    cycle, and each device's network time adds to the fill. (Each server is counted on its own path: a client NIC
    they share is not; nor are the messages' round trips, which the plan shows; nor the network of parts of one GPU
    probed together.)

    Args:
        plan: a fit plan (its devices' layers, host-expert layers, n_ubatch, n_batch, switches).
        expert_bytes: bytes of one layer's expert tensors.
        link_gbps: each device's host link rate (GB/s).
        shared_link: the devices share one link.
        compute: device index -> compute.LayerCompute (the probe); None: the bytes bound alone.
        n_tokens: the prompt's length (default: the plan's n_ctx).
        hidden: the model's hidden size (n_embd), for the network to RPC servers; 0: the network is not counted.
        n_batch: the batch to predict for (default: the plan's n_batch; at least its n_ubatch); with LAYER_MAJOR it
            sets the group size.
        staging_gbps: the host's copy into pinned memory (Plan.host_copy_gbps), for the patched build on an mmap-ed
            model: every expert copy goes through it first, beside the link (slots), and one copier serves every
            device, so a copy moves at the slower of the two and each ubatch waits for all devices' bytes at its
            rate; None: host weights are pinned.
        n_used: experts a token uses (model_file.expert_layout; 0: not known: whole tensors every upload).
        switches: the patched switches in force (switches_in_force; the plan's own override them); None: the
            plan's over the table's defaults.
    Returns:
        A Prediction, or None when nothing moves and compute is not counted (the bytes bound says nothing).
    """
    ub, nd = plan.ctx["n_ubatch"], len(plan.devices)
    nb = max(n_batch or plan.ctx["n_batch"], ub)
    n_tokens = n_tokens or plan.n_ctx
    k = layer_major_group(plan, nb)   # (a group's ubatches share one upload of each expert tensor)
    rates = [min(r, staging_gbps) for r in link_gbps] if staging_gbps else list(link_gbps)
    units = lambda n: -(-(-(-n // ub)) // k)   # (a batch's n tokens: its ubatches, in groups of k)
    share = upload_share(k * ub, n_used, plan.n_expert, plan.variant, {**(switches or {}), **plan.switches},
                         1 if shared_link else nd, units(nb) > 1)
    expert_bytes = expert_bytes * share
    xs = [expert_bytes / (r * 1e9) for r in rates]
    transfer = [d.host_expert_layers * x for d, x in zip(plan.devices, xs)]
    staged = sum(d.host_expert_layers for d in plan.devices) * expert_bytes / (staging_gbps * 1e9) if staging_gbps \
        else 0.0   # (one copier for every device)
    net_dev, servers = network_seconds(plan, hidden, n_tokens)
    net_dev = [k * t for t in net_dev]
    if compute is None and not any(transfer) and not servers:
        return None
    cs = [k * compute_for(compute, i).per_ubatch(ub) if compute else 0.0 for i in range(nd)]
    comp = [d.n_layers * c for d, c in zip(plan.devices, cs)]
    if compute:   # (embeddings and output: the last device's, once a ubatch)
        last = compute_for(compute, nd - 1)
        comp[-1] += k * last.outside_s[ub] * ub / last.n_tokens
    patched = plan.variant == "patched"
    overlap = patched and plan.switches.get("OVERLAP", 2) == 2
    stage = []
    for d, x, c, t, c_dev in zip(plan.devices, xs, cs, transfer, comp):
        h, rest = d.host_expert_layers, c_dev - d.host_expert_layers * c
        stage.append(x + c + (h - 1) * max(x, c) + rest if overlap and h > 0 else t + c_dev)
    fill = sum(stage) + sum(net_dev)
    net = {key: sum(net_dev[i] + stage[i] for i in idx) for key, idx in servers.items()}   # (each server's cycle)
    n_ub = units(nb)
    chunks, tail = divmod(n_tokens, nb)
    if patched and compute and compute_for(compute, 0).shared:
        # parts of one processor, pipelined: the probe ran them together, so a layer's time is what it adds to the
        # whole pipeline; the parts' copies (adding up on one link) go beside that compute, the first one exposed
        n_ubatches = chunks * n_ub + (units(tail) if tail else 0)
        c_all, x_all = sum(comp), max(sum(transfer) if shared_link else max(transfer), staged)
        total = n_ubatches * (max(c_all, x_all) if overlap else c_all + x_all) + (xs[0] if overlap and x_all else 0.0)
    elif patched:
        slowest = max(max(stage), sum(transfer) if shared_link else 0.0, staged, max(net.values(), default=0.0))
        total = chunks * ((n_ub - 1) * slowest + fill)
        if tail:
            total += (units(tail) - 1) * slowest + fill
    else:
        total = -(-n_tokens // ub) * fill
    if total <= 0:
        return None
    i = max(range(nd), key=lambda j: stage[j])
    bound = "compute" if compute and comp[i] >= transfer[i] else "transfer"
    if patched and net and max(net.values()) > max(stage) and max(net_dev) >= max(transfer + comp):
        bound = "network"
    return Prediction(ts=n_tokens / total, stage_s=stage, transfer_s=transfer, compute_s=comp if compute else None,
                      bound=bound, network_s=net, group=k)


def predicted_ts(plan: Plan, expert_bytes: float, link_gbps: Sequence[float], shared_link: bool = False,
                 compute: Optional[dict] = None, n_tokens: Optional[int] = None, hidden: int = 0,
                 **kw) -> Optional[float]:
    """predict()'s prompt tokens per second (None where it predicts nothing); kw: predict's other arguments."""
    p = predict(plan, expert_bytes, link_gbps, shared_link, compute, n_tokens, hidden, **kw)
    return p.ts if p else None


# a candidate is out, not probed, where even its best case is below the best prediction so far: its copies as its
# plan has them, attention's part as calibrated and this share of the cheapest per-token compute measured
CLEARLY_SLOWER = 0.75


def batch_choices(n_ubatch: int, cap: int) -> list[int]:
    """The n_batch values fit_ubatch predicts for an n_ubatch: n_ubatch times 1, 2, 4, ... below `cap`, and `cap` (the
    prompt, or the largest n_batch given)."""
    out, nb = [], n_ubatch
    while nb < cap:
        out.append(nb)
        nb *= 2
    return out + [cap]


def best_batch(plan: Plan, cap: int, compute: Optional[dict] = None, **kw) -> tuple[int, Optional[Prediction]]:
    """The n_batch (of batch_choices up to `cap`) whose prediction for the plan is the highest (ties: the larger),
    and that prediction (None: predict says nothing); kw: predict's other arguments."""
    best, best_pred = cap, None
    for nb in batch_choices(plan.ctx["n_ubatch"], cap):
        pred = predict(plan, compute=compute, n_batch=nb, **kw)
        if pred is not None and (best_pred is None or pred.ts >= best_pred.ts):
            best, best_pred = nb, pred
    return best, best_pred


_WHY = re.compile(r"leaves (?:all \d+ layers and the output layer|\d+ of \d+ layers \(\S+\)) on the CPU|planned "
                  r"[\d.]+ MiB on \S+, over its target of [\d.]+ MiB|found no placement[^\n]*?(?=\. Fix:|$)|host memory "
                  r"free for host experts[^\n]*?(?=\. Fix:|$)")


def _largest_placed(nbs: Sequence[int], placed_at) -> tuple:
    """The largest n_batch of `nbs` (ascending; a plan's memory grows with it: LAYER_MAJOR's groups) whose plan has a
    placement, by bisection with placed_at(n_batch) -> (plan, problem): (n_batch, plan, None), or (None, None, the
    problem at the smallest). Raises a problem that is not an OutOfMemoryError (fit refused the parameters)."""
    lo, hi, found, problem = -1, len(nbs), (None, None), None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plan, p = placed_at(nbs[mid])
        if p is not None and not isinstance(p, OutOfMemoryError):
            raise p
        if p is None:
            lo, found = mid, (nbs[mid], plan)
        else:
            hi, problem = mid, p
    return (*found, None if found[0] is not None else problem)


def _why(problem: Exception) -> str:
    """What keeps a candidate's plan from being used, from its error, in a few words."""
    m = _WHY.search(str(problem))
    return m.group(0) if m else str(problem).split(". Fix:")[0][-160:]


def _memory_fix(fit_at, n_ctx: int, n_ubatch: int, margins: Sequence[int]) -> str:
    """How to make room for a candidate without a placement: a smaller context where one places it (checked with
    fit_at(n_ctx) -> problem or None, at most two), a smaller margin, more device memory."""
    fixes = []
    for smaller in (n_ctx // 2, n_ctx // 4):
        if smaller < max(n_ubatch, 256):
            break
        if fit_at(smaller) is None:
            fixes.append(f"n_ctx {smaller} places it (-c {smaller}, or a shorter prompt)")
            break
    if any(margins):
        fixes.append(f"a smaller --margin (now {max(margins) / MiB:.0f} MiB a device)")
    return "; ".join(fixes + ["devices with more memory"])


def fit_ubatch(model: Union[str, os.PathLike], devices=FIT.devices, ctx=None, variant: str = FIT.variant,
               candidates: Sequence[int] = UBATCH_CANDIDATES, link_gbps=None, shared_link: bool = False,
               count_compute: bool = True, n_tokens: Optional[int] = None, n_batch: Optional[int] = None,
               load_mode: str = CONTEXT.load_mode, skip: bool = True, progress: bool = False, **kw) -> Plan:
    """fit with (n_batch, n_ubatch) chosen together by the throughput predict() gives from bytes per link and
    measured compute.

    The links' rates are measured once (the first dry run's process: each device's copy from pinned and pageable
    memory; the host's staging copy, cached) unless given. The candidates are the n_ubatch values up to the prompt
    and n_batch (and the prompt, or n_batch, itself). Each is
    planned at the largest n_batch (what a batch holds past n_ubatch changes no device's memory: a pipeline keeps a
    fixed number of ubatches in flight); the first without a placement ends the search upward (a larger ubatch needs
    larger compute buffers), and each is named with why and a fix. With count_compute (the default) a probe measures
    a layer's compute on the devices (compute.Probe, cached, within PROBE.budget), candidates in the order of their
    bytes bound, skipping one that even its best case (CLEARLY_SLOWER) shows slower than the best so far. Each
    candidate's n_batch is the one of batch_choices whose prediction (its copies, its compute, the pipeline's fill
    once a batch) is the highest; the pair predicted fastest wins (ties: the larger n_ubatch).

    Args:
        model: the GGUF file.
        devices: a device spec, as fit takes it.
        ctx: the context, as fit takes it; its n_ubatch and n_batch are chosen (n_ctx 0: FIT's n_ctx).
        variant: "patched" (default) or "baseline".
        candidates: the n_ubatch values to try.
        link_gbps: each device's host link rate in GB/s (default: a VDEV's own; CUDA 55 GB/s, a PCIe 5 x16 link).
        shared_link: the devices share one link (one GPU split in two).
        count_compute: probe the devices' compute and count it (False: the bytes bound alone).
        n_tokens: the prompt's length the prediction is for (default: n_ctx).
        n_batch: the largest n_batch to take (default: the prompt's length).
        load_mode: how the run keeps host weights: "none" (pinned) or "mmap" (pageable: the patched build stages
            them through pinned slots at the host's copy rate, the baseline copies them as they are).
        skip: leave out, unprobed, a candidate even its best case shows slower than the best so far (False: predict
            every candidate with a placement, as a bench that measures them all needs).
        progress: say what it plans and probes, with progress bars on stderr.
        **kw: more of fit's arguments (margin, split_mode, env, timeout, spread, expert_cache, ...); check is ignored (a
            candidate that fails the check is out).
    Returns:
        Plan: the winner, with predicted_ts and every candidate's row (Plan.ubatch_auto: n_ubatch, n_batch, the
        prediction and what binds it, or why it is out and the fix).
    Raises:
        OutOfMemoryError: when no candidate has a placement (each named, with the fix).
        ConfigError: for link rates of 0 or of the wrong count, or fit's ConfigErrors.
        DeviceSpecError: for a spec that does not parse, or that fit refuses.
        ModelError: for a missing model file, or one llama.cpp cannot load.
        TypeError: for a ctx that is neither a ContextParams nor a dict.
        WorkerError: when a worker dies or times out.
    """
    ctx = fit_context(ctx)
    spec = devspec.parse(devices)
    shared_link = shared_link or spec.one_link
    n_ctx = ctx.n_ctx or FIT.n_ctx
    n_tokens = n_tokens or n_ctx
    check_model_path(model)
    check_switch_env([variant], kw.get("env"))
    kw.pop("check", None)   # (a candidate that leaves layers on the CPU or a device over its target is out)
    cap = min(n_tokens, n_batch or n_tokens)
    ubs = sorted({u for u in candidates if u <= cap} | ({cap} if cap < max(candidates) else set()))
    expert_bytes = expert_bytes_per_layer(model)
    hidden = embedding_length(model) if spec.remote else 0   # (the network to RPC servers is counted)

    mmap = load_mode == "mmap"
    staging = mmap and variant == "patched"
    rated: dict = {}   # what the first dry run's process measured: each device's link, the host's staging copy

    def plan_at(n: int, u: int, nb: Optional[int] = None, group_bytes: bool = False, extra: Optional[dict] = None):
        c = ContextParams(**{**ctx.to_dict(), "n_ctx": n, "n_batch": nb or max(u, min(cap, n)), "n_ubatch": u})
        want = [] if rated or link_gbps is not None and not staging else \
            ["links"] + (["host_copy"] if staging and cached_host_copy() is None else [])
        plan = _fit_plan(model, devices=devices, ctx=c, variant=variant, link_gbps=link_gbps, check=True,
                         checked=True, rates=want, group_bytes=group_bytes,
                         **({**kw, "env": {**(kw.get("env") or {}), **extra}} if extra else kw))
        if want:
            rated.update(links=[d.link for d in plan.devices], host_copy=plan.host_copy_gbps or cached_host_copy())
            if plan.host_copy_gbps:
                cache_host_copy(plan.host_copy_gbps)
        return plan

    def placed_at(n: int, u: int, nb: Optional[int] = None) -> tuple[Optional[Plan], Optional[Exception]]:
        try:
            plan = plan_at(n, u, nb)
            return plan, plan_problem(plan, True)
        except OutOfMemoryError as e:   # (an RPC server's host memory)
            return None, e

    problem_at = lambda n, u, nb=None: placed_at(n, u, nb)[1]
    # LAYER_MAJOR: a group's activations grow with n_batch / n_ubatch, so a candidate without room at the largest
    # n_batch may have it at a smaller one
    groups = variant == "patched" and int(_switch_set(LAYER_MAJOR_VAR, kw.get("env")) or 0) != 0

    rows, placed, failed = [], [], None
    say = (lambda text: print(text, file=sys.stderr)) if progress else (lambda text: None)
    say(f"--ubatch auto: planning n_ubatch {ubs[0]}..{ubs[-1]} (n_batch up to {cap}) for a prompt of {n_tokens} "
        f"tokens on {spec}")
    for u in tqdm(ubs, desc="fit", unit="n_ubatch", file=sys.stderr, disable=not progress, leave=False):
        row = {"n_ubatch": u, "n_batch": cap}
        if failed is not None:
            rows.append({**row, "why": f"not planned: n_ubatch {failed['n_ubatch']} has no placement already (a larger "
                                       "ubatch needs larger compute buffers)", "fix": failed["fix"]})
            continue
        plan, problem = placed_at(n_ctx, u)
        if problem is not None and not isinstance(problem, OutOfMemoryError):
            raise problem   # (fit refused these parameters: so it does every candidate)
        margins, fix_nb = (plan.margins if plan is not None else []), None
        if problem is not None and groups and u < cap:
            nb, smaller, problem_there = _largest_placed(batch_choices(u, cap)[:-1], lambda b: placed_at(n_ctx, u, b))
            if smaller is not None:
                plan, problem, row = smaller, None, {**row, "n_batch": nb,
                                                     "larger_batch": f"n_batch {cap}: {_why(problem)}"}
            else:   # (not even one ubatch a batch, where no group forms)
                problem, fix_nb, row = problem_there, u, {**row, "n_batch": u}
        if problem is not None:
            failed = {**row, "why": _why(problem),
                      "fix": _memory_fix(lambda n: problem_at(n, u, fix_nb), n_ctx, u, margins)}
            rows.append(failed)
            continue
        placed.append((row, plan))
    if not placed:
        raise OutOfMemoryError(f"--ubatch auto: no candidate has a placement for {Path(model).name} on {spec} "
                               f"(n_ctx {n_ctx}):\n" + "\n".join("  " + line for line in grouped_rows(rows)))
    rates = link_rates(spec, link_gbps, len(placed[0][1].devices), rated.get("links"),
                       "pageable" if mmap and not staging else "pinned")
    pkw = dict(expert_bytes=expert_bytes, link_gbps=rates, shared_link=shared_link, n_tokens=n_tokens, hidden=hidden,
               staging_gbps=rated.get("host_copy") if staging else None, n_used=expert_layout(model)[0],
               switches=switches_in_force(variant, kw.get("env")))
    score = lambda pred: pred.ts if pred else float("inf")   # (nothing moves and compute not counted: no bound)
    # the most promising first (the bytes bound: compute not counted), so that the rest can be skipped
    order = sorted(placed, key=lambda rp: (-score(best_batch(rp[1], rp[0]["n_batch"], **pkw)[1]), rp[0]["n_ubatch"]))
    probe = Probe(model, devices, n_tokens, [r["n_ubatch"] for r, _ in placed],
                  # (an RPC server speaks its own variant's protocol; elsewhere every weight resident computes alike)
                  variant=variant if spec.remote else PROBE.variant, servers=[d.server for d in placed[0][1].devices],
                  timeout=kw.get("timeout") or FIT.timeout, progress=progress, hidden=hidden,
                  networks={d.server: d.server_net for d in placed[0][1].devices if d.server}) if count_compute else None
    best, best_ts, placed_nb = None, 0.0, {}
    try:
        for row, plan in order:
            u = row["n_ubatch"]
            if skip and best is not None and probe is not None:
                bound = probe.optimistic(u, CLEARLY_SLOWER)
                ub_ts = score(best_batch(plan, row["n_batch"], bound, **pkw)[1])
                if ub_ts < best_ts:
                    probe.skip(u)
                    rows.append({**row, "host_expert_layers": plan.host_expert_layers,
                                 "why": f"clearly slower: at most {ub_ts:.0f} t/s by the model (its compute at "
                                        f"{CLEARLY_SLOWER:g} of the cheapest measured), the best so far "
                                        f"{best_ts:.0f} t/s"})
                    continue
            compute = probe.compute(u) if probe is not None else None
            placed_nb[u] = plan.ctx["n_batch"]
            nb, pred = best_batch(plan, row["n_batch"], compute, **pkw)
            plan.ctx["n_batch"], plan.predicted_ts = nb, pred.ts if pred else None
            how = sorted({compute_for(compute, i).how.get(u, "") for i in range(len(plan.devices))}) if compute else []
            rows.append({**row, "n_batch": nb, "host_expert_layers": plan.host_expert_layers,
                         "predicted_ts": plan.predicted_ts, "bound": pred.bound if pred else None,
                         "stage_s": pred.stage_s if pred else None, "transfer_s": pred.transfer_s if pred else None,
                         "compute_s": pred.compute_s if pred else None, "network_s": pred.network_s if pred else {},
                         "compute": "; ".join(how), "why": "" if pred else "no host experts: compute binds",
                         "group": pred.group if pred else 1})
            if best is None or (score(pred), u) > (best_ts, best.ctx["n_ubatch"]):
                best, best_ts = plan, score(pred)
    finally:
        if probe is not None:
            probe.close()
    if groups:   # (the winner's memory at the n_batch it runs with, and its group's bytes)
        u, nb = best.ctx["n_ubatch"], best.ctx["n_batch"]
        if nb != placed_nb[u]:
            best = _at_chosen_batch(best, plan_at(n_ctx, u, nb, group_bytes=True))
        else:
            plan_layer_major(best, kw.get("env"), lambda extra: plan_at(n_ctx, u, nb, extra=extra))
    best.ubatch_auto = sorted(rows, key=lambda t: t["n_ubatch"])
    best.host_copy_gbps = best.host_copy_gbps or rated.get("host_copy")
    for d, link in zip(best.devices, rated.get("links") or []):
        d.link = d.link or link
    return best


def _at_chosen_batch(best: Plan, plan: Plan) -> Plan:
    """fit_ubatch's winner with LAYER_MAJOR as `plan`, the plan made again at the n_batch it chose (a smaller one
    than it was placed at keeps a smaller group), with its prediction and links carried over."""
    plan.predicted_ts, plan.host_copy_gbps = best.predicted_ts, best.host_copy_gbps
    for a, d in zip(plan.devices, best.devices):
        a.link = a.link or d.link
    return plan


def _rates_path() -> Path:
    return cache_dir() / "rates.json"


def cached_host_copy() -> Optional[float]:
    """The host's staging copy rate measured before on this machine (PYLLAMA_PP_CACHE/rates.json, by host name and
    usable cores), or None."""
    try:
        return json.loads(_rates_path().read_text()).get("host_copy_gbps", {}).get(_host_key())
    except (OSError, ValueError):
        return None


def cache_host_copy(gbps: float) -> None:
    """Keep the host's staging copy rate for later plans on this machine."""
    try:
        d = json.loads(_rates_path().read_text())
    except (OSError, ValueError):
        d = {}
    d.setdefault("host_copy_gbps", {})[_host_key()] = gbps
    _rates_path().parent.mkdir(parents=True, exist_ok=True)
    _rates_path().write_text(json.dumps(d, indent=1))


def _host_key() -> str:
    return f"{socket.gethostname()}:{usable_cores()}"


OVERLAP_VAR = "GGML_SCHED_PP_OVERLAP"
CACHE_VAR = "GGML_SCHED_PP_EXPERT_CACHE"


def _switch_set(var: str, env: Optional[dict]):
    """A patched switch's value as the fit's workers get it (env, then this process's environment); None: unset."""
    return (env or {}).get(var, os.environ.get(var))


def _plan_copies(plan: Plan, once, check: bool, env: Optional[dict]) -> Plan:
    """The patched build's dry runs measure the compute buffers with the switches in force: by default with
    OVERLAP=2's early expert copies (one more expert copy per device). Where that plan has no room (fit fails,
    leaves layers on the CPU, or a device over its target), plan again without them (OVERLAP=0), and say so. A
    value the user set (env / environment) is kept as it is."""
    forced = _switch_set(OVERLAP_VAR, env)
    if forced is not None:
        plan.switches = {"OVERLAP": int(forced)}
        plan.copies = f"OVERLAP={int(forced)} as set by {OVERLAP_VAR}"
        return plan
    problem = plan_problem(plan, check)
    compute = "/".join(f"{d.compute_bytes / MiB:.1f}" for d in plan.devices)
    plan.switches = {"OVERLAP": 2}
    plan.copies = (f"OVERLAP=2 (default): early expert copies planned, one more expert copy in each device's "
                   f"compute buffer (compute {compute} MiB)")
    if problem is None and (plan.path == "spread" or len(plan.devices) == 1):   # (one device: no spread to lose)
        return plan
    # no placement with the copies, or no spread (upstream's path: often a device without room for its share of
    # the dense-only layers beside the copies): try without them; a spread plan without copies beats one without
    # pipelining-friendly placement, and any plan beats none
    alt = once({OVERLAP_VAR: "0"})
    alt_problem = plan_problem(alt, check)
    if alt_problem is not None or (problem is None and alt.path != "spread"):
        return plan     # no better without the copies (the same path, or no placement either way)
    why = str(problem).split(". Fix:")[0] if problem is not None else f"path {plan.path}: {'; '.join(plan.reasons)}"
    alt.switches = {"OVERLAP": 0}
    alt.copies = (f"OVERLAP=0: no room for OVERLAP=2's early expert copies (with them, compute {compute} MiB and "
                  f"{why}); planned without them")
    alt.seconds += plan.seconds
    alt.host_copy_gbps = plan.host_copy_gbps   # (the rates the first dry run's process measured)
    for a, d in zip(alt.devices, plan.devices):
        a.link = d.link
    return alt


LAYER_MAJOR_VAR = "GGML_SCHED_PP_LAYER_MAJOR"


def layer_major_group(plan: Plan, n_batch: Optional[int] = None) -> int:
    """Ubatches per group as the patched build forms them for a plan at n_batch (default: the plan's): a group runs
    through each layer together on one upload of the layer's host experts (LAYER_MAJOR, patch 0015).

    K = min(LAYER_MAJOR, n_batch / n_ubatch), LAYER_MAJOR=1 meaning every ubatch of a batch, where host experts and
    op offload are in the plan (llama_layer_major::group_size); 1 where no group forms (the switch off, the
    baseline, one ubatch a batch, every weight on the devices).
    """
    v = int(plan.switches.get("LAYER_MAJOR", 0)) if plan.variant == "patched" else 0
    ub = plan.ctx["n_ubatch"]
    per_batch = -(-max(n_batch or plan.ctx["n_batch"], ub) // ub)
    if v <= 0 or per_batch < 2 or not any(plan.host_expert_layers) or not plan.ctx.get("op_offload", True):
        return 1
    return per_batch if v == 1 else min(v, per_batch)


def plan_layer_major(plan: Plan, env: Optional[dict], without=None) -> None:
    """LAYER_MAJOR as the patched plan's dry runs had it (env, then this process's environment): they reserve a
    group's worst case (its ubatches' activations, its whole expert copies) in the devices' compute buffers, so the
    placement already leaves room for it. Records the switch in plan.switches (a run with the plan applies it) and
    plan.layer_major: the switch, the group size and, with `without` (extra env -> the same context's Plan; it is
    given LAYER_MAJOR=0 and the plan's OVERLAP), each device's compute bytes above that plan's: the group's
    bytes. Nothing where the switch is off (the plan is then the one without it)."""
    v = int(_switch_set(LAYER_MAJOR_VAR, env) or 0)
    if v == 0:
        return
    plan.switches["LAYER_MAJOR"] = v
    k = layer_major_group(plan)
    plan.layer_major = {"switch": v, "group": k}
    if k < 2 or without is None:
        return
    off = without({LAYER_MAJOR_VAR: "0", OVERLAP_VAR: str(plan.switches.get("OVERLAP", 2))})
    plan.seconds += off.seconds
    plan.layer_major["bytes"] = [max(0, a.compute_bytes - b.compute_bytes) for a, b in zip(plan.devices, off.devices)]
    if off.host_expert_layers != plan.host_expert_layers or off.n_gpu_layers != plan.n_gpu_layers:
        plan.layer_major["without"] = {"host_expert_layers": off.host_expert_layers, "n_gpu_layers": off.n_gpu_layers}


__all__ = ["fit", "fit_ubatch", "spread_weights", "link_rates", "predict", "predicted_ts", "Prediction", "best_batch",
           "batch_choices", "reserved_bytes", "layer_major_group", "plan_layer_major", "switches_in_force",
           "expected_coverage", "upload_share"]
