"""Synthetic random-weight MoE GGUF files (gguf-py for the format, numpy for the weights).

``write_gguf(path, cfg)`` streams a valid GGUF v3 file that the pinned llama.cpp loads as
architecture ``cfg.arch`` (qwen3moe, llama (Mixtral-style), qwen2moe, glm4moe, deepseek2 (MLA
attention) or gpt-oss) with the ``"test"`` tokenizer.  The weights are random but deterministic
for a given :class:`SynthConfig` (same config and seed -> byte-identical file, within one numpy
version).  Weights are written as Q8_0 (random int8 quants with fp16 block scales, written
directly: no float quantization), F16 or BF16; the routed experts may have a type of their own
(``expert_type``: also Q4_K or MXFP4, as real models ship them, the quants drawn directly too);
norm weights, biases, attention sinks and the router (``ffn_gate_inp``) are F32.

Routing control
---------------
Random models route most tokens to a few experts (attention averages tokens into a shared
direction, so the router input stops depending on the token), which hides the expert traffic
this project is about (the bytes a ubatch moves follow from it).  ``SynthConfig.routing`` picks one of four regimes:

``"uniform"``  (default) token embeddings at scale 1.0, attention-output (``attn_output``) and
    expert-down (``ffn_down_exps``) weights at scale 0.0005.  Each layer then adds only a tiny
    update to the residual stream, which stays (almost) the token embedding: the router input is
    token-specific and, with router rows of equal norm, every expert is equally likely.  A ubatch
    of T random tokens uses about ``E * (1 - (1 - k/E)**T)`` experts per layer (E experts, k used):
    all 128 at T = 512 for the 30B shape; about 40 of 64 (a third unused) at T = 32 for ``tiny``.
``"skewed"``   as ``uniform``, and the router row of the expert of rank r (a random order per
    layer, drawn from the seed) is scaled by ``(r + 1) ** -skew`` (a Zipf-like norm profile).
    A larger row norm spreads that expert's logits, so it lands in the top-k more often.
    ``skew = 0`` is ``uniform``.  Measured by simulating the router on isotropic inputs
    (experts used per layer per ubatch, mean):

    =====  ======================  ==================
    skew   128 exp / 8 used, T=512  64 exp / 2 used, T=32
    =====  ======================  ==================
    0      128                      39
    0.25   128                      33
    0.5    127                      22
    1.0    79                       15
    1.5    58                       12
    2.0    47                       10
    =====  ======================  ==================

    Real models sit around skew 0.75-1 at ubatch 512 (72-95 of 128 experts in one report);
    ``preset(..., routing="skewed")`` without a skew uses ``DEFAULT_SKEW`` (1.0).
``"locality"`` as ``skewed`` (a weak profile: ``DEFAULT_LOCALITY_SKEW``), and the token embeddings follow a slow
    random walk over token ids, so that a stream of consecutive ids routes to slowly changing expert sets, as real
    models' decode does (temporal locality).  Row i of ``token_embd`` is
    ``embd_scale * (sqrt(locality) * w_i + sqrt(1 - locality) * z_i)``: ``z_i`` is the token's own N(0, I) part and
    ``w`` a stationary Gauss-Markov walk, ``w_{i+1} = rho * w_i + sqrt(1 - rho**2) * n_i`` with
    ``rho = exp(-1 / locality_span)`` (a "topic" that decorrelates over about ``locality_span`` ids).  Consecutive
    ids' embeddings then correlate by ``locality * rho``; ``locality = 0`` is ``skewed`` with independent tokens and
    ``locality`` near 1 is very sticky.  Since the residual stays ~ the embedding (as in ``uniform``), the router
    of every layer sees the walk.  A decode stream must feed consecutive ids to see it: the bench and
    ``pyllama-pp trace`` do so for files whose ``pyllama_pp.synth.routing`` is ``locality`` (``STREAM_ROUTINGS``).
    The defaults (``DEFAULT_LOCALITY``, ``DEFAULT_LOCALITY_SPAN``, ``DEFAULT_LOCALITY_SKEW``) are calibrated on
    the 128-expert, 8-used shape (docs/RESULTS.md, "Expert locality (synthetic routing)") to published
    measurements of real MoE decode: a per-layer LRU cache of 12.5% of a layer's experts hits ~67% and of 25% ~81%,
    while a static list of the 6.25% most used experts covers only ~1.5x its share (llama.cpp PR #27861 on a
    512-expert model: LRU of 64 experts 67%, of 128 81%, a static top-32 list ~10% of the traffic; flash-moe's
    frequency-weighted LRU reports ~95% hits; Eliseev & Mazur, "Fast Inference of Mixture-of-Experts Language
    Models with Offloading" (2023), find LRU caching of Mixtral's experts effective because consecutive tokens
    reuse experts).
``"natural"``  plain random initialisation: embeddings at 0.02, every matrix at
    ``1/sqrt(fan_in)``.  Attention and expert outputs dominate the residual, so routing
    concentrates on a minority of experts (as in a plain random model).

Every scale can be overridden with the ``*_scale`` fields of :class:`SynthConfig` (``None`` = the
default of the routing mode, see :meth:`SynthConfig.resolved_scales`).  "Scale" is the standard
deviation of the weights; Q8_0 quants are uniform int8, so the block scale is ``scale / 73.9``
(times a per-block factor in [0.75, 1.25)).  The output norm is ones and the output matrix is at
``1/sqrt(n_embd)``, so logits have a standard deviation of about 1 and stay finite.

Speed
-----
Tensors of at most ``TILE_MIN_ELEMENTS`` elements, the token embeddings and all F32 tensors are
drawn fresh from the random generator (Q8_0: random int8 quants; F16 and BF16: random 16-bit indices into a per-chunk
table of 65536 normal samples; Q4_K and MXFP4: random 4-bit quants under block scales drawn for the requested
standard deviation).  Larger tensors (the expert tensors and the output matrix
of big models) are tiled from a pool of about 16 MiB of random blocks made once per (type, scale)
and reused with a random start offset per tensor (the pool length is a prime number of units, so
repeats do not line up with rows or experts).  Writing is then bounded by the disk, not by the
random generator.

File layout: GGUF v3, default alignment 32, tensor data in the order token_embd, output_norm,
output, then blk.0 ... blk.{n-1}; each tensor's data is padded to 32 bytes.  Our own metadata
lives under ``pyllama_pp.synth.*`` (format version, preset, all config fields, resolved scales).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

import gguf
import numpy as np

from .defaults import CONTEXT
from .model_file import (GGML_BF16, GGML_F16, GGML_F32, GGML_MXFP4, GGML_Q4_K, GGML_Q8_0, GGML_TYPES, STREAM_ROUTINGS,
                         _nbytes, _pad)

__all__ = [
    "SynthConfig",
    "ARCHS",
    "WEIGHT_TYPES",
    "EXPERT_TYPES",
    "cached_model",
    "PRESETS",
    "preset",
    "write_gguf",
    "expert_bytes_per_layer",
    "estimate_file_bytes",
    "TILE_MIN_ELEMENTS",
    "SYNTH_FORMAT_VERSION",
    "ROUTING_MODES",
    "STREAM_ROUTINGS",
]

#: bumped whenever the bytes written for a given config change
SYNTH_FORMAT_VERSION = 1

#: tensors with more elements than this (except token_embd and F32 tensors) are tiled from a pool
TILE_MIN_ELEMENTS = 1 << 24

# the families synth writes: gguf-py's architecture for each (tensor names and metadata keys come from it)
ARCHS = {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "llama": gguf.MODEL_ARCH.LLAMA, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
         "glm4moe": gguf.MODEL_ARCH.GLM4_MOE, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2, "gpt-oss": gguf.MODEL_ARCH.GPT_OSS}
# llama_ftype values (include/llama.h): the file's type is its experts' (most of its bytes), as llama-quantize names
# a Q4_K_M or MXFP4_MOE file whose other tensors are Q8_0 or F16
_FILE_TYPE = {"q8_0": 7, "f16": 1, "bf16": 32, "q4_k": 15, "mxfp4": 38}
# the types of everything but the routed experts (type), and of the routed experts (expert_type)
_WEIGHT_TYPE = {"q8_0": GGML_Q8_0, "f16": GGML_F16, "bf16": GGML_BF16}
_EXPERT_TYPE = {**_WEIGHT_TYPE, "q4_k": GGML_Q4_K, "mxfp4": GGML_MXFP4}
WEIGHT_TYPES, EXPERT_TYPES = tuple(_WEIGHT_TYPE), tuple(_EXPERT_TYPE)
# deepseek2's router: "softmax" (DeepSeek-V2, llama.cpp's default for deepseek2) or "sigmoid" (V3: a selection bias,
# top-k weights normalised)
GATINGS = ("softmax", "sigmoid")
# deepseek2 files llama.cpp reads as "lite" (no query latent: attn_q instead of attn_q_a/attn_q_b): n_layer 26 or 27
_DEEPSEEK2_LITE_LAYERS = (26, 27)

ROUTING_MODES = ("uniform", "skewed", "locality", "natural")
DEFAULT_SKEW = 1.0   # routing="skewed" without a skew (preset(), the CLI): about real models' concentration
# routing="locality": the share of each token embedding that follows the walk, the walk's correlation length in ids,
# and the popularity profile's skew (preset(), the CLI) - calibrated in docs/RESULTS.md "Expert locality"
DEFAULT_LOCALITY = 0.81
DEFAULT_LOCALITY_SPAN = 16.0
DEFAULT_LOCALITY_SKEW = 0.13

# std of a uniform int8 in [-128, 127]
_INT8_STD = math.sqrt((256.0 ** 2 - 1.0) / 12.0)

_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "rope_dim", "v_head_dim")
# fields added after files were cached: left out of cached_model's config hash while at their defaults (so that a
# cached file keeps its name)
_LATER_FIELDS = _MLA_FIELDS + ("gating", "n_swa", "expert_type", "locality", "locality_span")

_SCALE_FIELDS = ("embd_scale", "attn_scale", "attn_out_scale", "ffn_scale", "down_scale",
                 "router_scale", "output_scale")


@dataclass
class SynthConfig:
    """Shape, family, weight types, routing regime and seed of a synthetic MoE model.

    Scales (``*_scale``) are weight standard deviations; ``None`` takes the routing mode's default
    (see :meth:`resolved_scales`):

    - ``embd_scale``: token embeddings (uniform/skewed 1.0, natural 0.02)
    - ``attn_scale``: attn_q / attn_k / attn_v (1/sqrt(n_embd); q and k are RMS-normed anyway); deepseek2's
      latent projections (attn_q_b, attn_k_b, attn_v_b) take ``attn_scale * sqrt(n_embd / fan_in)``; gpt-oss's
      q/k/v biases ``attn_scale`` and its attention sinks 1.0
    - ``attn_out_scale``: attn_output (uniform/skewed 0.0005, natural 1/sqrt(n_head*head_dim))
    - ``ffn_scale``: ffn_gate_exps / ffn_up_exps (1/sqrt(n_embd))
    - ``down_scale``: ffn_down_exps (uniform/skewed 0.0005, natural 1/sqrt(n_ff_exp))
    - ``router_scale``: ffn_gate_inp (1/sqrt(n_embd): router logits of std ~1); in uniform/skewed
      mode every router row is normalised to exactly ``router_scale * sqrt(n_embd)`` (times the
      skew profile) so that no expert is favoured by chance
    - ``output_scale``: output matrix (1/sqrt(n_embd): logits of std ~1)

    gpt-oss's expert biases take ``ffn_scale`` (gate, up) and ``down_scale`` (down), its attn_output bias
    ``attn_out_scale``; its router bias is zero and the selection biases (exp_probs_b) are ones, so that routing
    stays the router rows'.

    ``skew`` (``routing="skewed"`` and ``"locality"``): exponent of the Zipf-like profile of router row
    norms, ``(rank + 1) ** -skew``; 0 = none, ~1 = like real models' prompts, 2 = strongly concentrated.

    ``locality`` and ``locality_span`` (only for ``routing="locality"``; ``None`` = ``DEFAULT_LOCALITY``,
    ``DEFAULT_LOCALITY_SPAN``): the share in [0, 1] of each token embedding's variance that follows the random walk
    over ids, and the walk's correlation length in ids (> 0): see the module docstring.
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_vocab: int
    n_ctx_train: int = 4096
    type: str = "q8_0"
    routing: str = "uniform"
    skew: float = 0.0
    seed: int = CONTEXT.seed
    preset: str = "custom"
    rms_eps: float = 1e-6
    rope_freq_base: float = 1e6
    # the family: qwen3moe (q/k norms), llama (Mixtral-style: no shared expert), qwen2moe (a shared expert with its own
    # gate, n_ff_shexp wide); llama and qwen2moe need n_head * head_dim == n_embd
    arch: str = "qwen3moe"
    n_ff_shexp: int = 0
    # glm4moe (GLM-4.5-style) and deepseek2: shared experts of n_ff_exp each, the first n_layer_dense_lead layers dense
    # (n_ff wide); glm4moe: sigmoid gating with a selection bias (exp_probs_b)
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0
    n_ff: int = 0
    # deepseek2 (MLA attention, the split attn_k_b / attn_v_b form): head_dim is a query/key head (qk_nope + rope_dim),
    # v_head_dim a value head; keys and values come from a latent of kv_lora_rank (+ rope_dim), queries from one of
    # q_lora_rank (0: attn_q directly; what llama.cpp requires for 26 or 27 layers, its "lite" models); n_head_kv is 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    # deepseek2's gating (GATINGS): None = softmax (V2); "sigmoid" (V3) adds a selection bias (exp_probs_b)
    gating: Optional[str] = None
    # gpt-oss: the sliding window of its sliding-window layers (every other layer, llama.cpp's default pattern)
    n_swa: int = 0
    # the routed experts' type (_EXPERT_TYPE): None = type; shared experts and dense layers take type
    expert_type: Optional[str] = None
    # routing="locality": the walk's share of each token embedding and its correlation length (None: the defaults)
    locality: Optional[float] = None
    locality_span: Optional[float] = None
    embd_scale: Optional[float] = None
    attn_scale: Optional[float] = None
    attn_out_scale: Optional[float] = None
    ffn_scale: Optional[float] = None
    down_scale: Optional[float] = None
    router_scale: Optional[float] = None
    output_scale: Optional[float] = None

    @property
    def experts_type(self) -> str:
        """The routed experts' type: expert_type, or type when it is None."""
        return self.expert_type or self.type

    @property
    def sigmoid_gating(self) -> bool:
        """GLM-4.5 and DeepSeek-V3 style: sigmoid gating with a selection bias (exp_probs_b), top-k normalised."""
        return self.arch == "glm4moe" or (self.arch == "deepseek2" and self.gating == "sigmoid")

    def resolved_locality(self) -> Tuple[float, float]:
        """(locality, locality_span) with the defaults filled in (routing="locality" reads them)."""
        return (DEFAULT_LOCALITY if self.locality is None else float(self.locality),
                DEFAULT_LOCALITY_SPAN if self.locality_span is None else float(self.locality_span))

    def resolved_scales(self) -> Dict[str, float]:
        """The scale of every weight group, defaults filled in for the routing mode."""
        natural = self.routing == "natural"
        q_dim = self.n_head * (self.v_head_dim or self.head_dim)   # attn_output's fan-in
        defaults = {
            "embd_scale": 0.02 if natural else 1.0,
            "attn_scale": 1.0 / math.sqrt(self.n_embd),
            "attn_out_scale": 1.0 / math.sqrt(q_dim) if natural else 0.0005,
            "ffn_scale": 1.0 / math.sqrt(self.n_embd),
            "down_scale": 1.0 / math.sqrt(self.n_ff_exp) if natural else 0.0005,
            "router_scale": 1.0 / math.sqrt(self.n_embd),
            "output_scale": 1.0 / math.sqrt(self.n_embd),
        }
        out = {}
        for name in _SCALE_FIELDS:
            v = getattr(self, name)
            out[name] = float(defaults[name] if v is None else v)
        return out

    def validate(self) -> "SynthConfig":
        """Raise ValueError on a config llama.cpp could not load (or we cannot write)."""
        ints = ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert",
                "n_expert_used", "n_ff_exp", "n_vocab", "n_ctx_train")
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SynthConfig.{name} must be a positive integer, got {v!r}")
        for name in ("n_ff_shexp", "n_expert_shared", "n_layer_dense_lead", "n_ff") + _MLA_FIELDS + ("n_swa",):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"SynthConfig.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.arch, str) or self.arch not in ARCHS:   # (a list is unhashable: TypeError, not this)
            raise ValueError(f"SynthConfig.arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        if self.arch in ("llama", "qwen2moe") and self.n_head * self.head_dim != self.n_embd:
            raise ValueError(f"{self.arch} needs n_head * head_dim == n_embd ({self.n_head} * {self.head_dim} != {self.n_embd})")
        if (self.arch == "qwen2moe") != (self.n_ff_shexp > 0):
            raise ValueError("n_ff_shexp (the shared expert's width) is for qwen2moe, and qwen2moe needs one > 0")
        if (self.n_expert_shared or self.n_layer_dense_lead or self.n_ff) and self.arch not in ("glm4moe", "deepseek2"):
            raise ValueError("n_expert_shared, n_layer_dense_lead and n_ff are glm4moe's and deepseek2's")
        if self.n_layer_dense_lead >= self.n_layer or (self.n_layer_dense_lead > 0) != (self.n_ff > 0):
            raise ValueError(f"n_layer_dense_lead ({self.n_layer_dense_lead}) must be below n_layer ({self.n_layer}), "
                             f"with n_ff (the dense layers' width) > 0 exactly when there are dense layers")
        if self.arch == "deepseek2":
            self._validate_mla()
        elif any(getattr(self, f) for f in _MLA_FIELDS):
            raise ValueError(f"{', '.join(_MLA_FIELDS)} are deepseek2's (MLA attention); {self.arch} has none")
        if self.gating is not None and self.arch != "deepseek2":
            raise ValueError(f"gating is deepseek2's choice ({self.arch}'s is fixed): leave it None")
        if self.gating is not None and self.gating not in GATINGS:
            raise ValueError(f"SynthConfig.gating must be None or one of {list(GATINGS)}, got {self.gating!r}")
        if (self.arch == "gpt-oss") != (self.n_swa > 0):
            raise ValueError("n_swa (the sliding window) is for gpt-oss, and gpt-oss needs one > 0 (gpt-oss-20b: 128)")
        if self.type not in _WEIGHT_TYPE:
            raise ValueError(f"SynthConfig.type must be one of {sorted(_WEIGHT_TYPE)}, got {self.type!r} "
                             f"(q4_k and mxfp4 are for the routed experts: expert_type)")
        if self.expert_type is not None and self.expert_type not in _EXPERT_TYPE:
            raise ValueError(f"SynthConfig.expert_type must be None (= type) or one of {sorted(_EXPERT_TYPE)}, "
                             f"got {self.expert_type!r}")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"SynthConfig.routing must be one of {list(ROUTING_MODES)}, got {self.routing!r}")
        if self.locality is not None and not (0.0 <= self.locality <= 1.0):
            raise ValueError(f"SynthConfig.locality must be in [0, 1] (the walk's share of each embedding), "
                             f"got {self.locality!r}")
        if self.locality_span is not None and not (self.locality_span > 0 and math.isfinite(self.locality_span)):
            raise ValueError(f"SynthConfig.locality_span must be finite and > 0 (ids), got {self.locality_span!r}")
        if (self.locality is not None or self.locality_span is not None) and self.routing != "locality":
            raise ValueError(f"locality and locality_span are for routing='locality', not {self.routing!r}")
        if not (self.skew >= 0.0 and math.isfinite(self.skew)):
            raise ValueError(f"SynthConfig.skew must be finite and >= 0, got {self.skew!r}")
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"SynthConfig.seed must be a non-negative integer, got {self.seed!r}")
        if self.n_layer > 512:
            raise ValueError("n_layer must be <= 512 (LLAMA_MAX_LAYERS)")
        if self.n_expert > 1024:
            raise ValueError("n_expert must be <= 1024 (LLAMA_MAX_EXPERTS)")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used ({self.n_expert_used}) > n_expert ({self.n_expert})")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (RoPE)")
        self._validate_rows()
        for name in _SCALE_FIELDS:
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"SynthConfig.{name} must be finite and >= 0, got {v!r}")
        return self

    def _validate_mla(self) -> None:
        for name in ("kv_lora_rank", "rope_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"deepseek2 needs SynthConfig.{name} > 0 (DeepSeek-V2-Lite: kv_lora_rank 512, "
                                 f"rope_dim 64, v_head_dim 128)")
        if self.rope_dim % 2 or self.rope_dim >= self.head_dim:
            raise ValueError(f"deepseek2's rope_dim ({self.rope_dim}) must be even and below head_dim "
                             f"({self.head_dim} = the unroped part + rope_dim)")
        if self.n_head_kv != 1:
            raise ValueError(f"deepseek2's MLA attention has one latent key/value head: n_head_kv must be 1, "
                             f"not {self.n_head_kv}")
        if self.n_expert_shared < 1:
            raise ValueError("deepseek2 needs n_expert_shared >= 1 (llama.cpp loads its shared-expert tensors)")
        if self.is_deepseek2_lite() and self.q_lora_rank:
            raise ValueError(f"llama.cpp reads a deepseek2 of {self.n_layer} layers as a lite model without a query "
                             f"latent: set q_lora_rank=0 (attn_q), or choose another n_layer")

    def is_deepseek2_lite(self) -> bool:
        """Whether llama.cpp's deepseek2 loader takes this shape for a lite model (it then ignores q_lora_rank)."""
        return self.n_layer in _DEEPSEEK2_LITE_LAYERS or (self.n_layer == 48 and self.n_vocab == 128256)

    def row_lengths(self) -> Tuple[List[Tuple[str, int]], List[Tuple[str, int]]]:
        """The row lengths (ggml's ne[0]) of the weight matrices: (what, length) of those of ``type`` and of the routed
        experts (``expert_type``); a quantized type needs multiples of its block size."""
        dense = [("n_embd", self.n_embd)]
        if self.arch == "deepseek2":
            dense += [("n_head*v_head_dim (attn_output)", self.n_head * self.v_head_dim),
                      ("kv_lora_rank (attn_v_b)", self.kv_lora_rank),
                      ("head_dim-rope_dim (attn_k_b)", self.head_dim - self.rope_dim)]
            if self.q_lora_rank:
                dense.append(("q_lora_rank (attn_q_b)", self.q_lora_rank))
        else:
            dense.append(("n_head*head_dim", self.n_head * self.head_dim))
        if self.n_ff:
            dense.append(("n_ff (the dense layers' ffn_down)", self.n_ff))
        if self.n_ff_shexp:
            dense.append(("n_ff_shexp (ffn_down_shexp)", self.n_ff_shexp))
        if self.n_expert_shared:
            dense.append(("n_ff_exp*n_expert_shared (ffn_down_shexp)", self.n_ff_exp * self.n_expert_shared))
        experts = [("n_embd (ffn_gate_exps, ffn_up_exps)", self.n_embd), ("n_ff_exp (ffn_down_exps)", self.n_ff_exp)]
        if self.expert_type is None:   # (one type: the messages name the rows as before)
            dense.append(("n_ff_exp", self.n_ff_exp))
            return dense, []
        return dense, experts

    def _validate_rows(self) -> None:
        dense, experts = self.row_lengths()
        for field, tname, rows in (("type", self.type, dense), ("expert_type", self.expert_type, experts)):
            name, blck, _ = GGML_TYPES[_EXPERT_TYPE[tname]] if tname else ("", 1, 0)
            for what, n in rows:
                if n % blck:
                    fit = sorted(t for t, g in (_EXPERT_TYPE if field == "expert_type" else _WEIGHT_TYPE).items()
                                 if n % GGML_TYPES[g][1] == 0)
                    raise ValueError(f"{name} needs row lengths that are multiples of {blck}: {what} = {n}; choose a "
                                     f"multiple of {blck} there, or {field} one of {fit}")


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SynthConfig)}

