"""Hostile GGUFs (a fixed handful of bench/fuzz_gguf.py's kinds of damage): each is refused with a ModelError that
says what is wrong, by pyllama_pp's own check (in this process, no variant loaded) and, for one case of each kind,
by llama.cpp alone (in a worker, the check off): exit code 3, never a signal. The CLI refuses them before any worker starts."""
from __future__ import annotations

import struct
import sys

import pytest

from pyllama_pp import ModelError, cli, model_file, worker
from pyllama_pp.model_file import check_model_path

TIMEOUT = 120


@pytest.fixture(scope="module")
def original(tiny_model):
    with open(tiny_model, "rb") as f:
        data = f.read()
    return data, model_file.read_gguf_header(tiny_model)


def _put(data: bytes, at: int, fmt: str, value) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    return bytes(buf)


def _tensor_field(lay: dict, name: str, field: str) -> int:
    """Where a tensor info's n_dims, ne[0], type or offset is."""
    t = next(t for t in lay["tensors"] if t["name"] == name)
    at = t["info_offset"] + 8 + len(name)
    return {"n_dims": at, "ne0": at + 4, "type": at + 4 + 8 * len(t["shape"]),
            "offset": at + 4 + 8 * len(t["shape"]) + 4}[field]


def _with_alignment(data: bytes, lay: dict, value: int, gtype: int = model_file.GGUF_UINT32) -> bytes:
    """A general.alignment entry first in the metadata, the rest as it was."""
    head = _put(data[:24], 16, "<Q", lay["n_kv"] + 1)
    key = b"general.alignment"
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", gtype) + \
        struct.pack("<Q" if gtype == model_file.GGUF_UINT64 else "<I", value)
    return head + entry + data[24:]


T = "blk.1.ffn_up_exps.weight"
CASES = {   # name: (damage, words of pyllama_pp's check)
    "truncated in the header": (lambda d, l: d[:20], "truncated"),
    "truncated in the metadata": (lambda d, l: d[:l["ti_offset"] - 100], "truncated"),
    "truncated in the tensor infos": (lambda d, l: d[:l["ti_offset"] + 50], "truncated"),
    "truncated in the data": (lambda d, l: d[:l["data_offset"] + 1000], "truncated GGUF file"),
    "version 1": (lambda d, l: _put(d, 4, "<I", 1), "unsupported version 1"),
    "huge n_kv": (lambda d, l: _put(d, 16, "<Q", 2**63 - 1), "implausible counts"),
    "huge n_tensors": (lambda d, l: _put(d, 8, "<Q", 2**64 - 1), "implausible counts"),
    "huge key length": (lambda d, l: _put(d, l["kv_offsets"]["general.name"][0], "<Q", 2**62), "truncated"),
    "huge token count": (lambda d, l: _put(d, l["kv_offsets"]["tokenizer.ggml.tokens"][1] + 8, "<Q", 2**40),
                         "cannot fit"),
    "bad value type": (lambda d, l: _put(d, l["kv_offsets"]["general.file_type"][1], "<I", 13), "invalid value type"),
    "nested array": (lambda d, l: _put(d, l["kv_offsets"]["tokenizer.ggml.token_type"][1] + 4, "<I", 9),
                     "invalid array element type"),
    "5 dimensions": (lambda d, l: _put(d, _tensor_field(l, T, "n_dims"), "<I", 5), "dimensions"),
    "huge dimension": (lambda d, l: _put(d, _tensor_field(l, T, "ne0"), "<q", 2**62), "ends at byte"),
    "negative dimension": (lambda d, l: _put(d, _tensor_field(l, T, "ne0"), "<q", -1), "negative dimension"),
    "unknown tensor type": (lambda d, l: _put(d, _tensor_field(l, T, "type"), "<I", 1000), "unknown tensor type"),
    "removed tensor type": (lambda d, l: _put(d, _tensor_field(l, T, "type"), "<I", 4), "unknown tensor type"),
    "alignment 3": (lambda d, l: _with_alignment(d, l, 3), "bad general.alignment 3"),
    "alignment 0": (lambda d, l: _with_alignment(d, l, 0), "bad general.alignment 0"),
    "alignment as uint64": (lambda d, l: _with_alignment(d, l, 32, model_file.GGUF_UINT64), "must be a uint32"),
    "offset past the end": (lambda d, l: _put(d, _tensor_field(l, T, "offset"), "<Q", 2**63), "offset"),
    "offset out of line": (lambda d, l: _put(d, _tensor_field(l, T, "offset"), "<Q", 32), "offset"),
}


# the cases that also go through llama.cpp alone in a worker (one of each kind of damage; ~0.2 s each)
IN_WORKER = {"truncated in the tensor infos", "version 1", "huge n_kv", "huge token count", "bad value type",
             "nested array", "5 dimensions", "huge dimension", "unknown tensor type", "alignment 3",
             "offset past the end"}


def _damaged(tmp_path, original, name: str) -> str:
    data, lay = original
    path = tmp_path / (name.replace(" ", "_") + ".gguf")
    path.write_bytes(CASES[name][0](data, lay))
    return str(path)


@pytest.mark.parametrize("name", list(CASES))
def test_damaged_gguf_is_a_clean_model_error(tmp_path, original, name, monkeypatch):
    path = _damaged(tmp_path, original, name)
    with pytest.raises(ModelError) as ei:          # pyllama_pp's check, before llama.cpp sees the file
        check_model_path(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path} is not a valid GGUF file: ") and CASES[name][1] in msg and "\n" not in msg, msg
    if name not in IN_WORKER:
        return
    # llama.cpp alone (the check off): a clean error too, never a crash
    with pytest.raises(ModelError) as ei:
        worker.run_job({"kind": "schedule", "model": path, "devices": "cpu",
                        "ctx": {"n_ctx": 64, "n_batch": 32, "n_ubatch": 32}}, "baseline", timeout=TIMEOUT,
                       env={"PYLLAMA_PP_GGUF_CHECK": "0"})
    assert ei.value.exit_code == 3, (ei.value.exit_code, str(ei.value))


def test_damaged_gguf_in_a_worker_and_in_the_cli(tmp_path, original, capsys, monkeypatch):
    path = _damaged(tmp_path, original, "huge n_tensors")
    with pytest.raises(ModelError) as ei:
        worker.run_job({"kind": "schedule", "model": path, "devices": "cpu"}, "patched", timeout=TIMEOUT)
    assert ei.value.exit_code == 3 and "implausible counts" in str(ei.value), str(ei.value)

    def refuse(*a, **k):
        raise AssertionError("a worker was started for a damaged GGUF")
    # every way the CLI can start a worker: run_job where it is imported, and a serving worker's start
    from pyllama_pp.worker import client
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] == "pyllama_pp" and getattr(mod, "run_job", None) is client.run_job:
            monkeypatch.setattr(mod, "run_job", refuse)
    monkeypatch.setattr(client.ServingWorker, "start", refuse)
    assert cli.main(["run", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pyllama-pp: error: ") and "not a valid GGUF file" in err and "\n" not in err, err
