"""RPC devices: an rpc-server process serving a VDEV, used by a worker through `rpc://HOST:PORT`."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pyllama_pp import devices as devspec
from pyllama_pp import Placement, Session
from pyllama_pp.fit import fit
from pyllama_pp.params import ContextParams
from pyllama_pp.errors import DeviceError, DeviceSpecError, OutOfMemoryError, PyllamaError, WorkerError
from pyllama_pp.rpc.relay import Link
from pyllama_pp.servers.serve import free_port, spawn_server, wait_listening
from pyllama_pp.worker.client import run_job

HOST = "127.0.0.1"


def start_server(variant: str = "baseline", devices: str = "vdev:1x0@0") -> tuple[int, subprocess.Popen]:
    return spawn_server(devices, variant, HOST)


def start_server_with(variant: str, devices: str, **kw) -> tuple[int, subprocess.Popen]:
    return spawn_server(devices, variant, HOST, **kw)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)
    proc.stderr.close()


@pytest.fixture
def rpc_server():
    port, proc = start_server()
    try:
        wait_listening(port, proc, HOST)
        yield port
    finally:
        stop(proc)


def servers(variant: str, n: int, devices: str = "vdev:1x0@0"):
    started = [start_server(variant, devices) for _ in range(n)]
    try:
        for port, proc in started:
            wait_listening(port, proc, HOST)
        yield [port for port, _ in started]
    finally:
        for _, proc in started:
            stop(proc)


@pytest.fixture
def two_rpc_servers():
    yield from servers("baseline", 2)


@pytest.fixture
def two_patched_servers():
    yield from servers("patched", 2)


def spec_of(ports) -> str:
    return "rpc://" + ",".join(f"{HOST}:{p}" for p in ports)


def host_buffers(res: dict) -> list[str]:
    """The buffer types of a result's schedule that hold weights in a server's host memory."""
    return sorted(m["buft"] for m in res["schedule"]["memory"]
                  if m["buft"].startswith("RPC") and m["buft"].endswith("_Host") and m["model_bytes"] > 0)


def test_spec_forms():
    s = devspec.parse("rpc://127.0.0.1:50052,127.0.0.1:50053")
    assert s.kind == "rpc" and s.endpoints == ["127.0.0.1:50052", "127.0.0.1:50053"]
    assert s.label == "rpc://127.0.0.1:50052,127.0.0.1:50053"
    assert devspec.parse({"kind": "rpc", "endpoints": ["host-a:1"]}).endpoints == ["host-a:1"]
    mixed = devspec.parse("vdev:1x0@0+rpc://127.0.0.1:50052")
    assert mixed.kind == "rpc" and mixed.local.kind == "vdev" and mixed.endpoints == ["127.0.0.1:50052"]
    assert devspec.parse(mixed.to_dict()).local.vdevs == mixed.local.vdevs
    assert devspec.parse("cuda:0+rpc://h:1").local.cuda_ids == [0]
    assert devspec.parse("rpc://h:1/1,h:2").endpoints == ["h:1/1", "h:2"]
    for bad in ("rpc://", "rpc://host", "rpc://host:0", "rpc://host:70000", "rpc://h:1,h:1", "rpc://h:x",
                "rpc://h:1/0,h:1", "rpc://h:1/0,h:1/0", "rpc://h:1/x",
                "rpc://h:1,", {"kind": "rpc", "endpoints": []}, "cpu+rpc://h:1", "rpc://h:1+rpc://h:2",
                {"kind": "rpc", "endpoints": ["h:1"], "local": {"kind": "cpu"}}):
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


def test_host_experts_stay_on_their_servers(runner, two_patched_servers, assert_logits_match):
    """Patched servers keep the experts of the layers their device holds in their own host memory: the client's RAM
    holds none of them, the pipeline stays on, and the logits are the single-process baseline's."""
    remote = runner.logits("patched", devices=spec_of(two_patched_servers), placement={"host_experts": "all"},
                           n_tokens=32)
    local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=32)
    assert host_buffers(remote) == sorted(f"RPC0[{HOST}:{p}]_Host" for p in two_patched_servers), remote["schedule"]
    cpu = [m for m in remote["schedule"]["memory"] if m["buft"] == "CPU"]
    experts = sum(m["model_bytes"] for m in remote["schedule"]["memory"] if m["buft"].endswith("_Host"))
    assert cpu and cpu[0]["model_bytes"] < experts / 4, remote["schedule"]["memory"]   # (embeddings only)
    assert remote["schedule"]["pipeline_parallel"], remote["schedule"]
    assert_logits_match(remote["logits"], local["logits"], "host experts on two patched servers vs one process",
                        limit=1e-6)


