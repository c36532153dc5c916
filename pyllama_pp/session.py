"""The Python API: a model placed on devices (`Placement`), a `Session` that schedules and evaluates it.

Data flows one way: model -> placement (or a fit plan) -> session -> schedule / eval results -> rows.
A session loads one variant into this process (see binding.load); use pyllama_pp.worker to run the
other variant in its own process.
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from . import binding, devices as devspec
from .errors import (ConfigError, DecodeError, DeviceError, DeviceSpecError, ModelError, OutOfMemoryError,
                     PyllamaError, UnsupportedError, is_device_fault, one_statement)

# upstream's patterns for expert tensors (common/fit.cpp LAYER_FRACTION_MOE)
EXPERT_TENSORS = r"ffn_(up|down|gate|gate_up)_(ch)?exps"
LOAD_MODES = {"none": 0, "mmap": 1}
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}


def host_expert_overrides(host_experts: Union[str, int, Sequence[int], None], n_layer: Optional[int] = None) -> list[str]:
    """Tensor overrides that keep experts in host RAM: "all", "none", N (the first N layers, like
    --n-cpu-moe) or an explicit list of layers."""
    if host_experts in (None, "none", 0):
        return []
    if host_experts == "all":
        return [rf"blk\.\d+\.{EXPERT_TENSORS}=CPU"]
    if isinstance(host_experts, str):
        if host_experts.isdigit():
            host_experts = int(host_experts)
        else:
            raise ConfigError(f"host_experts must be 'all', 'none', a count or a list of layers, not {host_experts!r}")
    if isinstance(host_experts, int) and host_experts < 0:
        raise ConfigError(f"host_experts takes a count >= 0 (the first N layers), not {host_experts}")
    try:
        layers = list(range(host_experts)) if isinstance(host_experts, int) else sorted(set(int(i) for i in host_experts))
    except (TypeError, ValueError):
        raise ConfigError(f"host_experts must be 'all', 'none', a count or a list of layers, not {host_experts!r}") from None
    if n_layer is not None and layers and (layers[0] < 0 or layers[-1] >= n_layer):
        raise ConfigError(f"host-expert layers {layers} outside the model's 0..{n_layer - 1}")
    return [rf"blk\.({'|'.join(map(str, layers))})\.{EXPERT_TENSORS}=CPU"] if layers else []


@dataclass
class Placement:
    """Where the weights go (llama_model_params). Defaults: every layer on the devices, layer split, experts on
    the devices, load mode none (no mmap: host weights in pinned memory where the device offers it)."""

    n_gpu_layers: int = -1
    split_mode: str = "layer"
    tensor_split: Optional[list[float]] = None
    host_experts: Union[str, int, list[int], None] = "none"
    overrides: list[str] = field(default_factory=list)   # extra "PATTERN=BUFT" entries
    load_mode: str = "none"
    no_host: bool = False
    main_gpu: int = 0

    def __post_init__(self):
        host_expert_overrides(self.host_experts)  # raises ConfigError for a value it cannot place
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode must be one of {sorted(LOAD_MODES)}, not {self.load_mode!r}")
        if self.split_mode not in SPLIT_MODES:
            raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {self.split_mode!r}")
        _check_int("n_gpu_layers", self.n_gpu_layers, -1)

    def all_overrides(self, n_layer: Optional[int] = None) -> list[str]:
        return host_expert_overrides(self.host_experts, n_layer) + list(self.overrides)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ContextParams:
    """llama_context_params that matter here."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0
    flash_attn: int = 1
    op_offload: bool = True
    offload_kqv: bool = True

    def __post_init__(self):
        _check_int("n_ctx", self.n_ctx, 0)
        _check_int("n_batch", self.n_batch, 1)
        _check_int("n_ubatch", self.n_ubatch, 1)
        _check_int("n_threads", self.n_threads, 0)
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"n_ubatch ({self.n_ubatch}) cannot exceed n_batch ({self.n_batch}): "
                              "lower n_ubatch or raise n_batch")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_int(name: str, value, lowest: int) -> None:
    """A whole number in [lowest, 2**31 - 1] (llama.cpp's int32 fields), else a ConfigError that says so."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be a whole number, not {value!r}")
    if not lowest <= value <= 2**31 - 1:
        raise ConfigError(f"{name} must be between {lowest} and {2**31 - 1}, not {value}")


@dataclass
class ModelInfo:
    path: str
    desc: str
    arch: str
    size_bytes: int
    n_params: int
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    n_expert: int
    n_expert_used: int
    n_ctx_train: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BackendInfo:
    name: str
    buft: str
    compute_buffer_bytes: int


@dataclass
class SplitInput:
    name: str
    kind: str          # "host weight", "user input" or "activation"
    bytes: int         # as the scheduler prints it (K/M rounded)


@dataclass
class Split:
    index: int
    backend: str
    n_nodes: int
    inputs: list[SplitInput]


@dataclass
class Schedule:
    """The scheduler's view of the reserved graph (and, with detail=True, of one ubatch's splits)."""

    variant: str
    pipeline_parallel: bool
    n_copies: int
    n_splits: int
    backends: list[BackendInfo]
    memory: list[dict]
    ext: Optional[dict] = None
    splits: list[Split] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_frame(self):
        """One row per split when the detail is there, else one row per backend."""
        import pandas as pd
        if self.splits:
            return pd.DataFrame([{"split": sp.index, "backend": sp.backend, "n_nodes": sp.n_nodes,
                                  "n_inputs": len(sp.inputs),
                                  "host_weight_bytes": sum(i.bytes for i in sp.inputs if i.kind == "host weight"),
                                  "user_input_bytes": sum(i.bytes for i in sp.inputs if i.kind == "user input"),
                                  "activation_bytes": sum(i.bytes for i in sp.inputs if i.kind == "activation"),
                                  "inputs": ", ".join(i.name for i in sp.inputs)} for sp in self.splits])
        return pd.DataFrame([asdict(b) for b in self.backends])


_SIZE = {"K": 1024, "M": 1024**2, "G": 1024**3}
_USER_INPUTS = re.compile(r"^(inp_|attn_inp_|out_ids|inp_embd|leaf_|pos|kq_mask|self_)")


def parse_split_listing(text: str) -> list[Split]:
    """Parse GGML_SCHED_DEBUG=2's listing; returns the splits of the LAST graph in `text`."""
    graphs: list[list[Split]] = []
    cur: Optional[Split] = None
    for line in text.splitlines():
        m = re.match(r"## SPLIT #(\d+): (\S+) # (\d+) inputs(?::\s*(.*))?$", line.strip())
        if m:
            idx = int(m.group(1))
            if idx == 0:
                graphs.append([])
            if not graphs:
                graphs.append([])
            inputs = []
            for name, size in re.findall(r"\[(.+?) \(\s*([0-9.]+[KMG]?)\)\]", m.group(4) or ""):
                num, unit = re.match(r"([0-9.]+)([KMG]?)", size).groups()
                nbytes = int(float(num) * _SIZE.get(unit, 1))
                kind = ("host weight" if name.endswith(".weight") else
                        "user input" if _USER_INPUTS.match(name) else "activation")
                inputs.append(SplitInput(name, kind, nbytes))
            cur = Split(idx, m.group(2), 0, inputs)
            graphs[-1].append(cur)
        elif line.startswith("node #") and cur is not None:
            cur.n_nodes += 1
    return graphs[-1] if graphs else []


