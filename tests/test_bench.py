"""The A/B runner: rows on disk as they come, a killed worker becomes an error row, tables and plots."""
from __future__ import annotations

import json

import pandas as pd

from pyllama_pp import bench


def _cfgs(model, **kw):
    common = dict(devices="vdev:2x0@0", n_batch=64, n_ubatch=32, tests=[["pp", 64]], reps=1, **kw)
    return [bench.BenchConfig(model=model, label="quick", **common),
            # far too long for the timeout below: its worker is killed mid-run
            bench.BenchConfig(model=model, label="killed", devices="vdev:2x0@0.0001GBps", n_batch=64, n_ubatch=32,
                              tests=[["pp", 64]], reps=50)]


def test_killed_worker_leaves_error_row_and_finished_rows(tiny_model, tmp_path):
    df = bench.ab(_cfgs(str(tiny_model)), out_dir=tmp_path, progress=False, timeout=10)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    quick = [r for r in rows if r["label"] == "quick"]
    killed = [r for r in rows if r["label"] == "killed"]
    assert {r["variant"] for r in quick} == {"baseline", "patched"}
    assert all(r["avg_ts"] > 0 and not r.get("error") for r in quick)
    assert killed and all("timed out" in r["error"] for r in killed)
    assert len(df) == len(rows)
    csv = pd.read_csv(tmp_path / "results.csv")
    assert len(csv) == len(rows)


def test_speedup_markdown_and_plot(tiny_model, tmp_path):
    cfg = bench.BenchConfig(model=str(tiny_model), devices="vdev:2x0@0", n_batch=64, n_ubatch=32,
                            tests=[["pp", 64], ["tg", 4]], reps=1)
    df = bench.ab([cfg], out_dir=tmp_path, progress=False, timeout=120)
    p = df[df.variant == "patched"].set_index("test")
    b = df[df.variant == "baseline"].set_index("test")
    for test in ("pp64", "tg4"):
        assert abs(p.loc[test, "speedup"] - p.loc[test, "avg_ts"] / b.loc[test, "avg_ts"]) < 1e-9
    md = bench.markdown(df)
    assert md.count("\n") == 2 + 2 and "pp64" in md and "tg4" in md
    png = bench.plot(df, tmp_path / "ab.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # llama-bench's column names are there
    for col in ("n_batch", "n_ubatch", "avg_ts", "stddev_ts", "samples_ts", "test", "model", "coverage",
                "h2d_bytes_per_device", "pipeline_parallel"):
        assert col in df.columns


def test_expand_crosses_like_llama_bench(tiny_model):
    cfgs = bench.expand(str(tiny_model), devices=["cpu", "vdev:2x0@0"], n_batch=[64, 128], n_ubatch=[32, 128],
                        host_experts=["all"])
    # ubatch 128 > batch 64 is skipped, as llama-bench skips impossible combinations
    assert len(cfgs) == 2 * 3
    assert all(c.n_ubatch <= c.n_batch for c in cfgs)
