"""A model file before any native code reads it: a clear ModelError for a missing, unreadable or damaged GGUF, and
the facts fit's planner needs from its tensor index."""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import Union

import gguf

from .errors import ModelError
from .params import EXPERT_TENSORS
from .synth import STREAM_ROUTINGS, read_gguf_header


def check_model_path(path: Union[str, Path]) -> None:
    """A clear ModelError for a model path that is missing, a folder, unreadable or not a GGUF file."""
    path = Path(path)
    if path.is_dir():
        raise ModelError(f"{path} is a folder, not a model file: give the .gguf file inside it")
    if not path.is_file():
        raise ModelError(f"model file not found: {path} (write a synthetic one with `pyllama-pp synth OUT.gguf`)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                         "write one with `pyllama-pp synth` or convert your model with llama.cpp's tools")
    if os.environ.get("PYLLAMA_PP_GGUF_CHECK", "1") != "0":
        check_gguf_layout(path)


def check_gguf_layout(path: Union[str, Path]) -> None:
    """Read the GGUF's header, metadata and tensor table (not the data) and refuse a damaged one with the reason:
    a count, length or dimension that cannot fit in the file, a bad type, alignment or offset, a truncated file.
    llama.cpp checks these too, but says only "failed to load model"; this names what is wrong.
    (PYLLAMA_PP_GGUF_CHECK=0 leaves it to llama.cpp alone, as bench/fuzz_gguf.py --no-check does.)"""
    try:
        read_gguf_header(path)
    except (ValueError, struct.error, OverflowError, MemoryError, UnicodeError) as e:
        why = str(e).removeprefix(f"{path}: ").removeprefix("not a valid GGUF file: ")
        raise ModelError(f"{path} is not a valid GGUF file: {why} (a damaged or truncated file? write one with "
                         "`pyllama-pp synth` or convert your model with llama.cpp's tools)") from None


def layer_counts(path: Union[str, Path]) -> tuple[int, int]:
    """The model's repeating layers and, among them, the leading dense ones (GGUF keys `<arch>.block_count` and
    `<arch>.leading_dense_block_count`); 0 where the file does not say.

    Args:
        path: the GGUF file (checked by check_model_path first).
    Returns:
        (layers, leading dense layers).
    """
    kv = read_gguf_header(path)["kv"]
    return _arch_int(kv, "block_count"), _arch_int(kv, "leading_dense_block_count")


def _arch_int(kv: dict, key: str) -> int:
    """The integer GGUF key `<arch>.<key>` of a header's key-values (the first of an array); 0 where absent."""
    n = kv.get(f"{kv.get('general.architecture', '')}.{key}", 0)
    return int(n[0] if isinstance(n, list) else n) if n else 0


def embedding_length(path: Union[str, Path]) -> int:
    """The model's hidden size (GGUF key `<arch>.embedding_length`); 0 where the file does not say."""
    return _arch_int(read_gguf_header(path)["kv"], "embedding_length")


def block_count(path: Union[str, Path]) -> int:
    """The model's repeating layers (GGUF key `<arch>.block_count`); 0 where the file does not say.

    Args:
        path: the GGUF file (checked by check_model_path first).
    Returns:
        The layer count, or 0 when the metadata has none.
    """
    return layer_counts(path)[0]


def _expert_tensors(model: Union[str, os.PathLike]) -> list[tuple[int, int]]:
    """(layer, bytes) of each expert tensor (gguf-py reads the index)."""
    out = []
    for t in gguf.GGUFReader(str(model)).tensors:
        m = re.fullmatch(rf"blk\.(\d+)\.{EXPERT_TENSORS}\.weight", t.name)
        if m:
            out.append((int(m.group(1)), int(t.n_bytes)))
    return out


def expert_bytes_per_layer(model: Union[str, os.PathLike]) -> float:
    """Bytes of a MoE layer's expert tensors (gate, up, down), the mean over the layers (gguf-py reads the index)."""
    per_layer: dict = {}
    for layer, n in _expert_tensors(model):
        per_layer[layer] = per_layer.get(layer, 0) + n
    return sum(per_layer.values()) / len(per_layer) if per_layer else 0.0


def expert_layout(model: Union[str, os.PathLike]) -> tuple[int, int]:
    """The experts each token uses (GGUF key `<arch>.expert_used_count`) and the expert tensors of a MoE layer (gate,
    up, down: 3; gate_up and down: 2), the most any layer has; 0 where the file has none."""
    per_layer: dict = {}
    for layer, _ in _expert_tensors(model):
        per_layer[layer] = per_layer.get(layer, 0) + 1
    return _arch_int(read_gguf_header(model)["kv"], "expert_used_count"), max(per_layer.values(), default=0)


def expert_tensor_bytes(model: Union[str, os.PathLike]) -> int:
    """Bytes of the model's largest expert tensor: what one expert copy moves (0: no experts)."""
    return max((n for _, n in _expert_tensors(model)), default=0)


def synth_routing(path: Union[str, Path]) -> str:
    """The routing mode a synthetic model was written with (GGUF key `pyllama_pp.synth.routing`); "" for other files.

    Args:
        path: the GGUF file (checked by check_model_path first).
    """
    return str(read_gguf_header(path)["kv"].get("pyllama_pp.synth.routing", ""))


def routes_by_stream(path: Union[str, Path]) -> bool:
    """Whether the model's routing follows a stream of consecutive token ids (a synthetic model of a mode in
    synth.STREAM_ROUTINGS, "locality"): its tests feed such a stream, every other model random tokens."""
    return synth_routing(path) in STREAM_ROUTINGS
