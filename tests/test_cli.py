"""`pyllama-pp` with bad input: one line on stderr that says what is wrong and how to fix it, a non-zero exit, and
no worker started where the problem can be seen up front."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_pp import ConfigError, model_file, worker
from pyllama_pp.params import ContextParams, Placement


def test_missing_folder_and_non_gguf_models(usage_error, no_worker, tmp_path):
    assert "model file not found" in usage_error(["run", str(tmp_path / "none.gguf")])
    assert "is a folder, not a model file" in usage_error(["run", str(tmp_path)])
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert "not a GGUF file" in usage_error(["ab", str(text)])


@pytest.mark.parametrize("argv,words", [
    (["-b", "-5"], "-b/--batch takes whole numbers >= 1, got -5"),
    (["-ub", "0"], "-ub/--ubatch takes whole numbers >= 1, got 0"),
    (["-ub", "512", "-b", "64"], "larger than n_batch"),
    (["-p", "-3"], "-p/--pp"),
    (["-p", "0", "-n", "0"], "nothing to measure"),
    (["-n", "-3"], "-n/--tg"),
    (["-c", "-1"], "-c/--ctx"),
    (["-ngl", "-7"], "-ngl"),
    (["-ts", "0,0"], "-ts"),
    (["--host-experts", "lots"], "host_experts must be 'all', 'none', a count or a list of layers, not 'lots'"),
    (["--devices", "vdev:bogus"], "bad device spec 'vdev:bogus'"),
    (["--variant", "baseline", "--switch", "NOSUCH=1"], "--variant baseline has none"),
])
def test_bad_run_options_are_refused_before_a_worker_starts(usage_error, no_worker, tiny_model, argv, words):
    line = usage_error(["run", tiny_model, *argv])
    assert words in line, line


def test_synth_families_and_expert_types(usage_error, no_worker, tmp_path, capsys):
    """synth writes the new families with the experts' type of the preset or of --expert-type, and says what to change
    when the experts' rows do not fit the type's blocks."""
    import json
    from pyllama_pp import cli
    for preset, etype, want in (("gptoss-tiny", None, "MXFP4"), ("deepseek2-tiny", "bf16", "BF16"),
                                ("tiny", "mxfp4", "MXFP4")):
        out = tmp_path / f"{preset}.gguf"
        argv = ["synth", str(out), "--preset", preset, "--n-layer", "2", "--json"]
        assert cli.main(argv + (["--expert-type", etype] if etype else [])) == 0
        s = json.loads(capsys.readouterr().out)
        t = {x["name"]: x["type_name"] for x in model_file.read_gguf_header(out)["tensors"]}
        assert s["expert_type"] == want.lower() and t["blk.1.ffn_down_exps.weight"] == want, (preset, s)
    line = usage_error(["synth", str(tmp_path / "q.gguf"), "--preset", "tiny", "--expert-type", "q4_k"])
    assert "Q4_K needs row lengths that are multiples of 256" in line and "expert_type one of" in line, line
    assert not (tmp_path / "q.gguf").exists()


def test_bad_ab_options_write_no_files(usage_error, no_worker, tiny_model, tmp_path):
    out = tmp_path / "out"
    assert "-b/--batch" in usage_error(["ab", tiny_model, "-b", "-5", "-o", str(out)])
    assert not out.exists(), "an A/B run that measured nothing left files behind"


@pytest.mark.parametrize("argv,words", [
    (["--baseline-devices", "rpc://127.0.0.1:1"], "are for RPC devices"),
    (["--devices", "rpc://127.0.0.1:1,127.0.0.1:2", "--baseline-devices", "rpc://127.0.0.1:3"],
     "do not match"),
    (["--devices", "rpc://127.0.0.1:1", "--baseline-devices", "rpc://127.0.0.1:3;rpc://127.0.0.1:4"],
     "--baseline-devices gives 2 spec(s) and --devices 1"),
])
def test_baseline_devices_that_do_not_match_are_refused(usage_error, no_worker, tiny_model, argv, words):
    line = usage_error(["ab", tiny_model, "-ngl", "-1", "--host-experts", "all", *argv])
    assert words in line, line


def test_unknown_switch_names_its_near_misses(usage_error, tiny_model):
    """The patched build's own table decides (one info job, no measurement)."""
    line = usage_error(["run", tiny_model, "--switch", "UPLOAD_AL=0"])
    assert "no such switch" in line and "UPLOAD_ALL" in line and "pyllama-pp info" in line, line


def test_switch_value_out_of_range_is_refused(usage_error, tiny_model):
    """The patched build's table gives each switch its range: a value outside it is refused up front."""
    line = usage_error(["run", tiny_model, "--switch", "OVERLAP=1"])
    assert "OVERLAP=1" in line and "out of range" in line and "0, 2" in line, line


def test_worker_errors_keep_their_class_and_one_line(tiny_model, tmp_path):
    """An error raised inside a worker reaches the caller as the same class (and WorkerError), one statement."""
    from pyllama_pp import ModelError, WorkerError
    with pytest.raises(ModelError) as ei:
        worker.run_job({"kind": "schedule", "model": str(tmp_path / "gone.gguf")}, "baseline", timeout=120)
    e = ei.value
    assert isinstance(e, WorkerError) and e.exit_code == 3 and e.error_type == "ModelError"
    assert str(e).startswith("model file not found") and "\n" not in str(e), str(e)


