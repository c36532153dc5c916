"""One host against two on ggml RPC: prompt and decode t/s, and the bytes each host's network link carries per token.

Rows, each in a process of its own (the same devices, model, sizes and load mode in every row):
- `one host`: the devices in one process, every expert in (pinned) host RAM, patched defaults;
- `2 hosts, patched`: a patched rpc-server per device (protocol 7.1), every expert in the RAM of the server whose
  device holds its layer (RPC_HOST): only activations cross the network;
- `2 hosts, upstream`: upstream's servers and client, every expert in the client's RAM - upstream's placement of host
  experts over RPC (its client computes them; pipelining off);
- `2 hosts, upstream, experts on each server's CPU`: upstream's servers each serving their CPU too
  (`rpc-server --cpu`), every expert overridden to the CPU device of the server whose device holds its layer -
  upstream's other placement: the servers' CPUs compute the experts, pipelining off;
- `2 hosts, patched, RPC_HOST=0`: the patched client and servers with the switch off (experts in the client's RAM).
Each server sits behind a `pyllama_pp.rpc.relay.Link` (a loopback relay) that counts the bytes each way and paces them at
--net-gbps, so "network bytes per token" is measured, not modelled. Logits of every row are compared with the first
row's (NMSE). A prompt's bytes are per prompt token, decode's per generated token; both leave the load out. The
servers share this machine's cores: each gets an equal share for its CPU threads.

    python bench/multihost_ab.py                                  # CPU: tiny preset, a VDEV per host
    python bench/multihost_ab.py --preset qwen3-30b-a3b --host-devices "cuda:0;cuda:1" --local-devices cuda
        (GPU machine, one H200 split in two: GGML_CUDA_DEVICES=2; the 30B preset's load crosses the relay too)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pyllama_pp import switches, synth
from pyllama_pp.planning import models_dir
from pyllama_pp.model_file import block_count
from pyllama_pp.params import ContextParams, Placement
from pyllama_pp.plan import layer_ranges
from pyllama_pp.counters import per_gpu
from pyllama_pp.rpc.relay import Link
from pyllama_pp.servers.serve import spawn_server, wait_listening
from pyllama_pp.session import Session
from pyllama_pp.stats import nmse

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"


def network_bytes(links: list) -> tuple[int, int]:
    """Bytes the relays carried so far, up (client -> servers) and down."""
    return sum(x.bytes_up for x in links), sum(x.bytes_down for x in links)


def server_cpu_overrides(model: str, endpoints: list[str]) -> tuple[str, ...]:
    """Tensor overrides that put each layer's experts on the CPU device (device 1) of the server whose device 0
    holds the layer, for an even split over the servers' devices."""
    ranges, _ = layer_ranges(-1, [1.0] * len(endpoints), block_count(model))
    return tuple(rf"^blk\.({'|'.join(str(i) for i in range(a, b))})\.ffn_(up|gate|down)_exps\.weight$=RPC1[{ep}]"
                 for (a, b), ep in zip(ranges, endpoints) if b > a)


def pcie_bytes(s: Session) -> list[int]:
    """Host-weight bytes moved to each device so far (a patched server's copies included: it reports them)."""
    return per_gpu(s.ext_stats() or {}, "weight_bytes", 1, plus=("direct_bytes_est", "gather_bytes_est")) or []


