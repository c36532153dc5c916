"""The README's Python example runs as written (so the documented API cannot drift from the package)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_pp import cli, devices, fit, planning, synth
from pyllama_pp.defaults import MAIN_JOB, MAIN_JOB_MODEL, UBATCH_CANDIDATES
from pyllama_pp.errors import OutOfMemoryError
from pyllama_pp.model_file import block_count
from pyllama_pp.fit import fit_ubatch
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.planning import main_job_model, plan_runs

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_runs(tmp_path, monkeypatch):
    code = "\n".join(re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S))
    assert "import pyllama_pp" in code
    synth.write_gguf(tmp_path / "tiny.gguf", synth.preset("tiny"))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    # what the example shows holds: host experts spread over both devices, the patched logits equal the baseline's
    plan, df = scope["plan"], scope["df"]
    assert plan.path == "spread" and all(d.host_expert_layers > 0 for d in plan.devices)
    assert set(df["variant"]) == {"baseline", "patched"} and df["error"].isna().all()
    assert scope["r"].logits.shape == (1, scope["s"].info.n_vocab)
    assert (tmp_path / "plan.json").exists()


def _readme_commands():
    spec = importlib.util.spec_from_file_location("readme_commands", README.parent / "bench" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.commands(README.read_text(), install=True)


def test_readme_commands_parse_and_ci_runs_them():
    """Every README command line is one `bench/readme_commands.py` runs (CI runs that script), and every
    `pyllama-pp` line parses with the CLI's own parser: an option renamed or removed fails here at once."""
    cmds = _readme_commands()
    usage = [c for c in cmds if c["where"] == "usage"]
    assert len(usage) >= 15 and any(c["gpu"] for c in usage) and any(c["where"] == "install" for c in cmds)
    for c in usage:
        argv = shlex.split(c["cmd"])
        assert argv[0] == "pyllama-pp", c["cmd"]
        args = cli.build_parser().parse_args(cli._join_dash_values(argv[1:]))
        assert args.cmd == argv[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bench/readme_commands.py --install" in ci


NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    return text[start:text.index("\n## ", start + 1)]


def test_readme_lists_every_patch_of_the_series():
    """"N patches" and the numbered list are patches/series: its count, and each patch by name, in order."""
    series = [ln.strip().removesuffix(".patch") for ln in (README.parent / "patches" / "series").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    part = _section("What the patch series does")
    count = re.search(r"\b([A-Z][a-z]+) patches\b", part).group(1).lower()
    assert NUMBER_WORDS.index(count) == len(series), (count, len(series))
    listed = re.findall(r"^(\d+)\. `(\d{4}-[^`]+)`", part, flags=re.M)
    assert [name for _, name in listed] == series, listed
    assert [int(n) for n, _ in listed] == list(range(1, len(series) + 1))


def _usage_line(prefix: str) -> str:
    return next(c["cmd"] + "  # " + c.get("comment", "") for c in _readme_commands_with_comments()
                if c["cmd"].startswith(prefix))


def _readme_commands_with_comments() -> list[dict]:
    spec = importlib.util.spec_from_file_location("readme_commands", README.parent / "bench" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = []
    for section, body in mod.blocks(README.read_text()):
        if section.startswith("Using it"):
            out += [dict(zip(("cmd", "comment"), mod.split_comment(line))) for line in body]
    return out


def test_readme_main_job_facts_are_the_tools():
    """The quick start's main job: its model's layers and size, its devices, and what fit places (host-expert layers
    in all and per device), read from the package, not written twice."""
    text = " ".join(README.read_text().split())
    m = re.search(r"a tiny synthetic MoE \((\d+) layers, ([\d.]+) MiB\) on two ([\d.]+) MiB VDEVs with throttled "
                  r"([\d.]+) GB/s links, placed by the patched build's fit \((\d+) of the (\d+) layers' experts in host "
                  r"RAM, (\d+) per device\), baseline vs patched on that one placement at n_ubatch (\d+) / n_batch (\d+)",
                  text)
    assert m, "the quick start's description of the main job"
    layers, mib, dev_mib, gbps, on_host, of, per_dev, ub, nb = m.groups()
    model = main_job_model()
    assert int(layers) == MAIN_JOB_MODEL["n_layer"] == block_count(model) == int(of)
    assert float(mib) == round(os.path.getsize(model) / 2**20, 1), os.path.getsize(model)
    spec = devices.parse(MAIN_JOB.devices)
    assert spec.n_devices == 2 and {v.memory for v in spec.vdevs} == {int(dev_mib) * 2**20}
    assert {v.link_gbps for v in spec.vdevs} == {float(gbps)}
    assert (int(ub), int(nb)) == (MAIN_JOB.n_ubatch, MAIN_JOB.n_batch)
    cfg, = plan_runs(__import__("pyllama_pp").Choices()).configs
    plan = fit(model, devices=MAIN_JOB.devices, ctx=ContextParams(n_ctx=cfg.context().n_ctx, n_batch=cfg.n_batch,
                                                                  n_ubatch=cfg.n_ubatch))
    assert [d.host_expert_layers for d in plan.devices] == [int(per_dev)] * 2
    assert sum(d.host_expert_layers for d in plan.devices) == int(on_host)


def test_readme_model_and_spread_comments_are_the_tools(tmp_path):
    """The usage block's claims about what the tools make: the tiny preset's layers and size, and the layers
    `--spread links` gives each device."""
    line = _usage_line("pyllama-pp synth tiny.gguf")
    layers, mib = re.search(r"# (\d+) layers, ([\d.]+) MiB", line).groups()
    synth.write_gguf(tmp_path / "tiny.gguf", synth.preset("tiny"))
    assert int(layers) == block_count(tmp_path / "tiny.gguf")
    assert float(mib) == round(os.path.getsize(tmp_path / "tiny.gguf") / 2**20, 1)
    line = _usage_line("pyllama-pp fit tiny.gguf --devices '{")
    weights, got = re.search(r"weighted (\d+:\d+) by link rate: (\d+) and (\d+) of the", line).group(1), \
        [int(x) for x in re.search(r"by link rate: (\d+) and (\d+) of the", line).groups()]
    args = cli.build_parser().parse_args(cli._join_dash_values(shlex.split(line.split("  # ")[0])[1:]))
    plan = fit(tmp_path / "tiny.gguf", devices=args.devices, spread="links",
               ctx=ContextParams(n_ctx=args.ctx, n_ubatch=args.ubatch))
    assert [d.host_expert_layers for d in plan.devices] == got, [d.host_expert_layers for d in plan.devices]
    rates = devices.parse(args.devices).link_rates()
    assert weights == ":".join(f"{r:g}" for r in rates)


def _every_candidate_on_host(checked: list):
    """fit_ubatch for `-ub auto`, checking that every n_ubatch it may choose (what it picks depends on the compute it
    measures) has a plan with experts in host RAM, so that the example does whichever it picks; each candidate is
    planned as fit_ubatch plans it, without the compute probe, until one has no placement (larger ones need more)."""
    def check(model, devices, ctx=None, candidates=UBATCH_CANDIDATES, **kw):
        kw.pop("count_compute", None)
        placed = []
        for ub in sorted(candidates):
            try:
                placed.append(fit_ubatch(model, devices=devices, ctx=ctx, candidates=[ub], count_compute=False, **kw))
            except OutOfMemoryError:
                break
        assert len(placed) >= 2, (devices, ctx)
        for plan in placed:
            assert sum(d.host_expert_layers for d in plan.devices) > 0, (devices, plan.ctx)
        checked.append(devices)
        return placed[0]
    return check


def test_every_readme_example_keeps_experts_in_host_ram(tmp_path, monkeypatch, capsys):
    """Each `run`, `ab`, `fit` and `check` example of the usage block (run in order in one folder, as CI does) places
    experts in host RAM: fit's plans keep some there, and the rest name --host-experts (all by default)."""
    monkeypatch.chdir(tmp_path)
    checked, auto = [], []
    monkeypatch.setattr(cli, "fit_ubatch", _every_candidate_on_host(auto))
    monkeypatch.setattr(planning, "fit_ubatch", _every_candidate_on_host(auto))
    for c in _readme_commands_with_comments():
        argv = shlex.split(c["cmd"])[1:]
        if c["comment"].startswith("GPU"):
            continue
        args = cli.build_parser().parse_args(cli._join_dash_values(argv))
        if args.cmd == "synth":
            assert cli.main(argv + ["--json"]) == 0
        elif args.cmd == "fit":
            assert cli.main(argv + ["--json"]) == 0
            plan = json.loads(capsys.readouterr().out)
            assert any("exps" in o for o in plan["tensor_overrides"]), (c["cmd"], plan["tensor_overrides"])
            checked.append(c["cmd"])
        elif args.cmd in ("run", "ab") and not args.resume:
            planned = plan_runs(cli.choices_from_args(args))
            for cfg in planned.configs:
                for v in planned.variants:
                    pl = cfg.placement_for(v)
                    assert any("exps" in o for o in pl.all_overrides(block_count(cfg.model))), (c["cmd"], v, pl)
            checked.append(c["cmd"])
        elif args.cmd == "check":
            assert Placement(host_experts=args.host_experts).all_overrides(), c["cmd"]
            checked.append(c["cmd"])
        capsys.readouterr()
    assert len(checked) >= 10 and len(auto) == sum("-ub auto" in c for c in checked), (checked, auto)


def test_readme_test_suite_facts_are_the_tools():
    """The quick start's test suite: its count is what pytest collects (within 5%), its time the last whole run that
    docs/RESULTS.md records ("Install, build and test times"), which counted about as many tests."""
    text = " ".join(README.read_text().split())
    n, secs = map(int, re.search(r"The second runs the test suite \(about (\d+) tests, (\d+) s on 2 cores", text).groups())
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", str(README.parent / "tests")],
                         capture_output=True, text=True, timeout=300, cwd=README.parent)
    collected = int(re.search(r"(\d+) tests? collected", res.stdout).group(1))
    assert abs(collected - n) <= 0.05 * collected, (n, collected)
    runs = re.findall(r"^\| the whole test suite \| (\d+) s \((\d+) tests\)", (README.parent / "docs" / "RESULTS.md").read_text(),
                      flags=re.M)
    assert runs, "RESULTS.md records no whole test suite run"
    last_secs, last_n = map(int, runs[-1])
    assert secs == last_secs and abs(last_n - collected) <= 0.05 * collected, (secs, runs[-1], collected)


def test_readme_says_once_how_ub_auto_chooses():
    """One paragraph on `-ub auto`'s choice (there were two, near-identical)."""
    paragraphs = README.read_text().split("\n\n")
    assert len([p for p in paragraphs if p.startswith("`-ub auto`")]) == 1


def test_readme_layer_major_comment_is_the_plan(tmp_path):
    """The usage line of LAYER_MAJOR's fit: the group size and the host-expert layers a device with and without the
    switch, as the plan says (the section "When the expert cache and LAYER_MAJOR pay" reasons with them)."""
    line = _usage_line("pyllama-pp fit tiny.gguf --devices \"vdev:2x6MiB@0.2GBps\"")
    group, with_, without = map(int, re.search(r"groups of (\d+) ubatches.*, (\d+) host-expert layers a device where "
                                                r"(\d+) without", line).groups())
    args = cli.build_parser().parse_args(cli._join_dash_values(shlex.split(line.split("  # ")[0])[1:]))
    synth.write_gguf(tmp_path / "tiny.gguf", synth.preset("tiny"))
    plan = fit(tmp_path / "tiny.gguf", devices=args.devices, ctx=ContextParams(n_ctx=args.ctx, n_batch=args.batch,
                                                                    n_ubatch=args.ubatch),
               switches={"LAYER_MAJOR": 1})
    assert plan.layer_major["group"] == group, plan.layer_major
    assert [d.host_expert_layers for d in plan.devices] == [with_] * 2
    assert plan.layer_major["without"]["host_expert_layers"] == [without] * 2
    section = " ".join(_section("Using it").split())
    assert f"K = {group}, L = {without}, L' = {with_}" in section


def test_readme_when_the_switches_pay_quotes_results():
    """The section on when the expert cache and LAYER_MAJOR pay quotes docs/RESULTS.md: every speed-up and share it
    gives (with its interval where it has one) stands there, and so does each RESULTS section it names."""
    text = README.read_text()
    section = " ".join(text[text.index("### When the expert cache and LAYER_MAJOR pay"):text.index("### Python")].split())
    results = (README.parent / "docs" / "RESULTS.md").read_text()
    figures = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:x|%| GB| s)(?: \[[\d.]+, [\d.]+\])?", section)
    assert len(figures) >= 15 and "2.02x" in figures and "67%" in figures, figures
    assert [f for f in figures if f not in results] == []
    named = re.findall(r'"([^"]+)"', section.split("Each figure's command, machine and date:")[1])
    headings = re.findall(r"^#+ (.+)$", results, flags=re.M)
    assert len(named) == 3 and all(any(h.startswith(n) for h in headings) for n in named), (named, headings)
