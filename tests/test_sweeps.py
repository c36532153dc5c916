"""bench/sweeps.toml, the GPU machine's named sweeps: well formed, and naming only switches the patched build has."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pyllama_pp import synth

ROOT = Path(__file__).resolve().parents[1]
BLOCK_KEYS = {"name", "est", "configs", "model", "skew", "devices", "env", "ext", "variants", "reps", "load_mode",
              "host_experts", "tensor_split", "timeline", "interleave", "loads", "preset", "synth"}


def _gpu_run():
    sys.path.insert(0, str(ROOT / "bench"))   # gpu_run imports gather_timeline from its folder
    try:
        spec = importlib.util.spec_from_file_location("gpu_run_under_test", ROOT / "bench" / "gpu_run.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_sweeps_are_well_formed_and_use_live_switches(runner):
    data = _gpu_run().load_sweeps()
    switches = {sw["name"] for sw in runner.run("patched", {"kind": "info"})["switches"]}
    assert {"main", "quick", "mmap", "skewed"} <= set(data["sweeps"]), sorted(data["sweeps"])
    names = set()
    for sweep, blocks in data["sweeps"].items():
        assert blocks, f"sweep {sweep} has no block"
        for b in blocks:
            where = f"sweep {sweep}, block {b.get('name')}"
            assert set(b) <= BLOCK_KEYS and {"name", "est", "configs"} <= set(b), f"{where}: keys {sorted(b)}"
            names.add(b["name"])
            assert b["est"] > 0 and b["configs"], where
            rounds = b.get("interleave", 2)
            assert isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 2 and rounds % 2 == 0, \
                f"{where}: interleave must be an even number of rounds, got {rounds!r}"
            loads = b.get("loads", 1)
            assert isinstance(loads, int) and not isinstance(loads, bool) and loads >= 1 and \
                (loads == 1 or "interleave" in b), f"{where}: loads must be >= 1 and go with interleave, got {loads!r}"
            for nb, ub, tests in b["configs"]:
                assert 1 <= ub <= nb, f"{where}: n_ubatch {ub} > n_batch {nb}"
                assert tests and all(t[0] in ("pp", "tg") and t[1] >= 1 for t in tests), f"{where}: {tests}"
            unknown = set(b.get("ext", {})) - switches
            assert not unknown, f"{where}: switches the patched build does not have: {sorted(unknown)}"
            assert set(b.get("variants", ["baseline", "patched"])) <= {"baseline", "patched"}, where
            assert b.get("model", "uniform") in ("uniform", "skewed"), where
            if "preset" in b:   # another family's preset: its overrides must make a valid config
                assert not {"routing", "skew", "seed"} & set(b.get("synth", {})), f"{where}: set by model / skew"
                synth.preset(b["preset"], **b.get("synth", {}))
    for name, check in data["correctness"].items():
        assert all(w == "*" or w in data["sweeps"] for w in check["when"]), f"correctness {name}: {check['when']}"
        exts = [c[2] for c in check.get("cases", [])] + [check.get("env", {}), check.get("then", {})]
        unknown = set().union(*map(set, exts)) - switches
        assert not unknown, f"correctness {name}: unknown switches {sorted(unknown)}"
        for pname in check.get("presets", []):
            assert pname in synth.PRESETS, f"correctness {name}: unknown preset {pname}"
