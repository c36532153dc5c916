"""Reporting: llama-bench-like Markdown tables and the A/B plot, made from a DataFrame of rows (pyllama_pp.row)."""
from __future__ import annotations

import numbers
from pathlib import Path
from typing import Optional, Union


def num(x, fmt: str = "{:.0f}") -> str:
    """A number for a table cell: empty for None and NaN."""
    return "" if x is None or x != x else fmt.format(x)


def fmt_bytes(b) -> str:
    try:
        b = float(b)
    except (TypeError, ValueError):
        return ""
    if b != b:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


def markdown(df) -> str:
    """A compare-llama-bench-like table: one line per config and test, baseline vs patched."""
    if df.empty:
        return "(no rows)\n"
    lines = ["| devices | host experts | n_batch | n_ubatch | test | coverage | baseline t/s | patched t/s | speedup "
             "| PP b/p | bytes/dev baseline | bytes/dev patched | bound t/s (patched): links, with fill | patched: re-reservations, host waits (largest cause) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | --- |"]
    for (cfg, test), g in df.groupby(["config", "test"], sort=True):
        b = g[g.variant == "baseline"].iloc[0] if (g.variant == "baseline").any() else None
        p = g[g.variant == "patched"].iloc[0] if (g.variant == "patched").any() else None
        ref = p if p is not None else b

        def ts(r):
            if r is None:
                return ""
            if isinstance(r.get("error"), str) and r.get("error"):
                return "error"
            return f"{r['avg_ts']:.1f} ± {r['stddev_ts']:.1f}"

        def per_dev(r):
            if r is None or not isinstance(r.get("h2d_bytes_per_device"), list):
                return ""
            return " / ".join(fmt_bytes(x) for x in r["h2d_bytes_per_device"])

        def pp(r):
            return "" if r is None or r.get("pipeline_parallel") != r.get("pipeline_parallel") else \
                ("on" if r.get("pipeline_parallel") else "off")

        def blocked(r):
            # where the patched host thread waited (per run): re-reservations (each drains the pipeline), total wait
            # and its largest cause (input_events = the host ran ahead and waits for the pipeline: expected)
            if r is None or not isinstance(r.get("host_wait_s"), dict):
                return ""
            waits = r["host_wait_s"]
            total = sum(waits.values())
            top = max(waits, key=waits.get) if waits else ""
            return f"{num(r.get('re_reservations')) or '?'}, {total:.2f} s" + (f" ({top})" if total > 0 else "")

        cov = ref.get("coverage")
        cov_s = f"{100 * cov:.0f}%" if isinstance(cov, float) and cov == cov else ""
        sp = p.get("speedup") if p is not None else None
        sp_s = "" if sp is None or sp != sp else f"{sp:.2f}"
        lo = p.get("speedup_ci_lo") if p is not None else None
        if sp_s and isinstance(lo, float) and lo == lo:   # bench.interleaved: the paired median, its 95% interval
            loads = p.get("loads")
            loads_s = f" in {loads:.0f} loads" if isinstance(loads, numbers.Real) and loads == loads and loads > 1 else ""
            sp_s += f" (paired {p['speedup_median']:.3f} [{lo:.3f}, {p['speedup_ci_hi']:.3f}], {p['rounds']:.0f} rounds{loads_s})"
        bound = "" if p is None else ", ".join(filter(None, (num(p.get("bound_ts")), num(p.get("bound_pipe_ts")))))
        placed = " / ".join(dict.fromkeys(str(r.get("host_experts") or "") for r in (b, p) if r is not None))
        lines.append(
            f"| {ref['devices']} | {placed} | {ref['n_batch']} "
            f"| {ref['n_ubatch']} | {test} | {cov_s} | {ts(b)} | {ts(p)} "
            f"| {sp_s} | {pp(b)}/{pp(p)} | {per_dev(b)} | {per_dev(p)} "
            f"| {bound} | {blocked(p)} |")
    return "\n".join(lines) + "\n"


def plot(df, path: Union[str, Path], title: str = "pyllama_pp A/B") -> Optional[Path]:
    """Bar chart of avg_ts per config/test for both variants (error bars = stddev), with speedups on top."""
    import matplotlib   # (imported here: only a plot needs it, and it takes a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # (with matplotlib, above)

    ok = df[df["avg_ts"].notna()] if "avg_ts" in df else df
    if ok.empty:
        return None
    groups = list(ok.groupby(["config", "test"], sort=True))
    labels = [f"{g.iloc[0]['devices']}\nub={g.iloc[0]['n_ubatch']} {test}" for (c, test), g in groups]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    width = 0.38
    for k, v in enumerate(("baseline", "patched")):
        vals = [g[g.variant == v]["avg_ts"].mean() if (g.variant == v).any() else 0 for _, g in groups]
        errs = [g[g.variant == v]["stddev_ts"].mean() if (g.variant == v).any() else 0 for _, g in groups]
        xs = [i + (k - 0.5) * width for i in range(len(groups))]
        ax.bar(xs, vals, width, yerr=errs, label=v, color=("#8c8c8c", "#1f77b4")[k], capsize=3)
    for i, (_, g) in enumerate(groups):
        sp = g[g.variant == "patched"]["speedup"].mean() if (g.variant == "patched").any() else float("nan")
        top = g["avg_ts"].max()
        if sp == sp:
            ax.text(i + 0.5 * width, top * 1.02, f"{sp:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("tokens / s (avg_ts)")
    ax.set_title(title)
    ax.legend()
    ax.margins(y=0.15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
