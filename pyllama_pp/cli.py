"""`pyllama-pp`: info, synth, fit, run, ab. Every subcommand takes --json (one JSON document on stdout)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import difflib

import pandas as pd

from . import _pin, runner, synth, trace
from ._version import __version__
from . import devices as devspec
from .binding import VARIANTS, available_variants, backend_modules, build_info
from .check import check_logits
from .config import expand
from .devices import FORMS
from .errors import ConfigError, DeviceSpecError, PyllamaError, UnsupportedError
from .fit import fit, fit_ubatch
from .model_file import block_count, check_model_path
from .params import ContextParams, Placement, ctx_for
from .plan import Plan
from .report import devices_label, markdown, plot
from .rpc import server as rpc_server
from .row import Row, RowWriter, read_rows
from .worker.client import run_job

# The main job (`pyllama-pp ab` with no model): the tiny preset with 7 layers on 2 virtual devices of 7 MiB each,
# too small for its 12 MiB, whose links are throttled so that transfers dominate. The patched build's fit places
# it (6 of the 7 layers' experts in host RAM, 3 per device) and both variants run that one placement (--fit same);
# n_ubatch 128 uses ~98% of the experts; n_batch = 16 x n_ubatch.
DEFAULT_DEVICES = "vdev:2x7MiB@0.1GBps"
# No decode row by default: one load per variant leaves decode to where each process's memory landed (a few
# percent either way, more than the variants differ there); decode claims are paired (--paired N --loads K).
MAIN_JOB = {"batch": [2048], "ubatch": [128], "pp": [2048], "tg": [], "fit": "same"}
MAIN_JOB_N_LAYER = 7
PLAIN = {"batch": [512], "ubatch": [32], "pp": [512], "tg": [16]}
CPU_ONLY_NOTE = ("--devices cpu (the default with a model): no accelerator, so no mechanism of the series acts and "
                 "both variants run the same CPU path. Name devices to measure it: --devices cuda (or cuda:0,1), or "
                 "virtual ones with throttled links, e.g. --devices vdev:2x256MiB@0.1GBps")


def _cache_dir() -> Path:
    return Path(os.environ.get("PYLLAMA_PP_CACHE") or Path.home() / ".cache" / "pyllama_pp")


def _emit(args, data, text: str) -> None:
    if args.json:
        print(json.dumps(data, default=float, indent=1))
    else:
        print(text)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in str(s).split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {s!r}")
    return n


def _even_rounds(s: str) -> int:
    n = _positive(s)
    if n % 2:
        raise argparse.ArgumentTypeError(f"expected an even number of rounds (AB and BA pairs), got {s!r}")
    return n


# ---------------------------------------------------------------------------------------------------------
def accepted_values(sw: dict) -> str:
    """What a switch of the patched build's table accepts, as a user writes it: "0/1", "-1..100", "0, 2"."""
    if sw.get("values"):
        return ", ".join(str(v) for v in sw["values"])
    if sw.get("type") == "bool":
        return "0/1"
    return f"{sw['min']}..{sw['max']}"


def switches_markdown(switches: list[dict]) -> str:
    """The README's switch section (between <!-- switches:begin --> and <!-- switches:end -->), made from the
    patched library's table (`pyllama-pp info --markdown-switches` prints it)."""
    lines = ["| switch (`GGML_SCHED_PP_<NAME>`, `--switch NAME=V`) | type | default | accepted | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for sw in switches:
        meaning = sw["meaning"].replace("|", "\\|")
        lines.append(f"| `{sw['name']}` | {sw['type']} | {sw['default']} | {accepted_values(sw)} | {meaning} |")
    return "\n".join(lines)


def cmd_info(args) -> int:
    if getattr(args, "markdown_switches", False):
        if "patched" not in available_variants():
            raise UnsupportedError("--markdown-switches reads the patched build's switch table; it is not built")
        print(switches_markdown(run_job({"kind": "info"}, "patched", timeout=120).get("switches", [])))
        return 0
    pin = _pin.PIN
    variants = []
    for v in VARIANTS:
        entry = {"name": v, "built": v in available_variants()}
        if entry["built"]:
            try:
                r = run_job({"kind": "info"}, v, timeout=120)
                entry.update(ext_version=r["ext_version"], devices=r["devices"], system_info=r["system_info"],
                             switches=r.get("switches", []), env_problems=r.get("env_problems", []))
            except PyllamaError as e:
                entry["error"] = str(e)
        entry["patches"] = _pin.PATCHES if v == "patched" else []
        variants.append(entry)
    # backend modules built for both variants (libggml-<name>.so), plus the devices' own backends (VDEV, ...)
    backends = sorted(backend_modules() | {d["backend"] for e in variants for d in e.get("devices", [])} | {"VDEV"})
    data = {"version": __version__, "upstream": {"commit": pin.get("commit"), "commit_date": pin.get("commit_date"),
                                                 "package": f"{pin.get('package')}=={pin.get('version')}",
                                                 "sha256": pin.get("sha256")},
            "variants": variants, "backends": backends, "build": build_info()}
    lines = [f"pyllama_pp {__version__}", f"upstream llama.cpp {data['upstream']['commit']} "
             f"({data['upstream']['commit_date']}, from {data['upstream']['package']})", f"backends: {', '.join(backends)}"]
    for e in variants:
        lines.append(f"variant {e['name']}: {'built' if e['built'] else 'NOT BUILT'}"
                     + (f", scheduler extension v{e.get('ext_version')}" if e.get("ext_version") else ""))
        for p in e["patches"]:
            lines.append(f"  {p}")
        if e.get("switches"):
            lines.append("  switches (GGML_SCHED_PP_<NAME>=V, --switch NAME=V):")
            for sw in e["switches"]:
                lines.append(f"    {sw['name']}={sw['value']} ({sw.get('type', 'int')}, default {sw.get('default')}, "
                             f"{accepted_values(sw) if 'min' in sw else '?'}): {sw['meaning']}")
        for problem in e.get("env_problems", []):
            lines.append(f"  NOT ACCEPTED (the patched runs would refuse it): {problem}")
        for d in e.get("devices", []):
            lines.append(f"  device {d['name']} ({d['backend']}): {d['description']}, "
                         f"{d['memory_total'] / 2**30:.1f} GiB")
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_synth(args) -> int:
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_expert", "n_expert_used", "n_ff_exp", "n_vocab",
                                               "routing", "skew") if getattr(args, k, None) is not None}
    if not Path(args.out).parent.is_dir():
        raise ConfigError(f"cannot write {args.out}: the folder {Path(args.out).parent} does not exist")
    if Path(args.out).is_dir():
        raise ConfigError(f"cannot write {args.out}: it is a folder; give a file name such as {Path(args.out) / 'm.gguf'}")
    cfg = synth.preset(args.preset, seed=args.seed, type=args.type, expert_type=args.expert_type, **overrides)
    summary = synth.write_gguf(args.out, cfg, progress=not args.json and sys.stderr.isatty())
    _emit(args, summary, f"wrote {args.out}: {summary['bytes'] / 1e6:.1f} MB, {summary['n_tensors']} tensors, "
                         f"{summary['expert_bytes_per_layer'] / 1e6:.2f} MB of {summary['expert_type']} experts a layer, "
                         f"routing {summary['routing']}, {summary['seconds']:.1f} s")
    return 0


