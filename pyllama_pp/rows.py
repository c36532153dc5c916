"""Rows from a worker's result: llama-bench-like fields, the bytes moved per device, the expert coverage, the
patched scheduler's counters, and the bounds the bytes imply; error rows for runs that failed (pyllama_pp.row owns
the Row type)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

from . import devices as devspec
from . import switches
from .binding import backend_modules, build_info
from .config import RunConfig, config_key
from .counters import all_gpus, per_gpu
from .defaults import OFFLOAD_MIN_BATCH
from .jobs import depth_of, test_name
from .row import Row


def _env_knobs(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith((switches.PREFIX, "GGML_OP_OFFLOAD", "GGML_CUDA_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def link_bound(cfg: RunConfig, h2d: list[int], n_tokens: int) -> tuple[list[float], float]:
    """Per-device link bandwidth (GB/s) and the tokens/s bound the bytes moved imply (links in parallel,
    a shared link carries the bytes of all its devices). VDEVs know their links; other devices take
    cfg.link_gbps (e.g. measured host->GPU bandwidth)."""
    spec = devspec.parse(cfg.devices)
    gbps = spec.link_rates()
    if gbps is not None:
        groups = [("g", g) if g >= 0 else ("d", i) for i, g in enumerate(spec.link_groups())]
    elif cfg.link_gbps:
        gbps = [float(x) for x in cfg.link_gbps][:len(h2d)]
        groups = [("g", 0) if cfg.shared_link else ("d", i) for i in range(len(gbps))]
    else:
        return [], float("nan")
    if not h2d or not gbps or min(gbps) <= 0:
        return gbps, float("nan")
    per_link: dict = {}
    for i, (g, key) in enumerate(zip(gbps, groups)):
        t = h2d[i] / (g * 1e9) if i < len(h2d) else 0.0
        per_link[key] = per_link.get(key, 0.0) + t
    worst = max(per_link.values())
    return gbps, (n_tokens / worst if worst > 0 else float("nan"))


def pipe_bound(cfg: RunConfig, h2d: list[int], gbps: list[float], n_tokens: int,
                bound: Optional[float] = None) -> float:
    """The tokens/s bound of a prompt pipelined in ubatches through the devices in order, when each device's
    stage takes the time of its own uploads (bytes / link speed, spread evenly over the ubatches): the first
    ubatch goes through every stage, each later one adds the slowest stage (pipeline fill), and no link can
    carry more than its bytes. Compute is not in it (see all-on-GPU rows for that). bound: link_bound's
    bound for these bytes, when the caller has it."""
    if not h2d or not gbps or min(gbps) <= 0:
        return float("nan")
    n_ub = max(1, -(-n_tokens // max(1, min(cfg.n_ubatch, cfg.n_batch))))
    stages = [h2d[i] / n_ub / (g * 1e9) for i, g in enumerate(gbps) if i < len(h2d) and h2d[i] > 0]
    if not stages:
        return float("nan")
    fill = sum(stages) + (n_ub - 1) * max(stages)
    if bound is None:
        bound = link_bound(cfg, h2d, n_tokens)[1]
    links = n_tokens / bound    # busiest link, all its bytes (shared links add up)
    return n_tokens / max(fill, links)


# the fewest lookups (all reps, all devices) a hit rate is given from: below it a rate says little (two lookups read
# 0.0, 0.5 or 1.0) and the row keeps only its counts (expert_cache_hits, expert_cache_misses)
MIN_HIT_RATE_LOOKUPS = 32


def cache_hit_rate(ext: dict) -> Optional[float]:
    """The device expert cache's hits over its lookups, all devices (EXPERT_CACHE); None where it looked nothing up
    (off, the baseline, no decode) or fewer than MIN_HIT_RATE_LOOKUPS times (a prompt's few small ubatches)."""
    hits, misses = (all_gpus(ext, k, 1) for k in ("cache_hits", "cache_misses"))
    if hits is None or misses is None or hits + misses < max(1, MIN_HIT_RATE_LOOKUPS):
        return None
    return hits / (hits + misses)


def cache_hit_rate_per_device(ext: dict) -> Optional[list]:
    """Each device's own hit rate (None below MIN_HIT_RATE_LOOKUPS lookups) where EXPERT_CACHE was a per-device list
    (its value a list's text); None with one value for every device, or none."""
    if not isinstance((ext.get("params") or {}).get(switches.EXPERT_CACHE), str):
        return None
    hits, misses = per_gpu(ext, "cache_hits", 1), per_gpu(ext, "cache_misses", 1)
    if hits is None or misses is None:
        return None
    return [h / (h + m) if h + m >= max(1, MIN_HIT_RATE_LOOKUPS) else None for h, m in zip(hits, misses)]


def rows_from_result(cfg: RunConfig, variant: str, res: dict, meta: dict) -> list[Row]:
    """A row per test of a measure job's result `res` for `variant` (counters per run: divided by the reps)."""
    rows = []
    model = res["model"]
    sched = res["schedule"]
    for t in res["tests"]:
        n_tok = t["n"]
        secs = t["seconds"]
        ts = [n_tok / s for s in secs if s > 0]
        devs = t["devices"]
        reps = max(len(secs), 1)
        h2d = [int(d["h2d_bytes"] / reps) for d in devs]
        ext = t.get("ext") or {}
        if not h2d and ext.get("backends"):
            # no device counters (CUDA): the patched scheduler's own count of host-weight bytes per device. DIRECT's
            # kernel reads (DIRECT) and GATHER's device copies are not in it: DIRECT's estimate (measured
            # coverage x tensor bytes) is added, and GATHER's bytes as the device counted them where it does (CUDA's
            # library; prefetches included), else their estimate
            counted = any("gather_bytes" in b for b in ext["backends"])
            h2d = per_gpu(ext, "weight_bytes", reps,
                           plus=("direct_bytes_est", "gather_bytes" if counted else "gather_bytes_est")) or []
        gbps, bound = link_bound(cfg, h2d, n_tok)
        pipe = pipe_bound(cfg, h2d, gbps, n_tok, bound) if t["kind"] == "pp" else float("nan")
        avg = statistics.fmean(ts) if ts else float("nan")
        cov = t.get("coverage") or {}
        pl = cfg.placement_for(variant)
        rows.append(Row(**{
            "variant": variant, "model": Path(model["path"]).name, "model_size": model["size_bytes"],
            "model_n_params": model["n_params"], "n_expert": model["n_expert"], "n_expert_used": model["n_expert_used"],
            "devices": cfg.devices_for(variant), "n_gpu_layers": pl.n_gpu_layers, "split_mode": pl.split_mode,
            "tensor_split": list(pl.tensor_split) if pl.tensor_split else None, "host_experts": pl.label,
            "tensor_buft_overrides": ";".join(pl.all_overrides()), "load_mode": pl.load_mode,
            "n_ctx": cfg.context().n_ctx, "n_batch": cfg.n_batch, "n_ubatch": min(cfg.n_ubatch, cfg.n_batch),
            "test": test_name([t["kind"], n_tok, t.get("depth", 0)]), "n_prompt": n_tok if t["kind"] == "pp" else 0,
            "n_gen": n_tok if t["kind"] == "tg" else 0, "n_depth": t.get("depth", 0), "avg_ts": avg,
            "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0, "samples_ts": ts,
            "avg_ns": int(statistics.fmean(secs) * 1e9) if secs else 0, "speedup": float("nan"),
            "pipeline_parallel": sched["pipeline_parallel"], "n_copies": sched["n_copies"],
            "n_splits": sched["n_splits"], "experts_used": cov.get("experts_used_per_layer_ubatch"),
            "coverage": cov.get("coverage"), "h2d_bytes": sum(h2d), "h2d_bytes_per_device": h2d, "link_gbps": gbps,
            "bound_ts": bound, "bound_frac": avg / bound if bound and bound == bound else float("nan"),
            "bound_pipe_ts": pipe, "bound_pipe_frac": avg / pipe if pipe and pipe == pipe else float("nan"),
            "host_syncs": int(sum(d["host_syncs"] for d in devs) / reps) if devs else None,
            "id_readbacks": int(ext["id_readbacks"] / reps) if "id_readbacks" in ext else None,
            "upload_all": int(ext["upload_all"] / reps) if "upload_all" in ext else None,
            "direct_reads": int(ext["direct"] / reps) if "direct" in ext else None,
            "gathers": int(ext["gather"] / reps) if "gather" in ext else None,
            "prefetches": int(ext["prefetch"] / reps) if "prefetch" in ext else None,
            "chained": int(ext["chained"] / reps) if "chained" in ext else None,
            "re_reservations": int(ext["reallocs"] / reps) if "reallocs" in ext else None,
            "plan_switches": int(ext["plan_switches"] / reps) if "plan_switches" in ext else None,
            "realloc_reason": ext.get("last_realloc") if ext.get("reallocs") else None,
            "realloc_log": ext.get("realloc_log") or None,
            "graph_nodes": [ext["graph_nodes_min"], ext["graph_nodes_max"]] if "graph_nodes_min" in ext else None,
            "host_wait_s": ({c: us / 1e6 / reps for c, us in ext["host_wait_us"].items()}
                            if "host_wait_us" in ext else None),
            "host_submit_s": ([b["submit_us"] / 1e6 / reps for b in ext["backends"]]
                              if ext.get("backends") and "submit_us" in ext["backends"][0] else None),
            "host_sched_s": ({k[:-3]: ext[k] / 1e6 / reps for k in ("compute_async_us", "alloc_us", "synchronize_us",
                                                                  "stage_wait_us", "stage_copy_us") if k in ext}
                             if "compute_async_us" in ext else None),
            # host-weight bytes that went through pinned staging (pageable host weights; STAGING)
            "staged_bytes_per_device": per_gpu(ext, "staged_bytes", reps),
            # GATHER's estimate beside the count the bytes above take where the device counts them (CUDA)
            "gather_bytes_est_per_device": per_gpu(ext, "gather_bytes_est", reps),
            "compute_buffer_bytes": [b["compute_buffer_bytes"] for b in sched["backends"]],
            # PREFETCH=2's lanes per device (VRAM outside the compute buffers; a level, not a delta)
            "ring_bytes_per_device": per_gpu(ext, "ring_bytes", 1) if ext else None,
            # EXPERT_CACHE's lookups, all devices
            **{f"expert_{k}": all_gpus(ext, k, reps) for k in ("cache_hits", "cache_misses", "cache_evictions",
                                                                "cache_ops", "cache_cpu_ops", "cache_shadow_hits",
                                                                "cache_shadow_misses", "cache_cpu_misses",
                                                                "cache_refills")},
            "expert_cache_hit_rate": cache_hit_rate(ext),
            "expert_cache_hit_rate_per_device": cache_hit_rate_per_device(ext),
            # LAYER_MAJOR's groups (a switch asked for but no group formed shows as 0)
            "layer_major_groups": layer_major_groups(ext, reps),
            # ... and its guard's decisions (EXPERT_CACHE_MIN_HIT: a layer to the CPU, or back to its slots)
            "expert_cache_switches": (None if all_gpus(ext, "cache_leaves", reps) is None else
                                      all_gpus(ext, "cache_leaves", reps) + all_gpus(ext, "cache_returns", reps)),
            "label": cfg.label, "config_key": config_key(cfg),
            "switches": (switches.of_run(cfg.env, cfg.switches, res.get("switch_defaults")) if variant == "patched"
                         else {}),
            **meta}))
        rows[-1].notes = [*(cfg.notes if variant == "patched" else ()), *idle_switch_notes(cfg, rows[-1], ext)] or None
    return rows


def _batches(cfg: RunConfig, row: Row) -> tuple[int, int]:
    """(ubatches in the test's largest batch, tokens in its largest ubatch): decode runs one token a batch."""
    tokens = min(row.n_prompt, cfg.n_batch) if row.n_prompt else 1
    ub = min(cfg.n_ubatch, cfg.n_batch)
    return -(-tokens // ub), min(tokens, ub)


def idle_switch_notes(cfg: RunConfig, row: Row, ext: dict) -> list[str]:
    """A sentence for each patched switch the run set that could not act in it (the scheduler's own count of what
    it did is 0), with why. LAYER_MAJOR groups a batch's ubatches: it needs two or more ubatches a batch, layer
    weights in host RAM and a device to upload them to. EXPERT_CACHE serves expert ops on host weights below op
    offload's threshold (decode) from a device's slots: it needs such batches, host experts and a device. The
    reasons are checked in that order; the last of each is what only the scheduler knew."""
    params = ext.get("params") or {}
    on = lambda name: str(params.get(name, 0)) not in ("0", "")
    accelerators = devspec.parse(row.devices).accelerators
    host = bool(row.tensor_buft_overrides)
    n_ub, ub_tokens = _batches(cfg, row)
    notes = []
    if on(switches.LAYER_MAJOR) and not row.layer_major_groups:
        if not accelerators:
            why = "the devices are the CPU alone, which computes every layer where its weights are: nothing is uploaded"
        elif not host:
            why = "no layer weights are in host RAM (--host-experts none): nothing is uploaded per ubatch"
        elif n_ub < 2:
            batch = (f"n_batch {cfg.n_batch}, n_ubatch {min(cfg.n_ubatch, cfg.n_batch)}" if row.n_prompt else
                     "decode runs one token a batch")
            why = f"a batch of {row.test} is one ubatch ({batch}), and a group needs two or more"
        else:
            why = (f"a batch has {n_ub} ubatches, but the devices had no room for a group's graph (its ubatches' "
                   "activations and whole expert copies), so they ran one by one; fit plans that room: --fit")
        notes.append(f"LAYER_MAJOR={params[switches.LAYER_MAJOR]} did not act: {why}")
    threshold = int(cfg.env.get("GGML_OP_OFFLOAD_MIN_BATCH", OFFLOAD_MIN_BATCH))
    if on(switches.EXPERT_CACHE) and not (row.expert_cache_ops or row.expert_cache_cpu_ops):
        if not accelerators:
            why = "the devices are the CPU alone: there is no device memory to cache experts in"
        elif not host:
            why = "no experts are in host RAM (--host-experts none): every expert is on its device already"
        elif ub_tokens >= threshold:
            why = (f"it serves batches below op offload's threshold ({threshold} tokens: decode), and {row.test} runs "
                   f"ubatches of {ub_tokens} tokens, whose expert ops the devices compute on uploaded copies")
        else:
            why = "no expert op of the test read the slots"
        notes.append(f"EXPERT_CACHE={switches.shown(switches.EXPERT_CACHE, params[switches.EXPERT_CACHE])} did not "
                     f"act: {why}")
    return notes


def layer_major_groups(ext: dict, reps: int) -> Optional[int]:
    """Groups of ubatches that ran through each layer together, per run (LAYER_MAJOR); None where the switch was off
    in the run (its switches as the scheduler read them: ext's params) and none formed."""
    groups = int(ext["layer_major_graphs"] / reps) if "layer_major_graphs" in ext else 0
    asked = str((ext.get("params") or {}).get(switches.LAYER_MAJOR, 0)) != "0"
    return groups if groups or asked else None


def error_text(e: BaseException) -> str:
    """One line for a row's `error`: the worker's error class and message (ModelError: model file not found: ...)."""
    kind = getattr(e, "error_type", None) or type(e).__name__
    return f"{kind}: {e}"


def error_rows(cfg: RunConfig, variant: str, err: str, meta: dict) -> list[Row]:
    """A row per test of `cfg` for a `variant` run that failed with `err`."""
    pl = cfg.placement_for(variant)
    return [Row(variant=variant, model=Path(cfg.model).name, devices=cfg.devices_for(variant), n_batch=cfg.n_batch,
                n_ubatch=min(cfg.n_ubatch, cfg.n_batch), host_experts=pl.label,
                tensor_buft_overrides=";".join(pl.all_overrides()), load_mode=pl.load_mode, test=test_name(t),
                n_depth=depth_of(t), label=cfg.label, config_key=config_key(cfg), error=err[:2000], **meta)
            for t in cfg.tests]


def meta(cfg: RunConfig) -> dict:
    """The row fields that say where and how a config ran: environment knobs, build, machine, date."""
    info = build_info()
    # "cuda": how the package was configured; the CUDA module may also have been dropped into the backends folder
    # afterwards (bench/gpu_run.sh with a carried module): "cuda_module" says whether it is there
    return {"env": _env_knobs(cfg.env), "build": {"cuda": info.get("cuda"), "compiler": info.get("compiler"),
                                                  "cuda_module": "CUDA" in backend_modules()},
            "machine": f"{platform.node()} ({os.cpu_count()} cores)", "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def workload_step_row(st: dict, res: dict) -> dict:
    """The Row fields of one step of a worker "workload" result (`res["steps"]`) that every workload table shows."""
    ext = st.get("ext") or {}
    return {"round": st["round"] + 1, "test": f"r{st['round'] + 1} {st['kind']}{st['n']}",
            "n_prompt": st["n"] if st["kind"] == "pp" else 0, "n_gen": st["n"] if st["kind"] == "tg" else 0,
            "avg_ts": st["ts"], "pipeline_parallel": res["schedule"]["pipeline_parallel"], "host_syncs": st["host_syncs"],
            "h2d_bytes_per_device": st["h2d_bytes_per_device"], "re_reservations": ext.get("reallocs"),
            "plan_switches": ext.get("plan_switches"), "id_readbacks": ext.get("id_readbacks")}
