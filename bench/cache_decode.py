#!/usr/bin/env python3
"""Decode with host experts against the expert cache (EXPERT_CACHE, patch 0014): tokens/s at each cache size, the
cache's hit rate and the bytes it fetches per token, beside the baseline build (its experts on the host CPU); and the
logits of 16 tokens decoded with each size against size 0's (on a GPU: its kernels against the host CPU's, which
test-backend-ops holds to an NMSE of 5e-4 for MUL_MAT_ID; on VDEVs both are the CPU's: 0).

    python bench/cache_decode.py                                   # tiny preset, one VDEV on a 1 GB/s link
    python bench/cache_decode.py --preset small --devices "vdev:1x0@4GBps" --sizes 0,-8,-16,-32,-128
    python bench/cache_decode.py --model M.gguf --devices cuda --sizes 0,-16,-32,-64 -n 64   # GPU machine
    python bench/cache_decode.py --ci                              # the CI case (CI_CASE below)
    python bench/cache_decode.py --preset small --routing locality --devices "vdev:1x0@1GBps" --threads 1 \
        --sizes 0,-16,-32,-64 --hybrid 0,auto --rounds 30 -n 64       # EXPERT_HYBRID against the cache alone

The patched build runs in this process: the model is loaded once, each size gets its own context (a scheduler
copies the switches when it is made), all at once, so each size's slots stay warm between its runs; rounds run
every size once, the order reversed every other round, and each size's speed is paired with size 0's (the path
without the cache) by round (median ratio with its bootstrap interval). The first run of every size fills its
cache and is not counted. The baseline runs in a worker process (its own model load). A size is EXPERT_CACHE's
value: MiB per device, or -N: N slots per layer (0: off); every size's slots take device memory at once. Each size
runs once per --min-hit value (EXPERT_CACHE_MIN_HIT, the guard's floor: 0 none; a layer whose cache's shadow hits
less goes back to the CPU), and once per --hybrid value (EXPERT_HYBRID: a token's misses split between the link
and the host CPU, the value the CPU's expert rate in percent of the link's; auto measures both here), paired with the
cache alone of its size and floor (vs cache alone), with the misses a token the CPU and the link took. The logits
check counts the ops that read the slots while it decodes (logits_cache_ops):
an NMSE of 0 with none of them compared the CPU path with itself.

Routing decides the hit rate: a synthetic model's default ("uniform") routes consecutive tokens independently,
so an LRU of S of E experts hits about S/E; "locality" routes a stream of consecutive token ids to slowly changing
experts, as real decode does, and is fed such a stream (the tokens a measure job's tg would decode: bench_tokens).

The CI case (--ci, VDEVs, no GPU): both paths cost a token a fixed part plus, on the cached path, the misses' uploads:
t(h) = t_dev + (1 - h) t_miss against t_cpu, so the cache wins where t_dev < t_cpu and the misses are few and cheap.
On the GPU machine t_cpu - t_dev is the host's expert matmuls, which the GPU does many times faster, and PCIe moves
an expert about as fast as the host's cores read one. On a VDEV, which computes with the host's kernels on as many
threads here, it is the CPU path's per-layer round trip: the activations and ids copied to the host synchronously
(a handoff with the VDEV's stream thread each), the host's split, the result copied back. CI_CASE keeps the
structure: locality routing calibrated to real decode (the small preset's LRU hits 81% / 89% at 32 / 64 of 128
slots; tg128 rounds, so that the tokens a round repeats do not fit the slots), 128 slots (every expert: the cached
path's fixed part alone, t_dev), a throttled link fast enough that a miss costs less than a hit saves (16 GB/s: an
expert of 156 KB in 10 us), and host and VDEV on one thread each, so that neither side computes faster.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:   # `python bench/cache_decode.py` from anywhere finds the package of this checkout
    sys.path.insert(0, str(REPO))

from pyllama_pp import synth  # noqa: E402
from pyllama_pp.model_file import routes_by_stream, synth_routing  # noqa: E402
from pyllama_pp.params import ContextParams, Placement  # noqa: E402
from pyllama_pp.session import Session  # noqa: E402
from pyllama_pp.stats import max_abs_diff, nmse, paired_ci  # noqa: E402
from pyllama_pp.worker import run_job  # noqa: E402
from pyllama_pp.defaults import threads  # noqa: E402
from pyllama_pp.worker.handlers.base import bench_tokens  # noqa: E402
from pyllama_pp.model_file import expert_tensor_bytes, expert_tensor_shape  # noqa: E402
from pyllama_pp.worker.handlers.fit import cpu_expert_rate, link_rate  # noqa: E402

from _clock import left, log  # noqa: E402   (bench/_clock.py; this script's folder is on sys.path)
from decode_probe import close_contexts, switch_contexts, tg_run  # noqa: E402   (bench/decode_probe.py)

CACHE_KEYS = ("cache_ops", "cache_hits", "cache_misses", "cache_evictions", "cache_bytes", "cache_cpu_ops",
              "cache_leaves", "cache_returns", "cache_shadow_hits", "cache_shadow_misses", "cache_cpu_misses",
              "cache_hybrid_layers")
# the CI case (module docstring): argument defaults --ci sets (options given explicitly still win)
CI_CASE = {"preset": "small", "routing": "locality", "devices": "vdev:1x0@16GBps", "threads": 1,
           "sizes": "0,-32,-64,-128", "rounds": 20, "n": 128}


def cache_totals(ext: dict) -> dict:
    """The cache's counters over all backends, and its levels (slots per layer: the smallest; bytes: all devices)."""
    out = {k: sum(b.get(k, 0) for b in ext["backends"]) for k in CACHE_KEYS}
    out["cache_buffer_bytes"] = sum(b.get("cache_buffer_bytes", 0) for b in ext["backends"])
    out["cache_cpu_layers"] = sum(b.get("cache_cpu_layers", 0) for b in ext["backends"])
    slots = [b["cache_slots"] for b in ext["backends"] if b.get("cache_layers")]
    out["cache_slots"] = min(slots) if slots else 0
    return out


