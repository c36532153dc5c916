#!/usr/bin/env python3
"""How many kernels can one host thread queue on a CUDA stream before a launch blocks? And do host->device
copies from one pinned buffer to two GPUs overlap when one thread issues them? (PyTorch, on the GPU machine.)

Asked to see whether one scheduler thread can keep two GPUs busy: if launches block once a stream holds Q
pending kernels, a thread that feeds two GPUs in turn is tied to the slower queue. Writes cuda_queue.json.
  python lab/cuda_queue.py [--out DIR]   (default bench/out/cuda_queue/)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench" / "out" / "cuda_queue",
                    help="output folder (default: bench/out/cuda_queue, git-ignored)")
    args = ap.parse_args()
    import torch
    res: dict = {"devices": torch.cuda.device_count()}
    torch.cuda.set_device(0)
    s = torch.cuda.Stream(0)
    cycles = 20000  # ~10 us a kernel at ~2 GHz
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        rows = []
        for n in (64, 256, 512, 1024, 2048, 4096, 8192):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.cuda._sleep(cycles)
            t_host = time.perf_counter() - t0
            torch.cuda.synchronize()
            t_all = time.perf_counter() - t0
            rows.append({"kernels": n, "host_s": t_host, "total_s": t_all, "per_kernel_us": t_all / n * 1e6})
            print(rows[-1], flush=True)
        res["queue"] = rows
    if torch.cuda.device_count() >= 2:
        n = 2 << 30
        host = torch.empty(n, dtype=torch.uint8).pin_memory()
        dst = [torch.empty(n // 2, dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]
        streams = [torch.cuda.Stream(d) for d in (0, 1)]
        for d in (0, 1):
            dst[d].copy_(host[:n // 2], non_blocking=True)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        out = {}
        for name, devs in (("gpu0", (0,)), ("gpu1", (1,)), ("both", (0, 1))):
            t0 = time.perf_counter()
            for d in devs:
                with torch.cuda.stream(streams[d]):
                    dst[d].copy_(host[d * (n // 2):(d + 1) * (n // 2)], non_blocking=True)
            t_host = time.perf_counter() - t0
            for d in devs:
                streams[d].synchronize()
            t = time.perf_counter() - t0
            out[name] = {"GBps": len(devs) * (n // 2) / t / 1e9, "host_s": t_host, "total_s": t}
            print(name, out[name], flush=True)
        res["pinned_h2d_one_thread"] = out
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_queue.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