@dataclass
class EvalResult:
    """Logits (n_out x n_vocab float32), wall time, and the counters that moved during the eval."""

    logits: np.ndarray
    seconds: float
    n_tokens: int
    counters: dict
    ext: Optional[dict] = None

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "n_tokens": self.n_tokens, "tokens_per_second": self.tokens_per_second,
                "counters": self.counters, "ext": self.ext, "logits_shape": list(self.logits.shape)}


COUNTER_FIELDS = ("h2d_bytes", "d2h_bytes", "d2d_bytes", "h2d_copies", "d2h_copies", "d2d_copies", "graph_computes",
                  "host_syncs", "event_records", "event_waits", "alloc_bytes", "peak_alloc_bytes", "failed_allocs",
                  "link_busy_s", "compute_s", "gathers", "beside_gathers", "chained_gathers", "buffer_allocs",
                  "hd_copies")
# device counters that are levels (bytes allocated now, the peak, counts since the devices were made), not counts
# per eval: deltas keep the later value
LEVEL_FIELDS = ("alloc_bytes", "peak_alloc_bytes", "buffer_allocs", "hd_copies")


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
    from .synth import read_gguf_header
    try:
        read_gguf_header(path)
    except (ValueError, struct.error, OverflowError, MemoryError, UnicodeError) as e:
        why = str(e).removeprefix(f"{path}: ").removeprefix("not a valid GGUF file: ")
        raise ModelError(f"{path} is not a valid GGUF file: {why} (a damaged or truncated file? write one with "
                         "`pyllama-pp synth` or convert your model with llama.cpp's tools)") from None


