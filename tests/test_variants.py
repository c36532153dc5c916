"""Both variants in worker processes: info, CPU numerics, and errors that must come back as exceptions."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import pyllama_pp
from pyllama_pp import VariantError, WorkerError
from pyllama_pp.worker import run_job

JOB_TIMEOUT = 120.0

VARIANTS = ("baseline", "patched")
# the patched build's switch table, in order (one off-switch per mechanism and the tuning knobs)
SWITCH_NAMES = ["GATE", "OWNER_OFFLOAD", "EARLY_INPUTS", "UPLOAD_ALL", "UPLOAD_ALL_MIN", "UPLOAD_ALL_MIN_COV", "LINKS",
                "STAGING", "STABLE_RESERVE", "DIRECT", "OVERLAP", "GATHER", "PREFETCH", "PREFETCH2_MIN_TOKENS", "RPC_HOST",
                "EXPERT_CACHE", "EXPERT_CACHE_MIN_HIT", "EXPERT_HYBRID", "EXPERT_REFILL",
                "LAYER_MAJOR"]


def _worker_error(runner, variant: str, job: dict) -> str:
    with pytest.raises(WorkerError) as ei:
        runner.run(variant, job, cache=False)
    e = ei.value
    msg = f"{e.error_type}: {e} (exit code {e.exit_code})"
    assert "killed by signal" not in msg and "timed out" not in msg, f"the worker crashed:\n{msg}"
    # exit code 3: a PyllamaError with its message; 4 would be an unexpected exception (a bug)
    assert "(exit code 3)" in msg, f"not a clean error:\n{msg}"
    # the parent raises the worker's own class (ModelError, ...) too, with the worker's one-line message
    assert type(e).__name__ == e.error_type and isinstance(e, getattr(pyllama_pp.errors, e.error_type)), type(e).__mro__
    assert "\n" not in str(e) and "stderr" not in str(e), f"not one statement: {str(e)!r}"
    return msg


def test_available_variants():
    assert set(pyllama_pp.available_variants()) == set(VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_info(variant):
    info = run_job({"kind": "info"}, variant, timeout=JOB_TIMEOUT)
    assert info["variant"] == variant
    if variant == "patched":
        assert info["ext_version"] >= 1
        # the typed switch table (patch 0001; each mechanism's patch adds its rows): one off-switch per mechanism
        # and the tuning knobs, each with type, default, range, meaning and current value (the default here)
        sw = {s["name"]: s for s in info["switches"]}
        assert list(sw) == SWITCH_NAMES, list(sw)
        for s in sw.values():
            assert s["type"] in ("bool", "int", "ints") and s["meaning"] and s["min"] <= s["default"] <= s["max"], s
            assert s["value"] == s["default"], s
            assert s["type"] != "bool" or (s["min"], s["max"]) == (0, 1), s
            assert not s["values"] or s["default"] in s["values"], s
        # the defaults README and docs/DEVELOPING.md state
        documented = {"GATE": 1, "OVERLAP": 2, "DIRECT": -1, "GATHER": -1, "PREFETCH": 1, "PREFETCH2_MIN_TOKENS": 1024,
                      "STAGING": 1, "LINKS": 0, "UPLOAD_ALL_MIN": -1, "UPLOAD_ALL_MIN_COV": -1, "LAYER_MAJOR": 0}
        assert {k: sw[k]["value"] for k in documented} == documented
        assert sw["OVERLAP"]["values"] == [0, 2] and sw["DIRECT"]["values"] == [-1, 0, 2]
    else:
        assert info["ext_version"] == 0 and info["switches"] == []
    assert any(d["backend"] == "CPU" for d in info["devices"]), info["devices"]


def test_unknown_variant_in_process():
    # load() checks the name before it loads anything, so this is safe in the test process
    with pytest.raises(VariantError) as ei:
        pyllama_pp.load("nope")
    assert "'nope'" in str(ei.value) and "baseline" in str(ei.value) and "patched" in str(ei.value)


def test_unknown_variant_in_worker(runner):
    msg = _worker_error(runner, "nope", {"kind": "info"})
    assert "VariantError" in msg and "nope" in msg


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_model_info_and_finite_logits(runner, variant, tiny_cfg):
    r = runner.logits(variant, devices="cpu", n_tokens=16, ctx={"n_ctx": 64, "n_batch": 16, "n_ubatch": 16})
    lg = r["logits"]
    model = r["schedule"]  # schedule facts come back too
    assert model["variant"] == variant
    assert lg.shape == (16, tiny_cfg.n_vocab), lg.shape
    assert lg.dtype == np.float32
    assert np.all(np.isfinite(lg)), "non-finite logits"
    assert float(lg.std()) > 0.1, "logits are (nearly) constant: the model did not run"
    assert not np.allclose(lg[0], lg[-1]), "different tokens give the same logits"


def test_model_info(tiny_info, tiny_cfg):
    assert tiny_info["arch"] == "qwen3moe"
    assert tiny_info["n_layer"] == tiny_cfg.n_layer
    assert tiny_info["n_vocab"] == tiny_cfg.n_vocab
    assert tiny_info["n_expert"] == tiny_cfg.n_expert
    assert tiny_info["n_expert_used"] == tiny_cfg.n_expert_used


@pytest.mark.parametrize("n_ubatch", [16, 64])
def test_cpu_logits_identical_between_variants(runner, n_ubatch, assert_logits_match):
    ctx = {"n_ctx": 256, "n_batch": 128, "n_ubatch": n_ubatch}
    a = runner.logits("baseline", devices="cpu", ctx=ctx, n_tokens=96)["logits"]
    b = runner.logits("patched", devices="cpu", ctx=ctx, n_tokens=96)["logits"]
    assert_logits_match(b, a, f"CPU patched vs baseline, n_ubatch {n_ubatch}")


def test_same_job_is_deterministic(runner):
    ctx = {"n_ctx": 128, "n_batch": 32, "n_ubatch": 32}
    a = runner.logits("baseline", ctx=ctx, n_tokens=32, seed=3)["logits"]
    b = runner.run("baseline", {"kind": "logits", "devices": "cpu", "ctx": ctx, "n_tokens": 32, "seed": 3,
                                "logits": "all"}, cache=False)["logits"]
    c = runner.logits("baseline", ctx=ctx, n_tokens=32, seed=4)["logits"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c), "another token seed gives the same logits"


@pytest.mark.parametrize("variant", VARIANTS)
def test_missing_model_is_a_model_error(runner, variant, tmp_path):
    missing = tmp_path / "missing.gguf"
    msg = _worker_error(runner, variant, {"kind": "schedule", "model": str(missing)})
    assert "ModelError" in msg and str(missing) in msg and "not found" in msg, msg
    assert "exit code 3" in msg, f"an expected error should be a clean exit (3), not a bug report:\n{msg}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_gguf_file_is_a_model_error(runner, variant, tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n")
    msg = _worker_error(runner, variant, {"kind": "schedule", "model": str(p)})
    assert "ModelError" in msg and "GGUF" in msg, msg
    assert "exit code 3" in msg, msg


@pytest.mark.parametrize("variant", VARIANTS)
def test_truncated_gguf_is_a_model_error(runner, tiny_model, variant, tmp_path):
    """A file with the GGUF magic whose tensor data is cut off is a broken model, not a memory problem."""
    p = tmp_path / "truncated.gguf"
    with open(tiny_model, "rb") as f:
        p.write_bytes(f.read(3_000_000))
    msg = _worker_error(runner, variant, {"kind": "schedule", "model": str(p), "devices": "cpu"})
    assert "exit code 3" in msg, msg
    assert "ModelError" in msg, f"a truncated GGUF was reported as something else:\n{msg.splitlines()[0]}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_of_range_token_is_a_decode_error(runner, variant, tiny_info):
    n_vocab = tiny_info["n_vocab"]
    for bad in (n_vocab + 5, n_vocab, -1):
        msg = _worker_error(runner, variant, {"kind": "logits", "devices": "cpu", "tokens": [1, 2, bad],
                                              "ctx": {"n_ctx": 64, "n_batch": 16, "n_ubatch": 16},
                                              "out": "/nonexistent/never-written.npy"})
        assert "DecodeError" in msg and str(bad) in msg and "index 2" in msg, msg
        assert "exit code 3" in msg, msg
    # and the largest valid token decodes
    r = runner.logits(variant, tokens=[0, n_vocab - 1], ctx={"n_ctx": 64, "n_batch": 16, "n_ubatch": 16})
    assert r["logits"].shape == (2, n_vocab) and np.all(np.isfinite(r["logits"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_too_many_tokens_for_the_context(runner, variant):
    msg = _worker_error(runner, variant, {"kind": "logits", "devices": "cpu", "n_tokens": 40,
                                          "ctx": {"n_ctx": 32, "n_batch": 32, "n_ubatch": 32},
                                          "out": "/nonexistent/never-written.npy"})
    assert "DecodeError" in msg and "n_ctx" in msg, msg


def test_switches_need_the_patched_build(runner):
    msg = _worker_error(runner, "baseline", {"kind": "schedule", "devices": "cpu",
                                             "switches": {"UPLOAD_ALL": 0}})
    assert "UnsupportedError" in msg and "UPLOAD_ALL" in msg, msg


def test_unknown_switch_is_refused(runner):
    """ggml_backend_sched_pp_set_param with a name the table does not know returns an error: a ConfigError."""
    msg = _worker_error(runner, "patched", {"kind": "schedule", "devices": "cpu", "switches": {"BOGUS": 1}})
    assert msg.startswith("ConfigError") and "BOGUS" in msg, msg


def test_switch_value_out_of_range_is_refused(runner):
    """set_param with a value the switch does not accept (OVERLAP's retired ring, 1) is an error naming the range."""
    msg = _worker_error(runner, "patched", {"kind": "schedule", "devices": "cpu", "switches": {"OVERLAP": 1}})
    assert msg.startswith("ConfigError") and "OVERLAP=1" in msg and "0,2" in msg, msg
    msg = _worker_error(runner, "patched", {"kind": "schedule", "devices": "cpu", "switches": {"UPLOAD_ALL_MIN_COV": 101}})
    assert msg.startswith("ConfigError") and "UPLOAD_ALL_MIN_COV=101" in msg and "-1..100" in msg, msg


@pytest.mark.parametrize("env, words", [({"GGML_SCHED_PP_BOGUS": "1"}, ["GGML_SCHED_PP_BOGUS=1", "no such switch", "OVERLAP"]),
                                        ({"GGML_SCHED_PP_OVRELAP": "2"}, ["GGML_SCHED_PP_OVRELAP=2", "no such switch"]),
                                        ({"GGML_SCHED_PP_TRANSIENT": "0"}, ["GGML_SCHED_PP_TRANSIENT=0", "no such switch"]),
                                        ({"GGML_SCHED_PP_OVERLAP": "1"}, ["GGML_SCHED_PP_OVERLAP=1", "out of range", "0,2"]),
                                        ({"GGML_SCHED_PP_GATE": "2"}, ["GGML_SCHED_PP_GATE=2", "out of range", "0 or 1"]),
                                        ({"GGML_SCHED_PP_UPLOAD_ALL": "yes"}, ["GGML_SCHED_PP_UPLOAD_ALL=yes", "not an integer"])],
                         ids=["unknown", "misspelled", "retired", "out-of-range", "bool", "not-an-integer"])
def test_switch_environment_problems_are_config_errors(runner, env, words):
    """A GGML_SCHED_PP_* variable the patched build's table does not accept (a name it does not know, a value out
    of range or not an integer) is a ConfigError at Session creation that names the variable and what is accepted
    (the library alone would log it and use the default)."""
    with pytest.raises(WorkerError) as ei:
        runner.run("patched", {"kind": "schedule", "devices": "cpu"}, env=env, cache=False)
    msg = str(ei.value)
    assert ei.value.error_type == "ConfigError", (ei.value.error_type, msg)
    for w in words:
        assert w in msg, (w, msg)


def test_the_baseline_reads_no_switches(runner):
    """The baseline has no switch table: GGML_SCHED_PP_* variables are not read there (the CLI refuses --switch
    for a baseline-only run)."""
    r = runner.run("baseline", {"kind": "schedule", "devices": "cpu"}, env={"GGML_SCHED_PP_BOGUS": "1"}, cache=False)
    assert r["schedule"]["n_splits"] >= 1


def test_readme_switch_section_is_the_librarys_table():
    """The README's switch section is generated from the patched library's table (pyllama-pp info
    --markdown-switches): they agree."""
    from pyllama_pp.about import switches_markdown
    info = run_job({"kind": "info"}, "patched", timeout=JOB_TIMEOUT)
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"<!-- switches:begin -->\n(.*?)\n<!-- switches:end -->", text, re.S)
    assert m, "README.md has no <!-- switches:begin --> ... <!-- switches:end --> section"
    assert m.group(1).strip() == switches_markdown(info["switches"]).strip(), \
        "README's switch section is stale: regenerate it with `pyllama-pp info --markdown-switches`"


