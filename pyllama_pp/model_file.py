"""A model file before any native code reads it: the GGUF format as this package reads and writes it (value and
tensor types, the header reader), a clear ModelError for a missing, unreadable or damaged GGUF, and the facts fit's
planner needs from its header and tensor index.

The facts read one parsed header per file and version of it (`header`: cached by path, size and modification time),
so a command that asks several of them reads the file's header once."""
from __future__ import annotations

import functools
import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO, Dict, Optional, Tuple, Union

import numpy as np

from .errors import ModelError
from .params import EXPERT_TENSORS


GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# gguf value types (ggml/include/gguf.h)
GGUF_UINT8, GGUF_INT8, GGUF_UINT16, GGUF_INT16, GGUF_UINT32, GGUF_INT32 = 0, 1, 2, 3, 4, 5
GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY = 6, 7, 8, 9
GGUF_UINT64, GGUF_INT64, GGUF_FLOAT64 = 10, 11, 12

_SCALAR_FMT = {
    GGUF_UINT8: "<B", GGUF_INT8: "<b", GGUF_UINT16: "<H", GGUF_INT16: "<h",
    GGUF_UINT32: "<I", GGUF_INT32: "<i", GGUF_FLOAT32: "<f", GGUF_BOOL: "<?",
    GGUF_UINT64: "<Q", GGUF_INT64: "<q", GGUF_FLOAT64: "<d",
}
_SCALAR_NP = {
    GGUF_UINT8: "<u1", GGUF_INT8: "<i1", GGUF_UINT16: "<u2", GGUF_INT16: "<i2",
    GGUF_UINT32: "<u4", GGUF_INT32: "<i4", GGUF_FLOAT32: "<f4", GGUF_BOOL: "<u1",
    GGUF_UINT64: "<u8", GGUF_INT64: "<i8", GGUF_FLOAT64: "<f8",
}

# ggml tensor types: id -> (name, block size, bytes per block)
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q4_K, GGML_BF16, GGML_MXFP4 = 0, 1, 8, 12, 30, 39
# every type the pinned ggml reads from a GGUF (ggml.h; 4, 5, 31-33 and 36-38 were removed)
GGML_TYPES: Dict[int, Tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}

#: routing modes whose routing follows a stream of consecutive token ids (the bench feeds them such a stream)
STREAM_ROUTINGS = ("locality",)


def _nbytes(ne: Tuple[int, ...], gtype: int) -> int:
    _, blck, tsize = GGML_TYPES[gtype]
    n = 1
    for d in ne:
        n *= d
    return n // blck * tsize


def _pad(n: int, align: int = ALIGNMENT) -> int:
    return (n + align - 1) // align * align


class _Reader:
    def __init__(self, f: BinaryIO, path: str, size: int):
        self.f, self.path, self.size = f, path, size

    def fail(self, msg: str) -> ValueError:
        return ValueError(f"{self.path}: not a valid GGUF file: {msg}")

    def read(self, n: int) -> bytes:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise self.fail(f"truncated (needs {n} bytes at offset {pos}, file has {self.size})")
        b = self.f.read(n)
        if len(b) != n:
            raise self.fail(f"truncated (short read at offset {pos})")
        return b

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, gtype: int):
        if gtype == GGUF_STRING:
            return self.string()
        if gtype == GGUF_ARRAY:
            etype = self.unpack("<I")
            n = self.unpack("<Q")
            if etype == GGUF_STRING:
                if n * 8 > self.size:
                    raise self.fail(f"string array of {n} entries cannot fit")
                return [self.string() for _ in range(n)]
            if etype not in _SCALAR_NP:
                raise self.fail(f"invalid array element type {etype}")
            dt = np.dtype(_SCALAR_NP[etype])
            arr = np.frombuffer(self.read(n * dt.itemsize), dtype=dt)
            return (arr != 0).tolist() if etype == GGUF_BOOL else arr.tolist()
        if gtype not in _SCALAR_FMT:
            raise self.fail(f"invalid value type {gtype}")
        return self.unpack(_SCALAR_FMT[gtype])


