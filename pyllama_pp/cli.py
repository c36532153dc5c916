"""`pyllama-pp`: info, synth, run, fit, ab, check, trace, rpc-server. Every subcommand takes --json (one JSON document on
stdout). The CLI parses, builds one description of the run (pyllama_pp.planning.Choices), calls the library and
prints; defaults and their help come from pyllama_pp.defaults."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from . import runner, synth, trace
from . import devices as devspec
from ._version import __version__
from .about import about, about_text, switch_table, switches_markdown
from .binding import VARIANTS
from .check import check_context, check_logits
from .defaults import (CHECK, CONTEXT, CUDA_LINK_GBPS, FIT, MAIN_JOB, MARGINS, OFFLOAD_MIN_BATCH, PAIRED, RPC_HOST,
                       RPC_PORT, RUN, TRACE, UBATCH_CANDIDATES, WORKLOADS)
from .devices import FORMS, FORMS_HEADING
from .errors import ConfigError, DeviceSpecError, PyllamaError
from .fit import fit, fit_ubatch
from .workload import Workload
from .model_file import check_model_path
from .params import ContextParams, Placement
from .planning import Choices, check_switches, cpu_only_notes, main_job_model, plan_runs
from .report import (any_failed, check_measured, error_lines, markdown, noise_warnings, plot, row_notes,
                     text_table)
from .row import read_rows
from .servers import serve as rpc_server
from .switches import ExpertCache, parse_given

BASELINE_SERVERS = ("`pyllama-pp rpc-server --variant baseline` beside each patched one; upstream's client refuses "
                    "patched servers")
JSON_HELP = "print one JSON document on stdout instead of the table (errors too, as {\"error\": ...})"
__all__ = ["main", "build_parser", "choices_from_args"]


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


def _workload_arg(s: str) -> str:
    try:
        Workload.parse(s)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


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


def _specs(s: str) -> list[str]:
    return [x for x in s.split(";") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def _margin_arg(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _size(n: int) -> str:
    """Bytes as a help text writes them: 1GiB, 0."""
    return f"{n // 2**30}GiB" if n and n % 2**30 == 0 else str(n)


def _nums(values) -> str:
    return ",".join(map(str, values)) if values else "none"


# -- info, synth, fit, check, rpc-server ---------------------------------------------------------------------------
def cmd_info(args) -> int:
    if args.markdown_switches:
        print(switches_markdown(switch_table()))
        return 0
    data = about()
    _emit(args, data, about_text(data))
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


def _device_notes(args, *specs) -> None:
    """How the device specs were read (a default they left to us), as notes on stderr."""
    for note in [n for spec in specs if spec for n in devspec.parse(spec).notes] if not args.json else ():
        print(f"pyllama-pp: note: {note}", file=sys.stderr)


def cmd_fit(args) -> int:
    _device_notes(args, args.devices)
    auto = args.ubatch == "auto"
    batch = args.batch or FIT.n_batch
    if not auto and batch < args.ubatch:
        raise ConfigError(f"-ub/--ubatch ({args.ubatch}) is larger than -b/--batch ({batch}). Fix: -ub <= -b")
    ctx = ContextParams(n_ctx=args.ctx, n_batch=batch, n_ubatch=min(batch, FIT.n_ubatch) if auto else args.ubatch,
                        op_offload=not args.no_op_offload, offload_kqv=not args.no_kv_offload)
    spread = args.spread if args.spread in ("equal", "links") else args.spread.split(",")
    switches = parse_given(args.switch)
    check_switches(switches, [args.variant])
    kw = dict(devices=args.devices, ctx=ctx, variant=args.variant, margin=args.margin, split_mode=args.split_mode,
              check=not args.no_check, spread=spread, link_gbps=args.link_gbps, switches=switches,
              expert_cache=None if args.expert_cache is None else ExpertCache.parse(args.expert_cache, args.variant))
    kw.update(workload=args.workload, trace=args.trace, load_mode=args.load_mode, progress=not args.json)
    plan = fit_ubatch(args.model, shared_link=args.shared_link, n_batch=args.batch, **kw) \
        if auto else fit(args.model, **kw)
    if args.out:
        plan.save(args.out)
    _emit(args, {"pyllama_pp_plan": 1, **plan.to_dict()},
          str(plan) + (f"\nplan written to {args.out}" if args.out else ""))
    return 0


def cmd_check(args) -> int:
    """Both variants on one placement, every token's logits compared; exit 1 on a mismatch."""
    model = args.model or main_job_model()
    check_model_path(model)
    _device_notes(args, args.devices, args.baseline_devices)
    switches = parse_given(args.switch)
    check_switches(switches, ["patched"])
    if args.ubatch > args.batch:
        raise ConfigError(f"-ub/--ubatch ({args.ubatch}) is larger than -b/--batch ({args.batch}). Fix: -ub <= -b")
    ctx = ContextParams(n_ctx=check_context(args.tokens).n_ctx, n_batch=args.batch, n_ubatch=args.ubatch)
    res = check_logits(model, devices=args.devices,
                       placement=Placement(host_experts=args.host_experts, tensor_split=args.tensor_split),
                       ctx=ctx, n_tokens=args.tokens, seed=args.seed, switches=switches,
                       baseline_devices=args.baseline_devices)
    _emit(args, res.to_dict(), str(res))
    return 0 if res.ok else 1


