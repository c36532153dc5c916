"""Reporting: llama-bench-like Markdown tables and the A/B plot, made from a DataFrame of rows (pyllama_pp.row)."""
from __future__ import annotations

import numbers
import re
import textwrap
from pathlib import Path
from typing import Optional, Union

import numpy as np

from . import devices as devspec
from . import switches
from .errors import ConfigError, DeviceSpecError
from .rows import MIN_HIT_RATE_LOOKUPS
from .stats import Contention

# the causes of the patched build's host waits (the scheduler's ggml_sched_pp_wait_names), as the legend explains them
WAIT_CAUSES = {
    "input_events": "early input uploads of an older graph: the host ran ahead of the pipeline, expected",
    "fallback": "a synchronous copy between two devices that have no asynchronous one (the host waits for each)",
    "user_input": "a synchronous upload of the user's inputs",
    "split_switch": "a split without inputs after one on another device",
    "ids": "the routing-id readback of the selective expert copy",
    "realloc": "a re-reservation of the graph's buffers (every device synchronized)",
    "upload": "issuing host-weight uploads (blocks while a device's queue is full)",
}

# what the table's columns mean, printed under it (and in results.md): an entry for the columns it names, each where
# one of them is printed
LEGEND = (
    (("baseline t/s", "patched t/s"), "**t/s**: avg_ts ± stddev_ts over the repetitions (llama-bench's columns)."),
    (("reps",), "**reps**: the repetitions behind each t/s (with `--paired`: the rounds)."),
    (("speedup",), "**speedup**: patched / baseline avg_ts, and with `--paired` the median of the paired rounds' ratios "
                   "with its 95% interval."),
    (("PP b/p",), "**PP b/p**: pipeline parallelism on or off in the baseline / patched build."),
    (("coverage",), "**coverage**: the share of the host-resident experts that the routing used per ubatch."),
    (("bytes/dev b", "bytes/dev p"), "**bytes/dev b, p**: host-to-device bytes per device per run (what crossed each "
                                     "link), baseline and patched."),
    (("bound t/s",), "**bound t/s**: the patched build's throughput if every link moved its bytes at its rate and "
                     "nothing else took time (links), and the same with the pipeline's fill and drain (with fill)."),
    (("re-reservations, waits",), "**re-reservations, waits**: graph re-reservations of the patched build (each drains "
                                  "the pipeline), and the time its host thread waited, with the largest cause: "
                                  + "; ".join(f"*{k}*: {v}" for k, v in WAIT_CAUSES.items()) + "."),
    (("patched switches",), "**patched switches**: the patched scheduler's switches the run set to other than their "
                            "defaults (`--switch`, a plan's, `GGML_SCHED_PP_*`); the others at their defaults "
                            "(`pyllama-pp info`)."),
    (("cache hits (patched)",), "**cache hits**: the patched build's device expert cache (EXPERT_CACHE, "
                                "`--expert-cache`): its hits over its lookups, all devices (empty where it looked "
                                "nothing up; where it looked up fewer than "
                                f"{MIN_HIT_RATE_LOOKUPS} times, the lookups instead of a rate)."),
)
# said of the t/s columns where a run failed
ERROR_NOTE = "**error**: the run failed (its message is under the table and in the rows' `error` column)."


def legend(cols: list[str], with_error: bool = False) -> str:
    """The legend of a table with columns `cols`: the entries (LEGEND) of the columns printed, none of one left out,
    each a "- " item wrapped to TEXT_WIDTH; with_error: a t/s cell reads **error** somewhere."""
    items = [text + (f" {ERROR_NOTE}" if with_error and "baseline t/s" in names else "")
             for names, text in LEGEND if any(c in cols for c in names)]
    return "".join(_wrap_item(f"- {text}") + "\n" for text in items)


DECODE_NOTE = ("- **tg rows without `--paired`**: each variant's model was loaded once, and where a process's memory "
               "lands moves decode by a few percent; for a decode claim use `--paired N --loads K` (an interval).")


def devices_label(text) -> str:
    """A device spec as tables and plots name it (a JSON spec written the short way)."""
    try:
        return devspec.parse(text).label
    except (DeviceSpecError, TypeError, ValueError, OSError):
        return str(text)


