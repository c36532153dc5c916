"""Pure-Python placement and context values (pyllama_pp.params; no variant is loaded here)."""
from __future__ import annotations

import dataclasses
import re

import pytest

from pyllama_pp.errors import ConfigError
from pyllama_pp.params import ContextParams, Placement, host_expert_overrides

EXPERT_NAMES = ["blk.{i}.ffn_up_exps.weight", "blk.{i}.ffn_down_exps.weight", "blk.{i}.ffn_gate_exps.weight",
                "blk.{i}.ffn_gate_up_exps.weight"]
OTHER_NAMES = ["blk.{i}.ffn_gate_inp.weight", "blk.{i}.attn_q.weight", "blk.{i}.ffn_up_shexp.weight",
               "blk.{i}.ffn_norm.weight"]


def _host_layers(overrides: list[str], n_layer: int = 48) -> set[int]:
    """Layers whose expert tensors an override list sends to the CPU (llama.cpp uses regex_search)."""
    layers = set()
    for ov in overrides:
        pattern, _, buft = ov.rpartition("=")
        assert buft == "CPU", ov
        rx = re.compile(pattern)
        for i in range(n_layer):
            hits = [bool(rx.search(n.format(i=i))) for n in EXPERT_NAMES]
            if any(hits):
                assert all(hits), f"{ov} keeps only some expert tensors of layer {i} on the host"
                layers.add(i)
            for n in OTHER_NAMES:
                assert not rx.search(n.format(i=i)), f"{ov} also matches {n.format(i=i)}"
    return layers


@pytest.mark.parametrize("spec,want", [
    ("all", set(range(48))), ("none", set()), (None, set()), (0, set()), (3, {0, 1, 2}), ("2", {0, 1}),
    ([1, 3], {1, 3}), ([13, 1], {1, 13}), ([4, 4, 5], {4, 5}), ([], set()),
])
def test_host_expert_overrides(spec, want):
    assert _host_layers(host_expert_overrides(spec)) == want


def test_layer_list_does_not_match_other_layers_with_the_same_digits():
    assert _host_layers(host_expert_overrides([1, 3])) == {1, 3}   # not 11, 13, 31, ...


def test_host_expert_overrides_rejects_bad_values():
    with pytest.raises(ConfigError):             # (a ValueError)
        host_expert_overrides("most")
    with pytest.raises(ConfigError, match=r"layer 6, and the model has 6 layers \(0\.\.5\)"):
        host_expert_overrides([2, 6], n_layer=6)


def test_placement_overrides_and_dicts():
    p = Placement(host_experts=2, overrides=[r"blk\.5\.attn_q=CPU"])
    ov = p.all_overrides()
    assert len(ov) == 2 and ov[-1] == r"blk\.5\.attn_q=CPU"
    assert _host_layers(ov[:1]) == {0, 1}
    assert Placement(**p.to_dict()) == p
    assert ContextParams(**ContextParams(n_ubatch=16).to_dict()).n_ubatch == 16


def test_placement_and_context_are_frozen_and_normalized():
    """Both values are checked once and cannot change afterwards: a changed copy is made with dataclasses.replace.
    Equal choices written differently are the same Placement."""
    p = Placement(host_experts="3", overrides=[r"blk\.5\.attn_q=CPU"], tensor_split=[1, 1])
    assert p.host_experts == 3 and p.overrides == (r"blk\.5\.attn_q=CPU",) and p.tensor_split == (1.0, 1.0)
    assert Placement(host_experts=[2, 0]).host_experts == (0, 2)
    assert Placement(host_experts=0) == Placement(host_experts=None) == Placement(host_experts="none")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.host_experts = "all"
    c = ContextParams(n_ubatch=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_ubatch = 32
    assert dataclasses.replace(c, n_ubatch=32).n_ubatch == 32 and c.n_ubatch == 16
    with pytest.raises(ConfigError, match="cannot exceed n_batch"):
        dataclasses.replace(c, n_ubatch=4096)
