#!/usr/bin/env python3
"""Every MoE architecture of the pinned tree, baseline vs patched: same logits, pipelined?

Upstream's own `tests/test-llama-archs.cpp` (in the pinned sdist, not in git here) writes a tiny random model of
every architecture with `-o DIR`. This script builds it against the pinned tree (its own CMake project, the
pristine tree: the models are the same for both variants), writes the models, and runs each MoE model through
both variants with every expert in host RAM on two VDEVs: the patched logits must equal the baseline's for the
same placement (NMSE <= 1e-6) with pipelining on. A model the harness cannot run in either variant is reported with
the reason; exit code 1 when any architecture differs or the patched build fails where the baseline runs.

With `--ab`, each model that ran in both variants is also a prompt A/B on slow links: 2 reps a variant, or with
`--paired N [--loads K]` the paired rounds of `pyllama-pp ab --paired N --loads K` (runner.interleaved), whose median
ratio and its 95% interval go into the row and the table.

    python bench/archs.py --out DIR [--models DIR] [--arch REGEX] [--devices vdev:2x0@0] [--ubatch 32] [--tokens 64]
                          [--ab [DEVICES] [--paired N [--loads K]]]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from pyllama_pp.defaults import PAIRED
from pyllama_pp.errors import PyllamaError
from pyllama_pp.stats import nmse
from pyllama_pp.worker import run_job

REPO = Path(__file__).resolve().parents[1]
SOURCE = "tests/test-llama-archs.cpp"
NMSE_MAX = 1e-6


def _fetch():
    sys.path.insert(0, str(REPO / "vendor" / "llama.cpp"))
    import fetch
    return fetch


def build_writer(work: Path) -> Path:
    """test-llama-archs from the pinned sdist (downloaded and verified as the build does), linked against the
    pinned tree's llama and llama-common; ccache when present. Returns the executable."""
    fetch = _fetch()
    pin = fetch.read_pin()
    tree = fetch.ensure_tree(pin)
    exe = work / "build" / "test-llama-archs"
    if exe.exists():
        return exe
    try:
        sdist = fetch.source_archive(pin, need_sdist=True)   # (the trimmed archive has no tests/)
    except fetch.FetchError as e:
        raise SystemExit(f"{SOURCE} comes from the sdist: {e}")
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("vendor/llama.cpp/" + SOURCE))
        (src / "test-llama-archs.cpp").write_bytes(tar.extractfile(member).read())
    (src / "CMakeLists.txt").write_text(f"""cmake_minimum_required(VERSION 3.14)
project(pp_llama_archs C CXX)
set(LLAMA_BUILD_COMMON ON CACHE BOOL "" FORCE)
foreach(opt LLAMA_BUILD_TESTS LLAMA_BUILD_TOOLS LLAMA_BUILD_EXAMPLES LLAMA_BUILD_SERVER LLAMA_BUILD_APP LLAMA_OPENSSL
            GGML_NATIVE LLAMA_BUILD_MTMD)
    set(${{opt}} OFF CACHE BOOL "" FORCE)
endforeach()
set(BUILD_SHARED_LIBS OFF CACHE BOOL "" FORCE)
add_subdirectory({tree.as_posix()} llama.cpp EXCLUDE_FROM_ALL)
add_executable(test-llama-archs test-llama-archs.cpp)
target_include_directories(test-llama-archs PRIVATE {tree.as_posix()}/src {tree.as_posix()}/common)
target_link_libraries(test-llama-archs PRIVATE llama llama-common)
""")
    if shutil.which("cmake") is None:
        raise SystemExit("building test-llama-archs needs cmake on PATH (pip install cmake ninja)")
    build = work / "build"
    launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    # paths relative to where the tree and the build sit (new folders on every CI run), as CMakeLists.txt does for
    # the variants: ccache then serves the next run
    env = {**os.environ, "CCACHE_BASEDIR": os.path.commonpath([tree.resolve(), build.resolve()]), "CCACHE_NOHASHDIR": "1"}
    for cmd in (["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *gen, *launcher],
                ["cmake", "--build", str(build), "--target", "test-llama-archs", "-j", str(os.cpu_count() or 2)]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"building test-llama-archs failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
    return exe


def write_models(exe: Path, out: Path, arch: str, seed: int) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(exe), "-o", str(out), "-s", str(seed)] + (["-a", arch] if arch else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return sorted(out.glob("*-moe.gguf"))


def n_layer_of(model: Path) -> int:
    import gguf
    r = gguf.GGUFReader(str(model))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    f = r.fields.get(f"{arch}.block_count")
    return int(f.parts[-1][0]) if f is not None else 0


def run_pair(model: Path, devices: str, ub: int, n_tokens: int, tmp: Path) -> dict:
    """Both variants on the same placement: every expert in host RAM, the repeating layers split evenly over two
    devices (the output layer counts on the last); n_ubatch = n_tokens when the model needs one ubatch (non-causal
    encoders, diffusion models), said in `note`."""
    row: dict = {"arch": model.name[: -len("-moe.gguf")], "model": model.name}
    n_layer = n_layer_of(model)
    split = [n_layer // 2, n_layer - n_layer // 2 + 1] if n_layer >= 2 else None
    for attempt, (u, n) in enumerate(((ub, n_tokens), (n_tokens, n_tokens))):
        res, errs = {}, {}
        for v in ("baseline", "patched"):
            job = {"kind": "logits", "model": str(model), "devices": devices, "placement": {"host_experts": "all", "tensor_split": split},
                   "ctx": {"n_ctx": max(256, 2 * n), "n_batch": n, "n_ubatch": u}, "n_tokens": n, "logits": "all",
                   "out": str(tmp / f"{v}.npy")}
            try:
                r = run_job(job, v, timeout=300)
                res[v] = (r, np.load(tmp / f"{v}.npy"))
            except PyllamaError as e:
                errs[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if "baseline" in errs and "patched" in errs and attempt == 0:
            continue   # (try once more with one ubatch per batch)
        break
    row.update({"n_layer": n_layer, "tensor_split": split, "n_ubatch": u, "n_tokens": n, "note": "one ubatch: the model needs n_ubatch >= n_tokens" if attempt else ""})
    if errs:
        row.update({"baseline_error": errs.get("baseline", ""), "patched_error": errs.get("patched", ""),
                    "ok": "baseline" in errs and "patched" in errs})   # (neither runs: reported, not a mismatch)
        row["status"] = "neither variant runs it" if row["ok"] else "variants differ in what they run"
        return row
    (rb, b), (rp, p) = res["baseline"], res["patched"]
    a64, b64 = b.astype(np.float64), p.astype(np.float64)
    err = nmse(p, b)
    ext = rp.get("ext") or {}
    row.update({"pipelined": rp["schedule"]["pipeline_parallel"], "baseline_pipelined": rb["schedule"]["pipeline_parallel"],
                "nmse": err, "max_abs": float(np.max(np.abs(a64 - b64))) if a64.size else 0.0,
                "upload_all": ext.get("upload_all"), "gather": ext.get("gather"), "selective": ext.get("selective"),
                "offload_owner": ext.get("offload_owner"),
                "h2d_bytes": [d["h2d_bytes"] for d in rp["counters"]["devices"]]})
    row["ok"] = err <= NMSE_MAX and b.shape == p.shape
    row["status"] = "same logits" + (", pipelined" if row["pipelined"] else ", NOT pipelined") if row["ok"] else \
        f"logits differ (NMSE {err:.2e})"
    return row


def speed(rows: list[dict], models: list[Path], devices: str, out: Path, paired: int | None = None,
          loads: int = PAIRED.loads) -> None:
    """--ab: each model that ran in both variants, as a prompt A/B on slow links (pp256 / ub32), into its row:
    speedup (ratio of the averages), the patched fraction of the links' bound with the pipeline's fill, coverage.
    2 reps a variant, or with `paired` that many rounds over `loads` fresh loads (runner.interleaved, as `ab --paired
    N --loads K`), adding the median paired ratio and its 95% interval (speedup_median, speedup_ci_lo / _hi)."""
    from pyllama_pp import runner
    from pyllama_pp.config import RunConfig
    from pyllama_pp.params import Placement
    by_name = {m.name: m for m in models}
    num = lambda x: float(x) if x == x and x is not None else None   # (NaN, None: None)
    for r in rows:
        if "nmse" not in r:
            continue
        n = r["n_tokens"] * 4
        c = RunConfig(model=str(by_name[r["model"]]), devices=devices, n_batch=n, n_ubatch=r["n_ubatch"],
                      tests=[["pp", n]], reps=2, label=r["arch"],
                      placement=Placement(host_experts="all", tensor_split=r["tensor_split"]))
        kw = dict(out_dir=out / "ab" / r["arch"], progress=False, timeout=300)
        df = runner.interleaved([c], rounds=paired, loads=loads, **kw) if paired else runner.ab([c], **kw)
        p = df[df["variant"] == "patched"]
        if len(p) and not p["error"].fillna("").astype(str).str.len().gt(0).any():
            x = p.iloc[0]
            r.update({"ab_devices": devices, "ab_test": f"pp{n} / ub{r['n_ubatch']}", "speedup": float(x["speedup"]),
                      "bound_frac": num(x["bound_pipe_frac"]), "coverage": num(x["coverage"])})
            if paired:
                b = df[df["variant"] == "baseline"].iloc[0]
                r.update({"ab_rounds": int(x["rounds"]), "ab_loads": int(x["loads"]),
                          "baseline_ts": float(b["avg_ts"]), "patched_ts": float(x["avg_ts"]),
                          **{k: float(x[k]) for k in ("speedup_median", "speedup_ci_lo", "speedup_ci_hi")}})
        print(f"  {r['arch']}: speedup {r.get('speedup', float('nan')):.2f}"
              + (f", paired {_paired(r)}" if "speedup_median" in r else ""), flush=True)


def _paired(r: dict) -> str:
    """A row's paired speedup: median [95% interval]."""
    return f"{r['speedup_median']:.3f} [{r['speedup_ci_lo']:.3f}, {r['speedup_ci_hi']:.3f}]"


def table(rows: list[dict]) -> str:
    paired = any("speedup_median" in r for r in rows)
    lines = ["| architecture | layers | status | pipelined (patched) | NMSE | max abs | ub / tokens | "
             "upload-all / gather / selective | host->device per VDEV (patched) | speedup (VDEV A/B) | "
             + ("paired speedup [95%] | " if paired else "") + "of bound | coverage |",
             "| --- | ---: | --- | --- | ---: | ---: | --- | --- | --- | ---: | " + ("--- | " if paired else "")
             + "---: | ---: |"]
    pct = lambda x: f"{100 * x:.0f}%" if isinstance(x, float) else ""
    for r in rows:
        err = r.get("baseline_error") or r.get("patched_error")
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        lines.append(f"| {r['arch']} | {r.get('n_layer', '')} | {r['status']}{': ' + err if err else ''}"
                     f"{' (' + r['note'] + ')' if r.get('note') else ''} "
                     f"| {r.get('pipelined', '')} | {r.get('nmse', float('nan')):.1e} | {r.get('max_abs', float('nan')):.1e} "
                     f"| {r['n_ubatch']} / {r['n_tokens']} | {r.get('upload_all', '')} / {r.get('gather', '')} / "
                     f"{r.get('selective', '')} | {' / '.join(f'{b / 2**20:.1f} MiB' for b in r.get('h2d_bytes', []))} "
                     f"| {sp} " + (f"| {_paired(r) if 'speedup_median' in r else ''} " if paired else "")
                     + f"| {pct(r.get('bound_frac'))} | {pct(r.get('coverage'))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, help="models test-llama-archs -o wrote (default: build it and write them)")
    ap.add_argument("--arch", default="", help="regex of architectures (test-llama-archs -a)")
    ap.add_argument("--devices", default="vdev:2x0@0")
    ap.add_argument("--ubatch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ab", metavar="DEVICES", nargs="?", const="vdev:2x0@0.1GBps",
                    help="also a prompt A/B of each model on these devices (default vdev:2x0@0.1GBps: slow links)")
    ap.add_argument("--paired", type=int, metavar="N",
                    help="with --ab: N (even) paired rounds instead of 2 reps, as `pyllama-pp ab --paired N`: the "
                         "median ratio of the rounds and its 95%% interval")
    ap.add_argument("--loads", type=int, default=PAIRED.loads, metavar="K",
                    help="with --paired: K fresh loads of both workers, N rounds each (default: %(default)s)")
    args = ap.parse_args()
    if args.paired is not None and (not args.ab or args.paired < 2 or args.paired % 2):
        ap.error(f"--paired {args.paired}: an even number of rounds >= 2 (AB and BA pairs), with --ab")
    if args.loads != PAIRED.loads and (not args.paired or args.loads < 1):
        ap.error(f"--loads {args.loads}: a whole number >= 1, with --paired N")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.models:
        models = sorted(args.models.glob("*-moe.gguf"))
        if args.arch:
            models = [m for m in models if re.search(args.arch, m.name[: -len("-moe.gguf")])]
    else:
        exe = build_writer(args.out / "writer")
        print(f"built {exe} ({time.time() - t0:.0f} s)", flush=True)
        models = write_models(exe, args.out / "models", args.arch, args.seed)
    if not models:
        raise SystemExit("no MoE models (*-moe.gguf) to run")
    rows = []
    for i, m in enumerate(models):
        rows.append(run_pair(m, args.devices, args.ubatch, args.tokens, args.out))
        r = rows[-1]
        print(f"[{i + 1}/{len(models)} {time.time() - t0:5.0f}s] {r['arch']}: {r['status']}", flush=True)
    if args.ab:
        speed(rows, models, args.ab, args.out, args.paired, args.loads)
    (args.out / "archs.json").write_text(json.dumps(rows, indent=1))
    md = table(rows)
    (args.out / "archs.md").write_text(md + "\n")
    print(md)
    bad = [r["arch"] for r in rows if not r["ok"] or (not r.get("pipelined", True) and "nmse" in r)]
    ran = sum(1 for r in rows if "nmse" in r)
    print(f"\n{ran} of {len(rows)} MoE architectures ran in both variants, {sum(1 for r in rows if r['ok'] and 'nmse' in r)} "
          f"with the same logits; {len(rows) - ran} run in neither; problems: {', '.join(bad) or 'none'} "
          f"({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