PRESETS: Dict[str, SynthConfig] = {
    # ~11.7 MB as Q8_0; 64 experts, 2 used: a 32-token ubatch leaves about a third unused
    "tiny": SynthConfig(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
                        n_expert=64, n_expert_used=2, n_ff_exp=64, n_vocab=4096, preset="tiny"),
    # ~258 MB as Q8_0 (20 MB of experts a layer; expert/attention bytes ratio close to 30B-A3B's)
    "small": SynthConfig(n_layer=12, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
                         n_expert=128, n_expert_used=8, n_ff_exp=96, n_vocab=8192, preset="small"),
    # shaped like Qwen3-30B-A3B: ~31.9 GB (29.7 GiB) as Q8_0, 0.64 GB of experts a layer
    "qwen3-30b-a3b": SynthConfig(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                                 n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=32768,
                                 preset="qwen3-30b-a3b"),
    # Mixtral-style (llama with experts: 8, top-2, no shared expert), tiny and shaped like Mixtral-8x7B (~49.6 GB Q8_0)
    "mixtral-tiny": SynthConfig(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_expert=8,
                                n_expert_used=2, n_ff_exp=256, n_vocab=4096, rope_freq_base=1e6, arch="llama",
                                preset="mixtral-tiny"),
    "mixtral-8x7b": SynthConfig(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_expert=8,
                                n_expert_used=2, n_ff_exp=14336, n_vocab=32000, rope_freq_base=1e6, arch="llama",
                                preset="mixtral-8x7b"),
    # Qwen2-MoE (60 experts, top-4, a shared expert with its own gate), tiny and shaped like Qwen1.5-MoE-A2.7B (~15 GB)
    "qwen2moe-tiny": SynthConfig(n_layer=6, n_embd=128, n_head=4, n_head_kv=4, head_dim=32, n_expert=60,
                                 n_expert_used=4, n_ff_exp=64, n_ff_shexp=256, n_vocab=4096, arch="qwen2moe",
                                 preset="qwen2moe-tiny"),
    # GLM-4.5-style (glm4moe: one shared expert, the first layer dense, sigmoid gating), tiny and shaped like
    # GLM-4.5-Air cut to 24 of its 46 layers (~57 GB as Q8_0: the whole model would not fit the GPU machine's RAM)
    "glm4moe-tiny": SynthConfig(n_layer=6, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_expert=32,
                                n_expert_used=4, n_ff_exp=64, n_expert_shared=1, n_layer_dense_lead=1, n_ff=256,
                                n_vocab=4096, arch="glm4moe", preset="glm4moe-tiny"),
    "glm4.5-air-l24": SynthConfig(n_layer=24, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128, n_expert=128,
                                  n_expert_used=8, n_ff_exp=1408, n_expert_shared=1, n_layer_dense_lead=1, n_ff=10944,
                                  n_vocab=32768, arch="glm4moe", preset="glm4.5-air-l24"),
    "qwen2moe-a2.7b": SynthConfig(n_layer=24, n_embd=2048, n_head=16, n_head_kv=16, head_dim=128, n_expert=60,
                                  n_expert_used=4, n_ff_exp=1408, n_ff_shexp=5632, n_vocab=32768, arch="qwen2moe",
                                  preset="qwen2moe-a2.7b"),
    # deepseek2 (MLA attention with a query latent, 2 shared experts, the first layer dense, V3's sigmoid gating with a
    # selection bias), tiny, and shaped like DeepSeek-V2-Lite (27 layers: llama.cpp's lite form, no query latent;
    # softmax gating; ~16.5 GB as Q8_0 with a 32768-token vocabulary)
    "deepseek2-tiny": SynthConfig(n_layer=6, n_embd=128, n_head=4, n_head_kv=1, head_dim=48, rope_dim=16, v_head_dim=32,
                                  q_lora_rank=64, kv_lora_rank=64, n_expert=32, n_expert_used=4, n_ff_exp=64,
                                  n_expert_shared=2, n_layer_dense_lead=1, n_ff=256, gating="sigmoid", n_vocab=4096,
                                  rope_freq_base=1e4, arch="deepseek2", preset="deepseek2-tiny"),
    "deepseek-v2-lite": SynthConfig(n_layer=27, n_embd=2048, n_head=16, n_head_kv=1, head_dim=192, rope_dim=64,
                                    v_head_dim=128, q_lora_rank=0, kv_lora_rank=512, n_expert=64, n_expert_used=6,
                                    n_ff_exp=1408, n_expert_shared=2, n_layer_dense_lead=1, n_ff=10944, n_vocab=32768,
                                    rope_freq_base=1e4, arch="deepseek2", preset="deepseek-v2-lite"),
    # gpt-oss (attention with biases and sinks, sliding-window attention on every other layer, experts with biases,
    # a router bias), experts in MXFP4 as gpt-oss ships them; tiny, and shaped like gpt-oss-20b (~11 GB with a
    # 32768-token vocabulary and Q8_0 elsewhere; the real file, with its 201088 tokens, is ~12.1 GB)
    "gptoss-tiny": SynthConfig(n_layer=6, n_embd=128, n_head=8, n_head_kv=2, head_dim=32, n_expert=32, n_expert_used=4,
                               n_ff_exp=128, n_vocab=4096, n_swa=64, rope_freq_base=1.5e5, rms_eps=1e-5,
                               expert_type="mxfp4", arch="gpt-oss", preset="gptoss-tiny"),
    "gpt-oss-20b": SynthConfig(n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64, n_expert=32,
                               n_expert_used=4, n_ff_exp=2880, n_vocab=32768, n_swa=128, rope_freq_base=1.5e5,
                               rms_eps=1e-5, expert_type="mxfp4", arch="gpt-oss", preset="gpt-oss-20b"),
}


