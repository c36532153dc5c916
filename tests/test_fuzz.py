"""Random combinations of the patched scheduler's switches, device shapes, batch sizes, routing and load modes on
VDEVs: the logits must match the baseline's for the same placement (NMSE <= 1e-6). 16 cases in CI; for a long run:
PP_FUZZ_CASES=600 PP_FUZZ_SEED=1 python -m pytest -q tests/test_fuzz.py (2-core machine: ~0.7 s a case);
PP_FUZZ_FORCE (JSON) sets switches in every case."""
from __future__ import annotations

import json
import os
import random

import pytest

from pyllama_pp import synth

N_CASES = int(os.environ.get("PP_FUZZ_CASES", "16"))
SEED = int(os.environ.get("PP_FUZZ_SEED", "0"))
# switches set in every case, e.g. PP_FUZZ_FORCE='{"GGML_SCHED_PP_OVERLAP": 2, "GGML_SCHED_PP_PREFETCH": 2}'
try:
    FORCE = dict(json.loads(os.environ.get("PP_FUZZ_FORCE", "{}")))
except (ValueError, TypeError) as e:
    pytest.exit(f"PP_FUZZ_FORCE must be a JSON object of switches, e.g. '{{\"GGML_SCHED_PP_OVERLAP\": 2}}': {e}", returncode=4)
# the live switches of the patched build's table (tests/test_variants.py SWITCH_NAMES), with values worth drawing
SWITCHES = {"OVERLAP": [0, 2], "DIRECT": [-1, 0, 2], "UPLOAD_ALL": [0, 1], "EARLY_INPUTS": [0, 1], "STAGING": [0, 1],
            "OWNER_OFFLOAD": [0, 1], "STABLE_RESERVE": [0, 1], "GATHER": [-1, 0], "PREFETCH": [0, 1, 2],
            "LAYER_MAJOR": [0, 1, 2]}
# (and EXPERT_CACHE with its EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID and EXPERT_REFILL, drawn in _case)


def _case(i: int) -> dict:
    rng = random.Random(SEED * 100003 + i)
    ub = rng.choice([16, 32, 64, 128, 256])
    nb = ub * rng.choice([1, 2, 4, 8])
    link = rng.choice([0, 0.5, 2])
    shape = rng.choice(["two", "shared", "slow", "three", "one"])   # ("one": a single device pipelines too, patch 0002)
    pad = rng.choice([0, 512])   # CUDA's row padding in alloc sizes (OVERLAP=2 pools the expert copies then)
    opt = f",pad={pad}" if pad else ""
    devs = {"two": f"vdev:2x0@{link}{opt}", "shared": f"vdev:2x0@{link},shared{opt}",
            "slow": f"vdev:2x0@{link},speed=1:3{opt}", "one": f"vdev:1x0@{link}{opt}",
            "three": {"kind": "vdev", "devices": [{"link_gbps": link, "link_group": 0, "row_pad": pad},
                                                  {"link_gbps": link, "link_group": 0, "row_pad": pad},
                                                  {"link_gbps": link, "row_pad": pad}]}}[shape]
    env = {f"GGML_SCHED_PP_{k}": rng.choice(v) for k, v in SWITCHES.items() if rng.random() < 0.5}
    if env.get("GGML_SCHED_PP_PREFETCH") == 2:   # (the fuzz's ubatches are below PREFETCH=2's default 1024 tokens)
        env["GGML_SCHED_PP_PREFETCH2_MIN_TOKENS"] = rng.choice([1, 1024])
    placement = {"host_experts": rng.choice(["all", "all", 3])}
    if rng.random() < 0.2:
        placement["load_mode"] = "mmap"
    case = {"routing": rng.choice(["uniform", "skew1", "skew2"]), "devices": devs, "placement": placement,
            "ctx": {"n_ctx": max(256, 2 * nb + 64), "n_batch": nb, "n_ubatch": ub}, "n_tokens": nb * rng.choice([1, 2]),
            "env": env}
    # EXPERT_CACHE, drawn last: a seed's other draws do not depend on it (it serves ubatches below op offload's 32
    # tokens: 16 tokens x 2 ids need 32 slots a layer, which 64 MiB and -32 give and -2 does not), its guard's
    # floor (0: none; 100: a layer leaves for the CPU once its shadow has seen 32 tokens, and never returns) and the
    # hybrid's rate ratio
    if rng.random() < 0.5:
        env["GGML_SCHED_PP_EXPERT_CACHE"] = rng.choice([64, -32, -2])
        env["GGML_SCHED_PP_EXPERT_CACHE_MIN_HIT"] = rng.choice([0, 30, 100])
        env["GGML_SCHED_PP_EXPERT_HYBRID"] = rng.choice([0, 100, 1000])   # (its misses split with the host CPU)
        env["GGML_SCHED_PP_EXPERT_REFILL"] = rng.choice([0, 1, 2])        # (... or all theirs, slots refilled after)
    env.update(FORCE)
    return case


@pytest.fixture(scope="module")
def routed_runners(tmp_path_factory, tiny_model) -> dict:
    """One JobRunner per routing (cases that share a baseline run it once)."""
    from conftest import JobRunner

    models = {"uniform": tiny_model}
    for name, skew in (("skew1", 1.0), ("skew2", 2.0)):
        models[name] = str(synth.cached_model(tmp_path_factory.getbasetemp() / "skewed", "tiny", seed=1,
                                              routing="skewed", skew=skew))
    return {name: JobRunner(path, tmp_path_factory.mktemp(f"fuzz-{name}")) for name, path in models.items()}


@pytest.mark.parametrize("i", range(N_CASES))
def test_random_switches_keep_the_logits(routed_runners, assert_logits_match, i):
    c = _case(i)
    runner = routed_runners[c["routing"]]
    kw = {k: c[k] for k in ("devices", "placement", "ctx", "n_tokens")}
    b = runner.logits("baseline", **kw)
    p = runner.logits("patched", env=c["env"], **kw)
    assert_logits_match(p["logits"], b["logits"], f"case {i}: {c}")
