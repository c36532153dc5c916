#!/usr/bin/env python3
"""The A/B benchmark on the GPU machine: correctness, then the sweeps of bench/sweeps.toml, within a time budget.

Run by bench/gpu_run.sh after the CUDA build. Steps run in priority order and each is skipped when the
budget left cannot hold it; every finished step's table is written under --out at once, so a cut-off
run still returns what it measured.

  1. devices and build facts
  2. correctness on the tiny preset: patched vs baseline logits, same placement (2 GPUs, experts in host
     RAM), and each vs all weights on the GPUs (NMSE, max abs diff); on the 30B preset for the sweeps that ask
  3. the qwen3-30b-a3b preset (near-uniform routing; skewed when a block asks) written to local disk; a block
     with `preset` (and `synth` overrides) writes that preset instead
  4. the named sweeps (both variants unless a block says, pinned host weights, every expert in host RAM, layer
     split); `--preset tiny --devices vdev:2x0@0` runs the same on a CPU machine as a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np

import gather_timeline   # bench/gather_timeline.py (this script's folder is on sys.path)
from _clock import left, log

from pyllama_pp import report, runner, switches, synth
from pyllama_pp.binding import VARIANTS
from pyllama_pp.config import RunConfig
from pyllama_pp.errors import PyllamaError
from pyllama_pp.params import Placement
from pyllama_pp.stats import nmse
from pyllama_pp.worker import run_job

SWEEPS_FILE = Path(__file__).with_name("sweeps.toml")


def load_sweeps(path: Path = SWEEPS_FILE) -> dict:
    """bench/sweeps.toml: {"sweeps": {name: [block, ...]}, "correctness": {name: {...}}}; configs as tuples."""
    try:
        import tomllib
    except ImportError:   # Python < 3.11
        import tomli as tomllib
    data = tomllib.loads(path.read_text())
    for blocks in data["sweeps"].values():
        for block in blocks:
            block["configs"] = [(nb, ub, [list(t) for t in tests]) for nb, ub, tests in block["configs"]]
    return data


def switch_env(ext: dict) -> dict:
    """--switch style {NAME: value} as the patched build's environment."""
    return switches.to_env(ext)


