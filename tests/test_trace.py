"""The expert trace (pyllama_pp.trace, the "trace" job, native/trace.cpp, pyllama_pp.expert_trace): what the shim
records agrees with the coverage callback's count, both variants record the same ids, a locality model's stream
shows its locality in the trace, and bad input stops before a worker starts."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pyllama_pp import cli, synth
from pyllama_pp.expert_cache_sim import locality_summary
from pyllama_pp.expert_trace import ExpertTrace
from pyllama_pp.worker.handlers.base import random_tokens


@pytest.fixture(scope="module")
def locality_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("loc") / "tiny-loc.gguf"
    synth.write_gguf(path, synth.preset("tiny", seed=1, routing="locality"))
    return str(path)


def trace_job(runner, variant: str, model=None, **kw) -> dict:
    job = {"kind": "trace", "devices": "cpu", **kw}
    if model:
        job["model"] = model
    return runner.run(variant, job)


def test_the_prompt_trace_counts_what_coverage_counts(runner, tiny_info):
    """32 prompt tokens in one ubatch: the distinct ids the trace holds per layer are the coverage callback's count
    (the measure job's pp32 with the same seed decodes the same tokens)."""
    tr = trace_job(runner, "baseline", n_prompt=32, n_decode=0, seed=5)
    ids = np.array(tr["ids"])
    assert ids.shape == (32, tiny_info["n_layer"], tiny_info["n_expert_used"])
    assert tr["tokens"] == random_tokens(32, tiny_info["n_vocab"], 5).tolist()
    assert ((ids >= 0) & (ids < tiny_info["n_expert"])).all()
    assert all(len(set(row)) == len(row) for row in ids.reshape(-1, ids.shape[2]).tolist())   # top-k: distinct
    cov = runner.run("baseline", {"kind": "measure", "tests": [["pp", 32]], "reps": 1, "warmup": 0, "seed": 5,
                                  "ctx": {"n_ubatch": 32, "n_batch": 32}})["tests"][0]["coverage"]["per_layer_mean"]
    assert len(cov) >= tiny_info["n_layer"] - 1
    for layer, used in cov.items():
        col = tr["layers"].index(int(layer))
        assert len(np.unique(ids[:, col])) == used, layer


def test_both_variants_record_the_same_ids(runner):
    """A prompt in two ubatches, then decode: the baseline and the patched build route alike on the CPU."""
    kw = dict(n_prompt=40, n_decode=12, seed=2, ctx={"n_ubatch": 32, "n_batch": 64, "n_ctx": 256})
    b, p = trace_job(runner, "baseline", **kw), trace_job(runner, "patched", **kw)
    assert b["layers"] == p["layers"] == list(range(len(b["layers"])))
    assert np.array_equal(np.array(b["ids"]), np.array(p["ids"]))
    assert b["n_prompt"] == 40 and len(b["ids"]) == 52


def test_a_locality_model_is_fed_a_stream_and_shows_locality(runner, locality_model):
    """The bench's token choice: consecutive ids for a locality model, random ones otherwise; its consecutive tokens
    share more experts than far-apart ones, and more than the uniform model's do."""
    loc = trace_job(runner, "patched", model=locality_model, n_decode=96, seed=3)
    uni = trace_job(runner, "patched", n_decode=96, seed=3)
    toks = np.array(loc["tokens"])
    assert loc["routing"] == "locality" and uni["routing"] == "uniform"
    assert (np.diff(toks) == 1).all()
    assert np.any(np.diff(np.array(uni["tokens"])) != 1)
    s_loc = locality_summary(ExpertTrace(loc["ids"], loc["layers"], loc["n_expert"]))
    s_uni = locality_summary(ExpertTrace(uni["ids"], uni["layers"], uni["n_expert"]))
    assert s_loc["overlap_lag1"] > 2 * s_loc["overlap_random"], s_loc
    assert s_loc["overlap_lag1"] > s_uni["overlap_lag1"] + 0.15, (s_loc, s_uni)


def test_measure_feeds_a_locality_model_a_stream(runner, locality_model):
    """A decode test's coverage on a locality model: consecutive ids use fewer experts per prompt ubatch than the
    uniform model's random tokens (the stream reaches the measure job)."""
    job = {"kind": "measure", "tests": [["pp", 32]], "reps": 1, "warmup": 0, "seed": 1,
           "ctx": {"n_ubatch": 32, "n_batch": 32}}
    loc = runner.run("baseline", {**job, "model": locality_model})["tests"][0]["coverage"]
    uni = runner.run("baseline", job)["tests"][0]["coverage"]
    assert loc["experts_used_per_layer_ubatch"] < 0.8 * uni["experts_used_per_layer_ubatch"], (loc, uni)


def test_cli_trace_writes_the_npz(tmp_path, capsys, tiny_model):
    out = tmp_path / "t.npz"
    assert cli.main(["trace", tiny_model, "-p", "8", "-n", "8", "-o", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    tr = ExpertTrace.load(out)
    assert tr.ids.shape == (16, doc["moe_layers"], doc["k"]) and tr.n_prompt == 8 and doc["tokens"] == 16
    assert tr.meta["model"] == tiny_model and len(tr.meta["tokens"]) == 16
    assert doc["out"] == str(out) and 0.0 <= doc["lru_0.25"] <= 1.0


@pytest.mark.parametrize("argv, says", [
    (["-n", "0"], "not both 0"),
    (["-n", "-3"], ">= 0"),
    (["-n", "8", "-o", "t.parquet"], ".npz"),
    (["-n", "8", "-o", "/nonexistent/dir/t.npz"], "does not exist"),
])
def test_bad_input_stops_before_a_worker(usage_error, no_worker, tiny_model, argv, says):
    assert says in usage_error(["trace", tiny_model, *argv])


def test_records_are_put_in_place():
    """Two ubatches of a 2-layer model (layers 1 and 3), records in compute order."""
    flat = np.arange(2 * 3 * 2 + 2 * 1 * 2, dtype=np.int32) % 7
    recs = [(1, 3, 2, 0), (3, 3, 2, 6), (1, 1, 2, 12), (3, 1, 2, 14)]
    tr = ExpertTrace.from_records(recs, flat, 4, 8, n_prompt=3)
    assert tr.layers.tolist() == [1, 3]
    assert tr.ids[:3, 0].ravel().tolist() == flat[0:6].tolist()
    assert tr.ids[:3, 1].ravel().tolist() == flat[6:12].tolist()
    assert tr.ids[3].tolist() == [flat[12:14].tolist(), flat[14:16].tolist()]
    with pytest.raises(ValueError, match="lacks token 3"):
        ExpertTrace.from_records(recs[:3], flat, 4, 8)


def test_save_and_load(tmp_path):
    tr = ExpertTrace(np.array([[[1, 2]], [[2, 3]]]), [4], 8, 1, {"seed": 3})
    tr.save(tmp_path / "x.npz")
    back = ExpertTrace.load(tmp_path / "x.npz")
    assert np.array_equal(back.ids, tr.ids) and back.layers.tolist() == [4] and back.n_prompt == 1
    assert back.meta == {"seed": 3} and back.n_expert == 8
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(ValueError, match="not an expert trace"):
        ExpertTrace.load(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="out of range"):
        ExpertTrace(np.array([[[9]]]), [0], 8)


def test_captured_hidden_states_are_the_graph_s(tiny_model, tiny_cfg):
    """trace.record(capture=...): each named tensor lands per token and layer, n_embd wide, every one recorded, and
    they are the graph's: ffn_norm-L is rms_norm(ffn_inp-L) times layer L's norm weight (the ones of the synth), and
    ffn_inp-L is l_out-(L-1) plus attention (not a copy of it)."""
    from pyllama_pp import trace
    tr = trace.record(tiny_model, n_prompt=8, n_decode=6, seed=4, capture=("ffn_inp", "l_out", "ffn_norm"))
    assert set(tr.tensors) == {"ffn_inp", "l_out", "ffn_norm"}
    for x in tr.tensors.values():
        assert x.shape == (14, tiny_cfg.n_layer, tiny_cfg.n_embd) and np.isfinite(x).all()
    inp, norm = tr.tensors["ffn_inp"], tr.tensors["ffn_norm"]
    rms = inp / np.sqrt(np.mean(inp.astype(np.float64) ** 2, axis=2, keepdims=True) + 1e-6)
    assert np.allclose(norm, rms, rtol=1e-4, atol=1e-5)
    assert not np.allclose(inp[:, 1:], tr.tensors["l_out"][:, :-1])


def test_a_capture_without_its_file_is_refused():
    """The trace job writes captured tensors to capture_out: a job that captures without one is a ConfigError."""
    from pyllama_pp.errors import ConfigError
    from pyllama_pp.jobs import TraceJob
    with pytest.raises(ConfigError, match="capture_out"):
        TraceJob(variant="patched", model="m.gguf", n_prompt=0, n_decode=4, capture=["l_out"]).check()
