"""An expert trace: the experts each MoE layer chose for each token of a run (``pyllama-pp trace``), the input of the
expert-cache simulator (pyllama_pp.expert_cache_sim).

The shim records one block of ids per MoE layer per ubatch, in the order llama computed them (trace.cpp,
``pp_trace_record``); :meth:`ExpertTrace.from_records` puts them in place: [tokens, layers, k].
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, Union

import numpy as np

__all__ = ["ExpertTrace"]


@dataclass
class ExpertTrace:
    """The experts each MoE layer chose for each token of a run.

    Attributes:
        ids: int32 [tokens, layers, k]: each token's ids in top-k order at each MoE layer (-1: not recorded).
        layers: the model's layer index of each column (MoE layers only: dense layers choose no experts).
        n_expert: experts per layer.
        n_prompt: the first tokens that were a prompt (decoded as one batch); the rest were decoded one by one.
        meta: what made it (model, variant, devices, seed, routing, tokens, ...).
        tensors: hidden states captured with the ids (``Session.trace_experts(capture=...)``): llama's tensor name
            ("l_out", "ffn_inp", "ffn_norm") -> float32 [tokens, the model's layers, width] (NaN: not recorded).
            Not written by save().
    Raises:
        ValueError: for ids that are not [tokens, layers, k] with one column per layer, or out of range.
    """

    ids: np.ndarray
    layers: np.ndarray
    n_expert: int
    n_prompt: int = 0
    meta: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)

    def __post_init__(self):
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.layers = np.asarray(self.layers, dtype=np.int32)
        if self.ids.ndim != 3 or self.ids.shape[1] != len(self.layers):
            raise ValueError(f"ids must be [tokens, layers, k] with one column per layer, got shape "
                             f"{self.ids.shape} for {len(self.layers)} layers")
        if self.ids.size and int(self.ids.max()) >= self.n_expert:
            raise ValueError(f"an expert id {int(self.ids.max())} is out of range for {self.n_expert} experts")
        if not 0 <= self.n_prompt <= self.n_tokens:
            raise ValueError(f"n_prompt ({self.n_prompt}) must be in [0, {self.n_tokens}]")

    @property
    def n_tokens(self) -> int:
        """Tokens recorded."""
        return int(self.ids.shape[0])

    @staticmethod
    def from_records(records: Sequence[tuple], flat_ids: np.ndarray, n_tokens: int, n_expert: int,
                     n_prompt: int = 0, meta: Union[dict, None] = None) -> "ExpertTrace":
        """Place the shim's records - one per MoE layer per ubatch, in compute order - into [tokens, layers, k]. A
        record whose layer is not above the previous one starts the next ubatch; a ubatch's tokens follow the
        previous ubatch's.

        Args:
            records: (layer, n_tokens, k, offset) each (pp_trace_record: offset into flat_ids).
            flat_ids: every record's ids, each record's n_tokens x k token-major.
            n_tokens: the tokens decoded.
            n_expert: experts per layer.
            n_prompt: the first tokens that were a prompt.
            meta: what made it.
        Returns:
            ExpertTrace: the ids in place.
        Raises:
            ValueError: when the records do not cover exactly n_tokens tokens at every layer.
        """
        layers = sorted({int(r[0]) for r in records})
        col = {layer: i for i, layer in enumerate(layers)}
        k = max((int(r[2]) for r in records), default=0)
        ids = np.full((n_tokens, len(layers), k), -1, dtype=np.int32)
        seen = np.zeros((n_tokens, len(layers)), dtype=bool)
        start, width, prev = 0, 0, None
        for layer, n_tok, kk, offset in records:
            if prev is not None and layer <= prev:   # the next ubatch
                start, width = start + width, 0
            prev, width = layer, max(width, n_tok)
            if start + n_tok > n_tokens:
                raise ValueError(f"the trace holds more than the {n_tokens} tokens decoded (layer {layer})")
            block = np.asarray(flat_ids[offset: offset + n_tok * kk], dtype=np.int32).reshape(n_tok, kk)
            ids[start: start + n_tok, col[layer], :kk] = block
            seen[start: start + n_tok, col[layer]] = True
        if not seen.all():
            t, c = np.argwhere(~seen)[0]
            raise ValueError(f"the trace lacks token {t} at layer {layers[c]} (a layer that computed only some rows, "
                             "or records past the trace's limit)")
        return ExpertTrace(ids, np.asarray(layers), n_expert, n_prompt, dict(meta or {}))

    @staticmethod
    def place_tensors(records: Sequence[tuple], values: np.ndarray, names: Sequence[str], n_tokens: int,
                      n_layer: int) -> dict:
        """Place the shim's captured tensors - one per layer per ubatch and name, in compute order - into
        [tokens, layers, width] per name: each layer's records follow each other in token order.

        Args:
            records: (capture, layer, n_tokens, width, offset) each (pp_trace_tensor: capture indexes names).
            values: every record's values, each record's n_tokens x width token-major.
            names: the captured names, in the order they were asked for.
            n_tokens: the tokens decoded.
            n_layer: the model's layers.
        Returns:
            dict: name -> float32 [n_tokens, n_layer, width], NaN where nothing was recorded.
        Raises:
            ValueError: when a layer's records hold more than n_tokens tokens or a layer index is out of range.
        """
        out: dict = {}
        cursor = np.zeros((len(names), n_layer), dtype=np.int64)
        for which, layer, n_tok, width, offset in records:
            name = names[which]
            if not 0 <= layer < n_layer:
                raise ValueError(f"a captured {name} names layer {layer} of a {n_layer}-layer model")
            if name not in out:
                out[name] = np.full((n_tokens, n_layer, width), np.nan, dtype=np.float32)
            start = int(cursor[which, layer])
            if start + n_tok > n_tokens:
                raise ValueError(f"the captured {name} holds more than the {n_tokens} tokens decoded (layer {layer})")
            out[name][start: start + n_tok, layer] = np.asarray(values[offset: offset + n_tok * width],
                                                                dtype=np.float32).reshape(n_tok, width)
            cursor[which, layer] = start + n_tok
        return out

    def save(self, path: Union[str, Path]) -> None:
        """Write the trace as a compressed .npz: ids, layers, n_expert, n_prompt and meta (JSON text).

        Args:
            path: the file (numpy adds .npz to a name without it).
        """
        np.savez_compressed(path, ids=self.ids, layers=self.layers, n_expert=np.int32(self.n_expert),
                            n_prompt=np.int32(self.n_prompt), meta=np.array(json.dumps(self.meta, default=str)))

    @staticmethod
    def load(path: Union[str, Path]) -> "ExpertTrace":
        """Read a trace that save() wrote.

        Args:
            path: the .npz file.
        Returns:
            ExpertTrace: the trace.
        Raises:
            ValueError: for a file that is not such a trace.
        """
        try:
            with np.load(path, allow_pickle=False) as z:
                return ExpertTrace(z["ids"], z["layers"], int(z["n_expert"]), int(z["n_prompt"]),
                                   json.loads(str(z["meta"])))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"{path} is not an expert trace (.npz from `pyllama-pp trace -o`): {e}") from None