def read_gguf_header(path) -> Dict[str, Any]:
    """Parse a GGUF file's header (metadata and tensor infos) without reading tensor data.

    Returns ``{"path", "version", "alignment", "n_kv", "n_tensors", "kv": {key: value},
    "kv_types": {key: gguf type id}, "tensors": [{"name", "shape" (ggml order, ne[0] first),
    "type" (ggml type id), "type_name", "offset" (relative to the data section), "file_offset",
    "nbytes", "info_offset" (where its tensor info starts)}], "data_offset", "file_size",
    "kv_offsets": {key: (where its entry starts, where its type id is)}, "ti_offset" (where the tensor infos
    start)}``.  Arrays come back as lists.

    Raises ValueError (message names the file) for a non-GGUF, malformed or truncated file.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        f = open(path, "rb", buffering=1 << 20)
    except OSError as e:
        raise ValueError(f"{path}: cannot read GGUF file: {e}") from e
    with f:
        r = _Reader(f, path, size)
        if size < 4 or f.read(4) != GGUF_MAGIC:
            raise r.fail("bad magic (expected 'GGUF')")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise r.fail(f"unsupported version {version}")
        n_tensors = r.unpack("<Q")   # (uint64 in the format)
        n_kv = r.unpack("<Q")
        # (the smallest entries: a 1-byte key, a type and a 1-byte value; a 1-byte name, 1 dimension, type, offset)
        if n_tensors < 0 or n_kv < 0 or 24 + 14 * n_kv + 30 * n_tensors > size:
            raise r.fail(f"implausible counts (n_tensors={n_tensors}, n_kv={n_kv}: more than a file of {size} "
                         "bytes can hold)")
        kv: Dict[str, Any] = {}
        kv_types: Dict[str, int] = {}
        kv_offsets: Dict[str, Tuple[int, int]] = {}
        for _ in range(n_kv):
            at = f.tell()
            key = r.string()
            if not key:
                raise r.fail("empty key")
            if key in kv:
                raise r.fail(f"duplicate key {key!r}")
            type_at = f.tell()
            gtype = r.unpack("<I")
            kv[key] = r.value(gtype)
            kv_types[key] = gtype
            kv_offsets[key] = (at, type_at)
        alignment = kv.get("general.alignment", ALIGNMENT)
        if "general.alignment" in kv and kv_types["general.alignment"] != GGUF_UINT32:
            raise r.fail(f"general.alignment must be a uint32, not of gguf type {kv_types['general.alignment']}")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise r.fail(f"bad general.alignment {alignment!r}")
        tensors = []
        ti_offset = f.tell()
        for _ in range(n_tensors):
            info_at = f.tell()
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims < 1 or n_dims > 4:
                raise r.fail(f"tensor {name!r} has {n_dims} dimensions")
            shape = list(struct.unpack(f"<{n_dims}q", r.read(8 * n_dims)))
            if any(d < 0 for d in shape):
                raise r.fail(f"tensor {name!r} has a negative dimension {shape}")
            gtype = r.unpack("<I")
            offset = r.unpack("<Q")
            info = GGML_TYPES.get(gtype)
            if info is None:
                raise r.fail(f"tensor {name!r} has an unknown tensor type {gtype}")
            nbytes = None
            if info is not None:
                if shape[0] % info[1]:
                    raise r.fail(f"tensor {name!r}: row length {shape[0]} not a multiple of {info[1]} ({info[0]})")
                nbytes = _nbytes(tuple(shape), gtype)
            tensors.append({"name": name, "shape": shape, "type": gtype,
                            "type_name": info[0] if info else f"type{gtype}",
                            "offset": offset, "nbytes": nbytes, "info_offset": info_at})
        data_offset = _pad(f.tell(), alignment) if n_tensors else f.tell()
    expected: Optional[int] = 0  # None once a tensor of unknown type size was seen
    for t in tensors:
        t["file_offset"] = data_offset + t["offset"]
        if t["offset"] % alignment:
            raise ValueError(f"{path}: not a valid GGUF file: tensor {t['name']!r} offset "
                             f"{t['offset']} is not aligned to {alignment}")
        if expected is not None and t["offset"] != expected:
            raise ValueError(f"{path}: not a valid GGUF file: tensor {t['name']!r} has offset "
                             f"{t['offset']}, expected {expected}")
        if t["nbytes"] is None:
            expected = None
            continue
        end = t["file_offset"] + t["nbytes"]
        if end > size:
            raise ValueError(f"{path}: truncated GGUF file: tensor {t['name']!r} ends at byte "
                             f"{end}, file has {size}")
        if expected is not None:
            expected += _pad(t["nbytes"], alignment)
    return {
        "path": path, "version": version, "alignment": alignment, "n_kv": n_kv,
        "n_tensors": n_tensors, "kv": kv, "kv_types": kv_types, "tensors": tensors,
        "data_offset": data_offset, "file_size": size,
        # where each part starts in the file (bench/fuzz_gguf.py aims its corruptions with these)
        "kv_offsets": kv_offsets, "ti_offset": ti_offset,
    }


def header(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """read_gguf_header's result for `path`, parsed once per file and version of it (its size and modification
    time, inode): what the facts below read. Do not change the dict it returns: later callers get the same one."""
    st = os.stat(path)
    return _header(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _header(path: str, size: int, mtime_ns: int) -> Dict[str, Any]:
    return read_gguf_header(path)

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
        header(path)
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
    kv = header(path)["kv"]
    return _arch_int(kv, "block_count"), _arch_int(kv, "leading_dense_block_count")


def _arch_int(kv: dict, key: str) -> int:
    """The integer GGUF key `<arch>.<key>` of a header's key-values (the first of an array); 0 where absent."""
    n = kv.get(f"{kv.get('general.architecture', '')}.{key}", 0)
    return int(n[0] if isinstance(n, list) else n) if n else 0


