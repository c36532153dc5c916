"""What a layer's compute costs on a device, measured: the probe `fit --ubatch auto` predicts with.

A prompt's ubatch moves every host-expert layer's experts over the device's link and computes every layer the
device holds. Bytes per link are known from the plan; compute is not, and at a large n_ubatch it is what binds.
The probe measures it on the device itself, with the model's own layers: two replicas of the model with the first
`lead + 1` and `lead + 9` layers (lead: the leading dense layers some families have; at most the model's own),
every weight resident on one device, each running the prompt at every candidate n_ubatch. The difference of the two
times is eight MoE layers' compute; what is left of the shorter is the per-prompt cost outside the layers
(embeddings, output). Results are
cached per model file, device and sizes (PYLLAMA_PP_CACHE/compute/).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Optional, Sequence, Union

import gguf

from . import devices as devspec
from .defaults import PROBE, cache_dir as _cache_root
from .errors import ConfigError
from .jobs import MeasureJob
from .model_file import layer_counts
from .params import ContextParams, Placement, ctx_for
from .worker.client import run_job

# MoE layers of the two replicas: their difference is eight layers' compute (fewer where the model has fewer), enough
# to stand above the run-to-run noise of a prompt's time on a GPU
REPLICA_LAYERS = (1, 9)


def cache_dir() -> Path:
    """Where replicas and probe results are kept (PYLLAMA_PP_CACHE or ~/.cache/pyllama_pp, then compute/)."""
    return _cache_root() / "compute"


def _model_key(model: Union[str, os.PathLike]) -> str:
    st = Path(model).stat()
    return hashlib.sha1(f"{Path(model).resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


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
    out = Path(out_dir or cache_dir()) / f"{Path(model).stem}-{_model_key(model)}-L{keep}.gguf"
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


def probe_devices(devices) -> list[tuple[list[int], str]]:
    """The device specs the probe runs on, with the devices each stands for (DeviceSpec.probe_specs): for VDEVs one
    per distinct compute speed (unthrottled, no memory limit: only compute is measured); for CUDA the first device
    (the devices are taken to be alike), or every device together where they are parts of one GPU (shares_one_gpu);
    "cpu" for the CPU.

    Args:
        devices: a device spec.
    Returns:
        [(device indices, device spec), ...].
    """
    return devspec.parse(devices).probe_specs()


@dataclass
class LayerCompute:
    """What the probe measured on one device: seconds one MoE layer takes over a prompt of n_tokens at each n_ubatch,
    and the seconds outside the layers (embeddings, output) per prompt.

    Attributes:
        device: the device spec it ran on.
        n_tokens: the prompt's length.
        layer_s: n_ubatch -> seconds of one MoE layer over the whole prompt.
        outside_s: n_ubatch -> seconds outside the layers over the whole prompt.
        shared: measured on every device of a spec whose devices are parts of one GPU, pipelined together: a layer's
            time is what one more layer adds to the whole pipeline, wherever it is.
    """

    device: str
    n_tokens: int
    layer_s: dict = field(default_factory=dict)
    outside_s: dict = field(default_factory=dict)
    shared: bool = False

    def per_ubatch(self, n_ubatch: int) -> float:
        """Seconds one MoE layer computes one ubatch of n_ubatch tokens (the prompt's mean)."""
        return self.layer_s[n_ubatch] * n_ubatch / self.n_tokens


def _prompt_seconds(model: Path, device: str, ubatches: Sequence[int], n_tokens: int, reps: int,
                    timeout: Optional[float]) -> dict:
    """Median seconds of a prompt of n_tokens at each n_ubatch, every weight resident on the device."""
    n_ctx = ctx_for(n_tokens + 8)
    ctxs = [ContextParams(n_ctx=n_ctx, n_batch=n_tokens, n_ubatch=ub) for ub in ubatches]
    job = MeasureJob(variant="baseline", model=str(model), devices=device, placement=Placement(), ctx=ctxs[0],
                     tests=[["pp", n_tokens]], reps=reps, warmup=1, coverage=False,
                     ctx_list=[{"ctx": c.to_dict(), "tests": [["pp", n_tokens]]} for c in ctxs])
    res = run_job(job, "baseline", timeout=timeout)
    out = {}
    for ub, run in zip(ubatches, res["runs"]):
        if "error" in run:
            raise ConfigError(f"the compute probe could not run n_ubatch {ub} on {device}: {run['error']}")
        out[ub] = median(run["tests"][0]["seconds"])
    return out


def probe(model: Union[str, os.PathLike], devices, ubatches: Sequence[int], n_tokens: int, reps: int = PROBE.reps,
          timeout: Optional[float] = PROBE.timeout, cache: bool = True) -> dict[int, LayerCompute]:
    """Measure one MoE layer's compute at each n_ubatch on each kind of device the spec names.

    Args:
        model: the GGUF file.
        devices: the device spec (its devices' compute is probed; links and memory limits play no part).
        ubatches: the n_ubatch values.
        n_tokens: the prompt's length.
        reps: timed runs per replica and n_ubatch (the median counts).
        timeout: seconds per probe job.
        cache: read and write results under cache_dir().
    Returns:
        device index -> LayerCompute (-1: every device, for "cuda" without ids and "cpu").
    Raises:
        ConfigError: when the model has too few layers, or a replica cannot run on a device.
        WorkerError: when a probe's worker dies or times out.
    """
    out: dict[int, LayerCompute] = {}
    for idx, device in probe_devices(devices):
        key = hashlib.sha1(json.dumps([_model_key(model), device, sorted(ubatches), n_tokens,
                                       os.environ.get("GGML_CUDA_DEVICES", "")]).encode()).hexdigest()[:16]
        path = cache_dir() / f"probe-{key}.json"
        lc = None
        if cache and path.exists():
            d = json.loads(path.read_text())
            lc = LayerCompute(d["device"], d["n_tokens"], {int(k): v for k, v in d["layer_s"].items()},
                              {int(k): v for k, v in d["outside_s"].items()}, d.get("shared", False))
        if lc is None:
            n_lo, n_hi = REPLICA_LAYERS[0], min(REPLICA_LAYERS[1], moe_layers(model))
            lo, hi = (_prompt_seconds(replica(model, n), device, ubatches, n_tokens, reps, timeout)
                      for n in (n_lo, n_hi))
            span = max(n_hi - n_lo, 1)
            layer = {ub: max(hi[ub] - lo[ub], 0.0) / span for ub in ubatches}
            outside = {ub: max(lo[ub] - n_lo * layer[ub], 0.0) for ub in ubatches}
            lc = LayerCompute(device, n_tokens, layer, outside, shared=shares_one_gpu(device))
            if cache:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(asdict(lc)))
        for i in idx:
            out[i] = lc
    return out


def compute_for(probed: dict[int, LayerCompute], device_index: int) -> LayerCompute:
    """The probe result that stands for a device (its own, or the one for every device)."""
    return probed.get(device_index) or probed[-1]


__all__ = ["probe", "replica", "LayerCompute", "probe_devices", "shares_one_gpu"]
