"""`fit`: plan where a model's layers and experts go on a device spec, with the variant's own common/fit.cpp.

The baseline's plan is upstream's (its steps 3 and 4: host experts piled onto the trailing devices, or its refusal
and why); the patched build's patch 0010 spreads the host-expert layers evenly over the devices when pipeline
parallelism can use them (path "spread"), else it takes upstream's steps and says why (path "upstream").

A `Plan` is data: shown as a table, `to_frame()`, saved and loaded as JSON (`save` / `load`), and applied with
`Session(model, plan=plan)`. It names the model (path and size) and the device spec it was made for; applying it to
another model or other devices raises PlanError.

>>> plan = fit("tiny.gguf", devices="vdev:2x24MiB@4GBps", ctx=ContextParams(n_ctx=512, n_ubatch=128))
>>> print(plan)
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from . import devices as devspec
from .errors import ConfigError, DeviceSpecError, ModelError, OutOfMemoryError

FIT_STATUS = {0: "success", 1: "failure", 2: "error"}
GiB = 1024**3
MiB = 1024**2
# upstream's default margin per device (common/common.h fit_params_target); VDEV budgets are exact, so none there
DEFAULT_MARGIN = {"cuda": 1 * GiB, "vdev": 0}
_EXPERT_NAMES = ("ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_exps.weight")
_DENSE_FFN_NAMES = ("ffn_gate_inp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_shexp.weight")


class PlanError(ConfigError):
    """A plan that does not belong to this model or these devices, or a plan file that cannot be read."""


@dataclass
class DevicePlan:
    """One device of a plan: its slice of the layers [first, end), how many of them are full (experts on the device)
    and how many keep their experts (or part of them: partial_layers) in host RAM, and the memory fit expects there.
    A partial layer whose part overflows to the next device counts as full here."""

    name: str
    layers: list[int]                  # [first, end) of the repeating layers
    full_layers: int
    host_expert_layers: int
    model_bytes: int
    context_bytes: int
    compute_bytes: int
    free_bytes: int
    target_bytes: int                  # free - margin: what fit keeps the device within
    partial_layers: int = 0            # layers with only part of their FFN moved (upstream's overflow), among the above

    @property
    def expected_bytes(self) -> int:
        return self.model_bytes + self.context_bytes + self.compute_bytes


@dataclass
class Plan:
    """A fit result for one model on one device spec with one variant."""

    variant: str
    model: str
    model_size: int                    # bytes of the model file: a plan for another file is refused
    devices_spec: dict                 # DeviceSpec.to_dict()
    ctx: dict                          # the ContextParams fit planned for (n_ctx as fit chose it)
    status: str                        # success, failure, error
    path: str                          # "spread" (patch 0010) or "upstream"
    reasons: list[str]
    n_gpu_layers: int
    tensor_split: list[float]
    tensor_overrides: list[str]        # "PATTERN=BUFT"
    n_ctx: int
    n_layer: int
    n_expert: int
    margins: list[int]
    devices: list[DevicePlan]
    host: dict = field(default_factory=dict)   # model / context / compute bytes in host memory
    message: str = ""                  # fit's own reason when it failed
    seconds: float = 0.0
    # the patched scheduler's switches this plan's memory was measured with, applied with it (Session, run/ab):
    # OVERLAP=2's early expert copies (one more expert copy per device in the compute buffers) where they fit,
    # else OVERLAP=0; {} for the baseline. copies: which, and why, in words
    switches: dict = field(default_factory=dict)
    copies: str = ""
    spread_weights: list = field(default_factory=list)   # spread="links" or weights: the patched fit's weights
    # fit_ubatch: the throughput the bytes bound predicts for this plan (prompt t/s), and every n_ubatch it tried
    predicted_ts: Optional[float] = None
    ubatch_auto: list = field(default_factory=list)

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def host_expert_layers(self) -> list[int]:
        return [d.host_expert_layers for d in self.devices]

    def to_dict(self) -> dict:
        d = asdict(self)
        for dev, src in zip(d["devices"], self.devices):
            dev["expected_bytes"] = src.expected_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        try:
            devs = [DevicePlan(**{k: v for k, v in x.items() if k != "expected_bytes"}) for x in d["devices"]]
            return cls(**{**d, "devices": devs})
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a pyllama_pp plan ({e})") from None

    def to_frame(self):
        import pandas as pd
        rows = []
        for d in self.devices:
            rows.append({"device": d.name, "first": d.layers[0], "end": d.layers[1], "full_layers": d.full_layers,
                         "host_expert_layers": d.host_expert_layers, "partial_layers": d.partial_layers,
                         "model_bytes": d.model_bytes,
                         "context_bytes": d.context_bytes, "compute_bytes": d.compute_bytes,
                         "expected_bytes": d.expected_bytes, "free_bytes": d.free_bytes, "target_bytes": d.target_bytes})
        return pd.DataFrame(rows)

    def __str__(self) -> str:
        head = (f"fit ({self.variant}) {Path(self.model).name}: {self.status}, path {self.path}"
                + (f" ({'; '.join(self.reasons)})" if self.reasons else "")
                + f"\n  n_gpu_layers {self.n_gpu_layers}, tensor_split {','.join(f'{x:g}' for x in self.tensor_split)}, "
                  f"n_ctx {self.n_ctx}, {len(self.tensor_overrides)} tensor overrides, {self.seconds:.2f} s")
        lines = [head, f"  {'device':<8} {'layers':>9} {'full':>5} {'host':>5} {'part':>5} {'model':>9} {'context':>9} "
                       f"{'compute':>9} {'expected':>9} {'target':>9}  (MiB)"]
        for d in self.devices:
            lines.append(f"  {d.name:<8} {f'{d.layers[0]}-{d.layers[1]}':>9} {d.full_layers:>5} {d.host_expert_layers:>5} "
                         f"{d.partial_layers:>5} "
                         f"{d.model_bytes / MiB:9.1f} {d.context_bytes / MiB:9.1f} {d.compute_bytes / MiB:9.1f} "
                         f"{d.expected_bytes / MiB:9.1f} {d.target_bytes / MiB:9.1f}")
        if self.copies:
            lines.append(f"  copies: {self.copies}")
        if self.spread_weights:
            lines.append(f"  spread: host-expert layers weighted {', '.join(f'{w:g}' for w in self.spread_weights)}")
        if self.ubatch_auto:
            lines.append("  --ubatch auto: " + "; ".join(
                f"ub{c['n_ubatch']}: " + (f"{c['predicted_ts']:.0f} t/s" if c.get("predicted_ts") else c.get("why", "-"))
                for c in self.ubatch_auto) + f" -> n_ubatch {self.ctx.get('n_ubatch')}, n_batch {self.ctx.get('n_batch')}")
        if self.message:
            lines.append(f"  fit: {self.message}")
        return "\n".join(lines)

    # -- files -----------------------------------------------------------------------------------------------
    def save(self, path: Union[str, os.PathLike]) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"pyllama_pp_plan": 1, **self.to_dict()}, indent=1))
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Plan":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise PlanError(f"cannot read the plan {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not a plan (invalid JSON: {e})") from None
        if not isinstance(d, dict) or d.pop("pyllama_pp_plan", None) != 1:
            raise PlanError(f"{path} is not a pyllama_pp plan (write one with `pyllama-pp fit MODEL --json` "
                            "or Plan.save)")
        return cls.from_dict(d)

    # -- use -------------------------------------------------------------------------------------------------
    def check(self, model: Union[str, os.PathLike], devices=None) -> None:
        """PlanError unless this plan was made for `model` (same file name and size) and `devices` (when given)."""
        p = Path(model)
        try:
            size = p.stat().st_size
        except OSError:
            raise ModelError(f"model file not found: {p}") from None
        if p.name != Path(self.model).name or size != self.model_size:
            raise PlanError(f"this plan was made for another model ({self.model}, {self.model_size} bytes), not {p} "
                            f"({size} bytes): make a new one with `pyllama-pp fit {p} --devices ...`")
        if devices is not None:
            spec = devspec.parse(devices)
            if _spec_key(spec.to_dict()) != _spec_key(self.devices_spec):
                raise PlanError(f"this plan was made for other devices ({self.devices_spec.get('text') or 'another spec'}),"
                                f" not {spec}: make a new one with `pyllama-pp fit {p} --devices {spec}`")

    def placement_dict(self) -> dict:
        """Placement(**...) fields that apply this plan."""
        return {"n_gpu_layers": self.n_gpu_layers, "split_mode": self.ctx.get("split_mode", "layer"),
                "tensor_split": list(self.tensor_split) if any(self.tensor_split) else None,
                "host_experts": "none", "overrides": list(self.tensor_overrides)}

    def ext_params(self) -> dict:
        """The patched scheduler's switches this plan was measured with (none for a baseline plan)."""
        return dict(self.switches) if self.variant == "patched" else {}

    def placement(self):
        from .session import Placement
        return Placement(**self.placement_dict())

    def context_params(self):
        from .session import ContextParams
        c = {k: v for k, v in self.ctx.items() if k in ContextParams.__dataclass_fields__}
        return ContextParams(**{**c, "n_ctx": self.n_ctx})


