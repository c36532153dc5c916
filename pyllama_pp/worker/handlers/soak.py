"""Job kind "soak": many mixed calls in ONE session and context, as a long-running server makes them, with
checkpoints whose logits are compared with a fresh session's (the reference: the same job with `reference`).

Calls mix batch sizes on both sides of the op-offload threshold (32 tokens: VDEV's, as CUDA's) and of the
patched scheduler's upload-all bar (4 x n_expert selections idle, 2 x in flight: 128 / 64 tokens for the tiny
model's 64 experts, 2 used), outputs all / last / none / a few rows, new prompts (a clear), continuations,
rewinds (the cache cut back, then decoded again from there) and context shifts (llama.cpp's: positions dropped
and the rest moved down, the keys rotated at the next decode). Host RSS is read from /proc/self/status here, in the
process that holds the session. pyllama_pp.soak runs the two jobs and judges them.
"""
from __future__ import annotations

import ctypes
import time
from typing import Optional

import numpy as np

from ...devices import list_devices
from ...errors import ConfigError
from ...jobs import SoakJob
from ...stats import nmse
from .base import open_session

OFFLOAD_MIN = 32          # VDEV's (and CUDA's) op-offload batch threshold
MiB = 1024 * 1024
# batch sizes: below the op-offload threshold, between it and the upload-all bar, above that bar
SMALL = (1, 1, 1, 2, 3, 5, 8, 16, 31)
MID = (32, 33, 40, 48, 63, 64, 100)
LARGE = (127, 128, 129, 200, 256, 384, 512, 700)
# (kind, weight): a new prompt (clear), a continuation, a rewind (cut the cache back, decode from there), a
# context shift before a continuation (also forced whenever a continuation would not fit)
KINDS = (("prompt", 0.2), ("continue", 0.45), ("rewind", 0.2), ("shift", 0.15))
OUTPUTS = (("last", 0.4), ("all", 0.25), ("none", 0.25), ("rows", 0.1))


def rss_bytes(trim: bool = False) -> int:
    """VmRSS of this process (Linux); with trim, after glibc's malloc_trim(0) has handed free heap pages back, so
    that what is left is memory in use, not the allocator's high-water mark after a large logits array (a 700-row
    "all" output is 11 MB here): a leak survives the trim, the allocator's spare pages do not."""
    if trim:
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def band(n: int, n_expert: int, n_used: int) -> str:
    """Which side of the thresholds a batch of n tokens is on (the idle upload-all bar)."""
    if n < OFFLOAD_MIN:
        return "below offload"
    return "above upload-all" if n * n_used >= 4 * n_expert else "offload, below upload-all"


# ---------------------------------------------------------------------------------------------------------
# checkpoint recipes: fixed steps from an empty context, run in the soak and once in a fresh session
RECIPE_SEED = 12345   # the recipes' own tokens, the same in every soak (not the soak's seed)


