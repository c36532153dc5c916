"""The compute probe's model and bookkeeping: attention's keys, a short measurement carried to the prompt's length,
the calibration, the budget's choices, the cache a second probe reuses, and where RPC devices are probed."""
from __future__ import annotations

import pytest

from pyllama_pp import compute
from pyllama_pp.compute import Probe, key_count


def test_key_count_lays_out_the_mask():
    assert key_count(512, 512) == 512 * 512
    assert key_count(1000, 300) == 300 * 300 + 300 * 600 + 300 * 900 + 100 * 1000   # the last ubatch: 100 tokens
    assert key_count(1024, 1) == 1024 * 1025 // 2                                  # token by token: causal


def _device(tiny_model) -> compute._Device:
    d = compute._Device(tiny_model, "vdev:1x0@0", [-1], "baseline", reps=3, timeout=60, cache=False)
    assert (d.n_lo, d.n_hi) == (2, 6)   # (the tiny model's six layers)
    return d


def test_a_short_measurement_is_carried_to_the_prompt(tiny_model):
    """A run at 512 tokens: one layer's time (the replicas' difference over their four layers) less attention's part
    there is the per-token part; at 4096 tokens a layer takes 4096 times that plus attention's part there; a candidate
    not run takes the per-token part of the one measured."""
    d = _device(tiny_model)
    b = 2e-9
    d.kv = (1e-4, b)
    d.data["runs"]["64:512"] = [0.10, 0.30]   # (2 and 6 layers: 0.05 s a layer, 0 s outside)
    a = (0.05 - b * key_count(512, 64)) / 512
    layer, outside, how = d.layer(64, 4096)
    assert layer == pytest.approx(4096 * a + b * key_count(4096, 64)) and outside == pytest.approx(0.0)
    assert how == "measured at 512 tokens"
    layer, _, how = d.layer(256, 4096, like=64)
    assert layer == pytest.approx(4096 * a + b * key_count(4096, 256)) and how == "estimated from n_ubatch 64"
    assert d.layer(256, 4096) is None and d.nearest(256, 4096) == 64
    d.data["runs"]["64:4096"] = [0.8, 2.4]    # the prompt itself: as measured
    assert d.layer(64, 4096) == (pytest.approx(0.4), pytest.approx(0.0), "measured")


def test_attentions_calibration_recovers_its_part(tiny_model):
    """A layer's time (the replicas' difference) at two lengths is P a + b K(P, u): b comes back exactly, also where
    each prompt has a fixed cost outside the layers (which the shorter replica's time alone would take for a part
    of the per-token cost, and solve to the wrong b)."""
    d = _device(tiny_model)
    a, b, fixed = 3e-4, 5e-9, 0.02
    for n in (512, 8192):
        layer = n * a + b * key_count(n, 512)
        d.data["runs"][f"512:{n}"] = [fixed + d.n_lo * layer, fixed + d.n_hi * layer]
    d.calibrate(512, (512, 8192))
    assert d.kv[1] == pytest.approx(b) and d.calibrated() and d.data["attention"] == [512, 512, 8192]
    x = (fixed + d.n_lo * 8192 * a) / (8192 * d.n_lo)   # (what a run costs a layer-token, the fixed part in it)
    assert d.kv[0] == pytest.approx(x)
    assert d.cost(512, 512) == pytest.approx(4 * (d.n_lo + d.n_hi) * (512 * x + b * key_count(512, 512)))
    d.kv = None
    d.load_calibration()                                 # (from the cache: the same runs, no new one)
    assert d.kv[1] == pytest.approx(b)


def test_the_budget_chooses_the_prompt_a_short_one_or_an_estimate(tiny_model):
    """Each candidate runs on the prompt where its share of the budget covers that, else on a short prompt where the
    budget covers that, else takes a measured candidate's part; without a budget every one runs on the prompt."""
    p = Probe(tiny_model, "vdev:2x0@0", 8192, candidates=[64, 128, 256], budget=10, cache=False)
    (d,) = p.devices
    d.kv = (1e-6, 1e-12)                          # cheap: every candidate on the prompt
    assert p._plan(64) == (8192, pytest.approx(d.cost(64, 8192)))
    d.kv = (1e-4, 1e-9)                           # the prompt costs more than a third of 10 s, a short one less
    assert d.cost(64, 8192) > 10 / 3 and d.cost(64, 512) < 10
    assert p._plan(64)[0] == 512 and p._plan(1024)[0] == 1024   # (a short prompt holds one ubatch at least)
    p.spent = 9.99                                # the budget spent: estimated, once something stands for it
    assert p._plan(128)[0] == 512                 # (nothing measured yet: it must run)
    d.data["runs"]["64:512"] = [0.1, 0.3]
    assert p._plan(128) == (None, 0.0)
    p.budget = None
    assert p._plan(128)[0] == 8192