def _spec_key(d: dict) -> str:
    """A device spec without its text (the same devices written two ways are the same)."""
    return json.dumps({k: v for k, v in d.items() if k not in ("text", "ids")}, sort_keys=True)


def _margins(margin, spec: devspec.DeviceSpec) -> list[int]:
    n = spec.n_devices or 1
    if margin is None:
        return [DEFAULT_MARGIN.get(spec.kind, GiB)] * n
    vals = list(margin) if isinstance(margin, (list, tuple)) else [margin]
    try:
        vals = [devspec.parse_size(v) for v in vals]
    except DeviceSpecError as e:
        raise ConfigError(f"bad margin {margin!r}: {e}") from None
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n and spec.n_devices:   # ("cuda" names no count: the devices fit finds)
        raise ConfigError(f"{len(vals)} margins for {n} devices: give one, or one per device")
    return vals


def _host_layers(overrides: Sequence[str], n_layer: int) -> tuple[set[int], set[int]]:
    """Layers whose expert tensors an override list keeps in host memory (llama.cpp matches with regex_search), and
    the partial ones among all overridden layers: upstream's overflow of part of a layer (its FFN, or its gate and
    down, or down only) to system memory or to the next device, instead of exactly the layer's experts."""
    host, partial = set(), set()
    for ov in overrides:
        pattern, _, buft = ov.rpartition("=")
        rx = re.compile(pattern)
        for i in range(n_layer):
            experts = [bool(rx.search(f"blk.{i}.{n}")) for n in _EXPERT_NAMES]
            if not any(experts):
                continue
            if buft == "CPU":
                host.add(i)
            if buft != "CPU" or not all(experts) or any(rx.search(f"blk.{i}.{n}") for n in _DENSE_FFN_NAMES):
                partial.add(i)
    return host, partial


