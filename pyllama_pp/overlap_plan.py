"""OVERLAP (patch 0009) as fit plans it: the patched build's dry runs measure the compute buffers with OVERLAP=2's early
expert copies; where that leaves no room, fit plans again without them (`plan_copies`)."""
from __future__ import annotations

from . import switches
from .plan import MiB, Plan, plan_problem


def plan_copies(plan: Plan, once, check: bool, force: dict) -> Plan:
    """The patched build's dry runs measure the compute buffers with the switches in force: by default with
    OVERLAP=2's early expert copies (one more expert copy per device). Where that plan has no room (fit fails,
    leaves layers on the CPU, or a device over its target), plan again without them (OVERLAP=0), and say so. A
    value the user set (`force`: the switches set, NAME -> value) is kept as it is; `once(extra switches)` plans
    again."""
    forced = force.get(switches.OVERLAP)
    if forced is not None:
        plan.switches = {switches.OVERLAP: int(forced)}
        plan.copies = f"OVERLAP={int(forced)} as set"
        return plan
    problem = plan_problem(plan, check)
    compute = "/".join(f"{d.compute_bytes / MiB:.1f}" for d in plan.devices)
    plan.switches = {switches.OVERLAP: 2}
    plan.copies = (f"OVERLAP=2 (default): early expert copies planned, one more expert copy in each device's "
                   f"compute buffer (compute {compute} MiB)")
    if problem is None and (plan.path == "spread" or len(plan.devices) == 1):   # (one device: no spread to lose)
        return plan
    # no placement with the copies, or no spread (upstream's path: often a device without room for its share of
    # the dense-only layers beside the copies): try without them; a spread plan without copies beats one without
    # pipelining-friendly placement, and any plan beats none
    alt = once({switches.OVERLAP: 0})
    alt_problem = plan_problem(alt, check)
    if alt_problem is not None or (problem is None and alt.path != "spread"):
        return plan     # no better without the copies (the same path, or no placement either way)
    why = str(problem).split(". Fix:")[0] if problem is not None else f"path {plan.path}: {'; '.join(plan.reasons)}"
    alt.switches = {switches.OVERLAP: 0}
    alt.copies = (f"OVERLAP=0: no room for OVERLAP=2's early expert copies (with them, compute {compute} MiB and "
                  f"{why}); planned without them")
    alt.take_rates(plan)
    return alt


__all__ = ["plan_copies"]
