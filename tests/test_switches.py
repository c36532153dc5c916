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
