#!/usr/bin/env python3
"""Several hosts on ggml RPC, on paper: bytes per PCIe link and per network link, and predicted prefill and decode
t/s, for a DeepSeek-V3-sized MoE on H hosts with G GPUs each, against upstream's two naive RPC placements.

Placements:
- series: each host keeps its own layers' experts in its own (pinned) RAM and streams them to its own GPUs over
  their own PCIe links (upload-all above the coverage bar, beside compute); only activations cross the network.
- naive-cpu: experts on each server's CPU device (`-ot exps=RPC[host:port]` on its CPU): the server's CPU computes
  them; only activations cross the network.
- naive-client: experts in the client's RAM: every remote GPU reads them over the network, every ubatch.

The model: every number it uses is a named constant below, with where it comes from (measured here, the model's
config, or an assumption to be replaced by a measurement). Prefill: one ubatch of U tokens flows through H x G
pipeline stages (each GPU a stage with its share of the layers); a stage takes the longer of its expert copies and
its compute (OVERLAP), the slowest stage or the busiest network link sets the pace. Decode (one sequence): one token
passes every stage in turn; small batches stay on the CPU that holds the experts (op offload starts at 32 tokens),
so decode reads the used experts from host RAM, plus a network round trip per host boundary.

    python bench/multihost_paper.py [--out DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# DeepSeek-V3 (its config.json): 61 layers, the first 3 dense; 256 routed experts (8 used) and 1 shared expert of
# intermediate size 2048; hidden 7168; dense FFN 18432; MLA attention (q_lora 1536, kv_lora 512, 128 heads,
# qk 128 + 64 rope, v 128); vocab 129280
N_LAYER, N_DENSE, N_EXPERT, N_USED, N_SHARED = 61, 3, 256, 8, 1
HIDDEN, FF_EXPERT, FF_DENSE, VOCAB = 7168, 2048, 18432, 129280
ATTN_PARAMS = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * 7168
EXPERT_BYTES_PER_PARAM = 4.5 / 8      # Q4_K experts (about 4.5 bits a weight)
DENSE_BYTES_PER_PARAM = 8.5 / 8       # Q8_0 for attention, shared expert and dense layers
# measured here: one H200's host link (PCIe 5 x16) moves 51-55 GB/s (docs/RESULTS.md); the planner's default
LINK_GBPS = 55.0
# measured here: one H200 computes the qwen3-30b-a3b preset (48 layers, 3.3 G active weights a token, so about
# 0.069 G a layer) at 9490 t/s at ub4096 with every weight resident (docs/results/long-prompts-2026-12-03): GPU
# seconds per active weight and token, scaled to this model's active weights per layer (first order: matmul-bound)
H200_S_PER_ACTIVE_PARAM = 1 / (9490 * 3.3e9)
# assumptions (not measured here): a server CPU computes quantized MoE matmuls at 1.5 TFLOP/s for prompts and reads
# weights at 200 GB/s for decode; a GPU spends 0.1 ms a layer on one token's dense work (launch-bound); the network
# adds 20 us a message; activations travel as f32; ggml RPC copies between two servers through the client (the
# server's copy works only inside one backend)
CPU_FLOPS, CPU_READ_GBPS, GPU_LAYER_TOKEN_S, NET_LATENCY_S, ACT_BYTES = 1.5e12, 200.0, 1e-4, 20e-6, 4
UBATCH = 4096
PROMPT = 32768   # the prompt's length: 8 ubatches; a pipeline of more stages than ubatches never fills


def model_sizes() -> dict:
    expert_params = 3 * HIDDEN * FF_EXPERT
    moe_layers = N_LAYER - N_DENSE
    layer_expert_bytes = N_EXPERT * expert_params * EXPERT_BYTES_PER_PARAM
    active_moe = ATTN_PARAMS + (N_USED + N_SHARED) * expert_params
    active_dense = ATTN_PARAMS + 3 * HIDDEN * FF_DENSE
    return {"moe_layers": moe_layers, "expert_bytes": expert_params * EXPERT_BYTES_PER_PARAM,
            "layer_expert_bytes": layer_expert_bytes, "all_expert_bytes": moe_layers * layer_expert_bytes,
            "active_moe": active_moe, "active_dense": active_dense,
            "dense_bytes": (N_LAYER * ATTN_PARAMS + N_DENSE * 3 * HIDDEN * FF_DENSE
                            + moe_layers * N_SHARED * expert_params + 2 * VOCAB * HIDDEN) * DENSE_BYTES_PER_PARAM}


def coverage(n_tokens: int) -> float:
    """The share of a layer's experts a ubatch of n_tokens uses (uniform routing)."""
    return 1 - (1 - N_USED / N_EXPERT) ** n_tokens