def cmd_rpc_server(args) -> int:
    """Serve this machine's devices over llama.cpp's ggml RPC until killed."""
    rpc_server.serve(args.devices, host=args.host, port=args.port, variant=args.variant, threads=args.threads,
                     cpu=args.cpu, host_ram=devspec.parse_size(args.host_ram) if args.host_ram else 0)
    return 1   # (serve returns only by an error, which it raises)


def cmd_trace(args) -> int:
    """The experts each MoE layer chose for each token (pyllama_pp.trace); -o writes them (.npz)."""
    tr = trace.record(args.model, n_prompt=args.pp, n_decode=args.tg, seed=args.seed, variant=args.variant,
                      devices=args.devices, out=args.out)
    s = trace.summary(tr)
    _emit(args, {**s, "out": str(args.out) if args.out else None}, trace.describe(s, args.out))
    return 0


# -- run and ab: choices -> planning -> runner -> tables ------------------------------------------------------------
def choices_from_args(args) -> Choices:
    """run / ab's options as the library's Choices (None where an option was not given)."""
    tup = lambda x: tuple(x) if x is not None else None
    tests = lambda x: () if x == [0] else tup(x)   # (llama-bench's -p 0 / -n 0: none)
    return Choices(command=args.cmd, model=args.model, variant=getattr(args, "variant", RUN.variant),
                   devices=tup(args.devices), host_experts=tuple(args.host_experts), n_batch=tup(args.batch),
                   n_ubatch=args.ubatch if args.ubatch == "auto" else tup(args.ubatch), n_ctx=args.ctx,
                   n_gpu_layers=args.ngl, tensor_split=tup(args.tensor_split), pp=tests(args.pp), tg=tests(args.tg),
                   depth=tuple(args.depth), reps=args.reps, workload=args.workload, load_mode=args.load_mode,
                   offload_min_batch=args.offload_min_batch, switches=parse_given(args.switch), plan=args.plan,
                   fit=args.fit, margin=tup(args.margin), expert_cache=args.expert_cache,
                   baseline_devices=tup(getattr(args, "baseline_devices", None)),
                   paired=getattr(args, "paired", None), loads=getattr(args, "loads", PAIRED.loads))