def _layer_ranges(n_gpu_layers: int, split: list[float], n_layer: int) -> list[list[int]]:
    """[first, end) of the repeating layers per device, as llama-model.cpp assigns them (the output layer counts
    as layer n_layer; layers below n_layer + 1 - n_gpu_layers stay on the CPU)."""
    n_act = n_layer + 1
    ngl = n_act if n_gpu_layers < 0 else min(n_gpu_layers, n_act)
    start = n_act - ngl
    total = sum(split)
    cum, bounds = 0.0, []
    for s in split:
        cum += s
        bounds.append(cum / total if total > 0 else 1.0)
    owner = []
    for il in range(start, n_act):
        x = (il - start) / ngl if ngl else 0.0
        owner.append(next((i for i, b in enumerate(bounds) if x < b), len(split) - 1))   # upper_bound
    out = []
    for dev in range(len(split)):
        mine = [start + j for j, o in enumerate(owner) if o == dev and start + j < n_layer]
        out.append([mine[0], mine[-1] + 1] if mine else [start, start])
    return out


def plan_from_result(res: dict, variant: str, model: str, spec: devspec.DeviceSpec, ctx: dict,
                     margins: list[int]) -> Plan:
    """A Plan from the worker's raw pp_fit result."""
    n_layer, ndev = res["n_layer"], len(res["devices"])
    if len(margins) == 1:   # (a spec such as "cuda" names no device count: one margin for every device)
        margins = margins * ndev
    if len(margins) != ndev:
        raise ConfigError(f"{len(margins)} margins for the {ndev} devices fit found: give one, or one per device")
    records = [r["data"] for r in res.get("report", []) if r.get("type") == "fit_placement"]
    status = FIT_STATUS.get(res["status"], str(res["status"]))
    if records:
        path, reasons = records[-1]["path"], list(records[-1]["reasons"])
    elif variant == "baseline":
        path, reasons = "upstream", ["the baseline build has upstream's fit only"]
    else:
        path = "upstream"
        reasons = ["fit needed no host experts (the model fits on the devices as it is)"] if status == "success" \
            else [res.get("message") or "fit refused"]
    if variant == "baseline" and status != "success":
        reasons.append(res.get("message") or "fit refused")
    split = list(res["tensor_split"])
    if not any(split):
        # fit kept llama's default split: proportional to each device's free memory
        split = [float(d["free_bytes"]) for d in res["devices"]]
    ranges = _layer_ranges(res["n_gpu_layers"], split, n_layer)
    host, partial = _host_layers(res["overrides"], n_layer)
    devs = []
    for i, d in enumerate(res["devices"]):
        first, end = ranges[i]
        n_host = sum(1 for il in range(first, end) if il in host)
        devs.append(DevicePlan(name=d["name"], layers=[first, end], full_layers=(end - first) - n_host,
                               host_expert_layers=n_host, partial_layers=sum(1 for il in range(first, end) if il in partial),
                               model_bytes=d["model_bytes"], context_bytes=d["context_bytes"],
                               compute_bytes=d["compute_bytes"], free_bytes=d["free_bytes"],
                               target_bytes=d["free_bytes"] - margins[i]))
    size = Path(model).stat().st_size
    return Plan(variant=variant, model=str(model), model_size=size,
                devices_spec={**spec.to_dict(), "ids": spec.cuda_ids}, ctx=ctx,
                status=status, path=path, reasons=reasons, n_gpu_layers=res["n_gpu_layers"],
                tensor_split=list(res["tensor_split"])[:ndev], tensor_overrides=list(res["overrides"]),
                n_ctx=res["n_ctx"], n_layer=n_layer, n_expert=res["n_expert"], margins=margins, devices=devs,
                host=res.get("host", {}), message=res.get("message", ""), seconds=res.get("seconds", 0.0))


