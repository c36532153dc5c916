#!/usr/bin/env python3
"""Device memory of baseline, patched and the naive change (gate only) - docs/RESULTS.md, issue 4."""
import _common as C
from pyllama_pp.worker import run_job
from pyllama_pp import synth
cfg = synth.preset("tiny", seed=1, n_layer=C.N_LAYER)
MODEL = str(C.synth_model())
one_expert_tensor = synth.expert_bytes_per_layer(cfg) // 3
rows = []
for name, variant, env in [("baseline", "baseline", {}), ("patched", "patched", {}),
                           ("patched, upstream's 4 copies (COPIES=4)", "patched", {"GGML_SCHED_PP_COPIES": "4"}),
                           ("patched, a device copy of the user inputs per graph (SHARED_INPUTS=0)", "patched",
                            {"GGML_SCHED_PP_SHARED_INPUTS": "0"}),
                           ("naive (gate only: GATE=2 TRANSIENT=0 SHARED_INPUTS=0 COPIES=4)", "patched",
                            {"GGML_SCHED_PP_GATE": "2", "GGML_SCHED_PP_TRANSIENT": "0", "GGML_SCHED_PP_SHARED_INPUTS": "0",
                             "GGML_SCHED_PP_COPIES": "4"})]:
    for ub in (32, 128):
        r = run_job({"kind": "schedule", "model": MODEL, "devices": "vdev:2x0@0",
                     "placement": {"host_experts": "all", "tensor_split": [3, 5]},
                     "ctx": {"n_ctx": 2304, "n_batch": 16 * ub, "n_ubatch": ub}}, variant, env=env, timeout=120)["schedule"]
        bufs = {b["name"]: b["compute_buffer_bytes"] for b in r["backends"]}
        rows.append((name, ub, r["pipeline_parallel"], r["n_copies"], bufs["VDEV0"], bufs["VDEV1"]))
print("one expert tensor:", one_expert_tensor)
print("| build | n_ubatch | PP | n_copies | VDEV0 compute buffer | VDEV1 compute buffer |")
print("| --- | ---: | --- | ---: | ---: | ---: |")
for n, ub, pp, nc, a, b in rows:
    print(f"| {n} | {ub} | {'on' if pp else 'off'} | {nc} | {a/2**20:.2f} MiB | {b/2**20:.2f} MiB |")