def _config_kwargs(args) -> dict:
    tests = []
    if any(d < 0 for d in args.depth):
        raise PyllamaError(f"-d/--n-depth takes token counts >= 0, got {args.depth}")
    for d in dict.fromkeys(args.depth or [0]):   # each depth once, in order
        if args.pp:
            tests += [["pp", n] + ([d] if d else []) for n in args.pp]
        if args.tg:
            tests += [["tg", n] + ([d] if d else []) for n in args.tg]
    env = {}
    if args.offload_min_batch is not None:
        env["GGML_OP_OFFLOAD_MIN_BATCH"] = str(args.offload_min_batch)
    switches = _switches(args.switch)
    if not tests:
        raise ConfigError("-p 0 and -n 0 leave nothing to measure: give prompt (-p) or generation (-n) lengths")
    return {"tests": tests, "reps": args.reps, "n_ctx": args.ctx, "switches": switches, "env": env}


def _switches(given: Optional[list]) -> dict:
    """--switch NAME=VALUE (repeatable) as {NAME: value}."""
    switches = {}
    for kv in given or []:
        k, _, v = kv.partition("=")
        if not v:
            raise PyllamaError(f"--switch takes NAME=VALUE (e.g. UPLOAD_ALL=0), not {kv!r}")
        try:
            switches[k.upper()] = int(v)
        except ValueError:
            raise PyllamaError(f"--switch {kv!r}: the value must be an integer (e.g. UPLOAD_ALL=0)") from None
    return switches


def _placements(args) -> list[Placement]:
    """--host-experts (swept), -ngl, -ts and --load-mode as the Placements of the matrix."""
    return [Placement(host_experts=he, n_gpu_layers=args.ngl, tensor_split=args.tensor_split,
                      load_mode=args.load_mode) for he in args.host_experts]


def _check_args(args, model: Optional[str], variants: list[str]) -> None:
    """Usage errors found before any worker starts, each a ConfigError / ModelError / DeviceSpecError that names
    what is wrong and how to fix it."""
    if model is not None:
        check_model_path(model)
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"-o/--out {args.out} is a file, not a folder: give a folder for the rows")
    for spec in args.devices:
        why = devspec.parse(spec).unbuilt(backend_modules())
        if why:
            raise DeviceSpecError(f"--devices {spec}: {why}")
    for flag, values, lowest in (("-b/--batch", args.batch, 1), ("-ub/--ubatch", args.ubatch, 1),
                                 ("-p/--pp", args.pp, 1), ("-n/--tg", args.tg, 1), ("-d/--n-depth", args.depth, 0)):
        bad = [v for v in values or [] if not lowest <= v <= 2**31 - 1]
        if bad:
            raise ConfigError(f"{flag} takes whole numbers >= {lowest}, got {', '.join(map(str, bad))}")
    pairs = [(b, ub) for b in args.batch for ub in args.ubatch]
    if not any(ub <= b for b, ub in pairs):
        raise ConfigError(f"n_ubatch ({','.join(map(str, args.ubatch))}) is larger than n_batch "
                          f"({','.join(map(str, args.batch))}) in every pair: nothing would run. Fix: -ub <= -b")
    skipped = [f"-b {b} -ub {ub}" for b, ub in pairs if ub > b]
    if skipped:
        print(f"pyllama-pp: note: skipping {', '.join(skipped)} (n_ubatch > n_batch)", file=sys.stderr)
    if args.ctx < 0:
        raise ConfigError(f"-c/--ctx takes a context size >= 0 (0: what the tests need), got {args.ctx}")
    if args.ctx > 0 and not args.workload:
        need = max(n + d for d in (args.depth or [0]) for n in (args.pp or []) + (args.tg or [])) + 8 \
            if (args.pp or args.tg) else 0
        if args.ctx < need and getattr(args, "plan", None):
            raise ConfigError(f"the plan {args.plan} was made for n_ctx {args.ctx}, and the longest test needs {need} "
                              "positions (tokens, depth and 8 spare). Fix: shorter tests (-p/-n/-d), or a plan made "
                              f"with `pyllama-pp fit MODEL -c {need} ... -o PLAN.json`")
        if args.ctx < need:
            raise ConfigError(f"-c/--ctx {args.ctx} is too small for the tests: the longest needs {need} positions "
                              f"(tokens, depth and 8 spare). Fix: -c 0 (what the tests need) or -c {need}")
    if args.ngl < -1:
        raise ConfigError(f"-ngl takes -1 (every layer) or a layer count >= 0, got {args.ngl}")
    if args.tensor_split is not None and (min(args.tensor_split) < 0 or sum(args.tensor_split) <= 0):
        raise ConfigError(f"-ts takes non-negative proportions with a positive sum (e.g. 3,5), got {args.tensor_split}")
    if args.tensor_split is not None:
        for spec in args.devices:
            n = devspec.parse(spec).n_devices
            if n and len(args.tensor_split) != n:
                raise ConfigError(f"-ts gives {len(args.tensor_split)} proportions and --devices {devices_label(spec)} "
                                  f"has {n} device{'s' if n > 1 else ''}: give one per device (e.g. "
                                  f"-ts {','.join('1' for _ in range(n))})")
    placements = _placements(args)
    n_layer = block_count(model) if model is not None else 0
    for pl in placements:
        if n_layer:
            pl.all_overrides(n_layer)   # (a host-expert choice past the model's last layer is refused here)
    if args.switch:
        _check_switches(args.switch, variants)