def preset(name: str, **overrides: Any) -> SynthConfig:
    """A copy of preset ``name`` with ``overrides`` (any SynthConfig field) applied.

    Overrides that are ``None`` are ignored (handy for optional CLI flags), except for the
    ``*_scale`` fields, where ``None`` means "the routing mode's default".  Unknown preset or field
    names raise ValueError; the result is validated.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown synth preset {name!r}; presets: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(SynthConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown SynthConfig field(s) {bad}; fields: {', '.join(sorted(fields))}")
    overrides = {k: v for k, v in overrides.items() if v is not None or k in _SCALE_FIELDS}
    if overrides.get("routing") == "skewed" and "skew" not in overrides:
        # "skewed" without a skew would be uniform (skew 0): default to real models' level
        overrides["skew"] = DEFAULT_SKEW
    if overrides.get("routing") == "locality" and "skew" not in overrides:
        overrides["skew"] = DEFAULT_LOCALITY_SKEW   # (the weak static popularity real decode shows)
    return dataclasses.replace(PRESETS[name], **overrides).validate()


# ----------------------------------------------------------------------------------------------
# tensor plan


@dataclass
class _Tensor:
    name: str
    ne: Tuple[int, ...]  # ggml order: ne[0] is the row length
    gtype: int
    fill: str  # "ones" | "zeros" | "normal" (F32 biases, sinks) | "router" | "walk" (locality's embeddings) | "matrix"
    scale: float = 0.0
    fresh: bool = True
    layer: int = -1
    nbytes: int = 0
    offset: int = 0  # relative to the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


def _plan(cfg: SynthConfig) -> List[_Tensor]:
    s = cfg.resolved_scales()
    wt = _WEIGHT_TYPE[cfg.type]
    et = _EXPERT_TYPE[cfg.experts_type]
    E, D, F, V = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp, cfg.n_vocab
    q_dim = cfg.n_head * cfg.head_dim
    kv_dim = cfg.n_head_kv * cfg.head_dim

    def mat(name, ne, scale, layer=-1, always_fresh=False, gtype=wt):
        t = _Tensor(name, tuple(ne), gtype, "matrix", scale, layer=layer)
        t.fresh = always_fresh or t.n_elements <= TILE_MIN_ELEMENTS
        return t

    def f32(name, ne, fill, layer, scale=0.0):   # norms ("ones"), biases and sinks ("normal", "zeros")
        return _Tensor(name, tuple(ne), GGML_F32, fill, scale, layer=layer)

    T = gguf.MODEL_TENSOR

    def name(kind, bid=None, suffix="weight") -> str:   # the format's own names (gguf-py): blk.3.ffn_up_exps.weight
        assert kind in gguf.MODEL_TENSORS[ARCHS[cfg.arch]], (cfg.arch, kind)
        return gguf.TENSOR_NAMES[kind].format(bid=bid) + "." + suffix

    def latent(fan_in):   # deepseek2's projections from a latent: attn_scale as if their input were n_embd wide
        return s["attn_scale"] * math.sqrt(E / fan_in)

    embd = mat(name(T.TOKEN_EMBD), (E, V), s["embd_scale"], always_fresh=True)
    if cfg.routing == "locality":
        embd.fill = "walk"
    ts = [
        embd,
        _Tensor(name(T.OUTPUT_NORM), (E,), GGML_F32, "ones"),
        mat(name(T.OUTPUT), (E, V), s["output_scale"]),
    ]
    for i in range(cfg.n_layer):
        ts.append(_Tensor(name(T.ATTN_NORM, i), (E,), GGML_F32, "ones", layer=i))
        if cfg.arch == "deepseek2":   # MLA, as llama.cpp loads it with is_mla(): attn_k_b / attn_v_b split
            Q, KV, R, H = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_dim, cfg.n_head
            if Q:
                ts += [f32(name(T.ATTN_Q_A_NORM, i), (Q,), "ones", i), mat(name(T.ATTN_Q_A, i), (E, Q), s["attn_scale"], i),
                       mat(name(T.ATTN_Q_B, i), (Q, q_dim), latent(Q), i)]
            else:
                ts.append(mat(name(T.ATTN_Q, i), (E, q_dim), s["attn_scale"], i))
            nope = cfg.head_dim - R
            ts += [f32(name(T.ATTN_KV_A_NORM, i), (KV,), "ones", i),
                   mat(name(T.ATTN_KV_A_MQA, i), (E, KV + R), s["attn_scale"], i),
                   mat(name(T.ATTN_K_B, i), (nope, KV, H), latent(nope), i),
                   mat(name(T.ATTN_V_B, i), (KV, cfg.v_head_dim, H), latent(KV), i),
                   mat(name(T.ATTN_OUT, i), (H * cfg.v_head_dim, E), s["attn_out_scale"], i)]
        else:
            ts += [
                mat(name(T.ATTN_Q, i), (E, q_dim), s["attn_scale"], i),
                mat(name(T.ATTN_K, i), (E, kv_dim), s["attn_scale"], i),
                mat(name(T.ATTN_V, i), (E, kv_dim), s["attn_scale"], i),
                mat(name(T.ATTN_OUT, i), (q_dim, E), s["attn_out_scale"], i),
            ]
        if cfg.arch == "qwen3moe":
            ts += [_Tensor(name(T.ATTN_Q_NORM, i), (cfg.head_dim,), GGML_F32, "ones", layer=i),
                   _Tensor(name(T.ATTN_K_NORM, i), (cfg.head_dim,), GGML_F32, "ones", layer=i)]
        if cfg.arch == "gpt-oss":    # biases on q, k, v and the output; a sink logit per head
            ts += [f32(name(T.ATTN_Q, i, "bias"), (q_dim,), "normal", i, s["attn_scale"]),
                   f32(name(T.ATTN_K, i, "bias"), (kv_dim,), "normal", i, s["attn_scale"]),
                   f32(name(T.ATTN_V, i, "bias"), (kv_dim,), "normal", i, s["attn_scale"]),
                   f32(name(T.ATTN_OUT, i, "bias"), (E,), "normal", i, s["attn_out_scale"]),
                   f32(name(T.ATTN_SINKS, i), (cfg.n_head,), "normal", i, 1.0)]
        # (GLM and gpt-oss call the FFN's input norm post_attention_norm)
        ts.append(_Tensor(name(T.ATTN_POST_NORM if cfg.arch in ("glm4moe", "gpt-oss") else T.FFN_NORM, i), (E,),
                          GGML_F32, "ones", layer=i))
        if i < cfg.n_layer_dense_lead:   # a dense layer: no experts, nothing for host_experts to move
            N = cfg.n_ff
            ts += [mat(name(T.FFN_GATE, i), (E, N), s["ffn_scale"], i), mat(name(T.FFN_UP, i), (E, N), s["ffn_scale"], i),
                   mat(name(T.FFN_DOWN, i), (N, E), s["down_scale"], i)]
            continue
        ts += [
            _Tensor(name(T.FFN_GATE_INP, i), (E, D), GGML_F32, "router", s["router_scale"], layer=i),
            mat(name(T.FFN_GATE_EXP, i), (E, F, D), s["ffn_scale"], i, gtype=et),
            mat(name(T.FFN_UP_EXP, i), (E, F, D), s["ffn_scale"], i, gtype=et),
            mat(name(T.FFN_DOWN_EXP, i), (F, E, D), s["down_scale"], i, gtype=et),
        ]
        if cfg.arch == "gpt-oss":    # the router's bias (zero: routing stays the router rows'), the experts' biases
            ts += [f32(name(T.FFN_GATE_INP, i, "bias"), (D,), "zeros", i),
                   f32(name(T.FFN_GATE_EXP, i, "bias"), (F, D), "normal", i, s["ffn_scale"]),
                   f32(name(T.FFN_UP_EXP, i, "bias"), (F, D), "normal", i, s["ffn_scale"]),
                   f32(name(T.FFN_DOWN_EXP, i, "bias"), (E, D), "normal", i, s["down_scale"])]
        if cfg.sigmoid_gating:   # a selection bias (the same for every expert: routing stays the router's)
            ts.append(f32(name(T.FFN_EXP_PROBS_B, i, "bias"), (D,), "ones", i))
        # shared experts stay with their layer's device (host_experts moves *_exps): n_expert_shared of n_ff_exp
        # (glm4moe, deepseek2), or one of n_ff_shexp with its own gate (qwen2moe); the two never meet
        S = cfg.n_ff_shexp or cfg.n_ff_exp * cfg.n_expert_shared
        if cfg.arch == "qwen2moe":
            ts.append(mat(name(T.FFN_GATE_INP_SHEXP, i), (E,), s["router_scale"], i))
        if S:
            ts += [mat(name(T.FFN_GATE_SHEXP, i), (E, S), s["ffn_scale"], i),
                   mat(name(T.FFN_UP_SHEXP, i), (E, S), s["ffn_scale"], i),
                   mat(name(T.FFN_DOWN_SHEXP, i), (S, E), s["down_scale"], i)]
    off = 0
    for t in ts:
        t.nbytes = _nbytes(t.ne, t.gtype)
        t.offset = off
        off += _pad(t.nbytes)
    return ts


def expert_bytes_per_layer(cfg: SynthConfig) -> int:
    """Bytes of ffn_gate_exps + ffn_up_exps + ffn_down_exps of one MoE layer (unpadded; weights, not biases)."""
    et = _EXPERT_TYPE[cfg.experts_type]
    return 3 * _nbytes((cfg.n_embd, cfg.n_ff_exp, cfg.n_expert), et)


# ----------------------------------------------------------------------------------------------
# metadata


def _writer(cfg: SynthConfig, tensors: List[_Tensor]) -> "gguf.GGUFWriter":
    """A gguf-py writer holding the file's metadata and tensor table (the data is streamed by write_gguf)."""
    w = gguf.GGUFWriter(None, cfg.arch)   # general.architecture first; gguf-py prefixes the keys with it
    w.add_name(f"pyllama_pp synth {cfg.arch} {cfg.preset}")
    w.add_file_type(_FILE_TYPE[cfg.experts_type])
    if cfg.type == "q8_0" or cfg.expert_type in ("q8_0", "q4_k", "mxfp4"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    # unused by qwen3moe (Qwen3-30B-A3B stores 768 * 8); llama reads its experts' width from it (Mixtral: 14336);
    # gpt-oss-20b stores its experts' width
    w.add_feed_forward_length(cfg.n_ff or (cfg.n_ff_exp if cfg.arch in ("llama", "gpt-oss")
                                           else cfg.n_ff_exp * cfg.n_expert_used))
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    if cfg.arch == "deepseek2":
        # MLA as the converter writes it: the cache holds one latent head (kv_lora_rank + rope_dim keys,
        # kv_lora_rank values); the *_mla lengths are the heads after attn_k_b / attn_v_b (llama.cpp's is_mla())
        w.add_key_length(cfg.kv_lora_rank + cfg.rope_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_rope_dimension_count(cfg.rope_dim)
        w.add_q_lora_rank(cfg.q_lora_rank)   # (read unless the model is lite; 0 = attn_q)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    if cfg.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    if cfg.arch in ("glm4moe", "deepseek2"):   # GLM-4.5, DeepSeek-V3: sigmoid, normalised; DeepSeek-V2: softmax, as is
        sigmoid = cfg.sigmoid_gating
        w.add_expert_shared_count(cfg.n_expert_shared)
        w.add_leading_dense_block_count(cfg.n_layer_dense_lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_weights_norm(sigmoid)
        w.add_expert_weights_scale(1.0)
    if cfg.arch == "gpt-oss":     # (its gating is fixed: softmax over the top-k logits; SWA on every other layer)
        w.add_sliding_window(cfg.n_swa)
    # the "test" vocab: token i is named by its hex id (what the test vocab prints for it), all NORMAL, no BOS/EOS
    w.add_tokenizer_model("test")
    w.add_token_list([format(i, "x") for i in range(cfg.n_vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.n_vocab)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    # ours: how this file was made
    w.add_uint32("pyllama_pp.synth.version", SYNTH_FORMAT_VERSION)
    w.add_string("pyllama_pp.synth.preset", cfg.preset)
    w.add_string("pyllama_pp.synth.type", cfg.type)
    w.add_string("pyllama_pp.synth.routing", cfg.routing)
    w.add_float32("pyllama_pp.synth.skew", float(cfg.skew))
    w.add_uint64("pyllama_pp.synth.seed", int(cfg.seed))
    w.add_uint64("pyllama_pp.synth.tile_min_elements", TILE_MIN_ELEMENTS)
    for field in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert",
                  "n_expert_used", "n_ff_exp", "n_vocab", "n_ctx_train"):
        w.add_uint32(f"pyllama_pp.synth.{field}", int(getattr(cfg, field)))
    if cfg.arch != "qwen3moe":   # (qwen3moe files stay as they were)
        w.add_string("pyllama_pp.synth.arch", cfg.arch)
        for field in ("n_ff_shexp", "n_expert_shared", "n_layer_dense_lead", "n_ff"):
            w.add_uint32(f"pyllama_pp.synth.{field}", int(getattr(cfg, field)))
    if cfg.arch == "deepseek2":
        for field in _MLA_FIELDS:
            w.add_uint32(f"pyllama_pp.synth.{field}", int(getattr(cfg, field)))
        w.add_string("pyllama_pp.synth.gating", cfg.gating or "softmax")
    if cfg.arch == "gpt-oss":
        w.add_uint32("pyllama_pp.synth.n_swa", cfg.n_swa)
    if cfg.expert_type is not None:   # (files of one type stay as they were)
        w.add_string("pyllama_pp.synth.expert_type", cfg.expert_type)
    if cfg.routing == "locality":
        locality, span = cfg.resolved_locality()
        w.add_float32("pyllama_pp.synth.locality", locality)
        w.add_float32("pyllama_pp.synth.locality_span", span)
    for field, v in cfg.resolved_scales().items():
        w.add_float32(f"pyllama_pp.synth.{field}", v)
    for t in tensors:   # gguf-py takes numpy's order of dimensions: the reverse of ggml's ne
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes,
                          raw_dtype=gguf.GGMLQuantizationType(t.gtype))
    return w


def _header_bytes(cfg: SynthConfig, tensors: List[_Tensor]) -> bytes:
    """Header, metadata and tensor table, padded to the data alignment, as gguf-py writes them."""
    w = _writer(cfg, tensors)
    with tempfile.TemporaryDirectory(prefix="pyllama_pp_synth_") as d:
        head = Path(d) / "header.gguf"
        w.write_header_to_file(head)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        w.close()
        return head.read_bytes()


def estimate_file_bytes(cfg: SynthConfig) -> int:
    """Exact size of the file ``write_gguf`` would write for ``cfg``."""
    cfg.validate()
    ts = _plan(cfg)
    return len(_header_bytes(cfg, ts)) + ts[-1].offset + _pad(ts[-1].nbytes)


# ----------------------------------------------------------------------------------------------
# random data


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=key)))


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _prev_prime(n: int) -> int:
    n |= 1
    while True:
        if n < 4 or all(n % p for p in range(3, int(math.isqrt(n)) + 1, 2)):
            return n
        n -= 2


