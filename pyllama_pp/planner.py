"""fit's planner: (n_batch, n_ubatch) chosen together by the throughput pyllama_pp.predict gives for each candidate's
placement (pyllama_pp.placement), with the compute a probe measures; the probe is handed in (pyllama_pp.compute's
`Probe`, or a stand-in), so planning starts no process of its own beyond fit's dry runs."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from tqdm import tqdm

from . import devices as devspec
from . import switches as switches_mod
from .defaults import CONTEXT, FIT, PROBE, UBATCH_CANDIDATES, UBATCH_MEASURE
from .errors import OutOfMemoryError
from .layer_major_plan import plan_layer_major
from .model_file import embedding_length, expert_bytes_per_layer, expert_layout
from .params import ContextParams
from .placement import _fit_plan, cached_rate, check_inputs, fit_context, host_copy_key, keep_rate
from .plan import MiB, Plan, grouped_rows, plan_problem
from .predict import CLEARLY_SLOWER, batch_choices, best_batch, compute_for, link_rates, predict
from .workload import Workload


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
               load_mode: str = CONTEXT.load_mode, skip: bool = True, progress: bool = False,
               switches: Optional[dict] = None, probe: Optional[Callable] = None,
               contenders: Optional[list] = None, **kw) -> Plan:
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
        switches: the patched build's switches, NAME -> value, as fit takes them (the dry runs measure with them).
        probe: what measures compute: called as pyllama_pp.compute.Probe is (model, devices, n_tokens, ubatches,
            variant=, servers=, timeout=, progress=, hidden=, networks=) and used as one; None: compute is not
            counted (pyllama_pp.fit.fit_ubatch hands in the Probe).
        n_tokens: the prompt's length the prediction is for (default: n_ctx).
        n_batch: the largest n_batch to take (default: the prompt's length).
        load_mode: how the run keeps host weights: "none" (pinned) or "mmap" (pageable: the patched build stages
            them through pinned slots at the host's copy rate, the baseline copies them as they are).
        skip: leave out, unprobed, a candidate even its best case shows slower than the best so far (False: predict
            every candidate with a placement, as a bench that measures them all needs).
        progress: say what it plans and probes, with progress bars on stderr.
        contenders: a list to add the other candidates predicted within UBATCH_MEASURE.band of the winner to (the
            closest, at most UBATCH_MEASURE.most - 1), made final as the winner is (the facade measures them:
            pyllama_pp.fit.fit_ubatch); None: none is made final.
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
    check_inputs(model, variant, kw.get("env"))
    kw.pop("check", None)   # (a candidate that leaves layers on the CPU or a device over its target is out)
    n_tokens = n_tokens or ctx.n_ctx or FIT.n_ctx
    search = _Search(model, devices, ctx, variant, link_gbps, n_tokens, n_batch, load_mode, switches, kw)
    rows, placed = search.place(candidates, progress)
    rows, best = search.choose(rows, placed, shared_link, probe if count_compute else None, skip, progress)
    if contenders is not None:
        contenders += [search.finish(p, rows) for p in search.near(best)]
    return search.finish(best, rows)


class _Search:
    """fit_ubatch's search, step by step: the candidates' plans (`place`, at the largest n_batch they have room for),
    the prediction of each with its compute (`choose`) and the winner made final (`finish`). Holds what every step
    shares: the model's facts, the switches, and the rates the first dry run's process measured."""

    def __init__(self, model, devices, ctx: ContextParams, variant: str, link_gbps, n_tokens: int,
                 n_batch: Optional[int], load_mode: str, switches: Optional[dict], kw: dict):
        self.model, self.devices, self.ctx, self.variant, self.link_gbps, self.kw = \
            model, devices, ctx, variant, link_gbps, kw
        self.spec = devspec.parse(devices)
        self.n_ctx, self.n_tokens = ctx.n_ctx or FIT.n_ctx, n_tokens
        self.cap = min(n_tokens, n_batch or n_tokens)
        self.hidden = embedding_length(model) if self.spec.remote else 0   # (the network to RPC servers is counted)
        # (the switches the dry runs and runs get: a GGML_SCHED_PP_* variable's as one given)
        self.given = switches_mod.user_set(switches, kw.get("env")) if variant == "patched" else {}
        self.load_mode, self.mmap = load_mode, load_mode == "mmap"
        self.staging = self.mmap and variant == "patched"
        # LAYER_MAJOR: a group's activations grow with n_batch / n_ubatch, so a candidate without room at the
        # largest n_batch may have it at a smaller one
        self.groups = variant == "patched" and int(self.given.get(switches_mod.LAYER_MAJOR) or 0) != 0
        self.rated: dict = {}   # what the first dry run's process measured: each device's link, the staging copy
        self.placed_nb: dict = {}
        self.predicted: list[Plan] = []   # the candidates predicted, at their best n_batch

    def plan_at(self, n: int, u: int, nb: Optional[int] = None, group_bytes: bool = False,
                extra: Optional[dict] = None) -> Plan:
        """The plan of n_ctx n, n_ubatch u and n_batch nb (default: the largest the prompt and n_ctx allow)."""
        c = ContextParams(**{**self.ctx.to_dict(), "n_ctx": n, "n_batch": nb or max(u, min(self.cap, n)),
                             "n_ubatch": u})
        copy_key = host_copy_key(self.given)   # (the staging copy's rate by its copier threads)
        want = [] if self.rated or self.link_gbps is not None and not self.staging else \
            ["links"] + (["host_copy"] if self.staging and cached_rate("host_copy_gbps", copy_key) is None else [])
        plan = _fit_plan(self.model, devices=self.devices, ctx=c, variant=self.variant, link_gbps=self.link_gbps,
                         check=True, checked=True, rates=want, group_bytes=group_bytes,
                         given={**self.given, **(extra or {})}, **self.kw)
        if want:
            if plan.host_copy_gbps:
                plan.host_copy_gbps = keep_rate("host_copy_gbps", plan.host_copy_gbps, copy_key)
            self.rated.update(links=[d.link for d in plan.devices],
                              host_copy=plan.host_copy_gbps or cached_rate("host_copy_gbps", copy_key))
        return plan

    def placed_at(self, n: int, u: int, nb: Optional[int] = None) -> tuple[Optional[Plan], Optional[Exception]]:
        """plan_at's plan and what keeps it from being used (None: nothing)."""
        try:
            plan = self.plan_at(n, u, nb)
            return plan, plan_problem(plan, True)
        except OutOfMemoryError as e:   # (an RPC server's host memory)
            return None, e

    def place(self, candidates: Sequence[int], progress: bool) -> tuple[list, list]:
        """Each candidate n_ubatch planned, upward, until one has no placement: (rows of the candidates that are out,
        with why and a fix; [(row, plan)] of those placed)."""
        cap, n_ctx = self.cap, self.n_ctx
        ubs = sorted({u for u in candidates if u <= cap} | ({cap} if cap < max(candidates) else set()))
        rows, placed, failed = [], [], None
        if progress:
            print(f"--ubatch auto: planning n_ubatch {ubs[0]}..{ubs[-1]} (n_batch up to {cap}) for a prompt of "
                  f"{self.n_tokens} tokens on {self.spec}", file=sys.stderr)
        for u in tqdm(ubs, desc="fit", unit="n_ubatch", file=sys.stderr, disable=not progress, leave=False):
            row = {"n_ubatch": u, "n_batch": cap}
            if failed is not None:
                rows.append({**row, "why": f"not planned: n_ubatch {failed['n_ubatch']} has no placement already (a "
                                           "larger ubatch needs larger compute buffers)", "fix": failed["fix"]})
                continue
            plan, problem = self.placed_at(n_ctx, u)
            if problem is not None and not isinstance(problem, OutOfMemoryError):
                raise problem   # (fit refused these parameters: so it does every candidate)
            margins, fix_nb = (plan.margins if plan is not None else []), None
            if problem is not None and self.groups and u < cap:
                nb, smaller, problem_there = _largest_placed(batch_choices(u, cap)[:-1],
                                                             lambda b: self.placed_at(n_ctx, u, b))
                if smaller is not None:
                    plan, problem, row = smaller, None, {**row, "n_batch": nb,
                                                         "larger_batch": f"n_batch {cap}: {_why(problem)}"}
                else:   # (not even one ubatch a batch, where no group forms)
                    problem, fix_nb, row = problem_there, u, {**row, "n_batch": u}
            if problem is not None:
                failed = {**row, "why": _why(problem),
                          "fix": _memory_fix(lambda n: self.placed_at(n, u, fix_nb)[1], n_ctx, u, margins)}
                rows.append(failed)
                continue
            placed.append((row, plan))
        if not placed:
            raise OutOfMemoryError(f"--ubatch auto: no candidate has a placement for {Path(self.model).name} on "
                                   f"{self.spec} (n_ctx {n_ctx}):\n" +
                                   "\n".join("  " + line for line in grouped_rows(rows)))
        return rows, placed

    def choose(self, rows: list, placed: list, shared_link: bool, probe: Optional[Callable], skip: bool,
               progress: bool) -> tuple[list, Plan]:
        """Each placed candidate predicted at its best n_batch, with the compute the probe measures (the most
        promising first; one even its best case shows slower than the best so far is out, unprobed, with skip):
        (every candidate's row, the winner)."""
        spec, variant = self.spec, self.variant
        pkw = predict_terms(self.model, spec, variant, len(placed[0][1].devices), self.load_mode, self.n_tokens,
                            link_gbps=self.link_gbps, links=self.rated.get("links"),
                            host_copy=self.rated.get("host_copy"), env=self.kw.get("env"), given=self.given,
                            shared_link=shared_link)
        score = lambda pred: pred.ts if pred else float("inf")   # (nothing moves and compute not counted: no bound)
        # the most promising first (the bytes bound: compute not counted), so that the rest can be skipped
        order = sorted(placed, key=lambda rp: (-score(best_batch(rp[1], rp[0]["n_batch"], **pkw)[1]),
                                               rp[0]["n_ubatch"]))
        first = placed[0][1].devices
        probe = probe(self.model, self.devices, self.n_tokens, [r["n_ubatch"] for r, _ in placed],
                      # (an RPC server speaks its own variant's protocol; elsewhere every weight resident computes
                      # alike)
                      variant=variant if spec.remote else PROBE.variant, servers=[d.server for d in first],
                      timeout=self.kw.get("timeout") or FIT.timeout, progress=progress, hidden=self.hidden,
                      networks={d.server: d.server_net for d in first if d.server}) if probe is not None else None
        best, best_ts = None, 0.0
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
                self.placed_nb[u] = plan.ctx["n_batch"]
                nb, pred = best_batch(plan, row["n_batch"], compute, **pkw)
                plan.ctx["n_batch"], plan.predicted_ts = nb, pred.ts if pred else None
                how = sorted({compute_for(compute, i).how.get(u, "") for i in range(len(plan.devices))}) \
                    if compute else []
                rows.append({**row, "n_batch": nb, "host_expert_layers": plan.host_expert_layers,
                             "predicted_ts": plan.predicted_ts, "bound": pred.bound if pred else None,
                             "stage_s": pred.stage_s if pred else None,
                             "transfer_s": pred.transfer_s if pred else None,
                             "compute_s": pred.compute_s if pred else None,
                             "network_s": pred.network_s if pred else {}, "compute": "; ".join(how),
                             "why": "" if pred else "no host experts: compute binds",
                             "group": pred.group if pred else 1})
                if pred:
                    self.predicted.append(plan)
                if best is None or (score(pred), u) > (best_ts, best.ctx["n_ubatch"]):
                    best, best_ts = plan, score(pred)
        finally:
            if probe is not None:
                probe.close()
        return rows, best

    def near(self, best: Plan) -> list[Plan]:
        """The other candidates predicted within UBATCH_MEASURE.band of `best`, the closest first, as many as the
        facade measures beside it (a candidate made final costs a dry run with LAYER_MAJOR)."""
        if not best.predicted_ts:
            return []
        bar = (1 - UBATCH_MEASURE.band) * best.predicted_ts
        return sorted((p for p in self.predicted if p is not best and p.predicted_ts >= bar),
                      key=lambda p: -p.predicted_ts)[:max(0, UBATCH_MEASURE.most - 1)]

    def finish(self, best: Plan, rows: list) -> Plan:
        """The winner as it runs: with LAYER_MAJOR its memory at the n_batch it runs with and its group's bytes;
        every candidate's row, and the rates measured."""
        if self.groups:
            u, nb = best.ctx["n_ubatch"], best.ctx["n_batch"]
            if nb != self.placed_nb[u]:
                best = _at_chosen_batch(best, self.plan_at(self.n_ctx, u, nb, group_bytes=True))
            else:
                plan_layer_major(best, self.given, lambda extra: self.plan_at(self.n_ctx, u, nb, extra=extra))
        best.ubatch_auto = sorted(rows, key=lambda t: t["n_ubatch"])
        best.host_copy_gbps = best.host_copy_gbps or self.rated.get("host_copy")
        for d, link in zip(best.devices, self.rated.get("links") or []):
            d.link = d.link or link
        return best