def _check_switches(switches: list[str], variants: list[str]) -> None:
    """--switch NAME=VALUE: well formed, for a run that has the patched build, and a name its table knows."""
    for kv in switches:
        name, _, value = kv.partition("=")
        if not name or not value:
            raise ConfigError(f"--switch takes NAME=VALUE (e.g. UPLOAD_ALL=0), not {kv!r}")
        try:
            int(value)
        except ValueError:
            raise ConfigError(f"--switch {kv!r}: the value must be an integer (e.g. UPLOAD_ALL=0)") from None
    if "patched" not in variants:
        raise ConfigError("--switch sets the patched build's scheduler switches; --variant baseline has none. "
                          "Fix: drop --switch, or run --variant patched (or ab)")
    known = {sw["name"]: sw for sw in run_job({"kind": "info"}, "patched", timeout=120).get("switches", [])}
    for kv in switches:
        name, _, v = kv.partition("=")
        name = name.upper()
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise ConfigError(f"--switch {name}: the patched build has no such switch"
                              + (f" (did you mean {', '.join(near)}?)" if near else "")
                              + "; `pyllama-pp info` lists them")
        sw = known[name]
        try:
            x = int(v)
        except ValueError:
            continue   # (reported by _config_kwargs)
        if "min" in sw and (not sw["min"] <= x <= sw["max"] or (sw.get("values") and x not in sw["values"])):
            raise ConfigError(f"--switch {name}={x}: out of range; {name} accepts {accepted_values(sw)} "
                              f"(default {sw['default']}): {sw['meaning']}")


def models_dir() -> Path:
    """Where synthetic models are cached (PYLLAMA_PP_CACHE or ~/.cache/pyllama_pp, then models/)."""
    return _cache_dir() / "models"


def _configs(args, model: str) -> list:
    """The A/B matrix of `run` and `ab`: devices x n_batch x n_ubatch x host experts, like llama-bench; with
    `ab --baseline-devices`, each device spec's baseline servers."""
    cfgs = expand(model, devices=args.devices, n_batch=args.batch, n_ubatch=args.ubatch,
                  placements=_placements(args), **_config_kwargs(args))
    base = getattr(args, "baseline_devices", None)
    if not base:
        return cfgs
    if len(base) != len(args.devices):
        raise ConfigError(f"--baseline-devices gives {len(base)} spec(s) and --devices {len(args.devices)}: give the "
                          "baseline's servers for each --devices spec, ';'-separated in the same order")
    pair = dict(zip(args.devices, base))
    return [dataclasses.replace(c, baseline_devices=pair[c.devices]) for c in cfgs]


def _default_model() -> str:
    return str(synth.cached_model(models_dir(), "tiny", seed=1, n_layer=MAIN_JOB_N_LAYER))


def _print_rows(df) -> str:
    cols = ["variant", "devices", "n_batch", "n_ubatch", "test", "avg_ts", "stddev_ts", "pipeline_parallel",
            "coverage", "h2d_bytes"]
    cols = [c for c in cols if c in df.columns]
    return df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}") + _error_lines(df)


def _fill_defaults(args, defaults: dict) -> None:
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _failed(df) -> bool:
    """Any error row (a worker that failed or was killed)?"""
    return "error" in df and bool(df["error"].fillna("").astype(str).str.len().gt(0).any())


def _check_measured(df) -> None:
    if df.empty:
        raise ConfigError("nothing was measured: no test matched the options (check -p/-n/-b/-ub)")


def _error_lines(df) -> str:
    """Each distinct error once, under the table: which run, and the worker's one-line message."""
    if "error" not in df:
        return ""
    seen, lines = set(), []
    for r in df[df["error"].fillna("").astype(str).str.len() > 0].to_dict("records"):
        key = (r.get("variant"), r.get("devices"), r.get("n_ubatch"), r["error"])
        if key not in seen:
            seen.add(key)
            lines.append(f"  {r.get('variant')} {r.get('devices')} ub={r.get('n_ubatch')}: {r['error']}")
    return ("\nerrors:\n" + "\n".join(lines)) if lines else ""


def _workload(args, model: str, variants) -> int:
    """--workload mixed: runner.MIXED_WORKLOAD in one context per variant, -r rounds, on every device spec."""
    if args.plan or args.fit:
        raise ConfigError("--workload takes no --plan or --fit yet: run it with --host-experts / -ts")
    dfs = [runner.mixed_workload(cfg, variants=variants, rounds=args.reps) for cfg in _configs(args, model)]
    df = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame()
    _check_measured(df)
    cols = [c for c in ("variant", "devices", "test", "avg_ts", "speedup", "re_reservations", "plan_switches",
                        "host_syncs") if c in df.columns]
    rows = json.loads(df.to_json(orient="records"))
    if args.out:
        RowWriter(Path(args.out)).write(Row.from_dict(r) for r in rows)
    _emit(args, {"rows": rows},
          df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}") + _error_lines(df))
    return 1 if _failed(df) else 0


