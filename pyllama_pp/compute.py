"""What a layer's compute costs on a device, measured: the probe `fit --ubatch auto` predicts with.

A prompt's ubatch moves every host-expert layer's experts over the device's link and computes every layer the
device holds. Bytes per link are known from the plan; compute is not, and at a large n_ubatch it is what binds.
The probe measures it on the device itself (for an RPC server's devices: on the server), with the model's own layers:
two replicas of the model with the first `lead + 2` and `lead + 10` layers (lead: the leading dense layers some
families have; fewer where the model has fewer), every weight resident on one device. The difference of their times
is eight MoE layers' compute; what is left of the shorter is the cost outside the layers (embeddings, output).

A layer's time over a prompt of P tokens in ubatches of u is P a(u) + b K(P, u): a per-token part that depends on the
ubatch (the matrix products, the experts a ubatch uses) and attention's, b seconds per key a query reads, K(P, u) the
keys in all (`key_count`). Each candidate runs the prompt itself where that fits the time budget (PROBE.budget,
pyllama_pp.defaults); else a short prompt (one ubatch, at least PROBE.n_tokens) whose result b carries to the prompt's
length (b: calibrated once, a layer's time - the replicas' difference, free of any fixed cost a prompt has - at one
n_ubatch on two lengths, the second CALIBRATION_SPAN times the first); a candidate whose short prompt does not fit the
budget either takes the per-token part of the nearest candidate measured ("estimated"). Each measurement is cached as
it lands, per model (by content: a copy elsewhere is the same model), device spec and replica
(PYLLAMA_PP_CACHE/compute/), and serves later probes of any length.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from statistics import median
from typing import Optional, Sequence, Union

import gguf
from tqdm import tqdm

from . import devices as devspec
from .defaults import PROBE, cache_dir as _cache_root
from .errors import ConfigError
from .jobs import MeasureJob
from .model_file import layer_counts
from .params import ContextParams, Placement, ctx_for
from .predict import LayerCompute
from .rpc import network
from .worker.client import ServingWorker

# MoE layers of the two replicas: their difference is eight layers' compute (fewer where the model has fewer), enough
# to stand above the run-to-run noise of a prompt's time on a GPU; the shorter has two, as one layer's experts can
# stay in a CPU's cache from ubatch to ubatch where a model's many layers' do not (one layer alone runs well below
# the per-layer time of two or more)
REPLICA_LAYERS = (2, 10)
# attention's calibration: both replicas at one n_ubatch (PROBE.n_tokens where the candidates reach it) on the short
# prompt and on this many times its length (up to the prompt's): on a GPU attention is a few percent of a layer at a
# few thousand tokens, so the span must be long for its part to stand above the noise (at 512 and 2048 tokens of
# ubatches of 64 the H100's fit solved to b < 0 and predicted a prompt of 16384 tokens carried from 1024 20% fast)
CALIBRATION_SPAN = 16


def cache_dir() -> Path:
    """Where replicas and probe results are kept (PYLLAMA_PP_CACHE or ~/.cache/pyllama_pp, then compute/)."""
    return _cache_root() / "compute"


# the model's bytes its cache key reads: this many at the start (the GGUF header: metadata and tensor infos) and at
# each quarter of the file and its end (weights): a copy of the file anywhere gets the same key, another model not
KEY_SAMPLE_BYTES = 1 << 20


def model_key(model: Union[str, os.PathLike]) -> str:
    """The model named by its content, not its path: its size and a hash of its first MiB (the GGUF header) and a
    MiB at each quarter of the file and its end, so the same file copied to another folder reuses the probe's
    measurements and replicas (a path or a date would measure it again)."""
    size = Path(model).stat().st_size
    h = hashlib.sha1(str(size).encode())
    with open(model, "rb") as f:
        for at in dict.fromkeys((0, size // 4, size // 2, 3 * size // 4, max(0, size - KEY_SAMPLE_BYTES))):
            f.seek(at)
            h.update(f.read(KEY_SAMPLE_BYTES))
    return h.hexdigest()[:12]


def moe_layers(model: Union[str, os.PathLike]) -> int:
    """The model's layers after its leading dense ones."""
    n_layer, n_dense = layer_counts(model)
    return n_layer - n_dense


