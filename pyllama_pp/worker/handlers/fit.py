"""Job kind "fit": the variant's common/fit.cpp in this process, its raw result (pyllama_pp.plan makes the Plan)."""
from __future__ import annotations

import json
import time

from ... import binding
from ... import devices as devspec
from ...defaults import threads
from ...errors import DeviceSpecError
from ...jobs import FitJob
from ...params import SPLIT_MODES
from ...session import connect_servers, register_devices


def handle(job: FitJob) -> dict:
    """Set up the job's devices, run pp_fit, return the raw result.

    Raises:
        DeviceSpecError: for a spec without accelerator devices.
    """
    native = binding.load(job.variant)
    spec = devspec.parse(job.devices)
    servers = connect_servers(native, spec) if spec.kind == "rpc" else []
    names = register_devices(native, spec, servers)
    if names == "none":
        raise DeviceSpecError("fit needs accelerator devices")
    res = run_fit(native, job.model, names, SPLIT_MODES[job.split_mode], job.ctx, list(job.margins),
                  int(job.n_ctx_min))
    if servers:   # (each RPC device's server, the host memory that server can give host weights, the network to it:
        # asked once per server, through its first device)
        server = {n: ep for ep, served in servers for n in served}
        asked: dict = {}
        for d in res["devices"]:
            ep = d["server"] = server.get(d["name"])
            if ep and ep not in asked:
                asked[ep] = (server_host_free(native, d["name"]), net_rate(native, d["name"], d["free_bytes"]))
            d["server_host_free"], d["server_net"] = asked.get(ep, (None, None))
    return res


def server_host_free(native, name: str):
    """The host memory the patched RPC server of device `name` can still give host weights (None: it keeps none)."""
    free, total = native.ffi.new("uint64_t *"), native.ffi.new("uint64_t *")
    return int(free[0]) if native.lib.pp_rpc_host_memory(name.encode(), free, total) == 0 else None


NET_PROBE_BYTES = (1 << 20, 16 << 20)   # a first measure, and a longer one where the first took under 20 ms


def net_rate(native, name: str, free_bytes: int):
    """The network to the server of RPC device `name`, measured with NET_PROBE_BYTES written there and read back (no
    more than an eighth of the device's free memory, at least 64 KiB), and a message's round trip: {"up_gbps",
    "down_gbps", "rtt_s"}, or None where it cannot be measured (a server that drops the connection ends the worker:
    ggml RPC aborts on a lost server)."""
    up, down, rtt = (native.ffi.new("double *") for _ in range(3))
    got, last = None, 0
    for size in NET_PROBE_BYTES:
        n = max(64 << 10, min(size, int(free_bytes) // 8))
        if n == last or native.lib.pp_rpc_net_rate(name.encode(), n, up, down, rtt) != 0:
            break
        last, got = n, {"up_gbps": up[0], "down_gbps": down[0], "rtt_s": rtt[0]}
        if n / (up[0] * 1e9) + n / (down[0] * 1e9) > 0.02:
            break
    return got


def run_fit(native, model: str, dev_names: str, split_mode: int, ctx, margins: list[int], n_ctx_min: int = 0) -> dict:
    """pp_fit in this process (devices already set up); the raw result as a dict (used by the worker)."""
    lib, ffi, s = native.lib, native.ffi, native.str
    keep = [ffi.new("char[]", str(model).encode()), ffi.new("char[]", dev_names.encode())]
    p = ffi.new("pp_fit_params *")
    p.path, p.devices, p.split_mode, p.n_ctx_min = keep[0], keep[1], split_mode, n_ctx_min
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