def test_host_experts_on_servers_with_expert_coverage_counted(runner, two_patched_servers):
    """Counting expert coverage cuts each split into sub-graphs at the routers (an eval callback): a server runs
    those too, with the experts in its host memory and layers left on the client's CPU. A prompt measured without
    logits runs its last layer's expert ops on no token."""
    for placement in ({"host_experts": "all"}, {"host_experts": [3, 4], "n_gpu_layers": 4, "tensor_split": [2, 2]}):
        res = runner.run("patched", {"kind": "measure", "devices": spec_of(two_patched_servers), "placement": placement,
                                     "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 64}, "tests": [["pp", 256]],
                                     "reps": 1, "warmup": 0, "coverage": True}, cache=False)
        assert host_buffers(res) and res["tests"][0]["seconds"][0] > 0, res
        # each server's copies of its host experts, in the client's counters for its device (the server reports
        # them): both devices' with every expert on host; the first device's with layers 3 and 4's (it holds both)
        rpc = [b["weight_bytes"] > 0 for b in res["tests"][0]["ext"]["backends"] if b["name"].startswith("RPC")]
        assert rpc == ([True, True] if placement["host_experts"] == "all" else [True, False]), res["tests"][0]["ext"]


@pytest.mark.parametrize("n_ubatch,logits", [(1, "all"), (8, "last")])
def test_small_batches_on_a_server_match_one_process(runner, two_patched_servers, assert_logits_match,
                                                     n_ubatch, logits):
    """Ubatches below op offload's minimum batch (decode): the server's device copies the used experts in, and the
    logits are the single-process baseline's, for every token's logits and for the last one's."""
    ctx = {"n_ctx": 256, "n_batch": 64, "n_ubatch": n_ubatch}
    remote = runner.logits("patched", devices=spec_of(two_patched_servers), placement={"host_experts": "all"},
                           n_tokens=24, ctx=ctx, logits=logits)
    local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=24, ctx=ctx,
                          logits=logits)
    assert host_buffers(remote), remote["schedule"]
    assert_logits_match(remote["logits"], local["logits"], f"ubatches of {n_ubatch} on two patched servers",
                        limit=1e-6)


def test_rpc_host_switch_keeps_experts_on_the_client(runner, two_patched_servers):
    res = runner.logits("patched", devices=spec_of(two_patched_servers), placement={"host_experts": "all"},
                        n_tokens=8, env={**os.environ, "GGML_SCHED_PP_RPC_HOST": "0"})
    assert host_buffers(res) == [], res["schedule"]["memory"]


def test_upstream_servers_keep_host_experts_on_the_client(runner, two_rpc_servers, assert_logits_match):
    """A patched client with upstream's servers (protocol 7.0): the experts stay in the client's RAM, as upstream
    keeps them, with the same logits."""
    remote = runner.logits("patched", devices=spec_of(two_rpc_servers), placement={"host_experts": "all"},
                           n_tokens=32)
    local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=32)
    assert host_buffers(remote) == [], remote["schedule"]["memory"]
    assert_logits_match(remote["logits"], local["logits"], "patched client, upstream servers", limit=1e-6)


def test_upstream_client_meets_a_patched_server_with_a_clear_error(runner, two_patched_servers):
    t0 = time.monotonic()
    with pytest.raises(DeviceSpecError, match=r"speaks another protocol .*7\.1.*--variant baseline"):
        runner.run("baseline", {"kind": "logits", "devices": spec_of(two_patched_servers[:1]), "n_tokens": 4},
                   cache=False)
    assert time.monotonic() - t0 < 20