def _resumed(args) -> tuple[list, list[str]]:
    """--resume DIR: the sweep's own configs and variants (DIR/sweep.json); other measurement options are refused
    (the sweep keeps the options it started with)."""
    plain = build_parser().parse_args([args.cmd, "--resume", str(args.resume)])
    given = [k for k, v in vars(plain).items() if k not in ("json", "resume", "func") and getattr(args, k, v) != v]
    if given:
        flags = ", ".join("MODEL" if k == "model" else "--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"--resume continues a sweep with the options it started with ({args.resume}/"
                          f"{runner.SWEEP_FILE}); drop {flags}")
    args.out = args.resume
    return runner.load_sweep(args.resume)


def _interrupted(out: Optional[Path], cmd: str, resumable: bool = True) -> int:
    """Ctrl-C during a sweep: what is kept and how to go on (exit 130, as a shell reports SIGINT)."""
    if out is not None and (Path(out) / "results.jsonl").exists():
        n = len(read_rows(out))
        print(f"pyllama-pp: interrupted; the {n} row{'' if n == 1 else 's'} measured so far "
              f"{'is' if n == 1 else 'are'} in {Path(out) / 'results.jsonl'}; "
              + (f"continue with `pyllama-pp {cmd} --resume {out}`" if resumable else "run the rest again (a paired run "
                 "cannot be resumed)"), file=sys.stderr)
    else:
        print("pyllama-pp: interrupted (" + ("nothing was measured yet" if out else "rows stay on disk only with -o DIR")
              + ")", file=sys.stderr)
    return 130


def _ubatch_auto(args, model: str) -> None:
    """-ub auto: fit --ubatch auto on the (one) device spec for the longest prompt test; its n_ubatch, n_batch and
    plan then stand for -ub, -b and --fit same (both variants on the patched plan's placement)."""
    if args.ubatch != ["auto"]:
        return
    if len(args.devices) != 1 or args.plan or args.fit or args.workload:
        raise ConfigError("-ub auto plans for one --devices spec, without --plan, --fit or --workload: give one spec "
                          "(or sweep n_ubatch by hand: -ub 512,1024,...)")
    if not args.pp:
        raise ConfigError("-ub auto chooses n_ubatch for a prompt: give -p N (the prompt's length)")
    n_tokens = max(args.pp) + max(args.depth or [0])
    n_ctx = args.ctx or n_tokens + 256
    plan = fit_ubatch(model, devices=args.devices[0], margin=args.margin, n_tokens=max(args.pp),
                      ctx=ContextParams(n_ctx=n_ctx, n_batch=max(args.batch or [max(args.pp)])))
    if not args.json:
        print(plan, file=sys.stderr)
    args.ubatch, args.batch, args.auto_plan = [plan.ctx["n_ubatch"]], [plan.ctx["n_batch"]], plan


def _plan_sizes(args) -> None:
    """--plan PLAN.json: the plan's model where none is given, and its sizes where -b / -ub / -c are not given (the
    plan's memory was measured for them); larger ones than it was made for are refused (they need more memory)."""
    if not args.plan:
        return
    plan = Plan.load(args.plan)
    if args.model is None:
        args.model = plan.model
    made = {"batch": plan.ctx.get("n_batch"), "ubatch": plan.ctx.get("n_ubatch")}
    for key, flag in (("batch", "-b"), ("ubatch", "-ub")):
        if made[key] is None:
            continue
        if getattr(args, key) is None:
            setattr(args, key, [made[key]])
        elif max(getattr(args, key)) > made[key]:
            raise ConfigError(f"{flag} {max(getattr(args, key))}: the plan {args.plan} was made for n_batch "
                              f"{made['batch']}, n_ubatch {made['ubatch']} and n_ctx {plan.n_ctx}, and larger batches "
                              f"need more memory than it planned. Fix: drop {flag}, or make a plan for these sizes "
                              f"(`pyllama-pp fit {args.model} -b N -ub N -o PLAN.json`)")
    if args.ctx > plan.n_ctx:
        raise ConfigError(f"-c {args.ctx}: the plan {args.plan} was made for n_ctx {plan.n_ctx}. Fix: -c {plan.n_ctx} "
                          f"or less, or make a plan with `pyllama-pp fit {args.model} -c {args.ctx} -o PLAN.json`")
    if args.ctx == 0:
        args.ctx = plan.n_ctx
    if args.pp is None:   # (a default prompt that fits the plan's context, beside the default decode test)
        tg = args.tg if args.tg is not None else [16]
        room = args.ctx - 8 - max(tg or [0]) - max(args.depth or [0])
        args.pp = [min(512, 1 << (room.bit_length() - 1))] if room >= 1 else []


def cmd_run(args) -> int:
    if args.resume:
        cfgs, variants = _resumed(args)
    else:
        _plan_sizes(args)
        if args.model is None:
            raise ConfigError("run needs a MODEL (a .gguf file), or --resume DIR to continue a sweep")
        _fill_defaults(args, PLAIN)
        _ubatch_auto(args, args.model)
        _check_args(args, args.model, [args.variant])
        if args.workload:
            return _workload(args, args.model, [args.variant])
        cfgs, variants = _configs(args, args.model), [args.variant]
        _apply_plans(args, args.model, cfgs, variants)
    try:
        df = runner.ab(cfgs, variants=variants, out_dir=args.out, progress=not args.json, resume=bool(args.resume))
    except KeyboardInterrupt:
        return _interrupted(args.out, "run")
    _check_measured(df)
    _emit(args, {"rows": json.loads(df.to_json(orient="records"))}, _print_rows(df))
    return 1 if _failed(df) else 0


def cmd_ab(args) -> int:
    if args.resume:
        cfgs, variants = _resumed(args)
        model = cfgs[0].model
    else:
        _plan_sizes(args)
        default = args.model is None
        model = args.model or _default_model()
        if default and args.devices == ["cpu"] and not args.plan:   # (--plan: the plan's devices)
            args.devices = [DEFAULT_DEVICES]
        # (the main job places by fit unless told where: --plan, or a placement of one's own)
        # (--workload takes no fit yet: it runs the main job's model on an even split)
        placed = args.workload or args.plan or args.tensor_split is not None or args.host_experts != ["all"] \
            or args.ngl != -1 or args.ubatch == ["auto"]
        _fill_defaults(args, (dict(MAIN_JOB, fit=None) if placed else MAIN_JOB) if default else PLAIN)
        _ubatch_auto(args, model)
        _check_args(args, args.model, list(VARIANTS))
        if args.workload and args.paired:
            raise ConfigError("--paired runs the tests (-p/-n) in rounds; --workload has rounds of its own (-r). "
                              "Fix: drop one of them")
        if args.workload:
            if args.loads > 1:
                raise ConfigError("--loads repeats paired rounds (-p/-n); --workload has rounds of its own (-r). "
                                  "Fix: drop --loads")
            return _workload(args, model, list(VARIANTS))
        if args.loads > 1 and not args.paired:
            raise ConfigError(f"--loads {args.loads} repeats paired rounds with fresh workers. Fix: add --paired N, "
                              "or drop --loads")
        cfgs, variants = _configs(args, model), list(VARIANTS)
        _apply_plans(args, model, cfgs, variants)
    notes = [CPU_ONLY_NOTE] if all(not devspec.parse(c.devices).accelerators for c in cfgs) else []
    for note in notes if not args.json else []:
        print(f"pyllama-pp: note: {note}", file=sys.stderr)
    out = Path(args.out or Path("pyllama_pp_out") / time.strftime("ab-%Y%m%d-%H%M%S"))
    try:
        if args.paired:
            df = runner.interleaved(cfgs, variants=variants, rounds=args.paired, out_dir=out, progress=not args.json,
                                   loads=args.loads)
        else:
            df = runner.ab(cfgs, variants=variants, out_dir=out, progress=not args.json, resume=bool(args.resume))
    except KeyboardInterrupt:   # (rows of a paired run come whole, per config; there is no sweep to resume)
        return _interrupted(out, "ab", resumable=not args.paired)
    _check_measured(df)
    md = markdown(df)
    (out / "results.md").write_text(md)
    png = plot(df, out / "ab.png", title=f"{Path(model).name}: baseline vs patched")
    files = {"jsonl": str(out / "results.jsonl"), "csv": str(out / "results.csv"), "markdown": str(out / "results.md"),
             "plot": str(png) if png else None}
    _emit(args, {"rows": json.loads(df.to_json(orient="records")), "files": files, "notes": notes},
          md + _error_lines(df) + "\n" + "\n".join(f"{k}: {v}" for k, v in files.items() if v))
    return 1 if _failed(df) else 0


def cmd_fit(args) -> int:
    auto = args.ubatch == "auto"
    if not auto and args.batch < args.ubatch:
        raise ConfigError(f"-ub/--ubatch ({args.ubatch}) is larger than -b/--batch ({args.batch}). Fix: -ub <= -b")
    ctx = ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=min(args.batch, 512) if auto else args.ubatch,
                        op_offload=not args.no_op_offload, offload_kqv=not args.no_kv_offload)
    spread = args.spread if args.spread in ("equal", "links") else args.spread.split(",")
    kw = dict(devices=args.devices, ctx=ctx, variant=args.variant, margin=args.margin, split_mode=args.split_mode,
              check=not args.no_check, spread=spread, link_gbps=args.link_gbps)
    if auto:
        plan = fit_ubatch(args.model, shared_link=args.shared_link, **kw)
    else:
        plan = fit(args.model, **kw)
    if args.out:
        plan.save(args.out)
    _emit(args, {"pyllama_pp_plan": 1, **plan.to_dict()},
          str(plan) + (f"\nplan written to {args.out}" if args.out else ""))
    return 0