def replica(model: Union[str, os.PathLike], n_moe_layers: int, out_dir: Optional[Path] = None) -> Path:
    """A GGUF with the model's first leading-dense + `n_moe_layers` layers and everything outside the layers, the
    same metadata with block_count (and per-layer arrays) cut to match: the model's own layers, fewer of them.

    Args:
        model: the GGUF file.
        n_moe_layers: how many MoE layers after the leading dense ones (at least 1).
        out_dir: where to write it (default: cache_dir()); written once per model file and layer count.
    Returns:
        The replica's path.
    Raises:
        ConfigError: when the model has fewer layers than asked for.
    """
    n_layer, n_dense = layer_counts(model)
    keep = n_dense + n_moe_layers
    if n_moe_layers < 1 or keep > n_layer:
        raise ConfigError(f"a replica of {Path(model).name} with {n_moe_layers} MoE layers needs {keep} layers; the "
                          f"model has {n_layer}")
    out = Path(out_dir or cache_dir()) / f"{Path(model).stem}-{model_key(model)}-L{keep}.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(str(model))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out) + ".tmp", arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value, vtype = f.contents(), f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if f.name == f"{arch}.block_count":
            value = keep
        elif vtype == gguf.GGUFValueType.ARRAY and isinstance(value, list) and len(value) == n_layer \
                and not f.name.startswith("tokenizer."):
            value = value[:keep]   # (a per-layer array: head counts, sliding-window pattern)
        w.add_key_value(f.name, value, vtype, sub_type=sub)
    tensors = [t for t in reader.tensors
               if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= keep)]
    for t in tensors:   # (as gguf-py's gguf_new_metadata copies them: the raw data, its shape and type)
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.data)
    w.close()
    os.replace(str(out) + ".tmp", out)
    return out


def shares_one_gpu(devices) -> bool:
    """Whether a spec's devices are parts of one GPU (GGML_CUDA_DEVICES splits a GPU into that many): their compute
    runs side by side on the same multiprocessors, so it does not add up as separate GPUs' would
    (DeviceSpec.shares_one_gpu)."""
    return devspec.parse(devices).shares_one_gpu


def probe_devices(devices, servers: Optional[Sequence[Optional[str]]] = None) -> list[tuple[list[int], str]]:
    """The device specs the probe runs on, with the devices each stands for (DeviceSpec.probe_specs): for VDEVs one
    per distinct compute speed (unthrottled, no memory limit: only compute is measured); for CUDA the first device
    (the devices are taken to be alike), or every device together where they are parts of one GPU (shares_one_gpu);
    for RPC servers a device of each server; "cpu" for the CPU.

    Args:
        devices: a device spec.
        servers: each device's RPC server, HOST:PORT or None, as a fit plan names them (for specs with servers).
    Returns:
        [(device indices, device spec), ...].
    """
    return devspec.parse(devices).probe_specs(servers)


def key_count(n_tokens: int, n_ubatch: int) -> int:
    """The keys a prompt's queries read in all, as attention's mask lays them out: each ubatch's tokens against every
    cell in use once it is in (n_tokens in ubatches of n_ubatch)."""
    full, tail = divmod(n_tokens, n_ubatch)
    total = n_ubatch * n_ubatch * full * (full + 1) // 2   # (ubatch i of full ones: n_ubatch x (i + 1) n_ubatch)
    return total + tail * n_tokens