def test_context_and_placement_params_are_checked_when_made():
    for kwargs, words in (({"n_ubatch": -1}, "n_ubatch must be between 1"), ({"n_batch": 0}, "n_batch"),
                          ({"n_ctx": 2**40}, "n_ctx must be between 0"), ({"n_batch": 64, "n_ubatch": 128},
                                                                         "cannot exceed n_batch"),
                          ({"n_threads": 1.5}, "whole number")):
        with pytest.raises(ConfigError, match=words):
            ContextParams(**kwargs)
    for kwargs in ({"host_experts": "lots"}, {"host_experts": -2}, {"load_mode": "swap"}, {"split_mode": "diag"}):
        with pytest.raises(ConfigError):
            Placement(**kwargs)
    assert ContextParams(n_batch=64, n_ubatch=64).n_ubatch == 64 and Placement(host_experts="3").host_experts == 3


def test_console_script_reports_a_usage_error_in_one_line(tmp_path):
    """End to end through the installed `pyllama-pp` script: exit 2, one line on stderr, nothing on stdout."""
    exe = shutil.which("pyllama-pp") or str(Path(sys.executable).with_name("pyllama-pp"))
    res = subprocess.run([exe, "run", str(tmp_path / "none.gguf")], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ), cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip().count("\n") == 0 and "model file not found" in res.stderr, res.stderr


def _script() -> str:
    return shutil.which("pyllama-pp") or str(Path(sys.executable).with_name("pyllama-pp"))


def _json_run(args: list[str], cwd: Path) -> dict:
    import json
    res = subprocess.run([_script(), *args, "--json"], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert res.returncode == 0, (args, res.returncode, res.stderr[-2000:])
    return json.loads(res.stdout)


def test_every_subcommand_end_to_end_through_the_console_script(tmp_path):
    """info, synth, run and ab as a user runs them: the installed script, --json, a model it wrote itself."""
    info = _json_run(["info"], tmp_path)
    assert {v["name"] for v in info["variants"] if v["built"]} == {"baseline", "patched"}
    assert info["upstream"]["commit"] and info["variants"][1]["switches"], info["upstream"]

    model = tmp_path / "t.gguf"
    s = _json_run(["synth", str(model), "--preset", "tiny", "--n-layer", "3", "--seed", "5"], tmp_path)
    assert model.stat().st_size == s["bytes"] > 0 and s["n_tensors"] > 0

    common = ["--devices", "vdev:2x0@0", "-p", "64", "-n", "4", "-b", "64", "-ub", "32", "-r", "1"]
    run = _json_run(["run", str(model), "--variant", "baseline", *common], tmp_path)["rows"]
    assert {r["test"] for r in run} == {"pp64", "tg4"} and all(r["avg_ts"] > 0 for r in run), run
    assert all(r["variant"] == "baseline" and not r.get("error") for r in run)

    out = tmp_path / "ab"
    ab = _json_run(["ab", str(model), *common, "-o", str(out)], tmp_path)
    rows = ab["rows"]
    assert {(r["variant"], r["test"]) for r in rows} == {(v, t) for v in ("baseline", "patched") for t in ("pp64", "tg4")}
    assert all(r["speedup"] > 0 for r in rows if r["variant"] == "patched"), rows
    for kind in ("jsonl", "csv", "markdown", "plot"):
        assert Path(ab["files"][kind]).is_file(), (kind, ab["files"])


def test_a_closed_pipe_ends_quietly():
    """`pyllama-pp info | head -1`: the reader went away; no "Broken pipe" error, the exit status of a process that
    a closed pipe ended (128 + SIGPIPE), as a shell reports one."""
    r, w = os.pipe()
    os.close(r)
    try:
        res = subprocess.run([sys.executable, "-m", "pyllama_pp.cli", "info"], stdout=w, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(w)
    assert res.stderr == "" and res.returncode == 128 + 13, (res.returncode, res.stderr)


def test_vdevs_without_a_rate_say_their_links_are_unthrottled(capsys, tiny_model):
    """`vdev:2x64MiB` (no @RATE): accepted, with a note that its links are unthrottled (as @0)."""
    from pyllama_pp.planning import Choices, plan_runs
    notes = plan_runs(Choices(command="run", model=tiny_model, devices=("vdev:2x64MiB",))).notes
    assert any("vdev:2x64MiB" in n and "unthrottled" in n and "@0" in n for n in notes), notes
    assert not any("unthrottled" in n for n in plan_runs(Choices(command="run", model=tiny_model,
                                                                 devices=("vdev:2x64MiB@4GBps",))).notes)
    from pyllama_pp import cli
    assert cli.main(["fit", tiny_model, "--devices", "vdev:2x64MiB", "-c", "256"]) == 0
    assert "note: vdev:2x64MiB" in capsys.readouterr().err