def failed(r) -> bool:
    """Did this row's run fail (a worker error, a crash)?"""
    return r is not None and isinstance(r.get("error"), str) and bool(r.get("error"))


def any_failed(df) -> bool:
    """Any error row (a worker that failed or was killed)?"""
    return "error" in df and bool(df["error"].fillna("").astype(str).str.len().gt(0).any())


def check_measured(df) -> None:
    """Refuse an empty result: nothing matched the options.

    Raises:
        ConfigError: saying which options to check.
    """
    if df.empty:
        raise ConfigError("nothing was measured: no test matched the options (check -p/-n/-b/-ub)")


def error_lines(df) -> str:
    """Each distinct error once, for under a table: which run, and the worker's one-line message."""
    if "error" not in df:
        return ""
    seen, lines = set(), []
    for r in df[df["error"].fillna("").astype(str).str.len() > 0].to_dict("records"):
        key = (r.get("variant"), r.get("devices"), r.get("n_ubatch"), r["error"])
        if key not in seen:
            seen.add(key)
            lines.append(f"  {r.get('variant')} {r.get('devices')} ub={r.get('n_ubatch')}: {r['error']}")
    return ("\nerrors:\n" + "\n".join(lines)) if lines else ""


def row_notes(df) -> list[str]:
    """The rows' notes (Row.notes: a switch that could not act, and why), each distinct one once with the runs it is
    about (variant, test, devices, n_ubatch)."""
    if "notes" not in df:
        return []
    where: dict = {}
    for r in df.to_dict("records"):
        for note in r.get("notes") if isinstance(r.get("notes"), list) else ():
            where.setdefault(note, []).append(f"{r.get('test')}, ub={r.get('n_ubatch')}")
    return [f"{note} ({'; '.join(dict.fromkeys(runs))})" for note, runs in where.items()]


# an unpaired A/B's speedup whose relative spread (the two variants' samples) passes this is warned of, and so is a
# speedup further than SAME_PATH_GAP from 1 where both variants run the same CPU path
WIDE_SPREAD = 0.05
SAME_PATH_GAP = 0.05


def _speedup_spread(b, p) -> float:
    """The relative spread of patched / baseline avg_ts from the two rows' samples: the root of the sum of their
    squared coefficients of variation (NaN where a row has no spread: one sample)."""
    cvs = [r["stddev_ts"] / r["avg_ts"] if _real(r.get("stddev_ts")) and _real(r.get("avg_ts")) and r["avg_ts"] > 0
           and len(r.get("samples_ts") or ()) > 1 else float("nan") for r in (b, p)]
    return float(np.hypot(*cvs))


RERUN = ("rerun on an idle machine: decode on the CPU moves with every other process there (decode claims: "
         "`--paired N --loads K`)")


