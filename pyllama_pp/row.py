"""A result row: one test of one configuration on one variant, as llama-bench writes one (`test`, `avg_ts`,
`stddev_ts`, `n_batch`, `n_ubatch`, ...), plus the scheduler's facts, the bytes moved per device, the expert coverage
and where it ran. `Row` owns the field names, their types and their values; the JSONL / CSV writer here, the
DataFrame (`frame`) and the Markdown table and plot (pyllama_pp.report) read them from it.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import pandas as pd

NAN = float("nan")


@dataclass
class Row:
    """One test of one configuration on one variant. Fields left None were not measured (a baseline has no patched
    counters, CUDA no device counters); a float left NaN had nothing to compute it from.

    Attributes:
        variant, model, model_size, model_n_params, n_expert, n_expert_used: the build and the model.
        devices, n_gpu_layers, split_mode, tensor_split, host_experts, tensor_buft_overrides, load_mode: where it
            ran and the placement (host_experts: Placement.label; tensor_buft_overrides: every override,
            ";"-joined, llama-bench's -ot).
        n_ctx, n_batch, n_ubatch, test, n_prompt, n_gen, n_depth: the context and the test, as llama-bench names
            them (test: "pp512", "tg32 @ d1024").
        avg_ts, stddev_ts, samples_ts, avg_ns: the measurement, tokens/s (samples_ts: one per rep).
        speedup: patched avg_ts / baseline avg_ts, same config and test.
        pipeline_parallel, n_copies, n_splits: the scheduler's facts (Schedule).
        experts_used, coverage: experts used per MoE layer and ubatch, and that over n_expert.
        h2d_bytes, h2d_bytes_per_device, link_gbps: host -> device bytes per run (all devices, per device) and each
            device's link rate.
        bound_ts, bound_frac, bound_pipe_ts, bound_pipe_frac: the t/s the bytes allow over the links (no compute),
            without and with the pipeline's fill, and avg_ts as a fraction of each.
        host_syncs, id_readbacks, upload_all, direct_reads, gathers, prefetches, chained, re_reservations,
            plan_switches: the patched scheduler's counters, per run.
        realloc_reason, realloc_log, graph_nodes, host_wait_s, host_submit_s, host_sched_s, staged_bytes_per_device,
            gather_bytes_est_per_device, compute_buffer_bytes, ring_bytes_per_device: the patched scheduler's
            reallocations, graph sizes, host-side times and buffer bytes.
        expert_cache_hits, expert_cache_misses, expert_cache_evictions: the expert cache's lookups per run (EXPERT_CACHE;
            all devices; its uploads are in h2d_bytes).
        expert_cache_hit_rate: its hits over its lookups (None: it looked nothing up, or fewer than
            rows.MIN_HIT_RATE_LOOKUPS times: the counts above say how many).
        layer_major_groups: groups of ubatches that ran through each layer together per run (LAYER_MAJOR; None where
            the switch was off and none formed).
        expert_cache_ops, expert_cache_cpu_ops, expert_cache_switches, expert_cache_shadow_hits,
            expert_cache_shadow_misses: its expert ops per run that read the slots and that its guard ran on the CPU
            (EXPERT_CACHE_MIN_HIT), the guard's decisions (a layer to the CPU or back), and its shadow's lookups.
        expert_cache_cpu_misses: of its misses per run, those the host CPU computed instead of the link
            (EXPERT_HYBRID; the link's are expert_cache_misses less these).
        expert_cache_refills: of those, the experts copied into slots after the CPU computed them (EXPERT_REFILL).
        expert_cache_hit_rate_per_device: with EXPERT_CACHE's per-device list (devices whose caches differ; the
            list is in `switches`), each device's own hit rate (None: fewer lookups than rows.MIN_HIT_RATE_LOOKUPS);
            None with one value for every device.
        label, config, config_key: the configuration's label, its index in its sweep, and a hash of what it
            measures (a resumed sweep reuses rows with the same key).
        env, switches, build, machine, date: the environment, the patched build's switches the run set to other
            than their defaults (its environment's, `--switch` and a plan's; {} for the baseline), the build, the
            machine and when.
        contention: what other processes took of the CPU while the config ran (stats.Contention's fields; None
            where it was not watched: RPC devices, workloads).
        error: why the run failed (then avg_ts is NaN); None when it did not.
        notes: what planning said of the run (the patched build's expert cache planned on its placement without a
            fit, or why none: RunConfig.notes) and what it could not do as asked, each a sentence with why (a patched
            switch that could not act here: LAYER_MAJOR with one ubatch a batch, EXPERT_CACHE on the CPU alone, ...);
            None where nothing.
        rounds, loads, ratios, speedup_median, speedup_ci_lo, speedup_ci_hi: paired rounds (runner.interleaved):
            over `loads` model loads, the per-round ratios to the baseline, their median and its 95% interval.
        round, seconds: a workload step (runner.mixed_workload): its round and wall time.
    """

    # what ran: the configuration (llama-bench's fields)
    variant: str = ""
    model: str = ""
    model_size: Optional[int] = None
    model_n_params: Optional[int] = None
    n_expert: Optional[int] = None
    n_expert_used: Optional[int] = None
    devices: str = ""
    n_gpu_layers: Optional[int] = None
    split_mode: Optional[str] = None
    tensor_split: Optional[list] = None
    host_experts: str = ""                       # the placement's label (Placement.label)
    tensor_buft_overrides: Optional[str] = None  # every override, ";"-joined (llama-bench's -ot)
    load_mode: Optional[str] = None
    n_ctx: Optional[int] = None
    n_batch: Optional[int] = None
    n_ubatch: Optional[int] = None
    test: str = ""
    n_prompt: int = 0
    n_gen: int = 0
    n_depth: int = 0
    # the measurement
    avg_ts: float = NAN
    stddev_ts: float = NAN
    samples_ts: Optional[list] = None
    avg_ns: Optional[int] = None
    speedup: float = NAN                         # patched avg_ts / baseline avg_ts, same config and test
    pipeline_parallel: Optional[bool] = None
    n_copies: Optional[int] = None
    n_splits: Optional[int] = None
    experts_used: Optional[float] = None         # experts used per MoE layer and ubatch
    coverage: Optional[float] = None             # experts_used / n_expert
    h2d_bytes: Optional[int] = None              # host -> device bytes per run, all devices
    h2d_bytes_per_device: Optional[list] = None
    link_gbps: Optional[list] = None
    bound_ts: float = NAN                        # t/s the bytes allow over the links (no compute)
    bound_frac: float = NAN
    bound_pipe_ts: float = NAN                   # the same with the pipeline's fill
    bound_pipe_frac: float = NAN
    # the patched scheduler's counters, per run
    host_syncs: Optional[int] = None
    id_readbacks: Optional[int] = None
    upload_all: Optional[int] = None
    direct_reads: Optional[int] = None
    gathers: Optional[int] = None
    prefetches: Optional[int] = None
    chained: Optional[int] = None
    re_reservations: Optional[int] = None
    plan_switches: Optional[int] = None
    realloc_reason: Optional[str] = None
    realloc_log: Optional[Any] = None
    graph_nodes: Optional[list] = None
    host_wait_s: Optional[dict] = None
    host_submit_s: Optional[list] = None
    host_sched_s: Optional[dict] = None
    staged_bytes_per_device: Optional[list] = None
    gather_bytes_est_per_device: Optional[list] = None
    compute_buffer_bytes: Optional[list] = None
    ring_bytes_per_device: Optional[list] = None
    expert_cache_hits: Optional[int] = None
    expert_cache_misses: Optional[int] = None
    expert_cache_evictions: Optional[int] = None
    expert_cache_hit_rate: Optional[float] = None
    layer_major_groups: Optional[int] = None
    expert_cache_ops: Optional[int] = None
    expert_cache_cpu_ops: Optional[int] = None
    expert_cache_switches: Optional[int] = None
    expert_cache_shadow_hits: Optional[int] = None
    expert_cache_shadow_misses: Optional[int] = None
    expert_cache_cpu_misses: Optional[int] = None
    expert_cache_refills: Optional[int] = None
    expert_cache_hit_rate_per_device: Optional[list] = None
    # where and how
    label: str = ""
    config: Optional[int] = None                 # the configuration's index in its sweep
    config_key: Optional[str] = None             # a hash of what the configuration measures (resume)
    env: Optional[dict] = None
    switches: Optional[dict] = None              # the patched build's switches off their defaults (switches.of_run)
    error: Optional[str] = None                  # why the run failed (then avg_ts is NaN)
    notes: Optional[list] = None                 # what planning said of it; a switch that could not act, and why
    build: Optional[dict] = None
    machine: Optional[str] = None
    date: Optional[str] = None
    contention: Optional[dict] = None            # other processes on the CPU meanwhile (stats.Contention)
    # paired rounds (runner.interleaved): over `loads` model loads, the per-round ratios to the baseline, their
    # median and its 95% interval
    rounds: Optional[int] = None
    loads: Optional[int] = None
    ratios: Optional[list] = None
    speedup_median: float = NAN
    speedup_ci_lo: float = NAN
    speedup_ci_hi: float = NAN
    # a workload step (runner.mixed_workload)
    round: Optional[int] = None
    seconds: Optional[float] = None

    @property
    def failed(self) -> bool:
        """Whether this row is an error row."""
        return bool(self.error)

    def to_dict(self) -> dict:
        """The row as data, in field order.

        Returns:
            dict: field name -> value (JSON-ready; NaN stays a float).
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """A Row from to_dict()'s form.

        Args:
            d: field name -> value; keys Row does not know (a file written by another version) are left out.
        Returns:
            Row: the row.
        """
        return cls(**{k: v for k, v in d.items() if k in FIELD_NAMES})

    def copy(self, **changes) -> "Row":
        """A copy of the row.

        Args:
            **changes: fields to set in the copy, name -> value.
        Returns:
            Row: the copy.
        Raises:
            TypeError: for a name that is not a field.
        """
        return dataclasses.replace(self, **changes)