def test_malformed_jobs_are_refused_before_a_worker_starts(runner):
    """The job contract (pyllama_pp.jobs): an unknown kind or a misspelled field is a ConfigError in the parent."""
    from pyllama_pp import ConfigError
    with pytest.raises(ConfigError, match="unknown job kind 'frobnicate'"):
        runner.run("baseline", {"kind": "frobnicate"}, cache=False)
    with pytest.raises(ConfigError, match="a logits job has no field.*n_token\\b"):
        runner.run("baseline", {"kind": "logits", "n_token": 4}, cache=False)
    with pytest.raises(ConfigError, match="n_ubatch"):
        runner.run("baseline", {"kind": "schedule", "ctx": {"n_ubatch": -1}}, cache=False)
    # the switches field is `switches`: the old name is a misspelled field like any other
    with pytest.raises(ConfigError, match="a schedule job has no field.*ext_params"):
        runner.run("patched", {"kind": "schedule", "ext_params": {"OVERLAP": 0}}, cache=False)


def test_worker_survives_errors(runner, tmp_path):
    """After failed jobs, the next job in a fresh worker runs normally."""
    _worker_error(runner, "patched", {"kind": "schedule", "model": str(tmp_path / "missing.gguf")})
    r = runner.run("patched", {"kind": "schedule", "devices": "cpu"}, cache=False)
    assert r["schedule"]["variant"] == "patched"


def test_small_preset_loads_and_decodes(tmp_path):
    """The 'small' preset (~260 MB) loads and decodes with finite logits (the tiny one is covered above)."""
    from pyllama_pp import synth
    from pyllama_pp.worker import run_job

    path = tmp_path / "small.gguf"
    summary = synth.write_gguf(path, synth.preset("small", seed=3))
    assert 100e6 <= summary["bytes"] <= 300e6
    out = tmp_path / "small.npy"
    res = run_job({"kind": "logits", "model": str(path), "devices": "cpu", "ctx": {"n_ctx": 64, "n_batch": 16,
                   "n_ubatch": 16}, "n_tokens": 8, "logits": "all", "out": str(out)}, "patched", timeout=300)
    logits = np.load(out)
    assert logits.shape == (8, synth.preset("small").n_vocab) and res["shape"] == [8, logits.shape[1]]
    assert np.isfinite(logits).all() and logits.std() > 0