def test_ab_gives_the_baseline_its_own_servers(tiny_model, tmp_path, two_patched_servers, two_rpc_servers):
    """An A/B over RPC: the patched build on the patched servers, the baseline on upstream's servers of the same
    hosts (baseline_devices); both rows measure and name the servers they ran on, only the patched one pipelines.
    Baseline servers that do not match the devices are refused before anything runs."""
    from pyllama_pp import runner as ab_runner
    from pyllama_pp.config import RunConfig
    from pyllama_pp.errors import ConfigError
    cfg = RunConfig(tiny_model, devices=spec_of(two_patched_servers), baseline_devices=spec_of(two_rpc_servers),
                    n_batch=128, n_ubatch=32, tests=[["pp", 128]], reps=1)
    assert cfg.job("baseline").devices == spec_of(two_rpc_servers) and cfg.job("patched").devices == cfg.devices
    df = ab_runner.ab([cfg], out_dir=tmp_path / "ab", progress=False)
    rows = {r["variant"]: r for r in df.to_dict("records")}
    assert set(rows) == {"baseline", "patched"} and not any(r["error"] for r in rows.values()), rows
    assert rows["patched"]["pipeline_parallel"] and not rows["baseline"]["pipeline_parallel"]
    assert rows["baseline"]["devices"] == spec_of(two_rpc_servers) and rows["patched"]["devices"] == cfg.devices
    assert all(r["avg_ts"] > 0 for r in rows.values())
    with pytest.raises(ConfigError, match="do not match"):
        RunConfig(tiny_model, devices=spec_of(two_patched_servers), baseline_devices=spec_of(two_rpc_servers[:1]))
    with pytest.raises(ConfigError, match="are for RPC devices"):
        RunConfig(tiny_model, devices="vdev:2x0@0", baseline_devices=spec_of(two_rpc_servers))


def test_check_runs_the_baseline_on_its_own_servers(tiny_model, two_patched_servers, two_rpc_servers, capsys):
    """`check --baseline-devices`: the patched build's RPC path (host experts in the servers' RAM) against upstream's
    servers of the same hosts, logits compared; servers that do not match the devices are refused before a worker."""
    from pyllama_pp import cli
    assert cli.main(["check", tiny_model, "--devices", spec_of(two_patched_servers), "--baseline-devices",
                     spec_of(two_rpc_servers), "-n", "64", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["patched_pipeline_parallel"] and not res["baseline_pipeline_parallel"], res
    assert res["baseline_devices"] == spec_of(two_rpc_servers), res
    assert cli.main(["check", tiny_model, "--devices", spec_of(two_patched_servers), "--baseline-devices",
                     spec_of(two_rpc_servers[:1])]) == 2
    assert "do not match" in capsys.readouterr().err


def test_a_server_on_a_busy_port_says_so_before_its_banner():
    """rpc-server on a port something else listens on: one error line, exit 2, and no "serving" / "Starting RPC
    server" banner before it."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "pyllama_pp.cli", "rpc-server", "--devices", "vdev:1x0@0",
                              "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{HOST}:{port}" in lines[0] and "--port" in lines[0], res.stderr


def test_network_bytes_per_token_are_counted_and_activations_only(runner, two_patched_servers):
    """Through a Link per host (a counting relay): with the experts on their servers, a prompt token costs fewer
    network bytes than with the experts in the client's RAM (RPC_HOST=0), where every layer's expert op runs on the
    client and its activations cross twice; both directions are counted."""
    per_token = {}
    for rpc_host in ("1", "0"):
        links = [Link(p) for p in two_patched_servers]
        try:
            spec = spec_of([x.port for x in links])
            env = {**os.environ, "GGML_SCHED_PP_RPC_HOST": rpc_host}
            counts = []
            for n in (32, 160):
                before = sum(x.bytes_up + x.bytes_down for x in links)
                runner.run("patched", {"kind": "logits", "devices": spec, "placement": {"host_experts": "all"},
                                       "n_tokens": n, "logits": "last"}, env=env, cache=False)
                counts.append(sum(x.bytes_up + x.bytes_down for x in links) - before)
                assert all(x.bytes_up > 0 and x.bytes_down > 0 for x in links)
            per_token[rpc_host] = (counts[1] - counts[0]) / 128
        finally:
            for x in links:
                x.close()
    assert 0 < per_token["1"] < per_token["0"], per_token


def test_multihost_bench_runs_a_short_ab(tmp_path):
    bench = Path(__file__).resolve().parents[1] / "bench" / "multihost_ab.py"
    out = tmp_path / "mh"
    proc = subprocess.run([sys.executable, str(bench), "-p", "128", "-n", "4", "-ub", "64", "--reps", "1",
                           "--rows", "patched,upstream,upstream-cpu", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["key"]: r for r in json.loads(proc.stdout)["rows"]}
    assert rows["patched"]["pipeline_parallel"] and not rows["upstream"]["pipeline_parallel"]
    assert rows["upstream"]["nmse_vs_first"] <= 1e-6
    assert rows["patched"]["host_expert_bytes_on_servers"] > 0 == rows["upstream"]["host_expert_bytes_on_servers"]
    # upstream's other placement: each server serves its CPU too, and the experts of its layers sit there
    cpu_row = rows["upstream-cpu"]
    assert not cpu_row["pipeline_parallel"] and cpu_row["nmse_vs_first"] <= 1e-6, cpu_row
    on_servers = rows["patched"]["host_expert_bytes_on_servers"]   # (the same experts: sizes up to alignment)
    assert abs(cpu_row["host_expert_bytes_on_servers"] - on_servers) < 0.01 * on_servers, cpu_row
    for r in rows.values():
        assert r["net_up_per_prompt_token"] > 0 and r["net_down_per_prompt_token"] > 0, r
    assert (out / "multihost.md").read_text().count("\n") == 5


def test_fit_across_hosts_plans_each_servers_copies(tiny_model, assert_logits_match, runner):
    """fit over two patched servers whose devices cannot hold every expert: a spread plan with host experts on both
    hosts, room kept on each device for its server's own expert copies, and a run from the plan that pipelines
    within the servers' memory (a device over its budget fails the server's allocation) with the baseline's logits."""
    for ports in servers("patched", 2, "vdev:1x5MiB@4GBps"):
        ctx = ContextParams(n_ctx=512, n_batch=256, n_ubatch=64)
        plan = fit(tiny_model, devices=spec_of(ports), ctx=ctx, margin=0, timeout=120)
        assert plan.path == "spread" and all(d.host_expert_layers > 0 for d in plan.devices), str(plan)
        assert "kept for its own expert copies" in plan.copies
        # each device knows its server, and the host memory that server reported free for host experts
        assert [d.server for d in plan.devices] == [f"{HOST}:{p}" for p in ports], str(plan)
        assert all(d.server_host_free > 0 for d in plan.devices) and "free host memory for its experts" in plan.copies
        res = runner.run("patched", {"kind": "logits", "plan": plan.to_dict(), "n_tokens": 256, "logits": "all"},
                         cache=False)
        assert res["schedule"]["pipeline_parallel"] and host_buffers(res), res["schedule"]
        local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=256,
                              ctx={"n_ctx": 512, "n_batch": 256, "n_ubatch": 64})
        assert_logits_match(res["logits"], local["logits"], "fit across two hosts vs one process", limit=1e-6)


