"""RPC devices: an rpc-server process serving a VDEV, used by a worker through `rpc://HOST:PORT`."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from pyllama_pp import devices as devspec
from pyllama_pp.errors import DeviceSpecError, PyllamaError

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"rpc-server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"rpc-server did not listen on {HOST}:{port} within {timeout:.0f} s")


def start_server() -> tuple[int, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyllama_pp.cli", "rpc-server", "--devices", "vdev:1x0@0",
                             "--host", HOST, "--port", str(port), "--variant", "baseline"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    return port, proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)
    proc.stderr.close()


@pytest.fixture
def rpc_server():
    port, proc = start_server()
    try:
        wait_for_port(port, proc)
        yield port
    finally:
        stop(proc)


@pytest.fixture
def two_rpc_servers():
    started = [start_server() for _ in range(2)]
    try:
        for port, proc in started:
            wait_for_port(port, proc)
        yield [port for port, _ in started]
    finally:
        for _, proc in started:
            stop(proc)


def test_spec_forms():
    s = devspec.parse("rpc://127.0.0.1:50052,127.0.0.1:50053")
    assert s.kind == "rpc" and s.endpoints == ["127.0.0.1:50052", "127.0.0.1:50053"]
    assert s.label == "rpc://127.0.0.1:50052,127.0.0.1:50053"
    assert devspec.parse({"kind": "rpc", "endpoints": ["host-a:1"]}).endpoints == ["host-a:1"]
    for bad in ("rpc://", "rpc://host", "rpc://host:0", "rpc://host:70000", "rpc://h:1,h:1", "rpc://h:x",
                "rpc://h:1,", {"kind": "rpc", "endpoints": []}):
        with pytest.raises(DeviceSpecError):
            devspec.parse(bad)


def test_rpc_logits_match_local(runner, rpc_server, assert_logits_match):
    remote = runner.logits("baseline", devices=f"rpc://{HOST}:{rpc_server}", placement={"host_experts": "none"},
                           n_tokens=32)
    local = runner.logits("baseline", devices="vdev:1x0@0", placement={"host_experts": "none"}, n_tokens=32)
    assert_logits_match(remote["logits"], local["logits"], "baseline on rpc:// vs on the VDEV itself", limit=1e-6)


def test_rpc_closed_port_is_an_error(runner):
    port = free_port()   # (nothing listens there)
    t0 = time.monotonic()
    with pytest.raises(PyllamaError, match="cannot reach the RPC server") as e:
        runner.run("baseline", {"kind": "logits", "devices": f"rpc://{HOST}:{port}", "n_tokens": 4}, cache=False)
    assert isinstance(e.value, DeviceSpecError)
    assert time.monotonic() - t0 < 10


def test_two_servers_pipeline_and_match_one_process(runner, two_rpc_servers, assert_logits_match):
    """Two hosts (two servers on loopback, a VDEV each): the patched build pipelines over both and gives the logits
    of the baseline on two VDEVs in one process."""
    spec = "rpc://" + ",".join(f"{HOST}:{p}" for p in two_rpc_servers)
    remote = runner.logits("patched", devices=spec, placement={"host_experts": "none"}, n_tokens=32)
    local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=32)
    assert remote["schedule"]["pipeline_parallel"] and remote["schedule"]["n_splits"] >= 2, remote["schedule"]
    assert_logits_match(remote["logits"], local["logits"], "patched over two RPC servers vs baseline on two VDEVs",
                        limit=1e-6)
