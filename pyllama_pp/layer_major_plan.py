"""LAYER_MAJOR (patch 0015) as fit plans it: whether a run's prompts would use it (`wants_layer_major`, the rule fit and
a run without a fit turn it on by), the group a plan's batches form (`layer_major_group`), and the switch, the group
and the group's memory written into a patched plan (`plan_layer_major`)."""
from __future__ import annotations

from typing import Optional

from . import switches
from .plan import Plan
from .workload import Workload


def wants_layer_major(variant: str, given: dict, host_experts: bool, workload: Workload, n_batch: int,
                      n_ubatch: int) -> bool:
    """Whether LAYER_MAJOR is worth a trial where it is not set: the patched build, the switch not given, expert layers
    in host RAM, and the workload's longest prompt giving a batch two or more ubatches (groups form). The trial then
    asks whether the groups' memory fits (fit: beside every resident expert layer; a run's own placement: beside what
    it keeps).

    Args:
        variant: "patched" or "baseline".
        given: the switches the user set, NAME -> value (the run's and the environment's GGML_SCHED_PP_* variables).
        host_experts: some expert layer is in host RAM.
        workload: what the run does (its prompts, timed or not).
        n_batch, n_ubatch: the run's batch sizes.
    Returns:
        bool: whether to try it.
    """
    if variant != "patched" or switches.LAYER_MAJOR in given or not host_experts:
        return False
    per_batch = min(n_batch, workload.longest_prompt)
    return per_batch >= 2 * min(n_ubatch, n_batch)


def layer_major_group(plan: Plan, n_batch: Optional[int] = None) -> int:
    """Ubatches per group as the patched build forms them for a plan at n_batch (default: the plan's): a group runs
    through each layer together on one upload of the layer's host experts (LAYER_MAJOR, patch 0015).

    K = min(LAYER_MAJOR, n_batch / n_ubatch), LAYER_MAJOR=1 meaning every ubatch of a batch, where host experts and
    op offload are in the plan (llama_layer_major::group_size); 1 where no group forms (the switch off, the
    baseline, one ubatch a batch, every weight on the devices).
    """
    v = int(plan.switches.get(switches.LAYER_MAJOR, 0)) if plan.variant == "patched" else 0
    ub = plan.ctx["n_ubatch"]
    per_batch = -(-max(n_batch or plan.ctx["n_batch"], ub) // ub)
    if v <= 0 or per_batch < 2 or not any(plan.host_expert_layers) or not plan.ctx.get("op_offload", True):
        return 1
    return per_batch if v == 1 else min(v, per_batch)


def plan_layer_major(plan: Plan, force: dict, without=None) -> None:
    """LAYER_MAJOR as the patched plan's dry runs had it (`force`: the switches set, NAME -> value): they reserve a
    group's worst case (its ubatches' activations, its whole expert copies) in the devices' compute buffers, so the
    placement already leaves room for it. Records the switch in plan.switches (a run with the plan applies it) and
    plan.layer_major: the switch, the group size and, with `without` (extra switches -> the same context's Plan; it is
    given LAYER_MAJOR=0 and the plan's OVERLAP), each device's compute bytes above that plan's: the group's
    bytes. Nothing where the switch is off (the plan is then the one without it)."""
    v = int(force.get(switches.LAYER_MAJOR) or 0)
    if v == 0:
        return
    plan.switches[switches.LAYER_MAJOR] = v
    k = layer_major_group(plan)
    plan.layer_major = {"switch": v, "group": k}
    if k < 2 or without is None:
        return
    off = without({switches.LAYER_MAJOR: 0, switches.OVERLAP: plan.switches.get(switches.OVERLAP, 2)})
    plan.seconds += off.seconds
    plan.layer_major["bytes"] = [max(0, a.compute_bytes - b.compute_bytes) for a, b in zip(plan.devices, off.devices)]
    if off.host_expert_layers != plan.host_expert_layers or off.n_gpu_layers != plan.n_gpu_layers:
        plan.layer_major["without"] = {"host_expert_layers": off.host_expert_layers, "n_gpu_layers": off.n_gpu_layers}


__all__ = ["wants_layer_major", "layer_major_group", "plan_layer_major"]
