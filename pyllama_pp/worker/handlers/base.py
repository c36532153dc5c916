"""What every handler needs: the job's session, the tokens of a test, and the patched build's switch table."""
from __future__ import annotations

import numpy as np

from ... import binding
from ...errors import ConfigError
from ...jobs import Job
from ...plan import Plan
from ...session import Session
from ...switches import value_of


def open_session(job: Job) -> Session:
    """The Session a job describes: its model with its plan, or with its devices, placement and context.

    Raises:
        ConfigError: for a job without a model; whatever Session raises.
    """
    if not job.model:
        raise ConfigError(f"a {job.kind} job needs a model")
    if job.plan:   # a fit plan (Plan.to_dict()): its devices, placement and context
        return Session(job.model, plan=Plan.from_dict(job.plan), variant=job.variant, switches=job.switches or None)
    return Session(job.model, devices=job.devices, placement=job.placement, ctx=job.ctx, variant=job.variant,
                   switches=job.switches or None)


def random_tokens(n: int, n_vocab: int, seed: int) -> np.ndarray:
    """n token ids drawn uniformly from the vocabulary (the same ones for the same seed)."""
    return np.random.default_rng(seed).integers(0, n_vocab, n, dtype=np.int64)


def bench_tokens(n: int, n_vocab: int, seed: int, stream: bool = False) -> np.ndarray:
    """The n tokens of a test (the same ones for the same seed): random_tokens, or with `stream` n consecutive ids from
    a seeded start (wrapping at n_vocab), for a model whose routing follows such a stream
    (model_file.routes_by_stream: a synthetic model with routing "locality" routes consecutive ids to slowly changing
    experts, as real decode does)."""
    if not stream:
        return random_tokens(n, n_vocab, seed)
    start = int(np.random.default_rng(seed).integers(0, max(n_vocab - n, 0) + 1))
    return (start + np.arange(n, dtype=np.int64)) % n_vocab


def switch_table(native: binding.Native) -> list[dict]:
    """The variant's switch table as its library holds it (one dict a switch: name, type, default, min, max, values,
    meaning, value); [] for a library without the extension (the baseline)."""
    if native.lib.pp_ext_version() <= 0:
        return []
    ffi, switches = native.ffi, []
    name, desc, val = ffi.new("char[64]"), ffi.new("char[512]"), ffi.new("int64_t *")
    typ, values, lo, hi, dflt = ffi.new("char[16]"), ffi.new("char[64]"), ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int64_t *")
    for i in range(64):
        if native.lib.pp_ext_param_info(i, name, 64, val, desc, 512) != 0:
            break
        native.check(native.lib.pp_ext_param_spec(i, typ, 16, dflt, lo, hi, values, 64))
        accepted = [int(v) for v in native.str(values).split(",") if v]
        value = int(val[0])
        if native.str(typ) == "ints":   # (one value per device: a list reads as its text, "-2,-4")
            text = ffi.new("char[512]")
            native.check(native.lib.pp_ext_get_param_text(name, text, 512))
            value = value_of(native.str(text))
        switches.append({"name": native.str(name), "type": native.str(typ), "default": int(dflt[0]),
                         "min": int(lo[0]), "max": int(hi[0]), "values": accepted or None,
                         "meaning": native.str(desc), "value": value})
    return switches


def switch_defaults(native: binding.Native) -> dict:
    """The variant's switches' defaults, NAME -> value ({} for the baseline): what a result's rows compare the
    switches a run set against, so that one set to its default is not reported as set."""
    return {sw["name"]: sw["default"] for sw in switch_table(native)}
