"""The soak's API (the soak tool is bench/soak.py): many mixed calls in ONE session and context, as a long-running
server makes them, checked for crashes, host memory growth, device memory drift and logits that drift from a fresh
session's.

`run(...)` runs the two worker jobs (kind "soak", pyllama_pp.worker.handlers.soak: the reference in a fresh
session, then the soak, which compares each checkpoint with the reference's logits as it goes) and `judge` applies
the limits.

Device memory: on VDEVs the bytes allocated (device counters), which must not move at all after the warm-up. On CUDA
devices the memory in use as CUDA reports it (memory_total - memory_free of the ggml device, i.e. cudaMemGetInfo:
the whole GPU, every process and the CUDA context included), which must stay within CUDA_DRIFT_MIN_BYTES or
CUDA_DRIFT_FRAC (the larger) of the first checkpoint after the warm-up (CUDA's pool allocators move a little).
Devices that share one GPU (GGML_CUDA_DEVICES) each report an equal share of it (ggml divides by the share count),
so their figures are equal and each is that share of the GPU's memory in use.

With the patched build's device expert cache (`switches={"EXPERT_CACHE": N}`: N MiB of expert slots per device) the
slots are part of the memory judged above, and the memory they take on each device must also stay within the N MiB
the switch gives them at every checkpoint (EXPERT_CACHE=-N, N slots a layer whatever they take, sets no such bound).
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from .defaults import CONTEXT, SOAK, TIMEOUTS
from .switches import ExpertCache
from .worker.client import run_job

NMSE_MAX = 1e-6
RSS_GROWTH_MAX = 0.05
MiB = 1024 * 1024
CUDA_DRIFT_MIN_BYTES = 16 * MiB   # CUDA memory in use may move this much after the warm-up...
CUDA_DRIFT_FRAC = 0.005           # ... or this fraction of the first checkpoint's after the warm-up, the larger


@dataclass
class SoakResult:
    """What the soak found; `problems` is empty when it passed."""

    variant: str
    devices: str
    calls: int
    evals: int
    shifts: int
    rewinds: int
    clears: int
    seconds: float
    rss_start: int
    rss_warm: int
    rss_end: int
    rss_max: int
    rss_growth: float
    rss_untrimmed_max: int       # the largest RSS before malloc_trim (the allocator's spare pages included)
    alloc_bytes: list            # per device, at the checkpoints after the warm-up (one list per checkpoint)
    checkpoints: int
    matched: int
    exact: int
    nmse_max: float
    counts: dict
    bands: dict
    ext: Optional[dict]
    problems: list = field(default_factory=list)
    rows: list = field(default_factory=list)   # the checkpoints, with their NMSE
    expert_cache: Union[int, str] = 0   # EXPERT_CACHE as the soak ran (0: off, or the baseline; a list: its text)
    cache_buffer_bytes: dict = field(default_factory=dict)   # the expert slots' memory per backend at the end
    # CUDA devices only (None otherwise): per device its name, total_bytes, used_start_bytes (the session made),
    # warm_used_bytes (the warm-up's last checkpoint); used_bytes at each checkpoint after the warm-up (one list per
    # checkpoint), the largest drift from the first of them (signed bytes), the tolerance, and flat
    cuda: Optional[dict] = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if d["cuda"] is None:
            del d["cuda"]
        return d


def cuda_pair(devices: str, found: list[dict]) -> str:
    """The soak's devices for `devices` given the devices a worker found (an info job's devices): a bare `cuda`
    becomes the first two CUDA devices (one where there is one): the soak checks correctness and leaks on the tiny
    preset, and two devices are what pipelining needs; more would only spread its few layers thinner. Any other
    spec, and `cuda` where no CUDA device was found (the worker then says why), is kept."""
    if devices.strip().lower() != "cuda":
        return devices
    n = sum(d["backend"] == "CUDA" for d in found)
    return "cuda:0,1" if n >= 2 else "cuda:0" if n == 1 else devices


def soak_devices(devices: str, variant: str = CONTEXT.variant, timeout: float = TIMEOUTS.info,
                 env: Optional[dict] = None) -> str:
    """cuda_pair with the devices an info job (a worker of `variant`) finds; other specs without a worker."""
    if devices.strip().lower() != "cuda":
        return devices
    return cuda_pair(devices, run_job({"kind": "info"}, variant, timeout=timeout, env=env)["devices"])


def run(model: str, variant: str = CONTEXT.variant, devices: str = SOAK.devices, calls: int = SOAK.calls,
        seed: int = CONTEXT.seed, check_every: int = SOAK.check_every, warmup: int = SOAK.warmup, ctx: Optional[dict] = None,
        placement: Optional[dict] = None, workdir: Optional[str] = None, timeout: float = SOAK.timeout,
        env: Optional[dict] = None, switches: Optional[dict] = None) -> SoakResult:
    """The reference (a fresh session), then the soak, each in its own worker for `variant`; compared here.
    `switches`: the patched build's, NAME -> value, for both (the reference runs the recipes the same way)."""
    ctx = ctx or {"n_ctx": SOAK.n_ctx, "n_batch": SOAK.n_batch, "n_ubatch": SOAK.n_ubatch}
    placement = {"host_experts": SOAK.host_experts, **(placement or {})}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        base = {"kind": "soak", "model": model, "devices": devices, "placement": placement, "ctx": ctx,
                "switches": dict(switches or {})}
        ref = str(Path(tmp) / "ref.npz")
        run_job({**base, "reference": True, "out": ref}, variant, timeout=timeout, env=env)
        res = run_job({**base, "calls": calls, "seed": seed, "check_every": check_every, "warmup": warmup,
                       "out": ref}, variant, timeout=timeout, env=env)
    return judge(res, variant, devices)