def correctness(model: str, devices: str, out: Path, cases, n_tokens: int = 512, all_on_gpu: bool = True,
                timeout: float = 300) -> list[dict]:
    """Patched vs baseline logits (and each vs every weight on the GPUs) for (n_ubatch, load mode, patched build's
    environment) cases; mmap: host weights in pageable memory (the patched build stages them).
    `timeout`: seconds a worker may take (a hang costs no more)."""
    rows = []
    refs: dict = {}   # baseline and all-on-GPU logits per (name, n_ubatch, load mode): the cases share them

    def logits(name: str, variant: str, he: str, ub: int, mode: str, env: Optional[dict]) -> tuple:
        path = out / f"logits_{name}_ub{ub}.npy"
        res = run_job({"kind": "logits", "model": model, "devices": devices,
                       "placement": {"host_experts": he, "load_mode": mode},
                       "ctx": {"n_ctx": n_tokens + 64, "n_batch": n_tokens, "n_ubatch": ub},
                       "n_tokens": n_tokens, "seed": 7, "logits": "all", "out": str(path)}, variant, timeout=timeout, env=env)
        arr = np.load(path)
        path.unlink()
        return arr, res

    for ub, mode, penv in cases:
        got = {}
        for name, variant, he in (("baseline", "baseline", "all"), ("all_on_gpu", "baseline", "none"))[:2 if all_on_gpu else 1]:
            if (name, ub, mode) not in refs:
                arr, res = logits(name, variant, he, ub, mode, None)
                refs[(name, ub, mode)] = (arr, res["schedule"])
            got[name] = refs[(name, ub, mode)]
        arr, res = logits("patched", "patched", "all", ub, mode, penv)
        got["patched"] = (arr, res["schedule"])
        ext = {k: (res.get("ext") or {}).get(k) for k in ("id_readbacks", "selective", "upload_all", "direct", "gather", "prefetch", "chained")}
        b, p = got["baseline"][0], got["patched"][0]
        g = got["all_on_gpu"][0] if all_on_gpu else None
        rows.append({"model": Path(model).name, "devices": devices, "n_ubatch": ub, "load_mode": mode, "patched_env": penv,
                     "n_tokens": n_tokens,
                     "nmse_patched_vs_baseline": nmse(p, b), "maxabs_patched_vs_baseline": float(np.abs(p - b).max()),
                     "nmse_baseline_vs_all_on_gpu": nmse(b, g) if g is not None else None,
                     "nmse_patched_vs_all_on_gpu": nmse(p, g) if g is not None else None, "patched_ext": ext,
                     "pp_baseline": got["baseline"][1]["pipeline_parallel"],
                     "pp_patched": got["patched"][1]["pipeline_parallel"]})
        log(f"correctness ub={ub}: {rows[-1]}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--budget", type=float, default=480, help="seconds for this script")
    ap.add_argument("--devices", default="cuda")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pp_models"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="synthetic model preset (tiny: a local smoke test)")
    ap.add_argument("--link-gbps", type=float, default=55.0,
                    help="host->GPU bandwidth per link for the rows' bound (pinned, measured: 54.9 / 55.1 GB/s on the "
                         "2xH200 box by lab/cuda_queue.py)")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: correctness (all of it), synth, sweep, "
                                                "or one correctness case by name (tiny, gather, overlap2, prefetch2)")
    ap.add_argument("--sweep", default="main", help="comma-separated sweep names of bench/sweeps.toml")
    ap.add_argument("--sweeps-file", type=Path, default=SWEEPS_FILE, help="the sweeps (default: bench/sweeps.toml)")
    args = ap.parse_args()
    data = load_sweeps(args.sweeps_file)
    SWEEPS, CHECKS = data["sweeps"], data.get("correctness", {})
    sweeps = args.sweep.split(",")
    unknown = [n for n in sweeps if n not in SWEEPS]
    if unknown:   # before any GPU time is spent
        raise SystemExit(f"unknown sweep(s) {unknown}; choose from {sorted(SWEEPS)}")
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "devices": args.devices, "steps": {}}

    def save():
        (args.out / "gpu_summary.json").write_text(json.dumps(summary, indent=1, default=float))

    info = run_job({"kind": "info"}, "patched", timeout=120)
    summary["devices_seen"] = [d["name"] + ": " + d["description"] for d in info["devices"]]
    log(f"devices: {summary['devices_seen']}")
    save()

    def wanted(check: dict) -> bool:
        return "*" in check["when"] or any(n in check["when"] for n in sweeps)

    if "correctness" not in skip and "tiny" not in skip and "tiny" in CHECKS and wanted(CHECKS["tiny"]):
        tiny = synth.cached_model(args.model_dir, "tiny", seed=1, n_layer=7)
        cases = [(ub, mode, switch_env(ext)) for ub, mode, ext in CHECKS["tiny"]["cases"]]
        try:
            summary["steps"]["correctness_tiny"] = correctness(str(tiny), args.devices, args.out, cases)
        except PyllamaError as e:
            summary["steps"]["correctness_tiny"] = {"error": str(e)}
        save()

    for name, check in CHECKS.items():   # tiny presets of the other MoE families: one case each
        if "presets" not in check or "correctness" in skip or name in skip or not wanted(check):
            continue
        rows = []
        for pname in check["presets"]:
            if left(args.budget) < 60:
                break
            try:
                path = synth.cached_model(args.model_dir, pname, seed=1)
                rows += correctness(str(path), args.devices, args.out,
                                    [(ub, mode, switch_env(ext)) for ub, mode, ext in check["cases"]], timeout=120)
            except PyllamaError as e:
                rows.append({"model": pname, "error": str(e)})
        summary["steps"][f"correctness_{name}"] = rows
        save()

    big = args.model_dir / f"{args.preset}-uniform.gguf"
    blocks = [b for n in sweeps for b in SWEEPS[n]]
    def big_check(name: str, check: dict) -> bool:   # a correctness check on the 30B preset this call runs
        return name != "tiny" and "presets" not in check and wanted(check) and "correctness" not in skip \
            and name not in skip

    needs_big = any("preset" not in b for b in blocks) or any(big_check(n, c) for n, c in CHECKS.items())
    if "synth" not in skip and needs_big and not big.exists() and left(args.budget) > 30:  # ~20 s on the H200 box
        t = time.time()
        s = synth.write_gguf(big, synth.preset(args.preset, seed=1, routing="uniform"))
        summary["steps"]["synth"] = {k: s[k] for k in ("bytes", "expert_bytes_per_layer", "seconds")}
        log(f"wrote {big}: {s['bytes'] / 1e9:.1f} GB in {time.time() - t:.0f} s")
        save()

    for name, check in CHECKS.items():
        # the 30B preset: patched with `env`, then with `env` + `then` (~60 s a case: two loads; a worker loads the
        # 32 GB preset in about 25 s and runs in a few more: 150 s each, so that a hang does not take the call)
        if not big_check(name, check) or not big.exists() or left(args.budget) <= 150:
            continue
        env, then = switch_env(check["env"]), switch_env(check.get("then", {}))
        ub = check.get("n_ubatch", 256)
        try:
            summary["steps"][f"correctness_{name}"] = correctness(
                str(big), args.devices, args.out, cases=((ub, "none", env), (ub, "none", {**env, **then})),
                n_tokens=check.get("n_tokens", 1024), all_on_gpu=False, timeout=150)
        except PyllamaError as e:
            summary["steps"][f"correctness_{name}"] = {"error": str(e)}
        save()

    if "sweep" not in skip:   # (each block checks its own model: a skewed-only call may skip the uniform one)
        def family(b: dict) -> tuple:
            return b.get("preset"), b.get("synth")

        written, prev = [], {}   # other families' models: removed once no later block needs them (~64 GB of disk)
        for block in blocks:
            if written and family(block) != family(prev):
                for m in written:
                    m.unlink(missing_ok=True)
                written.clear()
            prev = block
            # skew 2.0: ~47 of 128 experts a layer at ub512 (37%); 1.0: ~74 (58%, like real models' 56-74%)
            skew = float(block.get("skew", 2.0))
            if "preset" in block:   # another family's preset, `synth` overrides, written once
                skewed = block.get("model") == "skewed"
                routing = {"routing": "skewed", "skew": skew} if skewed else {"routing": "uniform"}
                if left(args.budget) < block["est"] + 20:
                    log(f"skip {block['name']}: {left(args.budget):.0f} s left, needs ~{block['est']} and its model")
                    continue
                t = time.time()
                model = synth.cached_model(args.model_dir, block["preset"], seed=1, **routing, **block.get("synth", {}))
                written.append(model)
                log(f"{model.name}: {model.stat().st_size / 1e9:.1f} GB, ready in {time.time() - t:.0f} s")
            elif block.get("model") == "skewed":
                model = args.model_dir / f"{args.preset}-skew{skew:g}.gguf"
                if not model.exists() and left(args.budget) > block["est"] + 30:
                    t = time.time()
                    synth.write_gguf(model, synth.preset(args.preset, seed=1, routing="skewed", skew=skew))
                    log(f"wrote {model} in {time.time() - t:.0f} s")
            else:
                model = big
            if left(args.budget) < block["est"] or not model.exists():
                log(f"skip {block['name']}: {left(args.budget):.0f} s left, needs ~{block['est']}")
                continue
            devices = block.get("devices", args.devices)
            env = dict(block.get("env", {}))
            timeline = args.out / "timeline" / block["name"]
            if block.get("timeline"):   # the CUDA gather's timeline, one file per worker (bench/gather_timeline.py)
                timeline.parent.mkdir(parents=True, exist_ok=True)
                for old in timeline.parent.glob(timeline.name + ".*.csv"):   # (an earlier call's, same --out)
                    old.unlink()
                env["PYLLAMA_PP_GATHER_TIMELINE"] = str(timeline)
            shared = env.get("GGML_CUDA_DEVICES") is not None   # one GPU split in two: one link
            # (the block's host_experts, tensor_split and load_mode make its placement; ext, its switches)
            placement = Placement(host_experts=block.get("host_experts", "all"),
                                  tensor_split=block.get("tensor_split"), load_mode=block.get("load_mode", "none"))
            cfgs = [RunConfig(model=str(model), devices=devices, n_batch=nb, n_ubatch=ub, tests=tests,
                              reps=block.get("reps", args.reps), placement=placement, env=env,
                              switches=block.get("ext", {}), label=f"{block['name']} b{nb} ub{ub}",
                              # one entry per device at most (rows cut the list to their devices)
                              link_gbps=[args.link_gbps] * 16 if devices.startswith("cuda") else None,
                              shared_link=shared)
                    for nb, ub, tests in block["configs"]]
            t = time.time()
            # (a worker's job: at most three times its block's estimate, so that a hang leaves the blocks after it
            # their time)
            timeout = max(60, min(left(args.budget) - 10, 3 * block["est"]))
            # paired rounds (ABBA, one serving worker per variant) or reps
            run, extra = (runner.interleaved, {"rounds": block["interleave"], "loads": block.get("loads", 1)}) \
                if block.get("interleave") else (runner.ab, {})
            df = run(cfgs, variants=block.get("variants", VARIANTS), out_dir=args.out / "ab", progress=False,
                     timeout=timeout, **extra)
            log(f"{block['name']}: {time.time() - t:.0f} s (estimated {block['est']})\n{report.markdown(df)}")
            files = sorted(timeline.parent.glob(timeline.name + ".*.csv")) if block.get("timeline") else []
            if files:
                try:   # (a diagnosis: it must not stop the rest of the call)
                    tl = gather_timeline.summarize(gather_timeline.read(files))
                    (args.out / "timeline" / f"{block['name']}.json").write_text(json.dumps(tl, indent=1))
                    log(f"{block['name']}: the gather timeline\n{gather_timeline.markdown(tl)}")
                except Exception as e:   # noqa: BLE001
                    log(f"{block['name']}: the gather timeline could not be read: {e!r}")
            summary["steps"].setdefault("sweeps", []).append(json.loads(df.to_json(orient="records")))
            save()
        for m in written:
            m.unlink(missing_ok=True)
    md = args.out / "ab" / "results.jsonl"
    if md.exists():
        import pandas as pd
        df = pd.read_json(md, lines=True)
        df["config"] = df["label"]   # config numbers restart in each block's runner.ab call; labels do not
        (args.out / "gpu_results.md").write_text(report.markdown(df))
        print(report.markdown(df))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
