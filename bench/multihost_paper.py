#!/usr/bin/env python3
"""Several hosts on ggml RPC, on paper: bytes per PCIe link and per network link, and predicted prefill and decode
t/s, for a DeepSeek-V3-sized MoE on H hosts with G GPUs each, against upstream's two naive RPC placements; and, with
--check, the same byte model against the loopback runs measured on VDEVs (bench/multihost_ab.py).

Placements (what each one does in the pinned tree and the series, as measured on loopback):
- series: each host keeps its own layers' experts in its own (pinned) RAM and its GPUs copy them in over their own
  PCIe links (upload-all above the coverage bar, the used experts below it, beside compute); only activations and
  each device's inputs cross the network. Decode copies the used experts over PCIe too: the server runs every expert
  op on the device that holds its result.
- naive-cpu: experts on each server's CPU device (`-ot exps=RPC[host:port]` on its CPU): the server's CPU computes
  them; the hidden state goes GPU -> CPU device and back at every MoE layer, and ggml RPC copies between two
  backends through the client.
- naive-client: experts in the client's RAM: the client's CPU computes them (an RPC device offloads no op), so the
  hidden state crosses the client's NIC twice at every MoE layer, and pipelining is off (tensor overrides).

The network model (pyllama_pp.rpc.network, which fit's predictions use too; checked against measurement with --check):
per ubatch, the client's NIC carries the hidden state (f32) at every boundary between hosts twice (server ->
client -> next server: ggml RPC copies between two servers through the client; two GPUs of one host copy on the
host) and the embeddings to the first device; every device gets its own inputs (the KQ mask, f16, n_kv x n_tokens, n_kv the cache cells in use, padded
to 256; positions) and its graph as a message (a serialized tensor for each of about 75 a layer: measured, the
rest of the loopback bytes). Prefill: one ubatch of U tokens flows through H x G pipeline stages (each GPU a stage
with its share of the layers); a stage takes the longer of its expert copies and its compute (OVERLAP), the slowest
stage or the client's NIC sets the pace. Decode (one sequence): one token passes every stage in turn.

    python bench/multihost_paper.py [--out DIR] [--json]
    python bench/multihost_paper.py --check docs/results/multihost-ab-2026-12-03/vdev-tiny.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pyllama_pp.rpc import network
from pyllama_pp.rpc.network import n_kv_mean

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
CPU_FLOPS, CPU_READ_GBPS, GPU_LAYER_TOKEN_S, NET_LATENCY_S = 1.5e12, 200.0, 1e-4, 20e-6
ACT_BYTES = network.ACT_BYTES
UBATCH = 4096
PROMPT = 32768   # the prompt's length: 8 ubatches; a pipeline of more stages than ubatches never fills
def network_bytes_per_ubatch(hosts: int, gpus: int, layers: int, moe_layers: int, hidden: int, ubatch: int,
                             n_kv: float, placement: str) -> dict:
    """Bytes over the client's NIC per ubatch of `ubatch` tokens, up (client -> servers) and down, by part: the
    package's per-device model (pyllama_pp.rpc.network, which fit's predictions use) summed over hosts x gpus devices,
    each with an equal share of the layers (a boundary between two GPUs of one host stays on the host); the naive
    placements add a round trip of the hidden state a MoE layer."""
    devices = hosts * gpus
    trips = moe_layers if placement != "series" else 0
    parts = [network.device_bytes(hidden, ubatch, n_kv, layers / devices, act_in=i % gpus == 0,
                                  act_out=i % gpus == gpus - 1 and i != devices - 1, round_trips=trips / devices)
             for i in range(devices)]
    up, down = sum(u for u, _ in parts), sum(d for _, d in parts)
    inputs, graphs = devices * network.input_bytes(ubatch, n_kv), network.graph_bytes(layers)
    return {"up": up, "down": down, "activations": up + down - inputs - graphs, "inputs": inputs, "graphs": graphs}


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
    n_kv = n_kv_mean(PROMPT, UBATCH)
    # -- prefill, the series: each GPU streams its layers' experts over its own link, beside compute
    copy = moe_per_stage * m["layer_expert_bytes"] * coverage(UBATCH) / (LINK_GBPS * 1e9)
    compute = UBATCH * (moe_per_stage * m["active_moe"] + (layers_per_stage - moe_per_stage) * m["active_dense"]) \
        * H200_S_PER_ACTIVE_PARAM
    stage = max(copy, compute) + copy / max(moe_per_stage, 1)   # (the first copy of a stage is exposed)
    nb = {p: network_bytes_per_ubatch(hosts, gpus, N_LAYER, m["moe_layers"], HIDDEN, UBATCH, n_kv, p)
          for p in ("series", "naive")}
    client_net = max(nb["series"]["up"], nb["series"]["down"]) / net   # (full duplex: the busier way)
    n_ub = -(-PROMPT // UBATCH)

    def pipelined(slowest: float, n_stages: int, each: float) -> float:
        """Prompt t/s of n_ub ubatches through n_stages stages: (n_ub - 1) slowest steps plus one pass (the fill)."""
        return PROMPT / ((n_ub - 1) * slowest + n_stages * each)
    series_pp = pipelined(max(stage, client_net), stages, stage)
    naive_net = max(nb["naive"]["up"], nb["naive"]["down"]) / net
    gpu_all = UBATCH * (m["moe_layers"] * (m["active_moe"] - N_USED * 3 * HIDDEN * FF_EXPERT)
                        + N_DENSE * m["active_dense"]) * H200_S_PER_ACTIVE_PARAM
    # -- prefill, naive-client: the client's CPU computes every MoE layer's experts, one ubatch at a time (no
    # pipelining), the hidden state over the NIC twice a MoE layer
    client_cpu = UBATCH * m["moe_layers"] * (N_USED * 3 * HIDDEN * FF_EXPERT) * 2 / CPU_FLOPS
    naive_client_pp = PROMPT / (n_ub * (client_cpu + gpu_all + naive_net))
    # -- prefill, naive-cpu: each server's CPU computes its layers' experts (2 FLOP a weight a token), one ubatch at a
    # time (tensor overrides: no pipelining), the same round trips through the client
    cpu_stage = UBATCH * (m["moe_layers"] / hosts) * (N_USED * 3 * HIDDEN * FF_EXPERT) * 2 / CPU_FLOPS
    naive_cpu_pp = PROMPT / (n_ub * (hosts * cpu_stage + gpu_all + naive_net))
    # -- decode, one sequence, one stage after another: the series copies the used experts over each host's PCIe;
    # the naive placements read them from host RAM on a CPU, with a round trip through the client a MoE layer
    used_bytes = m["moe_layers"] * N_USED * m["expert_bytes"]
    hop = 2 * hosts * (NET_LATENCY_S + HIDDEN * ACT_BYTES / net)   # (a token in and out of each host)
    naive_hop = hop + 2 * m["moe_layers"] * (NET_LATENCY_S + HIDDEN * ACT_BYTES / net)
    gpu_token = N_LAYER * GPU_LAYER_TOKEN_S
    series_decode = 1 / (used_bytes / (LINK_GBPS * 1e9) + gpu_token + hop)
    cpu_decode = 1 / (used_bytes / (CPU_READ_GBPS * 1e9) + gpu_token + naive_hop)
    return {"hosts": hosts, "gpus_per_host": gpus, "network_gbit": net_gbit,
            "pcie_bytes_per_ubatch_per_link": moe_per_stage * m["layer_expert_bytes"] * coverage(UBATCH),
            "network_bytes_per_ubatch_client": nb["series"]["up"] + nb["series"]["down"],
            "network_bytes_per_ubatch_client_naive": nb["naive"]["up"] + nb["naive"]["down"],
            "network_parts_series": nb["series"],
            "network_bytes_per_token_decode": 2 * hosts * HIDDEN * ACT_BYTES,
            "stage_copy_s": copy, "stage_compute_s": compute,
            "bound": "network" if client_net > stage else ("pcie" if copy > compute else "compute"),
            "series_pp_ts": series_pp, "naive_cpu_pp_ts": naive_cpu_pp, "naive_client_pp_ts": naive_client_pp,
            "series_tg_ts": series_decode, "naive_cpu_tg_ts": cpu_decode, "naive_client_tg_ts": cpu_decode}


def check(path: Path) -> str:
    """The byte model against a bench/multihost_ab.py run (the tiny preset: 6 layers, n_embd 128): its rows'
    measured network bytes per prompt token next to the model's."""
    d = json.loads(path.read_text())
    a = d["args"]
    p, ub = a["p"], a["ubatch"]
    devices = len(a["host_devices"].split(";"))
    layers, hidden = 6, 128     # (the tiny preset)
    n_kv = n_kv_mean(p, ub)
    lines = ["| row | measured up B/token | model up | measured down B/token | model down | model's parts up: "
             "activations / inputs / graphs |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in d["rows"]:
        if "error" in r or r["key"] == "one":
            continue
        placement = "series" if r["key"] == "patched" else "naive"
        nb = network_bytes_per_ubatch(devices, 1, layers, layers, hidden, ub, n_kv, placement)
        act_up = nb["up"] - nb["inputs"] - nb["graphs"]
        lines.append(f"| {r['row']} | {r['net_up_per_prompt_token']:.0f} | {nb['up'] / ub:.0f} | "
                     f"{r['net_down_per_prompt_token']:.0f} | {nb['down'] / ub:.0f} | {act_up / ub:.0f} / "
                     f"{nb['inputs'] / ub:.0f} / {nb['graphs'] / ub:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/out/multihost_paper"), help="folder for rows.json")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--check", type=Path, help="a bench/multihost_ab.py JSON: the byte model against its rows")
    args = ap.parse_args()
    if args.check:
        print(check(args.check))
        return 0
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
    print("| hosts x GPUs | network | PCIe GB/ubatch/link | network MB/ubatch (client): series | naive | bound "
          "| prefill t/s: series | naive-cpu | naive-client | decode t/s: series | naive (cpu = client) |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['hosts']} x {r['gpus_per_host']} | {r['network_gbit']:g} Gb/s "
              f"| {r['pcie_bytes_per_ubatch_per_link'] / 1e9:.1f} | {r['network_bytes_per_ubatch_client'] / 1e6:.0f} "
              f"| {r['network_bytes_per_ubatch_client_naive'] / 1e6:.0f} "
              f"| {r['bound']} | {r['series_pp_ts']:.0f} | {r['naive_cpu_pp_ts']:.0f} | {r['naive_client_pp_ts']:.1f} "
              f"| {r['series_tg_ts']:.1f} | {r['naive_cpu_tg_ts']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