def recipes(n_vocab: int, seed: int = RECIPE_SEED) -> list[list[dict]]:
    """Steps: {"op": "eval", "tokens", "pos0", "clear", "logits"} | {"op": "shift", "keep", "discard"} |
    {"op": "rm", "p0"}. The logits of the eval steps that return some, in order, are the recipe's result."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(0, n_vocab, n).tolist()

    def ev(n, pos0, logits, clear=False):
        return {"op": "eval", "tokens": toks(n), "pos0": pos0, "clear": clear, "logits": logits}

    return [
        [ev(8, 0, "all", clear=True)],                                              # below the offload threshold
        [ev(48, 0, "last", clear=True), ev(24, 48, "all")],                        # between; a continuation
        [ev(300, 0, "all", clear=True)],                                            # above upload-all, 3 ubatches
        [ev(200, 0, "none", clear=True), {"op": "shift", "keep": 16, "discard": 100},
         ev(20, 100, "all"), ev(1, 120, "all")],                                    # a context shift, then decode
        [ev(100, 0, "none", clear=True), {"op": "rm", "p0": 60}, ev(30, 60, "all")],  # a rewind
    ]


def run_recipe(s, steps: list[dict]) -> tuple[np.ndarray, int]:
    """Run one recipe in session s; returns its logits (stacked rows) and the evals it made."""
    out, n_eval = [], 0
    for st in steps:
        if st["op"] == "eval":
            r = s.eval(st["tokens"], logits=st["logits"], pos0=st["pos0"], clear=st["clear"], stats=False)
            n_eval += 1
            if r.logits.shape[0]:
                out.append(r.logits)
        elif st["op"] == "shift":
            s.context_shift(st["keep"], st["discard"])
        elif st["op"] == "rm":
            s.kv_remove(st["p0"])
    return np.concatenate(out), n_eval


# ---------------------------------------------------------------------------------------------------------
# the worker side (job kind "soak")

def cuda_memory(s) -> list[dict]:
    """The session's CUDA devices as CUDA reports them now (ggml's device memory query, cudaMemGetInfo): name,
    description, total_bytes, used_bytes (total - free); empty for other devices."""
    return [{"name": d["name"], "description": d["description"], "total_bytes": d["memory_total"],
             "used_bytes": d["memory_total"] - d["memory_free"]} for d in s.spec.driver_devices(list_devices())]


def cache_memory(s) -> dict:
    """The device memory the expert cache's slots take now, per scheduler backend that has any (EXPERT_CACHE, the
    patched build; empty otherwise)."""
    ext = s.ext_stats() or {}
    return {b["name"]: b["cache_buffer_bytes"] for b in ext.get("backends", []) if b.get("cache_buffer_bytes")}


# summed over the backends (cache_cpu_misses: EXPERT_HYBRID's share of the misses)
CACHE_COUNTS = ("cache_ops", "cache_hits", "cache_misses", "cache_evictions", "cache_cpu_misses")


def _pick(rng, table):
    names, w = zip(*table)
    return names[int(rng.choice(len(names), p=np.asarray(w) / sum(w)))]


def _size(rng, warm_sizes: list, i: int) -> int:
    if i < len(warm_sizes):
        return warm_sizes[i]
    return int(rng.choice((SMALL, MID, LARGE)[int(rng.integers(0, 3))]))


def soak(s, calls: int, seed: int, check_every: int, warmup: int, ref: str) -> dict:
    """Run the soak in session s (this process holds it). The first `warmup` calls (0: auto, at least one of each
    size, kind and output) settle the allocations and are not judged for growth; then every recipe runs once, and
    one recipe every `check_every` calls, and once more at the end. Each checkpoint's logits are compared here with
    the reference's (`ref`, the .npz of reference_job) and dropped: the soak keeps no logits, so that its own
    bookkeeping does not grow the RSS it measures."""
    n_vocab, n_ctx = s.info.n_vocab, s.ctx_params.n_ctx
    n_expert, n_used = max(s.info.n_expert, 1), max(s.info.n_expert_used, 1)
    rec = recipes(n_vocab)
    rng = np.random.default_rng(seed)
    # the warm-up: every size once (a kind and an output each, in turn), then every recipe once
    warm_sizes = sorted(set(SMALL + MID + LARGE))
    warmup = warmup or len(warm_sizes) + 4
    kinds_cycle = [k for k, _ in KINDS]
    outs_cycle = [o for o, _ in OUTPUTS]
    with np.load(ref) as z:
        reference = {k: z[k] for k in z.files}
    rss0 = rss_bytes(trim=True)
    ext0 = s.ext_stats()
    cuda0 = cuda_memory(s)      # (empty unless the devices are CUDA's)
    pos = 0                     # the next position of the sequence in the cache
    counts: dict[str, int] = {}
    bands: dict[str, dict] = {}
    checkpoints = []
    n_eval = n_shift = n_rm = n_clear = 0
    t0 = time.perf_counter()

    def checkpoint(i_call: int, warm: bool, j: Optional[int] = None) -> int:
        nonlocal n_eval, n_clear
        j = len(checkpoints) % len(rec) if j is None else j
        logits, k = run_recipe(s, rec[j])
        n_eval += k
        n_clear += 1
        s.synchronize()
        devs = s.device_counters()
        want = reference[f"r{j}"]
        same = logits.shape == want.shape and bool(np.array_equal(logits, want))
        err = nmse(logits, want) if logits.shape == want.shape else float("inf")
        del logits
        checkpoints.append({"call": i_call, "recipe": j, "warmup": warm, "nmse": err, "exact": same,
                            "seconds": time.perf_counter() - t0, "rss_untrimmed": rss_bytes(),
                            "rss_bytes": rss_bytes(trim=True),
                            "alloc_bytes": [d["alloc_bytes"] for d in devs],
                            "peak_alloc_bytes": [d["peak_alloc_bytes"] for d in devs],
                            "failed_allocs": sum(d["failed_allocs"] for d in devs),
                            "cache_buffer_bytes": cache_memory(s)})
        if cuda0:
            checkpoints[-1]["cuda_used_bytes"] = [d["used_bytes"] for d in cuda_memory(s)]
        return 0   # a recipe ends with its own state in the cache: the next call starts from a clear

    for i in range(calls):
        n = _size(rng, warm_sizes, i)
        if i < len(warm_sizes):
            call, outk = kinds_cycle[i % len(kinds_cycle)], outs_cycle[i % len(outs_cycle)]
        else:
            call, outk = _pick(rng, KINDS), _pick(rng, OUTPUTS)
        if pos == 0 and call != "prompt":
            call = "prompt"
        if call == "rewind":
            p0 = int(rng.integers(0, pos))
            s.kv_remove(p0)
            n_rm += 1
            pos = p0
        if call == "shift" or (call != "prompt" and pos + n > n_ctx):
            keep = int(rng.integers(0, min(64, pos)))
            discard = max(1, (pos - keep) // 2)
            if pos + n - discard > n_ctx:   # a long call: make room for it
                discard = pos - keep
            if discard > 0 and keep + discard <= pos:
                pos = s.context_shift(keep, discard)
                n_shift += 1
            if pos + n > n_ctx:
                call = "prompt"
        clear = call == "prompt"
        pos0 = 0 if clear else pos
        n_clear += clear
        if outk == "rows":
            logits = sorted(set(rng.integers(0, n, min(n, 4)).tolist()))
        else:
            logits = outk
        r = s.eval(rng.integers(0, n_vocab, n), logits=logits, pos0=pos0, clear=clear, stats=False)
        n_eval += 1
        want = {"all": n, "last": 1, "none": 0}.get(outk, len(logits) if isinstance(logits, list) else 0)
        if r.logits.shape != (want, n_vocab) or not np.all(np.isfinite(r.logits)):
            raise AssertionError(f"call {i}: logits {r.logits.shape} (want {(want, n_vocab)}) or not finite")
        pos = pos0 + n
        if s.kv_pos_max() != pos - 1:
            raise AssertionError(f"call {i}: the cache ends at {s.kv_pos_max()}, not {pos - 1}")
        counts[call] = counts.get(call, 0) + 1
        counts["out " + outk] = counts.get("out " + outk, 0) + 1
        b = bands.setdefault(band(n, n_expert, n_used), {"calls": 0, "tokens": 0, "h2d_bytes": 0})
        b["calls"] += 1
        b["tokens"] += n
        b["h2d_bytes"] += sum(d["h2d_bytes"] for d in r.counters["devices"])
        del r    # (its logits, up to 11 MB, must not be alive at a checkpoint's RSS reading)
        done = i + 1
        if done == warmup:   # the end of the warm-up: every recipe once (their shapes settle too)
            for j in range(len(rec)):
                pos = checkpoint(done, True, j)
        elif done > warmup and ((done - warmup) % check_every == 0 or done == calls):
            pos = checkpoint(done, False)
    if not checkpoints or checkpoints[-1]["call"] != calls:
        checkpoint(calls, calls <= warmup)
    seconds = time.perf_counter() - t0
    ext = s.ext_stats()
    ext_moved = None
    if ext and ext0:
        ext_moved = {k: ext[k] - ext0.get(k, 0) for k in ("upload_all", "selective", "gather", "id_readbacks",
                                                           "offload_owner", "graphs", "reallocs", "plan_switches")
                     if isinstance(ext.get(k), int)}
        ext_moved.update({k: sum(b.get(k, 0) for b in ext["backends"]) - sum(b.get(k, 0) for b in ext0["backends"])
                          for k in CACHE_COUNTS})
    out = {"model": s.info.to_dict(), "calls": calls, "evals": n_eval, "shifts": n_shift, "rewinds": n_rm,
           "clears": n_clear, "warmup": warmup, "seconds": seconds, "rss_start": rss0, "counts": counts,
           "bands": bands, "checkpoints": checkpoints, "ext": ext_moved,
           "expert_cache": (ext or {}).get("params", {}).get("EXPERT_CACHE", 0)}
    if cuda0:   # each device at the start (the session made, no call yet)
        out["cuda_devices"] = cuda0
    return out


def reference(s, out: str) -> dict:
    """The recipes once each, in a fresh session (the worker's only one), logits saved to `out` (.npz)."""
    rec = recipes(s.info.n_vocab)
    saved = {f"r{j}": run_recipe(s, steps)[0] for j, steps in enumerate(rec)}
    np.savez(out, **saved)
    return {"recipes": len(rec)}


def handle(job: SoakJob) -> dict:
    """The soak (or, with job.reference, the reference's checkpoint recipes) in a fresh session.

    Raises:
        ConfigError: for a job without `out` or with counts out of range.
    """
    if not job.out:
        raise ConfigError("a soak job needs `out`, the .npz file of the reference's logits")
    if job.calls < 1 or job.check_every < 1 or job.warmup < 0:
        raise ConfigError("a soak job needs calls >= 1, check_every >= 1 and warmup >= 0")
    with open_session(job) as s:
        if job.reference:
            return reference(s, job.out)
        return soak(s, job.calls, job.seed, job.check_every, job.warmup, job.out)
