#!/usr/bin/env python3
"""The logits check on every synth family's tiny preset: both variants on one placement (every expert in host RAM,
pipelined in the patched build), the NMSE and the largest absolute difference of every token's logits.

Exit 1 when any family's logits differ (NMSE above the limit). Default devices: three unequal VDEVs (memory, link
rate and compute speed all differ); on the GPU machine `--devices cuda` (e.g. one H200 split in two with
GGML_CUDA_DEVICES=2).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pyllama_pp import synth
from pyllama_pp.check import check_logits

FAMILIES = ("tiny", "mixtral-tiny", "qwen2moe-tiny", "glm4moe-tiny", "deepseek2-tiny", "gptoss-tiny")
UNEQUAL_VDEVS = json.dumps({"kind": "vdev", "devices": [
    {"memory": "96MiB", "link_gbps": 4, "speed": 1.0},
    {"memory": "64MiB", "link_gbps": 2, "speed": 1.5},
    {"memory": "48MiB", "link_gbps": 1, "speed": 2.0}]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=UNEQUAL_VDEVS, help="device spec (default: three unequal VDEVs)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="synth presets, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench/out/check_families"), help="folder for results.json")
    ap.add_argument("--budget", type=float, default=0, help="seconds (bench/gpu_run.sh passes it; 0: no limit)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, t0, failed = [], time.time(), False
    print("| family | placement | tokens | n_ubatch | PP baseline/patched | splits | NMSE | max abs diff | same |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for fam in args.families.split(","):
        if args.budget and time.time() - t0 > args.budget - 30:
            print(f"(budget spent: {fam} and later not run)")
            break
        model = args.out / f"{fam}.gguf"
        synth.write_gguf(model, synth.preset(fam, seed=1))
        r = check_logits(model, devices=args.devices)
        rows.append({"family": fam, **r.to_dict()})
        failed |= not r.ok
        print(f"| {fam} | {r.placement} | {r.n_tokens} | {r.n_ubatch} | "
              f"{'on' if r.baseline_pipeline_parallel else 'off'}/{'on' if r.patched_pipeline_parallel else 'off'} | "
              f"{r.patched_n_splits} | {r.nmse:.3g} | {r.max_abs_diff:.3g} | {'yes' if r.ok else 'NO'} |", flush=True)
        model.unlink()
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
