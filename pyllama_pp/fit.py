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

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from . import devices as devspec
from .compute import compute_for, probe
from .defaults import FIT, UBATCH_CANDIDATES
from .errors import ConfigError, DeviceSpecError, OutOfMemoryError
from .model_file import check_model_path, embedding_length, expert_bytes_per_layer
from .params import SPLIT_MODES, ContextParams, as_context
from .plan import MiB, Plan, check_plan, plan_from_result, plan_problem
from .rpc.planning import check_server_host_memory, network_seconds, server_copy_bytes
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
        env: Optional[dict] = None, timeout: Optional[float] = FIT.timeout, spread="equal", link_gbps=None) -> Plan:
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
    Returns:
        Plan: the plan (its devices, layers, host-expert layers, overrides, expected memory and switches).
    Raises:
        ModelError: for a missing or bad model file.
        DeviceSpecError: for a spec that does not parse, has no accelerators, has a VDEV without a memory budget,
            or asks for split mode row on VDEVs.
        ConfigError: for a bad split_mode, margin or spread, link rates of 0 or of the wrong count, or a fit that
            refuses the given parameters.
        TypeError: for a ctx that is neither a ContextParams nor a dict.
        OutOfMemoryError: when fit finds no placement, or (unless check=False) leaves whole layers on the CPU or
            plans a device over its target.
        WorkerError: when the worker dies or times out.
    """
    return _fit(model, devices, ctx, variant, margin, split_mode, n_ctx_min, check, env, timeout, spread, link_gbps)


def _fit(model, devices=FIT.devices, ctx=None, variant: str = FIT.variant, margin=None,
         split_mode: str = FIT.split_mode, n_ctx_min: int = 0, check: bool = True, env: Optional[dict] = None, timeout: Optional[float] = FIT.timeout,
         spread="equal", link_gbps=None, checked: bool = False) -> Plan:
    """fit's work; `checked`: the caller has checked the model file and the switch environment (fit_ubatch, once
    for all its candidates)."""
    if not checked:
        check_model_path(model)
    spec = devspec.parse(devices)
    spec.fit_check(split_mode)   # (no accelerators, a device without a budget, a split its devices lack)
    if split_mode not in SPLIT_MODES:
        raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {split_mode!r}")
    ctx = fit_context(ctx)
    margins = _margins(margin, spec)
    server_copies = server_copy_bytes(model, spec, variant,
                                      str(_switch_set("GGML_SCHED_PP_RPC_HOST", env)) != "0")
    margins = [m + server_copies for m in margins]
    weights = spread_weights(spread, spec, link_gbps)
    if weights:
        env = {**(env or {}), "LLAMA_FIT_SPREAD_WEIGHTS": ",".join(f"{w:g}" for w in weights)}
    if not checked:
        check_switch_env([variant], env)
    job = {"kind": "fit", "model": str(model), "devices": spec.to_dict(), "ctx": ctx.to_dict(),
           "split_mode": split_mode, "margins": margins, "n_ctx_min": n_ctx_min}

    def once(extra: dict) -> Plan:
        res = run_job(job, variant, timeout=timeout, env={**(env or {}), **extra} or None)
        return plan_from_result(res, variant, str(model), spec, {**ctx.to_dict(), "split_mode": split_mode}, margins)

    plan = once({})
    if variant == "patched":
        if plan.devices:   # (one device is pipelined too, GATE)
            plan = _plan_copies(plan, once, check, env)
        plan.spread_weights = weights
        if server_copies:
            plan.copies += (f"; on each server, {server_copies / MiB:.1f} MiB of its device kept for its own expert "
                            f"copies (two expert tensors: RPC_HOST with OVERLAP=2), in the margin")
            plan.copies += check_server_host_memory(plan, expert_bytes_per_layer(model))
    return check_plan(plan, check)




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
    """

    ts: float
    stage_s: list
    transfer_s: list
    compute_s: Optional[list]
    bound: str
    network_s: dict = field(default_factory=dict)


def link_rates(spec: devspec.DeviceSpec, link_gbps, n_devices: int) -> list[float]:
    """Each device's host link rate in GB/s: the ones given, the spec's own (a VDEV's), or its kind's default
    (DeviceSpec.default_link_gbps: a PCIe 5 x16 link's 55 GB/s).

    Args:
        spec: the parsed device spec.
        link_gbps: rates given (numbers or "55GBps"), or None.
        n_devices: how many devices the plan has.
    Returns:
        One rate per device.
    Raises:
        ConfigError: for a rate of 0 or a count other than n_devices.
    """
    rates = [devspec.parse_rate(x) for x in link_gbps] if link_gbps is not None else spec.link_rates()
    if rates is None:
        rates = [spec.default_link_gbps] * n_devices
    return _checked_rates(rates, spec, "--ubatch auto", link_gbps is not None, n_devices)


