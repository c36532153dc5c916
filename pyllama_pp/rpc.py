"""Serve this machine's devices to other hosts over llama.cpp's ggml RPC (its rpc-server, in-process), and a relay
that counts and paces what crosses the network.

A client names the server's devices with the device spec `rpc://HOST:PORT` (`devices.py`); `Session` connects to it
through the same registration as every other kind (`session.register_devices`). The patched variant's server speaks
RPC protocol 7.1: it keeps the host weights of the layers its devices hold in its own RAM (pinned where the device
allows) and its devices copy them in, so only activations cross the network; upstream's (7.0) has no host memory of
its own, and an upstream client refuses a 7.1 server at connect.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from . import binding, defaults
from . import devices as devspec
from .errors import DeviceSpecError, PyllamaError, UnsupportedError
from .session import list_devices, register_devices


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
        PyllamaError: when the server cannot start (e.g. the port is taken); UnsupportedError for host_ram with the
            baseline variant.
    """
    spec = devspec.parse(devices)
    if spec.kind == "rpc":
        raise DeviceSpecError("rpc-server serves this machine's devices: give cpu, cuda[:IDS] or vdev:..., not rpc://")
    if not 1 <= int(port) <= 65535:
        raise DeviceSpecError(f"bad port {port}: use 1..65535")
    if host_ram and variant == "baseline":
        raise UnsupportedError("upstream's RPC server (--variant baseline, protocol 7.0) keeps no host memory of its "
                               "own: --host-ram needs the patched variant")
    native = binding.load(variant)
    names = register_devices(native, spec)
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


class Link:
    """A loopback TCP relay in front of an RPC server: the network between a client and one host, counted and, with
    a rate, paced (each direction on its own, as a full-duplex link).

    Args:
        target_port: the server's port on `host`.
        gbps: each direction's rate in GB/s (0: as fast as loopback carries it).
        host: where the server listens, and where the relay listens (on a port of its own, `port`).
    Raises:
        OSError: when the relay cannot listen.

    >>> link = Link(50052, gbps=1.0)          # clients connect to rpc://127.0.0.1:{link.port}
    >>> link.bytes_up, link.bytes_down        # client -> server, server -> client
    """

    def __init__(self, target_port: int, gbps: float = 0.0, host: str = "127.0.0.1"):
        self.target = (host, int(target_port))
        self.rate = float(gbps) * 1e9
        self.bytes_up = 0
        self.bytes_down = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(4)
        self.port = self._sock.getsockname()[1]
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._open.append(s)
            threading.Thread(target=self._pump, args=(client, server, "bytes_up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "bytes_down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        due = time.monotonic()
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if self.rate > 0:   # (pace: the bytes leave no sooner than the rate allows)
                    due = max(due, time.monotonic()) + n / self.rate
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                dst.sendall(view[:n])
                setattr(self, counter, getattr(self, counter) + n)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop relaying: the listening socket and every open connection are closed."""
        self._closed = True
        for s in [self._sock] + self._open:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
