"""A model on devices (`Session`): its schedule, its evaluation, its KV cache, edited as a server does.

Data flows one way: model -> placement (or a fit plan) -> session -> schedule / eval results -> rows. A session
loads one variant into this process (binding.load); the worker (pyllama_pp.worker) runs the other variant in its
own process. The native handles live in two small owners, `LoadedModel` and `Context`, each freed once, by
close() or at the end of a with-block; `Session` holds one of each.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from . import binding
from . import devices as devspec
from .counters import device_delta
from .defaults import CONTEXT, threads
from .errors import (ConfigError, DecodeError, DeviceError, ModelError, OutOfMemoryError, PyllamaError,
                     UnsupportedError, is_device_fault, one_statement)
from .expert_trace import ExpertTrace
from .model_file import check_model_path
from .params import LOAD_MODES, SPLIT_MODES, ContextParams, Placement, as_context, as_placement
from .plan import Plan
from .rpc.client import add_host_cache_counts, host_weight_bytes


@dataclass
class ModelInfo:
    """What llama.cpp read from the model file."""

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
    """A backend of the scheduler and its compute buffer."""

    name: str
    buft: str
    compute_buffer_bytes: int


# a split input's kind -> the column of its bytes in Schedule.to_frame()
INPUT_COLUMNS = {"host weight": "host_weight_bytes", "user input": "user_input_bytes", "activation": "activation_bytes"}


@dataclass
class SplitInput:
    """An input of a split: a host weight, a user input or an activation, with its size."""

    name: str
    kind: str          # "host weight", "user input" or "activation" (INPUT_COLUMNS)
    bytes: int         # as the scheduler prints it (K/M rounded)


@dataclass
class Split:
    """One split of a graph: the backend that runs it, its node count and its inputs."""

    index: int
    backend: str
    n_nodes: int
    inputs: list[SplitInput]

    def input_bytes(self) -> dict:
        """The bytes of the split's inputs by kind: {"host_weight_bytes", "user_input_bytes", "activation_bytes"}."""
        out = dict.fromkeys(INPUT_COLUMNS.values(), 0)
        for i in self.inputs:
            out[INPUT_COLUMNS[i.kind]] += i.bytes
        return out


def apply_switches(native: binding.Native, variant: str, switches: Optional[dict]) -> None:
    """Set the patched build's switches in this process (pp_ext_set_param: the scheduler reads them when it is made):
    how a run's and a fit dry run's switches reach C.

    Raises:
        UnsupportedError: for switches on a build without the table (the baseline).
        ConfigError: for a name the table does not know or a value out of its range.
    """
    if not switches:
        return
    if native.lib.pp_ext_version() <= 0:
        raise UnsupportedError(f"the {variant} build has no scheduler switches ({sorted(switches)})")
    for k, v in switches.items():
        try:
            if isinstance(v, str) and "," in v:   # (a switch of type "ints": one value per device)
                native.check(native.lib.pp_ext_set_param_text(str(k).upper().encode(), v.encode()))
            else:
                native.check(native.lib.pp_ext_set_param(str(k).upper().encode(), int(v)))
        except UnsupportedError:
            raise
        except PyllamaError as e:
            raise ConfigError(str(e)) from None


def env_problems(native: binding.Native) -> list[str]:
    """The GGML_SCHED_PP_* variables of this process's environment that the variant's switch table does not accept (a
    name it does not know, a value out of range), one line each; none for a build without the table."""
    if native.lib.pp_ext_version() <= 0:
        return []
    buf = native.ffi.new("char[8192]")
    n = native.lib.pp_ext_env_problems(buf, 8192)
    if n == native.lib.PP_ERR_UNSUPPORTED:
        return []
    native.check(n)
    return [line for line in native.str(buf).splitlines() if line] if n > 0 else []


