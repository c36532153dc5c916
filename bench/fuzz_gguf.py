"""Hostile GGUFs through the load path: corrupted headers, metadata and tensor tables, each load in its own worker.

Each case takes the tiny synthetic model and damages it one way (truncated at an offset; a flipped byte in the
header, a metadata entry or a tensor info; a huge count, length or dimension; a bad value, element or tensor type;
a bad general.alignment; a tensor offset past the end or out of line), then loads it in a worker ("schedule" job,
CPU) and sorts the outcome:

  clean     a ModelError (exit code 3): the file was refused with a reason
  loaded    the file loaded anyway (the damage hit a value nothing checks, e.g. a token's text)
  other     another error class (exit 3), or a bug in pyllama_pp (exit 4)
  crash     the worker was killed by a signal (llama.cpp crashed or aborted) or timed out

    python bench/fuzz_gguf.py --iterations 400 --seed 1 [--no-check] [--out DIR] [--show crash,other]

--no-check skips pyllama_pp's own GGUF check before llama.cpp sees the file (PYLLAMA_PP_GGUF_CHECK=0): what
llama.cpp alone does with each case. The table is printed; --out writes cases.jsonl and summary.json.
tests/test_gguf_fuzz.py runs a fixed handful of these cases in CI.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path

from pyllama_pp import model_file, synth
from pyllama_pp.errors import PyllamaError
from pyllama_pp.worker import run_job

HUGE_U64 = [2**64 - 1, 2**63 - 1, 2**63, 2**62, 2**40, 2**32 + 1, 2**32 - 1, 2**31]
KINDS = ("truncate", "flip_header", "flip_kv", "flip_ti", "huge_count", "huge_length", "huge_dim", "n_dims",
         "bad_kv_type", "bad_array_type", "bad_tensor_type", "bad_alignment", "bad_offset")


def _put(buf: bytearray, at: int, fmt: str, value) -> None:
    struct.pack_into(fmt, buf, at, value)


def _kv_entry(key: str, gtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", gtype) + payload


def mutate(data: bytes, layout: dict, rng: random.Random, kind: str) -> tuple[bytes, str]:
    """One damaged copy of `data` (a valid GGUF whose read_gguf_header is `layout`) and what was done to it."""
    buf = bytearray(data)
    kv = list(layout["kv_offsets"].items())
    tensors = layout["tensors"]
    if kind == "truncate":
        where = rng.choice(["header", "kv", "ti", "data"])
        lo, hi = {"header": (0, 24), "kv": (24, layout["ti_offset"]), "ti": (layout["ti_offset"], layout["data_offset"]),
                  "data": (layout["data_offset"], len(data) - 1)}[where]
        at = rng.randrange(lo, hi)
        return bytes(buf[:at]), f"truncated at {at} ({where})"
    if kind == "flip_header":
        at = rng.randrange(0, 24)
        buf[at] ^= rng.randrange(1, 256)
        return bytes(buf), f"byte {at} of the header flipped"
    if kind == "flip_kv":
        key, (at, type_at) = rng.choice(kv)
        pos = rng.randrange(at, type_at + 4 + 16)   # its key length, key, type and the start of its value
        buf[pos] ^= rng.randrange(1, 256)
        return bytes(buf), f"byte {pos} of metadata {key!r} flipped"
    if kind == "flip_ti":
        t = rng.choice(tensors)
        pos = rng.randrange(t["info_offset"], t["info_offset"] + 8 + len(t["name"]) + 4 + 8 * len(t["shape"]) + 12)
        buf[pos] ^= rng.randrange(1, 256)
        return bytes(buf), f"byte {pos} of tensor info {t['name']!r} flipped"
    if kind == "huge_count":
        field, at = rng.choice([("n_tensors", 8), ("n_kv", 16)])
        v = rng.choice(HUGE_U64 + [layout[field] + 1, layout[field] * 1000])
        _put(buf, at, "<Q", v)
        return bytes(buf), f"{field} = {v}"
    if kind == "huge_length":
        key, (at, type_at) = rng.choice(kv)
        v = rng.choice(HUGE_U64)
        what = rng.choice(["key length", "value"])
        if what == "key length" or layout["kv_types"][key] not in (model_file.GGUF_STRING, model_file.GGUF_ARRAY):
            _put(buf, at, "<Q", v)
            return bytes(buf), f"key length of {key!r} = {v}"
        # a string's length, or an array's element count (after its element type)
        off = type_at + 4 + (4 if layout["kv_types"][key] == model_file.GGUF_ARRAY else 0)
        _put(buf, off, "<Q", v)
        return bytes(buf), f"length of {key!r} = {v}"
    if kind in ("huge_dim", "n_dims", "bad_tensor_type", "bad_offset"):
        t = rng.choice(tensors)
        at = t["info_offset"] + 8 + len(t["name"].encode())
        n_dims = len(t["shape"])
        if kind == "n_dims":
            v = rng.choice([0, 5, 255, 2**31, 2**32 - 1])
            _put(buf, at, "<I", v)
            return bytes(buf), f"{t['name']}: n_dims = {v}"
        if kind == "huge_dim":
            d = rng.randrange(n_dims)
            v = rng.choice([2**63 - 1, 2**62, 2**40, 2**31, 0, -1, -(2**63)])
            _put(buf, at + 4 + 8 * d, "<q", v)
            return bytes(buf), f"{t['name']}: ne[{d}] = {v}"
        type_at = at + 4 + 8 * n_dims
        if kind == "bad_tensor_type":
            v = rng.choice([4, 5, 31, 32, 33, 36, 40, 41, 100, 255, 2**31, 2**32 - 1, 0, 1, 12])
            _put(buf, type_at, "<I", v)
            return bytes(buf), f"{t['name']}: type = {v}"
        v = rng.choice([len(data), 2**63, 2**64 - 32, t["offset"] + 1, t["offset"] + 16, 0, t["offset"] + 2**32])
        _put(buf, type_at + 4, "<Q", v)
        return bytes(buf), f"{t['name']}: offset = {v}"
    if kind == "bad_kv_type":
        key, (at, type_at) = rng.choice(kv)
        v = rng.choice([13, 14, 100, 255, 2**31, 2**32 - 1] + list(range(13)))
        _put(buf, type_at, "<I", v)
        return bytes(buf), f"type of {key!r} = {v}"
    if kind == "bad_array_type":
        arrays = [(k, p) for k, p in kv if layout["kv_types"][k] == model_file.GGUF_ARRAY]
        key, (at, type_at) = rng.choice(arrays)
        v = rng.choice([model_file.GGUF_ARRAY, 13, 255, 2**32 - 1] + list(range(13)))
        _put(buf, type_at + 4, "<I", v)
        return bytes(buf), f"element type of {key!r} = {v}"
    if kind == "bad_alignment":
        # a general.alignment entry first in the metadata, the rest as it was (tensor infos padded to the alignment
        # where it is a sane one, so only the alignment itself is wrong)
        gtype, fmt, v = rng.choice([(model_file.GGUF_UINT32, "<I", a) for a in (0, 3, 24, 48, 64, 2**31, 2**32 - 1)]
                                   + [(model_file.GGUF_UINT64, "<Q", 64), (model_file.GGUF_STRING, None, "32")])
        payload = struct.pack(fmt, v) if fmt else struct.pack("<Q", len(v)) + v.encode()
        head = bytearray(data[:24])
        _put(head, 16, "<Q", layout["n_kv"] + 1)
        meta = _kv_entry("general.alignment", gtype, payload) + data[24:layout["ti_offset"]]
        infos = data[layout["ti_offset"]:layout["ti_offset"] + sum(
            8 + len(t["name"].encode()) + 4 + 8 * len(t["shape"]) + 12 for t in tensors)]
        out = bytes(head) + meta + infos
        pad_to = v if isinstance(v, int) and 0 < v <= 4096 else layout["alignment"]
        out += b"\0" * (-len(out) % pad_to)
        return out + data[layout["data_offset"]:], f"general.alignment = {v!r} (gguf type {gtype})"
    raise ValueError(kind)


def classify(exc: "BaseException | None") -> str:
    if exc is None:
        return "loaded"
    code = getattr(exc, "exit_code", None)
    if code is None or code < 0:
        return "crash"
    return "clean" if getattr(exc, "error_type", "") == "ModelError" and code == 3 else "other"


def load_in_worker(path: str, check: bool = True, timeout: float = 60.0) -> "BaseException | None":
    """Load `path` in a worker (CPU, a small context); None when it loaded, else the error."""
    job = {"kind": "schedule", "model": path, "devices": "cpu", "ctx": {"n_ctx": 64, "n_batch": 32, "n_ubatch": 32}}
    env = None if check else {"PYLLAMA_PP_GGUF_CHECK": "0"}
    try:
        run_job(job, "baseline", timeout=timeout, env=env)
        return None
    except PyllamaError as e:
        return e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", "-n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="llama.cpp alone: skip pyllama_pp's GGUF check")
    ap.add_argument("--out", type=Path, help="folder for cases.jsonl and summary.json")
    ap.add_argument("--show", default="crash,other", help="outcomes whose cases are listed (default: crash,other)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    model = tmp / "tiny.gguf"
    synth.write_gguf(str(model), synth.preset("tiny", seed=1))
    data = model.read_bytes()
    layout = model_file.read_gguf_header(model)
    counts: dict = collections.defaultdict(collections.Counter)
    cases = []
    t0 = time.time()
    bad = tmp / "bad.gguf"
    for i in range(args.iterations):
        kind = KINDS[i % len(KINDS)]
        blob, what = mutate(data, layout, rng, kind)
        bad.write_bytes(blob)
        err = load_in_worker(str(bad), check=not args.no_check)
        outcome = classify(err)
        counts[kind][outcome] += 1
        cases.append({"i": i, "kind": kind, "what": what, "outcome": outcome,
                      "error_type": getattr(err, "error_type", None), "exit_code": getattr(err, "exit_code", 0),
                      "message": str(err) if err else ""})
        if outcome in args.show.split(","):
            print(f"  #{i} {kind}: {what} -> {outcome}: {str(err)[:200]}", file=sys.stderr)
    secs = time.time() - t0
    outcomes = ("clean", "loaded", "other", "crash")
    print(f"\nGGUF fuzz: {args.iterations} cases, seed {args.seed}, "
          f"{'llama.cpp alone (--no-check)' if args.no_check else 'pyllama_pp check + llama.cpp'}, {secs:.0f} s\n")
    print(f"| {'damage':<16} | " + " | ".join(f"{o:>6}" for o in outcomes) + " |")
    print(f"| {'-' * 16} | " + " | ".join("-----:" for _ in outcomes) + " |")
    for kind in KINDS:
        print(f"| {kind:<16} | " + " | ".join(f"{counts[kind][o]:>6}" for o in outcomes) + " |")
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    print(f"| {'all':<16} | " + " | ".join(f"{total[o]:>6}" for o in outcomes) + " |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "cases.jsonl", "w") as f:
            for c in cases:
                f.write(json.dumps(c) + "\n")
        (args.out / "summary.json").write_text(json.dumps(
            {"iterations": args.iterations, "seed": args.seed, "check": not args.no_check, "seconds": secs,
             "totals": dict(total), "by_kind": {k: dict(v) for k, v in counts.items()},
             "machine": f"{os.uname().nodename} ({os.cpu_count()} cores)",
             "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    return 1 if total["crash"] or total["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