def noise_warnings(df) -> list[str]:
    """What makes the rows' numbers doubtful, each a sentence with the advice to rerun: samples that spread more than
    their mean, a paired interval wider than its estimate, an unpaired speedup whose variants' samples spread more
    than WIDE_SPREAD, a speedup away from 1 where both variants ran the same CPU path, other processes on the CPU
    while a config ran (stats.Contention). None for steady rows on an idle machine."""
    if df.empty:
        return []
    rows = [r for r in df.to_dict("records") if not failed(r)]
    spread, flagged = [], set()
    for r in rows:
        name = f"{r.get('variant')} {r.get('test')} ({devices_label(r.get('devices'))}, ub={r.get('n_ubatch')})"
        avg, sd = r.get("avg_ts"), r.get("stddev_ts")
        if isinstance(sd, numbers.Real) and isinstance(avg, numbers.Real) and sd == sd and sd > avg:
            spread.append(f"{name}: {avg:.1f} ± {sd:.1f} t/s")
            flagged.add((r.get("config"), r.get("test")))
        med, lo, hi = (r.get(k) for k in ("speedup_median", "speedup_ci_lo", "speedup_ci_hi"))
        if all(isinstance(x, numbers.Real) and x == x for x in (med, lo, hi)) and hi - lo > med:
            spread.append(f"{name}: paired {med:.3f} [{lo:.3f}, {hi:.3f}]")
    wide_speedups, same_path = [], []
    for (cfg, test), b, p in _groups(df[~df.apply(failed, axis=1)]) if "variant" in df else ():
        if b is None or p is None or _real(p.get("speedup_ci_lo")):   # (paired rows: their interval, above)
            continue
        if (cfg, test) in flagged:   # (a row of it spread more than its mean: said above)
            continue
        name = f"{test} ({devices_label(p.get('devices'))}, ub={p.get('n_ubatch')})"
        sp, wide = p["avg_ts"] / b["avg_ts"] if b["avg_ts"] else float("nan"), _speedup_spread(b, p)
        if _real(wide) and wide > WIDE_SPREAD:
            wide_speedups.append(f"{name}: {sp:.2f} ± {sp * wide:.2f}")
        if not devspec.parse(p.get("devices")).accelerators and _real(sp) and abs(sp - 1) > SAME_PATH_GAP:
            same_path.append(f"{name}: {sp:.2f}x")
    out = [f"the samples spread more than their estimate ({'; '.join(spread)}); {RERUN}"] if spread else []
    if wide_speedups:
        out.append(f"a speedup whose variants' samples spread more than {WIDE_SPREAD:.0%} cannot show a gap that size "
                   f"({'; '.join(wide_speedups)}); {RERUN}, or pair the rounds: `--paired N`")
    if same_path:
        out.append(f"both variants run the same CPU path where no accelerator is named, so a speedup away from 1.00 "
                   f"is the machine's noise ({'; '.join(same_path)}); {RERUN}")
    seen: dict = {}
    for r in rows:
        c = r.get("contention")
        if isinstance(c, dict) and Contention(**c).contended:
            seen.setdefault(r.get("config"), Contention(**c))
    if seen:
        c = max(seen.values(), key=lambda x: x.others_cores)
        who = ", ".join(f"{name} (pid {pid}: {cores:.2f} cores)" for name, pid, cores in c.busy[:3]) or "many small ones"
        out.append(f"other processes used {c.others_cores:.1f} cores while {len(seen)} of "
                   f"{df['config'].nunique()} configs ran ({who}; load {c.load_1m:.1f} on {c.cores} usable cores); "
                   + RERUN)
    return out


# columns a table shows only where some row has a value: the device expert cache's hit rate (EXPERT_CACHE), the
# groups of ubatches per run (LAYER_MAJOR)
OPTIONAL_COLUMNS = ("expert_cache_hit_rate", "layer_major_groups")


def text_table(df, cols: list[str]) -> str:
    """The rows' given columns (those the frame has; an OPTIONAL_COLUMNS one where some row has a value) as a plain
    table, "-" where a row has no value, with error_lines under it."""
    cols = [c for c in cols if c in df.columns and (c not in OPTIONAL_COLUMNS or df[c].notna().any())]
    # (a value not measured - None or NaN, e.g. a decode row's coverage - reads "-", as the Markdown's empty cell)
    return df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}", na_rep="-") + error_lines(df)


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


def switches_text(r) -> str:
    """The patched switches a row's run set, "NAME=V ...": its `switches` (those of its environment, `--switch` and
    its plan, off their defaults: switches.of_run), EXPERT_CACHE in --expert-cache's form (switches.shown)."""
    given = r.get("switches") if r is not None and isinstance(r.get("switches"), dict) else {}
    return " ".join(f"{k}={switches.shown(k, v)}" for k, v in sorted(given.items()))


def _groups(df) -> list:
    """The table's lines: (config, test) and the baseline's and patched build's row of each (None: that variant did
    not run it); by config, then its tests in the order they ran (a workload's steps too)."""
    out = []
    ordered = sorted(df.reset_index(drop=True).groupby(["config", "test"], sort=False),
                     key=lambda kv: (kv[0][0], kv[1].index.min()))
    for (cfg, test), g in ordered:
        pick = lambda v: g[g.variant == v].iloc[0] if (g.variant == v).any() else None
        out.append(((cfg, test), pick("baseline"), pick("patched")))
    return out


def devices_cell(b, p) -> str:
    """The devices of a table line (and a plot's group): the patched build's, and the baseline's where it ran on
    others (its own RPC servers)."""
    ref = p if p is not None else b
    text = devices_label(ref["devices"])
    if b is not None and p is not None and b["devices"] != p["devices"]:
        text += f" (baseline: {devices_label(b['devices'])})"
    return text


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and x == x