def check_plan(plan: Plan, check: bool = True) -> Plan:
    """The errors a user can act on (unless check=False): fit found no placement, not even the dense weights fit on
    the devices (whole layers left on the CPU), or the plan's own measurement puts a device over its target."""
    problem = plan_problem(plan, check)
    if problem is not None:
        raise problem
    return plan


def plan_problem(plan: Plan, check: bool = True) -> Optional[Exception]:
    """check_plan's error for this plan, or None."""
    if plan.status != "success" and re.search(r"already set|not implemented|did not provide", plan.message):
        return ConfigError(f"fit ({plan.variant}) refused: {plan.message}")
    if plan.status != "success":
        return OutOfMemoryError(f"fit ({plan.variant}) found no placement for {Path(plan.model).name} on "
                                f"{plan.devices_spec.get('text') or 'these devices'}: {plan.message or plan.reasons}")
    if not check:
        return None
    where = plan.devices_spec.get("text") or "these devices"
    on_cpu = plan.n_layer + 1 - plan.n_gpu_layers if plan.n_gpu_layers >= 0 else 0
    if on_cpu > 0:
        return OutOfMemoryError(
            f"{Path(plan.model).name} does not fit on {where} even with every expert in host RAM: fit ({plan.variant}) "
            f"leaves {on_cpu} of {plan.n_layer + 1} layers on the CPU. Fix: give the devices more memory, or lower the "
            "margin, --ctx or --ubatch (or take the plan as it is: fit(..., check=False), --no-check)")
    over = [d for d in plan.devices if d.expected_bytes > d.target_bytes]
    if over:
        d = over[0]
        return OutOfMemoryError(
            f"fit ({plan.variant}) planned {d.expected_bytes / MiB:.1f} MiB on {d.name}, over its target of "
            f"{d.target_bytes / MiB:.1f} MiB (upstream's steps measure a device before the pipeline's copies exist "
            f"on it; path {plan.path}: {'; '.join(plan.reasons) or '-'}). Fix: give the devices more memory, or lower "
            "the margin, --ctx or --ubatch (or take the plan as it is: fit(..., check=False), --no-check)")
    return None


