"""Tests for pyllama_pp.synth (synthetic qwen3moe GGUF writer). CPU only, a few seconds."""

import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    from pyllama_pp import model_file, synth
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pyllama_pp import model_file, synth

LAYER_TENSORS = {
    # name: (shape as a function of cfg, F32 always?)
    "attn_norm": (lambda c: [c.n_embd], True),
    "attn_q": (lambda c: [c.n_embd, c.n_head * c.head_dim], False),
    "attn_k": (lambda c: [c.n_embd, c.n_head_kv * c.head_dim], False),
    "attn_v": (lambda c: [c.n_embd, c.n_head_kv * c.head_dim], False),
    "attn_output": (lambda c: [c.n_head * c.head_dim, c.n_embd], False),
    "attn_q_norm": (lambda c: [c.head_dim], True),
    "attn_k_norm": (lambda c: [c.head_dim], True),
    "ffn_norm": (lambda c: [c.n_embd], True),
    "ffn_gate_inp": (lambda c: [c.n_embd, c.n_expert], True),
    "ffn_gate_exps": (lambda c: [c.n_embd, c.n_ff_exp, c.n_expert], False),
    "ffn_up_exps": (lambda c: [c.n_embd, c.n_ff_exp, c.n_expert], False),
    "ffn_down_exps": (lambda c: [c.n_ff_exp, c.n_embd, c.n_expert], False),
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_bytes(path, info):
    with open(path, "rb") as f:
        f.seek(info["file_offset"])
        return f.read(info["nbytes"])


def dequant(path, info):
    raw = np.frombuffer(tensor_bytes(path, info), dtype=np.uint8)
    if info["type_name"] == "F32":
        a = raw.view("<f4").astype(np.float64)
    elif info["type_name"] == "F16":
        a = raw.view("<f2").astype(np.float64)
    else:
        assert info["type_name"] == "Q8_0"
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view("<f2").astype(np.float64)
        a = (b[:, 2:].view(np.int8).astype(np.float64) * d).ravel()
    return a.reshape(info["shape"][::-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = synth.preset("tiny")
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    summary = synth.write_gguf(path, cfg)
    return cfg, path, summary, model_file.read_gguf_header(path)


def test_presets_build_configs():
    assert set(synth.PRESETS) >= {"tiny", "small", "qwen3-30b-a3b"}
    for name in synth.PRESETS:
        cfg = synth.preset(name)
        assert cfg.preset == name
        assert cfg.validate() is cfg
    tiny = synth.preset("tiny")
    assert tiny.n_layer >= 6 and tiny.n_expert == 64 and tiny.n_expert_used == 2
    assert 8e6 <= synth.estimate_file_bytes(tiny) <= 14e6
    assert 100e6 <= synth.estimate_file_bytes(synth.preset("small")) <= 300e6
    big = synth.preset("qwen3-30b-a3b")
    assert (big.n_layer, big.n_embd, big.n_head, big.n_head_kv, big.head_dim) == (48, 2048, 32, 4, 128)
    assert (big.n_expert, big.n_expert_used, big.n_ff_exp, big.n_vocab) == (128, 8, 768, 32768)
    assert abs(synth.expert_bytes_per_layer(big) / 1e9 - 0.64) < 0.01
    assert 29.0 <= synth.estimate_file_bytes(big) / 2**30 <= 30.5
    # overrides; presets themselves are not modified
    cfg = synth.preset("tiny", seed=7, type="f16", n_layer=3, routing="skewed", skew=1.0)
    assert (cfg.seed, cfg.type, cfg.n_layer, cfg.routing, cfg.skew) == (7, "f16", 3, "skewed", 1.0)
    assert synth.PRESETS["tiny"].seed == 0 and synth.PRESETS["tiny"].n_layer == tiny.n_layer


def test_unknown_preset_and_bad_config():
    with pytest.raises(ValueError) as e:
        synth.preset("huge")
    for name in ("tiny", "small", "qwen3-30b-a3b"):
        assert name in str(e.value)
    with pytest.raises(ValueError):
        synth.preset("tiny", no_such_field=1)
    with pytest.raises(ValueError):
        synth.preset("tiny", n_embd=100)  # Q8_0 rows must be multiples of 32
    synth.preset("tiny", n_embd=100, type="f16")  # fine for F16
    with pytest.raises(ValueError):
        synth.preset("tiny", n_expert_used=65)
    with pytest.raises(ValueError):
        synth.preset("tiny", routing="random")
    with pytest.raises(ValueError):
        synth.preset("tiny", n_head_kv=3)


def test_tiny_file(tiny):
    cfg, path, summary, h = tiny
    size = os.path.getsize(path)
    assert size == summary["bytes"] == synth.estimate_file_bytes(cfg) == h["file_size"]
    assert 8e6 <= size <= 14e6
    assert summary["n_tensors"] == 3 + 12 * cfg.n_layer == h["n_tensors"] == len(h["tensors"])
    assert summary["expert_bytes_per_layer"] == synth.expert_bytes_per_layer(cfg)
    assert summary["seconds"] > 0

    kv = h["kv"]
    assert h["version"] == 3 and h["alignment"] == 32 and h["data_offset"] % 32 == 0
    assert kv["general.architecture"] == "qwen3moe"
    assert kv["general.file_type"] == 7
    a = "qwen3moe."
    expect = {
        "block_count": cfg.n_layer, "context_length": cfg.n_ctx_train, "embedding_length": cfg.n_embd,
        "attention.head_count": cfg.n_head, "attention.head_count_kv": cfg.n_head_kv,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "expert_count": cfg.n_expert, "expert_used_count": cfg.n_expert_used,
        "expert_feed_forward_length": cfg.n_ff_exp,
    }
    for k, v in expect.items():
        assert kv[a + k] == v, k
        assert h["kv_types"][a + k] == 4, k  # uint32, as llama.cpp's loader requires
    for k in ("attention.layer_norm_rms_epsilon", "rope.freq_base"):
        assert h["kv_types"][a + k] == 6  # float32
    assert a + "feed_forward_length" in kv
    assert kv["tokenizer.ggml.model"] == "test"
    toks = kv["tokenizer.ggml.tokens"]
    assert len(toks) == cfg.n_vocab and len(set(toks)) == cfg.n_vocab and all(toks)
    assert kv["pyllama_pp.synth.preset"] == "tiny"
    assert kv["pyllama_pp.synth.routing"] == "uniform"
    assert kv["pyllama_pp.synth.seed"] == 0
    assert kv["pyllama_pp.synth.n_expert"] == cfg.n_expert

    t = {x["name"]: x for x in h["tensors"]}
    for name, shape, f32 in [("token_embd.weight", [cfg.n_embd, cfg.n_vocab], False),
                             ("output.weight", [cfg.n_embd, cfg.n_vocab], False),
                             ("output_norm.weight", [cfg.n_embd], True)]:
        assert t[name]["shape"] == shape
        assert t[name]["type_name"] == ("F32" if f32 else "Q8_0")
    for i in range(cfg.n_layer):
        for short, (shape_of, f32) in LAYER_TENSORS.items():
            info = t[f"blk.{i}.{short}.weight"]
            assert info["shape"] == shape_of(cfg), info["name"]
            assert info["type_name"] == ("F32" if f32 else "Q8_0"), info["name"]
    assert len(t) == len(h["tensors"])
    for info in h["tensors"]:
        assert info["offset"] % 32 == 0 and info["file_offset"] % 32 == 0
    exps = sum(t[f"blk.0.ffn_{w}_exps.weight"]["nbytes"] for w in ("gate", "up", "down"))
    assert exps == synth.expert_bytes_per_layer(cfg)
    last = h["tensors"][-1]
    assert size == last["file_offset"] + -(-last["nbytes"] // 32) * 32


def test_tiny_weights_scales_and_routing(tiny):
    cfg, path, _, h = tiny
    t = {x["name"]: x for x in h["tensors"]}
    emb = dequant(path, t["token_embd.weight"])
    assert abs(emb.std() - 1.0) < 0.1  # uniform routing: embeddings at scale 1.0
    assert abs(dequant(path, t["blk.0.attn_output.weight"]).std() - 5e-4) < 1e-4
    assert abs(dequant(path, t["blk.0.ffn_down_exps.weight"]).std() - 5e-4) < 1e-4
    assert np.all(dequant(path, t["output_norm.weight"]) == 1.0)
    router = dequant(path, t["blk.0.ffn_gate_inp.weight"])  # [n_expert, n_embd]
    norms = np.linalg.norm(router, axis=1)
    assert np.allclose(norms, norms[0], rtol=1e-5)

    # layer-0 routing of 32 random tokens (the residual is ~ the embedding): about 40 of 64 used
    def used(router, toks):
        x = emb[toks]
        x = x / np.sqrt((x * x).mean(1, keepdims=True))
        sel = np.argsort(-(x @ router.T), axis=1)[:, : cfg.n_expert_used]
        return len(np.unique(sel))

    toks = np.random.default_rng(3).integers(0, cfg.n_vocab, 32)
    n_uniform = [used(dequant(path, t[f"blk.{i}.ffn_gate_inp.weight"]), toks) for i in range(cfg.n_layer)]
    assert 30 <= np.mean(n_uniform) <= 48, n_uniform
    logits = emb[toks] @ dequant(path, t["output.weight"]).T
    assert np.isfinite(logits).all()


def test_skewed_router_profile(tmp_path):
    cfg = synth.preset("tiny", routing="skewed", skew=1.5, n_layer=2, n_vocab=256)
    path = tmp_path / "skewed.gguf"
    synth.write_gguf(path, cfg)
    h = model_file.read_gguf_header(path)
    assert h["kv"]["pyllama_pp.synth.routing"] == "skewed"
    assert abs(h["kv"]["pyllama_pp.synth.skew"] - 1.5) < 1e-6
    t = {x["name"]: x for x in h["tensors"]}
    r0 = dequant(path, t["blk.0.ffn_gate_inp.weight"])
    r1 = dequant(path, t["blk.1.ffn_gate_inp.weight"])
    norms = np.sort(np.linalg.norm(r0, axis=1))[::-1]
    want = (np.arange(cfg.n_expert) + 1.0) ** -1.5
    assert np.allclose(norms / norms[0], want, rtol=1e-4)
    # favoured experts differ between layers
    assert not np.array_equal(np.argsort(np.linalg.norm(r0, axis=1)), np.argsort(np.linalg.norm(r1, axis=1)))
    # fewer experts win than with uniform routing
    emb = dequant(path, t["token_embd.weight"])
    x = emb[np.random.default_rng(3).integers(0, cfg.n_vocab, 32)]
    sel = np.argsort(-(x @ r0.T), axis=1)[:, :2]
    assert len(np.unique(sel)) < 30


def test_natural_scales(tmp_path):
    cfg = synth.preset("tiny", routing="natural", n_layer=1, n_vocab=256)
    s = cfg.resolved_scales()
    assert s["embd_scale"] == 0.02
    assert abs(s["attn_out_scale"] - 1 / np.sqrt(cfg.n_head * cfg.head_dim)) < 1e-12
    assert synth.preset("tiny", routing="natural", embd_scale=0.5).resolved_scales()["embd_scale"] == 0.5


def test_determinism(tmp_path, tiny):
    cfg, path, _, _ = tiny
    again = tmp_path / "again.gguf"
    synth.write_gguf(again, synth.preset("tiny"))
    assert sha256(again) == sha256(path)
    other = tmp_path / "other.gguf"
    synth.write_gguf(other, synth.preset("tiny", seed=1))
    assert os.path.getsize(other) == os.path.getsize(path)
    assert sha256(other) != sha256(path)
    h0, h1 = model_file.read_gguf_header(path), model_file.read_gguf_header(other)
    name = "blk.0.ffn_up_exps.weight"
    i0 = next(x for x in h0["tensors"] if x["name"] == name)
    i1 = next(x for x in h1["tensors"] if x["name"] == name)
    assert tensor_bytes(path, i0) != tensor_bytes(other, i1)


def test_tiled_path_deterministic(tmp_path, monkeypatch):
    # the path big models take: large tensors tiled from a pool with a per-tensor start offset
    monkeypatch.setattr(synth, "TILE_MIN_ELEMENTS", 1 << 12)
    monkeypatch.setattr(synth, "_POOL_BYTES", 1 << 18)
    for typ in ("q8_0", "f16"):
        cfg = synth.preset("tiny", n_layer=2, type=typ)
        a, b = tmp_path / f"a_{typ}.gguf", tmp_path / f"b_{typ}.gguf"
        synth.write_gguf(a, cfg)
        synth.write_gguf(b, cfg)
        assert sha256(a) == sha256(b)
        h = model_file.read_gguf_header(a)
        assert h["file_size"] == synth.estimate_file_bytes(cfg)
        t = {x["name"]: x for x in h["tensors"]}
        gate = dequant(a, t["blk.0.ffn_gate_exps.weight"])
        up = dequant(a, t["blk.0.ffn_up_exps.weight"])
        assert not np.array_equal(gate, up)
        assert abs(gate.std() - cfg.resolved_scales()["ffn_scale"]) < 0.15 * cfg.resolved_scales()["ffn_scale"]


def test_f16(tmp_path):
    cfg = synth.preset("tiny", type="f16", n_layer=2)
    path = tmp_path / "f16.gguf"
    summary = synth.write_gguf(path, cfg)
    h = model_file.read_gguf_header(path)
    assert summary["bytes"] == os.path.getsize(path) == synth.estimate_file_bytes(cfg)
    assert h["kv"]["general.file_type"] == 1
    t = {x["name"]: x for x in h["tensors"]}
    assert t["token_embd.weight"]["type_name"] == "F16"
    assert t["output_norm.weight"]["type_name"] == "F32"
    for short, (shape_of, f32) in LAYER_TENSORS.items():
        info = t[f"blk.1.{short}.weight"]
        assert info["shape"] == shape_of(cfg)
        assert info["type_name"] == ("F32" if f32 else "F16"), short
    assert summary["expert_bytes_per_layer"] == 3 * cfg.n_embd * cfg.n_ff_exp * cfg.n_expert * 2
    emb = dequant(path, t["token_embd.weight"])
    assert np.isfinite(emb).all() and abs(emb.std() - 1.0) < 0.1


def test_progress_goes_to_stderr(tmp_path, capsys):
    synth.write_gguf(tmp_path / "p.gguf", synth.preset("tiny", n_layer=2, n_vocab=256), progress=True)
    out = capsys.readouterr()
    assert out.out == "" and "layer 2/2" in out.err


def test_read_rejects_garbage_and_truncated(tmp_path, tiny):
    _, path, _, h = tiny
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="garbage.gguf"):
        model_file.read_gguf_header(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        model_file.read_gguf_header(empty)
    with pytest.raises(ValueError, match="missing.gguf"):
        model_file.read_gguf_header(tmp_path / "missing.gguf")

    data = path.read_bytes()
    # cut inside the metadata, inside the tensor infos, and inside the tensor data
    for cut in (40, h["data_offset"] - 100, len(data) - 1000):
        trunc = tmp_path / f"trunc_{cut}.gguf"
        trunc.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"trunc_{cut}.gguf"):
            model_file.read_gguf_header(trunc)
    # a GGUF magic followed by nonsense counts
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") * 2)
    with pytest.raises(ValueError, match="bad.gguf"):
        model_file.read_gguf_header(bad)


def test_skewed_without_a_skew_is_not_uniform():
    """routing="skewed" alone used to mean skew 0, i.e. uniform routing under another name."""
    cfg = synth.preset("tiny", routing="skewed")
    assert cfg.skew == synth.DEFAULT_SKEW > 0
    assert synth.preset("tiny", routing="skewed", skew=0.0).skew == 0.0   # explicit 0 stays allowed
    assert synth.preset("tiny").skew == 0.0


def test_cached_model_never_hands_out_a_file_of_another_config(tmp_path, monkeypatch):
    """cached_model's file name carries every field that differs from the preset: an override of n_expert (not
    in the short name) gets a file of its own, not the one written for the preset's defaults."""
    written = []
    monkeypatch.setattr(synth, "write_gguf", lambda path, cfg: (written.append(cfg), Path(path).write_bytes(b"x")))
    plain = synth.cached_model(tmp_path, "tiny", seed=1)
    assert synth.cached_model(tmp_path, "tiny", seed=1) == plain and len(written) == 1   # written once
    more = synth.cached_model(tmp_path, "tiny", seed=1, n_expert=2 * written[0].n_expert)
    assert more != plain and len(written) == 2 and written[1].n_expert == 2 * written[0].n_expert
    assert plain.name == f"tiny-L{written[0].n_layer}-uniform-s1.gguf"      # the short name where nothing else differs
    skewed = synth.cached_model(tmp_path, "tiny", seed=1, routing="skewed", skew=2.0)
    assert skewed.name == f"tiny-L{written[0].n_layer}-skewed2-s1.gguf" and len(written) == 3
    near = synth.cached_model(tmp_path, "tiny", seed=1, routing="skewed", skew=2.0000001)   # the name rounds it
    assert near != skewed and len(written) == 4


def test_gguf_py_reads_back_what_synth_wrote(tmp_path):
    """The format's own library (gguf-py) reads the file back: architecture, shapes, types, offsets and metadata."""
    import gguf

    cfg = synth.preset("tiny", n_layer=2, seed=4, routing="skewed", skew=1.5)
    path = tmp_path / "t.gguf"
    synth.write_gguf(path, cfg)
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values()}
    assert kv["general.architecture"] == "qwen3moe" and kv["qwen3moe.block_count"] == 2
    assert kv["qwen3moe.expert_count"] == cfg.n_expert and kv["tokenizer.ggml.model"] == "test"
    assert len(kv["tokenizer.ggml.tokens"]) == cfg.n_vocab and kv["pyllama_pp.synth.routing"] == "skewed"
    got = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors}
    names = [t.name for t in r.tensors]
    assert names[:3] == ["token_embd.weight", "output_norm.weight", "output.weight"], names[:3]
    assert got["blk.1.ffn_up_exps.weight"] == ((cfg.n_embd, cfg.n_ff_exp, cfg.n_expert), "Q8_0")
    assert got["blk.0.ffn_gate_inp.weight"] == ((cfg.n_embd, cfg.n_expert), "F32")
    assert len(names) == 3 + 12 * cfg.n_layer
    # the data section ends where the file ends (the last tensor padded to the alignment)
    last = r.tensors[-1]
    assert last.data_offset + last.n_bytes <= path.stat().st_size < last.data_offset + last.n_bytes + 32


# (name, arch, overrides): every family, and routed experts of the types real models ship them in
FAMILY_CASES = [
    ("mixtral-tiny", "llama", {}), ("qwen2moe-tiny", "qwen2moe", {}), ("glm4moe-tiny", "glm4moe", {}),
    ("deepseek2-tiny", "deepseek2", {}),                                  # a query latent, sigmoid gating (V3)
    ("deepseek2-tiny", "deepseek2", {"q_lora_rank": 0, "gating": "softmax"}),   # attn_q, softmax gating (V2)
    ("gptoss-tiny", "gpt-oss", {}),                                       # MXFP4 experts with biases, sinks, SWA
    ("mixtral-tiny", "llama", {"n_embd": 256, "head_dim": 64, "expert_type": "q4_k"}),   # (Q4_K: rows of 256)
    ("qwen2moe-tiny", "qwen2moe", {"expert_type": "bf16"}),
    ("glm4moe-tiny", "glm4moe", {"expert_type": "mxfp4"}),
]


@pytest.mark.parametrize("name, arch, overrides", FAMILY_CASES,
                         ids=[n + "".join(f"-{v}" for v in o.values()) for n, _, o in FAMILY_CASES])
def test_more_families_load_and_match_the_baseline(tmp_path_factory, name, arch, overrides):
    """Every family, written with gguf-py's names and keys for its architecture, and routed experts in other types
    than the rest: both variants load them; with every expert in host RAM on 2 VDEVs the patched build pipelines,
    uploads the routed experts only (shared experts, dense layers, routers and attention stay on their layer's device:
    the host holds exactly the *_exps tensors and the token embeddings) and gives the baseline's logits."""
    import re
    from pyllama_pp.params import EXPERT_TENSORS
    from pyllama_pp.worker import run_job
    cfg = synth.preset(name, seed=1, **overrides)
    path = synth.cached_model(tmp_path_factory.mktemp(name), name, seed=1, **overrides)
    header = model_file.read_gguf_header(path)
    assert header["kv"]["general.architecture"] == arch and cfg.arch == arch
    assert header["kv"][f"{arch}.expert_count"] == cfg.n_expert
    t = {x["name"]: x for x in header["tensors"]}
    shared_in = "blk.1.ffn_up_shexp.weight"   # (glm4moe's and deepseek2's layer 0 is dense)
    assert (shared_in in t) == (arch in ("qwen2moe", "glm4moe", "deepseek2"))
    assert ("blk.0.ffn_up.weight" in t and "blk.0.ffn_up_exps.weight" not in t) == (arch in ("glm4moe", "deepseek2"))
    assert ("blk.0.attn_q_norm.weight" in t) is False
    assert ("blk.1.attn_k_b.weight" in t) == ("blk.1.attn_kv_a_mqa.weight" in t) == (arch == "deepseek2")
    assert ("blk.1.attn_q_a.weight" in t) == (arch == "deepseek2" and cfg.q_lora_rank > 0)
    assert ("blk.1.ffn_down_exps.bias" in t) == ("blk.1.attn_sinks.weight" in t) == (arch == "gpt-oss")
    etype = {"q4_k": "Q4_K", "bf16": "BF16", "mxfp4": "MXFP4", None: "Q8_0"}[cfg.expert_type]
    assert {x["type_name"] for n, x in t.items() if re.search(r"_exps\.weight$", n)} == {etype}
    assert t["blk.1.attn_output.weight"]["type_name"] == "Q8_0"
    out = tmp_path_factory.mktemp(name + "-logits")
    kw = {"kind": "logits", "model": str(path), "devices": "vdev:2x0@0.5", "placement": {"host_experts": "all"},
          "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 32}, "n_tokens": 256, "logits": "all"}
    b = run_job({**kw, "out": str(out / "b.npy")}, "baseline", timeout=120)
    p = run_job({**kw, "out": str(out / "p.npy")}, "patched", timeout=120)
    lb, lp = np.load(out / "b.npy"), np.load(out / "p.npy")
    assert lb.shape == lp.shape == (256, cfg.n_vocab) and np.isfinite(lb).all()
    assert float(((lb - lp) ** 2).sum() / (lb ** 2).sum()) <= 1e-6
    assert p["schedule"]["pipeline_parallel"] is True and b["schedule"]["pipeline_parallel"] is False
    # what stays in host RAM: the routed experts (with gpt-oss's expert biases) and the token embeddings, nothing else
    host = sum(x["nbytes"] for n, x in t.items() if re.search(EXPERT_TENSORS, n) or n == "token_embd.weight")
    mem = {m["buft"]: m["model_bytes"] for m in p["schedule"]["memory"]}
    assert mem["VDEV_Host"] == host, (mem, host)
    rest = sum(x["nbytes"] for x in t.values()) - host
    assert rest <= mem["VDEV0"] + mem["VDEV1"] <= rest + 256 * len(t), (mem, rest)   # (tensors padded in buffers)
    # every host-weight upload is a routed expert tensor: whole ones are multiples of one expert tensor's bytes
    one = synth.expert_bytes_per_layer(cfg) // 3
    moved = sum(x["weight_bytes"] for x in p["ext"]["backends"])
    assert moved > 0 and p["ext"]["upload_all"] + p["ext"]["gather"] > 0
    assert p["ext"]["selective"] + p["ext"]["gather"] > 0 or moved % one == 0, (moved, one)


# bad family configs: the preset(...) call and what its error must say (what, and how to fix it)
BAD_CONFIGS = [
    ("tiny", dict(arch="mamba"), "arch must be one of"),
    ("tiny", dict(arch=["qwen3moe"]), "arch must be one of"),
    ("qwen2moe-tiny", dict(n_ff_shexp=0), "n_ff_shexp"),
    ("tiny", dict(n_expert_shared=1), "glm4moe's"),
    ("glm4moe-tiny", dict(n_ff=0), "n_layer_dense_lead"),
    ("mixtral-tiny", dict(head_dim=64), "n_head \\* head_dim == n_embd"),
    ("deepseek2-tiny", dict(n_layer=27), "lite model without a query latent: set q_lora_rank=0"),
    ("deepseek2-tiny", dict(n_head_kv=2), "n_head_kv must be 1"),
    ("deepseek2-tiny", dict(rope_dim=48), "rope_dim \\(48\\) must be even and below head_dim"),
    ("deepseek2-tiny", dict(kv_lora_rank=0), "deepseek2 needs SynthConfig.kv_lora_rank > 0"),
    ("deepseek2-tiny", dict(n_expert_shared=0), "n_expert_shared >= 1"),
    ("tiny", dict(kv_lora_rank=64), "are deepseek2's \\(MLA attention\\); qwen3moe has none"),
    ("glm4moe-tiny", dict(gating="softmax"), "gating is deepseek2's choice"),
    ("deepseek2-tiny", dict(gating="relu"), "gating must be None or one of"),
    ("deepseek2-tiny", dict(q_lora_rank=48),
     "Q8_0 needs row lengths that are multiples of 32: q_lora_rank \\(attn_q_b\\)"),
    ("gptoss-tiny", dict(n_swa=0), "gpt-oss needs one > 0"),
    ("tiny", dict(n_swa=64), "n_swa \\(the sliding window\\) is for gpt-oss"),
    ("tiny", dict(type="q4_k"), "type must be one of .* \\(q4_k and mxfp4 are for the routed experts"),
    ("tiny", dict(expert_type="q2_k"), "expert_type must be None \\(= type\\) or one of"),
    ("tiny", dict(expert_type="q4_k"), "Q4_K needs row lengths that are multiples of 256: n_embd \\(ffn_gate_exps, "
                                       "ffn_up_exps\\) = 128; .* or expert_type one of \\['bf16', 'f16', 'mxfp4', 'q8_0'\\]"),
    ("deepseek-v2-lite", dict(expert_type="q4_k"), "n_ff_exp \\(ffn_down_exps\\) = 1408"),  # (1408 = 5.5 x 256)
    ("tiny", dict(n_ff_exp=48, expert_type="mxfp4"),
     "MXFP4 needs row lengths that are multiples of 32: n_ff_exp \\(ffn_down_exps\\) = 48"),
]


@pytest.mark.parametrize("name, overrides, says", BAD_CONFIGS)
def test_bad_family_configs_say_what_to_fix(name, overrides, says):
    with pytest.raises(ValueError, match=says):
        synth.preset(name, **overrides)


def test_family_presets_have_their_models_shapes():
    big = synth.preset("mixtral-8x7b")
    assert 46 <= synth.estimate_file_bytes(big) / 1e9 <= 51   # Mixtral-8x7B as Q8_0
    assert 13 <= synth.estimate_file_bytes(synth.preset("qwen2moe-a2.7b")) / 1e9 <= 17
    assert 50 <= synth.estimate_file_bytes(synth.preset("glm4.5-air-l24")) / 1e9 <= 64   # fits 128 GB of host RAM
    assert 15.5 <= synth.estimate_file_bytes(synth.preset("deepseek-v2-lite")) / 1e9 <= 17.5
    assert 10.5 <= synth.estimate_file_bytes(synth.preset("gpt-oss-20b")) / 1e9 <= 12.5   # (real: 12.1, 201088 tokens)
    lite = synth.preset("deepseek-v2-lite")
    assert (lite.n_layer, lite.n_embd, lite.n_head, lite.kv_lora_rank, lite.q_lora_rank) == (27, 2048, 16, 512, 0)
    assert (lite.rope_dim, lite.head_dim - lite.rope_dim, lite.v_head_dim) == (64, 128, 128)
    assert (lite.n_expert, lite.n_expert_used, lite.n_expert_shared, lite.n_ff_exp, lite.n_ff) == (64, 6, 2, 1408, 10944)
    oss = synth.preset("gpt-oss-20b")
    assert (oss.n_layer, oss.n_embd, oss.n_head, oss.head_dim, oss.n_head_kv) == (24, 2880, 64, 64, 8)
    assert (oss.n_expert, oss.n_expert_used, oss.n_ff_exp, oss.expert_type) == (32, 4, 2880, "mxfp4")
    assert synth.preset("deepseek2-tiny", n_layer=27, q_lora_rank=0).is_deepseek2_lite()   # MLA's lite form
    synth.preset("tiny", n_ff_exp=48, type="f16", expert_type="bf16")   # fine: BF16 has no blocks
    assert synth.preset("qwen3-30b-a3b", expert_type="q4_k").expert_type == "q4_k"   # (768 and 2048 rows)


# values of each expert type: (gguf-py's name, bytes per block of 256 values)
EXPERT_TYPES = {"q4_k": ("Q4_K", 144), "mxfp4": ("MXFP4", 8 * 17), "bf16": ("BF16", 512), "f16": ("F16", 512),
                "q8_0": ("Q8_0", 8 * 34)}


@pytest.mark.parametrize("tiled", [False, True], ids=["fresh", "tiled"])
@pytest.mark.parametrize("etype", sorted(EXPERT_TYPES))
def test_expert_types_dequantize_to_the_requested_scale(tmp_path, monkeypatch, etype, tiled):
    """Each expert type's random data, read back by gguf-py's own dequantization, has the standard deviation asked
    for (within 10%; the ffn scale and uniform routing's 0.0005 down scale) and a mean near 0, drawn fresh or tiled
    from a pool (whose unit is a block); the file's size is the estimate and its file_type llama.cpp's for it."""
    import gguf
    if tiled:
        monkeypatch.setattr(synth, "TILE_MIN_ELEMENTS", 1 << 12)
        monkeypatch.setattr(synth, "_POOL_BYTES", 1 << 18)
    cfg = synth.preset("mixtral-tiny", n_layer=2, n_embd=256, head_dim=64, n_vocab=256, expert_type=etype)
    path = tmp_path / f"{etype}.gguf"
    summary = synth.write_gguf(path, cfg)
    h = model_file.read_gguf_header(path)
    assert summary["bytes"] == h["file_size"] == synth.estimate_file_bytes(cfg)
    assert summary["expert_type"] == etype and h["kv"]["pyllama_pp.synth.expert_type"] == etype
    assert h["kv"]["general.file_type"] == {"q4_k": 15, "mxfp4": 38, "bf16": 32, "f16": 1, "q8_0": 7}[etype]
    qname, per256 = EXPERT_TYPES[etype]
    t = {x["name"]: x for x in h["tensors"]}
    assert t["blk.0.attn_q.weight"]["type_name"] == "Q8_0"   # the rest keeps type
    scales = cfg.resolved_scales()
    for name, scale in (("ffn_gate_exps", scales["ffn_scale"]), ("ffn_down_exps", scales["down_scale"])):
        info = t[f"blk.1.{name}.weight"]
        assert info["type_name"] == qname
        n = int(np.prod(info["shape"]))
        assert info["nbytes"] == n // 256 * per256
        raw = np.frombuffer(tensor_bytes(path, info), dtype=np.uint8).reshape(-1, info["nbytes"] // info["shape"][2])
        v = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qname]).astype(np.float64).ravel()
        assert v.size == n and np.isfinite(v).all()
        assert abs(v.std() / scale - 1) < 0.1, (name, v.std(), scale)
        assert abs(v.mean()) < 0.02 * scale, (name, v.mean(), scale)
    gate, up = (tensor_bytes(path, t[f"blk.1.ffn_{w}_exps.weight"]) for w in ("gate", "up"))
    assert gate != up


def test_one_type_files_stay_as_they_were(tmp_path):
    """expert_type None (the default) is type: no key of its own, and naming the same type changes the metadata only
    (the tensor data, table and file type are the same bytes)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    synth.write_gguf(a, synth.preset("tiny", n_layer=2))
    synth.write_gguf(b, synth.preset("tiny", n_layer=2, expert_type="q8_0"))
    ha, hb = model_file.read_gguf_header(a), model_file.read_gguf_header(b)
    assert "pyllama_pp.synth.expert_type" not in ha["kv"] and hb["kv"]["pyllama_pp.synth.expert_type"] == "q8_0"
    assert ha["kv"]["general.file_type"] == hb["kv"]["general.file_type"] == 7
    assert [(x["name"], x["shape"], x["type"], x["offset"]) for x in ha["tensors"]] == \
           [(x["name"], x["shape"], x["type"], x["offset"]) for x in hb["tensors"]]
    assert a.read_bytes()[ha["data_offset"]:] == b.read_bytes()[hb["data_offset"]:]


def test_deepseek2_is_written_as_llama_cpp_loads_mla(tmp_path):
    """deepseek2's keys and shapes as the pinned loader reads them (is_mla(): the split attn_k_b / attn_v_b form):
    the cache's one latent head (kv_lora_rank + rope_dim keys, kv_lora_rank values), the heads after the latent
    projections (*_mla), the query latent, shared experts, the dense first layer, sigmoid gating with its bias."""
    cfg = synth.preset("deepseek2-tiny", n_layer=3, n_vocab=256)
    path = tmp_path / "ds.gguf"
    synth.write_gguf(path, cfg)
    h = model_file.read_gguf_header(path)
    kv, a = h["kv"], "deepseek2."
    nope = cfg.head_dim - cfg.rope_dim
    assert (kv[a + "attention.key_length"], kv[a + "attention.value_length"]) == (cfg.kv_lora_rank + cfg.rope_dim,
                                                                                 cfg.kv_lora_rank)
    assert (kv[a + "attention.key_length_mla"], kv[a + "attention.value_length_mla"]) == (cfg.head_dim, cfg.v_head_dim)
    assert kv[a + "rope.dimension_count"] == cfg.rope_dim and kv[a + "attention.head_count_kv"] == 1
    assert (kv[a + "attention.q_lora_rank"], kv[a + "attention.kv_lora_rank"]) == (cfg.q_lora_rank, cfg.kv_lora_rank)
    assert (kv[a + "expert_shared_count"], kv[a + "leading_dense_block_count"]) == (2, 1)
    assert kv[a + "expert_gating_func"] == 2 and kv[a + "expert_weights_norm"] is True   # sigmoid (V3)
    assert kv[a + "feed_forward_length"] == cfg.n_ff
    t = {x["name"]: (x["shape"], x["type_name"]) for x in h["tensors"]}
    H, E, S = cfg.n_head, cfg.n_embd, cfg.n_ff_exp * cfg.n_expert_shared
    for name, shape in [("attn_q_a", [E, cfg.q_lora_rank]), ("attn_q_a_norm", [cfg.q_lora_rank]),
                        ("attn_q_b", [cfg.q_lora_rank, H * cfg.head_dim]), ("attn_kv_a_norm", [cfg.kv_lora_rank]),
                        ("attn_kv_a_mqa", [E, cfg.kv_lora_rank + cfg.rope_dim]), ("attn_k_b", [nope, cfg.kv_lora_rank, H]),
                        ("attn_v_b", [cfg.kv_lora_rank, cfg.v_head_dim, H]), ("attn_output", [H * cfg.v_head_dim, E]),
                        ("ffn_gate_shexp", [E, S]), ("ffn_down_shexp", [S, E]), ("ffn_gate_inp", [E, cfg.n_expert])]:
        assert t[f"blk.1.{name}.weight"][0] == shape, name
    assert t["blk.1.exp_probs_b.bias"] == ([cfg.n_expert], "F32")
    assert t["blk.0.ffn_up.weight"][0] == [E, cfg.n_ff] and "blk.0.ffn_gate_inp.weight" not in t
    assert not any(".attn_q.weight" in n or ".attn_k.weight" in n or "attn_kv_b" in n for n in t)
    v2 = synth.preset("deepseek2-tiny", n_layer=3, n_vocab=256, q_lora_rank=0, gating="softmax")
    synth.write_gguf(path, v2)
    h = model_file.read_gguf_header(path)
    names = {x["name"] for x in h["tensors"]}
    assert "blk.1.attn_q.weight" in names and "blk.1.attn_q_a.weight" not in names and "blk.1.exp_probs_b.bias" not in names
    assert h["kv"][a + "expert_gating_func"] == 1 and h["kv"][a + "expert_weights_norm"] is False   # softmax (V2)


def test_gptoss_is_written_as_llama_cpp_loads_it(tmp_path):
    """gpt-oss: the sliding window, attention biases and sinks, a zero router bias (routing stays the router rows'),
    expert biases beside MXFP4 experts, and MXFP4_MOE as the file type."""
    cfg = synth.preset("gptoss-tiny", n_layer=2, n_vocab=256)
    path = tmp_path / "oss.gguf"
    summary = synth.write_gguf(path, cfg)
    h = model_file.read_gguf_header(path)
    kv, a = h["kv"], "gpt-oss."
    assert kv["general.architecture"] == "gpt-oss" and kv[a + "attention.sliding_window"] == cfg.n_swa
    assert kv["general.file_type"] == 38 and kv[a + "expert_feed_forward_length"] == cfg.n_ff_exp
    assert summary["expert_bytes_per_layer"] == 3 * cfg.n_embd * cfg.n_ff_exp * cfg.n_expert * 17 // 32
    t = {x["name"]: x for x in h["tensors"]}
    E, F, D, q = cfg.n_embd, cfg.n_ff_exp, cfg.n_expert, cfg.n_head * cfg.head_dim
    for name, shape in [("attn_q.bias", [q]), ("attn_k.bias", [cfg.n_head_kv * cfg.head_dim]), ("attn_output.bias", [E]),
                        ("attn_sinks.weight", [cfg.n_head]), ("ffn_gate_inp.bias", [D]), ("ffn_gate_exps.bias", [F, D]),
                        ("ffn_up_exps.bias", [F, D]), ("ffn_down_exps.bias", [E, D]), ("post_attention_norm.weight", [E])]:
        assert (t[f"blk.1.{name}"]["shape"], t[f"blk.1.{name}"]["type_name"]) == (shape, "F32"), name
    assert t["blk.1.ffn_up_exps.weight"]["type_name"] == "MXFP4" and t["blk.1.attn_q.weight"]["type_name"] == "Q8_0"
    assert np.all(dequant(path, t["blk.1.ffn_gate_inp.bias"]) == 0)
    s = cfg.resolved_scales()
    for name, scale in (("ffn_gate_exps.bias", s["ffn_scale"]), ("ffn_down_exps.bias", s["down_scale"])):
        v = dequant(path, t[f"blk.1.{name}"])
        assert 0.9 * scale < v.std() < 1.1 * scale, name
    sinks = dequant(path, t["blk.1.attn_sinks.weight"])   # (8 of them, std 1)
    assert len(np.unique(sinks)) == cfg.n_head and np.abs(sinks).max() < 5


@pytest.mark.parametrize("name", ["deepseek2-tiny", "gptoss-tiny"])
def test_routing_control_reaches_the_new_families(tmp_path_factory, name):
    """deepseek2's selection bias and gpt-oss's router bias are constant, so routing is the router rows': uniform
    routing uses about E (1 - (1 - k/E)^T) experts per layer and 32-token ubatch (measured by the baseline build), a
    skew of 2 far fewer."""
    from pyllama_pp.worker import run_job
    d = tmp_path_factory.mktemp(name + "-routing")
    cfg = synth.preset(name)
    used = {}
    for routing, skew in (("uniform", 0.0), ("skewed", 2.0)):
        path = synth.cached_model(d, name, seed=1, routing=routing, skew=skew)
        h = model_file.read_gguf_header(path)
        bias = next(x for x in h["tensors"] if x["name"] in ("blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.bias"))
        assert len(np.unique(dequant(path, bias))) == 1
        r = run_job({"kind": "measure", "model": str(path), "devices": "vdev:2x0@0", "tests": [["pp", 256]], "reps": 1,
                     "warmup": 0, "ctx": {"n_ctx": 512, "n_batch": 256, "n_ubatch": 32}}, "baseline", timeout=120)
        used[routing] = r["tests"][0]["coverage"]["experts_used_per_layer_ubatch"]
    E, k = cfg.n_expert, cfg.n_expert_used
    assert used["uniform"] >= 0.95 * E * (1 - (1 - k / E) ** 32), used
    assert used["skewed"] <= 0.7 * used["uniform"], used


def test_locality_routing_walks_over_token_ids(tmp_path):
    """routing="locality": its metadata, bytes fixed by the seed, and embeddings whose consecutive rows correlate by
    locality * exp(-1 / locality_span) while far rows do not (what makes a stream of ids route with locality)."""
    cfg = synth.preset("tiny", routing="locality", n_layer=2, n_vocab=2048, seed=3)
    assert (cfg.skew, cfg.resolved_locality()) == (synth.DEFAULT_LOCALITY_SKEW,
                                                   (synth.DEFAULT_LOCALITY, synth.DEFAULT_LOCALITY_SPAN))
    path, again, other = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth.write_gguf(path, cfg)
    synth.write_gguf(again, synth.preset("tiny", routing="locality", n_layer=2, n_vocab=2048, seed=3))
    synth.write_gguf(other, synth.preset("tiny", routing="locality", n_layer=2, n_vocab=2048, seed=4))
    assert sha256(path) == sha256(again) != sha256(other)
    h = model_file.read_gguf_header(path)
    kv = h["kv"]
    assert kv["pyllama_pp.synth.routing"] == "locality"
    assert abs(kv["pyllama_pp.synth.locality"] - synth.DEFAULT_LOCALITY) < 1e-6
    assert abs(kv["pyllama_pp.synth.locality_span"] - synth.DEFAULT_LOCALITY_SPAN) < 1e-6
    assert abs(kv["pyllama_pp.synth.skew"] - synth.DEFAULT_LOCALITY_SKEW) < 1e-6
    t = {x["name"]: x for x in h["tensors"]}
    emb = dequant(path, t["token_embd.weight"])
    assert abs(emb.std() - 1.0) < 0.1
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    want = synth.DEFAULT_LOCALITY * np.exp(-1.0 / synth.DEFAULT_LOCALITY_SPAN)
    lag1 = float((e[1:] * e[:-1]).sum(1).mean())
    far = float((e[200:] * e[:-200]).sum(1).mean())
    assert abs(lag1 - want) < 0.05, (lag1, want)
    assert abs(far) < 0.05, far
    # the popularity profile is skewed's, at the weak default
    norms = np.sort(np.linalg.norm(dequant(path, t["blk.0.ffn_gate_inp.weight"]), axis=1))[::-1]
    assert np.allclose(norms / norms[0], (np.arange(cfg.n_expert) + 1.0) ** -cfg.skew, rtol=1e-4)
    # a sticky walk (locality 1, a long span) correlates more; locality 0 leaves independent tokens
    sticky = synth.preset("tiny", routing="locality", n_layer=1, n_vocab=512, locality=1.0, locality_span=64.0)
    loose = synth.preset("tiny", routing="locality", n_layer=1, n_vocab=512, locality=0.0)
    for c, lo, hi in ((sticky, 0.95, 1.0), (loose, -0.05, 0.05)):
        synth.write_gguf(tmp_path / "x.gguf", c)
        x = dequant(tmp_path / "x.gguf", next(i for i in model_file.read_gguf_header(tmp_path / "x.gguf")["tensors"]
                                              if i["name"] == "token_embd.weight"))
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        assert lo <= float((x[1:] * x[:-1]).sum(1).mean()) <= hi


def test_locality_settings_are_checked_and_named():
    with pytest.raises(ValueError, match="locality must be in"):
        synth.preset("tiny", routing="locality", locality=1.5)
    with pytest.raises(ValueError, match="locality_span"):
        synth.preset("tiny", routing="locality", locality_span=0.0)
    with pytest.raises(ValueError, match="routing='locality'"):
        synth.preset("tiny", locality=0.5)
    assert synth.preset("tiny", routing="locality", skew=0.0).skew == 0.0


def test_cached_locality_models_of_other_settings_get_other_files(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(synth, "write_gguf", lambda path, cfg: written.append((path, cfg)) or Path(path).touch())
    a = synth.cached_model(tmp_path, "tiny", routing="locality")
    b = synth.cached_model(tmp_path, "tiny", routing="locality", skew=0.3)
    c = synth.cached_model(tmp_path, "tiny", routing="locality", locality=0.5)
    assert len({a, b, c}) == 3 and len(written) == 3
    assert a.name == f"tiny-L6-locality{synth.DEFAULT_LOCALITY_SKEW:g}-s0.gguf"
    assert synth.cached_model(tmp_path, "tiny", routing="locality") == a and len(written) == 3