def decode_logits(s: Session, toks: np.ndarray, n: int) -> tuple:
    """The logits of n tokens decoded one by one from an empty KV cache ([n, n_vocab]), and the expert ops that read
    the slots and that the guard ran on the CPU meanwhile (all 0 without the cache)."""
    before = cache_totals(s.ext_stats())
    logits = np.concatenate([s.eval(toks[i: i + 1], logits="last", pos0=i, clear=i == 0, stats=False).logits
                             for i in range(n)])
    after = cache_totals(s.ext_stats())
    return logits, after["cache_ops"] - before["cache_ops"], after["cache_cpu_ops"] - before["cache_cpu_ops"]


def h2d(s: Session) -> int:
    """Host-to-device bytes the VDEVs counted since their last reset (none on other devices)."""
    return sum(d["h2d_bytes"] for d in s.device_counters())


def baseline_ts(model: str, devices: str, ctx: ContextParams, n: int, reps: int, depth: int = 0,
                host_experts: str = "all") -> float:
    """The baseline build's tg t/s (after `depth` prompt tokens) in a worker, mean of `reps` timed runs: with every
    expert in host RAM (random tokens: its host CPU computes the experts, whatever the routing), or with
    host_experts="none" every weight in VRAM (the ceiling)."""
    res = run_job({"kind": "measure", "model": model, "devices": devices, "placement": {"host_experts": host_experts},
                   "ctx": ctx.to_dict(), "tests": [["tg", n, depth]], "reps": reps, "coverage": False}, "baseline",
                  timeout=3600)
    secs = res["tests"][0]["seconds"]
    return float(np.mean([n / s for s in secs]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: --preset written once into /tmp/pp_models)")
    ap.add_argument("--preset", default="tiny", help="synthetic preset when no --model (default tiny)")
    ap.add_argument("--routing", default="uniform", help=f"the preset's routing mode (this synth: {', '.join(synth.ROUTING_MODES)}; "
                    "with --model: the model's own, as its file says)")
    ap.add_argument("--devices", default="vdev:1x0@1GBps", help="device spec (default one VDEV on a 1 GB/s link; cuda)")
    ap.add_argument("--sizes", default="0,-4,-8,-16,-64",
                    help="EXPERT_CACHE values, comma-separated: MiB per device, -N slots per layer, 0 first (off)")
    ap.add_argument("--min-hit", default="",
                    help="EXPERT_CACHE_MIN_HIT values, comma-separated, each with every size but 0 (default: the "
                         "switch's value in this process)")
    ap.add_argument("--hybrid", default="",
                    help="EXPERT_HYBRID values, comma-separated, each with every size but 0 and every --min-hit: the "
                         "host CPU's expert rate in percent of the link's (0: the cache alone; auto: measured here, "
                         "the CPU's decode expert op against a VDEV spec's link, or the first device's pinned link "
                         "measured with one expert's copies)")
    ap.add_argument("--ci", action="store_true",
                    help="the CI case: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in CI_CASE.items()))
    ap.add_argument("-n", type=int, default=32, help="tokens per tg run (default 32)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, even (default 10)")
    ap.add_argument("--n-ctx", type=int, default=512, help="n_ctx (default 512; with --depth at least depth + n + 1)")
    ap.add_argument("--depth", type=int, default=0,
                    help="prompt tokens in the context before each tg run, like llama-bench's -d (default 0): decoded "
                         "in one ubatch of that size, not timed")
    ap.add_argument("--ceiling", action="store_true",
                    help="also the baseline's tg with every weight in VRAM (the ceiling), in a worker")
    ap.add_argument("--threads", type=int, default=0,
                    help="host CPU threads of both builds (0: every core); a VDEV computes with its spec's threads "
                         "(threads=N, default 1): --threads 1 gives the host's experts the device's compute")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline build's run")
    ap.add_argument("--budget", type=float, default=0, help="stop starting rounds after this many seconds (0: none)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "cache_decode"),
                    help="folder for cache_decode.json / .md (default bench/out/cache_decode, git-ignored)")
    args = ap.parse_args()
    if args.ci:
        ap.set_defaults(**CI_CASE)
        args = ap.parse_args()
    if args.rounds < 2 or args.rounds % 2:
        ap.error(f"--rounds must be an even number of at least 2 (rounds pair up), got {args.rounds}")
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes takes integers (MiB, or -N slots per layer), got {args.sizes!r}")
    if not sizes or sizes[0] != 0:
        ap.error("--sizes must start with 0 (the path without the cache, which the others are paired with)")
    try:
        min_hits = [int(x) for x in args.min_hit.split(",") if x.strip()] or [None]
    except ValueError:
        ap.error(f"--min-hit takes integers 0..100 (percent), got {args.min_hit!r}")
    if any(m is not None and not 0 <= m <= 100 for m in min_hits):
        ap.error(f"--min-hit takes integers 0..100 (percent), got {args.min_hit!r}")
    hybrid_text = [x.strip() for x in args.hybrid.split(",") if x.strip()] or ["0"]
    if any(x != "auto" and not x.isdigit() for x in hybrid_text):
        ap.error(f"--hybrid takes integers >= 0 (percent) or auto, got {args.hybrid!r}")
    if args.routing not in synth.ROUTING_MODES:
        ap.error(f"--routing must be one of {', '.join(synth.ROUTING_MODES)} in this build of synth")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = str(synth.cached_model("/tmp/pp_models", args.preset, seed=1, routing=args.routing))
    else:
        args.routing = synth_routing(model) or "the model's"   # (what the table and JSON name)
    n_ub = max(512, args.depth)   # the prompt in one ubatch: one upload of its experts
    ctxp = ContextParams(n_ctx=max(args.n_ctx, args.depth + args.n + 1), n_batch=n_ub, n_ubatch=n_ub,
                         n_threads=args.threads)
    s = Session(model, devices=args.devices, placement=Placement(host_experts="all"), ctx=ctxp, variant="patched")
    log(f"loaded {model} on {args.devices}")
    consecutive = routes_by_stream(model)   # (a locality model: a stream of consecutive ids; else random ones)
    toks = bench_tokens(args.n + 1, s.info.n_vocab, seed=1, stream=consecutive)
    prefix = bench_tokens(args.depth, s.info.n_vocab, seed=2, stream=consecutive) if args.depth else None


    # EXPERT_HYBRID's auto: the host CPU's decode expert op (as fit measures it) against the spec's link
    rates = {}
    if "auto" in hybrid_text:
        rates["cpu_gbps"] = float(next(iter(cpu_expert_rate(s.native, model, threads(args.threads)).values())))
        rates["link_gbps"] = float((s.spec.link_rates() or [0.0])[0])   # (a VDEV's throttle; else measured)
        if not rates["link_gbps"] > 0:
            dev = next(b["name"] for b in s.ext_stats()["backends"] if b["name"] != "CPU")
            shape = expert_tensor_shape(model)
            link = link_rate(s.native, dev, 1 << 30, expert_tensor_bytes(model) // max(1, shape[3] if shape else 1))
            rates["link_gbps"] = link["pinned_gbps"] or link["pageable_gbps"]
        rates["auto"] = max(1, round(100 * rates["cpu_gbps"] / rates["link_gbps"]))
        log(f"EXPERT_HYBRID auto: CPU {rates['cpu_gbps']:.2f} GB/s, link {rates['link_gbps']:.2f} GB/s "
            f"-> {rates['auto']}")
    hybrids = [rates["auto"] if x == "auto" else int(x) for x in hybrid_text]

    # a context per size, floor and hybrid value, each with its own scheduler and slots (the switches are read when a
    # scheduler is made); size 0 once
    own = s.ext_stats()["params"]["EXPERT_CACHE_MIN_HIT"]
    sets = [(0, own, 0)] + [(v, own if m is None else m, h) for v in sizes[1:] for m in min_hits for h in hybrids]
    sizes = [v for v, _, _ in sets]
    ctxs = switch_contexts(s, [{"EXPERT_CACHE": v, "EXPERT_CACHE_MIN_HIT": m, "EXPERT_HYBRID": h} for v, m, h in sets],
                           ctxp)
    for c in ctxs:
        s._ctx = c
        tg_run(s, toks, args.n, prefix)   # warm-up: fills the cache (the context's: it stays warm between tg runs)
    samples = [[] for _ in sizes]
    counts = [{k: 0 for k in CACHE_KEYS + ("h2d_bytes", "ids_wait_us")} for _ in sizes]
    per_round = None
    for r in range(args.rounds):
        if args.budget and per_round and left(args.budget) < 2 * per_round and r % 2 == 0:
            log(f"budget: stopping after {r} rounds")
            break
        t_r = time.time()
        for i in (range(len(sizes)) if r % 2 == 0 else reversed(range(len(sizes)))):
            s._ctx = ctxs[i]
            e0 = s.ext_stats()
            s.reset_counters()
            dt = tg_run(s, toks, args.n, prefix)
            moved = h2d(s)
            e1 = s.ext_stats()
            samples[i].append(args.n / dt)
            c0, c1 = cache_totals(e0), cache_totals(e1)
            for k in CACHE_KEYS:
                counts[i][k] += c1[k] - c0[k]
            counts[i]["h2d_bytes"] += moved
            counts[i]["ids_wait_us"] += e1["host_wait_us"]["ids"] - e0["host_wait_us"]["ids"]
        per_round = time.time() - t_r
    levels, logits = [], []
    for c in ctxs:
        s._ctx = c
        levels.append(cache_totals(s.ext_stats()))
        logits.append(decode_logits(s, toks, min(args.n, 16)))   # against size 0's (the CPU computes its experts)
    base = None if args.no_baseline else baseline_ts(model, args.devices, ctxp, args.n, 3, args.depth)
    ceiling = baseline_ts(model, args.devices, ctxp, args.n, 3, args.depth, "none") if args.ceiling else None

    vdev = s.spec.kind == "vdev"   # (only VDEVs count their links' bytes)
    rows = []
    for i, v in enumerate(sizes):
        ts = np.asarray(samples[i])
        med, lo, hi = paired_ci(ts / np.asarray(samples[0])) if i else (1.0, 1.0, 1.0)
        # a hybrid row against the cache alone (its size and floor, EXPERT_HYBRID=0), paired by round
        alone = (next((j for j, x in enumerate(sets) if x[2] == 0 and x[:2] == sets[i][:2]), None)
                 if sets[i][2] else None)
        vc = paired_ci(ts / np.asarray(samples[alone])) if alone is not None else (None, None, None)
        c = counts[i]
        tokens = len(ts) * args.n
        lookups = c["cache_hits"] + c["cache_misses"]
        shadow = c["cache_shadow_hits"] + c["cache_shadow_misses"]
        rows.append({"expert_cache": v, "min_hit": sets[i][1], "hybrid": sets[i][2],
                     "slots_per_layer": levels[i]["cache_slots"],
                     "nmse_vs_off": nmse(logits[i][0], logits[0][0]),
                     "max_abs_vs_off": max_abs_diff(logits[i][0], logits[0][0]),
                     "logits_cache_ops": logits[i][1], "logits_cpu_ops": logits[i][2],
                     "cache_mib": levels[i]["cache_buffer_bytes"] / 2**20, "avg_ts": float(ts.mean()),
                     "stddev_ts": float(ts.std(ddof=1)) if len(ts) > 1 else 0.0, "vs_off": med, "vs_off_lo": lo,
                     "vs_off_hi": hi, "vs_baseline": float(ts.mean()) / base if base else None,
                     "of_ceiling": float(ts.mean()) / ceiling if ceiling else None,
                     "vs_cache": vc[0], "vs_cache_lo": vc[1], "vs_cache_hi": vc[2],
                     "hit_rate": c["cache_hits"] / lookups if lookups else None,
                     "cpu_miss_share": c["cache_cpu_misses"] / c["cache_misses"] if c["cache_misses"] else None,
                     "cpu_misses_per_token": c["cache_cpu_misses"] / tokens if tokens else None,
                     "link_misses_per_token": (c["cache_misses"] - c["cache_cpu_misses"]) / tokens if tokens else None,
                     "fetched_mb_per_token": c["cache_bytes"] / tokens / 1e6 if tokens else None,
                     "h2d_mb_per_token": c["h2d_bytes"] / tokens / 1e6 if tokens and vdev else None,
                     "ids_wait_us_per_token": c["ids_wait_us"] / tokens if tokens else None,
                     "cache_ops_per_token": c["cache_ops"] / tokens if tokens else None,
                     "cpu_ops_per_token": c["cache_cpu_ops"] / tokens if tokens else None,
                     "switches": c["cache_leaves"] + c["cache_returns"], "cpu_layers": levels[i]["cache_cpu_layers"],
                     "shadow_hit_rate": c["cache_shadow_hits"] / shadow if shadow else None,
                     "rounds": len(ts), "samples_ts": ts.tolist()})
    doc = {"model": model, "devices": args.devices, "n": args.n, "depth": args.depth, "routing": args.routing,
           "threads": args.threads, "ceiling_ts": ceiling, "hybrid_rates": rates,
           "command": " ".join(sys.argv[1:]), "ci": args.ci,
           "tokens": "consecutive" if consecutive else "random", "baseline_ts": base,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    (out / "cache_decode.json").write_text(json.dumps(doc, indent=1))
    fmt = lambda x, f: "" if x is None else format(x, f)   # noqa: E731
    lines = ["| EXPERT_CACHE | MIN_HIT | HYBRID | slots/layer | MiB | t/s | vs off (paired, 95%) | vs cache alone "
             "(paired, 95%) | vs baseline | of in VRAM | hit rate | misses/token CPU / link | "
             "shadow hit rate | CPU ops/token (switches) | fetched MB/token | h2d MB/token | ids wait us/token | "
             "logits NMSE vs off (slot ops / CPU ops in that check) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: |"]
    for x in rows:
        vsc = (f"{x['vs_cache']:.3f} [{x['vs_cache_lo']:.3f}, {x['vs_cache_hi']:.3f}]" if x["vs_cache"] is not None
               else "")
        split = (f"{x['cpu_misses_per_token']:.1f} / {x['link_misses_per_token']:.1f}"
                 if x["cpu_misses_per_token"] is not None and x["expert_cache"] else "")
        lines.append(f"| {x['expert_cache']} | {x['min_hit'] if x['expert_cache'] else ''} | "
                     f"{x['hybrid'] if x['expert_cache'] else ''} | {x['slots_per_layer']} | "
                     f"{x['cache_mib']:.1f} | "
                     f"{x['avg_ts']:.1f} ± {x['stddev_ts']:.1f} | {x['vs_off']:.3f} [{x['vs_off_lo']:.3f}, "
                     f"{x['vs_off_hi']:.3f}] ({x['rounds']}) | {vsc} | {fmt(x['vs_baseline'], '.2f')} | "
                     f"{fmt(x['of_ceiling'], '.0%')} | "
                     f"{fmt(x['hit_rate'], '.3f')} | {split} | {fmt(x['shadow_hit_rate'], '.3f')} | "
                     f"{fmt(x['cpu_ops_per_token'], '.1f')} ({x['switches']}) | "
                     f"{fmt(x['fetched_mb_per_token'], '.3f')} | "
                     f"{fmt(x['h2d_mb_per_token'], '.3f')} | {fmt(x['ids_wait_us_per_token'], '.0f')} | "
                     f"{x['nmse_vs_off']:.2e} ({x['logits_cache_ops']} / {x['logits_cpu_ops']}) |")
    table = "\n".join(lines)
    head = (f"{Path(model).name} on {args.devices}, tg{args.n}{f' @ d{args.depth}' if args.depth else ''}, routing "
            f"{args.routing}, {args.threads or 'all'} host threads, {'consecutive' if consecutive else 'random'} "
            f"tokens; baseline {fmt(base, '.1f')} t/s" + (f"; every weight in VRAM {ceiling:.1f} t/s" if ceiling else ""))
    (out / "cache_decode.md").write_text(f"{head}\n\n{table}\n")
    print(head)
    print(table)
    close_contexts(s, ctxs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