def judge(res: dict, variant: str, devices: str) -> SoakResult:
    """The soak job's result against the limits: every checkpoint's logits, the device memory after the warm-up,
    the host RSS growth after the warm-up."""
    problems = []
    rows = []
    matched = exact = 0
    nmse_max = 0.0
    for c in res["checkpoints"]:
        e, same = c["nmse"], c["exact"]
        nmse_max = max(nmse_max, e)
        matched += e <= NMSE_MAX
        exact += same
        rows.append(c)
        if e > NMSE_MAX:
            problems.append(f"checkpoint after call {c['call']} (recipe {c['recipe']}): logits NMSE {e:.3e} "
                            f"> {NMSE_MAX:.0e} against a fresh session")
        if c["failed_allocs"]:
            problems.append(f"checkpoint after call {c['call']}: {c['failed_allocs']} failed device allocations")
    judged = [c for c in res["checkpoints"] if not c["warmup"]] or res["checkpoints"][-1:]
    warm = [c for c in res["checkpoints"] if c["warmup"]][-1:] or judged[:1]
    warm = warm[0]
    allocs = [c["alloc_bytes"] for c in [warm] + judged]
    if any(a != allocs[0] for a in allocs):
        changed = next(c for c in judged if c["alloc_bytes"] != allocs[0])
        problems.append(f"device memory moved after the warm-up: {allocs[0]} -> {changed['alloc_bytes']} bytes "
                        f"per device at call {changed['call']}")
    cache = ExpertCache.of_switch(res.get("expert_cache", 0))   # (a per-device list: its largest size bounds all)
    budget = max((cache.at(i).bytes for i in range(max(1, len(cache.devices)))), default=0)
    for c in judged if budget > 0 else []:
        over = {b: n for b, n in c.get("cache_buffer_bytes", {}).items() if n > budget}
        if over:
            problems.append(f"expert slots past EXPERT_CACHE={res['expert_cache']} MiB at call {c['call']}: "
                            + ", ".join(f"{b} {n} bytes" for b, n in over.items()))
    cuda = judge_cuda(res, warm, judged, problems) if "cuda_used_bytes" in judged[0] else None
    rss = [c["rss_bytes"] for c in res["checkpoints"]]
    rss_warm, rss_end = warm["rss_bytes"], rss[-1]
    rss_top = max(c["rss_bytes"] for c in judged)
    growth = (rss_top - rss_warm) / rss_warm if rss_warm else 0.0
    if growth > RSS_GROWTH_MAX:
        problems.append(f"host RSS grew {growth:.1%} after the warm-up ({rss_warm} -> {rss_top} bytes), "
                        f"more than {RSS_GROWTH_MAX:.0%}")
    return SoakResult(variant, devices, res["calls"], res["evals"], res["shifts"], res["rewinds"], res["clears"],
                      res["seconds"], res["rss_start"], rss_warm, rss_end, max(rss), growth,
                      max(c["rss_untrimmed"] for c in res["checkpoints"]), allocs,
                      len(res["checkpoints"]), matched, exact, nmse_max, res["counts"], res["bands"], res["ext"],
                      problems, rows, res.get("expert_cache", 0), judged[-1].get("cache_buffer_bytes", {}), cuda)


def cuda_tolerance(used: int) -> int:
    """How far CUDA memory in use may move after the warm-up from `used` bytes (the first checkpoint's)."""
    return max(CUDA_DRIFT_MIN_BYTES, int(CUDA_DRIFT_FRAC * used))


def judge_cuda(res: dict, warm: dict, judged: list, problems: list) -> dict:
    """CUDA memory in use at each checkpoint after the warm-up against the first of them (within cuda_tolerance);
    appends a problem per device that moved further, and returns SoakResult.cuda."""
    used = [c["cuda_used_bytes"] for c in judged]
    base = used[0]
    devs = res.get("cuda_devices") or [{"name": f"CUDA device {k}"} for k in range(len(base))]
    drift, tol = [], []
    for k, b in enumerate(base):
        moved = [(c["cuda_used_bytes"][k] - b, c) for c in judged]
        d, at = max(moved, key=lambda m: abs(m[0]))
        drift.append(d)
        tol.append(cuda_tolerance(b))
        if abs(d) > tol[-1]:
            problems.append(f"{devs[k]['name']}: device memory in use moved after the warm-up: {b} -> "
                            f"{at['cuda_used_bytes'][k]} bytes ({d / MiB:+.1f} MiB) at call {at['call']}, more than "
                            f"{tol[-1] / MiB:.1f} MiB")
    return {"devices": [d["name"] for d in devs], "total_bytes": [d.get("total_bytes") for d in devs],
            "used_start_bytes": [d.get("used_bytes") for d in devs], "warm_used_bytes": warm.get("cuda_used_bytes"),
            "used_bytes": used, "drift_bytes": drift, "tolerance_bytes": tol,
            "flat": all(abs(d) <= t for d, t in zip(drift, tol))}