class Session:
    """A model loaded with a placement on a device spec, plus one llama context.

    >>> s = Session("tiny.gguf", devices="vdev:2x0@0", placement=Placement(host_experts="all"))
    >>> s.schedule().pipeline_parallel
    """

    def __init__(self, model: Union[str, os.PathLike], devices: Union[str, dict, devspec.DeviceSpec, None] = "cpu",
                 placement: Optional[Placement] = None, ctx: Optional[ContextParams] = None,
                 variant: str = "patched", ext_params: Optional[dict] = None, plan=None):
        self.path = Path(model)
        check_model_path(self.path)
        if plan is not None:
            # a fit plan (pyllama_pp.fit.Plan, or its file): its devices, placement and context, for this model only
            from .fit import Plan
            plan = plan if isinstance(plan, Plan) else Plan.load(plan)
            if placement is not None:
                raise ConfigError("give a plan or a placement, not both")
            plan.check(self.path, None if devices in (None, "cpu") else devices)
            devices, placement = plan.devices_spec, plan.placement()
            ctx = ctx or plan.context_params()
            if variant == "patched":   # the switches the plan's memory was measured with (yours win)
                ext_params = {**plan.ext_params(), **(ext_params or {})}
        self.plan = plan
        self.spec = devspec.parse(devices)
        self.placement = placement or Placement()
        self.ctx_params = ctx or ContextParams()
        self.native = binding.load(variant)
        self.variant = variant
        self._model = None
        self._ctx = None
        self._check_switch_env()
        self._apply_ext_params(ext_params or {})
        dev_names = self._setup_devices()
        self._load_model(dev_names)
        self._ctx = self._new_context(coverage=False)

    # -- setup -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._model is None:
            raise PyllamaError(f"this Session of {self.path.name} is closed (close(), or the end of its with-block, "
                               "freed its model): create a new Session")

    def _check_switch_env(self) -> None:
        """The patched build: GGML_SCHED_PP_* variables its switch table does not accept are an error here (the
        library would log them and use the defaults). The baseline has no table and reads none of them."""
        lib = self.native.lib
        if lib.pp_ext_version() <= 0:
            return
        buf = self.native.ffi.new("char[8192]")
        n = lib.pp_ext_env_problems(buf, 8192)
        if n == lib.PP_ERR_UNSUPPORTED:
            return
        self.native.check(n)
        if n > 0:
            problems = [line for line in self.native.str(buf).splitlines() if line]
            raise ConfigError("the patched scheduler does not accept " + "; ".join(problems) +
                              ". Fix: unset or correct the variable (pyllama-pp info lists the switches)")

    def _apply_ext_params(self, params: dict) -> None:
        if not params:
            return
        if self.native.lib.pp_ext_version() <= 0:
            raise UnsupportedError(f"the {self.variant} build has no scheduler switches ({sorted(params)})")
        for k, v in params.items():
            try:
                self.native.check(self.native.lib.pp_ext_set_param(k.upper().encode(), int(v)))
            except UnsupportedError:
                raise
            except PyllamaError as e:
                raise ConfigError(str(e)) from None

    def _setup_devices(self) -> str:
        return register_devices(self.native, self.spec)

    def _load_model(self, dev_names: str) -> None:
        lib, ffi = self.native.lib, self.native.ffi
        pl = self.placement
        if pl.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode must be one of {sorted(LOAD_MODES)}, not {pl.load_mode!r}")
        if pl.split_mode not in SPLIT_MODES:
            raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {pl.split_mode!r}")
        keep = []

        def cstr(s: str):
            b = ffi.new("char[]", s.encode())
            keep.append(b)
            return b

        p = ffi.new("pp_model_params *")
        p.path = cstr(str(self.path))
        p.n_gpu_layers = 0 if self.spec.kind == "cpu" else pl.n_gpu_layers
        p.split_mode = SPLIT_MODES[pl.split_mode]
        p.main_gpu = pl.main_gpu
        for i, v in enumerate((pl.tensor_split or [])[:16]):
            p.tensor_split[i] = float(v)
        p.devices = cstr(dev_names)
        ov = pl.all_overrides()
        p.overrides = cstr("\n".join(ov)) if ov else ffi.NULL
        p.load_mode = LOAD_MODES[pl.load_mode]
        p.no_host = int(pl.no_host)
        p.use_extra_bufts = 0
        m = lib.pp_model_load(p)
        if m == ffi.NULL:
            raw = self.native.last_error()
            msg = one_statement(raw)
            low = msg.lower()
            if is_device_fault(raw):
                raise DeviceError(msg)
            if "failed to allocate" in low or "out of memory" in low or "unable to allocate" in low or \
                    "out of (virtual) memory" in low:
                raise OutOfMemoryError(msg + ". Fix: put fewer layers on the devices (--ngl), keep experts in host "
                                             "RAM (--host-experts all), or give the devices more memory")
            raise ModelError(msg + " (not a valid GGUF for this build? check the file, or write one with "
                                   "`pyllama-pp synth`)")
        self._model = m
        info = ffi.new("pp_model_info *")
        self.native.check(lib.pp_model_get_info(m, info))
        s = self.native.str
        self.info = ModelInfo(str(self.path), s(info.desc), s(info.arch), info.size_bytes, info.n_params, info.n_layer,
                              info.n_embd, info.n_vocab, info.n_head, info.n_head_kv, info.n_expert, info.n_expert_used,
                              info.n_ctx_train)

    @staticmethod
    def _check_ctx(c: "ContextParams") -> None:
        if c.n_ubatch > c.n_batch:
            raise ConfigError(f"n_ubatch ({c.n_ubatch}) cannot exceed n_batch ({c.n_batch}): lower n_ubatch or raise n_batch")

    def _new_context(self, coverage: bool):
        self._check_open()
        lib, ffi = self.native.lib, self.native.ffi
        c = self.ctx_params
        self._check_ctx(c)
        p = ffi.new("pp_context_params *")
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = c.n_ctx, c.n_batch, c.n_ubatch, 1
        # llama's default (4) oversubscribes small machines and starves big ones; llama-bench uses the cores
        p.n_threads = c.n_threads if c.n_threads > 0 else max(1, os.cpu_count() or 1)
        p.flash_attn = c.flash_attn
        p.op_offload = int(c.op_offload)
        p.offload_kqv = int(c.offload_kqv)
        p.coverage = int(coverage)
        ctx = lib.pp_context_new(self._model, p)
        if ctx == ffi.NULL:
            raw = self.native.last_error()
            raise (DeviceError if is_device_fault(raw) else OutOfMemoryError)(one_statement(raw))
        return ctx

    def set_context(self, ctx: ContextParams) -> None:
        """Replace the llama context (n_batch, n_ubatch, n_ctx, ...) and keep the loaded model: a sweep over
        batch sizes then loads a large model once."""
        self._check_open()
        self._check_ctx(ctx)  # before the current context is freed
        old, self.ctx_params = self.ctx_params, ctx
        if self._ctx is not None:
            self.native.lib.pp_context_free(self._ctx)
            self._ctx = None
        try:
            self._ctx = self._new_context(coverage=False)
        except Exception:
            self.ctx_params = old  # keep a usable session: the previous context again
            self._ctx = self._new_context(coverage=False)
            raise

    # -- facts ---------------------------------------------------------------------------------------------
    def schedule(self, _ctx=None) -> Schedule:
        """Pipeline parallel on/off, copies, splits and per-backend buffers of the reserved (or last) graph."""
        self._check_open()
        lib, ffi, s = self.native.lib, self.native.ffi, self.native.str
        ctx = _ctx if _ctx is not None else self._ctx
        si = ffi.new("pp_sched_info *")
        self.native.check(lib.pp_get_sched_info(ctx, si))
        backends = [BackendInfo(s(si.backends[i].name), s(si.backends[i].buft), si.backends[i].compute_buffer_bytes)
                    for i in range(min(si.n_backends, 18))]
        rows = ffi.new("pp_memory_row[64]")
        n = self.native.check(lib.pp_get_memory_breakdown(ctx, rows, 64))
        memory = [{"buft": s(rows[i].buft), "device": s(rows[i].device), "model_bytes": rows[i].model_bytes,
                   "context_bytes": rows[i].context_bytes, "compute_bytes": rows[i].compute_bytes} for i in range(n)]
        return Schedule(self.variant, bool(si.pipeline_parallel), si.n_copies, si.n_splits, backends, memory,
                        self.ext_stats())

    def schedule_detail(self, n_tokens: Optional[int] = None) -> Schedule:
        """schedule() plus the splits of one real ubatch (device, node count, inputs by kind and size), read from
        the scheduler's own debug listing in a separate context (so timed contexts never print it)."""
        self._check_open()
        lib, ffi = self.native.lib, self.native.ffi
        old = os.environ.get("GGML_SCHED_DEBUG")
        os.environ["GGML_SCHED_DEBUG"] = "2"      # read when the scheduler is created
        try:
            ctx = self._new_context(coverage=False)
        finally:
            if old is None:
                os.environ.pop("GGML_SCHED_DEBUG", None)
            else:
                os.environ["GGML_SCHED_DEBUG"] = old
        try:
            n = n_tokens or min(self.ctx_params.n_ubatch, self.ctx_params.n_ctx)
            toks = self._tokens(np.arange(n) % self.info.n_vocab)
            lib.pp_log_capture(1)
            try:
                self._decode(ctx, toks, 0, np.zeros(0, dtype=np.int32))
                self.native.check(lib.pp_synchronize(ctx))
            finally:
                lib.pp_log_capture(0)
            size = lib.pp_log_captured(ffi.NULL, 0)
            buf = ffi.new("char[]", size + 1)
            lib.pp_log_captured(buf, size + 1)
            text = ffi.string(buf).decode(errors="replace")
            sched = self.schedule(_ctx=ctx)   # n_splits etc. of this ubatch's graph
        finally:
            lib.pp_context_free(ctx)
        sched.splits = parse_split_listing(text)
        return sched

    def ext_stats(self) -> Optional[dict]:
        """The patched scheduler's counters (None in the baseline)."""
        self._check_open()
        lib, ffi = self.native.lib, self.native.ffi
        if lib.pp_ext_version() <= 0:
            return None
        buf = ffi.new("char[65536]")
        self.native.check(lib.pp_ext_get_stats_json(self._ctx, buf, 65536))
        stats = json.loads(ffi.string(buf).decode())
        for b in stats.get("backends", []):   # GATHER's bytes where the device counts them (CUDA's library)
            n = lib.pp_gather_counted(b["name"].encode())
            if n >= 0:
                b["gather_bytes"] = n
        return stats

    def device_counters(self) -> list[dict]:
        """Per-VDEV counters (bytes moved per direction, syncs, ...); empty for other devices."""
        lib, ffi = self.native.lib, self.native.ffi
        out = []
        for i in range(lib.pp_vdev_count() if self.spec.kind == "vdev" else 0):
            c = ffi.new("struct pp_vdev_counters *")
            self.native.check(lib.pp_vdev_get_counters(i, c))
            out.append({"device": f"VDEV{i}", **{k: getattr(c, k) for k in COUNTER_FIELDS}})
        return out

    def reset_counters(self) -> None:
        self.native.lib.pp_vdev_reset_counters()

    # -- eval ----------------------------------------------------------------------------------------------
    def _decode(self, ctx, tokens: np.ndarray, pos0: int, out_idx: np.ndarray) -> np.ndarray:
        lib, ffi = self.native.lib, self.native.ffi
        n_vocab = self.info.n_vocab
        logits = np.empty((len(out_idx), n_vocab), dtype=np.float32)
        rc = lib.pp_decode(ctx, ffi.cast("int32_t *", tokens.ctypes.data), len(tokens), pos0, 0,
                           ffi.cast("int32_t *", out_idx.ctypes.data), len(out_idx),
                           ffi.cast("float *", logits.ctypes.data))
        self.native.check(rc)
        return logits

    def _tokens(self, tokens: Iterable[int]) -> np.ndarray:
        t = np.ascontiguousarray(np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens,
                                            dtype=np.int64))
        if t.ndim != 1 or t.size == 0:
            raise DecodeError("tokens must be a non-empty 1-D sequence of token ids")
        bad = np.flatnonzero((t < 0) | (t >= self.info.n_vocab))
        if bad.size:
            raise DecodeError(f"token {int(t[bad[0]])} at index {int(bad[0])} is out of range: this model has "
                              f"{self.info.n_vocab} tokens (0..{self.info.n_vocab - 1})")
        return t.astype(np.int32)

    def eval(self, tokens: Iterable[int], logits: Union[str, Sequence[int]] = "last", pos0: int = 0,
             clear: bool = True, stats: bool = True) -> EvalResult:
        """Decode tokens (in n_batch chunks) and return the requested logits: "last", "all", "none" or indices.
        stats=False skips the patched scheduler's counters (a JSON round trip): use it in per-token loops, so that
        both variants pay the same harness overhead."""
        self._check_open()
        t = self._tokens(tokens)
        if logits == "last":
            out_idx = np.array([len(t) - 1], dtype=np.int32)
        elif logits == "all":
            out_idx = np.arange(len(t), dtype=np.int32)
        elif logits == "none":
            out_idx = np.zeros(0, dtype=np.int32)
        else:
            out_idx = np.asarray(sorted(set(int(i) for i in logits)), dtype=np.int32)
        if pos0 + len(t) > self.ctx_params.n_ctx:
            raise DecodeError(f"{pos0 + len(t)} positions do not fit in n_ctx={self.ctx_params.n_ctx}")
        lib = self.native.lib
        if clear:
            self.native.check(lib.pp_memory_clear(self._ctx))
        self.native.check(lib.pp_synchronize(self._ctx))
        before = self.device_counters()
        t0 = time.perf_counter()
        out = self._decode(self._ctx, t, pos0, out_idx)
        self.native.check(lib.pp_synchronize(self._ctx))
        dt = time.perf_counter() - t0
        after = self.device_counters()
        delta = [{k: (a[k] - b[k] if isinstance(a[k], (int, float)) and k not in LEVEL_FIELDS else a[k]) for k in a}
                 for a, b in zip(after, before)]
        return EvalResult(out, dt, len(t), {"devices": delta}, self.ext_stats() if stats else None)

    # -- the KV cache, edited as a server does ---------------------------------------------------------------
    def kv_remove(self, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) of the sequence from the KV cache (p1 < 0: to the end). Rewinding to p0 before an
        eval(pos0=p0, clear=False) needs it: llama.cpp refuses positions that do not follow the last one held."""
        self._check_open()
        self.native.check(self.native.lib.pp_memory_seq_rm(self._ctx, 0, int(p0), int(p1)))

    def kv_shift(self, p0: int, p1: int, delta: int) -> None:
        """Move positions [p0, p1) by delta (p1 < 0: to the end); the keys are rotated at the next eval."""
        self._check_open()
        self.native.check(self.native.lib.pp_memory_seq_add(self._ctx, 0, int(p0), int(p1), int(delta)))

    def kv_pos_max(self) -> int:
        """The largest position the KV cache holds (-1: none)."""
        self._check_open()
        ffi = self.native.ffi
        out = ffi.new("int32_t *")
        self.native.check(self.native.lib.pp_memory_seq_pos_max(self._ctx, 0, out))
        return int(out[0])

    def context_shift(self, n_keep: int, n_discard: int) -> int:
        """llama.cpp's context shift (llama-cli, the server): drop positions [n_keep, n_keep + n_discard), move the
        rest down by n_discard; returns the next position to decode at."""
        end = self.kv_pos_max() + 1
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > end:
            raise DecodeError(f"cannot discard {n_discard} positions after {n_keep} kept: the cache holds {end}")
        self.kv_remove(n_keep, n_keep + n_discard)
        self.kv_shift(n_keep + n_discard, -1, -n_discard)
        return end - n_discard

    def coverage(self, tokens: Iterable[int], exclusive: bool = False) -> dict:
        """Experts used per MoE layer per ubatch for these tokens, measured in a separate context (the
        measurement syncs the host once per layer, so it is never part of a timed run). exclusive: free the
        session's own context meanwhile (its KV cache is lost, a fresh one follows), so that the two never hold
        device memory at once - for sessions whose memory a fit plan sized for one context."""
        self._check_open()
        t = self._tokens(tokens)
        lib, ffi = self.native.lib, self.native.ffi
        if exclusive and self._ctx is not None:
            lib.pp_context_free(self._ctx)
            self._ctx = None
        try:
            ctx = self._new_context(coverage=True)
            try:
                self._decode(ctx, t, 0, np.zeros(0, dtype=np.int32))
                n = lib.pp_coverage_count(ctx)
                rows = ffi.new("pp_coverage_row[]", max(n, 1))
                n = self.native.check(lib.pp_coverage_get(ctx, rows, n))
                recs = [(rows[i].layer, rows[i].n_tokens, rows[i].n_used) for i in range(n)]
            finally:
                lib.pp_context_free(ctx)
        finally:
            if self._ctx is None:
                self._ctx = self._new_context(coverage=False)
        # keep layers that saw the whole ubatch: the last layer of a graph runs only on the output rows
        full, ubatch = [], 0
        for layer, n_tok, used in recs:
            if layer == 0 or n_tok > ubatch:
                ubatch = n_tok
            if n_tok == ubatch and n_tok > 0:
                full.append((layer, n_tok, used))
        recs = full
        n_expert = max(self.info.n_expert, 1)
        per_layer: dict[int, list[int]] = {}
        for layer, _, used in recs:
            per_layer.setdefault(layer, []).append(used)
        mean_used = float(np.mean([u for _, _, u in recs])) if recs else 0.0
        return {"n_expert": self.info.n_expert, "n_expert_used": self.info.n_expert_used,
                "experts_used_per_layer_ubatch": mean_used, "coverage": mean_used / n_expert,
                "n_records": len(recs), "per_layer_mean": {k: float(np.mean(v)) for k, v in sorted(per_layer.items())}}

    # -- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        lib = self.native.lib
        if self._ctx is not None:
            lib.pp_context_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            lib.pp_model_free(self._model)
            self._model = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def register_devices(native, spec: "devspec.DeviceSpec") -> str:
    """Set up the devices of `spec` in this process (VDEVs are registered once per process); returns the device
    names for pp_model_params.devices ("none": CPU only)."""
    lib, ffi = native.lib, native.ffi
    if spec.kind == "cpu":
        return "none"
    if spec.kind == "vdev":
        n = len(spec.vdevs)
        have = lib.pp_vdev_count()
        if have and have != n:
            raise DeviceSpecError(f"this process already has {have} virtual devices; {n} were asked for. "
                                  "Use one device count per process (workers do this for you).")
        cfg = ffi.new("struct pp_vdev_config[]", n)
        for i, v in enumerate(spec.vdevs):
            cfg[i].memory_bytes = v.memory
            cfg[i].link_gbps = v.link_gbps
            cfg[i].link_group = v.link_group
            cfg[i].compute_factor = v.speed
            cfg[i].n_threads = v.threads
            cfg[i].d2d_gbps = v.d2d_gbps
            cfg[i].direct_read = v.direct_read
            cfg[i].row_pad = v.row_pad
            cfg[i].fail_alloc_at = v.fail_alloc_after + 1 if v.fail_alloc_after >= 0 else 0
            cfg[i].fail_copy_at = v.fail_copy_after + 1 if v.fail_copy_after >= 0 else 0
            cfg[i].fault_abort = int(v.fault_abort)
        err = ffi.new("char[512]")
        if lib.pp_vdev_register(cfg, n, err, 512) != 0:
            raise DeviceSpecError(f"cannot set up the virtual devices: {ffi.string(err).decode()}")
        return ",".join(f"VDEV{i}" for i in range(n))
    # cuda
    cuda = [d for d in list_devices() if d["backend"] == "CUDA"]
    if not cuda:
        raise DeviceSpecError("no CUDA device found: this build has no CUDA backend or the machine has no GPU. "
                              "Rebuild with CMAKE_ARGS='-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90' or use "
                              "--devices cpu / vdev:2x768MiB@4GBps")
    ids = spec.cuda_ids or list(range(len(cuda)))
    bad = [i for i in ids if i >= len(cuda)]
    if bad:
        raise DeviceSpecError(f"CUDA device(s) {bad} do not exist; this machine has {len(cuda)}")
    return ",".join(cuda[i]["name"] for i in ids)


def list_devices(variant: Optional[str] = None) -> list[dict]:
    """Devices the loaded (or given) variant sees: name, backend, type, memory, caps."""
    native = binding.loaded() or binding.load(variant or "patched")
    lib, ffi, s = native.lib, native.ffi, native.str
    out = []
    for i in range(lib.pp_device_count()):
        d = ffi.new("pp_device_info *")
        native.check(lib.pp_device_get(i, d))
        out.append({"name": s(d.name), "description": s(d.description), "backend": s(d.backend), "type": d.type,
                    "memory_free": d.memory_free, "memory_total": d.memory_total, "async": bool(d.caps_async),
                    "events": bool(d.caps_events), "host_buffer": bool(d.caps_host_buffer)})
    return out