def predict_terms(model, spec: devspec.DeviceSpec, variant: str, n_devices: int, load_mode: str,
                  n_tokens: Optional[int] = None, *, link_gbps=None, links: Optional[Sequence] = None,
                  host_copy: Optional[float] = None, env: Optional[dict] = None, given: Optional[dict] = None,
                  shared_link: bool = False) -> dict:
    """predict's arguments besides the plan and the compute, as fit_ubatch predicts a pair: the model's expert bytes
    and experts a token uses, each link's rate (given, else as fit measured it, else the spec's: the pinned rate
    where host weights are pinned or the patched build stages them, the pageable one for the baseline on an mmap-ed
    model), the staging copy, the network to RPC servers and the switches in force.

    Args:
        model: the GGUF file.
        spec: the parsed device spec.
        variant: "patched" or "baseline".
        n_devices: the plan's devices.
        load_mode: "none" (pinned) or "mmap".
        n_tokens: the prompt's length (None: the plan's n_ctx).
        link_gbps: rates given (predict.link_rates), or None.
        links: each device's measured link (DevicePlan.link), or None.
        host_copy: the host's staging copy in GB/s (Plan.host_copy_gbps), or None.
        env: the runs' environment (its GGML_SCHED_PP_* variables are in force).
        given: the switches the runs get (a plan's own override them in predict).
        shared_link: the devices share one link (besides a spec whose devices do).
    Returns:
        dict: keyword arguments for predict.predict / best_batch.
    Raises:
        ConfigError: for a link rate of 0 (an unthrottled VDEV) or of the wrong count.
    """
    staging = load_mode == "mmap" and variant == "patched"
    rates = link_rates(spec, link_gbps, n_devices, links, "pageable" if load_mode == "mmap" and not staging
                       else "pinned")
    return dict(expert_bytes=expert_bytes_per_layer(model), link_gbps=rates, shared_link=shared_link or spec.one_link,
                n_tokens=n_tokens, hidden=embedding_length(model) if spec.remote else 0,
                staging_gbps=host_copy if staging else None, n_used=expert_layout(model)[0],
                switches=switches_mod.user_set(given, env, variant))