def test_fit_measures_each_servers_network_and_counts_it(tiny_model):
    """fit measures the network to each server (through a Link pacing 0.02 GB/s each way): rates near the Link's
    and a round trip, in the plan and its text; --ubatch auto over that network predicts every candidate bound by
    it."""
    from pyllama_pp.fit import fit_ubatch
    from pyllama_pp.predict import predict
    from pyllama_pp.model_file import embedding_length
    for ports in servers("patched", 2):
        links = [Link(p, gbps=0.02) for p in ports]
        try:
            spec = spec_of([x.port for x in links])
            ctx = ContextParams(n_ctx=512, n_batch=128, n_ubatch=32)
            plan = fit_ubatch(tiny_model, devices=spec, ctx=ctx, candidates=(32, 64), count_compute=False,
                              timeout=120)
        finally:
            for x in links:
                x.close()
        for d in plan.devices:
            assert 0.01 < d.server_net["up_gbps"] < 0.024 and 0.01 < d.server_net["down_gbps"] < 0.024, d
            assert d.server_net["rtt_s"] > 0
        assert "network (measured)" in str(plan)
        tried = [c for c in plan.ubatch_auto if c.get("predicted_ts")]
        assert [c["n_ubatch"] for c in tried] == [32, 64] and all(c["bound"] == "network" for c in tried), tried
        # the plan's own prediction counts that network: without it (no hidden size) it predicts nothing, nothing
        # moving over the links of these unlimited devices
        assert predict(plan, 0, [55.0, 55.0], hidden=embedding_length(tiny_model)).bound == "network"
        assert predict(plan, 0, [55.0, 55.0]) is None