def run_fit(native, model: str, dev_names: str, split_mode: int, ctx, margins: list[int], n_ctx_min: int = 0) -> dict:
    """pp_fit in this process (devices already set up); the raw result as a dict (used by the worker)."""
    import time
    lib, ffi, s = native.lib, native.ffi, native.str
    keep = [ffi.new("char[]", str(model).encode()), ffi.new("char[]", dev_names.encode())]
    p = ffi.new("pp_fit_params *")
    p.path, p.devices, p.split_mode, p.n_ctx_min = keep[0], keep[1], split_mode, n_ctx_min
    each = margins * 16 if len(margins) == 1 else margins   # (one margin: every device's)
    for i, m in enumerate(each[:16]):
        p.margins[i] = int(m)
    c = ffi.new("pp_context_params *")
    c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max = ctx.n_ctx, ctx.n_batch, ctx.n_ubatch, 1
    c.n_threads = ctx.n_threads if ctx.n_threads > 0 else max(1, os.cpu_count() or 1)
    c.flash_attn, c.op_offload, c.offload_kqv = ctx.flash_attn, int(ctx.op_offload), int(ctx.offload_kqv)
    out = ffi.new("pp_fit_result *")
    t0 = time.perf_counter()
    native.check(lib.pp_fit(p, c, out))
    dt = time.perf_counter() - t0

    def mem(m) -> dict:
        return {"name": s(m.name), "model_bytes": m.model_bytes, "context_bytes": m.context_bytes,
                "compute_bytes": m.compute_bytes, "free_bytes": m.free_bytes, "total_bytes": m.total_bytes}

    try:
        report = json.loads(s(out.report) or "[]")
    except json.JSONDecodeError:
        report = []
    return {"status": out.status, "n_gpu_layers": out.n_gpu_layers, "n_ctx": out.n_ctx, "n_layer": out.n_layer,
            "n_expert": out.n_expert, "tensor_split": [float(out.tensor_split[i]) for i in range(out.n_devices)],
            "devices": [mem(out.devices[i]) for i in range(out.n_devices)], "host": mem(out.host),
            "overrides": [x for x in s(out.overrides).split("\n") if x], "message": s(out.message).strip(),
            "report": report, "seconds": dt}


def _checked_rates(rates: list, spec: devspec.DeviceSpec, what: str, given: bool, n_devices: int = 0) -> list:
    """Each device's host link rate (GB/s), refused where one is 0 (an unthrottled VDEV, or a 0 given) or where there
    are not as many rates as devices (n_devices: 0 when not known yet)."""
    if any(r <= 0 for r in rates):
        raise ConfigError(f"{what} weighs each device by its host link, and " +
                          (f"link_gbps {list(rates)} has a rate of 0: give each device's rate in GB/s, e.g. 55,25"
                           if given else f"{spec} has an unthrottled VDEV link (0): give every device a rate, "
                                         "e.g. vdev:2x8MiB@4GBps"))
    if n_devices and len(rates) != n_devices:
        raise ConfigError(f"{what}: {len(rates)} link rates for {n_devices} devices: give one per device")
    return [float(r) for r in rates]