def prompt_seconds(plan: Plan, model, workload: Workload, load_mode: str = CONTEXT.load_mode,
                   given: Optional[dict] = None) -> float:
    """The seconds a workload's prompts spend moving host experts on a plan, as fit_ubatch predicts a pair (predict at
    the plan's n_batch and n_ubatch, with its LAYER_MAJOR group), compute not counted (a plan of fit's has no probe:
    the bytes bound; every plan of one context computes alike, so two plans' difference is the link time between them).

    Args:
        plan: a fit plan (its links as fit measured them, else its spec's).
        model: the GGUF file it was made for.
        workload: what the run does (its timed prompts count).
        load_mode: how the run keeps host weights.
        given: the switches the user set (switches.user_set's: the runs get them).
    Returns:
        seconds (0 where nothing moves).
    Raises:
        ConfigError: for a link rate of 0 (an unthrottled VDEV: the link time is not known).
    """
    if not workload.prompt_tokens:
        return 0.0
    spec = devspec.parse(plan.devices_spec.get("text") or plan.devices_spec)
    terms = predict_terms(model, spec, plan.variant, len(plan.devices), load_mode, links=[d.link for d in plan.devices],
                          host_copy=plan.host_copy_gbps, given=given)
    total = 0.0
    for kind, n in workload.steps:
        pred = predict(plan, **{**terms, "n_tokens": n}) if kind == "pp" else None
        total += n / pred.ts if pred else 0.0
    return total


def _at_chosen_batch(best: Plan, plan: Plan) -> Plan:
    """fit_ubatch's winner with LAYER_MAJOR as `plan`, the plan made again at the n_batch it chose (a smaller one
    than it was placed at keeps a smaller group), with its prediction and links carried over."""
    plan.predicted_ts, plan.host_copy_gbps = best.predicted_ts, best.host_copy_gbps
    for a, d in zip(plan.devices, best.devices):
        a.link = a.link or d.link
    return plan


__all__ = ["fit_ubatch", "predict_terms", "prompt_seconds"]
