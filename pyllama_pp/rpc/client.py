"""The client's side of ggml RPC in this process: connect to rpc-servers (their devices join this process's), and ask
them what fit plans with (each server's host memory for host weights, the network to it) and what the patched
scheduler's counters leave out (the host weights a server copied in itself).

Every function takes the loaded variant (`binding.Native`); the shim's `pp_rpc_*` calls do the work
(pyllama_pp/native/rpc.cpp).
"""
from __future__ import annotations

import socket
from typing import Optional

from ..defaults import TIMEOUTS
from ..errors import DeviceSpecError, PyllamaError


def tcp_probe(endpoint: str, timeout: float = TIMEOUTS.rpc_connect) -> Optional[str]:
    """Why a TCP connection to an rpc-server's "HOST:PORT" fails ("Connection refused", "timed out"), or None when it
    connects (the server then waits for the next client, as it does after the shim's own probe)."""
    host, _, port = endpoint.partition("/")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def connect_servers(native, endpoints: list[str]) -> list[tuple[str, list[str]]]:
    """Connect to rpc-servers (ggml RPC registers each endpoint once per process).

    Args:
        native: the loaded variant.
        endpoints: "HOST:PORT" (every device of that server) or "HOST:PORT/N" (only its device N), as an rpc device
            spec lists them.
    Returns:
        (endpoint, the names of the devices used there) for each, in the given order.
    Raises:
        DeviceSpecError: for a server that cannot be reached, speaks another protocol, offers no devices or not the
            device asked for.
    """
    lib, ffi = native.lib, native.ffi
    out = []
    for item in endpoints:
        ep, _, dev = item.partition("/")   # ("HOST:PORT/N": only the server's device N)
        buf = ffi.new("char[1024]")
        try:
            native.check(lib.pp_rpc_add_server(ep.encode(), buf, 1024))
        except PyllamaError as e:
            if "version mismatch" not in str(e):
                raise
            # (the patched build speaks RPC protocol 7.1, upstream 7.0: a client refuses a newer server)
            variant = native.str(lib.pp_variant())
            raise DeviceSpecError(f"the RPC server at {ep} speaks another protocol than this build ({variant}): "
                                  f"{str(e).split(': ')[-1]}. Fix: start it from the same variant, `pyllama-pp "
                                  f"rpc-server --variant {variant} ...`; in `ab` and `check`, give the baseline its own "
                                  "servers with --baseline-devices") from None
        got = ffi.string(buf).decode()
        if not got:
            raise DeviceSpecError(f"the RPC server at {ep} offers no devices")
        offered = got.split(",")
        if dev and int(dev) >= len(offered):
            raise DeviceSpecError(f"the RPC server at {ep} offers {len(offered)} device(s) (0..{len(offered) - 1}), "
                                  f"not device {dev}. Fix: rpc://{ep}/N with N in 0..{len(offered) - 1}, or "
                                  f"rpc://{ep} for all of them")
        out.append((ep, [offered[int(dev)]] if dev else offered))
    return out


def host_weight_bytes(native, backend: str) -> int:
    """The host-weight bytes the patched RPC server behind scheduler backend `backend` ("RPC<N>[HOST:PORT]") copied
    to its device itself (RPC_HOST): the client's scheduler does not see those copies. -1 for another backend or a
    server that keeps no host weights."""
    return native.lib.pp_rpc_host_weight_bytes(backend.encode())


#: the counters of an RPC server's expert cache (pp_rpc_host_cache_counts), as the scheduler's stats name them; the
#: last three are levels
CACHE_COUNTS = ("ops", "hits", "misses", "evictions", "bytes", "buffer_bytes", "layers", "slots")


def add_host_cache_counts(native, backend: dict) -> None:
    """Add to a scheduler backend's stats (a dict with "name" and its "cache_*" counters) the expert cache of the
    patched RPC server behind it (EXPERT_CACHE on the server, protocol 7.1.1: the host experts the server keeps,
    cached on its device by the schedulers that run this client's graphs there); nothing for another backend or an
    older server. Counts and the slots' memory and layers add up; "cache_slots" is the fewest of a layer on either side."""
    got = native.ffi.new("pp_cache_counts *")
    if native.lib.pp_rpc_host_cache_counts(backend["name"].encode(), got) != 0:
        return
    server = {f"cache_{k}": int(getattr(got, k)) for k in CACHE_COUNTS}
    slots = [n for n, layers in ((backend.get("cache_slots", 0), backend.get("cache_layers", 0)),
                                 (server["cache_slots"], server["cache_layers"])) if layers]
    for k, v in server.items():
        backend[k] = backend.get(k, 0) + v
    backend["cache_slots"] = min(slots, default=0)


def server_host_free(native, name: str):
    """The host memory the patched RPC server of device `name` can still give host weights (None: it keeps none)."""
    free, total = native.ffi.new("uint64_t *"), native.ffi.new("uint64_t *")
    return int(free[0]) if native.lib.pp_rpc_host_memory(name.encode(), free, total) == 0 else None


NET_PROBE_BYTES = (1 << 20, 16 << 20)   # a first measure, and a longer one where the first took under 20 ms


def net_rate(native, name: str, free_bytes: int):
    """The network to the server of RPC device `name`, measured with NET_PROBE_BYTES written there and read back (no
    more than an eighth of the device's free memory, at least 64 KiB), and a message's round trip: {"up_gbps",
    "down_gbps", "rtt_s"}, or None where it cannot be measured (a server that drops the connection ends a baseline
    worker: upstream's ggml RPC aborts on a lost server)."""
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


def describe_servers(native, servers: list[tuple[str, list[str]]], devices: list[dict]) -> None:
    """Add to each of fit's device dicts (name, free_bytes) its RPC server ("server": the endpoint, None for a device
    of this machine), the host memory that server can give host weights ("server_host_free") and the network to it
    ("server_net"): asked once per server, through its first device.

    Args:
        native: the loaded variant.
        servers: what connect_servers returned.
        devices: fit's raw device dicts, changed in place.
    """
    server = {n: ep for ep, served in servers for n in served}
    asked: dict = {}
    for d in devices:
        ep = d["server"] = server.get(d["name"])
        if ep and ep not in asked:
            asked[ep] = (server_host_free(native, d["name"]), net_rate(native, d["name"], d["free_bytes"]))
        d["server_host_free"], d["server_net"] = asked.get(ep, (None, None))