def test_a_servers_host_memory_limit_is_reported_planned_and_refused(tiny_model, runner):
    """rpc-server --host-ram: a patched server reports what its host buffers may still take; fit refuses a plan
    that keeps more host experts on a server than that, naming the server; a load past it is an OutOfMemoryError
    that says so; upstream's server refuses the option."""
    ctx = ContextParams(n_ctx=512, n_batch=256, n_ubatch=64)
    started = [start_server_with("patched", "vdev:1x5MiB@4GBps", host_ram="1MiB") for _ in range(2)]
    try:
        for port, proc in started:
            wait_listening(port, proc, HOST)
        spec = spec_of([p for p, _ in started])
        with pytest.raises(OutOfMemoryError, match=rf"RPC server at {HOST}:\d+ has 1\.0 MiB of host memory free"):
            fit(tiny_model, devices=spec, ctx=ctx, margin=0, timeout=120)
        with pytest.raises(OutOfMemoryError, match=r"RPC server's host memory cannot hold the host experts"):
            runner.run("patched", {"kind": "logits", "devices": spec, "placement": {"host_experts": "all"},
                                   "n_tokens": 8}, cache=False)
    finally:
        for _, proc in started:
            stop(proc)
    port, proc = start_server_with("baseline", "vdev:1x0@0", host_ram="1MiB")
    try:
        with pytest.raises(PyllamaError, match="--host-ram needs the patched variant"):
            wait_listening(port, proc, HOST, timeout=30)
    finally:
        stop(proc)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_server_that_fails_mid_run_ends_the_job_with_an_error(tiny_model, fault):
    """A host fails while the client computes on it: killed, the job ends with an error that names the RPC server
    seconds after the kill; stopped (it hangs, the socket stays open), the job's timeout ends the worker. Neither
    the worker nor the other server is left behind."""
    started = [start_server("patched") for _ in range(2)]
    try:
        for port, proc in started:
            wait_listening(port, proc, HOST)
        job = {"kind": "measure", "model": str(tiny_model), "devices": spec_of([p for p, _ in started]),
               "placement": {"host_experts": "all"}, "ctx": {"n_ctx": 1024, "n_batch": 512, "n_ubatch": 128},
               "tests": [["pp", 512]], "reps": 100000, "warmup": 1, "coverage": False}
        failed = []
        victim = started[1][1]
        act = victim.kill if fault == "killed" else (lambda: os.kill(victim.pid, signal.SIGSTOP))
        threading.Timer(3.0, lambda: (act(), failed.append(time.monotonic()))).start()
        with pytest.raises(WorkerError, match="RPC server" if fault == "killed" else "timed out"):
            run_job(job, "patched", timeout=120 if fault == "killed" else 10)
        assert failed and time.monotonic() - failed[0] < 20
    finally:
        for _, proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)
    assert all(proc.returncode is not None for _, proc in started)


def test_a_server_that_goes_away_mid_sweep_keeps_the_finished_rows_and_is_named(tiny_model, tmp_path, monkeypatch):
    """`run -ub 32,64,128` over two servers, one killed once the first config's rows are written: those rows stay,
    the later configs' error rows name the server that went away and what to do (not ggml-rpc's source line), and
    this process goes on."""
    from pyllama_pp import runner as ab_runner
    from pyllama_pp.config import RunConfig, expand
    from pyllama_pp.row import RowWriter
    started = [start_server("patched") for _ in range(2)]
    try:
        for port, proc in started:
            wait_listening(port, proc, HOST)
        victim_port, victim = started[1]
        real = RowWriter.write

        def write(self, rows):   # the first config's rows reach the disk, then its server dies
            real(self, rows)
            if victim.poll() is None:
                victim.kill()
                victim.wait(timeout=10)
        monkeypatch.setattr(RowWriter, "write", write)
        cfgs = expand(tiny_model, devices=[spec_of([p for p, _ in started])], n_batch=[512], n_ubatch=[32, 64, 128],
                      tests=[["pp", 256]], reps=1)
        assert len(cfgs) == 3 and all(isinstance(c, RunConfig) for c in cfgs)
        df = ab_runner.ab(cfgs, variants=["patched"], out_dir=tmp_path, progress=False, timeout=120)
    finally:
        for _, proc in started:
            stop(proc)
    rows = {r["n_ubatch"]: r for r in df.to_dict("records")}
    error = {ub: r["error"] if isinstance(r["error"], str) else "" for ub, r in rows.items()}
    assert not error[32] and rows[32]["avg_ts"] > 0, error[32]
    assert len(Path(tmp_path / "results.jsonl").read_text().splitlines()) == 3
    for ub in (64, 128):
        err = error[ub]
        assert f"127.0.0.1:{victim_port}" in err and "rpc-server" in err and "ggml-rpc.cpp" not in err, (ub, err)
        assert f"127.0.0.1:{started[0][0]}" not in err, err