def predict(plan: Plan, expert_bytes: float, link_gbps: Sequence[float], shared_link: bool = False,
            compute: Optional[dict] = None, n_tokens: Optional[int] = None, hidden: int = 0) -> Optional[Prediction]:
    """A plan's prompt throughput from the bytes each link moves and, with `compute`, each device's compute.

    Per ubatch a device moves its host-expert layers' experts (near-full coverage: whole tensors) over its link, x
    seconds a layer, and computes its layers, c seconds a layer (the probe's). Devices that are parts of one GPU
    (a probe that ran them together: LayerCompute.shared) do not compute side by side as separate GPUs do: each
    ubatch takes the longer of all their layers' compute and all their copies (beside it, the first one exposed). The patched build copies a layer's
    experts beside the compute of the layer before (OVERLAP=2): the first copy is exposed, then each layer takes the
    longer of its copy and the compute before it (x + c + (h - 1) max(x, c) + (n - h) c); with OVERLAP=0 copies and
    compute add up. Pipelined stages overlap: a batch of k ubatches takes (k - 1) times the slowest stage plus every
    stage once (the fill); devices on one link also wait for the link's total. The baseline's stages and copies run
    one after the other. With `hidden`, RPC devices whose network fit measured (DevicePlan.server_net) also
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
    Returns:
        A Prediction, or None when nothing moves and compute is not counted (the bytes bound says nothing).
    """
    ub, nb, nd = plan.ctx["n_ubatch"], plan.ctx["n_batch"], len(plan.devices)
    n_tokens = n_tokens or plan.n_ctx
    xs = [expert_bytes / (r * 1e9) for r in link_gbps]
    transfer = [d.host_expert_layers * x for d, x in zip(plan.devices, xs)]
    net_dev, servers = network_seconds(plan, hidden, n_tokens)
    if compute is None and not any(transfer) and not servers:
        return None
    cs = [compute_for(compute, i).per_ubatch(ub) if compute else 0.0 for i in range(nd)]
    comp = [d.n_layers * c for d, c in zip(plan.devices, cs)]
    if compute:   # (embeddings and output: the last device's, once a ubatch)
        last = compute_for(compute, nd - 1)
        comp[-1] += last.outside_s[ub] * ub / last.n_tokens
    patched = plan.variant == "patched"
    overlap = patched and plan.switches.get("OVERLAP", 2) == 2
    stage = []
    for d, x, c, t, k in zip(plan.devices, xs, cs, transfer, comp):
        h, rest = d.host_expert_layers, k - d.host_expert_layers * c
        stage.append(x + c + (h - 1) * max(x, c) + rest if overlap and h > 0 else t + k)
    fill = sum(stage) + sum(net_dev)
    net = {k: sum(net_dev[i] + stage[i] for i in idx) for k, idx in servers.items()}   # (each server's cycle)
    n_ub = max(1, nb // ub)
    chunks, tail = divmod(n_tokens, nb)
    if patched and compute and compute_for(compute, 0).shared:
        # parts of one GPU, pipelined: the probe ran them together, so a layer's time is what it adds to the whole
        # pipeline; every part's copies share the link and go beside that compute, the first one exposed
        n_ubatches = chunks * n_ub + (-(-tail // ub) if tail else 0)
        c_all, x_all = sum(comp), sum(transfer)
        total = n_ubatches * (max(c_all, x_all) if overlap else c_all + x_all) + (xs[0] if overlap and x_all else 0.0)
    elif patched:
        slowest = max(max(stage), sum(transfer) if shared_link else 0.0, max(net.values(), default=0.0))
        total = chunks * ((n_ub - 1) * slowest + fill)
        if tail:
            total += (-(-tail // ub) - 1) * slowest + fill
    else:
        total = -(-n_tokens // ub) * fill
    if total <= 0:
        return None
    i = max(range(nd), key=lambda j: stage[j])
    bound = "compute" if compute and comp[i] >= transfer[i] else "transfer"
    if patched and net and max(net.values()) > max(stage) and max(net_dev) >= max(transfer + comp):
        bound = "network"
    return Prediction(ts=n_tokens / total, stage_s=stage, transfer_s=transfer, compute_s=comp if compute else None,
                      bound=bound, network_s=net)


def predicted_ts(plan: Plan, expert_bytes: float, link_gbps: Sequence[float], shared_link: bool = False,
                 compute: Optional[dict] = None, n_tokens: Optional[int] = None, hidden: int = 0) -> Optional[float]:
    """predict()'s prompt tokens per second (None where it predicts nothing)."""
    p = predict(plan, expert_bytes, link_gbps, shared_link, compute, n_tokens, hidden)
    return p.ts if p else None


def fit_ubatch(model: Union[str, os.PathLike], devices=FIT.devices, ctx=None, variant: str = FIT.variant,
               candidates: Sequence[int] = UBATCH_CANDIDATES, link_gbps=None, shared_link: bool = False,
               count_compute: bool = True, n_tokens: Optional[int] = None, **kw) -> Plan:
    """fit with n_ubatch chosen by the throughput it predicts from bytes per link and measured compute.

    Each candidate (up to n_ctx) is planned with n_batch = 8 x n_ubatch (at most n_ctx, at least ctx.n_batch, a
    multiple of n_ubatch), so that a batch keeps the pipeline full; a candidate whose compute buffers leave no
    placement is out. With count_compute (the default) a probe measures a layer's compute on the devices at every
    candidate (compute.probe, cached); each plan's prediction (predict) counts its copies, its compute and the
    pipeline's fill; the highest wins (ties: the larger n_ubatch).

    Args:
        model: the GGUF file.
        devices: a device spec, as fit takes it.
        ctx: the context, as fit takes it; its n_ubatch and n_batch are replaced (n_ctx 0: FIT's n_ctx).
        variant: "patched" (default) or "baseline".
        candidates: the n_ubatch values to try.
        link_gbps: each device's host link rate in GB/s (default: a VDEV's own; CUDA 55 GB/s, a PCIe 5 x16 link).
        shared_link: the devices share one link (one GPU split in two).
        count_compute: probe the devices' compute and count it (False: the bytes bound alone).
        n_tokens: the prompt's length the prediction is for (default: n_ctx).
        **kw: more of fit's arguments (margin, split_mode, env, timeout, spread, ...); check is ignored (a
            candidate that fails the check is out).
    Returns:
        Plan: the winner, with predicted_ts and every candidate's prediction (Plan.ubatch_auto).
    Raises:
        OutOfMemoryError: when no candidate has a placement.
        ConfigError: for link rates of 0 or of the wrong count, or fit's ConfigErrors.
        DeviceSpecError: for a spec that does not parse, or that fit refuses.
        ModelError: for a missing model file, or one llama.cpp cannot load.
        TypeError: for a ctx that is neither a ContextParams nor a dict.
        WorkerError: when a worker dies or times out.
    """
    ctx = fit_context(ctx)
    spec = devspec.parse(devices)
    n_ctx = ctx.n_ctx or FIT.n_ctx
    check_model_path(model)
    check_switch_env([variant], kw.get("env"))
    expert_bytes = expert_bytes_per_layer(model)
    hidden = embedding_length(model) if spec.remote else 0   # (the network to RPC servers is counted)
    tried, best, best_score, rates, placed = [], None, 0.0, None, []
    kw.pop("check", None)   # (a candidate that leaves layers on the CPU or a device over its target is out)
    for ub in [c for c in candidates if c <= n_ctx]:
        nb = min(n_ctx, max(ctx.n_batch, 8 * ub)) // ub * ub
        c = ContextParams(**{**ctx.to_dict(), "n_ctx": n_ctx, "n_batch": nb, "n_ubatch": ub})
        row = {"n_ubatch": ub, "n_batch": nb}
        try:
            plan = _fit(model, devices=devices, ctx=c, variant=variant, link_gbps=link_gbps, check=True, checked=True,
                        **kw)
        except OutOfMemoryError as e:
            m = re.search(r"leaves (all \d+ layers and the output layer|\d+ of \d+ layers \(\S+\)) on the CPU|over its "
                          r"target", str(e))
            tried.append({**row, "why": f"no placement ({m.group(0) if m else str(e).split('. Fix:')[0][-80:]})"})
            continue
        if rates is None:   # (the devices' links: known from the spec, or once the first plan counts the GPUs)
            rates = link_rates(spec, link_gbps, len(plan.devices))
        placed.append((row, plan))
    n_tokens = n_tokens or n_ctx
    probed = probe(model, devices, [r["n_ubatch"] for r, _ in placed], n_tokens,
                   timeout=kw.get("timeout") or FIT.timeout) if count_compute and placed else None
    for row, plan in placed:
        pred = predict(plan, expert_bytes, rates, shared_link, probed, n_tokens, hidden)
        plan.predicted_ts = pred.ts if pred else None
        tried.append({**row, "host_expert_layers": plan.host_expert_layers, "predicted_ts": plan.predicted_ts,
                      "bound": pred.bound if pred else None,
                      "stage_s": pred.stage_s if pred else None, "transfer_s": pred.transfer_s if pred else None,
                      "compute_s": pred.compute_s if pred else None, "network_s": pred.network_s if pred else {},
                      "why": "" if plan.predicted_ts else "no host experts: compute binds"})
        score = plan.predicted_ts or float("inf")   # (no host experts, compute not counted: the bound says nothing)
        if best is None or score >= best_score:
            best, best_score = plan, score
    if best is None:
        raise OutOfMemoryError(f"--ubatch auto: no n_ubatch of {list(candidates)} up to n_ctx {n_ctx} has a placement "
                               f"for {Path(model).name} on {spec}: " + "; ".join(t["why"] for t in tried))
    best.ubatch_auto = sorted(tried, key=lambda t: t["n_ubatch"])
    return best


OVERLAP_VAR = "GGML_SCHED_PP_OVERLAP"


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
    return alt


__all__ = ["fit", "fit_ubatch", "spread_weights", "link_rates", "predict", "predicted_ts", "Prediction"]
