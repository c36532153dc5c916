"""The README's Python example runs as written (so the documented API cannot drift from the package)."""
from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

from pyllama_pp import cli, synth

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
