"""Serve this machine's devices to other hosts over llama.cpp's ggml RPC (upstream's rpc-server, in-process).

A client names the server's devices with the device spec `rpc://HOST:PORT` (`devices.py`); `Session` connects to it
through the same registration as every other kind (`session.register_devices`).
"""
from __future__ import annotations

import sys
from typing import Optional

from . import binding
from . import devices as devspec
from .errors import DeviceSpecError
from .session import list_devices, register_devices


def serve(devices: "str | devspec.DeviceSpec", host: str = "127.0.0.1", port: int = 50052,
          variant: str = "baseline", threads: int = 1, announce: Optional[object] = None) -> None:
    """Register the local devices of `devices` in this process and serve them at HOST:PORT; blocks while serving.

    Args:
        devices: a device spec of this machine ("cpu", "cuda", "cuda:0", "vdev:1x0@0", ...; not rpc://).
        host, port: where to listen (127.0.0.1: this machine only; the RPC protocol has no authentication).
        variant: the build to load ("baseline" or "patched"); the served devices' backends come from it.
        threads: CPU threads for a CPU device.
        announce: a file to write "serving DEVICES on HOST:PORT" to before blocking (default: stderr).
    Raises:
        DeviceSpecError: for an rpc spec, a bad port, or devices that cannot be set up.
        PyllamaError: when the server cannot start (e.g. the port is taken).
    """
    spec = devspec.parse(devices)
    if spec.kind == "rpc":
        raise DeviceSpecError("rpc-server serves this machine's devices: give cpu, cuda[:IDS] or vdev:..., not rpc://")
    if not 1 <= int(port) <= 65535:
        raise DeviceSpecError(f"bad port {port}: use 1..65535")
    native = binding.load(variant)
    names = register_devices(native, spec)
    if names == "none":   # cpu: the CPU device itself
        names = next(d["name"] for d in list_devices() if d["type"] == 0)   # GGML_BACKEND_DEVICE_TYPE_CPU
    lib, ffi = native.lib, native.ffi
    keep = [ffi.new("char[]", n.encode()) for n in names.split(",")]
    arr = ffi.new("const char *[]", keep)
    endpoint = f"{host}:{int(port)}"
    print(f"serving {names} on {endpoint}", file=announce or sys.stderr, flush=True)
    native.check(lib.pp_rpc_start_server(endpoint.encode(), arr, len(keep), max(1, int(threads))))