def spread_weights(spread, spec: devspec.DeviceSpec, link_gbps=None) -> list:
    """The patched fit's share weights (LLAMA_FIT_SPREAD_WEIGHTS): [] for equal shares; "links": each device's host
    link rate (a VDEV's own, split among the devices of a link group; on CUDA the rates given as link_gbps), so that
    every stage streams its host experts in about the same time; or the weights given."""
    if spread in (None, "equal"):
        return []
    if spread == "links":
        if link_gbps is not None:
            rates = [devspec.parse_rate(x) for x in link_gbps]
        elif spec.kind == "vdev":
            groups: dict = {}
            for v in spec.vdevs:
                if v.link_group >= 0:
                    groups[v.link_group] = groups.get(v.link_group, 0) + 1
            rates = [v.link_gbps / groups.get(v.link_group, 1) if v.link_group >= 0 else v.link_gbps for v in spec.vdevs]
        else:
            raise ConfigError("spread='links' on CUDA needs each GPU's host link rate: link_gbps=[55, 25] "
                              "(CLI: --link-gbps 55,25; nvidia-smi shows each link's generation and width)")
        return _checked_rates(rates, spec, "spread='links'", link_gbps is not None, spec.n_devices or 0)
    if isinstance(spread, (list, tuple)):
        try:
            w = [float(x) for x in spread]
        except (TypeError, ValueError):
            w = []
        if w and all(x > 0 for x in w) and (not spec.n_devices or len(w) == spec.n_devices):
            return w
    raise ConfigError(f"spread takes 'equal', 'links' or one positive weight per device, not {spread!r}")


def fit(model: Union[str, os.PathLike], devices="vdev:2x0@0", ctx=None, variant: str = "patched",
        margin=None, split_mode: str = "layer", n_ctx_min: int = 0, check: bool = True,
        env: Optional[dict] = None, timeout: Optional[float] = 600, spread="equal", link_gbps=None) -> Plan:
    """Plan the placement of `model` on `devices` with `variant`'s fit (run in a worker process).

    ctx: ContextParams (n_ctx 0: fit chooses it, down to n_ctx_min); margin: bytes (or "256MiB") to leave free on
    each device, one value or one per device (default: upstream's 1 GiB on CUDA, none on VDEVs, whose budgets are
    exact); spread (patched): "equal" shares of the host-expert layers, "links" (shares by each device's host link
    rate: a VDEV's own, on CUDA link_gbps=[...]) or one weight per device. Raises OutOfMemoryError when fit finds no
    placement, or (unless check=False) leaves whole layers on the CPU or plans a device over its target;
    DeviceSpecError for a spec fit cannot place layers on, ModelError for a bad model, ConfigError for a bad spread."""
    from .session import SPLIT_MODES, ContextParams, check_model_path
    from .worker import run_job
    check_model_path(model)
    spec = devspec.parse(devices)
    if spec.kind == "cpu":
        raise DeviceSpecError("fit places layers on accelerators, and the device spec 'cpu' has none: "
                              "give --devices cuda, cuda:0,1 or vdev:2x768MiB@4GBps")
    if spec.kind == "vdev" and any(v.memory == 0 for v in spec.vdevs):
        raise DeviceSpecError(f"fit needs each device's memory, and {spec} has a VDEV without a memory budget "
                              "(0 = unlimited): give one, e.g. vdev:2x256MiB@4GBps")
    if split_mode not in SPLIT_MODES:
        raise ConfigError(f"split_mode must be one of {sorted(SPLIT_MODES)}, not {split_mode!r}")
    if split_mode == "row" and spec.kind == "vdev":
        raise DeviceSpecError(f"split mode row splits tensors by rows over CUDA devices; the VDEVs of {spec} have no "
                              "split buffers (and upstream's fit does not place layers in that mode): use layer")
    ctx = ctx or ContextParams()
    margins = _margins(margin, spec)
    weights = spread_weights(spread, spec, link_gbps)
    if weights:
        env = {**(env or {}), "LLAMA_FIT_SPREAD_WEIGHTS": ",".join(f"{w:g}" for w in weights)}
    job = {"kind": "fit", "model": str(model), "devices": {**spec.to_dict(), "ids": spec.cuda_ids}, "ctx": ctx.to_dict(),
           "split_mode": split_mode, "margins": margins, "n_ctx_min": n_ctx_min}

    def once(extra: dict) -> Plan:
        res = run_job(job, variant, timeout=timeout, env={**(env or {}), **extra} or None)
        return plan_from_result(res, variant, str(model), spec, {**ctx.to_dict(), "split_mode": split_mode}, margins)

    plan = once({})
    if variant == "patched":
        if plan.devices:   # (one device is pipelined too: patch 0002)
            plan = _plan_copies(plan, once, check, env)
        plan.spread_weights = weights
    return check_plan(plan, check)