def cmd_rpc_server(args) -> int:
    """Serve this machine's devices over llama.cpp's ggml RPC until killed."""
    rpc_server.serve(args.devices, host=args.host, port=args.port, variant=args.variant, threads=args.threads,
                     cpu=args.cpu, host_ram=devspec.parse_size(args.host_ram) if args.host_ram else 0)
    return 1   # (serve returns only by an error, which it raises)


def cmd_check(args) -> int:
    """Both variants on one placement, every token's logits compared; exit 1 on a mismatch."""
    model = args.model or _default_model()
    check_model_path(model)
    if args.switch:
        _check_switches(args.switch, ["patched"])
    switches = _switches(args.switch)
    if args.ubatch > args.batch:
        raise ConfigError(f"-ub/--ubatch ({args.ubatch}) is larger than -b/--batch ({args.batch}). Fix: -ub <= -b")
    n_ctx = ctx_for(args.tokens)
    res = check_logits(model, devices=args.devices,
                       placement=Placement(host_experts=args.host_experts, tensor_split=args.tensor_split),
                       ctx=ContextParams(n_ctx=n_ctx, n_batch=args.batch, n_ubatch=args.ubatch),
                       n_tokens=args.tokens, seed=args.seed, switches=switches)
    pp_b, pp_p = ("on" if x else "off" for x in (res.baseline_pipeline_parallel, res.patched_pipeline_parallel))
    _emit(args, res.to_dict(),
          f"{Path(model).name} on {res.devices}, host experts {res.placement}, {res.n_tokens} tokens, "
          f"n_ubatch {res.n_ubatch} (pipelining baseline {pp_b}, patched {pp_p}, {res.patched_n_splits} splits):\n"
          f"  patched vs baseline logits: NMSE {res.nmse:.3g}, max abs difference {res.max_abs_diff:.3g} -> "
          + ("same (NMSE <= %g)" % res.nmse_max if res.ok else "MISMATCH (NMSE > %g)" % res.nmse_max))
    return 0 if res.ok else 1


def cmd_trace(args) -> int:
    """The experts each MoE layer chose for each token (pyllama_pp.trace); -o writes them (.npz)."""
    tr = trace.record(args.model, n_prompt=args.pp, n_decode=args.tg, seed=args.seed, variant=args.variant,
                      devices=args.devices, out=args.out)
    s = trace.summary(tr)
    _emit(args, {**s, "out": str(args.out) if args.out else None}, trace.describe(s, args.out))
    return 0


