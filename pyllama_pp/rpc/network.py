"""What crosses the network per ubatch between a client and its ggml RPC servers: the byte model fit's predictions
and the multi-host paper (bench/multihost_paper.py) share.

Per ubatch of U tokens the first RPC device of each server's run of devices gets the hidden state (f32, U x hidden)
from the client - the embeddings, or the previous server's output: ggml RPC copies between two servers through the
client, so a boundary between servers crosses the client's network twice; a boundary between two devices of one
server does not (the server copies it itself, RPC_CMD_COPY_TENSOR). Every device gets its own inputs (the KQ mask,
f16, n_kv x U, n_kv the cache cells in use padded to KV_PAD; the positions) and its graph as a message of
RPC_TENSOR_BYTES per tensor, about GRAPH_TENSORS_PER_LAYER tensors a layer; the last device of a server's run sends
its output back down unless it holds the output layer (then only logits go down, not counted: a prompt's last
token's). A placement that computes experts away from the layer's device adds a round trip of the hidden state per
such layer. The constants were measured on loopback (`bench/multihost_paper.py --check` against
bench/multihost_ab.py's rows).
"""
from __future__ import annotations

ACT_BYTES = 4            # the hidden state travels as f32
MASK_BYTES = 2           # the KQ mask, f16
KV_PAD = 256             # the cache cells in use, padded
POS_BYTES = 4            # a position per token
# ggml RPC's serialized tensor (rpc_tensor in ggml-rpc.cpp: ids, type, shape, strides, op and its parameters, ten
# sources, view, data, a 64-byte name) and the tensors a layer's graph sends, measured on loopback
RPC_TENSOR_BYTES = 296
GRAPH_TENSORS_PER_LAYER = 75


def n_kv_mean(prompt: int, ubatch: int) -> float:
    """The KQ mask's width averaged over a prompt's ubatches: the cells in use after each, padded to KV_PAD."""
    n_ub = -(-prompt // ubatch)
    return sum(-(-min(prompt, (i + 1) * ubatch) // KV_PAD) * KV_PAD for i in range(n_ub)) / n_ub


def input_bytes(ubatch: int, n_kv: float) -> float:
    """One device's user inputs per ubatch: its KQ mask and the positions."""
    return ubatch * (MASK_BYTES * n_kv + POS_BYTES)


def graph_bytes(layers: float) -> float:
    """The graph message of a device computing `layers` layers."""
    return RPC_TENSOR_BYTES * GRAPH_TENSORS_PER_LAYER * layers


def device_bytes(hidden: int, ubatch: int, n_kv: float, layers: float, act_in: bool = True, act_out: bool = True,
                 round_trips: float = 0) -> tuple[float, float]:
    """One RPC device's bytes per ubatch over the client's network, (up to its server, down from it).

    Args:
        hidden: the model's hidden size (n_embd).
        ubatch: tokens in the ubatch.
        n_kv: the KQ mask's width (n_kv_mean for a prompt).
        layers: the layers the device computes.
        act_in: the hidden state comes from the client (the first device, or one after another server's).
        act_out: the hidden state goes back to the client (followed by another server's device; False for the device
            with the output layer, or one followed by a device of its own server).
        round_trips: extra round trips of the hidden state (experts computed off the device: one per such layer).
    """
    act = ubatch * hidden * ACT_BYTES
    up = act * act_in + input_bytes(ubatch, n_kv) + graph_bytes(layers) + round_trips * act
    down = act * act_out + round_trips * act
    return up, down


__all__ = ["device_bytes", "graph_bytes", "input_bytes", "n_kv_mean"]