@dataclass
class Schedule:
    """The scheduler's view of the reserved graph (Session.schedule / schedule_detail).

    Attributes:
        variant: the build that made it, "patched" or "baseline".
        pipeline_parallel: whether the scheduler runs the devices as a pipeline.
        n_copies: the copies of the graph's inputs the pipeline keeps (1 without pipeline parallelism).
        n_splits: the graph's split count (a split: a run of nodes on one backend).
        backends: one BackendInfo per backend: its name, buffer type and compute buffer bytes.
        memory: one dict per buffer type: buft, device, model_bytes, context_bytes, compute_bytes.
        ext: the patched scheduler's counters (None in the baseline).
        splits: one ubatch's splits (Split: backend, node count, inputs); filled by Session.schedule_detail() only.
    """

    variant: str
    pipeline_parallel: bool
    n_copies: int
    n_splits: int
    backends: list[BackendInfo]
    memory: list[dict]
    ext: Optional[dict] = None
    splits: list[Split] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The schedule as JSON-ready data.

        Returns:
            dict: the fields, nested dataclasses as dicts.
        """
        return asdict(self)

    def to_frame(self):
        """The schedule as a table.

        Returns:
            pandas.DataFrame: one row per split (backend, nodes, input bytes by kind) when `splits` is filled, else
            one row per backend (name, buft, compute_buffer_bytes).
        """
        import pandas as pd   # (here, not at the top: worker processes import this module and never need pandas)
        if self.splits:
            return pd.DataFrame([{"split": sp.index, "backend": sp.backend, "n_nodes": sp.n_nodes,
                                  "n_inputs": len(sp.inputs), **sp.input_bytes(),
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
    """What Session.eval gives: the logits, the wall time and the counters that moved during the eval.

    Attributes:
        logits: float32 array of n_out x n_vocab (n_out: the tokens whose logits were asked for).
        seconds: the decode's wall time, device work included.
        n_tokens: the tokens decoded.
        counters: {"devices": [...]}: per VDEV, the counters that moved (bytes per direction, syncs, ...).
        ext: the patched scheduler's counters after the eval (None in the baseline, or with stats=False).
    """

    logits: np.ndarray
    seconds: float
    n_tokens: int
    counters: dict
    ext: Optional[dict] = None

    @property
    def tokens_per_second(self) -> float:
        """float: n_tokens / seconds (NaN for a zero time)."""
        return self.n_tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        """The result as JSON-ready data, without the logits themselves.

        Returns:
            dict: seconds, n_tokens, tokens_per_second, counters, ext and logits_shape.
        """
        return {"seconds": self.seconds, "n_tokens": self.n_tokens, "tokens_per_second": self.tokens_per_second,
                "counters": self.counters, "ext": self.ext, "logits_shape": list(self.logits.shape)}




def model_params(native, path, dev_names: str, placement: Placement) -> tuple:
    """The native model parameters of a placement (pp_model_params), as a load and fit's measure of a placement take
    them.

    Args:
        native: the loaded variant (binding.load).
        path: the GGUF file.
        dev_names: the device names for the model ("none": the CPU only).
        placement: where the weights go.
    Returns:
        (the pp_model_params pointer, the cffi objects it points into: keep them while it is used).
    """
    ffi = native.ffi
    overrides = placement.all_overrides()
    keep = [ffi.new("char[]", s.encode()) for s in [str(path), dev_names] + overrides]
    p = ffi.new("pp_model_params *")
    p.path, p.devices = keep[0], keep[1]
    p.n_gpu_layers = 0 if dev_names == "none" else placement.n_gpu_layers
    p.split_mode = SPLIT_MODES[placement.split_mode]
    p.main_gpu = placement.main_gpu
    for i, v in enumerate((placement.tensor_split or ())[:16]):
        p.tensor_split[i] = float(v)
    items = ffi.new("const char *[]", keep[2:] or [ffi.NULL])
    p.overrides, p.n_overrides = items, len(overrides)
    p.load_mode = LOAD_MODES[placement.load_mode]
    p.no_host = int(placement.no_host)
    p.use_extra_bufts = 0
    return p, keep + [items]


class LoadedModel:
    """Owns one loaded llama model (its native handle) and what llama.cpp read from the file.

    Args:
        native: the loaded variant (binding.load).
        path: the GGUF file (checked by the caller).
        dev_names: the device names for the model ("none": the CPU only).
        placement: where the weights go.
    Raises:
        OutOfMemoryError: when the weights do not fit on the devices.
        DeviceError: when a device fails while the weights are copied.
        ModelError: when llama.cpp cannot load the file.
    """

    def __init__(self, native, path: Path, dev_names: str, placement: Placement):
        self.native = native
        lib, ffi = native.lib, native.ffi
        p, keep = model_params(native, path, dev_names, placement)
        handle = lib.pp_model_load(p)
        if handle == ffi.NULL:
            raw = native.last_error()
            msg = one_statement(raw)
            low = msg.lower()
            if is_device_fault(raw):
                raise DeviceError(msg)
            if re.search(r"allocate rpc\d+\[[^]]+\]_host buffer", low):
                raise OutOfMemoryError(msg + ". Fix: that RPC server's host memory cannot hold the host experts of "
                                             "its devices' layers: free memory there or start it with a larger "
                                             "--host-ram, add a host, or plan within it with `pyllama-pp fit`")
            if "failed to allocate" in low or "out of memory" in low or "unable to allocate" in low or \
                    "out of (virtual) memory" in low:
                raise OutOfMemoryError(msg + ". Fix: put fewer layers on the devices (--ngl), keep experts in host "
                                             "RAM (--host-experts all), or give the devices more memory")
            raise ModelError(msg + " (not a valid GGUF for this build? check the file, or write one with "
                                   "`pyllama-pp synth`)")
        self.handle = handle
        info = ffi.new("pp_model_info *")
        native.check(lib.pp_model_get_info(handle, info))
        s = native.str
        self.info = ModelInfo(str(path), s(info.desc), s(info.arch), info.size_bytes, info.n_params, info.n_layer,
                              info.n_embd, info.n_vocab, info.n_head, info.n_head_kv, info.n_expert,
                              info.n_expert_used, info.n_ctx_train)

    @property
    def closed(self) -> bool:
        """Whether the model was freed."""
        return self.handle is None

    def context(self, params: ContextParams, coverage: bool = False, trace=None) -> "Context":
        """A new llama context on this model (see Context)."""
        return Context(self, params, coverage, trace)

    def close(self) -> None:
        """Free the model (once; later calls do nothing). Free its contexts first."""
        if self.handle is not None:
            self.native.lib.pp_model_free(self.handle)
            self.handle = None


class Context:
    """Owns one llama context (its native handle) on a LoadedModel; a with-block frees it at its end.

    Args:
        model: the loaded model.
        params: the context's parameters.
        coverage: record the experts each MoE layer uses (one host sync per layer: never in a timed context).
        trace: a native pp_trace (cdata) that records each token's expert ids (the same sync; not with coverage);
            it must outlive the context.
    Raises:
        OutOfMemoryError: when the context's buffers do not fit on the devices.
        DeviceError: when a device fails while they are made.
    """

    def __init__(self, model: LoadedModel, params: ContextParams, coverage: bool = False, trace=None):
        self.native, self.params = model.native, params
        lib, ffi = self.native.lib, self.native.ffi
        p = ffi.new("pp_context_params *")
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = params.n_ctx, params.n_batch, params.n_ubatch, 1
        # llama's default (4) oversubscribes small machines and starves big ones; llama-bench uses the cores
        p.n_threads = threads(params.n_threads)
        p.flash_attn = params.flash_attn
        p.op_offload = int(params.op_offload)
        p.offload_kqv = int(params.offload_kqv)
        p.coverage = int(coverage)
        p.trace = trace if trace is not None else ffi.NULL
        handle = lib.pp_context_new(model.handle, p)
        if handle == ffi.NULL:
            raw = self.native.last_error()
            raise (DeviceError if is_device_fault(raw) else OutOfMemoryError)(one_statement(raw))
        self.handle = handle

    def close(self) -> None:
        """Free the context (once; later calls do nothing)."""
        if self.handle is not None:
            self.native.lib.pp_context_free(self.handle)
            self.handle = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A model loaded with a placement on a device spec, plus one llama context.

    Args:
        model: the GGUF file.
        devices: a device spec: "cpu", "cuda", "cuda:0,1", "vdev:2x768MiB@4GBps", a JSON dict or DeviceSpec.
        placement: where the weights go, a Placement or its dict (default: every layer on the devices, experts too).
        ctx: the context's parameters, a ContextParams or its dict (default: ContextParams()).
        variant: "patched" (default) or "baseline"; one process holds one of them.
        switches: the patched build's scheduler switches, NAME -> value (`pyllama-pp info` lists them); they hold
            for the whole process. Mistyped GGML_SCHED_PP_* variables in the environment are refused here too.
        plan: a fit Plan (or its file) for this model: its devices, placement, context and switches (yours win);
            give it instead of placement.
    Raises:
        ModelError: for a missing or damaged model file.
        DeviceSpecError: for a device spec that does not parse, or that this machine cannot satisfy.
        ConfigError: for a bad switch (given, or a mistyped GGML_SCHED_PP_* variable), a plan together with a
            placement, or parameters out of range.
        TypeError: for switches that are not a dict, or a placement or ctx of the wrong type.
        PlanError: for a plan made for another model or other devices, or a plan file that cannot be read.
        OutOfMemoryError: when the model or the context does not fit.
        DeviceError: when a device fails while the weights are copied.
        UnsupportedError: for switches on the baseline.
        VariantError: when this process already holds the other variant.
        BuildError: when the variant is not built.

    >>> with Session("tiny.gguf", devices="vdev:2x0@0", placement=Placement(host_experts="all")) as s:
    ...     s.schedule().pipeline_parallel, s.eval(range(64)).logits.shape
    """

    def __init__(self, model: Union[str, os.PathLike],
                 devices: Union[str, dict, devspec.DeviceSpec, None] = CONTEXT.devices,
                 placement: Union[Placement, dict, None] = None, ctx: Union[ContextParams, dict, None] = None,
                 variant: str = CONTEXT.variant, switches: Optional[dict] = None, plan: Union[Plan, str, os.PathLike, None] = None):
        self.path = Path(model)
        check_model_path(self.path)
        if switches is not None and not isinstance(switches, dict):
            raise TypeError(f"switches must be a dict NAME -> value, not {type(switches).__name__}")
        if plan is not None:
            plan = plan if isinstance(plan, Plan) else Plan.load(plan)
            if placement is not None:
                raise ConfigError("give a plan or a placement, not both")
            plan.check(self.path, None if devices in (None, "cpu") else devices)
            devices, placement = plan.devices_spec, plan.placement()
            ctx = ctx or plan.context_params()
            if variant == "patched":   # the switches the plan's memory was measured with (yours win)
                switches = {**plan.switches, **(switches or {})}
        self.plan = plan
        self.spec = devspec.parse(devices)
        self.placement = as_placement(placement)
        self.ctx_params = as_context(ctx)
        self.native = binding.load(variant)
        self.variant = variant
        self._model: Optional[LoadedModel] = None
        self._ctx: Optional[Context] = None
        self._check_switch_env()
        self._apply_switches(switches or {})
        dev_names = self.spec.register(self.native)
        self._model = LoadedModel(self.native, self.path, dev_names, self.placement)
        self.info = self._model.info
        self._ctx = self._model.context(self.ctx_params)

    # -- setup -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._model is None or self._model.closed:
            raise PyllamaError(f"this Session of {self.path.name} is closed (close(), or the end of its with-block, "
                               "freed its model): create a new Session")

    def _check_switch_env(self) -> None:
        """The patched build: GGML_SCHED_PP_* variables its switch table does not accept are an error here (the
        library would log them and use the defaults). The baseline has no table and reads none of them."""
        problems = env_problems(self.native)
        if problems:
            raise ConfigError("the patched scheduler does not accept " + "; ".join(problems) +
                              ". Fix: unset or correct the variable (pyllama-pp info lists the switches)")

    def _apply_switches(self, switches: dict) -> None:
        apply_switches(self.native, self.variant, switches)

    def set_context(self, ctx: Union[ContextParams, dict]) -> None:
        """Replace the llama context (n_batch, n_ubatch, n_ctx, ...) and keep the loaded model: a sweep over batch
        sizes then loads a large model once.

        Args:
            ctx: the new context's parameters, a ContextParams or its dict form.
        Raises:
            OutOfMemoryError: when the new context does not fit (the session keeps its previous one).
            ConfigError: for parameters out of range.
            TypeError: for a ctx that is neither a ContextParams nor a dict.
            PyllamaError: on a closed session.
        """
        self._check_open()
        ctx = as_context(ctx)
        old, self.ctx_params = self.ctx_params, ctx
        self._ctx.close()
        try:
            self._ctx = self._model.context(ctx)
        except Exception:
            self.ctx_params = old  # keep a usable session: the previous context again
            self._ctx = self._model.context(old)
            raise

    # -- facts ---------------------------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """The scheduler's view of the reserved (or last) graph.

        Returns:
            Schedule: pipeline parallel on/off, copies, split count, per-backend buffers, memory per buffer type,
            the patched counters; `splits` stays empty (schedule_detail() lists one ubatch's splits).
        Raises:
            PyllamaError: on a closed session.
        """
        self._check_open()
        return self._schedule(self._ctx)

    def _schedule(self, ctx: Context) -> Schedule:
        lib, ffi, s = self.native.lib, self.native.ffi, self.native.str
        si = ffi.new("pp_sched_info *")
        self.native.check(lib.pp_get_sched_info(ctx.handle, si))
        backends = [BackendInfo(s(si.backends[i].name), s(si.backends[i].buft), si.backends[i].compute_buffer_bytes)
                    for i in range(min(si.n_backends, 18))]
        rows = ffi.new("pp_memory_row[64]")
        n = self.native.check(lib.pp_get_memory_breakdown(ctx.handle, rows, 64))
        memory = [{"buft": s(rows[i].buft), "device": s(rows[i].device), "model_bytes": rows[i].model_bytes,
                   "context_bytes": rows[i].context_bytes, "compute_bytes": rows[i].compute_bytes} for i in range(n)]
        return Schedule(self.variant, bool(si.pipeline_parallel), si.n_copies, si.n_splits, backends, memory,
                        self._ext_stats(ctx))

    def schedule_detail(self, n_tokens: Optional[int] = None) -> Schedule:
        """schedule() plus the splits of one real ubatch (device, node count, inputs by kind and size), read from
        the scheduler's own debug listing in a separate context (so timed contexts never print it). The session's
        own context is freed meanwhile (a fresh one follows), so that the two never hold device memory at once.

        Args:
            n_tokens: the ubatch's size (default: n_ubatch, at most n_ctx).
        Returns:
            Schedule: as schedule() gives it, with `splits` filled.
        Raises:
            PyllamaError: on a closed session.
            OutOfMemoryError: when the debug context does not fit.
            DecodeError: when the ubatch cannot be decoded.
        """
        self._check_open()
        lib, ffi = self.native.lib, self.native.ffi
        n = n_tokens or min(self.ctx_params.n_ubatch, self.ctx_params.n_ctx)
        toks = self._tokens(np.arange(n) % self.info.n_vocab)
        self._ctx.close()
        try:
            with self._debug_context() as ctx:
                lib.pp_log_capture(1)
                try:
                    self._decode(ctx, toks, 0, np.zeros(0, dtype=np.int32))
                    self.native.check(lib.pp_synchronize(ctx.handle))
                finally:
                    lib.pp_log_capture(0)
                size = lib.pp_log_captured(ffi.NULL, 0)
                buf = ffi.new("char[]", size + 1)
                lib.pp_log_captured(buf, size + 1)
                text = ffi.string(buf).decode(errors="replace")
                sched = self._schedule(ctx)   # n_splits etc. of this ubatch's graph
        finally:
            self._ctx = self._model.context(self.ctx_params)
        sched.splits = parse_split_listing(text)
        return sched

    def _debug_context(self) -> Context:
        """A context whose scheduler prints its splits (GGML_SCHED_DEBUG=2 is read when a scheduler is made)."""
        old = os.environ.get("GGML_SCHED_DEBUG")
        os.environ["GGML_SCHED_DEBUG"] = "2"
        try:
            return self._model.context(self.ctx_params)
        finally:
            if old is None:
                os.environ.pop("GGML_SCHED_DEBUG", None)
            else:
                os.environ["GGML_SCHED_DEBUG"] = old

    def ext_stats(self) -> Optional[dict]:
        """The patched scheduler's counters.

        Returns:
            dict | None: the counters as the library reports them (per backend, bytes moved, syncs, ...); None in
            the baseline.
        Raises:
            PyllamaError: on a closed session.
        """
        self._check_open()
        return self._ext_stats(self._ctx)

    def _ext_stats(self, ctx: Context) -> Optional[dict]:
        lib, ffi = self.native.lib, self.native.ffi
        if lib.pp_ext_version() <= 0:
            return None
        buf = ffi.new("char[65536]")
        self.native.check(lib.pp_ext_get_stats_json(ctx.handle, buf, 65536))
        stats = json.loads(ffi.string(buf).decode())
        for b in stats.get("backends", []):   # GATHER's bytes where the device counts them (CUDA's library)
            n = lib.pp_gather_counted(b["name"].encode())
            if n >= 0:
                b["gather_bytes"] = n
            n = host_weight_bytes(self.native, b["name"])   # a patched RPC server's own copies
            if n >= 0:
                b["weight_bytes"] += n
            add_host_cache_counts(self.native, b)   # ... and its own expert cache's counters
        return stats

    def device_counters(self) -> list[dict]:
        """The VDEV counters since the last reset.

        Returns:
            list[dict]: one dict per VDEV: "device" (VDEV0, ...) and its counters (bytes moved per direction,
            syncs, ...); empty for other devices.
        """
        return self.spec.device_counters(self.native)

    def reset_counters(self) -> None:
        """Zero the VDEV counters (the peak allocation becomes the current one)."""
        self.native.lib.pp_vdev_reset_counters()

    def synchronize(self) -> None:
        """Wait until every device has finished the work submitted so far.

        Raises:
            PyllamaError: on a closed session.
            DeviceError: when a device failed while it ran.
        """
        self._check_open()
        self.native.check(self.native.lib.pp_synchronize(self._ctx.handle))

    # -- eval ----------------------------------------------------------------------------------------------
    def _decode(self, ctx: Context, tokens: np.ndarray, pos0: int, out_idx: np.ndarray) -> np.ndarray:
        lib, ffi = self.native.lib, self.native.ffi
        logits = np.empty((len(out_idx), self.info.n_vocab), dtype=np.float32)
        rc = lib.pp_decode(ctx.handle, ffi.cast("int32_t *", tokens.ctypes.data), len(tokens), pos0, 0,
                           ffi.cast("int32_t *", out_idx.ctypes.data), len(out_idx),
                           ffi.cast("float *", logits.ctypes.data))
        self.native.check(rc)
        return logits

    def _tokens(self, tokens: Iterable[int]) -> np.ndarray:
        try:
            t = np.ascontiguousarray(np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens,
                                                dtype=np.int64))
        except (TypeError, ValueError):
            raise TypeError("tokens must be a sequence of token ids (ints)") from None
        if t.ndim != 1 or t.size == 0:
            raise DecodeError("tokens must be a non-empty 1-D sequence of token ids")
        bad = np.flatnonzero((t < 0) | (t >= self.info.n_vocab))
        if bad.size:
            raise DecodeError(f"token {int(t[bad[0]])} at index {int(bad[0])} is out of range: this model has "
                              f"{self.info.n_vocab} tokens (0..{self.info.n_vocab - 1})")
        return t.astype(np.int32)

    def eval(self, tokens: Iterable[int], logits: Union[str, Sequence[int]] = "last", pos0: int = 0,
             clear: bool = True, stats: bool = True) -> EvalResult:
        """Decode tokens (in n_batch chunks) and return the requested logits.

        Args:
            tokens: token ids, each in 0..n_vocab-1.
            logits: "last" (default), "all", "none" or the indices of the tokens whose logits to return.
            pos0: the position of the first token.
            clear: empty the KV cache first (default); False continues after what it holds.
            stats: read the patched scheduler's counters afterwards (a JSON round trip): False in per-token loops,
                so that both variants pay the same harness overhead.
        Returns:
            EvalResult: logits (n_out x n_vocab float32), seconds, tokens, the device counters that moved.
        Raises:
            DecodeError: for an empty sequence, a token out of range, positions past n_ctx, or a failed decode.
            TypeError: for tokens that are not ints.
            ConfigError: for a `logits` word other than last, all or none.
            DeviceError: when a device fails during the decode.
            PyllamaError: on a closed session.
        """
        self._check_open()
        t = self._tokens(tokens)
        if logits == "last":
            out_idx = np.array([len(t) - 1], dtype=np.int32)
        elif logits == "all":
            out_idx = np.arange(len(t), dtype=np.int32)
        elif logits == "none":
            out_idx = np.zeros(0, dtype=np.int32)
        elif isinstance(logits, str):
            raise ConfigError(f"logits takes 'last', 'all', 'none' or a list of token indices, not {logits!r}")
        else:
            out_idx = np.asarray(sorted(set(int(i) for i in logits)), dtype=np.int32)
        if pos0 + len(t) > self.ctx_params.n_ctx:
            raise DecodeError(f"{pos0 + len(t)} positions do not fit in n_ctx={self.ctx_params.n_ctx}")
        lib = self.native.lib
        if clear:
            self.native.check(lib.pp_memory_clear(self._ctx.handle))
        self.native.check(lib.pp_synchronize(self._ctx.handle))
        before = self.device_counters()
        t0 = time.perf_counter()
        out = self._decode(self._ctx, t, pos0, out_idx)
        self.native.check(lib.pp_synchronize(self._ctx.handle))
        dt = time.perf_counter() - t0
        delta = device_delta(self.device_counters(), before)
        return EvalResult(out, dt, len(t), {"devices": delta}, self.ext_stats() if stats else None)

    # -- the KV cache, edited as a server does ---------------------------------------------------------------
    def kv_remove(self, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) of the sequence from the KV cache. Rewinding to p0 before an
        eval(pos0=p0, clear=False) needs it: llama.cpp refuses positions that do not follow the last one held.

        Args:
            p0: the first position to drop (>= 0).
            p1: the position after the last one to drop; < 0: to the end.
        Raises:
            UnsupportedError: when the model's memory cannot remove part of a sequence.
            PyllamaError: for p0 < 0, or on a closed session.
        """
        self._check_open()
        self.native.check(self.native.lib.pp_memory_seq_rm(self._ctx.handle, 0, int(p0), int(p1)))

    def kv_shift(self, p0: int, p1: int, delta: int) -> None:
        """Move positions [p0, p1) by delta; the keys are rotated at the next eval.

        Args:
            p0: the first position to move (>= 0).
            p1: the position after the last one to move; < 0: to the end.
            delta: how far to move them (negative: down).
        Raises:
            UnsupportedError: when the model's memory cannot shift positions.
            PyllamaError: for p0 < 0, or on a closed session.
        """
        self._check_open()
        self.native.check(self.native.lib.pp_memory_seq_add(self._ctx.handle, 0, int(p0), int(p1), int(delta)))

    def kv_pos_max(self) -> int:
        """The largest position the KV cache holds.

        Returns:
            int: that position; -1 when the cache is empty.
        Raises:
            PyllamaError: on a closed session.
        """
        self._check_open()
        out = self.native.ffi.new("int32_t *")
        self.native.check(self.native.lib.pp_memory_seq_pos_max(self._ctx.handle, 0, out))
        return int(out[0])

    def context_shift(self, n_keep: int, n_discard: int) -> int:
        """llama.cpp's context shift (llama-cli, the server): drop positions [n_keep, n_keep + n_discard), move the
        rest down by n_discard.

        Args:
            n_keep: the positions kept at the start (>= 0).
            n_discard: the positions dropped after them (>= 1).
        Returns:
            int: the next position to decode at.
        Raises:
            DecodeError: for a negative n_keep, n_discard < 1, or more positions than the cache holds.
            UnsupportedError: when the model's memory cannot remove or shift positions.
            PyllamaError: on a closed session.
        """
        end = self.kv_pos_max() + 1
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > end:
            raise DecodeError(f"cannot discard {n_discard} positions after {n_keep} kept: the cache holds {end}")
        self.kv_remove(n_keep, n_keep + n_discard)
        self.kv_shift(n_keep + n_discard, -1, -n_discard)
        return end - n_discard

    def coverage(self, tokens: Iterable[int], exclusive: bool = False) -> dict:
        """Experts used per MoE layer per ubatch for these tokens, measured in a separate context (the measurement
        syncs the host once per layer, so it is never part of a timed run).

        Args:
            tokens: the prompt.
            exclusive: free the session's own context meanwhile (its KV cache is lost, a fresh one follows), so that
                the two never hold device memory at once - for sessions whose memory a fit plan sized for one context.
        Returns:
            dict: "n_expert", "n_expert_used", "experts_used_per_layer_ubatch", "coverage" (a fraction),
            "n_records", "per_layer_mean" (layer -> experts used).
        Raises:
            DecodeError: for an empty sequence, a token out of range, or a failed decode.
            TypeError: for tokens that are not ints.
            OutOfMemoryError: when the measuring context does not fit.
            PyllamaError: on a closed session.
        """
        self._check_open()
        t = self._tokens(tokens)
        lib, ffi = self.native.lib, self.native.ffi
        if exclusive:
            self._ctx.close()
        try:
            with self._model.context(self.ctx_params, coverage=True) as ctx:
                self._decode(ctx, t, 0, np.zeros(0, dtype=np.int32))
                n = lib.pp_coverage_count(ctx.handle)
                rows = ffi.new("pp_coverage_row[]", max(n, 1))
                n = self.native.check(lib.pp_coverage_get(ctx.handle, rows, n))
                recs = [(rows[i].layer, rows[i].n_tokens, rows[i].n_used) for i in range(n)]
        finally:
            if exclusive:
                self._ctx = self._model.context(self.ctx_params)
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

    def trace_experts(self, tokens: Iterable[int], n_prompt: int = 0, exclusive: bool = False,
                      capture: Sequence[str] = ()) -> ExpertTrace:
        """The experts each MoE layer chose for each token, recorded in a separate context (llama's eval callback:
        one host sync per MoE layer, so never part of a timed run).

        Args:
            tokens: the run's tokens: the first n_prompt decoded as one prompt (in n_batch chunks, every row an
                output so that the last layer routes them all), then the others one by one after it.
            n_prompt: how many of them form the prompt (0: every token decoded one by one).
            exclusive: free the session's own context meanwhile (as in coverage()).
            capture: llama's names of f32 tensors to keep too ("l_out", "ffn_inp", "ffn_norm": "<name>-<layer>",
                [n_embd, n_tokens]), e.g. the hidden states that predict a layer's experts.
        Returns:
            ExpertTrace: ids [tokens, MoE layers, k], the layers, n_expert, n_prompt; `tensors` holds the captured
                names (those the graph has), each [tokens, n_layer, width].
        Raises:
            DecodeError: for an empty sequence, a token out of range, more tokens than n_ctx, n_prompt out of range,
                or a failed decode; also for a model whose layers choose no experts.
            TypeError: for tokens that are not ints.
            OutOfMemoryError: when the tracing context does not fit.
            PyllamaError: on a closed session.
        """
        self._check_open()
        t = self._tokens(tokens)
        if not 0 <= n_prompt <= len(t):
            raise DecodeError(f"n_prompt ({n_prompt}) must be in [0, {len(t)}] (the tokens given)")
        if len(t) > self.ctx_params.n_ctx:
            raise DecodeError(f"{len(t)} tokens do not fit in n_ctx={self.ctx_params.n_ctx}: raise n_ctx")
        lib, ffi = self.native.lib, self.native.ffi
        max_ids = len(t) * max(self.info.n_layer, 1) * max(self.info.n_expert_used, 1)
        raw = lib.pp_trace_new(max_ids)
        if raw == ffi.NULL:
            raise OutOfMemoryError(self.native.last_error())
        trace = ffi.gc(raw, lib.pp_trace_free)
        names = list(capture)
        for name in names:   # room for every token of every layer, n_embd wide
            self.native.check(lib.pp_trace_capture(trace, name.encode(), len(t) * max(self.info.n_layer, 1)
                                                   * max(self.info.n_embd, 1)))
        if exclusive:
            self._ctx.close()
        try:
            with self._model.context(self.ctx_params, trace=trace) as ctx:
                if n_prompt:
                    self._decode(ctx, t[:n_prompt], 0, np.arange(n_prompt, dtype=np.int32))
                for i in range(n_prompt, len(t)):
                    self._decode(ctx, t[i:i + 1], i, np.zeros(1, dtype=np.int32))
            sizes = ffi.new("int64_t[3]")
            self.native.check(lib.pp_trace_size(trace, sizes, sizes + 1, sizes + 2))
            recs = ffi.new("pp_trace_record[]", max(int(sizes[0]), 1))
            flat = np.zeros(max(int(sizes[1]), 1), dtype=np.int32)
            self.native.check(lib.pp_trace_get(trace, recs, sizes[0], ffi.cast("int32_t *", flat.ctypes.data),
                                               sizes[1]))
            captured = self._captured(trace, names, len(t))
        finally:
            if exclusive:
                self._ctx = self._model.context(self.ctx_params)
        if sizes[0] == 0:
            raise DecodeError(f"{self.path.name} has no layer that chooses experts: nothing to trace")
        records = [(recs[i].layer, recs[i].n_tokens, recs[i].k, recs[i].offset) for i in range(int(sizes[0]))]
        try:
            tr = ExpertTrace.from_records(records, flat, len(t), self.info.n_expert, n_prompt)
            tr.tensors = ExpertTrace.place_tensors(captured[0], captured[1], names, len(t), self.info.n_layer)
            return tr
        except ValueError as e:
            raise DecodeError(f"the expert trace is incomplete: {e}") from None

    def _captured(self, trace, names: Sequence[str], n_tokens: int) -> tuple:
        """The tensors a trace captured: (records as tuples, values); none where names is empty."""
        if not names:
            return [], np.zeros(0, dtype=np.float32)
        lib, ffi = self.native.lib, self.native.ffi
        sizes = ffi.new("int64_t[3]")
        self.native.check(lib.pp_trace_tensors_size(trace, sizes, sizes + 1, sizes + 2))
        if sizes[2]:
            raise DecodeError(f"{int(sizes[2])} captured tensors did not fit the trace's room for {n_tokens} tokens")
        recs = ffi.new("pp_trace_tensor[]", max(int(sizes[0]), 1))
        values = np.zeros(max(int(sizes[1]), 1), dtype=np.float32)
        self.native.check(lib.pp_trace_tensors_get(trace, recs, sizes[0], ffi.cast("float *", values.ctypes.data),
                                                   sizes[1]))
        return [(r.capture, r.layer, r.n_tokens, r.width, r.offset) for r in (recs[i] for i in range(int(sizes[0])))], values

    # -- lifetime -------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether close() freed the session's model."""
        return self._model is None or self._model.closed

    def close(self) -> None:
        """Free the context, then the model (once; later calls do nothing)."""
        if self._ctx is not None:
            self._ctx.close()
        if self._model is not None:
            self._model.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