def _margin_arg(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _apply_plans(args, model: str, cfgs: list, variants: list[str]) -> None:
    """--plan PLAN.json (one plan for every variant) or --fit (each variant's own fit for each config): the
    placement of each variant's run, in place of --host-experts / -ts / -ngl."""
    auto = getattr(args, "auto_plan", None)
    if not (args.plan or args.fit or auto):
        return
    if args.plan and args.fit:
        raise ConfigError("give --plan PLAN.json or --fit, not both")
    plan = auto or (Plan.load(args.plan) if args.plan else None)
    for cfg in cfgs:
        if plan is not None:
            plan.check(model, None if cfg.devices == "cpu" else cfg.devices)
            if cfg.devices == "cpu":
                spec = plan.devices_spec
                cfg.devices = spec.get("text") if spec.get("text") and not str(spec.get("text")).endswith(".json") \
                    else json.dumps({k: v for k, v in spec.items() if k != "text"})
            cfg.plans = {v: plan.placement(args.load_mode, source="fit" if auto else "plan") for v in variants}
            cfg.switches = {**plan.switches, **cfg.switches}   # the plan's copies (patched runs only)
            continue
        n_ctx = cfg.context().n_ctx
        ctx = ContextParams(n_ctx=n_ctx, n_batch=cfg.n_batch, n_ubatch=min(cfg.n_ubatch, cfg.n_batch))
        cfg.plans = {}
        for v in (["patched"] if args.fit == "same" else variants):
            p = fit(model, devices=cfg.devices_for(v), ctx=ctx, variant=v, margin=args.margin, env=cfg.env or None)
            if not args.json:
                print(p, file=sys.stderr)
            cfg.plans[v] = p.placement(args.load_mode, source="fit")
            if v == "patched":
                cfg.switches = {**p.switches, **cfg.switches}
        if args.fit == "same":
            cfg.plans = {v: cfg.plans["patched"] for v in variants}


# ---------------------------------------------------------------------------------------------------------
class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wrapped option help, an epilog kept as written (the device spec forms)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (what is wrong, and where the options are listed), or under --json as one JSON
    document on stdout; exit 2 either way, as argparse does."""

    json_errors = False   # (main sets it from the command line before parsing)

    def error(self, message: str):
        if _Parser.json_errors:
            print(json.dumps({"error": message, "type": "UsageError", "details": None}))
        print(f"{self.prog}: error: {message}. See `{self.prog} --help` for the options and their forms.",
              file=sys.stderr)
        sys.exit(2)


# options whose values may start with "-" (a negative number, a size): "--margin -1MiB" is read as "--margin=-1MiB"
_DASH_VALUES = ("--margin", "-c", "--ctx", "-ngl", "--ngl", "-b", "--batch", "-ub", "--ubatch", "-p", "--pp", "-n",
                "--tg", "-d", "--n-depth", "-r", "--reps", "--seed", "-ts", "--tensor-split")


def _join_dash_values(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _DASH_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-") and len(argv[i + 1]) > 1 \
                and not argv[i + 1].startswith("--"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    """The `pyllama-pp` argument parser (every subcommand, with its options and defaults)."""
    EXPERT_TYPES, PRESETS, ROUTING_MODES, WEIGHT_TYPES = (synth.EXPERT_TYPES, synth.PRESETS, synth.ROUTING_MODES,
                                                          synth.WEIGHT_TYPES)
    ap = _Parser(prog="pyllama-pp", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pyllama_pp {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    json_help = "print one JSON document on stdout instead of the table (errors too, as {\"error\": ...})"

    p = sub.add_parser("info", help="upstream commit, variants and their patches, switches, backends, devices",
                       formatter_class=_HelpFormatter)
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument("--markdown-switches", action="store_true",
                   help="print the patched build's switch table as the README's Markdown section, nothing else")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("synth", help="write a random-weight MoE GGUF (with a routing control)",
                       formatter_class=_HelpFormatter)
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS),
                   help="model shape and family (default: tiny, the CI model, qwen3moe; qwen3-30b-a3b is 29.8 GiB in "
                        "Q8_0); mixtral-* (llama), qwen2moe-*, glm4moe-tiny/glm4.5-air-l24, "
                        "deepseek2-tiny/deepseek-v2-lite (MLA), gptoss-tiny/gpt-oss-20b (MXFP4 experts)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    p.add_argument("--type", default="q8_0", choices=list(WEIGHT_TYPES), help="weight type (default: q8_0)")
    p.add_argument("--expert-type", dest="expert_type", choices=list(EXPERT_TYPES),
                   help="the routed experts' type (default: the preset's: --type, mxfp4 for gpt-oss; q4_k needs rows "
                        "of multiples of 256)")
    p.add_argument("--routing", choices=list(ROUTING_MODES),
                   help="uniform: every expert used about equally; skewed: some experts far more (real models' "
                        "coverage); locality: consecutive token ids route to slowly changing experts (decode's "
                        "temporal locality); natural: plain random weights (default: the preset's, uniform)")
    p.add_argument("--skew", type=float, help="with --routing skewed: how strongly (default: 1.0; 0 = uniform); with "
                   f"locality: its popularity profile (default: {synth.DEFAULT_LOCALITY_SKEW:g})")
    for dim, what in (("n_layer", "layers"), ("n_embd", "embedding width"), ("n_expert", "experts per layer"),
                      ("n_expert_used", "experts used per token"), ("n_ff_exp", "expert FFN width"),
                      ("n_vocab", "vocabulary size")):
        p.add_argument("--" + dim.replace("_", "-"), dest=dim, type=int, metavar="N",
                       help=f"{what} (default: the preset's)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_synth)

    def common(p, model_required: bool):
        if model_required:
            p.add_argument("model", nargs="?", help="GGUF model file (required unless --resume)")
        else:
            p.add_argument("model", nargs="?", help="GGUF model file (default: the main job, a tiny synthetic MoE "
                                                     f"with every expert in host RAM on {DEFAULT_DEVICES})")
        p.add_argument("--devices", type=lambda s: [x for x in s.split(";") if x], default=["cpu"],
                       help="device spec; several ';'-separated are swept (default: cpu; the main job: "
                            f"{DEFAULT_DEVICES}; forms below)")
        p.add_argument("--host-experts", type=lambda s: s.split(","), default=["all"],
                       help="experts in host RAM: all, none or N (the first N layers, like --n-cpu-moe); "
                            "comma-separated to sweep (default: all)")
        p.add_argument("-b", "--batch", type=_ints, default=None, metavar="N[,N]",
                       help="n_batch, comma-separated to sweep (default: 512; the main job: 2048)")
        p.add_argument("-ub", "--ubatch", type=lambda x: ["auto"] if x == "auto" else _ints(x), default=None,
                       metavar="N[,N]|auto",
                       help="n_ubatch, comma-separated to sweep (default: 32; the main job: 128); auto: the one "
                            "fit --ubatch auto predicts fastest for the longest prompt, with its plan for both variants")
        p.add_argument("-c", "--ctx", type=int, default=0, metavar="N",
                       help="n_ctx (default: 0, just what the tests need)")
        p.add_argument("-ngl", "--ngl", type=int, default=-1, metavar="N",
                       help="layers on the devices (default: -1, every layer)")
        p.add_argument("-ts", "--tensor-split", type=lambda s: [float(x) for x in s.split(",")], default=None,
                       metavar="A,B", help="layer proportions per device, like llama's -ts (default: even; "
                                           "the main job: fit's)")
        p.add_argument("-p", "--pp", type=_ints, default=None, metavar="N[,N]",
                       help="prompt lengths of pp tests, 0 for none (default: 512; the main job: 2048)")
        p.add_argument("-n", "--tg", type=_ints, default=None, metavar="N[,N]",
                       help="generation lengths of tg tests, 0 for none (default: 16; the main job: none, as "
                            "decode needs --paired)")
        p.add_argument("-d", "--n-depth", dest="depth", type=_ints, default=[0], metavar="N[,N]",
                       help="tokens already in the context before each test, like llama-bench's -d (default: 0)")
        p.add_argument("-r", "--reps", type=_positive, default=3, metavar="N",
                       help="repetitions per test; with --workload, rounds (default: 3)")
        p.add_argument("--workload", choices=["mixed"],
                       help="mixed: prompts pp64, pp512, pp128, pp2048 from an empty cache, then tg16, in one context "
                            "per variant, -r rounds (re-reservations and plan switches per step); -p/-n/-d are ignored")
        p.add_argument("--load-mode", default="none", choices=["none", "mmap"],
                       help="none: no mmap, host weights pinned where possible - upstream's fastest (default: none)")
        p.add_argument("--offload-min-batch", type=int, metavar="N",
                       help="GGML_OP_OFFLOAD_MIN_BATCH for both variants (default: llama.cpp's, 32)")
        p.add_argument("--switch", action="append", metavar="NAME=VALUE",
                       help="a patched scheduler switch, e.g. UPLOAD_ALL=0, repeatable (default: none; "
                            "`pyllama-pp info` lists them)")
        p.add_argument("-o", "--out", type=Path, metavar="DIR",
                       help="folder for the rows (jsonl, csv), the table and the plot "
                            "(default: run writes none; ab: pyllama_pp_out/ab-DATE-TIME)")
        p.add_argument("--plan", metavar="PLAN.json",
                       help="run with a fit plan (`pyllama-pp fit ... -o PLAN.json`) instead of --host-experts/-ts/-ngl; "
                            "--devices defaults to the plan's")
        p.add_argument("--fit", nargs="?", const="each", default=None, choices=["each", "same"],
                       help="plan each config with fit first: each (the default value) runs each variant with its "
                            "own variant's plan, same runs every variant with the patched build's plan (one "
                            "placement; the main job's default)")
        p.add_argument("--margin", type=_margin_arg, default=None, metavar="SIZE[,SIZE]",
                       help="with --fit: memory to leave free per device (default: 1GiB on CUDA, 0 on VDEVs)")
        p.add_argument("--resume", type=Path, metavar="DIR",
                       help="continue the sweep whose rows are in DIR (its -o folder) with its own options: configs "
                            "whose rows are all there without an error are not measured again")
        p.add_argument("--json", action="store_true", help=json_help)

    epilog = "device specs (--devices):" + FORMS
    p = sub.add_parser("run", help="run one variant (in a worker process): llama-bench-like rows and counters",
                       formatter_class=_HelpFormatter, epilog=epilog)
    common(p, True)
    p.add_argument("--variant", default="patched", choices=["patched", "baseline"],
                   help="which build runs (default: patched)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("fit", help="plan layers and host experts on the devices with a variant's fit (common/fit.cpp)",
                       formatter_class=_HelpFormatter, epilog=epilog)
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--devices", required=True, help="device spec (forms below); fit needs devices with memory")
    p.add_argument("--variant", default="patched", choices=["patched", "baseline"],
                   help="whose fit: patched spreads host experts over the devices (the series' fit patch), baseline is "
                        "upstream's (default: patched)")
    p.add_argument("-c", "--ctx", type=int, default=4096, metavar="N",
                   help="n_ctx to plan for; 0: fit chooses it (default: 4096)")
    p.add_argument("-b", "--batch", type=_positive, default=2048, metavar="N", help="n_batch (default: 2048)")
    p.add_argument("-ub", "--ubatch", type=lambda x: x if x == "auto" else _positive(x), default=512,
                   metavar="N|auto", help="n_ubatch; auto: the n_ubatch (64-4096, and an n_batch of 8 of them) whose "
                                          "plan the bytes bound predicts fastest (default: 512)")
    p.add_argument("--margin", type=_margin_arg, default=None, metavar="SIZE[,SIZE]",
                   help="memory to leave free on each device, one value or one per device "
                        "(default: upstream's 1GiB on CUDA, 0 on VDEVs, whose budgets are exact)")
    p.add_argument("--spread", default="equal", metavar="equal|links|W0,W1",
                   help="the patched fit's shares of host-expert layers: equal, links (by each device's host link "
                        "rate: a VDEV's own, on CUDA --link-gbps) or one weight per device (default: equal)")
    p.add_argument("--link-gbps", type=lambda x: [float(v) for v in x.split(",")], default=None, metavar="R0,R1",
                   help="each device's host link in GB/s, for --spread links and --ubatch auto (default: a VDEV's "
                        "own; CUDA 55, a PCIe 5 x16 link)")
    p.add_argument("--shared-link", action="store_true",
                   help="the devices share one host link (one GPU split in two): --ubatch auto predicts so")
    p.add_argument("--split-mode", default="layer", choices=["layer", "none", "row"],
                   help="llama's split mode (default: layer; fit's spread path needs it)")
    p.add_argument("--no-op-offload", action="store_true", help="plan without op offload (upstream's path then)")
    p.add_argument("--no-kv-offload", action="store_true", help="plan with the KV cache in host memory")
    p.add_argument("--no-check", action="store_true",
                   help="take fit's plan as it is, even one that leaves whole layers on the CPU or a device over its "
                        "target (default: an error that says so)")
    p.add_argument("-o", "--out", type=Path, metavar="PLAN.json", help="save the plan there (for run/ab --plan)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("ab", help="baseline vs patched on the same model, placement and batch sizes",
                       formatter_class=_HelpFormatter, epilog=epilog)
    common(p, False)
    p.add_argument("--paired", type=_even_rounds, metavar="N",
                   help="N (even) paired rounds instead of -r reps: one worker per variant loads the model once, then "
                        "each round runs every test once per variant, the order alternating (ABBA); rows get the median "
                        "speedup over AB / BA pairs of rounds and its 95%% interval (speedup_ci_lo/hi). For decode, "
                        "whose drift over time is larger than small gaps. Both variants stay loaded: with --fit or "
                        "--plan on GPUs, plan for half of each device")
    p.add_argument("--baseline-devices", type=lambda s: [x for x in s.split(";") if x], default=None,
                   metavar="SPEC",
                   help="for RPC devices: the baseline's own servers on the same hosts, in the same order "
                        "(`pyllama-pp rpc-server --variant baseline` beside each patched one; upstream's client "
                        "refuses patched servers). ';'-separated, one per --devices spec")
    p.add_argument("--loads", type=_positive, default=1, metavar="K",
                   help="with --paired: K fresh loads of both workers, N rounds each, the variants' load order "
                        "alternating; the interval then resamples whole loads (where each process's memory lands can "
                        "move decode by more than the variants differ)")
    p.set_defaults(func=cmd_ab)

    p = sub.add_parser("check", help="both variants on one placement: are the patched logits the baseline's?",
                       formatter_class=_HelpFormatter, epilog=epilog)
    p.add_argument("model", nargs="?", help="GGUF model file (default: the main job's model)")
    p.add_argument("--devices", default="vdev:2x0@0", help="device spec (default: vdev:2x0@0, two VDEVs; forms below)")
    p.add_argument("--host-experts", default="all",
                   help="experts in host RAM: all, none or N (the first N layers) (default: all)")
    p.add_argument("-ts", "--tensor-split", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   metavar="A,B", help="layer proportions per device (default: even)")
    p.add_argument("-b", "--batch", type=_positive, default=256, metavar="N", help="n_batch (default: 256)")
    p.add_argument("-ub", "--ubatch", type=_positive, default=64, metavar="N", help="n_ubatch (default: 64)")
    p.add_argument("-n", "--tokens", type=_positive, default=256, metavar="N",
                   help="random tokens decoded, every one's logits compared (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="the tokens' seed (default: 0)")
    p.add_argument("--switch", action="append", metavar="NAME=VALUE", help="a patched scheduler switch, repeatable")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("trace", help="the experts each MoE layer chooses for each token (for expert-cache hit rates)",
                       formatter_class=_HelpFormatter, epilog=epilog)
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--devices", default="cpu", help="device spec (default: cpu; forms below)")
    p.add_argument("--variant", default="patched", choices=["patched", "baseline"], help="the build (default: patched)")
    p.add_argument("-p", "--pp", type=int, default=0, metavar="N", help="prompt tokens first (default: 0)")
    p.add_argument("-n", "--tg", type=int, default=128, metavar="N", help="tokens decoded one by one (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="the tokens' seed, as run's (default: 0)")
    p.add_argument("-o", "--out", type=Path, help="write the trace here (.npz: ids [tokens, layers, k] and metadata)")
    p.add_argument("--json", action="store_true", help=json_help)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("rpc-server", help="serve this machine's devices to other hosts (llama.cpp's ggml RPC)",
                       formatter_class=_HelpFormatter, epilog=epilog)
    p.add_argument("--devices", default="cpu", help="device spec of this machine to serve (default: cpu; forms below)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; the protocol has no authentication)")
    p.add_argument("--port", type=_positive, default=50052, help="port to listen on (default: 50052)")
    p.add_argument("--variant", choices=list(VARIANTS), default="patched",
                   help="the build that serves: patched (default) keeps host experts of its devices' layers in this "
                        "host's RAM (RPC protocol 7.1; clients of the same variant); baseline is upstream's server "
                        "(7.0)")
    p.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="CPU threads: a served CPU device's, and those of the CPU the patched server runs beside its "
                        "devices (default: every core this process may use)")
    p.add_argument("--cpu", action="store_true",
                   help="serve this host's CPU too, as the last device (upstream's place for experts in a server's "
                        "RAM: a client overrides them to its buffer type, RPC<N>[HOST:PORT])")
    p.add_argument("--host-ram", default=None, metavar="SIZE",
                   help="the most of this host's memory the clients' host experts may take, e.g. 64GiB (default: "
                        "no limit of its own; the patched variant; fit plans within it)")
    p.set_defaults(func=cmd_rpc_server)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = _join_dash_values(list(sys.argv[1:] if argv is None else argv))
    _Parser.json_errors = "--json" in argv
    args = build_parser().parse_args(argv)
    # llama-bench's -p 0 / -n 0: no prompt / no generation tests
    if getattr(args, "tg", None) == [0]:
        args.tg = []
    if getattr(args, "pp", None) == [0]:
        args.pp = []
    try:
        return args.func(args)
    except (PyllamaError, ValueError, OSError) as e:
        kind = getattr(e, "error_type", None) or type(e).__name__
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": kind, "details": getattr(e, "details", "") or None}))
        # one statement on stderr: what is wrong and how to fix it (--json adds the worker's traceback or stderr;
        # a device spec's list of accepted forms is in --help)
        first = str(e).strip().splitlines()[0] if str(e).strip() else kind
        if isinstance(e, DeviceSpecError) and "\n" in str(e).strip():
            first += f" See `pyllama-pp {getattr(args, 'cmd', 'run')} --help` for the accepted forms."
        print(f"pyllama-pp: error: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyllama-pp: interrupted (rows written so far are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
