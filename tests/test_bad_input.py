"""Bad input that tests/test_cli.py does not cover (docs/RESULTS.md "Bad input and faults" lists every bad input with the
test that checks it): output paths, argparse's own refusals (unknown choices), switch syntax, a
context too small for the tests, CUDA without a CUDA build, two variants in one process, an empty token list."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from pyllama_pp import DecodeError, DeviceSpecError, cli, runner, worker
from pyllama_pp.binding import backend_modules
from pyllama_pp.servers.serve import free_port


def _argparse_error(capsys, argv: list[str]) -> str:
    """argparse's own refusal: exit 2 and one 'error:' line that points to --help (not the whole usage block);
    under --json the same as one JSON document on stdout."""
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and ": error: " in lines[0] and "--help" in lines[0], err
    with pytest.raises(SystemExit):
        cli.main(argv + ["--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["type"] == "UsageError" and out["error"] in lines[0], (out, lines)
    return lines[0]


def test_output_paths(usage_error, no_worker, tiny_model, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    assert "-o/--out" in usage_error(["run", tiny_model, "-o", str(f)]) and "is a file" in \
        usage_error(["ab", tiny_model, "-o", str(f)])
    assert "the folder" in usage_error(["synth", str(tmp_path / "none" / "m.gguf")])
    assert "it is a folder" in usage_error(["synth", str(tmp_path)])


@pytest.mark.parametrize("argv,words", [
    (["run", "{m}", "--variant", "bogus"], "invalid choice: 'bogus'"),
    (["fit", "{m}", "--split-mode", "diag"], "invalid choice: 'diag'"),
    (["run", "{m}", "-b", "x"], "expected comma-separated integers, got 'x'"),
    (["run", "{m}", "-r", "0"], "expected a whole number of at least 1"),
    (["synth", "x.gguf", "--preset", "huge"], "invalid choice: 'huge'"),
])
def test_argparse_refusals(capsys, no_worker, tiny_model, argv, words):
    line = _argparse_error(capsys, [a.format(m=tiny_model) for a in argv])
    assert words in line, line


@pytest.mark.parametrize("argv,words", [
    (["--switch", "UPLOAD_ALL"], "--switch takes NAME=VALUE"),
    (["--switch", "UPLOAD_ALL=yes"], "the value must be an integer"),
    (["-d", "-1"], "-d/--n-depth takes whole numbers >= 0, got -1"),
    (["-c", "64", "-p", "512"], "-c/--ctx 64 is too small for the tests: the longest needs 520 positions"),
])
def test_bad_options_refused_up_front(usage_error, no_worker, tiny_model, argv, words):
    line = usage_error(["run", tiny_model, *argv])
    assert words in line, line


@pytest.mark.parametrize("argv,words", [
    (["ab", "{m}", "--devices", "vdev:2x0@0", "-ts", "1,2,3"], "-ts gives 3 proportions and --devices vdev:2x0@0 has 2"),
    (["ab", "{m}", "--devices", "vdev:2x0@0", "--host-experts", "99"], "the model has 6 layers (0..5)"),
    (["run", "{m}", "--host-experts", "2,7"], "the first 7 layers, and the model has 6 layers"),
    (["ab", "--plan", "{m}"], "is not a plan (a binary file, not JSON text)"),
    (["fit", "{m}", "--devices", "vdev:2x8MiB@1GBps", "--margin", "-1MiB"], "margin -1MiB: a margin is memory"),
    (["run", "{m}", "-ub", "-3"], "-ub/--ubatch takes whole numbers >= 1, got -3"),
])
def test_bad_values_named(usage_error, no_worker, tiny_model, argv, words):
    """Each bad value is refused before any worker, with the option and the fix (not a codec error, not 'expected
    one argument', not a run that records it as given)."""
    line = usage_error([a.format(m=tiny_model) for a in argv])
    assert words in line, line


@pytest.mark.parametrize("argv", [
    ["run", "{m}", "--devices", "{spec}"],
    ["ab", "{m}", "--devices", "{spec}", "-o", "{tmp}/o"],
    ["ab", "{m}", "--devices", "{spec}", "--baseline-devices", "{spec}", "--paired", "2"],
    ["check", "{m}", "--devices", "{spec}"],
    ["fit", "{m}", "--devices", "{spec}"],
])
def test_an_rpc_server_that_cannot_be_reached_is_one_line_before_any_worker(usage_error, no_worker, tiny_model,
                                                                            tmp_path, monkeypatch, argv):
    """A wrong port among the servers: one line naming it and the fix, exit 2, no worker, no rows, no folder."""
    def refuse(*a, **k):
        raise AssertionError("a measuring worker was started")
    monkeypatch.setattr(runner, "run_job", refuse)
    monkeypatch.setattr(worker.ServingWorker, "start", refuse)
    with socket.socket() as listening:   # (one server that answers, one port where nothing listens)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        good, wrong = listening.getsockname()[1], free_port()
        spec = f"rpc://127.0.0.1:{good},127.0.0.1:{wrong}"
        line = usage_error([a.format(m=tiny_model, spec=spec, tmp=tmp_path) for a in argv])
    assert f"cannot reach the RPC server at 127.0.0.1:{wrong}" in line and "rpc-server" in line, line
    assert f"server at 127.0.0.1:{good}" not in line and not (tmp_path / "o").exists()


def test_misspelled_switch_in_the_environment(usage_error, capsys, tiny_model, tmp_path, monkeypatch):
    """A GGML_SCHED_PP_* name the patched table does not know stops `ab` before any measurement (no rows, exit
    2), and `info` shows it."""
    monkeypatch.setenv("GGML_SCHED_PP_UPLOAD_AL", "0")
    line = usage_error(["ab", tiny_model, "--devices", "vdev:2x0@0", "-p", "32", "-n", "0", "-o", str(tmp_path / "o")])
    assert "GGML_SCHED_PP_UPLOAD_AL=0: no such switch" in line, line
    assert not (tmp_path / "o" / "results.jsonl").exists()
    assert cli.main(["info", "--json"]) == 0
    patched = [v for v in json.loads(capsys.readouterr().out)["variants"] if v["name"] == "patched"][0]
    assert any("GGML_SCHED_PP_UPLOAD_AL" in p for p in patched["env_problems"]), patched.get("env_problems")


@pytest.mark.skipif("CUDA" in backend_modules(), reason="this build has a CUDA backend")
def test_cuda_devices_without_a_cuda_build(usage_error, no_worker, tiny_model):
    line = usage_error(["run", tiny_model, "--devices", "cuda:0,1"])
    assert "this build has no CUDA backend" in line, line


@pytest.mark.skipif("CUDA" in backend_modules(), reason="this build has a CUDA backend")
def test_cuda_devices_in_a_worker_without_cuda(tiny_model):
    with pytest.raises(DeviceSpecError) as ei:
        worker.run_job({"kind": "schedule", "model": tiny_model, "devices": "cuda"}, "baseline", timeout=120)
    assert ei.value.exit_code == 3 and "no CUDA device found" in str(ei.value), str(ei.value)


def test_second_variant_in_one_process():
    code = ("import pyllama_pp as p\np.load('baseline')\ntry:\n    p.load('patched')\n"
            "except p.VariantError as e:\n    print(str(e))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "already loaded the 'baseline' variant" in res.stdout, (res.stdout, res.stderr)


def test_empty_token_list_is_a_decode_error(tiny_model):
    with pytest.raises(DecodeError) as ei:
        worker.run_job({"kind": "logits", "model": tiny_model, "devices": "cpu", "n_tokens": 0,
                        "ctx": {"n_ctx": 64, "n_batch": 32, "n_ubatch": 32}, "out": "/nonexistent/x.npy"},
                       "baseline", timeout=120)
    assert ei.value.exit_code == 3 and "non-empty" in str(ei.value), str(ei.value)
