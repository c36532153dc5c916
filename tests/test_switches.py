"""The patched build's switches as Python knows them (pyllama_pp.switches): user values parsed once, the names and
prefix in one place, and one way to hand switches to C for runs and fit's dry runs alike."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pyllama_pp import switches
from pyllama_pp.errors import ConfigError
from pyllama_pp.switches import ExpertCache

MiB = 1 << 20
PKG = Path(__file__).resolve().parents[1] / "pyllama_pp"


def test_expert_cache_takes_auto_a_size_slots_or_none():
    assert ExpertCache.parse("auto") == ExpertCache.parse(" AUTO ") == ExpertCache(auto=True)
    assert ExpertCache.parse("2GiB").mib == 2048 and ExpertCache.parse(3 * MiB).mib == 3
    assert ExpertCache.parse("16slots") == ExpertCache.parse("16 slots") == ExpertCache.parse("-16") \
        == ExpertCache.parse(-16) == ExpertCache(slots=16)
    assert not ExpertCache.parse(0) and not ExpertCache.parse("0") and not ExpertCache.parse(None)
    assert not ExpertCache.parse(None, "baseline")


def test_expert_cache_forms_name_one_switch_value_and_one_text():
    for text, switch, shown, size in (("512MiB", 512, "512MiB", 512 * MiB), ("16slots", -16, "16slots", 0),
                                      ("auto", 0, "auto", 0), ("0", 0, "", 0)):
        c = ExpertCache.parse(text)
        assert (c.switch, c.text, c.bytes) == (switch, shown, size), text
        assert ExpertCache.parse(c) is c   # (parsed once: a parsed value passes through)


def test_expert_cache_refuses_what_it_cannot_give_with_the_fix():
    for bad, words in (("lots", "give auto"), ("-1MiB", "give auto"), ("100KiB", "whole MiB"),
                       ("1.5MiB", r"whole MiB.*1MiB or 2MiB"), ("1GB", r"953.67 MiB.*953MiB or 954MiB"),
                       ("70000slots", "at most 65536")):
        with pytest.raises(ConfigError, match=words):
            ExpertCache.parse(bad)
    with pytest.raises(ConfigError, match="baseline build has no expert cache"):
        ExpertCache.parse("auto", "baseline")


def test_expert_cache_takes_one_value_per_device():
    """A comma list of sizes, slot counts and 0s: one cache per device (the switch's list form, -16,-32), each
    device's own by index (none past the list); its text and switch read back as the same cache."""
    for text, switch, shown in (("16slots,32slots", "-16,-32", "16slots,32slots"), ("-16,-32", "-16,-32", "16slots,32slots"),
                                ("1GiB, 512MiB", "1024,512", "1024MiB,512MiB"), ("0,8slots", "0,-8", "0,8slots")):
        c = ExpertCache.parse(text)
        assert (c.switch, c.text, bool(c)) == (switch, shown, True), text
        assert ExpertCache.of_switch(c.switch) == ExpertCache.parse(c.text) == c
    c = ExpertCache.parse("512MiB,16slots")
    assert (c.at(0).mib, c.at(1).slots, bool(c.at(2)), c.bytes) == (512, 16, False, 0)
    assert not ExpertCache.parse("0,0") and ExpertCache.parse("16slots").at(3).slots == 16
    assert switches.shown("EXPERT_CACHE", "-16,-32") == "16slots,32slots"
    assert switches.parse_given(["expert_cache=-2, -4"]) == {"EXPERT_CACHE": "-2,-4"}
    assert switches.in_force("patched", {"GGML_SCHED_PP_EXPERT_CACHE": "-2,-4"}) == {"EXPERT_CACHE": "-2,-4"}
    for bad, words in (("auto,16slots", "auto plans every device"), ("16slots,lots", r"its value 2 \('lots'\)"),
                       ("16slots,", r"its value 2 \(''\)"), (",".join(["1slots"] * 16), "at most 15 devices")):
        with pytest.raises(ConfigError, match=words):
            ExpertCache.parse(bad)
    with pytest.raises(ConfigError, match=r"3 values for the 2 devices of vdev:2x1MiB. Fix: one value per device"):
        ExpertCache.parse("1slots,2slots,3slots").check_devices(2, "vdev:2x1MiB")
    ExpertCache.parse("1slots,2slots").check_devices(2)   # (as many as the devices, or fewer: the rest none)
    with pytest.raises(ConfigError, match="comma list of one per device"):
        switches.parse_given(["EXPERT_CACHE=-2,x"])


def test_the_guard_and_the_split_take_one_value_or_one_per_device():
    """EXPERT_CACHE_MIN_HIT and EXPERT_HYBRID as EXPERT_CACHE: one value for every device, or a comma list of one per
    device (each device reads its own, 0 past the list); the planner's values fold to one where the devices agree (the
    devices they do not matter for take it too)."""
    assert switches.parse_given(["expert_cache_min_hit=25, 100", "EXPERT_HYBRID=150,0"]) == \
        {"EXPERT_CACHE_MIN_HIT": "25,100", "EXPERT_HYBRID": "150,0"}
    assert switches.in_force("patched", {"GGML_SCHED_PP_EXPERT_HYBRID": "0,400"}) == {"EXPERT_HYBRID": "0,400"}
    assert switches.per_device("25,100", 2) == [25, 100] and switches.per_device(30, 3) == [30, 30, 30]
    assert switches.per_device("1,2", 3) == [1, 2, 0] and switches.per_device(None, 2) == [0, 0]
    assert switches.one_or_list([40, 40]) == 40 and switches.one_or_list([25, 100]) == "25,100"
    assert switches.one_or_list([150, 7], [True, False]) == 150 and switches.one_or_list([150, 0], [True, True]) == "150,0"
    assert switches.one_or_list([25, 100, 60], [True, False, True]) == "25,0,60"
    for value in (30, "30,100", 0):
        switches.check_device_lists({"EXPERT_CACHE_MIN_HIT": value, "EXPERT_HYBRID": "150,0"}, 2, "vdev:2x1MiB")
    switches.check_device_lists({"EXPERT_HYBRID": "150,0,1"}, 0)   # (devices not known yet: the scheduler logs it)
    switches.check_device_lists({"EXPERT_CACHE": "-2"}, 3)           # (EXPERT_CACHE's list may be shorter)


@pytest.mark.parametrize("name, value, n", [("EXPERT_CACHE_MIN_HIT", "25,100,5", 2), ("EXPERT_HYBRID", "150,0", 3)])
def test_a_guard_or_split_list_of_the_wrong_length_is_refused_with_the_fix(tiny_model, no_worker, name, value, n):
    """A per-device guard or split with more or fewer values than the spec's devices: a ConfigError naming the
    switch, the counts and the fix, before any worker - from `run`'s checks and from fit."""
    from pyllama_pp.placement import fit
    from pyllama_pp.planning import Choices, plan_runs
    spec = f"vdev:{n}x64MiB@4GBps"
    words = (rf"{name}={value}: {len(value.split(','))} values for the {n} devices of {spec}\. Fix: one value for "
             rf"every device \({name}={value.split(',')[0]}\), or {n} values, one per device in the spec's order")
    with pytest.raises(ConfigError, match=words):
        plan_runs(Choices(command="run", model=tiny_model, devices=(spec,), pp=(), tg=(4,), switches={name: value}))
    with pytest.raises(ConfigError, match=rf"{name}={value}: .* Fix: one value for every device"):
        fit(tiny_model, devices=spec, switches={name: value})


def test_switch_strings_and_environment():
    assert switches.parse_given(["upload_all=0", "OVERLAP=2"]) == {"UPLOAD_ALL": 0, "OVERLAP": 2}
    for bad in ("OVERLAP", "=2", "OVERLAP=two"):
        with pytest.raises(ConfigError):
            switches.parse_given([bad])
    env = switches.to_env({"OVERLAP": 0, "LAYER_MAJOR": 2})
    assert env == {"GGML_SCHED_PP_OVERLAP": "0", "GGML_SCHED_PP_LAYER_MAJOR": "2"}
    assert switches.in_env({**env, "OTHER": "1"}) == {"OVERLAP": "0", "LAYER_MAJOR": "2"}
    assert switches.in_force("patched", env)["LAYER_MAJOR"] == 2 and switches.in_force("baseline", env) == {}


def test_only_the_switches_module_spells_the_prefix():
    """The environment prefix of the patched switches is written in one module of the package (its code, not its
    docstrings or comments)."""
    spelled = []
    for f in PKG.rglob("*.py"):
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(getattr(n, "body", None), list) and n.body
                and isinstance(n.body[0], ast.Expr)}
        spelled += [f.relative_to(PKG).as_posix() for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith(switches.PREFIX) and id(node) not in docs]
    assert set(spelled) <= {"switches.py"}, spelled