def speedup_estimate(p) -> tuple:
    """The speedup a table line reports: (estimate, lo, hi, paired); with paired rounds their median and its 95%
    interval, else patched / baseline avg_ts (no interval); NaNs where there is none."""
    nan = float("nan")
    if p is None:
        return nan, nan, nan, False
    if _real(p.get("speedup_ci_lo")) and _real(p.get("speedup_median")):
        return p["speedup_median"], p["speedup_ci_lo"], p["speedup_ci_hi"], True
    sp = p.get("speedup")
    return (sp if _real(sp) else nan), nan, nan, False


# the table's columns that show wherever some line has a value; the others (devices, batch sizes, test, t/s, speedup)
# show always
SPARSE_COLUMNS = ("reps", "coverage", "PP b/p", "bytes/dev b", "bytes/dev p", "bound t/s",
                  "re-reservations, waits")
# the width a line of the text under the table is wrapped to
TEXT_WIDTH = 118


def _wrap_item(text: str) -> str:
    """A "- " list item of the text under the table, wrapped to TEXT_WIDTH with its continuation lines indented."""
    return textwrap.fill(text, width=TEXT_WIDTH, subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)


def _reps(b, p) -> str:
    """A line's repetitions: the timed samples behind each t/s (paired rounds: the rounds), one number where both
    variants have the same, else baseline/patched."""
    n = [len(r["samples_ts"]) if r is not None and isinstance(r.get("samples_ts"), (list, tuple, np.ndarray))
         and len(r["samples_ts"]) else None for r in (b, p)]
    if not any(n):
        return ""
    return str(n[0] or n[1]) if n[0] == n[1] or not (n[0] and n[1]) else f"{n[0]}/{n[1]}"


def markdown(df) -> str:
    """A compare-llama-bench-like table: one line per config and test, baseline vs patched, with the repetitions
    (and the patched switches the runs set, where any did); a column that is empty on every line is left out, and
    the legend under it is wrapped to TEXT_WIDTH."""
    if df.empty:
        return "(no rows)\n"
    patched = df[df.variant == "patched"].to_dict("records") if "variant" in df else []
    with_switches = any(switches_text(r) for r in patched)
    with_cache = any(_real(r.get("expert_cache_hit_rate")) or cache_lookups(r) for r in patched)
    right = {"n_batch", "n_ubatch", "reps", "coverage", "baseline t/s", "patched t/s", "cache hits (patched)",
             "speedup", "bound t/s"}
    lines = []
    for (cfg, test), b, p in _groups(df):
        ref = p if p is not None else b

        def ts(r):
            if r is None:
                return ""
            if failed(r):
                return "**error**"
            sd = f" ± {r['stddev_ts']:.1f}" if _real(r.get("stddev_ts")) else ""
            return f"{r['avg_ts']:.1f}{sd}"

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
            if r is None:
                return ""
            if not isinstance(r.get("host_wait_s"), dict):   # (a workload step: its re-reservations only)
                return num(r.get("re_reservations"))
            waits = r["host_wait_s"]
            total = sum(waits.values())
            top = max(waits, key=waits.get) if waits else ""
            return f"{num(r.get('re_reservations')) or '?'}, {total:.2f} s" + (f" ({top})" if total > 0 else "")

        cov = ref.get("coverage")
        cov_s = f"{100 * cov:.0f}%" if isinstance(cov, float) and cov == cov and _on_host(ref) else ""
        sp = p.get("speedup") if p is not None else None
        sp_s = "" if sp is None or sp != sp else f"{sp:.2f}"
        med, lo, hi, paired = speedup_estimate(p)
        if sp_s and paired:   # bench.interleaved: the paired median, its 95% interval
            loads = p.get("loads")
            loads_s = f" in {loads:.0f} loads" if _real(loads) and loads > 1 else ""
            sp_s += f" (paired {med:.3f} [{lo:.3f}, {hi:.3f}], {p['rounds']:.0f} rounds{loads_s})"
        bound = "" if p is None else ", ".join(filter(None, (num(p.get("bound_ts")), num(p.get("bound_pipe_ts")))))
        placed = " / ".join(dict.fromkeys(str(r.get("host_experts") or "") for r in (b, p) if r is not None))
        pps = f"{pp(b)}/{pp(p)}"
        cells = {"devices": devices_cell(b, p), "host experts": placed, "n_batch": str(ref["n_batch"]),
                 "n_ubatch": str(ref["n_ubatch"]), "test": str(test), "reps": _reps(b, p), "coverage": cov_s,
                 "baseline t/s": ts(b), "patched t/s": ts(p)}
        if with_cache:
            cells["cache hits (patched)"] = cache_cell(p)
        cells.update({"speedup": sp_s, "PP b/p": "" if pps == "/" else pps, "bytes/dev b": per_dev(b),
                      "bytes/dev p": per_dev(p), "bound t/s": bound, "re-reservations, waits": blocked(p)})
        if with_switches:
            cells["patched switches"] = f"{switches_text(p)}{groups_text(p)}"
        lines.append(cells)
    cols = [c for c in lines[0] if c not in SPARSE_COLUMNS or any(ln[c] for ln in lines)]
    table = ["| " + " | ".join(cols) + " |",
             "| " + " | ".join("---:" if c in right else "---" for c in cols) + " |"]
    table += ["| " + " | ".join(ln[c] for c in cols) + " |" for ln in lines]
    unpaired_tg = "test" in df and df["test"].astype(str).str.startswith("tg").any() and (
        "speedup_ci_lo" not in df or df["speedup_ci_lo"].isna().all())
    notes = "".join(_wrap_item(f"- note: {n}") + "\n" for n in row_notes(df))
    return ("\n".join(table) + "\n\n" + notes + ("\n" if notes else "") + legend(cols, any_failed(df))
            + (_wrap_item(DECODE_NOTE) + "\n" if unpaired_tg else ""))