def _resumed(args) -> tuple[list, list[str]]:
    """--resume DIR: the sweep's own configs and variants (DIR/sweep.json); other measurement options are refused
    (the sweep keeps the options it started with)."""
    plain = build_parser().parse_args([args.cmd, "--resume", str(args.resume)])
    given = [k for k, v in vars(plain).items() if k not in ("json", "resume", "func") and getattr(args, k, v) != v]
    if given:
        flags = ", ".join("MODEL" if k == "model" else "--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"--resume continues a sweep with the options it started with ({args.resume}/"
                          f"{runner.SWEEP_FILE}); drop {flags}")
    return runner.load_sweep(args.resume)


def _interrupted(out: Optional[Path], cmd: str, resumable: bool = True) -> int:
    """Ctrl-C during a sweep: what is kept and how to go on (exit 130, as a shell reports SIGINT)."""
    if out is not None and (Path(out) / "results.jsonl").exists():
        n = len(read_rows(out))
        print(f"pyllama-pp: interrupted; the {n} row{'' if n == 1 else 's'} measured so far "
              f"{'is' if n == 1 else 'are'} in {Path(out) / 'results.jsonl'}; "
              + (f"continue with `pyllama-pp {cmd} --resume {out}`" if resumable else "run the rest again (a paired run "
                 "or a workload cannot be resumed)"), file=sys.stderr)
    else:
        print("pyllama-pp: interrupted (" + ("nothing was measured yet" if out else "rows stay on disk only with -o DIR")
              + ")", file=sys.stderr)
    return 130


def _planned(args):
    """The configs, variants, choices (None when resumed) and notes of a run / ab."""
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"-o/--out {args.out} is a file, not a folder: give a folder for the rows")
    if args.resume:
        cfgs, variants = _resumed(args)
        return cfgs, variants, None, (cpu_only_notes(cfgs) if args.cmd == "ab" else [])
    planned = plan_runs(choices_from_args(args), progress=not args.json)
    for plan in planned.plans if not args.json else ():
        print(plan, file=sys.stderr)
    return list(planned.configs), list(planned.variants), planned.choices, list(planned.notes)


def cmd_measure(args) -> int:
    """run (one variant, rows) and ab (both, with a speedup, Markdown and a plot): plan, measure, print."""
    cfgs, variants, choices, notes = _planned(args)
    for note in notes if not args.json else ():
        print(f"pyllama-pp: note: {note}", file=sys.stderr)
    ab, paired = args.cmd == "ab", getattr(args, "paired", None)
    out = args.resume or args.out or (Path("pyllama_pp_out") / time.strftime("ab-%Y%m%d-%H%M%S") if ab else None)
    workload = choices is not None and choices.workload
    if args.resume and not args.json and not runner.left_to_run(cfgs, variants, args.resume):
        print(f"pyllama-pp: note: every config of {args.resume} was measured already, without an error: nothing was "
              "left to run; the table is its rows", file=sys.stderr)
    try:
        if workload:
            df = runner.mixed_workload(cfgs, variants=variants, rounds=choices.reps, out_dir=out,
                                       workload=choices.workload)
        elif paired:
            df = runner.interleaved(cfgs, variants=variants, rounds=paired, out_dir=out, progress=not args.json,
                                    loads=args.loads)
        else:
            df = runner.ab(cfgs, variants=variants, out_dir=out, progress=not args.json, resume=bool(args.resume))
    except KeyboardInterrupt:   # (rows of a paired run or a workload come whole; there is no sweep to resume)
        return _interrupted(out, args.cmd, resumable=not paired and not workload)
    check_measured(df)
    rows = json.loads(df.to_json(orient="records"))
    warnings = noise_warnings(df)
    for note in row_notes(df) if not args.json else ():
        print(f"pyllama-pp: note: {note}", file=sys.stderr)
    if not ab:
        _emit(args, {"rows": rows, "notes": notes, "warnings": warnings},
              text_table(df, ["variant", "devices", "n_batch", "n_ubatch", "test", "avg_ts", "stddev_ts",
                              "expert_cache_hit_rate", "layer_major_groups", "pipeline_parallel", "coverage",
                              "h2d_bytes"]
                         + (["re_reservations", "plan_switches", "host_syncs"] if workload else [])))
        _warnings(args, warnings)
        return 1 if any_failed(df) else 0
    out = Path(out)
    md = markdown(df)
    (out / "results.md").write_text(_made_by(args, df) + md)
    png = plot(df, out / "ab.png", title=f"{Path(cfgs[0].model).name}: baseline vs patched")
    files = {"jsonl": str(out / "results.jsonl"), "csv": str(out / "results.csv"), "markdown": str(out / "results.md"),
             "plot": str(png) if png else None}
    _emit(args, {"rows": rows, "files": files, "notes": notes, "warnings": warnings},
          md + error_lines(df) + "\n" + "\n".join(f"{k}: {v}" for k, v in files.items() if v))
    _warnings(args, warnings)
    return 1 if any_failed(df) else 0


