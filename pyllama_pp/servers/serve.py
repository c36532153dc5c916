"""Serve this machine's devices to other hosts over llama.cpp's ggml RPC (its rpc-server, in-process: the library part
of `pyllama-pp rpc-server`), and start such a server in a process of its own (tests, benches).

A client names the server's devices with the device spec `rpc://HOST:PORT` (pyllama_pp.devices); `Session` connects
to it through the same registration as every other kind (pyllama_pp.rpc.client). The patched variant's server speaks
RPC protocol 7.1: it keeps the host weights of the layers its devices hold in its own RAM (pinned where the device
allows) and its devices copy them in, so only activations cross the network; upstream's (7.0) has no host memory of
its own, and an upstream client refuses a 7.1 server at connect.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Optional

from .. import binding, defaults
from .. import devices as devspec
from ..devices import list_devices
from ..errors import ConfigError, DeviceSpecError, PyllamaError, UnsupportedError


def serve(devices: "str | devspec.DeviceSpec", host: str = "127.0.0.1", port: int = 50052,
          variant: str = "patched", threads: Optional[int] = None, announce: Optional[object] = None,
          cpu: bool = False, host_ram: int = 0) -> None:
    """Register the local devices of `devices` in this process and serve them at HOST:PORT; blocks while serving.

    Args:
        devices: a device spec of this machine ("cpu", "cuda", "cuda:0", "vdev:1x0@0", ...; not rpc://).
        host, port: where to listen (127.0.0.1: this machine only; the RPC protocol has no authentication).
        variant: the build to load ("patched", the default: protocol 7.1, host memory of its own; "baseline":
            upstream's 7.0); the served devices' backends come from it.
        threads: CPU threads for a served CPU device, and for the CPU the patched server runs beside its devices
            (default: every core this process may use).
        announce: a file to write "serving DEVICES on HOST:PORT" to before blocking (default: stderr).
        cpu: serve this host's CPU too, as the last device (where upstream keeps experts in a server's RAM).
        host_ram: the most bytes of this host's memory the clients' host experts may take (0, the default: no limit
            of its own); the patched variant only.
    Raises:
        DeviceSpecError: for an rpc spec, a bad port, or devices that cannot be set up.
        ConfigError: for an address it cannot listen on (a port in use), before anything is announced.
        PyllamaError: when the server cannot start; UnsupportedError for host_ram with the baseline variant.
    """
    spec = devspec.parse(devices)
    if spec.remote:
        raise DeviceSpecError("rpc-server serves this machine's devices: give cpu, cuda[:IDS] or vdev:..., not rpc://")
    if not 1 <= int(port) <= 65535:
        raise DeviceSpecError(f"bad port {port}: use 1..65535")
    if host_ram and variant == "baseline":
        raise UnsupportedError("upstream's RPC server (--variant baseline, protocol 7.0) keeps no host memory of its "
                               "own: --host-ram needs the patched variant")
    check_port(host, int(port))
    native = binding.load(variant)
    names = spec.register(native)
    if names == "none":   # cpu: the CPU device itself
        names = cpu_name()
    elif cpu:
        names += "," + cpu_name()
    lib, ffi = native.lib, native.ffi
    keep = [ffi.new("char[]", n.encode()) for n in names.split(",")]
    arr = ffi.new("const char *[]", keep)
    endpoint = f"{host}:{int(port)}"
    print(f"serving {names} on {endpoint}", file=announce or sys.stderr, flush=True)
    threads = defaults.threads(threads)
    native.check(lib.pp_rpc_start_server(endpoint.encode(), arr, len(keep), max(1, int(threads)), int(host_ram)))


def check_port(host: str, port: int) -> None:
    """Whether a server can listen at HOST:PORT, tried as ggml RPC's server binds (SO_REUSEADDR), before anything is
    loaded or announced.

    Raises:
        ConfigError: naming the address, why (in use, an address of another host) and the fix.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"rpc-server cannot listen on {host}:{port} ({e.strerror or e}). Fix: another --port, "
                              "or stop what listens there (--host must be an address of this machine)") from None


def cpu_name() -> str:
    """The name of this process's CPU device."""
    return next(d["name"] for d in list_devices() if d["type"] == 0)   # GGML_BACKEND_DEVICE_TYPE_CPU


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port at `host` that nothing listens on now (the system picks it).

    Args:
        host: the address.
    Returns:
        int: the port.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_server(devices: str, variant: str = "patched", host: str = "127.0.0.1", port: Optional[int] = None,
                 stderr=subprocess.PIPE, threads: Optional[int] = None, cpu: bool = False,
                 host_ram: Optional[str] = None) -> tuple[int, subprocess.Popen]:
    """Start `pyllama-pp rpc-server` in a process of its own (tests, benches); wait_listening says when it serves.

    Args:
        devices: the device spec it serves.
        variant: "patched" (default) or "baseline".
        host: where it listens.
        port: its port (default: a free one).
        stderr: where its stderr goes (default: a pipe, which wait_listening reads when it fails).
        threads: its CPU threads (default: rpc-server's).
        cpu: serve the CPU too, as the last device (rpc-server --cpu).
        host_ram: the most host memory its clients' host experts may take, a size ("2GiB"; rpc-server --host-ram).
    Returns:
        (port, process): stop it with process.kill().
    """
    port = port or free_port(host)
    argv = [sys.executable, "-m", "pyllama_pp.cli", "rpc-server", "--devices", devices, "--host", host,
            "--port", str(port), "--variant", variant]
    argv += (["--threads", str(threads)] if threads else []) + (["--cpu"] if cpu else [])
    argv += ["--host-ram", host_ram] if host_ram else []
    return port, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def wait_listening(port: int, proc: subprocess.Popen, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
    """Return once the server of spawn_server listens.

    Args:
        port: its port.
        proc: its process.
        host: its address.
        timeout: seconds to wait.
    Raises:
        PyllamaError: when it exits first (with its stderr where that is a pipe), or does not listen within timeout
            (it is killed then).
    """
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            said = proc.stderr.read()[-500:] if proc.stderr else "(its stderr went to a file)"
            raise PyllamaError(f"rpc-server at {host}:{port} exited with {proc.returncode}: {said}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise PyllamaError(f"rpc-server did not listen on {host}:{port} within {timeout:.0f} s")
