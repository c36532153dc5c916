"""Faults: VDEV's injected ones (an allocation or a host<->device copy that fails), a worker killed from outside,
Ctrl-C during `pyllama-pp ab`, and resuming a sweep. Each ends in a clear error, never a hang or a leftover worker,
and every row measured before it stays on disk."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pyllama_pp import DeviceError, DeviceSpecError, OutOfMemoryError, WorkerError, cli, devices, runner, worker
from pyllama_pp.config import RunConfig
from pyllama_pp.params import Placement

TIMEOUT = 120
CTX = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 32}


def _spec(fault: str = "", n: int = 2) -> str:
    return f"vdev:{n}x0@0" + (f",{fault}" if fault else "")


def _cfg(model: str, devs: str, **kw) -> RunConfig:
    return RunConfig(model=model, devices=devs, n_batch=64, n_ubatch=32, tests=[["pp", 32]], reps=1,
                     placement=Placement(host_experts="all"), **kw)


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]


def _alive(pid: int) -> bool:
    """Does a process with this pid exist (a zombie counts: nobody reaped it)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _workers_of(parent: int) -> list[int]:
    """Worker processes (python -m pyllama_pp.worker) whose parent is `parent`, from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"pyllama_pp.worker" in cmd:
            out.append(int(d))
    return out


# -- the device spec -------------------------------------------------------------------------------------------
def test_fault_options_in_device_specs():
    s = devices.parse("vdev:2x0@0,fail_alloc_after=3,fail_copy_after=0")
    assert [(v.fail_alloc_after, v.fail_copy_after) for v in s.vdevs] == [(3, 0), (3, 0)]
    s = devices.parse({"kind": "vdev", "devices": [{"fail_copy_after": 7, "fault_abort": True}, {}]})
    assert [(v.fail_alloc_after, v.fail_copy_after, v.fault_abort) for v in s.vdevs] == [(-1, 7, True), (-1, -1, False)]
    assert all(v.fault_abort for v in devices.parse("vdev:2x0@0,fail_copy_after=2,abort").vdevs)
    for bad in ("vdev:2x0@0,abort=1", '{"kind": "vdev", "devices": [{"fault_abort": 1}]}'):
        with pytest.raises(DeviceSpecError, match="abort"):
            devices.parse(bad)
    for bad in ("vdev:2x0@0,fail_alloc_after=-2", "vdev:2x0@0,fail_copy_after=1.5", "vdev:2x0@0,fail_alloc_after",
                '{"kind": "vdev", "devices": [{"fail_copy_after": "often"}]}'):
        with pytest.raises(DeviceSpecError, match="fail_(alloc|copy)_after|unknown option"):
            devices.parse(bad)


# -- injected faults, one worker each ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_allocation_that_fails_at_load_is_an_out_of_memory_error(tiny_model, variant):
    with pytest.raises(OutOfMemoryError) as ei:
        worker.run_job({"kind": "schedule", "model": tiny_model, "devices": _spec("fail_alloc_after=0"), "ctx": CTX,
                        "placement": {"host_experts": "all"}}, variant, timeout=TIMEOUT)
    e = ei.value
    assert isinstance(e, WorkerError) and e.exit_code == 3, (e.exit_code, str(e))
    assert "could not load" in str(e) and "injected fault: allocation #1" in str(e) and "\n" not in str(e), str(e)


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_copy_that_fails_at_load_or_mid_run_is_a_device_error(tiny_model, variant):
    """The first copy (at load, on VDEV's stream: reported at the next synchronize), one in the middle of a run and
    the last one (the logits' way back) all end in a DeviceError: ggml cannot return a failed copy, the shim turns
    its abort into one."""
    job = {"kind": "logits", "model": tiny_model, "ctx": CTX, "placement": {"host_experts": "all"}, "n_tokens": 32,
           "out": os.devnull}
    ok = worker.run_job({**job, "devices": _spec()}, variant, timeout=TIMEOUT)
    last = ok["counters"]["devices"][1]["hd_copies"]       # copies device 1 made in the whole run
    assert last > 10, ok["counters"]
    mid = ok["counters"]["devices"][0]["hd_copies"] // 2
    for dev, n, where in ((1, 0, "could not load"), (1, last - 1, ""), (0, mid, "")):
        spec = {"kind": "vdev", "devices": [{}, {}]}
        spec["devices"][dev]["fail_copy_after"] = n
        with pytest.raises(DeviceError) as ei:
            worker.run_job({**job, "devices": spec}, variant, timeout=TIMEOUT)
        e = ei.value
        assert e.exit_code == 3 and f"VDEV{dev}: injected fault: " in str(e) and f"copy #{n + 1} " in str(e), str(e)
        assert where in str(e) and "\n" not in str(e) and "ggml abort: /" not in str(e), str(e)


_GO_ON = """
import sys, numpy as np, pyllama_pp as pp
model, variant = sys.argv[1], sys.argv[2]
def session(fault=None):
    spec = {"kind": "vdev", "devices": [{}, {"fail_copy_after": fault} if fault is not None else {}]}
    return pp.Session(model, devices=spec, variant=variant, placement=pp.Placement(host_experts="all"),
                      ctx=pp.ContextParams(n_ctx=256, n_batch=64, n_ubatch=32))
toks = list(range(1, 33))
s = session()
ref = s.eval(toks, logits="all").logits
last = s.device_counters()[1]["hd_copies"]       # device 1's copies: load and one eval
s.close()
# (the counts run from the devices' registration, once per process): the same load and eval again, its last copy
# fails - the logits' way back, on the device's stream
s = session(fault=2 * last - 1)
try:
    s.eval(toks, logits="all")
    raise SystemExit("no error")
except pp.DeviceError as e:
    assert "a VDEV stream job failed" in str(e), str(e)
again = s.eval(toks, logits="all").logits         # the same session goes on, and computes for real
s.close()
print("same" if np.array_equal(ref, again) else "different")
"""


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_a_session_goes_on_after_a_device_error(tiny_model, variant):
    """A failed stream job is reported once; the stream then runs again (its stale jobs skipped), so the next eval
    of the same session gives the logits of a run without the fault, and closing the session does not abort."""
    res = subprocess.run([sys.executable, "-c", _GO_ON, tiny_model, variant], capture_output=True, text=True,
                         timeout=TIMEOUT, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert res.returncode == 0 and res.stdout.strip() == "same", (res.returncode, res.stdout, res.stderr[-2000:])


def test_faults_in_a_sweep_keep_the_rows_measured_before(tiny_model, tmp_path):
    """A/B sweep: config 1 fails to load (an allocation), config 2 loses a copy; the others are measured, every
    row is on disk, and no worker is left."""
    cfgs = [_cfg(tiny_model, _spec()), _cfg(tiny_model, _spec("fail_alloc_after=0")),
            _cfg(tiny_model, _spec("fail_copy_after=0")), _cfg(tiny_model, "vdev:2x0@0,threads=1")]
    out = tmp_path / "ab"
    df = runner.ab(cfgs, out_dir=out, progress=False, timeout=TIMEOUT)
    rows = _rows(out)
    assert len(rows) == len(df) == 2 * len(cfgs)
    by = {(r["config"], r["variant"]): r for r in rows}
    for v in ("baseline", "patched"):
        for ci in (0, 3):
            assert not by[ci, v].get("error") and by[ci, v]["avg_ts"] > 0, by[ci, v]
        assert by[1, v]["error"].startswith("OutOfMemoryError: llama.cpp could not load"), by[1, v]["error"]
        assert by[2, v]["error"].startswith("DeviceError: ") and "injected fault" in by[2, v]["error"], by[2, v]
    assert not _workers_of(os.getpid())


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_allocation_that_fails_mid_sweep(tiny_model, tmp_path, variant):
    """Two configs in one worker (one model load, two contexts): device 0's allocations after those of the first
    config fail, so the second config's context cannot be made. The first config's rows are measured and on disk."""
    probe = worker.run_job(_cfg(tiny_model, _spec()).job(variant, coverage=True), variant, timeout=TIMEOUT)
    k = probe["tests"][0]["devices"][0]["buffer_allocs"]   # device 0's buffers once the first config has run
    spec = json.dumps({"kind": "vdev", "devices": [{"fail_alloc_after": k}, {}]})
    cfgs = [_cfg(tiny_model, spec), RunConfig(model=tiny_model, devices=spec, n_batch=128, n_ubatch=64,
                                              tests=[["pp", 64]], reps=1, placement=Placement(host_experts="all"))]
    out = tmp_path / "ab"
    runner.ab(cfgs, variants=[variant], out_dir=out, progress=False, timeout=TIMEOUT)
    first, second = _rows(out)
    assert not first.get("error") and first["avg_ts"] > 0, first
    assert second["error"].startswith("OutOfMemoryError: llama.cpp could not create the context"), second
    m = re.search(r"injected fault: allocation #(\d+),", second["error"])
    assert m and int(m.group(1)) > k, second["error"]   # (the message is the last try's: the old context's again)


def test_a_copy_fault_that_aborts_kills_the_worker_and_the_sweep_goes_on(tiny_model, tmp_path, capsys):
    """`abort`: the failed copy calls abort() past the shim's callback, as where nothing can catch ggml's abort. The
    worker dies by SIGABRT; its rows are error rows with its last words, and the next config is measured."""
    out = tmp_path / "ab"
    runner.ab([_cfg(tiny_model, _spec("fail_copy_after=0,abort")), _cfg(tiny_model, _spec())], out_dir=out,
             progress=True, timeout=TIMEOUT)
    rows = _rows(out)
    assert len(rows) == 4
    for r in rows[:2]:
        assert r["error"].startswith(f"WorkerError: {r['variant']} worker died (killed by signal SIGABRT) without a "
                                     "result; its last words: pyllama_pp vdev VDEV0: injected fault: host->device "
                                     "copy #1 "), r["error"]
    assert all(not r.get("error") and r["avg_ts"] > 0 for r in rows[2:]), rows[2:]
    assert "killed by signal SIGABRT" in capsys.readouterr().err and not _workers_of(os.getpid())


# -- a worker killed from outside, Ctrl-C ------------------------------------------------------------------------
def test_a_worker_killed_mid_sweep_becomes_an_error_row_and_the_sweep_goes_on(tiny_model, tmp_path, capsys):
    killed: list[int] = []

    def killer():
        end = time.time() + 60
        while not killed and time.time() < end:
            for pid in _workers_of(os.getpid()):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.002)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    out = tmp_path / "ab"
    runner.ab([_cfg(tiny_model, "cpu"), _cfg(tiny_model, _spec())], out_dir=out, progress=True, timeout=TIMEOUT)
    t.join()
    rows = _rows(out)
    assert killed and not _alive(killed[0])
    assert len(rows) == 4
    first = rows[0]
    assert first["config"] == 0 and first["variant"] == "baseline", first
    assert first["error"].startswith("WorkerError: baseline worker died (killed by signal SIGKILL)"), first["error"]
    assert all(not r.get("error") and r["avg_ts"] > 0 for r in rows[1:]), rows
    assert "carrying on" in capsys.readouterr().err


def test_ctrl_c_during_ab_exits_130_keeps_rows_and_leaves_no_worker(tiny_model, tmp_path):
    """SIGINT to the whole process group, as a terminal's Ctrl-C: exit 130, one message that says where the rows
    are and how to go on, every finished row on disk, and the worker that was running is gone."""
    out = tmp_path / "ab"
    argv = [sys.executable, "-m", "pyllama_pp.cli", "ab", tiny_model, "--devices", "cpu;vdev:2x0@0;vdev:3x0@0",
            "-p", "512", "-n", "0", "-r", "10", "-o", str(out)]   # (long enough to be cut: about 1 s a run)
    # (a pytest-xdist worker ignores SIGINT, and an ignored signal stays ignored across exec: the CLI gets the
    # default disposition back, as it has when a user starts it from a terminal)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: set[int] = set()
    try:
        end = time.time() + 60
        while time.time() < end and proc.poll() is None:   # a row on disk and a worker at work
            workers = _workers_of(proc.pid)
            seen.update(workers)
            if workers and (out / "results.jsonl").exists() and (out / "results.jsonl").stat().st_size:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err, err
    rows = _rows(out)
    assert rows and all(not r.get("error") for r in rows), rows
    assert seen and not any(_alive(p) for p in seen), [p for p in seen if _alive(p)]


def test_a_worker_dies_with_its_parent(tiny_model):
    """A caller killed outright (SIGKILL: no cleanup of its own runs) takes its worker with it (PR_SET_PDEATHSIG)."""
    code = ("import sys\nfrom pyllama_pp.worker import run_job\n"
            "run_job({'kind': 'measure', 'model': sys.argv[1], 'tests': [['pp', 512]], 'reps': 500}, 'baseline')\n")
    parent = subprocess.Popen([sys.executable, "-c", code, tiny_model])
    try:
        end = time.time() + 60
        while not (workers := _workers_of(parent.pid)) and time.time() < end:
            time.sleep(0.01)
        assert workers, "no worker started"
        parent.kill()
        parent.wait()
        end = time.time() + 20
        while time.time() < end and _running(workers[0]):
            time.sleep(0.01)
        assert not _running(workers[0]), "the worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for PID 1, which in a container may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- resume ------------------------------------------------------------------------------------------------------
def _counting(monkeypatch, stop_at: int = 0, fail_first: bool = False) -> list:
    """The runner's worker jobs, counted: the call number `stop_at` raises KeyboardInterrupt (Ctrl-C) instead."""
    calls: list = []
    real = worker.ServingWorker.run

    def run(self, job, timeout=None):
        calls.append((job.devices, self.variant))
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        if fail_first and len(calls) == 1:
            raise WorkerError("baseline worker died (killed by signal SIGKILL) without a result")
        return real(self, job, timeout=timeout)

    monkeypatch.setattr(runner.ServingWorker, "run", run)
    return calls


def test_ab_resume_measures_only_what_is_missing(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ab"
    argv = ["ab", tiny_model, "--devices", "cpu;vdev:2x0@0", "-p", "32", "-n", "0", "-r", "1", "-o", str(out)]
    calls = _counting(monkeypatch, stop_at=3)          # Ctrl-C as the second config's first worker starts
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "the 2 rows measured so far" in err and f"pyllama-pp ab --resume {out}" in err, err
    assert len(_rows(out)) == 2
    calls = _counting(monkeypatch)
    assert cli.main(["ab", "--resume", str(out)]) == 0, capsys.readouterr()
    assert calls == [("vdev:2x0@0", "baseline"), ("vdev:2x0@0", "patched")], calls   # config 0 not started again
    rows = _rows(out)
    keys = [(r["config_key"], r["variant"], r["test"]) for r in rows]
    assert len(rows) == 4 and len(set(keys)) == 4 and all(not r.get("error") for r in rows), rows
    assert {r["devices"] for r in rows} == {"cpu", "vdev:2x0@0"}
    assert len((out / "results.csv").read_text().splitlines()) == 5
    md = (out / "results.md").read_text()
    assert "| cpu |" in md and "| vdev:2x0@0 |" in md and (out / "ab.png").exists()
    # nothing left to do: no worker at all
    capsys.readouterr()
    calls = _counting(monkeypatch)
    assert cli.main(["ab", "--resume", str(out), "--json"]) == 0 and calls == []
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 4 and len(_rows(out)) == 4


def test_resume_measures_error_rows_again(tiny_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _counting(monkeypatch, fail_first=True)
    assert cli.main(["run", tiny_model, "--variant", "baseline", "--devices", "cpu;vdev:2x0@0", "-p", "32", "-n", "0",
                     "-r", "1", "-o", str(out)]) == 1
    assert [bool(r.get("error")) for r in _rows(out)] == [True, False]
    calls = _counting(monkeypatch)
    assert cli.main(["run", "--resume", str(out)]) == 0, capsys.readouterr()
    assert calls == [("cpu", "baseline")]
    rows = _rows(out)
    assert len(rows) == 2 and all(not r.get("error") for r in rows) and rows[0]["devices"] == "cpu", rows


def test_resume_of_a_sweep_with_a_relative_model_path_reuses_every_row(tiny_model, tmp_path, monkeypatch):
    """The README's sweep (`ab tiny.gguf ... -o sweep`, a relative path), resumed from the folder it ran in and from
    another: nothing is measured again and no row is there twice (what a config measures does not depend on how its
    model's path was written)."""
    (tmp_path / "tiny.gguf").symlink_to(tiny_model)
    monkeypatch.chdir(tmp_path)
    argv = ["ab", "tiny.gguf", "--devices", "vdev:2x0@0", "-ub", "16,32", "-b", "64", "-p", "32", "-n", "0", "-r", "1",
            "-o", "sweep"]
    assert cli.main(argv) == 0
    first = (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()
    assert len(first) == 4
    for cwd in (tmp_path, tmp_path / "sweep"):
        monkeypatch.chdir(cwd)
        assert cli.main(["ab", "--resume", str(tmp_path / "sweep")]) == 0
        again = (tmp_path / "sweep" / "results.jsonl").read_text().splitlines()
        assert sorted(again) == sorted(first), "rows measured again or written twice"
    monkeypatch.chdir(tmp_path)
    assert runner.config_key(RunConfig("tiny.gguf")) == runner.config_key(RunConfig(str(tmp_path / "tiny.gguf")))


@pytest.mark.parametrize("argv,words", [
    (["ab", "--resume", "{tmp}/none"], "no such folder"),
    (["ab", "--resume", "{tmp}"], "has no sweep.json"),
    (["run", "--resume", "{tmp}/done", "-b", "64"], "drop --batch"),
    (["ab", "--resume", "{tmp}/done", "{model}"], "drop MODEL"),
    (["run"], "run needs a MODEL"),
])
def test_bad_resume_options(capsys, tmp_path, tiny_model, argv, words, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(runner, "run_job", refuse)
    monkeypatch.setattr(runner.ServingWorker, "start", refuse)
    (tmp_path / "done").mkdir()
    runner.save_sweep(tmp_path / "done", [_cfg(tiny_model, "cpu")], ["baseline"])
    argv = [a.format(tmp=tmp_path, model=tiny_model) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("pyllama-pp: error: ") and words in err, err