def _made_by(args, df) -> str:
    """results.md's head: the command that made the rows, the machine and when (the rows' first and last date)."""
    dates = sorted(str(d) for d in df["date"].dropna()) if "date" in df else []
    machines = ", ".join(dict.fromkeys(str(m) for m in df["machine"].dropna())) if "machine" in df else ""
    return (f"- command: `pyllama-pp {shlex.join(getattr(args, 'argv', None) or [args.cmd])}`\n"
            f"- machine: {machines or 'not recorded'}\n"
            f"- date: {dates[0] + (' to ' + dates[-1] if dates[-1] != dates[0] else '') if dates else 'not recorded'}"
            "\n\n")


def _warnings(args, warnings: list[str]) -> None:
    for w in warnings if not args.json else ():
        print(f"pyllama-pp: warning: {w}", file=sys.stderr)


def error_text(e: BaseException, cmd: str) -> str:
    """An error as stderr says it: the whole message, every line of it (what is wrong, the reasons listed under it,
    how to fix it), the lines after the first indented under it; --json adds the worker's traceback or stderr. A
    device spec's list of accepted forms is left to `--help`, where it stands already."""
    text = str(e).strip() or (getattr(e, "error_type", None) or type(e).__name__)
    if isinstance(e, DeviceSpecError) and FORMS_HEADING in text:
        text = text.split(FORMS_HEADING)[0].rstrip() + f" See `pyllama-pp {cmd} --help` for the accepted forms."
    first, *rest = text.splitlines()
    return "\n".join([first] + [ln if ln.startswith(" ") else "  " + ln for ln in rest if ln.strip()])