_POOL_BYTES = 16 << 20
_CHUNK_ELEMS = 1 << 22  # elements per fresh chunk (bounds memory)


def _q8_blocks(g: np.random.Generator, nb: int, scale: float) -> np.ndarray:
    """nb random Q8_0 blocks (fp16 d + 32 int8 quants) whose values have std ~ scale."""
    out = np.empty((nb, 34), dtype=np.uint8)
    raw = g.bit_generator.random_raw((nb * 32 + 7) // 8).view(np.uint8)[: nb * 32]
    out[:, 2:] = raw.reshape(nb, 32)
    d = (scale / _INT8_STD) * (0.75 + 0.5 * g.random(nb, dtype=np.float32))
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
    return out


def _f16_values(g: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """n F16 values, normally distributed with std ``scale``.

    Drawn as random 16-bit indices into a table of 65536 normal samples (made per call): about
    10x faster than drawing n normals, and just as random for our purposes.
    """
    table = (g.standard_normal(1 << 16, dtype=np.float32) * np.float32(scale)).astype("<f2")
    idx = g.bit_generator.random_raw((n + 3) // 4).view("<u2")[:n]
    return table[idx]


def _bf16_values(g: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """n BF16 values (as uint16), normally distributed with std ``scale``: as _f16_values, the table rounded to
    BF16 (to nearest even, as ggml does)."""
    bits = (g.standard_normal(1 << 16, dtype=np.float32) * np.float32(scale)).view(np.uint32).astype(np.uint64)
    table = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    idx = g.bit_generator.random_raw((n + 3) // 4).view("<u2")[:n]
    return table[idx]


def _random_bytes(g: np.random.Generator, n: int) -> np.ndarray:
    return g.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


# std of a uniform 4-bit quant (0..15)
_U4_STD = math.sqrt((16.0 ** 2 - 1.0) / 12.0)


def _q4k_blocks(g: np.random.Generator, nb: int, scale: float) -> np.ndarray:
    """nb random Q4_K blocks (fp16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit quants)
    whose 256 values have std ~ scale and mean ~ 0.

    A value is ``d * sc * q - dmin * m`` (8 sub-blocks of 32, each with its scale sc and min m). With m = sc and
    dmin = 7.5 d it is ``d * sc * (q - 7.5)``: symmetric about 0 for uniform quants q. The sub-block scales are random
    in [32, 63], d makes the block's std ``scale`` times a per-block factor in [0.75, 1.25), as for Q8_0."""
    out = np.empty((nb, 144), dtype=np.uint8)
    sc = g.integers(32, 64, size=(nb, 8), dtype=np.uint8)
    rms = np.sqrt((sc.astype(np.float32) ** 2).mean(axis=1))
    d = (np.float32(scale / _U4_STD) * (0.75 + 0.5 * g.random(nb, dtype=np.float32)) / rms).astype("<f2")
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = (d.astype(np.float32) * np.float32(7.5)).astype("<f2").view(np.uint8).reshape(nb, 2)
    lo, hi = sc[:, :4], sc[:, 4:]       # (ggml's get_scale_min_k4: sub-blocks 4-7 split over two places)
    out[:, 4:8] = (lo & 63) | ((hi >> 4) << 6)      # scales 0-3, and the top bits of scales 4-7
    out[:, 8:12] = (lo & 63) | ((hi >> 4) << 6)     # mins 0-3 (= the scales), and the top bits of mins 4-7
    out[:, 12:16] = (hi & 15) | ((hi & 15) << 4)    # the low bits of scales 4-7 and of mins 4-7
    out[:, 16:] = _random_bytes(g, nb * 128).reshape(nb, 128)
    return out


# std of a uniform E2M1 quant, in units of an E8M0 block scale's half (ggml's doubled kvalues: 0, +-1, ..., +-12)
_E2M1_STD = math.sqrt(2 * sum(k * k for k in (0, 1, 2, 3, 4, 6, 8, 12)) / 16)


def _mxfp4_blocks(g: np.random.Generator, nb: int, scale: float) -> np.ndarray:
    """nb random MXFP4 blocks (one E8M0 exponent byte e, 16 bytes of E2M1 nibbles) whose 32 values have std ~ scale
    and mean ~ 0.

    A value is ``2**(e - 128) * k`` (k a doubled E2M1 value). Uniform nibbles give std ``2**(e - 128) * 5.85``; the
    exponent is a power of two, so each block takes the one below or above the target (the target is ``scale``
    times a per-block factor in [0.75, 1.25), as for Q8_0), with odds that give the target's variance on average."""
    out = np.empty((nb, 17), dtype=np.uint8)
    out[:, 1:] = _random_bytes(g, nb * 16).reshape(nb, 16)
    if scale <= 0:   # (all zero: e = 0 with zero nibbles)
        out[:] = 0
        return out
    target = np.float64(scale / _E2M1_STD) * (0.75 + 0.5 * g.random(nb))
    lo = np.floor(np.log2(target))
    p_hi = (target ** 2 / 4.0 ** lo - 1.0) / 3.0     # variance 4**lo (1 - p) + 4**(lo + 1) p = target**2
    e = lo + 128 + (g.random(nb) < p_hi)
    out[:, 0] = np.clip(e, 2, 254).astype(np.uint8)   # (e < 2 is a subnormal half-scale in ggml)
    return out


# per type: (elements per unit, bytes per unit, generator of n units): the unit of fresh chunks and pools is a block
_UNITS = {g: (*GGML_TYPES[g][1:], make) for g, make in ((GGML_Q8_0, _q8_blocks), (GGML_F16, _f16_values),
                                                           (GGML_BF16, _bf16_values), (GGML_Q4_K, _q4k_blocks),
                                                           (GGML_MXFP4, _mxfp4_blocks))}


class _Pools:
    """One pool of random units (blocks of a quantized type, F16 or BF16 values) per (type, scale), made on demand."""

    def __init__(self, seed: int):
        self.seed = seed
        self.pools: Dict[Tuple[int, float], Tuple[memoryview, int, int]] = {}

    def get(self, gtype: int, scale: float) -> Tuple[memoryview, int, int]:
        key = (gtype, float(scale))
        if key not in self.pools:
            g = _rng(self.seed, 0x9001, gtype, int(np.float64(scale).view(np.uint64)))
            _, unit, make = _UNITS[gtype]
            n = _prev_prime(_POOL_BYTES // unit)
            data = make(g, n, scale)
            self.pools[key] = (memoryview(data.tobytes()), unit, n)
        return self.pools[key]


def _write_matrix(f: BinaryIO, t: _Tensor, cfg: SynthConfig, pools: _Pools) -> None:
    g = _rng(cfg.seed, 0x7E50, _name_key(t.name))
    unit_elems, _, make = _UNITS[t.gtype]
    n_units = t.n_elements // unit_elems
    if t.fresh:
        step = max(1, _CHUNK_ELEMS // unit_elems)
        for start in range(0, n_units, step):
            n = min(step, n_units - start)
            f.write(make(g, n, t.scale).data)
        return
    pool, unit, pn = pools.get(t.gtype, t.scale)
    pos = int(g.integers(0, pn))
    left = n_units
    while left:
        n = min(left, pn - pos)
        f.write(pool[pos * unit:(pos + n) * unit])
        left -= n
        pos = 0


def _router_weights(t: _Tensor, cfg: SynthConfig) -> np.ndarray:
    E, D = t.ne  # ggml (n_embd, n_expert): row e (length n_embd) is expert e's router row
    g = _rng(cfg.seed, 0x2007, _name_key(t.name))
    w = g.standard_normal((D, E), dtype=np.float32)
    if cfg.routing == "natural":
        w *= np.float32(t.scale)
        return w
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    mult = np.full(D, t.scale * math.sqrt(E), dtype=np.float64)
    if cfg.routing in ("skewed", "locality") and cfg.skew > 0:
        rank = g.permutation(D)  # expert e has rank rank[e]
        mult *= (rank + 1.0) ** (-float(cfg.skew))
    w *= mult.astype(np.float32)[:, None]
    return w


def _write_walk_embeddings(f: BinaryIO, t: _Tensor, cfg: SynthConfig) -> None:
    """routing="locality"'s token embeddings (see the module docstring), drawn in float32 and quantized to the
    tensor's type by gguf-py, in chunks of rows."""
    E, V = t.ne
    locality, span = cfg.resolved_locality()
    rho = math.exp(-1.0 / span)
    g = _rng(cfg.seed, 0x10CA, _name_key(t.name))
    state = g.standard_normal(E)   # the walk starts in its stationary distribution
    rows = max(1, _CHUNK_ELEMS // E)
    for start in range(0, V, rows):
        n = min(rows, V - start)
        walk = g.standard_normal((n, E)) * math.sqrt(1.0 - rho * rho)
        for i in range(n):
            state = rho * state + walk[i]
            walk[i] = state
        emb = t.scale * (math.sqrt(locality) * walk + math.sqrt(1.0 - locality) * g.standard_normal((n, E)))
        f.write(gguf.quants.quantize(emb.astype(np.float32), gguf.GGMLQuantizationType(t.gtype)).tobytes())


def _write_tensor(f: BinaryIO, t: _Tensor, cfg: SynthConfig, pools: _Pools) -> None:
    if t.fill == "ones":
        f.write(np.ones(t.n_elements, dtype="<f4").tobytes())
    elif t.fill == "zeros":
        f.write(np.zeros(t.n_elements, dtype="<f4").tobytes())
    elif t.fill == "normal":   # F32 biases and sinks (small: drawn whole)
        g = _rng(cfg.seed, 0xB1A5, _name_key(t.name))
        f.write((g.standard_normal(t.n_elements, dtype=np.float32) * np.float32(t.scale)).astype("<f4").tobytes())
    elif t.fill == "router":
        f.write(_router_weights(t, cfg).astype("<f4").tobytes())
    elif t.fill == "walk":
        _write_walk_embeddings(f, t, cfg)
    else:
        _write_matrix(f, t, cfg, pools)
    pad = _pad(t.nbytes) - t.nbytes
    if pad:
        f.write(b"\0" * pad)


# ----------------------------------------------------------------------------------------------
# public writer


def cached_model(directory, preset_name: str = "tiny", **overrides: Any) -> Path:
    """The GGUF of ``preset(preset_name, **overrides)`` in ``directory``, written once (the same config gives
    the same bytes). Named ``<preset>-L<n_layer>-<routing>[<skew>]-s<seed>[-<hash>].gguf``: the hash of the
    config is added when it differs from the preset in anything else (n_expert, type, ...), so two configs never
    share a file."""
    cfg = preset(preset_name, **overrides)
    tag = f"{cfg.routing}{cfg.skew:g}" if cfg.routing in ("skewed", "locality") else cfg.routing
    # (skew as the name writes it: a skew the name rounds gets the hash too)
    named = {"n_layer": cfg.n_layer, "routing": cfg.routing, "skew": float(f"{cfg.skew:g}"), "seed": cfg.seed}
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in _LATER_FIELDS or v != _FIELD_DEFAULTS[k]}   # (hashes of files cached before they came)
    other = "" if cfg == preset(preset_name, **named) else "-" + hashlib.sha1(
        json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:8]
    path = Path(directory) / f"{preset_name}-L{cfg.n_layer}-{tag}-s{cfg.seed}{other}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"pyllama_pp: writing the synthetic model {path}", file=sys.stderr)
        write_gguf(path, cfg)
    return path


def write_gguf(path, cfg: SynthConfig, progress: bool = False) -> Dict[str, Any]:
    """Write ``cfg`` as a GGUF file at ``path`` (streamed; atomically renamed into place).

    Returns a summary: ``path``, ``bytes`` (file size), ``n_params``, ``n_tensors``,
    ``expert_bytes_per_layer``, ``expert_bytes`` (all MoE layers), ``seconds``, ``mb_per_s``, and the
    config's ``preset``, ``type``, ``expert_type`` (the experts' type), ``routing``, ``skew``, ``seed``.
    """
    cfg.validate()
    path = os.fspath(path)
    t0 = time.perf_counter()
    tensors = _plan(cfg)
    header = _header_bytes(cfg, tensors)
    total = len(header) + tensors[-1].offset + _pad(tensors[-1].nbytes)
    pools = _Pools(cfg.seed)
    tmp = path + ".partial"
    last_layer = -2
    try:
        with open(tmp, "wb", buffering=1 << 22) as f:
            f.write(header)
            for t in tensors:
                if progress and t.layer != last_layer and t.layer >= 0:
                    last_layer = t.layer
                    done = f.tell()
                    dt = time.perf_counter() - t0
                    print(f"synth: layer {t.layer + 1}/{cfg.n_layer}  {done / 1e6:,.0f}/{total / 1e6:,.0f} MB"
                          f"  {done / 1e6 / max(dt, 1e-9):,.0f} MB/s", file=sys.stderr, flush=True)
                _write_tensor(f, t, cfg, pools)
            written = f.tell()
        if written != total:
            raise RuntimeError(f"internal error: wrote {written} bytes, planned {total}")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dt = time.perf_counter() - t0
    if progress:
        print(f"synth: wrote {path}: {total / 1e6:,.1f} MB in {dt:.1f} s ({total / 1e6 / max(dt, 1e-9):,.0f} MB/s)",
              file=sys.stderr, flush=True)
    epl = expert_bytes_per_layer(cfg)
    return {
        "path": path,
        "bytes": total,
        "n_params": sum(t.n_elements for t in tensors),
        "n_tensors": len(tensors),
        "expert_bytes_per_layer": epl,
        "expert_bytes": epl * (cfg.n_layer - cfg.n_layer_dense_lead),
        "seconds": dt,
        "mb_per_s": total / 1e6 / max(dt, 1e-9),
        "preset": cfg.preset,
        "type": cfg.type,
        "expert_type": cfg.experts_type,
        "routing": cfg.routing,
        "skew": cfg.skew,
        "seed": cfg.seed,
    }
