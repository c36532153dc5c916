"""Counter arithmetic shared by the worker (per-eval deltas) and the A/B runner (rounds added up): device counters
(VDEV's, per device) and the patched scheduler's stats (a JSON object per context, per backend).
"""
from __future__ import annotations

from typing import Optional

COUNTER_FIELDS = ("h2d_bytes", "d2h_bytes", "d2d_bytes", "h2d_copies", "d2h_copies", "d2d_copies", "graph_computes",
                  "host_syncs", "event_records", "event_waits", "alloc_bytes", "peak_alloc_bytes", "failed_allocs",
                  "link_busy_s", "compute_s", "gathers", "beside_gathers", "chained_gathers", "buffer_allocs",
                  "hd_copies")
# device counters that are levels (bytes allocated now, the peak, counts since the devices were made), not counts
# per eval: deltas keep the later value
LEVEL_FIELDS = ("alloc_bytes", "peak_alloc_bytes", "buffer_allocs", "hd_copies")


def device_delta(after: list[dict], before: list[dict]) -> list[dict]:
    """Per-device counters moved between two reads (levels: the later value)."""
    return [{k: (a[k] - b[k] if isinstance(a[k], (int, float)) and k not in LEVEL_FIELDS else a[k]) for k in a}
            for a, b in zip(after, before)]


def sum_devices(per_eval: list[list[dict]]) -> list[dict]:
    """Add up per-device counter deltas over several evals."""
    out: list[dict] = []
    for devs in per_eval:
        for i, d in enumerate(devs):
            if i >= len(out):
                out.append({k: (0 if isinstance(v, (int, float)) else v) for k, v in d.items()})
            for k, v in d.items():
                if isinstance(v, (int, float)) and k not in LEVEL_FIELDS:
                    out[i][k] += v
                elif k == "peak_alloc_bytes":
                    out[i][k] = max(out[i][k], v)
                elif k in LEVEL_FIELDS:
                    out[i][k] = v      # a level: as it stands after the last eval
    return out


EXT_LEVELS = ("n_copies", "n_splits", "transient_inputs", "graph_nodes_min", "graph_nodes_max", "links")
#: a backend's levels (as they stand, not counts): PREFETCH=2's lanes, STAGING's ring, the expert cache's memory
BACKEND_LEVELS = ("ring_bytes", "stage_slots", "cache_buffer_bytes", "cache_layers", "cache_slots", "cache_cpu_layers")


def ext_delta(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """The patched stats moved from `a` to `b` (levels and logs: b's); None where either is missing (baseline)."""
    if not a or not b:
        return None
    d = {k: b[k] - a[k] for k in b if isinstance(b[k], int) and k not in EXT_LEVELS}
    d.update({k: b[k] for k in EXT_LEVELS + ("last_realloc", "realloc_log") if k in b})
    for k in ("host_wait_us", "host_waits"):  # per-cause host waits (extension v2)
        if isinstance(b.get(k), dict):
            d[k] = {c: v - a.get(k, {}).get(c, 0) for c, v in b[k].items()}
    # (a key may appear in the later stats only: gather_bytes once the device's first gather is counted)
    d["backends"] = [{"name": y["name"], **{k: y[k] if k in BACKEND_LEVELS else y[k] - x.get(k, 0)
                                            for k in y if k != "name"}}
                     for x, y in zip(a["backends"], b["backends"])]
    d["params"] = b.get("params")
    return d


def ext_add(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Sum of two ext_delta results (levels and logs: the later one's)."""
    if a is None or b is None:
        return a or b
    out = dict(b)
    for k, v in b.items():
        if isinstance(v, int) and isinstance(a.get(k), int) and k not in EXT_LEVELS:
            out[k] = a[k] + v
        elif isinstance(v, dict) and k != "params":
            out[k] = {c: a.get(k, {}).get(c, 0) + x for c, x in v.items()}
    out["backends"] = [{"name": y["name"], **{k: y[k] if k in BACKEND_LEVELS else x.get(k, 0) + y[k]
                                              for k in y if k != "name"}}
                       for x, y in zip(a["backends"], b["backends"])]
    return out


def per_gpu(ext: dict, key: str, reps: int, plus: tuple = ()) -> Optional[list]:
    """One value per device backend (the CPU left out) from the patched scheduler's per-backend stats, per rep
    (with the keys in `plus` added where the stats have them); None where they do not have `key` (baseline, older
    builds)."""
    backends = ext.get("backends") or []
    if not backends or key not in backends[0]:
        return None
    return [int((b[key] + sum(b.get(k, 0) for k in plus)) / reps) for b in backends if b["name"] != "CPU"]


def all_gpus(ext: dict, key: str, reps: int) -> Optional[int]:
    """per_gpu's values summed over the devices, per rep; None where the stats do not have `key`."""
    v = per_gpu(ext, key, reps)
    return None if v is None else sum(v)
