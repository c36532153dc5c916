"""Where the weights go (`Placement`) and the llama context (`ContextParams`): plain, checked, frozen values.

Both are checked once, when they are made, and cannot change afterwards; every layer above (the fit plan, the
worker jobs, the A/B configurations, the CLI) carries them as they are down to the native shim.
"""
from __future__ import annotations

import math

from dataclasses import asdict, dataclass
from typing import Optional, Tuple, Union

from .defaults import CONTEXT
from .errors import ConfigError

# upstream's patterns for expert tensors (common/fit.cpp LAYER_FRACTION_MOE)
EXPERT_TENSORS = r"ffn_(up|down|gate|gate_up)_(ch)?exps"
LOAD_MODES = {"none": 0, "mmap": 1}
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
INT32_MAX = 2**31 - 1

HostExperts = Union[str, int, Tuple[int, ...]]


def check_int(name: str, value, lowest: int, highest: int = INT32_MAX) -> int:
    """`value` as an int when it is a whole number in [lowest, highest] (llama.cpp's int32 fields).

    Raises:
        ConfigError: naming `name`, for a value of another type or out of range.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(f"{name} must be a whole number, not {value!r}")
    value = int(value)
    if not lowest <= value <= highest:
        raise ConfigError(f"{name} must be between {lowest} and {highest}, not {value}")
    return value


def ctx_for(n_tokens: int, n_ctx: Optional[int] = None) -> int:
    """n_ctx for runs of up to n_tokens positions: `n_ctx` when set (not None or 0), else n_tokens rounded up to 256
    (at least 256)."""
    return n_ctx or max(256, int(math.ceil(n_tokens / 256.0)) * 256)


def normalize_host_experts(value) -> HostExperts:
    """The one form of a host-expert choice: "all", "none", a count N (the first N layers, like --n-cpu-moe) or a
    sorted tuple of layer indices.

    Raises:
        ConfigError: for anything else (a negative count, a word other than all/none, a list of non-integers).
    """
    if value is None or value == "none" or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return "none"
    if value == "all":
        return "all"
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ConfigError(f"host_experts must be 'all', 'none', a count or a list of layers, not {value!r}")
        value = int(value)
    if isinstance(value, bool):
        raise ConfigError(f"host_experts must be 'all', 'none', a count or a list of layers, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"host_experts takes a count >= 0 (the first N layers), not {value}")
        return value or "none"
    try:
        layers = tuple(sorted({check_int("host_experts layer", i, 0) for i in value}))
    except (TypeError, ConfigError):
        raise ConfigError(f"host_experts must be 'all', 'none', a count or a list of layers, not {value!r}") from None
    return layers or "none"


def host_expert_overrides(host_experts: HostExperts, n_layer: Optional[int] = None) -> list[str]:
    """Tensor overrides ("PATTERN=BUFT", llama's -ot form) that keep the chosen layers' experts in host RAM.

    Args:
        host_experts: a value normalize_host_experts accepts.
        n_layer: the model's layer count, to refuse layers it does not have.
    Raises:
        ConfigError: for a choice that names layers outside 0..n_layer-1.
    """
    he = normalize_host_experts(host_experts)
    if he == "none":
        return []
    if he == "all":
        return [rf"blk\.\d+\.{EXPERT_TENSORS}=CPU"]
    layers = list(range(he)) if isinstance(he, int) else list(he)
    if n_layer is not None and layers[-1] >= n_layer:
        given = f"the first {he} layers" if isinstance(he, int) else f"layer {layers[-1]}"
        raise ConfigError(f"host experts ({he if isinstance(he, int) else ','.join(map(str, he))}): {given}, and the "
                          f"model has {n_layer} layers (0..{n_layer - 1}). Fix: a count of at most {n_layer} (or "
                          f"'all'), or layers in 0..{n_layer - 1}")
    return [rf"blk\.({'|'.join(map(str, layers))})\.{EXPERT_TENSORS}=CPU"]


@dataclass(frozen=True)
class Placement:
    """Where the weights go (llama_model_params).

    Args:
        n_gpu_layers: layers on the devices (-1: every layer).
        split_mode: "layer" (default), "none" or "row".
        tensor_split: layer proportions per device (None: llama's default, by free memory).
        host_experts: experts kept in host RAM: "all", "none" (default), N (the first N layers) or a list of layers.
        overrides: more tensor overrides, "PATTERN=BUFT" each (llama's -ot); a fit plan's placement is these.
        load_mode: "none" (default: no mmap, host weights pinned where the device offers it) or "mmap".
        no_host: bypass the devices' pinned host buffer type.
        main_gpu: the device of split mode none.
        source: what chose this placement, for the rows' label: "" (given), "fit" or "plan".
    Raises:
        ConfigError: for a value out of range or of the wrong kind.
    """

    n_gpu_layers: int = CONTEXT.n_gpu_layers
    split_mode: str = CONTEXT.split_mode
    tensor_split: Optional[Tuple[float, ...]] = None
    host_experts: HostExperts = CONTEXT.host_experts
    overrides: Tuple[str, ...] = ()
    load_mode: str = CONTEXT.load_mode
    no_host: bool = False
    main_gpu: int = 0
    source: str = ""

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "host_experts", normalize_host_experts(self.host_experts))
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode must be one of {sorted(LOAD_MODES)}, not {self.load_mode!r}")
        if self.split_mode not in SPLIT_MODES:
            raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {self.split_mode!r}")
        check_int("n_gpu_layers", self.n_gpu_layers, -1)
        check_int("main_gpu", self.main_gpu, 0)
        if self.tensor_split is not None:
            try:
                split = tuple(float(x) for x in self.tensor_split)
            except (TypeError, ValueError):
                raise ConfigError(f"tensor_split takes proportions per device (e.g. [3, 5]), not "
                                  f"{self.tensor_split!r}") from None
            if not split or min(split) < 0 or sum(split) <= 0:
                raise ConfigError(f"tensor_split takes non-negative proportions with a positive sum (e.g. 3,5), "
                                  f"not {list(split)}")
            set_(self, "tensor_split", split)
        if isinstance(self.overrides, str) or not all(isinstance(o, str) and "=" in o.strip("=")
                                                      for o in self.overrides):
            raise ConfigError(f"overrides takes a list of 'PATTERN=BUFT' strings (llama's -ot), not {self.overrides!r}")
        set_(self, "overrides", tuple(self.overrides))
        if self.source not in ("", "fit", "plan"):
            raise ConfigError(f"source must be '', 'fit' or 'plan', not {self.source!r}")

    def all_overrides(self, n_layer: Optional[int] = None) -> list[str]:
        """Every tensor override of this placement: the host-expert ones, then the others.

        Args:
            n_layer: the model's layer count, to refuse host-expert layers it does not have (None: not checked).
        Returns:
            list[str]: "PATTERN=BUFT" each (llama's -ot form).
        Raises:
            ConfigError: when host_experts names layers outside 0..n_layer-1.
        """
        return host_expert_overrides(self.host_experts, n_layer) + list(self.overrides)

    @property
    def label(self) -> str:
        """How the rows and tables name this placement: the host-expert choice ("all", "none", "3", "0,2"), or for
        a fit plan's placement "fit: N overrides" / "plan: N overrides"."""
        if self.source:
            return f"{self.source}: {len(self.overrides)} override{'' if len(self.overrides) == 1 else 's'}"
        he = self.host_experts
        return ",".join(map(str, he)) if isinstance(he, tuple) else str(he)

    def to_dict(self) -> dict:
        """The fields as JSON-ready values; Placement(**d) makes it again.

        Returns:
            dict: the fields, tuples as lists.
        """
        d = asdict(self)
        for k in ("tensor_split", "overrides", "host_experts"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        return d


@dataclass(frozen=True)
class ContextParams:
    """The llama_context_params that matter here (defaults: pyllama_pp.defaults.CONTEXT, llama.cpp's own).

    Args:
        n_ctx: context size in positions (fit: 0 lets fit choose it).
        n_batch: tokens per llama_decode call (the logical batch).
        n_ubatch: tokens per graph (the physical batch); at most n_batch.
        n_threads: CPU threads (0: every core the process may run on).
        flash_attn: llama's flash-attention mode (1: on).
        op_offload: offload host-weight ops of large batches to the devices.
        offload_kqv: the KV cache on the devices.
    Raises:
        ConfigError: for a value out of range, or n_ubatch > n_batch.
    """

    n_ctx: int = CONTEXT.n_ctx
    n_batch: int = CONTEXT.n_batch
    n_ubatch: int = CONTEXT.n_ubatch
    n_threads: int = CONTEXT.n_threads
    flash_attn: int = CONTEXT.flash_attn
    op_offload: bool = True
    offload_kqv: bool = True

    def __post_init__(self):
        check_int("n_ctx", self.n_ctx, 0)
        check_int("n_batch", self.n_batch, 1)
        check_int("n_ubatch", self.n_ubatch, 1)
        check_int("n_threads", self.n_threads, 0)
        check_int("flash_attn", self.flash_attn, -1, 1)
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"n_ubatch ({self.n_ubatch}) cannot exceed n_batch ({self.n_batch}): "
                              "lower n_ubatch or raise n_batch")

    def to_dict(self) -> dict:
        """The fields as a dict; ContextParams(**d) makes it again.

        Returns:
            dict: field name -> value.
        """
        return asdict(self)


def _as(cls, value, name: str):
    """A `cls` from itself, its dict form or None (the default); TypeError naming `name` for anything else."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"{name} must be a {cls.__name__} or its dict, not {type(value).__name__}")


def as_placement(value: Union[Placement, dict, None]) -> Placement:
    """A Placement from itself, its dict form or None (the default).

    Raises:
        TypeError: for anything else.
        ConfigError: for a dict with bad values.
    """
    return _as(Placement, value, "placement")


def as_context(value: Union[ContextParams, dict, None]) -> ContextParams:
    """A ContextParams from itself, its dict form or None (the default).

    Raises:
        TypeError: for anything else.
        ConfigError: for a dict with bad values.
    """
    return _as(ContextParams, value, "ctx")


__all__ = ["Placement", "ContextParams", "EXPERT_TENSORS", "LOAD_MODES", "SPLIT_MODES", "check_int",
           "normalize_host_experts", "host_expert_overrides", "as_placement", "as_context"]