def measure(cfg: dict) -> dict:
    """One row, in this process: servers and relays up, the model loaded, a prompt and a decode measured."""
    out = Path(cfg["out"])
    procs, links = [], []
    env_switch = cfg.get("switches", {})
    for k, v in env_switch.items():
        os.environ[switches.var(k)] = str(v)
    try:
        if cfg["hosts"] == 1:
            devices = cfg["local_devices"]
        else:
            eps = []
            threads = max(1, len(os.sched_getaffinity(0)) // len(cfg["host_devices"]))   # (hosts share these cores)
            for i, dev in enumerate(cfg["host_devices"]):
                port, proc = spawn_server(dev, cfg["server_variant"], HOST, cpu=cfg.get("server_cpu", False),
                                          threads=threads, stderr=open(out / f"server-{cfg['key']}-{i}.log", "w"))
                procs.append(proc)
                wait_listening(port, proc, HOST)
                link = Link(port, gbps=cfg["net_gbps"])
                links.append(link)
                eps.append(f"{HOST}:{link.port}")
            devices = "rpc://" + ",".join(eps)
        if cfg.get("server_cpu"):   # (layers on each server's device 0, their experts on its CPU, device 1: no layer)
            placement = Placement(tensor_split=(1.0, 0.0) * len(eps), overrides=server_cpu_overrides(cfg["model"], eps))
        else:
            placement = Placement(tensor_split=(1.0,) * len(cfg["host_devices"]), host_experts="all")
        p, n, reps = cfg["p"], cfg["n"], cfg["reps"]
        ctx = ContextParams(n_ctx=p + n + 8, n_batch=p, n_ubatch=cfg["ubatch"])
        t0 = time.monotonic()
        with Session(cfg["model"], devices=devices, placement=placement, ctx=ctx,
                     variant=cfg["variant"]) as s:
            load_s = time.monotonic() - t0
            sched = s.schedule()
            rng = np.random.default_rng(0)
            prompt = rng.integers(0, s.info.n_vocab, p).tolist()
            s.eval(prompt, logits="none", stats=False)   # (warm-up)
            pcie0 = pcie_bytes(s)
            up0, down0 = network_bytes(links)
            secs = []
            for _ in range(reps):
                secs.append(s.eval(prompt, logits="none", stats=False).seconds)
            up1, down1 = network_bytes(links)
            pcie1 = pcie_bytes(s)
            last = s.eval(prompt, logits=list(range(max(0, p - 16), p)), stats=False).logits
            np.save(out / f"logits-{cfg['key']}.npy", last)
            gen = rng.integers(0, s.info.n_vocab, n).tolist()
            up2, down2 = network_bytes(links)
            t1 = time.perf_counter()
            for i, tok in enumerate(gen):
                s.eval([tok], logits="last", pos0=p + i, clear=False, stats=False)
            tg_s = time.perf_counter() - t1
            up3, down3 = network_bytes(links)
            mem = sched.memory
        pp_ts = [p / x for x in secs]
        return {"row": cfg["label"], "key": cfg["key"], "devices": devices, "variant": cfg["variant"],
                "pipeline_parallel": sched.pipeline_parallel, "n_prompt": p, "n_gen": n, "n_ubatch": cfg["ubatch"],
                "avg_ts_pp": float(np.mean(pp_ts)), "stddev_ts_pp": float(np.std(pp_ts)), "avg_ts_tg": n / tg_s,
                "net_up_per_prompt_token": (up1 - up0) / (reps * p), "net_down_per_prompt_token": (down1 - down0) / (reps * p),
                "pcie_per_prompt_token": [(b - a) / (reps * p) for a, b in zip(pcie0, pcie1)],
                "net_up_per_gen_token": (up3 - up2) / n, "net_down_per_gen_token": (down3 - down2) / n,
                "host_expert_bytes_on_servers": sum(m["model_bytes"] for m in mem if m["buft"].startswith("RPC")
                                                    and (m["buft"].endswith("_Host") or m["buft"].startswith("RPC1"))),
                "host_expert_bytes_on_client": sum(m["model_bytes"] for m in mem if not m["buft"].startswith("RPC")
                                                   and (m["buft"] == "CPU" or m["buft"].endswith("_Host"))),
                "load_s": load_s, "net_gbps": cfg["net_gbps"] if cfg["hosts"] > 1 else None}
    finally:
        for x in links:
            x.close()
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def write_summary(out: Path, args, results: list[dict]) -> str:
    """NMSE against the first row that ran, the markdown table and the JSON, written to `out`; returns the table."""
    ref = next((r for r in results if "error" not in r), None)
    for r in results:
        if "error" not in r and ref is not None:
            a, b = np.load(out / f"logits-{r['key']}.npy"), np.load(out / f"logits-{ref['key']}.npy")
            r["nmse_vs_first"] = nmse(a, b)
    one = next((r for r in results if r.get("key") == "one" and "error" not in r), None)
    lines = ["| row | PP | pp t/s | tg t/s | pp vs one host | net up B/token (pp) | net down B/token (pp) | "
             "net up+down B/token (tg) | host weights to each device B/token (pp) | experts on servers | "
             "experts in client RAM | NMSE vs first |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | **error** | | | | | | | | | | {r['error']} |")
            continue
        rel = f"{r['avg_ts_pp'] / one['avg_ts_pp']:.2f}x" if one else ""
        lines.append(f"| {r['row']} | {'on' if r['pipeline_parallel'] else 'off'} | {r['avg_ts_pp']:.1f} ± "
                     f"{r['stddev_ts_pp']:.1f} | {r['avg_ts_tg']:.1f} | {rel} | {r['net_up_per_prompt_token']:.0f} | "
                     f"{r['net_down_per_prompt_token']:.0f} | "
                     f"{r['net_up_per_gen_token'] + r['net_down_per_gen_token']:.0f} | "
                     f"{' / '.join(f'{x:.0f}' for x in r['pcie_per_prompt_token']) or '-'} | "
                     f"{r['host_expert_bytes_on_servers'] / 2**20:.1f} MiB | "
                     f"{r['host_expert_bytes_on_client'] / 2**20:.1f} MiB | {r.get('nmse_vs_first', float('nan')):.2e} |")
    table = "\n".join(lines)
    (out / "multihost.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))
    (out / "multihost.md").write_text(table + "\n")
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="synth preset (default: tiny)")
    ap.add_argument("--model", help="a GGUF instead of a preset")
    ap.add_argument("--host-devices", default="vdev:1x0@1GBps,speed=2;vdev:1x0@1GBps,speed=2",
                    help="each host's devices, ';'-separated (default: one VDEV each, 1 GB/s link)")
    ap.add_argument("--local-devices", default="vdev:2x0@1GBps,speed=2:2",
                    help="the same devices in one process (default: the two VDEVs)")
    ap.add_argument("--net-gbps", type=float, default=1.0, help="each host's network rate per direction, GB/s (0: loopback)")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (default: 512)")
    ap.add_argument("-n", type=int, default=16, help="decoded tokens (default: 16)")
    ap.add_argument("-ub", "--ubatch", type=int, default=128, help="n_ubatch (default: 128)")
    ap.add_argument("--reps", type=int, default=3, help="prompt repetitions (default: 3)")
    ap.add_argument("--rows", default="one,patched,upstream,upstream-cpu,switch-off",
                    help="rows to run, comma-separated: one, patched, upstream, upstream-cpu, switch-off")
    ap.add_argument("--out", default=str(HERE / "out" / "multihost"), help="folder for rows, logs and summary")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # (a row's config: run it in this process)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(synth.cached_model(models_dir(), args.preset, seed=1))
    hosts = args.host_devices.split(";")
    base = {"model": model, "host_devices": hosts, "local_devices": args.local_devices, "net_gbps": args.net_gbps,
            "p": args.p, "n": args.n, "ubatch": args.ubatch, "reps": args.reps, "out": str(out)}
    rows = {
        "one": {"label": "one host", "hosts": 1, "variant": "patched"},
        "patched": {"label": f"{len(hosts)} hosts, patched (experts on each server)", "hosts": len(hosts),
                    "variant": "patched", "server_variant": "patched"},
        "upstream": {"label": f"{len(hosts)} hosts, upstream (experts in the client's RAM)", "hosts": len(hosts),
                     "variant": "baseline", "server_variant": "baseline"},
        "upstream-cpu": {"label": f"{len(hosts)} hosts, upstream, experts on each server's CPU", "hosts": len(hosts),
                         "variant": "baseline", "server_variant": "baseline", "server_cpu": True},
        "switch-off": {"label": f"{len(hosts)} hosts, patched, RPC_HOST=0 (experts in the client's RAM)",
                       "hosts": len(hosts), "variant": "patched", "server_variant": "patched",
                       "switches": {"RPC_HOST": 0}},
    }
    results, t_start = [], time.monotonic()
    for key in args.rows.split(","):
        if args.budget and time.monotonic() - t_start > args.budget:
            results.append({"row": rows[key]["label"], "key": key, "error": "skipped: out of time"})
            continue
        cfg = {**base, **rows[key], "key": key}
        timeout = max(60, args.budget - (time.monotonic() - t_start)) if args.budget else None
        # (a process group of its own: the servers a row started go with it, also when it aborts or runs out of time)
        proc = subprocess.Popen([sys.executable, __file__, "--one", json.dumps(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if stdout is None:
            proc.communicate()
            results.append({"row": cfg["label"], "key": key, "error": f"timed out after {timeout:.0f} s"})
        else:
            if proc.returncode != 0:
                results.append({"row": cfg["label"], "key": key, "error": stderr.strip().splitlines()[-1:]})
            else:
                results.append(json.loads(stdout.strip().splitlines()[-1]))
        print(f"{cfg['label']}: {'error' if 'error' in results[-1] else 'done'}", file=sys.stderr, flush=True)
        write_summary(out, args, results)   # (after each row: a cut-off run keeps what it measured)
    table = write_summary(out, args, results)
    print(json.dumps({"rows": results}) if args.json else table)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