def cache_lookups(r) -> int:
    """The device expert cache's lookups in a row's runs (hits + misses; 0 where it has none)."""
    if r is None:
        return 0
    counts = [r.get(k) for k in ("expert_cache_hits", "expert_cache_misses")]
    return int(sum(counts)) if all(_real(c) for c in counts) else 0


def cache_cell(p) -> str:
    """The patched row's cache hits as the table shows them: its hit rate, or where it has none from too few lookups
    (rows.MIN_HIT_RATE_LOOKUPS) how many there were; empty without lookups."""
    if p is None:
        return ""
    if _real(p.get("expert_cache_hit_rate")):
        return f"{p['expert_cache_hit_rate']:.0%}"
    n = cache_lookups(p)
    return f"{n} lookup{'s' if n != 1 else ''}" if n else ""


def groups_text(r) -> str:
    """LAYER_MAJOR's groups per run beside the switches of a patched row that asked for it ("" otherwise)."""
    g = None if r is None else r.get("layer_major_groups")
    return f" ({g:.0f} layer-major groups a run)" if _real(g) else ""


def _on_host(r) -> bool:
    """Whether a row's placement kept experts in host RAM (a coverage is about those); True where unknown."""
    overrides, label = r.get("tensor_buft_overrides"), str(r.get("host_experts") or "")
    if isinstance(overrides, str):
        return bool(overrides)
    return label not in ("none", "0") and not label.endswith(": 0 overrides")


def _group_labels(groups: list) -> tuple[list[str], str]:
    """Each plot group's label (what differs between the groups: devices, host experts, n_batch, n_ubatch, test),
    wrapped to fit under its bars, and what they all share (for the title)."""
    fields = []
    for (_, test), b, p in groups:
        ref = p if p is not None else b
        placed = " / ".join(dict.fromkeys(str(r.get("host_experts") or "") for r in (b, p) if r is not None))
        fields.append([devices_cell(b, p), f"experts on host: {placed}", f"b={ref['n_batch']}",
                       f"ub={ref['n_ubatch']}", str(test)])
    varies = [len({f[i] for f in fields}) > 1 for i in range(len(fields[0]))]
    varies[-1] = varies[-1] or not any(varies)   # (every group named by something: its test at least)
    labels = ["\n".join(_wrap(x, PLOT_LABEL_CHARS) for x, v in zip(f, varies) if v) for f in fields]
    shared = ", ".join(x for x, v in zip(fields[0], varies) if not v)
    return labels, shared


