"""`pyllama-pp`: info, synth, run, ab. Every subcommand takes --json (one JSON document on stdout)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from . import __version__
from .errors import PyllamaError

# The main job (`pyllama-pp ab` with no model): the tiny preset with 7 layers on 2 virtual devices whose links are
# throttled so that transfers dominate; ts 3,5 gives each device 3 MoE layers (the last layer of a ubatch
# without outputs does no expert work); n_ubatch 128 uses ~98% of the experts; n_batch = 16 x n_ubatch.
DEFAULT_DEVICES = "vdev:2x256MiB@0.1GBps"
MAIN_JOB = {"batch": [2048], "ubatch": [128], "pp": [2048], "tensor_split": [3.0, 5.0]}
MAIN_JOB_N_LAYER = 7
PLAIN = {"batch": [512], "ubatch": [32], "pp": [512], "tensor_split": None}


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


# ---------------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from .binding import VARIANTS, available_variants, build_info
    from .worker import run_job
    from . import _pin
    pin = _pin.PIN
    variants = []
    for v in VARIANTS:
        entry = {"name": v, "built": v in available_variants()}
        if entry["built"]:
            try:
                r = run_job({"kind": "info"}, v, timeout=120)
                entry.update(ext_version=r["ext_version"], devices=r["devices"], system_info=r["system_info"],
                             switches=r.get("switches", []))
            except PyllamaError as e:
                entry["error"] = str(e)
        entry["patches"] = _pin.PATCHES if v == "patched" else []
        variants.append(entry)
    from .binding import backend_modules
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
                lines.append(f"    {sw['name']}={sw['value']}: {sw['description']}")
        for d in e.get("devices", []):
            lines.append(f"  device {d['name']} ({d['backend']}): {d['description']}, "
                         f"{d['memory_total'] / 2**30:.1f} GiB")
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_synth(args) -> int:
    from . import synth
    overrides = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_expert", "n_expert_used", "n_ff_exp", "n_vocab",
                                               "routing", "skew") if getattr(args, k, None) is not None}
    cfg = synth.preset(args.preset, seed=args.seed, type=args.type, **overrides)
    summary = synth.write_gguf(args.out, cfg, progress=not args.json and sys.stderr.isatty())
    _emit(args, summary, f"wrote {args.out}: {summary['bytes'] / 1e6:.1f} MB, {summary['n_tensors']} tensors, "
                         f"{summary['expert_bytes_per_layer'] / 1e6:.2f} MB of experts a layer, "
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
    ext = {}
    for kv in args.switch or []:
        k, _, v = kv.partition("=")
        if not v:
            raise PyllamaError(f"--switch takes NAME=VALUE (e.g. UPLOAD_ALL=0), not {kv!r}")
        try:
            ext[k.upper()] = int(v)
        except ValueError:
            raise PyllamaError(f"--switch {kv!r}: the value must be an integer (e.g. UPLOAD_ALL=0)") from None
    return {"tests": tests or [["pp", 512]], "reps": args.reps, "load_mode": args.load_mode,
            "tensor_split": args.tensor_split,
            "n_gpu_layers": args.ngl, "n_ctx": args.ctx, "ext_params": ext, "env": env}


def models_dir() -> Path:
    """Where synthetic models are cached (PYLLAMA_PP_CACHE or ~/.cache/pyllama_pp, then models/)."""
    return _cache_dir() / "models"


def _configs(args, model: str) -> list:
    """The A/B matrix of `run` and `ab`: devices x n_batch x n_ubatch x host experts, like llama-bench."""
    from . import bench
    return bench.expand(model, devices=args.devices, n_batch=args.batch, n_ubatch=args.ubatch,
                        host_experts=args.host_experts, **_config_kwargs(args))


def _default_model() -> str:
    from . import synth
    return str(synth.cached_model(models_dir(), "tiny", seed=1, n_layer=MAIN_JOB_N_LAYER))


def _print_rows(df) -> str:
    cols = ["variant", "devices", "n_batch", "n_ubatch", "test", "avg_ts", "stddev_ts", "speedup", "pipeline_parallel",
            "coverage", "h2d_bytes", "error"]
    cols = [c for c in cols if c in df.columns]
    return df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}")


def _fill_defaults(args, defaults: dict) -> None:
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _failed(df) -> bool:
    """Any error row (a worker that failed or was killed)?"""
    return "error" in df and bool(df["error"].fillna("").astype(str).str.len().gt(0).any())


def _workload(args, model: str, variants) -> int:
    """--workload mixed: bench.MIXED_WORKLOAD in one context per variant, -r rounds, on every device spec."""
    import pandas as pd

    from . import bench
    dfs = [bench.mixed_workload(cfg, variants=variants, rounds=args.reps) for cfg in _configs(args, model)]
    df = pd.concat(dfs, ignore_index=True) if dfs else pd.DataFrame()
    cols = [c for c in ("variant", "devices", "test", "avg_ts", "speedup", "re_reservations", "plan_switches",
                        "host_syncs", "error") if c in df.columns]
    rows = json.loads(df.to_json(orient="records"))
    if args.out:
        bench.RowWriter(Path(args.out)).write(rows)
    _emit(args, {"rows": rows},
          df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}") if not df.empty else "(no rows)")
    return 1 if _failed(df) else 0


def cmd_run(args) -> int:
    from . import bench
    _fill_defaults(args, PLAIN)
    if args.workload:
        return _workload(args, args.model, [args.variant])
    cfgs = _configs(args, args.model)
    df = bench.ab(cfgs, variants=[args.variant], out_dir=args.out, progress=not args.json)
    _emit(args, {"rows": json.loads(df.to_json(orient="records"))}, _print_rows(df))
    return 1 if _failed(df) else 0


def cmd_ab(args) -> int:
    from . import bench
    default = args.model is None
    model = args.model or _default_model()
    if default and args.devices == ["cpu"]:
        args.devices = [DEFAULT_DEVICES]
    _fill_defaults(args, MAIN_JOB if default else PLAIN)
    if args.workload:
        return _workload(args, model, list(bench.VARIANTS))
    cfgs = _configs(args, model)
    out = Path(args.out or Path("pyllama_pp_out") / time.strftime("ab-%Y%m%d-%H%M%S"))
    df = bench.ab(cfgs, out_dir=out, progress=not args.json)
    md = bench.markdown(df)
    (out / "results.md").write_text(md)
    png = bench.plot(df, out / "ab.png", title=f"{Path(model).name}: baseline vs patched")
    files = {"jsonl": str(out / "results.jsonl"), "csv": str(out / "results.csv"), "markdown": str(out / "results.md"),
             "plot": str(png) if png else None}
    _emit(args, {"rows": json.loads(df.to_json(orient="records")), "files": files},
          md + "\n" + "\n".join(f"{k}: {v}" for k, v in files.items() if v))
    return 1 if _failed(df) else 0


# ---------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pyllama-pp", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pyllama_pp {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("info", help="upstream commit, variants and their patches, backends, build options")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("synth", help="write a random-weight qwen3moe GGUF")
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="tiny", help="tiny, small or qwen3-30b-a3b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--type", default="q8_0", choices=["q8_0", "f16"])
    p.add_argument("--routing", choices=["uniform", "skewed", "natural"])
    p.add_argument("--skew", type=float)
    for dim in ("n_layer", "n_embd", "n_expert", "n_expert_used", "n_ff_exp", "n_vocab"):
        p.add_argument("--" + dim.replace("_", "-"), dest=dim, type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_synth)

    def common(p, model_required: bool):
        if model_required:
            p.add_argument("model", help="GGUF model file")
        else:
            p.add_argument("model", nargs="?", help="GGUF model file (default: a tiny synthetic MoE on 2 VDEVs)")
        p.add_argument("--devices", type=lambda s: [x for x in s.split(";") if x], default=["cpu"],
                       help="device spec(s), ';'-separated (cpu, cuda, cuda:0,1, vdev:2x768MiB@4GBps[,shared], JSON)")
        p.add_argument("--host-experts", type=lambda s: s.split(","), default=["all"],
                       help="all, none or N (the first N layers' experts in host RAM); comma-separated to sweep")
        p.add_argument("-b", "--batch", type=_ints, default=None, help="n_batch (comma-separated; default 512)")
        p.add_argument("-ub", "--ubatch", type=_ints, default=None, help="n_ubatch (comma-separated; default 32)")
        p.add_argument("-c", "--ctx", type=int, default=0, help="n_ctx (0: fits the tests)")
        p.add_argument("-ngl", "--ngl", type=int, default=-1)
        p.add_argument("-ts", "--tensor-split", type=lambda s: [float(x) for x in s.split(",")], default=None,
                       help="layer proportions per device, e.g. 3,5 (llama's -ts)")
        p.add_argument("-p", "--pp", type=_ints, default=None, help="prompt lengths (pp tests; default 512)")
        p.add_argument("-n", "--tg", type=_ints, default=[16], help="generation lengths (tg tests); 0 for none")
        p.add_argument("-d", "--n-depth", dest="depth", type=_ints, default=[0],
                       help="tokens already in the context before each test (llama-bench's -d; comma-separated)")
        p.add_argument("-r", "--reps", type=_positive, default=3, help="repetitions (with --workload: rounds)")
        p.add_argument("--workload", choices=["mixed"],
                       help="mixed: prompts pp64, pp512, pp128, pp2048 from an empty cache, then tg16, in one context "
                            "per variant, -r rounds (re-reservations and plan switches per step); -p/-n/-d are ignored")
        p.add_argument("--load-mode", default="none", choices=["none", "mmap"],
                       help="none (default): no mmap, host weights pinned where possible - upstream's fastest")
        p.add_argument("--offload-min-batch", type=int, help="GGML_OP_OFFLOAD_MIN_BATCH for both variants")
        p.add_argument("--switch", action="append", metavar="NAME=VALUE",
                       help="patched scheduler switch, e.g. UPLOAD_ALL=0 (repeatable)")
        p.add_argument("-o", "--out", type=Path, help="output folder for rows (jsonl/csv), table and plot")
        p.add_argument("--json", action="store_true")

    p = sub.add_parser("run", help="run one variant (in a worker process): llama-bench-like rows and counters")
    common(p, True)
    p.add_argument("--variant", default="patched", choices=["patched", "baseline"])
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ab", help="baseline vs patched on the same model, placement and batch sizes")
    common(p, False)
    p.set_defaults(func=cmd_ab)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "tg", None) == [0]:
        args.tg = []
    try:
        return args.func(args)
    except PyllamaError as e:
        msg = f"pyllama-pp: error: {e}"
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        print(msg, file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        print(f"pyllama-pp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pyllama-pp: interrupted (rows written so far are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
