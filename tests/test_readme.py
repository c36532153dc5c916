"""The README's Python example runs as written (so the documented API cannot drift from the package)."""
from __future__ import annotations

import re
from pathlib import Path

from pyllama_pp import synth

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