def _closed_pipe() -> int:
    """stdout's reader went away: nothing more to say (stdout goes to /dev/null, so that the flush at exit cannot
    fail again), and the exit status a shell gives a process that SIGPIPE ended."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


# -- the parser: one small builder per subcommand --------------------------------------------------------------------
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


EXPERT_CACHE_HELP = ("the patched build's device expert cache for decode (EXPERT_CACHE): auto (fit weighs each "
                     "device's memory between resident expert layers and cache slots by the time it predicts for the "
                     "workload, and may move layers to host RAM for slots; the plan lists what it weighed), a size a "
                     "device such as 512MiB or 2GiB (reserved before fit places the layers), slots a layer such as "
                     "16slots, or 0 (none); or one per device for devices that differ, in the device spec's order: "
                     "a comma list of sizes, slots and 0s such as 16slots,32slots or 1GiB,512MiB. The plan shows "
                     "each device's share; auto gives unequal devices their own slots")


def _margins_text() -> str:
    return f"{_size(MARGINS['cuda'])} on CUDA, {_size(MARGINS['vdev'])} on VDEVs, {_size(MARGINS['other'])} on others"


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="upstream commit, variants and their patches, switches, backends, devices",
                       formatter_class=_HelpFormatter)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--markdown-switches", action="store_true",
                   help="print the patched build's switch table as the README's Markdown section, nothing else")
    p.set_defaults(func=cmd_info)


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write a random-weight MoE GGUF (with a routing control)",
                       formatter_class=_HelpFormatter)
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--preset", default="tiny", choices=list(synth.PRESETS),
                   help="model shape and family (default: %(default)s, the CI model, qwen3moe; qwen3-30b-a3b is 29.8 "
                        "GiB in Q8_0); mixtral-* (llama), qwen2moe-*, glm4moe-tiny/glm4.5-air-l24, "
                        "deepseek2-tiny/deepseek-v2-lite (MLA), gptoss-tiny/gpt-oss-20b (MXFP4 experts)")
    p.add_argument("--seed", type=int, default=synth.SynthConfig.seed,
                   help="random seed of the weights (default: %(default)s)")
    p.add_argument("--type", default=synth.SynthConfig.type, choices=list(synth.WEIGHT_TYPES),
                   help="weight type (default: %(default)s)")
    p.add_argument("--expert-type", dest="expert_type", choices=list(synth.EXPERT_TYPES),
                   help="the routed experts' type (default: the preset's: --type, mxfp4 for gpt-oss; q4_k needs rows "
                        "of multiples of 256)")
    p.add_argument("--routing", choices=list(synth.ROUTING_MODES),
                   help="uniform: every expert used about equally; skewed: some experts far more (real models' "
                        "coverage); locality: consecutive token ids route to slowly changing experts (decode's "
                        "temporal locality); natural: plain random weights (default: the preset's, uniform)")
    p.add_argument("--skew", type=float,
                   help=f"with --routing skewed: how strongly (default: {synth.DEFAULT_SKEW:g}; 0 = uniform); with "
                        f"locality: its popularity profile (default: {synth.DEFAULT_LOCALITY_SKEW:g})")
    for dim, what in (("n_layer", "layers"), ("n_embd", "embedding width"), ("n_expert", "experts per layer"),
                      ("n_expert_used", "experts used per token"), ("n_ff_exp", "expert FFN width"),
                      ("n_vocab", "vocabulary size")):
        p.add_argument("--" + dim.replace("_", "-"), dest=dim, type=int, metavar="N",
                       help=f"{what} (default: the preset's)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_synth)


def _add_measure_options(p, model_required: bool) -> None:
    """The options run and ab share (llama-bench's, comma-separated values swept)."""
    main = f"the main job: {MAIN_JOB.devices}"
    if model_required:
        p.add_argument("model", nargs="?", help="GGUF model file (required unless --resume)")
    else:
        p.add_argument("model", nargs="?", help="GGUF model file (default: the main job, a tiny synthetic MoE "
                                                 f"with every expert in host RAM on {MAIN_JOB.devices})")
    p.add_argument("--devices", type=_specs, default=None,
                   help=f"device spec; several ';'-separated are swept (default: {RUN.devices}; {main}; forms below)")
    p.add_argument("--host-experts", type=lambda s: s.split(","), default=[RUN.host_experts],
                   help="experts in host RAM: all, none or N (the first N layers, like --n-cpu-moe); "
                        f"comma-separated to sweep (default: {RUN.host_experts})")
    p.add_argument("-b", "--batch", type=_ints, default=None, metavar="N[,N]",
                   help=f"n_batch, comma-separated to sweep (default: {RUN.n_batch}; the main job: {MAIN_JOB.n_batch})")
    p.add_argument("-ub", "--ubatch", type=lambda x: x if x == "auto" else _ints(x), default=None,
                   metavar="N[,N]|auto",
                   help=f"n_ubatch, comma-separated to sweep (default: {RUN.n_ubatch}; the main job: "
                        f"{MAIN_JOB.n_ubatch}); auto: the pair (n_batch up to the longest prompt or the largest -b, "
                        "n_ubatch) fit --ubatch auto predicts fastest for that prompt, with its plan for both variants")
    p.add_argument("-c", "--ctx", type=int, default=RUN.n_ctx, metavar="N",
                   help="n_ctx (default: %(default)s, just what the tests need)")
    p.add_argument("-ngl", "--ngl", type=int, default=RUN.n_gpu_layers, metavar="N",
                   help="layers on the devices (default: %(default)s, every layer)")
    p.add_argument("-ts", "--tensor-split", type=_floats, default=None, metavar="A,B",
                   help="layer proportions per device, like llama's -ts (default: even; the main job: fit's)")
    p.add_argument("-p", "--pp", type=_ints, default=None, metavar="N[,N]",
                   help=f"prompt lengths of pp tests, 0 for none (default: {_nums(RUN.pp)}; the main job: "
                        f"{_nums(MAIN_JOB.pp)})")
    p.add_argument("-n", "--tg", type=_ints, default=None, metavar="N[,N]",
                   help=f"generation lengths of tg tests, 0 for none (default: {_nums(RUN.tg)}; the main job: "
                        f"{_nums(MAIN_JOB.tg)}, as decode needs --paired)")
    p.add_argument("-d", "--n-depth", dest="depth", type=_ints, default=list(RUN.depth), metavar="N[,N]",
                   help="tokens already in the context before each test, like llama-bench's -d "
                        f"(default: {_nums(RUN.depth)})")
    p.add_argument("-r", "--reps", type=_positive, default=RUN.reps, metavar="N",
                   help="repetitions per test; with --workload, rounds (default: %(default)s)")
    p.add_argument("--workload", type=_workload_arg, metavar="NAME|pp=N,tg=N",
                   help=f"run a workload's steps in one context per variant, -r rounds (re-reservations and plan "
                        f"switches per step) instead of -p/-n/-d: {_workloads_text()}, or pp=N,tg=N")
    p.add_argument("--load-mode", default=RUN.load_mode, choices=["none", "mmap"],
                   help="none: no mmap, host weights pinned where possible - upstream's fastest (default: %(default)s)")
    p.add_argument("--offload-min-batch", type=int, metavar="N",
                   help=f"GGML_OP_OFFLOAD_MIN_BATCH for both variants (default: llama.cpp's, {OFFLOAD_MIN_BATCH})")
    p.add_argument("--switch", action="append", metavar="NAME=VALUE",
                   help="a patched scheduler switch, e.g. UPLOAD_ALL=0, or LAYER_MAJOR=1 (a batch's ubatches through "
                        "each layer together, one expert upload a group: for prompts whose uploads bind; set where "
                        "a run's groups form and their buffers fit, LAYER_MAJOR=0 keeps it off), repeatable (default: none; `pyllama-pp info` lists them; a row says "
                        "when a switch could not act)")
    p.add_argument("-o", "--out", type=Path, metavar="DIR",
                   help="folder for the rows (jsonl, csv), the table and the plot "
                        "(default: run writes none; ab: pyllama_pp_out/ab-DATE-TIME)")
    p.add_argument("--plan", metavar="PLAN.json",
                   help="run with a fit plan (`pyllama-pp fit ... -o PLAN.json`) instead of --host-experts/-ts/-ngl; "
                        "--devices defaults to the plan's")
    p.add_argument("--fit", nargs="?", const="each", default=None, choices=["each", "same"],
                   help="plan each config with fit first: each (the default value) runs each variant with its "
                        "own variant's plan, same runs every variant with the patched build's plan (one "
                        f"placement; the main job's default: {MAIN_JOB.fit})")
    p.add_argument("--margin", type=_margin_arg, default=None, metavar="SIZE[,SIZE]",
                   help=f"with --fit: memory to leave free per device (default: {_margins_text()})")
    p.add_argument("--expert-cache", default=None, metavar="auto|SIZE|Nslots|0[,...]",
                   help=EXPERT_CACHE_HELP + "; without --fit or -ub auto, auto is planned on the run's own placement "
                   f"(no layer moved) and a size sets the switch as it is (default: {FIT.expert_cache})")
    p.add_argument("--resume", type=Path, metavar="DIR",
                   help="continue the sweep whose rows are in DIR (its -o folder) with its own options: configs "
                        "whose rows are all there without an error are not measured again")
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run one variant (in a worker process): llama-bench-like rows and counters",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    _add_measure_options(p, True)
    p.add_argument("--variant", default=RUN.variant, choices=list(VARIANTS),
                   help="which build runs (default: %(default)s)")
    p.set_defaults(func=cmd_measure)


def _add_ab(sub) -> None:
    p = sub.add_parser("ab", help="baseline vs patched on the same model, placement and batch sizes",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    _add_measure_options(p, False)
    p.add_argument("--paired", type=_even_rounds, metavar="N",
                   help="N (even) paired rounds instead of -r reps: one worker per variant loads the model once, then "
                        "each round runs every test once per variant, the order alternating (ABBA); rows get the median "
                        "speedup over AB / BA pairs of rounds and its 95%% interval (speedup_ci_lo/hi). For decode, "
                        "whose drift over time is larger than small gaps. Both variants stay loaded: with --fit or "
                        "--plan on GPUs, plan for half of each device")
    p.add_argument("--baseline-devices", type=_specs, default=None, metavar="SPEC",
                   help="for RPC devices: the baseline's own servers on the same hosts, in the same order "
                        f"({BASELINE_SERVERS}). ';'-separated, one per --devices spec")
    p.add_argument("--loads", type=_positive, default=PAIRED.loads, metavar="K",
                   help="with --paired: K fresh loads of both workers, N rounds each, the variants' load order "
                        "alternating; the interval then resamples whole loads (where each process's memory lands can "
                        "move decode by more than the variants differ) (default: %(default)s)")
    p.set_defaults(func=cmd_measure)


def _workloads_text() -> str:
    return "; ".join(f"{k} ({', '.join(f'{a}{n}' for a, n in v)})" for k, v in WORKLOADS.items())


def _add_fit(sub) -> None:
    p = sub.add_parser("fit", help="plan layers and host experts on the devices with a variant's fit (common/fit.cpp)",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--devices", required=True, help="device spec (forms below); fit needs devices with memory")
    p.add_argument("--variant", default=FIT.variant, choices=list(VARIANTS),
                   help="whose fit: patched spreads host experts over the devices (the series' fit patch), baseline is "
                        "upstream's (default: %(default)s)")
    p.add_argument("-c", "--ctx", type=int, default=FIT.n_ctx, metavar="N",
                   help="n_ctx to plan for; 0: fit chooses it (default: %(default)s)")
    p.add_argument("-b", "--batch", type=_positive, default=None, metavar="N",
                   help=f"n_batch (default: {FIT.n_batch}; with --ubatch auto: the largest n_batch to take, default "
                        "the prompt, n_ctx)")
    p.add_argument("-ub", "--ubatch", type=lambda x: x if x == "auto" else _positive(x), default=FIT.n_ubatch,
                   metavar="N|auto", help=f"n_ubatch; auto: the pair (n_batch, n_ubatch {min(UBATCH_CANDIDATES)}-"
                                          f"{max(UBATCH_CANDIDATES)}, up to the prompt) predicted fastest from bytes "
                                          "per link and a compute probe (cached) (default: %(default)s)")
    p.add_argument("--margin", type=_margin_arg, default=None, metavar="SIZE[,SIZE]",
                   help="memory to leave free on each device, one value or one per device "
                        f"(default: {_margins_text()}; upstream's on CUDA, VDEV budgets are exact)")
    p.add_argument("--expert-cache", default=None, metavar="auto|SIZE|Nslots|0[,...]",
                   help=EXPERT_CACHE_HELP + f" (default: {FIT.expert_cache}; the patched variant)")
    p.add_argument("--workload", type=_workload_arg, default=FIT.workload, metavar="NAME|pp=N,tg=N",
                   help=f"what the plan is for: with --expert-cache auto fit weighs each device's memory between "
                        f"resident expert layers and cache slots by the time it predicts for it: {_workloads_text()}, "
                        "or pp=N,tg=N (default: %(default)s)")
    p.add_argument("--trace", metavar="T.npz",
                   help="a trace of the model's decode (`pyllama-pp trace`) for the cache's hit rates (default: a "
                        "synthetic model's routing, else a published prior, named in the plan)")
    p.add_argument("--load-mode", default=CONTEXT.load_mode, choices=["none", "mmap"],
                   help="how the run will keep host weights: mmap's cache misses cross the pageable link (default: "
                        "%(default)s)")
    p.add_argument("--spread", default="equal", metavar="equal|links|W0,W1",
                   help="the patched fit's shares of host-expert layers: equal, links (by each device's host link "
                        "rate: a VDEV's own, on CUDA --link-gbps) or one weight per device (default: %(default)s)")
    p.add_argument("--link-gbps", type=_floats, default=None, metavar="R0,R1",
                   help="each device's host link in GB/s, for --spread links and --ubatch auto (default: a VDEV's "
                        f"own; CUDA {CUDA_LINK_GBPS:g}, a PCIe 5 x16 link)")
    p.add_argument("--shared-link", action="store_true",
                   help="the devices share one host link (one GPU split in two): --ubatch auto predicts so")
    p.add_argument("--split-mode", default=FIT.split_mode, choices=["layer", "none", "row"],
                   help="llama's split mode (default: %(default)s; fit's spread path needs it)")
    p.add_argument("--switch", action="append", metavar="NAME=VALUE",
                   help="a patched scheduler switch the plan's memory is measured with and applied with, e.g. "
                        "LAYER_MAJOR=1 (a batch's ubatches in groups: their activations are planned), repeatable "
                        "(default: none)")
    p.add_argument("--no-op-offload", action="store_true", help="plan without op offload (upstream's path then)")
    p.add_argument("--no-kv-offload", action="store_true", help="plan with the KV cache in host memory")
    p.add_argument("--no-check", action="store_true",
                   help="take fit's plan as it is, even one that leaves whole layers on the CPU or a device over its "
                        "target (default: an error that says so)")
    p.add_argument("-o", "--out", type=Path, metavar="PLAN.json", help="save the plan there (for run/ab --plan)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_fit)


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="both variants on one placement: are the patched logits the baseline's?",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    p.add_argument("model", nargs="?", help="GGUF model file (default: the main job's model)")
    p.add_argument("--devices", default=CHECK.devices, help="device spec (default: %(default)s, two VDEVs; forms below)")
    p.add_argument("--baseline-devices", default=None, metavar="SPEC",
                   help=f"for RPC devices: the baseline's own servers on the same hosts, in the same order ({BASELINE_SERVERS})")
    p.add_argument("--host-experts", default=CHECK.host_experts,
                   help="experts in host RAM: all, none or N (the first N layers) (default: %(default)s)")
    p.add_argument("-ts", "--tensor-split", type=_floats, default=None,
                   metavar="A,B", help="layer proportions per device (default: even)")
    p.add_argument("-b", "--batch", type=_positive, default=CHECK.n_batch, metavar="N",
                   help="n_batch (default: %(default)s)")
    p.add_argument("-ub", "--ubatch", type=_positive, default=CHECK.n_ubatch, metavar="N",
                   help="n_ubatch (default: %(default)s)")
    p.add_argument("-n", "--tokens", type=_positive, default=CHECK.n_tokens, metavar="N",
                   help="random tokens decoded, every one's logits compared (default: %(default)s)")
    p.add_argument("--seed", type=int, default=CHECK.seed, help="the tokens' seed (default: %(default)s)")
    p.add_argument("--switch", action="append", metavar="NAME=VALUE", help="a patched scheduler switch, repeatable")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_check)


def _add_trace(sub) -> None:
    p = sub.add_parser("trace", help="the experts each MoE layer chooses for each token (for expert-cache hit rates)",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--devices", default=TRACE.devices, help="device spec (default: %(default)s; forms below)")
    p.add_argument("--variant", default=TRACE.variant, choices=list(VARIANTS), help="the build (default: %(default)s)")
    p.add_argument("-p", "--pp", type=int, default=TRACE.pp[0], metavar="N",
                   help="prompt tokens first (default: %(default)s)")
    p.add_argument("-n", "--tg", type=int, default=TRACE.tg[0], metavar="N",
                   help="tokens decoded one by one (default: %(default)s)")
    p.add_argument("--seed", type=int, default=TRACE.seed, help="the tokens' seed, as run's (default: %(default)s)")
    p.add_argument("-o", "--out", type=Path, help="write the trace here (.npz: ids [tokens, layers, k] and metadata)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_trace)


def _add_rpc_server(sub) -> None:
    p = sub.add_parser("rpc-server", help="serve this machine's devices to other hosts (llama.cpp's ggml RPC)",
                       formatter_class=_HelpFormatter, epilog="device specs (--devices):" + FORMS)
    p.add_argument("--devices", default=CONTEXT.devices,
                   help="device spec of this machine to serve (default: %(default)s; forms below)")
    p.add_argument("--host", default=RPC_HOST,
                   help="address to listen on (default: %(default)s; the protocol has no authentication)")
    p.add_argument("--port", type=_positive, default=RPC_PORT, help="port to listen on (default: %(default)s)")
    p.add_argument("--variant", choices=list(VARIANTS), default=CONTEXT.variant,
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


# the subcommands, in the order --help lists them (a new one: a builder here)
COMMANDS = (_add_info, _add_synth, _add_run, _add_fit, _add_ab, _add_check, _add_trace, _add_rpc_server)


def build_parser() -> argparse.ArgumentParser:
    """The `pyllama-pp` argument parser (every subcommand, with its options and defaults)."""
    ap = _Parser(prog="pyllama-pp", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pyllama_pp {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS:
        add(sub)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = _join_dash_values(list(sys.argv[1:] if argv is None else argv))
    _Parser.json_errors = "--json" in argv
    args = build_parser().parse_args(argv)
    args.argv = argv   # (results.md names the command)
    try:
        return args.func(args)
    except BrokenPipeError:   # (the reader went away: `pyllama-pp info | head -1`)
        return _closed_pipe()
    except (PyllamaError, ValueError, OSError) as e:
        kind = getattr(e, "error_type", None) or type(e).__name__
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": kind, "details": getattr(e, "details", "") or None}))
        print(f"pyllama-pp: error: {error_text(e, getattr(args, 'cmd', 'run'))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyllama-pp: interrupted (rows written so far are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