def embedding_length(path: Union[str, Path]) -> int:
    """The model's hidden size (GGUF key `<arch>.embedding_length`); 0 where the file does not say."""
    return _arch_int(header(path)["kv"], "embedding_length")


def block_count(path: Union[str, Path]) -> int:
    """The model's repeating layers (GGUF key `<arch>.block_count`); 0 where the file does not say.

    Args:
        path: the GGUF file (checked by check_model_path first).
    Returns:
        The layer count, or 0 when the metadata has none.
    """
    return layer_counts(path)[0]


def _expert_tensors(model: Union[str, os.PathLike]) -> list[tuple[int, int]]:
    """(layer, bytes) of each expert tensor, from the header's tensor index."""
    out = []
    for t in header(model)["tensors"]:
        m = re.fullmatch(rf"blk\.(\d+)\.{EXPERT_TENSORS}\.weight", t["name"])
        if m:
            out.append((int(m.group(1)), int(t["nbytes"])))
    return out


def expert_bytes_per_layer(model: Union[str, os.PathLike]) -> float:
    """Bytes of a MoE layer's expert tensors (gate, up, down), the mean over the layers (the header's index)."""
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
    return _arch_int(header(model)["kv"], "expert_used_count"), max(per_layer.values(), default=0)


def expert_tensor_shape(model: Union[str, os.PathLike]) -> Optional[tuple[int, int, int, int]]:
    """The model's largest expert tensor as (ggml type id, ne0, ne1, n_expert): what one expert op reads from (None: no
    experts). The CPU expert-rate probe runs this shape."""
    best = None
    for t in header(model)["tensors"]:
        if re.fullmatch(rf"blk\.\d+\.{EXPERT_TENSORS}\.weight", t["name"]) and len(t["shape"]) == 3 and \
                (best is None or t["nbytes"] > best["nbytes"]):
            best = t
    return (best["type"], *best["shape"]) if best else None


def expert_tensor_bytes(model: Union[str, os.PathLike]) -> int:
    """Bytes of the model's largest expert tensor: what one expert copy moves (0: no experts)."""
    return max((n for _, n in _expert_tensors(model)), default=0)


def synth_routing(path: Union[str, Path]) -> str:
    """The routing mode a synthetic model was written with (GGUF key `pyllama_pp.synth.routing`); "" for other files.

    Args:
        path: the GGUF file (checked by check_model_path first).
    """
    return str(header(path)["kv"].get("pyllama_pp.synth.routing", ""))


def routes_by_stream(path: Union[str, Path]) -> bool:
    """Whether the model's routing follows a stream of consecutive token ids (a synthetic model of a mode in
    synth.STREAM_ROUTINGS, "locality"): its tests feed such a stream, every other model random tokens."""
    return synth_routing(path) in STREAM_ROUTINGS
