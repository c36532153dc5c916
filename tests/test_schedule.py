"""Session.schedule_detail: the splits of one ubatch as the scheduler made them, for both variants."""
from __future__ import annotations

import pytest

from pyllama_pp.session import Schedule, Split, SplitInput
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


def test_a_splits_input_bytes_add_up_by_kind_in_the_frame():
    """Schedule.to_frame: one row per split with its inputs' bytes summed per kind (host weight, user input,
    activation), zero for a kind it lacks."""
    inputs = [SplitInput("blk.0.ffn_up_exps.weight", "host weight", 100), SplitInput("inp_pos", "user input", 8),
              SplitInput("blk.0.ffn_down_exps.weight", "host weight", 50), SplitInput("l_out-0", "activation", 4)]
    s = Schedule("patched", True, 2, 2, [], [], splits=[Split(0, "VDEV0", 10, inputs),
                                                         Split(1, "VDEV1", 3, inputs[1:2])])
    df = s.to_frame()
    assert df[["host_weight_bytes", "user_input_bytes", "activation_bytes", "n_inputs"]].values.tolist() == \
        [[150, 8, 4, 4], [0, 8, 0, 1]]
