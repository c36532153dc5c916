"""Job kind "fit": the variant's common/fit.cpp in this process, its raw result (pyllama_pp.plan makes the Plan)."""
from __future__ import annotations

import json
import time

from ... import binding
from ... import devices as devspec
from ...defaults import threads
from ...errors import DeviceSpecError
from ...jobs import FitJob
from ...model_file import expert_layout, expert_tensor_bytes, expert_tensor_shape
from ...params import SPLIT_MODES
from ...rpc.client import describe_servers
from ...session import apply_switches, model_params
from ...switches import staging_threads


def handle(job: FitJob) -> dict:
    """Set up the job's devices, run pp_fit, return the raw result.

    Raises:
        DeviceSpecError: for a spec without accelerator devices.
    """
    native = binding.load(job.variant)
    apply_switches(native, job.variant, job.switches)   # (as a run's: the dry run's scheduler reads them)
    spec = devspec.parse(job.devices)
    servers = spec.connect(native)   # (rpc-servers: asked for their host memory and network below)
    names = spec.register(native, servers)
    if names == "none":
        raise DeviceSpecError("fit needs accelerator devices")
    given = model_params(native, job.model, names, job.placement) if job.measure else None
    res = run_fit(native, job.model, names, SPLIT_MODES[job.split_mode], job.ctx, list(job.margins),
                  int(job.n_ctx_min), given[0] if given else None)
    if servers:
        describe_servers(native, servers, res["devices"])
    if job.rates:
        served = {n for _, names_there in servers for n in names_there}
        local = [d for d in res["devices"] if d["name"] not in served]   # (a server's link is the server's own)
        res["rates"] = measure_rates(native, local, job.rates, expert_tensor_bytes(job.model),
                                     staging_threads(job.switches))
        if "cpu_expert" in job.rates:
            res["rates"]["cpu_expert_gbps"] = cpu_expert_rate(native, job.model, threads(job.ctx.n_threads))
    return res


HOST_COPY_BYTES = 256 << 20   # eight staging slots' worth
RATE_REPS = 3
LINK_PROBE_TOTAL = 16 << 20   # a round of copies: this many bytes (small tensors: more copies), three rounds


def link_rate(native, name: str, free_bytes: int, copy_bytes: int) -> dict:
    """Device `name`'s host link, measured with copies of `copy_bytes` (one expert tensor: what a run's copies move
    at a time, their own costs included; at most an eighth of the device's free memory, at least 64 KiB), in rounds
    of LINK_PROBE_TOTAL bytes (at least RATE_REPS copies): {"pinned_gbps" (0: no pinned host memory),
    "pageable_gbps", "copy_bytes"}."""
    pinned, pageable = native.ffi.new("double *"), native.ffi.new("double *")
    n = max(64 << 10, min(copy_bytes or LINK_PROBE_TOTAL, int(free_bytes) // 8))
    copies = max(RATE_REPS, min(256, LINK_PROBE_TOTAL // n))
    native.check(native.lib.pp_link_rate(name.encode(), n, copies, pinned, pageable))
    return {"pinned_gbps": pinned[0], "pageable_gbps": pageable[0], "copy_bytes": n}


def measure_rates(native, devices: list[dict], what: list, copy_bytes: int, copy_threads: int = 0) -> dict:
    """The rates fit_ubatch predicts with, measured in this process: each device's host link ("links": name ->
    link_rate, with copies of copy_bytes) and the host's copy into pinned memory as the patched build's staging runs
    it ("host_copy_gbps", on copy_threads threads: 0 the build's default, as STAGING=1)."""
    out: dict = {}
    if "links" in what:
        out["links"] = {d["name"]: link_rate(native, d["name"], d["free_bytes"], copy_bytes) for d in devices}
    if "host_copy" in what:
        got = native.ffi.new("double *")
        native.check(native.lib.pp_host_copy_rate(devices[0]["name"].encode() if devices else native.ffi.NULL,
                                                  HOST_COPY_BYTES, copy_threads, RATE_REPS, got))
        out["host_copy_gbps"] = got[0]
    return out


CPU_EXPERT_REPS = 8


def cpu_expert_rate(native, model: str, n_threads: int) -> dict:
    """The host CPU's decode expert op on the model's largest expert tensor (pp_cpu_expert_rate: one token's
    n_used experts, GB/s of the experts it reads) at n_threads: {str(n_threads): GB/s}; {} for a model without
    experts. The expert cache's break-even compares it with the link a miss takes and the device's own read."""
    shape, n_used = expert_tensor_shape(model), expert_layout(model)[0]
    if shape is None or n_used <= 0:
        return {}
    gtype, ne0, ne1, n_expert = shape
    got = native.ffi.new("double *")
    native.check(native.lib.pp_cpu_expert_rate(gtype, ne0, ne1, n_expert, n_used, n_threads, CPU_EXPERT_REPS, got))
    return {str(n_threads): got[0]}


def run_fit(native, model: str, dev_names: str, split_mode: int, ctx, margins: list[int], n_ctx_min: int = 0,
            placement=None) -> dict:
    """pp_fit in this process (devices already set up); the raw result as a dict (used by the worker). `placement`:
    a pp_model_params (session.model_params) whose memory is measured as it is, no fit."""
    lib, ffi, s = native.lib, native.ffi, native.str
    keep = [ffi.new("char[]", str(model).encode()), ffi.new("char[]", dev_names.encode())]
    p = ffi.new("pp_fit_params *")
    p.path, p.devices, p.split_mode, p.n_ctx_min = keep[0], keep[1], split_mode, n_ctx_min
    p.placement = placement if placement is not None else ffi.NULL
    each = margins * 16 if len(margins) == 1 else margins   # (one margin: every device's)
    for i, m in enumerate(each[:16]):
        p.margins[i] = int(m)
    c = ffi.new("pp_context_params *")
    c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max = ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, 1
    c.n_threads = threads(ctx.n_threads)
    c.flash_attn, c.op_offload, c.offload_kqv = ctx.flash_attn, int(ctx.op_offload), int(ctx.offload_kqv)
    out = ffi.new("pp_fit_result *")
    t0 = time.perf_counter()
    native.check(lib.pp_fit(p, c, out))
    dt = time.perf_counter() - t0

    def mem(m) -> dict:
        return {"name": s(m.name), "model_bytes": m.model_bytes, "context_bytes": m.context_bytes,
                "compute_bytes": m.compute_bytes, "free_bytes": m.free_bytes, "total_bytes": m.total_bytes}

    try:
        report = json.loads(s(out.report) or "[]")
    except json.JSONDecodeError:
        report = []
    return {"status": out.status, "n_gpu_layers": out.n_gpu_layers, "n_ctx": out.n_ctx, "n_layer": out.n_layer,
            "n_expert": out.n_expert, "tensor_split": [float(out.tensor_split[i]) for i in range(out.n_devices)],
            "devices": [mem(out.devices[i]) for i in range(out.n_devices)], "host": mem(out.host),
            "overrides": [x for x in s(out.overrides).split("\n") if x], "message": s(out.message).strip(),
            "report": report, "seconds": dt}
