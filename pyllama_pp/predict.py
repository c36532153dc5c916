"""fit's model of time: what a plan's prompt takes, phase by phase, from the bytes each host link moves and the
compute each device does, as the planner (pyllama_pp.planner) and the benches predict it.

No process is started here: the rates (links, the host's staging copy) and the compute (`LayerCompute`, what the
probe in pyllama_pp.compute measured) are handed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from . import devices as devspec
from . import switches as sw
from .errors import ConfigError
from .layer_major_plan import layer_major_group
from .plan import Plan
from .servers.planning import network_seconds


@dataclass
class LayerCompute:
    """What the probe found for one device: seconds one MoE layer takes over a prompt of n_tokens at each n_ubatch,
    and the seconds outside the layers (embeddings, output) per prompt.

    Attributes:
        device: the device spec it ran on.
        n_tokens: the prompt's length.
        layer_s: n_ubatch -> seconds of one MoE layer over the whole prompt.
        outside_s: n_ubatch -> seconds outside the layers over the whole prompt.
        shared: measured on every device of a spec whose devices are parts of one GPU, pipelined together: a layer's
            time is what one more layer adds to the whole pipeline, wherever it is.
        how: n_ubatch -> how it was found: "measured" (on the prompt itself), "measured at N tokens" (a short prompt,
            carried to n_tokens by attention's part) or "estimated from n_ubatch U" (not run: U's per-token part).
        kv_s: attention's part: seconds one layer takes per key a query reads (0: not calibrated, or not needed).
    """

    device: str
    n_tokens: int
    layer_s: dict = field(default_factory=dict)
    outside_s: dict = field(default_factory=dict)
    shared: bool = False
    how: dict = field(default_factory=dict)
    kv_s: float = 0.0

    def per_ubatch(self, n_ubatch: int) -> float:
        """Seconds one MoE layer computes one ubatch of n_ubatch tokens (the prompt's mean)."""
        return self.layer_s[n_ubatch] * n_ubatch / self.n_tokens


def compute_for(probed: dict[int, LayerCompute], device_index: int) -> LayerCompute:
    """The probe result that stands for a device (its own, or the one for every device)."""
    return probed.get(device_index) or probed[-1]


def checked_rates(rates: list, spec: devspec.DeviceSpec, what: str, given: bool, n_devices: int = 0) -> list:
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
        return checked_rates([devspec.parse_rate(x) for x in link_gbps], spec, "--ubatch auto", True, n_devices)
    own = spec.link_rates() or [spec.default_link_gbps] * n_devices
    if measured is not None and len(measured) == len(own):
        own = [(m or {}).get(f"{source}_gbps") or r for m, r in zip(measured, own)]
    return checked_rates(own, spec, "--ubatch auto", False, n_devices)


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
    if variant != "patched" or not int(switches.get(sw.UPLOAD_ALL, 1)):
        return cov
    min_sel = int(switches.get(sw.UPLOAD_ALL_MIN, -1))
    min_sel = (2 if in_flight else 4) * n_expert if min_sel < 0 else min_sel
    links = int(switches.get(sw.LINKS, 0)) or n_links
    min_cov = int(switches.get(sw.UPLOAD_ALL_MIN_COV, -1))
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
    overlap = patched and plan.switches.get(sw.OVERLAP, 2) == 2
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


__all__ = ["LayerCompute", "compute_for", "checked_rates", "Prediction", "link_rates", "expected_coverage",
           "upload_share", "predict", "predicted_ts", "batch_choices", "best_batch", "CLEARLY_SLOWER"]