FIELDS = dataclasses.fields(Row)
FIELD_NAMES = tuple(f.name for f in FIELDS)


def frame(rows: Iterable[Row]):
    """A pandas DataFrame with one row per Row and a column per field, in field order."""
    return pd.DataFrame([r.to_dict() for r in rows], columns=list(FIELD_NAMES))


def _cell(v):
    return json.dumps(v) if isinstance(v, (list, dict)) else v


class RowWriter:
    """Appends rows to DIR/results.jsonl and DIR/results.csv as they come (each write reaches the disk before it
    returns: a crash or Ctrl-C keeps every row written). `out_dir` None: writes nothing."""

    def __init__(self, out_dir: Optional[Union[str, Path]]):
        self.out_dir = Path(out_dir) if out_dir else None
        if self.out_dir:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = self.out_dir / "results.jsonl"
            self.csv = self.out_dir / "results.csv"

    def write(self, rows: Iterable[Row]) -> None:
        """Append rows to both files."""
        if self.out_dir:
            self._append(list(rows), self.jsonl, self.csv)

    @staticmethod
    def _append(rows: list, jsonl: Path, csv_path: Path) -> None:
        with open(jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(r.to_dict(), default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())
        started = csv_path.exists() and csv_path.stat().st_size > 0
        with open(csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(FIELD_NAMES))
            if not started:
                w.writeheader()
            for r in rows:
                w.writerow({k: _cell(v) for k, v in r.to_dict().items()})

    def rewrite(self, rows: Iterable[Row]) -> None:
        """Replace both files with `rows` (a resumed sweep's final set), each file at once."""
        if not self.out_dir:
            return
        tmp = (self.jsonl.with_name("results.jsonl.tmp"), self.csv.with_name("results.csv.tmp"))
        for t in tmp:
            t.unlink(missing_ok=True)
        self._append(list(rows), *tmp)
        os.replace(tmp[0], self.jsonl)
        os.replace(tmp[1], self.csv)


def read_rows(out_dir: Union[str, Path]) -> list[Row]:
    """The rows of DIR/results.jsonl (a line torn by a crash mid-write is left out; no file: no rows)."""
    path = Path(out_dir) / "results.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict):
                rows.append(Row.from_dict(d))
    return rows


__all__ = ["Row", "FIELDS", "FIELD_NAMES", "frame", "RowWriter", "read_rows"]