def test_a_session_in_this_process_outlives_its_server(tiny_model):
    """A Session in the caller's own process whose patched server is killed between two decodes of a generation:
    the next call raises a DeviceError naming the server (ggml-rpc's dispatcher thread keeps the failed send for
    the waiting caller instead of aborting the process), so does every later call, and closing the session does
    not abort; this test finishing is the process living on."""
    port, proc = start_server("patched")
    try:
        wait_listening(port, proc, HOST)
        s = Session(tiny_model, devices=spec_of([port]), variant="patched", placement=Placement(host_experts="all"),
                    ctx=ContextParams(n_ctx=256, n_batch=64, n_ubatch=32))
        try:
            prompt = list(range(1, 33))
            first = s.eval(prompt, stats=False)
            assert first.logits.shape[0] == 1
            proc.kill()
            proc.wait(timeout=10)
            for call in (lambda: s.eval([int(first.logits[0].argmax())], pos0=32, clear=False, stats=False),
                         lambda: s.eval(prompt, stats=False)):   # the next token, then the prompt again
                with pytest.raises(DeviceError, match=f"lost the connection to {HOST}:{port}") as ei:
                    call()
                err = str(ei.value)
                assert "rpc-server" in err and "ggml-rpc.cpp" not in err and "\n" not in err, err
        finally:
            s.close()
    finally:
        stop(proc)


def test_local_and_remote_devices_in_one_spec(runner, two_patched_servers, assert_logits_match):
    """`vdev:...+rpc://...`: this machine's device holds the first layers, with their experts in this host's pinned
    RAM; the server's device the rest, with their experts in the server's RAM; pipelined, the baseline's logits."""
    spec = f"vdev:1x0@0+rpc://{HOST}:{two_patched_servers[0]}"
    res = runner.logits("patched", devices=spec, placement={"host_experts": "all"}, n_tokens=32)
    local = runner.logits("baseline", devices="vdev:2x0@0", placement={"host_experts": "none"}, n_tokens=32)
    mem = {m["buft"]: m["model_bytes"] for m in res["schedule"]["memory"]}
    assert host_buffers(res) == [f"RPC0[{HOST}:{two_patched_servers[0]}]_Host"], mem
    assert mem.get("VDEV_Host", 0) > 0, mem   # (the local layers' experts, pinned)
    assert res["schedule"]["pipeline_parallel"], res["schedule"]
    assert_logits_match(res["logits"], local["logits"], "a local VDEV and a server vs one process", limit=1e-6)


def test_one_device_of_a_server(runner, assert_logits_match):
    """`rpc://HOST:PORT/N` uses only the server's device N (here the second of two VDEVs); an N the server does not
    have is a DeviceSpecError that says which it has."""
    for (port,) in servers("patched", 1, "vdev:2x0@0"):
        res = runner.logits("patched", devices=f"rpc://{HOST}:{port}/1", placement={"host_experts": "all"},
                            n_tokens=32)
        names = [b["name"] for b in res["schedule"]["backends"] if b["name"] != "CPU"]
        assert names == [f"RPC1[{HOST}:{port}]"] and host_buffers(res) == [f"RPC1[{HOST}:{port}]_Host"], res["schedule"]
        local = runner.logits("baseline", devices="vdev:1x0@0", placement={"host_experts": "none"}, n_tokens=32)
        assert_logits_match(res["logits"], local["logits"], "a server's second device vs one VDEV", limit=1e-6)
        with pytest.raises(DeviceSpecError, match=r"offers 2 device\(s\) \(0..1\), not device 2"):
            runner.run("patched", {"kind": "logits", "devices": f"rpc://{HOST}:{port}/2", "n_tokens": 4}, cache=False)