def row(hosts: int, gpus: int, net_gbit: float, m: dict) -> dict:
    net = net_gbit / 8 * 1e9                       # bytes/s of one host's NIC
    stages = hosts * gpus
    moe_per_stage = m["moe_layers"] / stages
    layers_per_stage = N_LAYER / stages
    act = UBATCH * HIDDEN * ACT_BYTES              # one boundary's activations a ubatch
    # -- prefill, the series: each GPU streams its layers' experts over its own link, beside compute
    copy = moe_per_stage * m["layer_expert_bytes"] * coverage(UBATCH) / (LINK_GBPS * 1e9)
    compute = UBATCH * (moe_per_stage * m["active_moe"] + (layers_per_stage - moe_per_stage) * m["active_dense"]) \
        * H200_S_PER_ACTIVE_PARAM
    stage = max(copy, compute) + copy / max(moe_per_stage, 1)   # (the first copy of a stage is exposed)
    # the client's NIC carries every boundary twice (server -> client -> next server) and the ends
    client_net = (2 * (hosts - 1) + 2) * act / net
    n_ub = -(-PROMPT // UBATCH)

    def pipelined(slowest: float, n_stages: int, each: float) -> float:
        """Prompt t/s of n_ub ubatches through n_stages stages: (n_ub - 1) slowest steps plus one pass (the fill)."""
        return PROMPT / ((n_ub - 1) * slowest + n_stages * each)
    series_pp = pipelined(max(stage, client_net), stages, stage)
    # -- prefill, naive-client: every expert crosses the client's NIC to the remote GPUs, every ubatch
    over_net = m["all_expert_bytes"] * coverage(UBATCH) / net + client_net
    naive_client_pp = pipelined(max(stage, over_net), 1, over_net)
    # -- prefill, naive-cpu: each server's CPU computes its layers' experts (2 FLOP a weight a token)
    cpu_stage = UBATCH * (m["moe_layers"] / hosts) * (N_USED * 3 * HIDDEN * FF_EXPERT) * 2 / CPU_FLOPS
    naive_cpu_pp = pipelined(max(cpu_stage, client_net), hosts, cpu_stage)
    # -- decode, one sequence: the used experts read from host RAM by each host's CPU (series and naive-cpu alike),
    # the rest on the GPUs, a round trip through the client at each of the hosts
    used_bytes = m["moe_layers"] * N_USED * m["expert_bytes"]
    hop = 2 * hosts * (NET_LATENCY_S + HIDDEN * ACT_BYTES / net)
    gpu_token = N_LAYER * GPU_LAYER_TOKEN_S
    cpu_decode = 1 / (used_bytes / (CPU_READ_GBPS * 1e9) + gpu_token + hop)
    # naive-client decode: the used experts cross the network (gathered below the bar) instead
    client_decode = 1 / (used_bytes / net + gpu_token + hop)
    return {"hosts": hosts, "gpus_per_host": gpus, "network_gbit": net_gbit,
            "pcie_bytes_per_ubatch_per_link": moe_per_stage * m["layer_expert_bytes"] * coverage(UBATCH),
            "network_bytes_per_ubatch_client": (2 * (hosts - 1) + 2) * act,
            "network_bytes_per_token_decode": 2 * hosts * HIDDEN * ACT_BYTES,
            "stage_copy_s": copy, "stage_compute_s": compute,
            "bound": "network" if client_net > stage else ("pcie" if copy > compute else "compute"),
            "series_pp_ts": series_pp, "naive_cpu_pp_ts": naive_cpu_pp, "naive_client_pp_ts": naive_client_pp,
            "series_tg_ts": cpu_decode, "naive_cpu_tg_ts": cpu_decode, "naive_client_tg_ts": client_decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/out/multihost_paper"), help="folder for rows.json")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    m = model_sizes()
    rows = [row(h, g, n, m) for h in (2, 4, 8) for g in (1, 2, 4, 8) for n in (25, 100, 400)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.json").write_text(json.dumps({"model": m, "rows": rows}, indent=1))
    if args.json:
        print(json.dumps({"model": m, "rows": rows}, indent=1))
        return 0
    print(f"DeepSeek-V3-sized: {m['moe_layers']} MoE layers, {m['all_expert_bytes'] / 1e9:.0f} GB of Q4_K experts "
          f"({m['layer_expert_bytes'] / 1e9:.2f} GB a layer), {m['dense_bytes'] / 1e9:.0f} GB of the rest; "
          f"pp{PROMPT} in ubatches of {UBATCH} (coverage {coverage(UBATCH):.3f}); PCIe {LINK_GBPS:g} GB/s a GPU\n")
    print("| hosts x GPUs | network | PCIe GB/ubatch/link | network MB/ubatch (client) | bound | prefill t/s: series "
          "| naive-cpu | naive-client | decode t/s: series = naive-cpu | naive-client |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['hosts']} x {r['gpus_per_host']} | {r['network_gbit']:g} Gb/s "
              f"| {r['pcie_bytes_per_ubatch_per_link'] / 1e9:.1f} | {r['network_bytes_per_ubatch_client'] / 1e6:.0f} "
              f"| {r['bound']} | {r['series_pp_ts']:.0f} | {r['naive_cpu_pp_ts']:.0f} | {r['naive_client_pp_ts']:.1f} "
              f"| {r['series_tg_ts']:.1f} | {r['naive_client_tg_ts']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
