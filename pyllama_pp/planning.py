"""From a user's choices to what `run` and `ab` measure: `plan_runs(Choices(...))` gives the final, frozen RunConfigs
and the fit plans that placed them (`RunPlan`). The CLI parses its options into one `Choices`, calls `plan_runs`, runs
the configs and prints; a Python caller with the same choices gets the same configs.

The steps, in order: a plan file's model and sizes (`--plan`), the context's defaults (pyllama_pp.defaults: RUN, or
MAIN_JOB for `ab` without a model), the checks that need no worker (`check_choices`), `-ub auto` (fit_ubatch), the
matrix (config.expand), and the placements of `--plan`, `-ub auto` and `--fit`, or without them LAYER_MAJOR and the
expert cache planned on each config's own placement (fit.plan_on_placement). Switches (`--switch NAME=VALUE`) are parsed once
(`switches.parse_given`) and checked against the patched build's table (`check_switches`).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from . import devices as devspec
from . import switches, synth
from .about import accepted_values, switch_table
from .binding import VARIANTS, backend_modules
from .config import RunConfig, expand
from .defaults import CONTEXT, MAIN_JOB, MAIN_JOB_MODEL, PAIRED, RUN, cache_dir
from .errors import ConfigError, DeviceSpecError
from .fit import fit, fit_ubatch, plan_on_placement
from .memory_plan import refill_free
from .jobs import depth_of
from .layer_major_plan import wants_layer_major
from .model_file import block_count, check_model_path
from .params import INT32_MAX, ContextParams, Placement
from .plan import Plan
from .switches import ExpertCache
from .workload import Workload
from .worker.client import check_switch_env

CPU_ONLY_NOTE = ("--devices cpu (the default with a model): no accelerator, so no mechanism of the series acts and "
                 "both variants run the same CPU path. Name devices to measure it: --devices cuda (or cuda:0,1), or "
                 "virtual ones with throttled links, e.g. --devices vdev:2x256MiB@0.1GBps")
AUTO_CTX_SPARE = 256   # -ub auto without -c: n_ctx = the longest prompt (and depth) + this


# -- switches ------------------------------------------------------------------------------------------------------
def check_switches(switches: dict, variants: Sequence[str]) -> None:
    """Switches for a run that has the patched build, each a name its table knows with a value in its range (one
    info job asks the table).

    Args:
        switches: NAME -> value, as parse_switches gives them.
        variants: the variants about to run.
    Raises:
        ConfigError: naming the switch and what it accepts (close names for a misspelled one).
    """
    if not switches:
        return
    if "patched" not in variants:
        raise ConfigError("--switch sets the patched build's scheduler switches; --variant baseline has none. "
                          "Fix: drop --switch, or run --variant patched (or ab)")
    known = {sw["name"]: sw for sw in switch_table()}
    for name, x in switches.items():
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise ConfigError(f"--switch {name}: the patched build has no such switch"
                              + (f" (did you mean {', '.join(near)}?)" if near else "")
                              + "; `pyllama-pp info` lists them")
        sw = known[name]
        if isinstance(x, str) and sw.get("type") != "ints":
            raise ConfigError(f"--switch {name}={x}: {name} takes one value, not one per device; {name} accepts "
                              f"{accepted_values(sw)}")
        entries = [int(v) for v in x.split(",")] if isinstance(x, str) else [x]
        if "min" in sw and any(not sw["min"] <= v <= sw["max"] or (sw.get("values") and v not in sw["values"])
                               for v in entries):
            raise ConfigError(f"--switch {name}={x}: out of range; {name} accepts {accepted_values(sw)} "
                              f"(default {sw['default']}): {sw['meaning']}")


# -- choices and the planned run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choices:
    """What a user chose for `run` or `ab`, as the CLI's options say it; None where nothing was given (the context's
    default then applies: pyllama_pp.defaults RUN, or MAIN_JOB for `ab` without a model).

    Attributes:
        command: "run" (one variant) or "ab" (both).
        model: the GGUF file (None: the plan's model with `plan`; for `ab`, the main job's).
        variant: the variant `run` runs.
        devices: device specs, swept (None: cpu, the main job's devices, or the plan's).
        host_experts: host-expert choices, swept ("all", "none" or N).
        n_batch: n_batch values, swept; with n_ubatch "auto", the largest n_batch it may take (None: the prompt).
        n_ubatch: n_ubatch values, swept, or "auto" (fit_ubatch's choice of the pair (n_batch, n_ubatch), its plan
            for every variant).
        n_ctx: 0: what the tests need (with `plan`: the plan's).
        n_gpu_layers: layers on the devices (-1: every layer).
        tensor_split: layer proportions per device (None: even).
        pp: prompt lengths (empty: none).
        tg: generation lengths (empty: none).
        depth: tokens in the context before each test.
        reps: repetitions per test; a workload's rounds.
        workload: a Workload (or a name of defaults.WORKLOADS, "pp=N,tg=N") run in one context instead of the tests.
        load_mode: "none" or "mmap".
        offload_min_batch: GGML_OP_OFFLOAD_MIN_BATCH for both variants' workers.
        switches: the patched build's switches, NAME -> value (switches.parse_given).
        plan: a fit plan's file, applied to every variant.
        fit: "each" (each variant's own fit plan), "same" (the patched plan for every variant) or None.
        margin: memory fit leaves free per device (one size, or one per device).
        expert_cache: the patched build's device expert cache (an ExpertCache; its text forms are parsed into one):
            "auto" (as the memory planner weighs it for the workload: with a fit against resident layers, without
            one on the run's own placement, no layer moved), a size ("512MiB" a device) or slots a layer ("16slots";
            without a fit, either is the switch alone), or 0 (None: auto).
        baseline_devices: per device spec, the baseline's RPC servers on the same hosts.
        paired: rounds of a paired run (None: -r reps per worker).
        loads: fresh loads of a paired run.
    """

    command: str = "ab"
    model: Optional[str] = None
    variant: str = RUN.variant
    devices: Optional[tuple] = None
    host_experts: tuple = (RUN.host_experts,)
    n_batch: Optional[tuple] = None
    n_ubatch: Union[tuple, str, None] = None
    n_ctx: int = RUN.n_ctx
    n_gpu_layers: int = RUN.n_gpu_layers
    tensor_split: Optional[tuple] = None
    pp: Optional[tuple] = None
    tg: Optional[tuple] = None
    depth: tuple = RUN.depth
    reps: int = RUN.reps
    workload: Optional[Workload] = None
    load_mode: str = RUN.load_mode
    offload_min_batch: Optional[int] = None
    switches: dict = field(default_factory=dict)
    plan: Optional[str] = None
    fit: Optional[str] = None
    margin: Optional[tuple] = None
    expert_cache: Optional[ExpertCache] = None
    baseline_devices: Optional[tuple] = None
    paired: Optional[int] = None
    loads: int = PAIRED.loads

    def __post_init__(self):
        if self.expert_cache is not None and not isinstance(self.expert_cache, ExpertCache):   # (parsed once, here)
            object.__setattr__(self, "expert_cache", ExpertCache.parse(self.expert_cache))
        if self.workload is not None and not isinstance(self.workload, Workload):
            object.__setattr__(self, "workload", Workload.parse(self.workload))
        if (self.fit or self.n_ubatch == "auto") and "patched" in self.variants:
            # (where fit plans: --switch EXPERT_CACHE=V asks what --expert-cache does, planned the one way)
            cache, rest = switches.take_expert_cache(self.switches, self.expert_cache)
            object.__setattr__(self, "expert_cache", cache)
            object.__setattr__(self, "switches", rest)

    @property
    def variants(self) -> list[str]:
        """The variants that run: `variant` for run, both for ab."""
        return [self.variant] if self.command == "run" else list(VARIANTS)

    @property
    def main_job(self) -> bool:
        """`ab` without a model or plan: the main job (its model, devices and sizes)."""
        return self.command == "ab" and self.model is None and self.plan is None


@dataclass(frozen=True)
class RunPlan:
    """What `run` / `ab` measure: the final configs, the variants, the fit plans that placed them and what the user
    should know.

    Attributes:
        model: the model file.
        configs: the RunConfigs, frozen, with each variant's placement from a plan where one placed it.
        variants: the variants that run them, in order.
        plans: the fit plans made (`-ub auto`, `--fit`; without a fit, the dry runs of the configs' own placements
            LAYER_MAJOR and the expert cache were planned on), in the order they were made.
        notes: notes for the user (pairs left out, how a device spec was read, a CPU-only A/B).
        choices: the choices with every default filled in (what ran).
    """

    model: str
    configs: tuple
    variants: tuple
    plans: tuple = ()
    notes: tuple = ()
    choices: Optional[Choices] = None


def models_dir() -> Path:
    """Where synthetic models are cached (PYLLAMA_PP_CACHE or ~/.cache/pyllama_pp, then models/)."""
    return cache_dir() / "models"


def main_job_model() -> str:
    """The main job's model (MAIN_JOB_MODEL: the tiny preset), written once into models_dir()."""
    return str(synth.cached_model(models_dir(), MAIN_JOB_MODEL["preset"],
                                  **{k: v for k, v in MAIN_JOB_MODEL.items() if k != "preset"}))


def _with_env(c: Choices) -> Choices:
    """The GGML_SCHED_PP_* variables of this process's environment as switches given (--switch's win over them), read
    here once for the patched build: they are planned as --switch is (EXPERT_CACHE as --expert-cache where fit plans),
    and the plans' workers get them in their jobs alone (switches.unset)."""
    if "patched" not in c.variants:
        return c
    return dataclasses.replace(c, switches=switches.user_set(c.switches))


def _with_plan_file(c: Choices) -> Choices:
    """--plan PLAN.json: the plan's model where none is given, and its sizes where -b / -ub / -c are not given (the
    plan's memory was measured for them); larger ones than it was made for are refused (they need more memory)."""
    if not c.plan:
        return c
    plan = Plan.load(c.plan)
    model = c.model if c.model is not None else plan.model
    made = {"n_batch": plan.ctx.get("n_batch"), "n_ubatch": plan.ctx.get("n_ubatch")}
    sizes = {}
    for key, flag in (("n_batch", "-b"), ("n_ubatch", "-ub")):
        given = getattr(c, key)
        if made[key] is None:
            continue
        if given is None:
            sizes[key] = (made[key],)
        elif given != "auto" and max(given) > made[key]:
            raise ConfigError(f"{flag} {max(given)}: the plan {c.plan} was made for n_batch {made['n_batch']}, "
                              f"n_ubatch {made['n_ubatch']} and n_ctx {plan.n_ctx}, and larger batches need more "
                              f"memory than it planned. Fix: drop {flag}, or make a plan for these sizes "
                              f"(`pyllama-pp fit {model} -b N -ub N -o PLAN.json`)")
    if c.n_ctx > plan.n_ctx:
        raise ConfigError(f"-c {c.n_ctx}: the plan {c.plan} was made for n_ctx {plan.n_ctx}. Fix: -c {plan.n_ctx} "
                          f"or less, or make a plan with `pyllama-pp fit {model} -c {c.n_ctx} -o PLAN.json`")
    n_ctx = c.n_ctx or plan.n_ctx
    pp = c.pp
    if pp is None:   # (a default prompt that fits the plan's context, beside the default decode test)
        room = n_ctx - 8 - max(c.tg if c.tg is not None else RUN.tg, default=0) - max(c.depth, default=0)
        pp = (min(max(RUN.pp), 1 << (room.bit_length() - 1)),) if room >= 1 else ()
    return dataclasses.replace(c, model=model, n_ctx=n_ctx, pp=pp, **sizes)


def _placed(c: Choices) -> bool:
    """Whether the user said where the weights go (the main job places by fit otherwise)."""
    return bool(c.workload or c.plan or c.tensor_split is not None or c.host_experts != (RUN.host_experts,)
                or c.n_gpu_layers != RUN.n_gpu_layers or c.n_ubatch == "auto")


def _with_defaults(c: Choices) -> Choices:
    """Every size the user left out, from the context's defaults: MAIN_JOB for `ab` without a model (its fit only
    where the user did not place the weights: --workload takes no fit, and runs the main job's model on an even
    split), else RUN."""
    d = MAIN_JOB if c.main_job else RUN
    devices = c.devices or (d.devices,)   # (RUN's cpu with a plan: the plan's devices)
    fit_mode = c.fit if c.fit is not None else (d.fit if c.main_job and not _placed(c) else None)
    pick = lambda given, default: tuple(default) if given is None else given
    # (-ub auto chooses n_batch with n_ubatch, up to the prompt or the -b given)
    n_batch = c.n_batch if c.n_ubatch == "auto" else pick(c.n_batch, (d.n_batch,))
    return dataclasses.replace(c, devices=tuple(devices), n_batch=n_batch,
                               n_ubatch=pick(c.n_ubatch, (d.n_ubatch,)), pp=pick(c.pp, d.pp), tg=pick(c.tg, d.tg),
                               fit=fit_mode)


def _check_sizes(c: Choices) -> list[str]:
    """Batch sizes, test lengths and n_ctx in range; the notes of pairs left out (n_ubatch > n_batch)."""
    ubatch = [] if c.n_ubatch == "auto" else list(c.n_ubatch)
    for flag, values, lowest in (("-b/--batch", c.n_batch, 1), ("-ub/--ubatch", ubatch, 1), ("-p/--pp", c.pp, 1),
                                 ("-n/--tg", c.tg, 1), ("-d/--n-depth", c.depth, 0)):
        bad = [v for v in values or [] if not lowest <= v <= INT32_MAX]
        if bad:
            raise ConfigError(f"{flag} takes whole numbers >= {lowest}, got {', '.join(map(str, bad))}")
    if not c.pp and not c.tg:
        raise ConfigError("-p 0 and -n 0 leave nothing to measure: give prompt (-p) or generation (-n) lengths")
    notes = []
    if ubatch:
        pairs = [(b, ub) for b in c.n_batch for ub in ubatch]
        if not any(ub <= b for b, ub in pairs):
            raise ConfigError(f"n_ubatch ({','.join(map(str, ubatch))}) is larger than n_batch "
                              f"({','.join(map(str, c.n_batch))}) in every pair: nothing would run. Fix: -ub <= -b")
        skipped = [f"-b {b} -ub {ub}" for b, ub in pairs if ub > b]
        if skipped:
            notes.append(f"skipping {', '.join(skipped)} (n_ubatch > n_batch)")
    if c.n_ctx < 0:
        raise ConfigError(f"-c/--ctx takes a context size >= 0 (0: what the tests need), got {c.n_ctx}")
    if c.n_ctx > 0 and not c.workload and (c.pp or c.tg):
        need = max(n + d for d in (c.depth or RUN.depth) for n in (c.pp or ()) + (c.tg or ())) + 8
        if c.n_ctx < need and c.plan:
            raise ConfigError(f"the plan {c.plan} was made for n_ctx {c.n_ctx}, and the longest test needs {need} "
                              "positions (tokens, depth and 8 spare). Fix: shorter tests (-p/-n/-d), or a plan made "
                              f"with `pyllama-pp fit MODEL -c {need} ... -o PLAN.json`")
        if c.n_ctx < need:
            raise ConfigError(f"-c/--ctx {c.n_ctx} is too small for the tests: the longest needs {need} positions "
                              f"(tokens, depth and 8 spare). Fix: -c 0 (what the tests need) or -c {need}")
    return notes


def _check_placement(c: Choices, model: Optional[str]) -> None:
    """Devices this build can run and servers that answer, -ngl / -ts in range and matching the devices, host experts
    within the model."""
    specs = [devspec.parse(spec) for spec in c.devices]
    for flag, texts in (("--devices", c.devices), ("--baseline-devices", c.baseline_devices or ())):
        for text in texts:
            spec = devspec.parse(text)
            why = spec.unbuilt(backend_modules()) or spec.unreachable()
            if why:
                raise DeviceSpecError(f"{flag} {text}: {why}")
    if c.n_gpu_layers < -1:
        raise ConfigError(f"-ngl takes -1 (every layer) or a layer count >= 0, got {c.n_gpu_layers}")
    ts = c.tensor_split
    if ts is not None and (min(ts) < 0 or sum(ts) <= 0):
        raise ConfigError(f"-ts takes non-negative proportions with a positive sum (e.g. 3,5), got {list(ts)}")
    if ts is not None:
        for spec in specs:
            n = spec.n_devices
            if n and len(ts) != n:
                raise ConfigError(f"-ts gives {len(ts)} proportions and --devices {spec.label} "
                                  f"has {n} device{'s' if n > 1 else ''}: give one per device (e.g. "
                                  f"-ts {','.join('1' for _ in range(n))})")
    n_layer = block_count(model) if model is not None else 0
    for pl in placements(c):
        if n_layer:
            pl.all_overrides(n_layer)   # (a host-expert choice past the model's last layer is refused here)


def _check_modes(c: Choices) -> None:
    """Options that do not go together: --workload with --paired / --loads / --plan / --fit, --loads without
    --paired, -ub auto beside several specs, a plan, a fit or a workload, --plan with --fit."""
    if c.workload and c.paired:
        raise ConfigError("--paired runs the tests (-p/-n) in rounds; --workload has rounds of its own (-r). "
                          "Fix: drop one of them")
    if c.workload and c.loads > 1:
        raise ConfigError("--loads repeats paired rounds (-p/-n); --workload has rounds of its own (-r). "
                          "Fix: drop --loads")
    if c.loads > 1 and not c.paired:
        raise ConfigError(f"--loads {c.loads} repeats paired rounds with fresh workers. Fix: add --paired N, "
                          "or drop --loads")
    if c.n_ubatch == "auto":
        if len(c.devices) != 1:
            raise ConfigError(f"-ub auto plans for one --devices spec, and {len(c.devices)} were given: give one spec "
                              "(or sweep n_ubatch by hand: -ub 512,1024,...)")
        beside = {"--plan": c.plan, "--fit": c.fit, "--workload": c.workload}
        for flag in (f for f, v in beside.items() if v):
            raise ConfigError(f"-ub auto makes its own fit plan (the patched build's, for both variants) and runs the "
                              f"tests (-p/-n), so it takes no {flag}. Fix: drop {flag}, or drop -ub auto and give "
                              "-ub N")
        if not c.pp:
            raise ConfigError("-ub auto chooses n_ubatch for a prompt: give -p N (the prompt's length)")
    if c.workload and (c.plan or c.fit):
        raise ConfigError("--workload takes no --plan or --fit yet: run it with --host-experts / -ts")
    if c.plan and c.fit:
        raise ConfigError("give --plan PLAN.json or --fit, not both")
    _check_expert_cache(c)


def _check_expert_cache(c: Choices) -> None:
    """--expert-cache: a value ExpertCache.parse takes, for a run with the patched build, not beside --switch
    EXPERT_CACHE or a plan file (whose cache fit planned already); a size without a fit within the devices; a guard's
    or a split's per-device list (--switch or the environment) with a value for each device of every spec."""
    lists = {**switches.in_force("patched"), **c.switches}
    for text in c.devices if any(isinstance(lists.get(k), str) for k in switches.EVERY_DEVICE) else ():
        switches.check_device_lists(lists, devspec.parse(text).n_devices, text)
    given = c.switches.get(switches.EXPERT_CACHE)
    for text in c.devices if given is not None or c.expert_cache is not None else ():
        spec = devspec.parse(text)   # (a list: no more values than devices)
        for cache in (ExpertCache.parse(c.expert_cache), ExpertCache.of_switch(given or 0)):
            cache.check_devices(spec.n_devices, text)
    if c.expert_cache is None:
        return
    asked = ExpertCache.parse(c.expert_cache, "patched" if "patched" in c.variants else c.variant)
    if asked and switches.EXPERT_CACHE in c.switches:
        raise ConfigError(f"--expert-cache {asked.text} and --switch {switches.EXPERT_CACHE}=... set the same switch: "
                          "give one of them")
    if asked and c.plan:
        planned = Plan.load(c.plan).switches.get(switches.EXPERT_CACHE)
        why = (f"has its expert cache planned already ({switches.EXPERT_CACHE}={planned})" if planned else
               "was made without an expert cache: its layers leave the devices no room planned for one")
        raise ConfigError(f"--expert-cache {asked.text}: a plan runs as fit made it, and the plan {c.plan} {why}. "
                          f"Fix: drop --expert-cache, or make the plan with `pyllama-pp fit ... --expert-cache "
                          f"{asked.text} -o PLAN.json`")
    if asked and not (c.fit or c.n_ubatch == "auto"):
        for text in c.devices:
            room = [v.memory for v in getattr(devspec.parse(text), "vdevs", ()) if v.memory]
            if room and max(asked.at(i).bytes for i in range(len(room))) > min(room):
                raise ConfigError(f"--expert-cache {asked.text}: more than a device of --devices {text} has "
                                  f"({min(room) >> 20} MiB), and without --fit no one plans the cache's room. Fix: "
                                  f"--fit with --expert-cache auto (what the plan leaves free), or a size below the "
                                  "devices' free memory")


def _cache_switches(c: Choices) -> dict:
    """--expert-cache SIZE or Nslots without a fit: EXPERT_CACHE for the patched runs as it is (MiB a device, or -N
    slots a layer), planned by no one; {} where fit plans the cache (it adds the switch to its plan) or none was
    asked."""
    asked = ExpertCache.parse(c.expert_cache)
    return {switches.EXPERT_CACHE: asked.switch} if asked.switch and not (c.fit or c.n_ubatch == "auto") else {}


def check_choices(c: Choices, model: Optional[str] = None) -> list[str]:
    """Usage errors found before any worker starts (switch names aside, which need the patched build's table).

    Args:
        c: the choices, defaults filled in.
        model: the model file the user named (None: the main job's, whose header needs no check).
    Returns:
        list[str]: notes for the user (batch pairs left out).
    Raises:
        ConfigError: naming the option that is wrong and how to fix it.
        ModelError: for a missing or bad model file.
        DeviceSpecError: for a spec that does not parse, CUDA without a CUDA build, or an RPC server that cannot be
            reached.
    """
    if model is not None:
        check_model_path(model)
    notes = _check_sizes(c)
    if c.baseline_devices:
        if len(c.baseline_devices) != len(c.devices):
            raise ConfigError(f"--baseline-devices gives {len(c.baseline_devices)} spec(s) and --devices "
                              f"{len(c.devices)}: give the baseline's servers for each --devices spec, ';'-separated "
                              "in the same order")
        for devices, baseline in zip(c.devices, c.baseline_devices):
            devspec.check_baseline_devices(devices, baseline)
    _check_placement(c, model)
    _check_modes(c)
    return notes


def placements(c: Choices) -> list[Placement]:
    """--host-experts (swept), -ngl, -ts and --load-mode as the Placements of the matrix.

    Raises:
        ConfigError: for a value out of range.
    """
    return [Placement(host_experts=he, n_gpu_layers=c.n_gpu_layers, tensor_split=c.tensor_split,
                      load_mode=c.load_mode) for he in c.host_experts]


def tests_of(c: Choices) -> list:
    """The tests of the matrix, llama-bench's way: each depth once, in order, its pp tests then its tg tests.

    Raises:
        ConfigError: for a negative depth.
    """
    if any(d < 0 for d in c.depth):
        raise ConfigError(f"-d/--n-depth takes token counts >= 0, got {list(c.depth)}")
    tests = []
    for d in dict.fromkeys(c.depth or RUN.depth):
        tests += [["pp", n] + ([d] if d else []) for n in c.pp or ()]
        tests += [["tg", n] + ([d] if d else []) for n in c.tg or ()]
    return tests


def _ubatch_auto(c: Choices, model: str, progress: bool) -> tuple[Choices, Optional[Plan]]:
    """-ub auto: fit --ubatch auto on the (one) device spec for the longest prompt test, its n_batch at most the
    prompt and the largest -b given; its n_ubatch, n_batch and plan then stand for -ub, -b and --fit same (both
    variants on the patched plan's placement)."""
    if c.n_ubatch != "auto":
        return c, None
    n_ctx = c.n_ctx or max(c.pp) + max(c.depth, default=0) + AUTO_CTX_SPARE
    plan = fit_ubatch(model, devices=c.devices[0], margin=c.margin, expert_cache=c.expert_cache, n_tokens=max(c.pp),
                      workload=Workload.of_tests(c.pp, c.tg),
                      n_batch=max(c.n_batch) if c.n_batch else None, load_mode=c.load_mode, progress=progress,
                      ctx=ContextParams(n_ctx=n_ctx, n_batch=CONTEXT.n_batch, n_ubatch=CONTEXT.n_ubatch),
                      switches=c.switches, env=switches.unset(None))   # (the switches' memory and groups, planned)
    return dataclasses.replace(c, n_ubatch=(plan.ctx["n_ubatch"],), n_batch=(plan.ctx["n_batch"],)), plan


def _matrix(c: Choices, model: str) -> list[RunConfig]:
    """devices x n_batch x n_ubatch x host experts, like llama-bench; with --baseline-devices, each device spec's
    baseline servers."""
    env = {"GGML_OP_OFFLOAD_MIN_BATCH": str(c.offload_min_batch)} if c.offload_min_batch is not None else {}
    cfgs = expand(model, devices=c.devices, n_batch=c.n_batch, n_ubatch=c.n_ubatch, placements=placements(c),
                  tests=tests_of(c), reps=c.reps, n_ctx=c.n_ctx, switches={**c.switches, **_cache_switches(c)}, env=env)
    if not c.baseline_devices:
        return cfgs
    pair = dict(zip(c.devices, c.baseline_devices))
    return [dataclasses.replace(cfg, baseline_devices=pair[cfg.devices]) for cfg in cfgs]


def _plan_devices(plan: Plan) -> str:
    """The device spec a plan was made for, as a config names it."""
    spec = plan.devices_spec
    text = spec.get("text")
    return text if text and not str(text).endswith(".json") else json.dumps({k: v for k, v in spec.items()
                                                                           if k != "text"})


def _with_plan(cfg: RunConfig, plan: Plan, model: str, variants: Sequence[str], c: Choices, source: str) -> RunConfig:
    """cfg run on one plan by every variant (the plan's devices where cfg names none, its copies' switches)."""
    plan.check(model, None if cfg.devices == "cpu" else cfg.devices)
    devices = _plan_devices(plan) if cfg.devices == "cpu" else cfg.devices
    return dataclasses.replace(cfg, devices=devices,
                               plans={v: plan.placement(c.load_mode, source=source) for v in variants},
                               switches={**plan.run_switches(c.load_mode), **cfg.switches})   # (patched runs only)


def _with_fit(cfg: RunConfig, model: str, variants: Sequence[str], c: Choices, made: list) -> RunConfig:
    """cfg placed by fit: each variant's own plan (each), or the patched build's for every variant (same); a cache
    set by hand on an mmap-ed model with host-expert layers runs with MMAP_REFILL's switches, as without a fit."""
    ctx = ContextParams(n_ctx=cfg.context().n_ctx, n_batch=cfg.n_batch, n_ubatch=min(cfg.n_ubatch, cfg.n_batch))
    plans, run_switches, notes = {}, dict(cfg.switches), ()
    for v in (["patched"] if c.fit == "same" else variants):
        p = fit(model, devices=cfg.devices_for(v), ctx=ctx, variant=v, margin=c.margin, env=switches.unset(cfg.env),
                expert_cache=c.expert_cache if v == "patched" else None, switches=cfg.switches,
                workload=_tests_workload(cfg), load_mode=c.load_mode)
        made.append(p)
        plans[v] = p.placement(c.load_mode, source="fit")
        if v == "patched":
            run_switches = {**p.run_switches(c.load_mode), **cfg.switches}
            if c.load_mode == "mmap" and c.expert_cache and not c.expert_cache.auto and any(p.host_expert_layers):
                refill, note = _hand_set_mmap(c.switches)
                run_switches = {**run_switches, **refill}
                if refill and switches.EXPERT_CACHE_MIN_HIT not in c.switches:
                    # (fit's guard is priced for the cache alone's staged misses: the refill's path keeps the default)
                    run_switches.pop(switches.EXPERT_CACHE_MIN_HIT, None)
                notes += (f"expert cache (--devices {cfg.devices}, -b {cfg.n_batch} -ub {min(cfg.n_ubatch, cfg.n_batch)}"
                          f"): set by hand on an mmap-ed model, fit keeps its room: {note}",)
    if c.fit == "same":
        plans = {v: plans["patched"] for v in variants}
    return dataclasses.replace(cfg, plans=plans, switches=run_switches, notes=cfg.notes + notes)


#: what a cache set by hand on an mmap-ed model runs with where the user set neither: every miss of a decoded token on
#: the host CPU and one a token into the slots after it (a staged miss costs the host more than computing it there;
#: one H100, the 30B-A3B shape from mmap, 16 slots a layer: 1.203x upstream, the same call's all-but-one 0.786x, the
#: cache alone 0.589x before: docs/results/mmap-refill-2026-12-07)
MMAP_REFILL = {switches.EXPERT_HYBRID: switches.HYBRID_ALL_CPU, switches.EXPERT_REFILL: 1}


def _hand_set_mmap(given: dict) -> tuple[dict, str]:
    """A cache set by hand on an mmap-ed model: the switches it runs with (MMAP_REFILL, where the user set neither of
    them) and what the note says of its misses."""
    if not refill_free(given):
        return {}, ("a miss is copied into pinned staging by the host first, which can cost more than upstream's CPU "
                    "path computing it from the page cache (measured slower on an H100: docs/RESULTS.md, \"What a "
                    "user gets without switches\")")
    return dict(MMAP_REFILL), (
        f"its misses run on the host CPU and one a token goes into the slots after it ({switches.EXPERT_HYBRID}="
        f"{switches.HYBRID_ALL_CPU} {switches.EXPERT_REFILL}=1), as a miss copied into pinned staging by the host first "
        "costs more than upstream's CPU path computing it from the page cache (measured on an H100: docs/RESULTS.md, "
        f"\"What a user gets without switches\"); --switch {switches.EXPERT_REFILL}=0 for the cache alone")


def _placed_switches(cfg: RunConfig, c: Choices, model: str, made: list, measured: dict,
                     progress: bool) -> RunConfig:
    """Without a fit, the patched runs' switches that take device memory planned on the config's own placement
    (fit.plan_on_placement: no layer moved, its dry runs per placement, context and workload kept in `measured`):
    LAYER_MAJOR where the user did not set it (a switch or its variable) and the run's prompts (-p, -d, the workload)
    form groups over host experts (layer_major_plan.wants_layer_major), on where its groups fit beside the placement;
    the expert cache where the user set none (no --expert-cache or auto, no EXPERT_CACHE switch or variable), in the
    room the groups leave (where the run decodes too, the groups weighed against the slots their room would hold:
    LAYER_MAJOR=0 where those save more); a cache set by hand on an mmap-ed model with MMAP_REFILL's switches where
    the user set neither. The config with the plan's switches, and in its notes what was planned and why, or why
    nothing where that is news. As it is for the baseline alone, on the CPU alone, or where the user set both."""
    if "patched" not in c.variants:
        return cfg
    asked, given = c.expert_cache, c.switches   # (the environment's among them: _with_env)
    spec = devspec.parse(cfg.devices)
    where = (f"--devices {cfg.devices}, --host-experts {cfg.placement.label}, -b {cfg.n_batch} "
             f"-ub {min(cfg.n_ubatch, cfg.n_batch)}")
    workload = c.workload or _tests_workload(cfg)
    host = any(o.endswith("=CPU") for o in cfg.placement.all_overrides(block_count(model)))
    cache = not (asked is not None and not asked.auto) and switches.EXPERT_CACHE not in given
    groups = bool(spec.accelerators) and wants_layer_major("patched", given, host, workload, cfg.n_batch, cfg.n_ubatch)
    why = ("" if spec.accelerators else "the devices are the CPU alone") or \
          ("" if host else "no expert is in host RAM (every expert is on its device)") or \
          ("" if workload.decode_tokens else "the workload decodes no token")
    # (said where the user asked for the cache, or where a decode with host experts could have had one: a default
    # that cannot act on a prompt-only run, the CPU or every expert on its device is no news; LAYER_MAJOR's off is
    # news wherever its groups would have formed)
    news, room = asked is not None, ""
    if groups or (cache and not why):
        try:
            spec.fit_check(CONTEXT.split_mode)
        except DeviceSpecError as e:
            room = f"its room cannot be planned ({str(e).splitlines()[0]})"
    notes: tuple = ()
    hand_set = asked if asked is not None and not asked.auto else \
        ExpertCache.of_switch(given[switches.EXPERT_CACHE]) if switches.EXPERT_CACHE in given else None
    refill = {}
    if hand_set and c.load_mode == "mmap" and not why:
        refill, note = _hand_set_mmap(given)
        notes += (f"expert cache ({where}): set by hand on an mmap-ed model, so nothing is planned for it (its guard "
                  f"included): {note}; --expert-cache auto plans it and keeps none where it does not pay",)
    if cache and (why and news or room and not why):
        notes += (f"expert cache ({where}): no cache: {why or room}",)
    if groups and room:
        notes += (f"layer major ({where}): LAYER_MAJOR off: {room}",)
    cache, groups = cache and not why and not room, groups and not room
    if not (cache or groups):
        return dataclasses.replace(cfg, switches={**cfg.switches, **refill}, notes=cfg.notes + notes)
    key = json.dumps([cfg.devices, cfg.placement.to_dict(), cfg.context().to_dict(), workload.as_list(),
                      [list(s) for s in workload.untimed], cache])
    if key not in measured:
        measured[key] = plan_on_placement(model, cfg.devices, cfg.placement, cfg.context(), workload=workload,
                                          margin=c.margin, env=switches.unset(cfg.env), switches=cfg.switches,
                                          load_mode=c.load_mode, progress=progress, cache=cache)
        made.append(measured[key])
    plan = measured[key]
    planned = {k: v for k, v in plan.run_switches(c.load_mode).items()
               if k == switches.LAYER_MAJOR or k in switches.CACHE_SWITCHES}
    if plan.layer_major:
        notes += (f"layer major ({where}), planned on this placement without a fit: {plan.layer_major_text}",)
    if cache:
        set_ = f"; {switches.EXPERT_CACHE} {switches.shown(switches.EXPERT_CACHE, planned[switches.EXPERT_CACHE])}" \
            if planned.get(switches.EXPERT_CACHE) else ""
        split = plan.memory_plan.get("hybrid_note")
        notes += (f"expert cache ({where}), planned on this placement without a fit: {plan.memory_plan['why']}{set_}"
                  + (f"; {split}" if split else ""),)
    return dataclasses.replace(cfg, switches={**cfg.switches, **refill, **planned}, notes=cfg.notes + notes)


def _shared_plan_notes(made: Sequence[Plan], shared: bool) -> list[str]:
    """Where both variants run the patched plan and its memory planner moved expert layers to host RAM for cache
    slots the baseline has none of: the note that the baseline's placement is then not its best."""
    def moved(p: Plan) -> bool:
        alts = (p.memory_plan or {}).get("alternatives")
        chosen = alts[p.memory_plan["chosen"]] if alts else None
        return bool(chosen and chosen["slots"] and p.expert_cache and chosen["host"] != alts[0]["host"])
    if not shared or not any(moved(p) for p in made if p.variant == "patched"):
        return []
    return ["both variants run the patched plan, whose memory planner moved expert layers to host RAM for cache "
            "slots the baseline does not have: its placement is not the baseline's best. For upstream with its own "
            "placement: --fit each (or --expert-cache 0 to keep the layers)"]


def _tests_workload(cfg: RunConfig) -> Workload:
    """A config's own tests as the workload fit plans its memory for: its prompts (-p) and decodes, timed; each depth's
    -d tokens, which the context takes as a prompt before its test, untimed (they form LAYER_MAJOR's groups; the
    memory plan does not trade the timed tests' speed for them)."""
    depths = dict.fromkeys(depth_of(t) for t in cfg.tests if depth_of(t))
    return Workload.of_tests([t[1] for t in cfg.tests if t[0] == "pp"], [t[1] for t in cfg.tests if t[0] == "tg"],
                             list(depths))


def cpu_only_notes(configs: Sequence[RunConfig]) -> list[str]:
    """An A/B on the CPU alone measures no mechanism of the series: the note that says so, where it is."""
    return [CPU_ONLY_NOTE] if all(not devspec.parse(cfg.devices).accelerators for cfg in configs) else []


def plan_runs(choices: Choices, progress: bool = False) -> RunPlan:
    """The configs `run` / `ab` measure for these choices: defaults filled in, checked, (n_batch, n_ubatch) chosen
    (-ub auto), crossed into the matrix and placed (--plan, -ub auto, --fit; without them LAYER_MAJOR and the expert
    cache planned on each config's own placement). Fit plans and dry runs run in workers; nothing is measured.

    Args:
        choices: what the user chose (the CLI's options).
        progress: -ub auto and the decode probe say what they plan and probe, with progress bars on stderr.
    Returns:
        RunPlan: the frozen configs, the variants, the plans used, notes for the user and the filled-in choices.
    Raises:
        ConfigError: for choices that do not go together or values out of range (naming the option and the fix).
        ModelError: for a missing or bad model file.
        DeviceSpecError: for a device spec that does not parse.
        PlanError: for a plan made for another model or other devices.
        OutOfMemoryError: when fit finds no placement.
    """
    c = _with_plan_file(_with_env(choices))
    if c.command == "run" and c.model is None:
        raise ConfigError("run needs a MODEL (a .gguf file), or --resume DIR to continue a sweep")
    c = _with_defaults(c)
    variants = c.variants
    notes = check_choices(c, c.model)
    check_switch_env(variants)   # (a misspelled GGML_SCHED_PP_* variable: refused before any plan or note)
    check_switches(c.switches, variants)
    model = c.model if c.model is not None else main_job_model()
    c, auto = _ubatch_auto(c, model, progress)
    cfgs, made = _matrix(c, model), [auto] if auto else []
    plan = auto or (Plan.load(c.plan) if c.plan else None)
    if plan is not None:
        cfgs = [_with_plan(cfg, plan, model, variants, c, "fit" if auto else "plan") for cfg in cfgs]
    elif c.fit:
        cfgs = [_with_fit(cfg, model, variants, c, made) for cfg in cfgs]
        notes += list(dict.fromkeys(n for cfg in cfgs for n in cfg.notes))
    else:
        measured: dict = {}
        cfgs = [_placed_switches(cfg, c, model, made, measured, progress) for cfg in cfgs]
        notes += list(dict.fromkeys(n for cfg in cfgs for n in cfg.notes))
    notes += [n for spec in dict.fromkeys(c.devices + (c.baseline_devices or ())) for n in devspec.parse(spec).notes]
    if _cache_switches(c):
        notes.append(f"--expert-cache {c.expert_cache.text} without --fit sets the cache ({switches.EXPERT_CACHE}) as "
                     "it is: no plan left room for the slots, which take device memory beside the layers; --fit plans "
                     "them")
    if c.command == "ab":
        notes += cpu_only_notes(cfgs) + _shared_plan_notes(made, c.fit == "same" or auto is not None)
    return RunPlan(model=model, configs=tuple(cfgs), variants=tuple(variants), plans=tuple(made),
                   notes=tuple(notes), choices=c)


__all__ = ["Choices", "RunPlan", "plan_runs", "check_choices", "check_switches",
           "placements", "tests_of", "models_dir", "main_job_model", "cpu_only_notes"]
