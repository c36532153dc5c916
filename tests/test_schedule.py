"""Session.schedule_detail: the splits of one ubatch as the scheduler made them, for both variants."""
from __future__ import annotations

import pytest

from pyllama_pp.worker import run_job

JOB = {"kind": "schedule", "detail": True, "devices": "vdev:2x0@0", "placement": {"host_experts": "all"},
       "ctx": {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64}}


@pytest.mark.parametrize("variant", ["baseline", "patched"])
def test_splits_name_devices_nodes_and_host_weights(tiny_model, variant):
    sched = run_job({**JOB, "model": str(tiny_model)}, variant, timeout=120)["schedule"]
    splits = sched["splits"]
    assert len(splits) == sched["n_splits"]
    assert sum(sp["n_nodes"] for sp in splits) > 0
    weights = [(sp["backend"], i) for sp in splits for i in sp["inputs"] if i["kind"] == "host weight"]
    # every MoE layer's three expert tensors arrive as host-weight inputs of a device split
    assert {i["name"].split(".")[-2] for _, i in weights} == {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert all(i["bytes"] > 0 for _, i in weights)
    devices = {b for b, _ in weights}
    if variant == "baseline":
        assert devices == {"VDEV0"}, "upstream offloads every host-weight op to the first device"
    else:
        assert devices == {"VDEV0", "VDEV1"}, "the owner of each layer streams its experts"