class _Device:
    """The probe of one device spec: its replicas' workers (one each, kept loaded), its measurements (cached as they
    land) and attention's calibration."""

    def __init__(self, model, spec: str, indices: list[int], variant: str, reps: int, timeout: Optional[float],
                 cache: bool, net: Optional[dict] = None, hidden: int = 0):
        self.model, self.spec, self.indices, self.variant = model, spec, indices, variant
        self.net, self.hidden = net if net and net.get("up_gbps") and net.get("down_gbps") else None, hidden
        self.reps, self.timeout, self.cache = reps, timeout, cache
        self.n_hi = min(REPLICA_LAYERS[1], moe_layers(model))
        self.n_lo = max(1, min(REPLICA_LAYERS[0], self.n_hi - 1))
        key = hashlib.sha1(json.dumps([model_key(model), spec, os.environ.get("GGML_CUDA_DEVICES", ""), variant,
                                       self.n_lo, self.n_hi]).encode()).hexdigest()[:16]
        self.path = cache_dir() / f"compute-{key}.json"
        self.data = {"device": spec, "runs": {}}
        if cache and self.path.exists():
            self.data = json.loads(self.path.read_text())
        self.workers: dict[int, ServingWorker] = {}
        # an RPC server serves one client at a time: one replica's worker at a time, the other one closed
        self.exclusive = devspec.parse(spec).remote
        self.kv: Optional[tuple[float, float]] = None   # (seconds a layer-token outside attention, b)

    # -- runs
    def _seconds(self, n_layers: int, n_ubatch: int, n_tokens: int) -> float:
        """The median seconds of a prompt of n_tokens at n_ubatch on the replica of n_layers MoE layers."""
        if n_layers not in self.workers:
            if self.exclusive:
                self.close()
            self.workers[n_layers] = ServingWorker(self.variant).start()
        job = MeasureJob(variant=self.variant, model=str(replica(self.model, n_layers)), devices=self.spec,
                         placement=Placement(), tests=[["pp", n_tokens]], reps=self.reps, warmup=1, coverage=False,
                         ctx=ContextParams(n_ctx=ctx_for(n_tokens + 8), n_batch=n_tokens, n_ubatch=n_ubatch))
        return median(self.workers[n_layers].run(job, timeout=self.timeout)["tests"][0]["seconds"])

    def _save(self) -> None:
        if self.cache:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data))

    def run(self, n_ubatch: int, n_tokens: int) -> list[float]:
        """Both replicas' seconds on a prompt of n_tokens at n_ubatch (measured once, then cached)."""
        key = f"{n_ubatch}:{n_tokens}"
        if key not in self.data["runs"]:
            # (the replica loaded now first: with one worker at a time, one load a candidate)
            first = self.n_hi if self.n_hi in self.workers else self.n_lo
            got = {n: self._seconds(n, n_ubatch, n_tokens) for n in dict.fromkeys((first, self.n_lo, self.n_hi))}
            self.data["runs"][key] = [got[self.n_lo], got[self.n_hi]]
            self._save()
        return self.data["runs"][key]

    def calibrate(self, n_ubatch: int, lengths: Sequence[int]) -> None:
        """Attention's part b from one layer's time (the replicas' difference: a fixed cost of the prompt's, outside
        the layers, cancels) at n_ubatch on two prompt lengths: a layer takes P a + b K(P, u); both runs are kept as
        measurements too.

        Args:
            n_ubatch: the n_ubatch of both runs.
            lengths: the two prompt lengths (the first and the last count).
        """
        (p1, p2) = lengths[0], lengths[-1]
        for n in (p1, p2):
            self.run(n_ubatch, n)
        self.data["attention"] = [n_ubatch, p1, p2]
        self._save()
        (l1, _), (l2, _) = self._split(n_ubatch, p1), self._split(n_ubatch, p2)
        k1, k2 = key_count(p1, n_ubatch), key_count(p2, n_ubatch)
        det = p1 * k2 - p2 * k1
        b = max((p1 * l2 - p2 * l1) / det, 0.0) if det else 0.0
        lo = self.data["runs"][f"{n_ubatch}:{p2}"][0]   # (the shorter replica's seconds a token: what a run costs)
        self.kv = (max(lo - self.n_lo * b * k2, 0.0) / (p2 * self.n_lo), b)

    def calibrated(self) -> bool:
        """Whether attention's calibration is in the cache."""
        return "attention" in self.data

    def load_calibration(self) -> None:
        """Attention's part from the cached calibration."""
        u, p1, p2 = self.data["attention"]
        self.calibrate(u, (p1, p2))

    # -- what a layer costs
    def _split(self, n_ubatch: int, n_tokens: int) -> tuple[float, float]:
        """(one layer's seconds, the seconds outside the layers) of both replicas' seconds on a prompt of n_tokens at
        n_ubatch. On an RPC server the replicas' messages crossed the network too: a layer's graph message, the
        activations and inputs of each ubatch (rpc.network's bytes at the rates fit measured), which predict counts
        as network time, are taken out here."""
        lo, hi = self.data["runs"][f"{n_ubatch}:{n_tokens}"]
        layer = (hi - lo) / (self.n_hi - self.n_lo) if self.n_hi > self.n_lo else lo / self.n_lo
        outside = lo - self.n_lo * layer
        if self.net:
            n_ub = -(-n_tokens // n_ubatch)
            up, down = network.device_bytes(self.hidden, n_ubatch, network.n_kv_mean(n_tokens, n_ubatch), 0,
                                            act_out=False)
            layer -= n_ub * network.graph_bytes(1) / (self.net["up_gbps"] * 1e9)
            outside -= n_ub * (up / (self.net["up_gbps"] * 1e9) + down / (self.net["down_gbps"] * 1e9))
        return max(layer, 0.0), max(outside, 0.0)

    def measured(self, n_ubatch: int, n_tokens: int) -> list[int]:
        """The prompt lengths up to n_tokens measured at n_ubatch, longest first."""
        got = [int(k.split(":")[1]) for k in self.data["runs"] if int(k.split(":")[0]) == n_ubatch]
        return sorted((n for n in got if n <= n_tokens), reverse=True)

    def per_token(self, n_ubatch: int, n_tokens: int) -> Optional[tuple[float, float, int]]:
        """(a layer's seconds per token outside attention, the outside's seconds per token, the length measured) at
        n_ubatch, from its longest measurement up to n_tokens; None where there is none."""
        lengths = self.measured(n_ubatch, n_tokens)
        if not lengths:
            return None
        m = lengths[0]
        layer, outside = self._split(n_ubatch, m)
        b = self.kv[1] if self.kv else 0.0
        return max(layer - b * key_count(m, n_ubatch), 0.0) / m, outside / m, m

    def layer(self, n_ubatch: int, n_tokens: int, like: Optional[int] = None) -> Optional[tuple[float, float, str]]:
        """(one layer's seconds over the prompt, the seconds outside the layers, how) at n_ubatch: measured on the
        prompt, carried from a shorter one, or with `like`'s per-token part; None where nothing stands for it."""
        if f"{n_ubatch}:{n_tokens}" in self.data["runs"]:
            return (*self._split(n_ubatch, n_tokens), "measured")
        got = self.per_token(n_ubatch if like is None else like, n_tokens)
        if got is None:
            return None
        a, o, m = got
        b = self.kv[1] if self.kv else 0.0
        how = f"measured at {m} tokens" if like is None else f"estimated from n_ubatch {like}"
        return n_tokens * a + b * key_count(n_tokens, n_ubatch), o * n_tokens, how

    def cost(self, n_ubatch: int, n_tokens: int) -> float:
        """Seconds measuring both replicas at n_ubatch on n_tokens would take, by the calibration (inf: none)."""
        if not self.kv:
            return math.inf
        x, b = self.kv
        one = n_tokens * x + b * key_count(n_tokens, n_ubatch)   # (a layer, its share of the outside)
        return (1 + self.reps) * (self.n_lo + self.n_hi) * one

    def nearest(self, n_ubatch: int, n_tokens: int) -> Optional[int]:
        """The measured n_ubatch nearest to n_ubatch (by ratio)."""
        done = {int(k.split(":")[0]) for k in self.data["runs"] if int(k.split(":")[1]) <= n_tokens}
        return min(done, key=lambda u: abs(math.log(u / n_ubatch))) if done else None

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.workers.clear()


class Probe:
    """The compute probe of one model on one device spec for a prompt of n_tokens, candidate by candidate (the
    planner decides which: `compute` measures or estimates one, `skip` drops one), within a time budget. A context
    manager: its replicas' workers stay loaded until it closes.

    >>> with Probe("small.gguf", "vdev:2x87MiB@1GBps", 16384, candidates=[64, 128, 256], progress=True) as p:
    ...     layer_compute = p.compute(128)     # device index -> LayerCompute, with n_ubatch 128 in it

    Args:
        model: the GGUF file.
        devices: the device spec (its devices' compute is probed; links and memory limits play no part).
        n_tokens: the prompt's length.
        candidates: the n_ubatch values the planner may ask for (the budget is shared among those not asked yet).
        variant: the build that runs the replicas ("baseline": every weight resident, both compute alike; a spec
            with RPC servers needs their variant).
        servers: each device's RPC server as a fit plan names them (HOST:PORT or None), for specs with servers.
        reps: timed runs per replica and measurement (the median counts; one untimed first).
        budget: seconds the probe may spend measuring (None: no limit: every candidate on the prompt itself).
        timeout: seconds one replica's run may take.
        cache: read and write measurements under cache_dir().
        progress: say what it probes and show a progress bar on stderr.
        networks: each RPC server's network as fit measured it (HOST:PORT -> DevicePlan.server_net): what the
            replicas' messages took there is not compute.
        hidden: the model's hidden size (n_embd), for those messages' bytes.
    Raises:
        ConfigError: when the model has too few layers.
    """

    def __init__(self, model: Union[str, os.PathLike], devices, n_tokens: int, candidates: Sequence[int] = (),
                 variant: str = PROBE.variant, servers: Optional[Sequence[Optional[str]]] = None, reps: int = PROBE.reps,
                 budget: Optional[float] = PROBE.budget, timeout: Optional[float] = PROBE.timeout, cache: bool = True,
                 progress: bool = False, networks: Optional[dict] = None, hidden: int = 0):
        self.n_tokens, self.budget, self.progress = n_tokens, budget, progress
        shared = shares_one_gpu(devices)
        server = lambda spec: spec[len("rpc://"):].split("/")[0] if spec.startswith("rpc://") else None
        self.devices = [_Device(model, spec, idx, variant, reps, timeout, cache, (networks or {}).get(server(spec)),
                                hidden) for idx, spec in probe_devices(devices, servers)]
        self.results = {i: LayerCompute(d.spec, n_tokens, shared=shared) for d in self.devices for i in d.indices}
        self.pending = sorted(set(candidates))
        self.short = min(n_tokens, PROBE.n_tokens)
        self.spent, self.runs, self.started, self.bar = 0.0, 0, False, None

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _say(self, text: str) -> None:
        if self.progress:
            (self.bar.write if self.bar else print)(text, file=sys.stderr)

    def _start(self) -> None:
        """Once, before the first candidate: attention's calibration where prompts are carried, and what the probe is
        about to do (or that the cache answers it)."""
        self.started = True
        todo = [u for u in self.pending if any(d.layer(u, self.n_tokens) is None for d in self.devices)]
        asked = self.pending or [self.short]
        u = min(max(self.short, min(asked)), max(asked))   # (PROBE.n_tokens, within the candidates)
        short = max(u, self.short)
        longer = min(self.n_tokens, CALIBRATION_SPAN * short)
        t0, runs = time.perf_counter(), sum(len(d.data["runs"]) for d in self.devices)
        for d in self.devices:
            if d.calibrated():
                d.load_calibration()
            elif longer > short:
                d.calibrate(u, (short, longer))
        self.spent += time.perf_counter() - t0
        if not todo:
            ran = sum(len(d.data["runs"]) for d in self.devices) > runs
            self._say(f"compute probe: every candidate cached in {self.devices[0].path.parent}"
                      f"{f' (attention calibrated: {self.spent:.0f} s)' if ran else ' (no run)'}")
            return
        est, pending = self.spent, len(self.pending)
        for i, u in enumerate(todo):   # (as compute() will choose, candidate by candidate, the budget shrinking)
            est += self._plan(u, est, pending, measured=i > 0)[1]
            pending -= 1
        self._say(f"probing compute at n_ubatch {todo[0]}..{todo[-1]} on {len(self.devices)} device "
                  f"spec{'s' if len(self.devices) > 1 else ''} ({', '.join(devspec.parse(d.spec).label for d in self.devices)}), "
                  f"~{est:.0f} s{f' (budget {self.budget:g} s)' if self.budget else ''}; "
                  f"cached in {self.devices[0].path.parent}")
        self.bar = tqdm(total=len(self.pending), desc="compute probe", unit="n_ubatch", file=sys.stderr,
                        disable=not self.progress, leave=False)

    def _plan(self, n_ubatch: int, spent: Optional[float] = None, pending: Optional[int] = None,
              measured: Optional[bool] = None) -> tuple[Optional[int], float]:
        """The prompt length to measure n_ubatch at within the budget (None: estimate it), and its cost (seconds),
        with `spent` seconds spent, `pending` candidates left and something `measured` to stand for it (default: as
        they stand)."""
        full = self.n_tokens
        short = min(full, max(n_ubatch, self.short))
        cost = lambda n: max(d.cost(n_ubatch, n) for d in self.devices)
        if self.budget is None or full <= self.short:
            return full, 0.0 if full <= self.short else cost(full)
        left = self.budget - (self.spent if spent is None else spent)
        if cost(full) <= left / max(1, len(self.pending) if pending is None else pending):
            return full, cost(full)
        if measured is None:
            measured = all(d.nearest(n_ubatch, full) is not None for d in self.devices)
        if cost(short) <= left or not measured:
            return short, cost(short)   # (within the budget, or nothing measured yet to stand for it)
        return None, 0.0

    def compute(self, n_ubatch: int) -> dict[int, LayerCompute]:
        """Each device's compute at n_ubatch: from the cache, measured (on the prompt, or on a short one and carried to
        its length) or, past the budget, estimated from the nearest candidate measured.

        Args:
            n_ubatch: a candidate.
        Returns:
            device index -> LayerCompute (-1: every device, for "cuda" without ids and "cpu"), every n_ubatch asked
            so far in it.
        Raises:
            ConfigError: when a replica cannot run on a device.
            WorkerError: when a replica's worker dies or times out.
        """
        if not self.started:
            self._start()
        n, (length, _) = self.n_tokens, self._plan(n_ubatch)
        for d in self.devices:
            got = d.layer(n_ubatch, n)
            if got is None and length is not None:
                t0 = time.perf_counter()
                d.run(n_ubatch, length)
                self.spent += time.perf_counter() - t0
                self.runs += 1
                got = d.layer(n_ubatch, n)
            if got is None:
                got = d.layer(n_ubatch, n, like=d.nearest(n_ubatch, n))
            for i in d.indices:
                r = self.results[i]
                r.layer_s[n_ubatch], r.outside_s[n_ubatch], r.how[n_ubatch] = got
                r.kv_s = d.kv[1] if d.kv else 0.0
        self._done(n_ubatch)
        return self.results

    def optimistic(self, n_ubatch: int, slack: float) -> Optional[dict[int, LayerCompute]]:
        """A bound below each device's compute at n_ubatch, before measuring it: attention's part, and `slack` times
        the cheapest per-token part measured so far; None before the first measurement."""
        out = {}
        for d in self.devices:
            parts = [d.per_token(u, self.n_tokens) for u in {int(k.split(":")[0]) for k in d.data["runs"]}]
            parts = [p for p in parts if p]
            if not parts:
                return None
            a = slack * min(p[0] for p in parts)
            b = d.kv[1] if d.kv else 0.0
            lc = LayerCompute(d.spec, self.n_tokens, {n_ubatch: self.n_tokens * a + b * key_count(self.n_tokens,
                                                                                              n_ubatch)},
                              {n_ubatch: 0.0}, shared=self.results[d.indices[0]].shared)
            out.update({i: lc for i in d.indices})
        return out

    def skip(self, n_ubatch: int) -> None:
        """The planner will not ask for n_ubatch (its budget share goes to the others)."""
        self._done(n_ubatch)

    def _done(self, n_ubatch: int) -> None:
        if n_ubatch in self.pending:
            self.pending.remove(n_ubatch)
            if self.bar is not None:
                self.bar.update(1)

    def close(self) -> None:
        """Stop the replicas' workers and say what the probe took."""
        for d in self.devices:
            d.close()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.runs:
            self._say(f"compute probe: {self.spent:.0f} s, {self.runs} measurement{'s' if self.runs > 1 else ''}; "
                      f"cached in {self.devices[0].path.parent}")


def probe(model: Union[str, os.PathLike], devices, ubatches: Sequence[int], n_tokens: int, reps: int = PROBE.reps,
          timeout: Optional[float] = PROBE.timeout, cache: bool = True, budget: Optional[float] = PROBE.budget,
          variant: str = PROBE.variant, servers: Optional[Sequence[Optional[str]]] = None,
          progress: bool = False) -> dict[int, LayerCompute]:
    """Measure one MoE layer's compute at each n_ubatch on each kind of device the spec names (Probe, for every
    candidate).

    Args:
        model: the GGUF file.
        devices: the device spec (its devices' compute is probed; links and memory limits play no part).
        ubatches: the n_ubatch values.
        n_tokens: the prompt's length.
        reps: timed runs per replica and n_ubatch (the median counts).
        timeout: seconds per replica's run.
        cache: read and write results under cache_dir().
        budget: seconds the probe may spend measuring (None: every candidate on the prompt itself).
        variant: the build that runs the replicas (Probe).
        servers: each device's RPC server, for specs with servers (Probe).
        progress: say what it probes, with a progress bar on stderr.
    Returns:
        device index -> LayerCompute (-1: every device, for "cuda" without ids and "cpu").
    Raises:
        ConfigError: when the model has too few layers, or a replica cannot run on a device.
        WorkerError: when a probe's worker dies or times out.
    """
    with Probe(model, devices, n_tokens, ubatches, variant, servers, reps, budget, timeout, cache, progress) as p:
        for ub in sorted(set(ubatches)):
            p.compute(ub)
        return p.results


__all__ = ["probe", "Probe", "replica", "LayerCompute", "probe_devices", "shares_one_gpu", "key_count"]