DEFAULT_CUDA_LINK_GBPS = 55.0   # a PCIe 5 x16 link's measured host -> device rate (docs/RESULTS.md)
UBATCH_CANDIDATES = (64, 128, 256, 512, 1024, 2048, 4096)


def expert_bytes_per_layer(model: Union[str, os.PathLike]) -> float:
    """Bytes of a MoE layer's expert tensors (gate, up, down), the mean over the layers (gguf-py reads the index)."""
    import gguf

    from .session import EXPERT_TENSORS
    per_layer: dict = {}
    for t in gguf.GGUFReader(str(model)).tensors:
        m = re.fullmatch(rf"blk\.(\d+)\.{EXPERT_TENSORS}\.weight", t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + int(t.n_bytes)
    return sum(per_layer.values()) / len(per_layer) if per_layer else 0.0


def predicted_ts(plan: Plan, expert_bytes: float, link_gbps: Sequence[float], shared_link: bool = False) -> Optional[float]:
    """Prompt tokens/s the bytes bound allows this plan: every host-expert layer moves its experts once per ubatch
    (near-full coverage) over its device's link; pipelined stages (the patched build) overlap, so the slowest sets
    the pace, with the pipeline's fill (n_batch / n_ubatch ubatches through n_devices stages); the baseline's stages
    run one after the other. None when nothing moves (no host experts: compute binds)."""
    secs = [d.host_expert_layers * expert_bytes / (r * 1e9) for d, r in zip(plan.devices, link_gbps)]
    if not any(secs):
        return None
    ub, nb, nd = plan.ctx["n_ubatch"], plan.ctx["n_batch"], len(plan.devices)
    if plan.variant == "patched" and not shared_link:
        n_ub = max(1, nb // ub)
        return ub / max(secs) * n_ub / (n_ub + nd - 1)
    return ub / sum(secs)


def fit_ubatch(model: Union[str, os.PathLike], devices="vdev:2x0@0", ctx=None, variant: str = "patched",
               candidates: Sequence[int] = UBATCH_CANDIDATES, link_gbps=None, shared_link: bool = False,
               **kw) -> Plan:
    """fit with n_ubatch chosen: each candidate (up to n_ctx) is planned with n_batch = 8 x n_ubatch (at most n_ctx,
    at least ctx.n_batch, a multiple of n_ubatch), so that a batch keeps the pipeline full; a candidate whose compute buffers leave no
    placement is out; of the rest the plan with the highest predicted_ts wins (ties: the larger n_ubatch). The plan
    carries every candidate's prediction (Plan.ubatch_auto). link_gbps: each device's host link rate (default: a
    VDEV's own; CUDA 55 GB/s, a PCIe 5 x16 link); shared_link: the devices share one link (one GPU split in two)."""
    from .session import ContextParams
    ctx = ctx or ContextParams()
    spec = devspec.parse(devices)
    n_ctx = ctx.n_ctx or 4096
    expert_bytes = expert_bytes_per_layer(model)
    tried, best, best_score, rates = [], None, 0.0, None
    kw.pop("check", None)   # (a candidate that leaves layers on the CPU or a device over its target is out)
    for ub in [c for c in candidates if c <= n_ctx]:
        nb = min(n_ctx, max(ctx.n_batch, 8 * ub)) // ub * ub
        c = ContextParams(**{**ctx.to_dict(), "n_ctx": n_ctx, "n_batch": nb, "n_ubatch": ub})
        row = {"n_ubatch": ub, "n_batch": nb}
        try:
            plan = fit(model, devices=devices, ctx=c, variant=variant, link_gbps=link_gbps, check=True, **kw)
        except OutOfMemoryError as e:
            m = re.search(r"leaves \d+ of \d+ layers on the CPU|over its target", str(e))
            tried.append({**row, "why": f"no placement ({m.group(0) if m else str(e).split('. Fix:')[0][-80:]})"})
            continue
        if rates is None:   # (the devices' links: known from the spec, or once the first plan counts the GPUs)
            rates = _checked_rates([devspec.parse_rate(x) for x in link_gbps] if link_gbps is not None else
                                   [v.link_gbps for v in spec.vdevs] if spec.kind == "vdev" else
                                   [DEFAULT_CUDA_LINK_GBPS] * len(plan.devices),
                                   spec, "--ubatch auto", link_gbps is not None, len(plan.devices))
        plan.predicted_ts = predicted_ts(plan, expert_bytes, rates, shared_link)
        tried.append({**row, "host_expert_layers": plan.host_expert_layers, "predicted_ts": plan.predicted_ts,
                      "why": "" if plan.predicted_ts else "no host experts: compute binds"})
        score = plan.predicted_ts or float("inf")   # (no host experts: compute binds, the bound does not)
        if best is None or score >= best_score:
            best, best_score = plan, score
    if best is None:
        raise OutOfMemoryError(f"--ubatch auto: no n_ubatch of {list(candidates)} up to n_ctx {n_ctx} has a placement "
                               f"for {Path(model).name} on {spec}: " + "; ".join(t["why"] for t in tried))
    best.ubatch_auto = tried
    return best


OVERLAP_VAR = "GGML_SCHED_PP_OVERLAP"


def _plan_copies(plan: Plan, once, check: bool, env: Optional[dict]) -> Plan:
    """The patched build's dry runs measure the compute buffers with the switches in force: by default with
    OVERLAP=2's early expert copies (one more expert copy per device). Where that plan has no room (fit fails,
    leaves layers on the CPU, or a device over its target), plan again without them (OVERLAP=0), and say so. A
    value the user set (env / environment) is kept as it is."""
    forced = (env or {}).get(OVERLAP_VAR, os.environ.get(OVERLAP_VAR))
    if forced is not None:
        plan.switches = {"OVERLAP": int(forced)}
        plan.copies = f"OVERLAP={int(forced)} as set by {OVERLAP_VAR}"
        return plan
    problem = plan_problem(plan, check)
    compute = "/".join(f"{d.compute_bytes / MiB:.1f}" for d in plan.devices)
    plan.switches = {"OVERLAP": 2}
    plan.copies = (f"OVERLAP=2 (default): early expert copies planned, one more expert copy in each device's "
                   f"compute buffer (compute {compute} MiB)")
    if problem is None and (plan.path == "spread" or len(plan.devices) == 1):   # (one device: no spread to lose)
        return plan
    # no placement with the copies, or no spread (upstream's path: often a device without room for its share of
    # the dense-only layers beside the copies): try without them; a spread plan without copies beats one without
    # pipelining-friendly placement, and any plan beats none
    alt = once({OVERLAP_VAR: "0"})
    alt_problem = plan_problem(alt, check)
    if alt_problem is not None or (problem is None and alt.path != "spread"):
        return plan     # no better without the copies (the same path, or no placement either way)
    why = str(problem).split(". Fix:")[0] if problem is not None else f"path {plan.path}: {'; '.join(plan.reasons)}"
    alt.switches = {"OVERLAP": 0}
    alt.copies = (f"OVERLAP=0: no room for OVERLAP=2's early expert copies (with them, compute {compute} MiB and "
                  f"{why}); planned without them")
    alt.seconds += plan.seconds
    return alt


def do_fit_job(job) -> dict:
    """The worker's "fit" job (jobs.FitJob): set up the devices, run pp_fit, return the raw result."""
    from . import binding
    from .session import SPLIT_MODES, register_devices
    native = binding.load(job.variant)
    spec = devspec.parse(job.devices)
    names = register_devices(native, spec)
    if names == "none":
        raise DeviceSpecError("fit needs accelerator devices")
    return run_fit(native, job.model, names, SPLIT_MODES[job.split_mode], job.ctx, list(job.margins),
                   int(job.n_ctx_min))


__all__ = ["fit", "fit_ubatch", "Plan", "DevicePlan", "PlanError", "spread_weights", "predicted_ts"]