def _wrap(text: str, width: int) -> str:
    """`text` in lines of at most `width` characters, broken after a comma or semicolon where it can (a device spec
    has no spaces), else at spaces, else anywhere."""
    lines, cur = [], ""
    for part in re.split(r"(?<=[,;])", text):
        if cur and len(cur) + len(part) > width:
            lines.append(cur)
            cur = ""
        cur += part
    return "\n".join(textwrap.fill(ln, width=width, break_on_hyphens=False) for ln in lines + [cur])


PLOT_GROUP_INCHES = 2.0   # the width each group's bars and label get
PLOT_LABEL_CHARS = 24     # characters of a label line at its font size within that width


def plot_figure(df, title: str = "pyllama_pp A/B"):
    """The A/B plot as a matplotlib Figure: above, avg_ts of each table line for both variants (error bars: stddev_ts,
    never below 0 t/s); below, the speedup the table reports (with paired rounds their median and its 95% interval);
    each group labelled by what differs between them, the rest in the title. None without a measurement."""
    import matplotlib   # (imported here: only a plot needs it, and it takes a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # (with matplotlib, above)

    if df.empty or "avg_ts" not in df or df["avg_ts"].isna().all():
        return None
    groups = _groups(df)
    labels, shared = _group_labels(groups)
    fig, (ax, axs) = plt.subplots(2, 1, sharex=True, height_ratios=(3, 1.4),
                                  figsize=(max(6.0, PLOT_GROUP_INCHES * len(groups)), 6.0))
    width, xs = 0.38, np.arange(len(groups))
    top_all = df["avg_ts"].max()
    for k, v in enumerate(("baseline", "patched")):
        rows = [b if v == "baseline" else p for _, b, p in groups]
        vals = np.array([r["avg_ts"] if r is not None and _real(r.get("avg_ts")) else 0.0 for r in rows])
        sds = np.array([r["stddev_ts"] if r is not None and _real(r.get("stddev_ts")) else 0.0 for r in rows])
        at = xs + (k - 0.5) * width
        ax.bar(at, vals, width, yerr=[np.minimum(sds, vals), sds], label=v, color=("#8c8c8c", "#1f77b4")[k],
               capsize=3)
        for x, r in zip(at, rows):   # a failed run is marked, not drawn as a zero bar
            if r is not None and failed(r):
                ax.text(x, top_all * 0.02, "failed", rotation=90, ha="center", va="bottom", color="#d62728",
                        fontsize=9, fontweight="bold")
    est = [speedup_estimate(p) for _, _, p in groups]
    heights = np.array([e[0] if _real(e[0]) else 0.0 for e in est])
    lo = np.array([e[0] - e[1] if e[3] else 0.0 for e in est])
    hi = np.array([e[2] - e[0] if e[3] else 0.0 for e in est])
    axs.bar(xs, heights, 0.5, color="#1f77b4")
    paired = [i for i, e in enumerate(est) if e[3]]
    if paired:   # (the paired median's 95% interval; a ratio of means has none)
        axs.errorbar(xs[paired], heights[paired], yerr=[lo[paired], hi[paired]], fmt="none", ecolor="black",
                     capsize=4)
    axs.axhline(1.0, color="#444444", linewidth=0.8)
    for x, (m, a, z, paired) in zip(xs, est):
        if _real(m):
            axs.text(x, (z if paired else m) * 1.02, f"{m:.3f}x [{a:.3f}, {z:.3f}]" if paired else f"{m:.2f}x",
                     ha="center", va="bottom", fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    axs.set_xticks(xs)
    axs.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("tokens / s\n(avg_ts, bars: stddev_ts)", fontsize=9)
    axs.set_ylabel("patched / baseline" + ("\n(paired median, 95%)" if any(e[3] for e in est) else ""), fontsize=9)
    ax.set_title(title + (f"\n{shared}" if shared else ""), fontsize=10)
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    axs.set_ylim(bottom=0)
    axs.margins(y=0.25)
    fig.set_layout_engine("constrained")   # (tight_layout warns when labels are long; this one makes room)
    return fig


def plot(df, path: Union[str, Path], title: str = "pyllama_pp A/B") -> Optional[Path]:
    """The A/B plot (plot_figure) written to `path` (PNG); None when there is nothing to plot."""
    import matplotlib.pyplot as plt   # (imported here: only a plot needs it, and it takes a second to import)

    fig = plot_figure(df, title)
    if fig is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