def test_optimistic_compute_stays_below_the_measured(tiny_model):
    """The bound a candidate is skipped by: attention's part and `slack` times the cheapest per-token part measured."""
    p = Probe(tiny_model, "vdev:2x0@0", 4096, candidates=[64, 256], cache=False)
    (d,) = p.devices
    assert p.optimistic(256, 0.75) is None     # nothing measured: no bound
    d.kv = (1e-4, 2e-9)
    d.data["runs"]["64:512"] = [0.10, 0.30]
    measured = d.layer(64, 4096)[0]
    bound = p.optimistic(64, 1.0)[0].layer_s[64]
    assert bound == pytest.approx(measured)
    assert p.optimistic(64, 0.75)[0].layer_s[64] < measured


def test_a_second_probe_reuses_the_cache(tiny_model, tmp_path, monkeypatch, capsys):
    """The first probe measures (and says so), the second finds every measurement in the cache and runs none."""
    monkeypatch.setenv("PYLLAMA_PP_CACHE", str(tmp_path))
    with Probe(tiny_model, "vdev:2x0@0", 256, candidates=[64, 128], progress=True) as first:
        got = {u: first.compute(u)[0].layer_s[u] for u in (64, 128)}
    assert first.runs == 2 and "probing compute at n_ubatch 64..128" in capsys.readouterr().err
    with Probe(tiny_model, "vdev:2x0@0", 256, candidates=[64, 128], progress=True) as again:
        assert {u: again.compute(u)[0].layer_s[u] for u in (64, 128)} == got
    assert again.runs == 0 and "every candidate cached" in capsys.readouterr().err
    assert all(v > 0 for v in got.values()) and list((tmp_path / "compute").glob("compute-*.json"))


def test_the_cache_names_the_model_by_content_not_by_path(tiny_model, tmp_path):
    """The same file in another folder (a new date too) finds the first one's measurements and replica; a file
    that differs in a weight does not."""
    import os
    import shutil
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(tiny_model, copy)
    os.utime(copy, (1, 1))
    path = lambda m: compute._Device(m, "vdev:1x0@0", [-1], "baseline", reps=1, timeout=60, cache=False).path
    assert path(str(copy)) == path(tiny_model)
    assert compute.model_key(copy) == compute.model_key(tiny_model)
    other = tmp_path / "other.gguf"
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF   # (the last weight's last byte)
    other.write_bytes(bytes(data))
    assert path(str(other)) != path(tiny_model)


def test_rpc_devices_are_probed_on_their_servers(monkeypatch):
    """A server computes its devices' layers itself: one of its devices stands for them (not the client's CPU);
    this machine's devices before them are probed as their kind is."""
    from pyllama_pp.devices import vdev
    monkeypatch.setattr(vdev, "usable_cores", lambda: 16)   # (VDEVs with a core each: one of each speed)
    spec = "rpc://10.0.0.2:50052,10.0.0.3:50052/1"
    assert compute.probe_devices(spec, ["10.0.0.2:50052", "10.0.0.2:50052", "10.0.0.3:50052"]) == \
        [([0, 1], "rpc://10.0.0.2:50052/0"), ([2], "rpc://10.0.0.3:50052/1")]
    assert compute.probe_devices(spec) == [([-1], "rpc://10.0.0.2:50052/0")]
    local = compute.probe_devices("vdev:2x8MiB@1GBps,speed=1:2+rpc://10.0.0.2:50052", [None, None, "10.0.0.2:50052"])
    assert [idx for idx, _ in local] == [[0], [1], [2]] and local[2][1] == "rpc://10.0.0.2:50052/0"


def test_an_rpc_servers_messages_are_not_compute(tiny_model):
    """On an RPC server the replicas' messages cross the network as well: each layer's graph message and each
    ubatch's activations and inputs, at the rates fit measured, come off the layer's and the outside's time (predict
    counts them as the network's)."""
    from pyllama_pp.rpc import network
    net = {"up_gbps": 0.01, "down_gbps": 0.02}
    d = compute._Device(tiny_model, "rpc://127.0.0.1:50052/0", [-1], "patched", reps=3, timeout=60, cache=False,
                        net=net, hidden=64)
    plain = compute._Device(tiny_model, "rpc://127.0.0.1:50052/0", [-1], "patched", reps=3, timeout=60, cache=False)
    for x in (d, plain):
        x.data["runs"]["64:512"] = [0.60, 1.50]   # (0.225 s a layer, 0.15 s outside)
    n_ub = 512 // 64
    (layer, outside, _), (layer0, outside0, _) = d.layer(64, 512), plain.layer(64, 512)
    assert layer == pytest.approx(layer0 - n_ub * network.graph_bytes(1) / 0.01e9)
    up, down = network.device_bytes(64, 64, network.n_kv_mean(512, 64), 0, act_out=False)
    assert outside == pytest.approx(outside0 - n_ub * (up / 0.01e9 + down / 0.02e9))
    assert 0 < layer < layer0 and 0 <= outside < outside0
