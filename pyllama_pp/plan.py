"""A fit plan as data: which layers each device holds, which keep their experts in host RAM, and the memory fit
expects there (`Plan`, `DevicePlan`), made from a worker's raw fit result (`plan_from_result`).

A `Plan` is shown as a table, `to_frame()`, saved and loaded as JSON (`save` / `load`), and applied with
`Session(model, plan=plan)` or `pyllama-pp run/ab --plan`. It names the model (file name and size) and the device
spec it was made for; applying it to another model or other devices raises PlanError.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from . import devices as devspec
from .defaults import CONTEXT
from .errors import ConfigError, ModelError, OutOfMemoryError
from .params import ContextParams, Placement

FIT_STATUS = {0: "success", 1: "failure", 2: "error"}
GiB = 1024**3
MiB = 1024**2
from .switches import EXPERT_CACHE as CACHE_SWITCH
from .switches import EXPERT_CACHE_MIN_HIT as CACHE_MIN_HIT_SWITCH
from .switches import EXPERT_HYBRID as HYBRID_SWITCH
from .switches import EXPERT_REFILL as REFILL_SWITCH
from .switches import ExpertCache, per_device
_EXPERT_NAMES = ("ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_exps.weight")
_DENSE_FFN_NAMES = ("ffn_gate_inp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_shexp.weight")

class PlanError(ConfigError):
    """A plan that does not belong to this model or these devices, or a plan file that cannot be read."""


@dataclass
class DevicePlan:
    """One device of a plan: its slice of the layers, how many keep their experts in host RAM, and the memory fit
    expects there. A partial layer whose part overflows to the next device counts as full here.

    Attributes:
        name: the device's name (VDEV0, CUDA0, ...).
        layers: [first, end) of the repeating layers on this device.
        full_layers: layers whose experts are on the device.
        host_expert_layers: layers whose experts (or part of them) stay in host RAM.
        model_bytes: weights fit expects on the device.
        context_bytes: KV cache bytes fit expects there.
        compute_bytes: compute buffer bytes fit expects there.
        free_bytes: the device's free memory when fit ran.
        target_bytes: free_bytes less the margin: what fit keeps the device within.
        partial_layers: layers with only part of their FFN moved (upstream's overflow), among the above.
        output_layer: the device also holds the output layer (llama counts it as layer n_layer).
        server: for an RPC device, its server's HOST:PORT (None: a device of this machine).
        server_host_free: for a device of a patched RPC server, the host memory that server could still give host
            weights when fit ran (None: another device, or a server that keeps none).
        server_net: for an RPC device, the network to its server as fit measured it: {"up_gbps", "down_gbps",
            "rtt_s"} (each way's rate, a message's round trip; None: a device of this machine, or not measured).
        link: the device's host link as fit measured it: {"pinned_gbps", "pageable_gbps", "copy_bytes"} (copies of
            one expert tensor from pinned and from pageable host memory; None: not measured, or a device on an RPC
            server).
        cache_bytes: device memory of its expert cache's slots (EXPERT_CACHE; in its margin; 0: none).
        cache_slots: the slots each of its host-expert layers gets in that cache.
    """

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
    output_layer: bool = False         # the device also holds the output layer (llama counts it as layer n_layer)
    server: Optional[str] = None             # an RPC device's server, HOST:PORT
    server_host_free: Optional[int] = None   # a patched RPC server's free host memory for host weights
    server_net: Optional[dict] = None        # the network to an RPC device's server: rates and round trip
    link: Optional[dict] = None              # the host link as measured: pinned and pageable rates
    cache_bytes: int = 0                     # the expert cache's slots on the device (in its margin)
    cache_slots: int = 0                     # ... a host-expert layer's slots there

    @property
    def expected_bytes(self) -> int:
        """int: model_bytes + context_bytes + compute_bytes, what fit expects the device to hold."""
        return self.model_bytes + self.context_bytes + self.compute_bytes

    @property
    def n_layers(self) -> int:
        """How many repeating layers the device holds."""
        return self.layers[1] - self.layers[0]

    @property
    def layers_text(self) -> str:
        """The device's layers as a user reads them: first..last, inclusive ("0..2", "3..5 +out", "-")."""
        text = f"{self.layers[0]}..{self.layers[1] - 1}" if self.n_layers > 0 else ("out" if self.output_layer else "-")
        return text + (" +out" if self.output_layer and self.n_layers > 0 else "")


@dataclass
class Plan:
    """A fit result for one model on one device spec with one variant (made by `fit`, or `Plan.load`).

    Attributes:
        variant: the build whose fit made it, "patched" or "baseline".
        model: the GGUF file's path.
        model_size: the file's size in bytes: a plan for another file is refused.
        devices_spec: the device spec it was made for (DeviceSpec.to_dict()).
        ctx: the ContextParams fit planned for, as a dict (n_ctx as fit chose it; plus split_mode).
        status: "success", "failure" or "error".
        path: "spread" (the series' fit) or "upstream".
        reasons: why fit took that path, in words.
        n_gpu_layers: layers on the devices.
        tensor_split: layer proportions per device (all 0: llama's default).
        tensor_overrides: "PATTERN=BUFT" each (llama's -ot): the host experts and overflows.
        n_ctx: the context size fit chose.
        n_layer: the model's repeating layers.
        n_expert: experts per MoE layer.
        margins: bytes left free per device.
        devices: one DevicePlan per device.
        host: model / context / compute bytes in host memory.
        message: fit's own reason when it failed.
        seconds: how long fit took.
        switches: the patched scheduler's switches this plan's memory was measured with, applied with it ({} for
            the baseline).
        copies: which early expert copies were planned, and why, in words.
        spread_weights: the patched fit's share weights (spread="links" or given weights; [] for equal shares).
        predicted_ts: fit_ubatch: the prompt t/s predicted for the plan's (n_batch, n_ubatch) (None: not predicted:
            nothing moves and compute was not counted).
        ubatch_auto: fit_ubatch: every candidate n_ubatch with the n_batch it takes, its prediction, or why it is out
            and the fix.
        host_copy_gbps: the host's copy from pageable into pinned memory as the patched build's staging runs it, as
            measured (GB/s; None: not measured): what an mmap-ed model's host experts go through first.
        expert_cache: the device expert cache asked for ("auto", a size such as "512MiB", slots such as "16slots",
            or one of those per device, "16slots,32slots"; "": none): its switch is in `switches` (one value, or a
            list of one per device, "-16,-32"), each device's share in DevicePlan.cache_bytes / cache_slots
            (pyllama_pp.expert_cache_plan).
        layer_major: with LAYER_MAJOR (patched; {} without it): "switch" (its value), "group" (ubatches per group at
            the plan's n_batch and n_ubatch; 1: none form), "bytes" (each device's compute buffer bytes the group
            keeps, in compute_bytes: its ubatches' activations and whole expert copies; where measured) and
            "without" (the placement fit makes without the switch, where it differs).
        cpu_expert_gbps: the host CPU's decode expert op as measured, {threads: GB/s of the experts it reads} ({}: not
            measured; fit measures it where it plans the expert cache).
        cache_guard: where the expert cache is planned: the hit rate above which a layer's cached path costs less
            than the CPU path, per device and link ("pinned", "pageable"), the guard's switch value for each load mode
            ("min_hit": {"none": P, "mmap": P}), the rates it came from, and why (expert_cache_plan.guard).
        memory_plan: where fit weighed the cache against resident expert layers (expert cache "auto",
            pyllama_pp.memory_plan): the workload, the hit-rate curve and the decode costs it priced with, every
            alternative with its prediction, the one chosen and why ({}: not weighed).
        ubatch_measured: fit_ubatch: the pairs predicted closest to the best, each run as planned (n_ubatch,
            n_batch, layer_major, predicted_ts, measured_ts): the fastest measured is the plan's ([]: none measured).
    """

    variant: str
    model: str
    model_size: int                    # bytes of the model file: a plan for another file is refused
    devices_spec: dict                 # DeviceSpec.to_dict()
    ctx: dict                          # the ContextParams fit planned for (n_ctx as fit chose it)
    status: str                        # success, failure, error
    path: str                          # "spread" (the series' fit) or "upstream"
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
    # fit_ubatch: the throughput predicted for this plan's pair (prompt t/s), and every candidate it tried
    predicted_ts: Optional[float] = None
    ubatch_auto: list = field(default_factory=list)
    host_copy_gbps: Optional[float] = None
    expert_cache: str = ""             # the device expert cache asked for ("auto", "512MiB"; "": none)
    layer_major: dict = field(default_factory=dict)
    cpu_expert_gbps: dict = field(default_factory=dict)   # the host CPU's decode expert op, {threads: GB/s}
    cache_guard: dict = field(default_factory=dict)       # the cache's break-even hit rates (expert_cache_plan.guard)
    memory_plan: dict = field(default_factory=dict)       # the cache weighed against resident layers (memory_plan)
    ubatch_measured: list = field(default_factory=list)   # fit_ubatch: the closest pairs, measured

    # -- views -----------------------------------------------------------------------------------------------
    @property
    def host_expert_layers(self) -> list[int]:
        """list[int]: per device, the layers whose experts stay in host RAM."""
        return [d.host_expert_layers for d in self.devices]

    @property
    def idle_devices(self) -> list[str]:
        """Devices given no repeating layer (at most the output layer): they add nothing to a pipeline."""
        return [d.name for d in self.devices if d.n_layers == 0]

    @property
    def notes(self) -> list[str]:
        """What a user should know about this plan beyond its table: a device left idle, and why."""
        idle = self.idle_devices
        if not idle or not self.devices:
            return []
        why = ("upstream's fit needed no host experts and kept llama's default split (layers in proportion to each "
               "device's free memory), which gave it none" if self.path == "upstream" and not any(self.tensor_split)
               else f"fit ({self.path}) gave it none")
        even = ",".join("1" for _ in self.devices)
        return [f"{', '.join(idle)} hold{'s' if len(idle) == 1 else ''} no repeating layer: {why}. To use "
                f"{'it' if len(idle) == 1 else 'them'}: run with -ts {even} (layers evenly), or plan with less "
                "memory per device (fit then spreads host-expert layers over every device)"]

    @property
    def cache_text(self) -> str:
        """The device expert cache in words: its switch and each device's share ("" where none was asked)."""
        if not self.expert_cache:
            return ""
        switch = self.switches.get(CACHE_SWITCH, 0)
        if not switch:
            room = "/".join(f"{(d.target_bytes - d.expected_bytes) / MiB:.2f}" for d in self.devices)
            return (f"expert cache ({self.expert_cache}): none, no device with host-expert layers has room for the "
                    f"slots a token needs (free after the plan: {room} MiB)")
        form = ExpertCache.of_switch(switch).text
        asked = f" (asked: {self.expert_cache})" if self.expert_cache != form else ""
        values = "one value per device" if isinstance(switch, str) else "one value for every device"
        per = "; ".join(f"{d.name} {d.cache_bytes / MiB:.2f} MiB, {d.cache_slots} slots in each of its "
                        f"{d.host_expert_layers} host-expert layer{'s' if d.host_expert_layers > 1 else ''}"
                        for d in self.devices if d.host_expert_layers)
        where = (f"{per}; kept free on each device beside its layers (fit's target lowered by as much)" if per else
                 "no device has host-expert layers (every expert is on its device): nothing to cache")
        return (f"expert cache {form}{asked} ({CACHE_SWITCH}, {values}): {where}" + self._hybrid_text()
                + self._guard_text())

    def _hybrid_text(self) -> str:
        hybrid = self.switches.get(HYBRID_SWITCH)
        if not hybrid:
            return ""
        if self.switches.get(REFILL_SWITCH):
            return (f"; a decoded token's misses all on the host CPU, {self.switches[REFILL_SWITCH]} of them into the "
                    f"slots after it ({HYBRID_SWITCH}={hybrid} {REFILL_SWITCH}={self.switches[REFILL_SWITCH]})")
        if not isinstance(hybrid, str):
            return (f"; a token's misses split between the link and the host CPU ({HYBRID_SWITCH}={hybrid}: the CPU's "
                    f"expert rate {hybrid}% of the link's)")
        each = per_device(hybrid, len(self.devices))
        split = "; ".join(f"{d.name} {n}% of its link's" if n else f"{d.name} none (every miss over its link)"
                          for d, n in zip(self.devices, each) if d.host_expert_layers)
        return (f"; a token's misses split between the link and the host CPU, each device its own ({HYBRID_SWITCH}="
                f"{hybrid}: the CPU's expert rate {split})")

    @property
    def layer_major_text(self) -> str:
        """LAYER_MAJOR in words: on, with its group size and bytes a device, or off and why ("" where not planned)."""
        return _layer_major_text(self) if self.layer_major else ""

    def _guard_text(self) -> str:
        g = self.cache_guard
        if not g:
            return ""
        pinned, mmap = g["min_hit"]["none"], g["min_hit"]["mmap"]
        rates = ("a token's cost per layer on each path as the decode probe measured it, the links as fit measured "
                 "them" if g.get("from") == "decode probe" else
                 f"the host CPU's expert op {g['cpu_gbps']:.3g} GB/s, the devices' own read "
                 f"{'/'.join(f'{r:.3g}' for r in g['dev_gbps'])} GB/s, their links as measured")
        if isinstance(pinned, str) or isinstance(mmap, str):   # (each device its own bar)
            n = len(self.devices)
            bars = "; ".join(f"{d.name} {p}%" + (f" (mmap {m}%)" if m != p else "")
                             + (": the cache does not pay there, its layers go to the CPU path once their first tokens "
                                "are seen" if p >= 100 else "")
                             for d, p, m in zip(self.devices, per_device(pinned, n), per_device(mmap, n))
                             if d.cache_slots)
            return (f"\n  guard {CACHE_MIN_HIT_SWITCH}={pinned} (mmap: {mmap}), each device its own: below its bar a "
                    f"layer's cached path costs more than the CPU path ({rates}): {bars}")
        if pinned >= 100:
            return (f"\n  guard {CACHE_MIN_HIT_SWITCH}=100: the cache does not pay on these devices ({rates}): each "
                    "layer goes back to the CPU path once its first tokens are seen")
        shadow = (" (the hits of a shadow LRU that takes every miss, which the guard counts: the refill's own are "
                  "fewer)" if self.switches.get(REFILL_SWITCH) else "")
        return (f"\n  guard {CACHE_MIN_HIT_SWITCH}={pinned} (mmap: {mmap}): below that many hits{shadow} a layer's "
                f"cached path costs more than the CPU path ({rates})")

    def to_dict(self) -> dict:
        """The plan as JSON-ready data; Plan.from_dict makes it again.

        Returns:
            dict: the fields, each device with its expected_bytes too.
        """
        d = asdict(self)
        for dev, src in zip(d["devices"], self.devices):
            dev["expected_bytes"] = src.expected_bytes
            if not self.expert_cache:   # (a plan without the cache reads as one made before it existed)
                del dev["cache_bytes"], dev["cache_slots"]
        if not self.expert_cache:
            del d["expert_cache"]
        if not self.layer_major:   # (without LAYER_MAJOR a plan is the one made without the switch)
            del d["layer_major"]
        for key in ("cpu_expert_gbps", "cache_guard", "memory_plan", "ubatch_measured"):   # (not measured: the plan reads as one made before them)
            if not d[key]:
                del d[key]
        return d

    def take_rates(self, first: "Plan") -> None:
        """Keep the rates the first dry run's process measured (the staging copy, the CPU's expert op, the links) in a
        plan placed again without measuring them, and count that run's seconds.

        Args:
            first: the plan of the dry run that measured them.
        """
        self.host_copy_gbps, self.cpu_expert_gbps = first.host_copy_gbps, first.cpu_expert_gbps
        for a, d in zip(self.devices, first.devices):
            a.link = d.link
        self.seconds += first.seconds

    def run_switches(self, load_mode: str = CONTEXT.load_mode) -> dict:
        """The switches a run with this plan applies.

        Args:
            load_mode: how the run keeps host weights ("none": pinned, "mmap": pageable).
        Returns:
            dict: the plan's switches, with the expert cache's guard at its break-even for the link a miss takes in
            that load mode (pageable for "mmap").
        """
        min_hit = self.cache_guard.get("min_hit", {}).get(load_mode) if self.switches.get(CACHE_SWITCH) else None
        return {**self.switches, CACHE_MIN_HIT_SWITCH: min_hit} if min_hit is not None else dict(self.switches)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A Plan from to_dict()'s form.

        Args:
            d: the dict (expected_bytes of the devices is left out: it is computed).
        Returns:
            Plan: the plan.
        Raises:
            PlanError: for a dict that lacks a field or has an unknown one.
        """
        try:
            devs = [DevicePlan(**{k: v for k, v in x.items() if k != "expected_bytes"}) for x in d["devices"]]
            return cls(**{**d, "devices": devs})
        except (KeyError, TypeError) as e:
            raise PlanError(f"not a pyllama_pp plan ({e})") from None

    def to_frame(self):
        """The plan as a table.

        Returns:
            pandas.DataFrame: one row per device: its layers, full / host-expert / partial layers, and bytes.
        """
        import pandas as pd   # (here, not at the top: worker processes import this module and never need pandas)
        rows = []
        for d in self.devices:
            rows.append({"device": d.name, "first": d.layers[0], "end": d.layers[1], "full_layers": d.full_layers,
                         "host_expert_layers": d.host_expert_layers, "partial_layers": d.partial_layers,
                         "model_bytes": d.model_bytes,
                         "context_bytes": d.context_bytes, "compute_bytes": d.compute_bytes,
                         "expected_bytes": d.expected_bytes, "free_bytes": d.free_bytes, "target_bytes": d.target_bytes,
                         **({"cache_bytes": d.cache_bytes, "cache_slots": d.cache_slots} if self.expert_cache else {})})
        return pd.DataFrame(rows)

    def __str__(self) -> str:
        head = (f"fit ({self.variant}) {Path(self.model).name}: {self.status}, path {self.path}"
                + (f" ({'; '.join(self.reasons)})" if self.reasons else "")
                + f"\n  n_gpu_layers {self.n_gpu_layers}, tensor_split {','.join(f'{x:g}' for x in self.tensor_split)}, "
                  f"n_ctx {self.n_ctx}, {len(self.tensor_overrides)} tensor overrides, {self.seconds:.2f} s")
        lines = [head, f"  {'device':<8} {'layers':>11} {'full':>5} {'host':>5} {'part':>5} {'model':>9} {'context':>9} "
                       f"{'compute':>9} {'expected':>9} {'target':>9}  (MiB; layers first..last of {self.n_layer}, "
                       "+out: the output layer)"]
        for d in self.devices:
            lines.append(f"  {d.name:<8} {d.layers_text:>11} {d.full_layers:>5} {d.host_expert_layers:>5} "
                         f"{d.partial_layers:>5} "
                         f"{d.model_bytes / MiB:9.1f} {d.context_bytes / MiB:9.1f} {d.compute_bytes / MiB:9.1f} "
                         f"{d.expected_bytes / MiB:9.1f} {d.target_bytes / MiB:9.1f}")
        if self.copies:
            lines.append(f"  copies: {self.copies}")
        if self.layer_major:
            lines.append(f"  layer major: {self.layer_major_text}")
        nets = {d.server: d.server_net for d in self.devices if d.server and d.server_net}
        if nets:
            lines.append("  network (measured): " + "; ".join(
                f"{k} up {n.get('up_gbps', 0):.3g} / down {n.get('down_gbps', 0):.3g} GB/s, round trip "
                f"{n.get('rtt_s', 0) * 1e3:.2f} ms"
                for k, n in nets.items()))
        links = [(d.name, d.link) for d in self.devices if d.link]
        if links or self.host_copy_gbps:
            lines.append("  links (measured, host -> device): " + "; ".join(
                f"{name} {x['pinned_gbps']:.3g} GB/s pinned, {x['pageable_gbps']:.3g} pageable" for name, x in links)
                + (f"; host staging copy {self.host_copy_gbps:.3g} GB/s" if self.host_copy_gbps else ""))
        if self.expert_cache:
            lines.append(f"  {self.cache_text}")
        if self.memory_plan:
            lines += _memory_plan_lines(self.memory_plan)
        if self.spread_weights:
            lines.append(f"  spread: host-expert layers weighted {', '.join(f'{w:g}' for w in self.spread_weights)}")
        w = self.layer_major.get("weighed") or {}   # (the prompts' slower side taken for the workload: not "fastest")
        slower = bool(w) and w[w["chosen"]]["prompt_s"] > w["off" if w["chosen"] == "on" else "on"]["prompt_s"]
        if self.ubatch_auto:
            ts = f" predicted {self.predicted_ts:.0f} t/s," if self.predicted_ts else ""   # (None: layers moved)
            how = (ts + " taken for the workload (layer major, above)" if slower else
                   ts + " measured fastest (below)" if self.ubatch_measured else
                   f" predicted fastest ({self.predicted_ts:.0f} t/s)" if self.predicted_ts else "")
            lines.append(f"  --ubatch auto: n_batch {self.ctx.get('n_batch')}, n_ubatch {self.ctx.get('n_ubatch')}"
                         f"{how}; each candidate:")
            lines += ["    " + line for line in grouped_rows(self.ubatch_auto)]
        if self.ubatch_measured:
            lines.append("  --ubatch auto ran the closest predictions as planned and took "
                         + ("the pair the workload's weighing chose (layer major, above):" if slower else
                            "the fastest measured:"))
            mine = (self.ctx.get("n_ubatch"), self.ctx.get("n_batch"), int(bool(self.layer_major.get("switch"))))
            lines += [f"    {'*' if (r['n_ubatch'], r['n_batch'], r['layer_major']) == mine else ' '} n_ubatch "
                      f"{r['n_ubatch']}, n_batch {r['n_batch']}, LAYER_MAJOR={r['layer_major']}: measured "
                      f"{r['measured_ts']:.0f} t/s (predicted {r['predicted_ts']:.0f})" for r in self.ubatch_measured]
        if self.message:
            lines.append(f"  fit: {self.message}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    # -- files -----------------------------------------------------------------------------------------------
    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the plan as JSON (Plan.load, `pyllama-pp run/ab --plan` read it).

        Args:
            path: the file to write.
        Returns:
            Path: the file written.
        Raises:
            OSError: when the file cannot be written.
        """
        path = Path(path)
        path.write_text(json.dumps({"pyllama_pp_plan": 1, **self.to_dict()}, indent=1))
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Plan":
        """Read a plan that Plan.save (or `pyllama-pp fit --json`) wrote.

        Args:
            path: the plan file.
        Returns:
            Plan: the plan.
        Raises:
            PlanError: for a file that cannot be read, is not JSON, or is not a pyllama_pp plan.
        """
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise PlanError(f"cannot read the plan {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"{path} is not a plan (invalid JSON: {e})") from None
        except UnicodeDecodeError:
            raise PlanError(f"{path} is not a plan (a binary file, not JSON text): give the file that `pyllama-pp fit "
                            "MODEL --devices ... -o PLAN.json` wrote") from None
        if not isinstance(d, dict) or d.pop("pyllama_pp_plan", None) != 1:
            raise PlanError(f"{path} is not a pyllama_pp plan (write one with `pyllama-pp fit MODEL --json` "
                            "or Plan.save)")
        return cls.from_dict(d)

    # -- use -------------------------------------------------------------------------------------------------
    def check(self, model: Union[str, os.PathLike], devices=None) -> None:
        """Check that this plan was made for `model` (same file name and size) and `devices`.

        Args:
            model: the GGUF file the plan is to be applied to.
            devices: a device spec (any form parse_devices takes); None: not checked.
        Raises:
            ModelError: when the model file does not exist.
            PlanError: for another model, or other devices.
            DeviceSpecError: for a device spec that does not parse.
        """
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

    def placement(self, load_mode: str = CONTEXT.load_mode, source: str = "plan") -> Placement:
        """The Placement that applies this plan: its layers, split and tensor overrides.

        Args:
            load_mode: "none" (default) or "mmap".
            source: how the rows name it: "plan" (default) or "fit".
        Returns:
            Placement: the placement.
        Raises:
            ConfigError: for a load_mode or source out of range.
        """
        return Placement(n_gpu_layers=self.n_gpu_layers, split_mode=self.ctx.get("split_mode", CONTEXT.split_mode),
                         tensor_split=tuple(self.tensor_split) if any(self.tensor_split) else None,
                         overrides=tuple(self.tensor_overrides), load_mode=load_mode, source=source)

    def context_params(self) -> ContextParams:
        """The context fit planned for.

        Returns:
            ContextParams: the plan's context, with the n_ctx fit chose.
        Raises:
            ConfigError: for a plan whose context values are out of range.
        """
        c = {k: v for k, v in self.ctx.items() if k in ContextParams.__dataclass_fields__}
        return ContextParams(**{**c, "n_ctx": self.n_ctx})


def _layer_major_text(plan: Plan) -> str:
    """Plan.layer_major in words: the group size and what it keeps on each device."""
    lm, nb, ub = plan.layer_major, plan.ctx.get("n_batch"), plan.ctx.get("n_ubatch")
    if not lm["switch"]:
        return f"LAYER_MAJOR {lm.get('why', 'off')}"
    head = f"LAYER_MAJOR={lm['switch']}" + (f" ({lm['why']})" if lm.get("why") else "") + ": "
    if lm["group"] < 2:
        return head + (f"no groups (n_batch {nb} holds one ubatch of {ub})" if any(plan.host_expert_layers)
                       else "no groups (no host experts to upload)")
    text = head + f"groups of {lm['group']} ubatches (n_batch {nb} / n_ubatch {ub}), one expert upload a group"
    if lm.get("bytes") is not None:
        text += (f"; {'/'.join(f'{b / MiB:.2f}' for b in lm['bytes'])} MiB a device of the compute buffers (the "
                 "group's activations and whole expert copies)")
    if lm.get("without"):
        text += (f"; without the switch fit keeps host-expert layers {lm['without']['host_expert_layers']} "
                 f"(here {plan.host_expert_layers})")
    return text


def _memory_plan_lines(m: dict) -> list[str]:
    """The memory planner's alternatives and choice, as the plan prints them."""
    w = m["workload"]
    steps = ", ".join(f"{k}{n}" for k, n in w["steps"])
    if not m.get("alternatives"):
        return [f"  memory: weighed for the workload {w['name']} ({steps}): {m['why']}"]
    lines = [f"  memory: weighed for the workload {w['name']} ({steps}), load mode {m['load_mode']}; hit rates: "
             f"{m['curve']['source']}; chose {m['why']}"]
    if m.get("hybrid_note"):
        lines.append(f"    {m['hybrid_note']}")
    lines += [f"    {'*' if i == m['chosen'] else ' '} {alternative_line(a)}" for i, a in enumerate(m["alternatives"])]
    return lines


def alternative_line(a: dict) -> str:
    """One of the memory planner's alternatives in a line: what it keeps where, the path its host-expert layers take
    with the switches it sets, and its prediction.

    Args:
        a: memory_plan.Alternative's dict (as the plan's JSON holds it).
    Returns:
        The line.
    """
    slots = "/".join(map(str, a.get("device_slots") or [])) or a["slots"]
    cache = (f"{slots} slots a layer ({sum(a['cache_bytes']) / MiB:.0f} MiB, hits {a['hit']:.0%})"
             if a["slots"] else "no slots")
    paths = [p for p in a.get("paths", []) if p]
    how = ", ".join(x for x in (f"host layers on the {'/'.join(paths)}" if paths else "",
                                f"{HYBRID_SWITCH}={a['hybrid']}" if a.get("hybrid") else "",
                                f"{REFILL_SWITCH}={a['refill']}" if a.get("refill") else "") if x)
    pred = (f"decode {a['decode_ts']:.1f} t/s" + (f" ({how})" if how else "")
            + (f", prompts +{a['prompt_extra_s']:.3f} s" if a["prompt_extra_s"] else "") + f", {a['seconds']:.2f} s"
            if a["fits"] else "no room")
    return f"{a['name']:<18} resident expert layers {'/'.join(map(str, a['resident']))}, {cache}: {pred}"


def _row_text(row: dict) -> str:
    """One fit_ubatch candidate's outcome in words: its prediction and what binds it, or why it is out."""
    if row.get("predicted_ts"):
        return (f"{row['predicted_ts']:.0f} t/s" + (f", {row['bound']}-bound" if row.get("bound") else "")
                + (f", groups of {row['group']}" if row.get("group", 1) > 1 else "")
                + (f" (compute {row['compute']})" if row.get("compute") else "")
                + (f"; {row['larger_batch']}" if row.get("larger_batch") else ""))
    return row.get("why") or "-"


def grouped_rows(rows: Sequence[dict]) -> list[str]:
    """fit_ubatch's candidate rows as lines, one per candidate, candidates next to each other with the same n_batch,
    outcome and fix in one line: "n_ubatch 512..16384 (n_batch 16384): why. Fix: ...".

    Args:
        rows: Plan.ubatch_auto's rows (n_ubatch, n_batch, predicted_ts / why, fix), in n_ubatch order.
    Returns:
        The lines.
    """
    groups: list = []
    for row in rows:
        key = (row.get("n_batch"), _row_text(row), row.get("fix", ""))
        if groups and groups[-1][0] == key and not row.get("predicted_ts"):
            groups[-1][1].append(row["n_ubatch"])
        else:
            groups.append((key, [row["n_ubatch"]]))
    out = []
    for (nb, text, fix), ubs in groups:
        which = f"n_ubatch {ubs[0]}" + (f"..{ubs[-1]}" if len(ubs) > 1 else "")
        out.append(f"{which} (n_batch {nb}): {text}" + (f". Fix: {fix}" if fix else ""))
    return out


def _spec_key(d: dict) -> str:
    """A device spec without its text (the same devices written two ways are the same)."""
    # ("ids": plans saved before the spec's own cuda_ids were read back)
    return json.dumps({k: v for k, v in d.items() if k not in ("text", "ids")}, sort_keys=True)


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


def layer_ranges(n_gpu_layers: int, split: list[float], n_layer: int) -> tuple[list[list[int]], int]:
    """[first, end) of the repeating layers per device, and the device of the output layer (-1: the CPU), as
    llama-model.cpp assigns them (the output layer counts as layer n_layer; layers below n_layer + 1 - n_gpu_layers
    stay on the CPU)."""
    n_act = n_layer + 1
    ngl = n_act if n_gpu_layers < 0 else min(n_gpu_layers, n_act)
    start = n_act - ngl
    total = sum(split)
    cum, bounds = 0.0, []
    for s in split:
        cum += s
        bounds.append(cum / total if total > 0 else 1.0)
    owner = {}
    for il in range(start, n_act):
        x = (il - start) / ngl if ngl else 0.0
        owner[il] = next((i for i, b in enumerate(bounds) if x < b), len(split) - 1)   # upper_bound
    out = []
    for dev in range(len(split)):
        mine = [il for il, o in owner.items() if o == dev and il < n_layer]
        out.append([mine[0], mine[-1] + 1] if mine else [start, start])
    return out, owner.get(n_layer, -1)


_BLOCK_PATTERN = re.compile(r"^\^?blk\\\.(\d+)\\\.")


def _existing_overrides(overrides: Sequence[str], n_layer: int) -> list[str]:
    """The overrides that name a block the model has: upstream's set_ngl_tensor_split_tbo counts the output layer
    among the last device's partial layers and writes a pattern for block n_layer, which matches no tensor."""
    out = []
    for ov in overrides:
        m = _BLOCK_PATTERN.match(ov)
        if m is None or int(m.group(1)) < n_layer:
            out.append(ov)
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
    ranges, out_dev = layer_ranges(res["n_gpu_layers"], split, n_layer)
    overrides = _existing_overrides(res["overrides"], n_layer)
    host, partial = _host_layers(overrides, n_layer)
    devs = []
    for i, d in enumerate(res["devices"]):
        first, end = ranges[i]
        n_host = sum(1 for il in range(first, end) if il in host)
        devs.append(DevicePlan(name=d["name"], layers=[first, end], full_layers=(end - first) - n_host,
                               host_expert_layers=n_host, partial_layers=sum(1 for il in range(first, end) if il in partial),
                               output_layer=i == out_dev,
                               model_bytes=d["model_bytes"], context_bytes=d["context_bytes"],
                               compute_bytes=d["compute_bytes"], free_bytes=d["free_bytes"],
                               target_bytes=d["free_bytes"] - margins[i],
                               server=d.get("server"), server_host_free=d.get("server_host_free"),
                               server_net=d.get("server_net"), link=res.get("rates", {}).get("links", {}).get(d["name"])))
    size = Path(model).stat().st_size
    # (the model's absolute path: `run/ab --plan PLAN.json` without a model finds it from any working directory)
    return Plan(variant=variant, model=str(Path(model).resolve()), model_size=size,
                devices_spec=spec.to_dict(), ctx=ctx,
                status=status, path=path, reasons=reasons, n_gpu_layers=res["n_gpu_layers"],
                tensor_split=list(res["tensor_split"])[:ndev], tensor_overrides=overrides,
                n_ctx=res["n_ctx"], n_layer=n_layer, n_expert=res["n_expert"], margins=margins, devices=devs,
                host=res.get("host", {}), message=res.get("message", ""), seconds=res.get("seconds", 0.0),
                host_copy_gbps=res.get("rates", {}).get("host_copy_gbps"),
                cpu_expert_gbps=res.get("rates", {}).get("cpu_expert_gbps") or {})


def _on_cpu_text(on_cpu: int, n_layer: int) -> str:
    """llama's n_gpu_layers counts the output layer as layer n_layer: the first on_cpu of 0..n_layer stay on the CPU."""
    if on_cpu > n_layer:
        return f"all {n_layer} layers and the output layer"
    return f"{on_cpu} of {n_layer} layers (0..{on_cpu - 1})"


def plan_problem(plan: Plan, check: bool = True) -> Optional[Exception]:
    """The error a user can act on for this plan, or None (unless check=False): fit found no placement, not even
    the dense weights fit on the devices (whole layers left on the CPU), or the plan's own measurement puts a device
    over its target."""
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
            f"leaves {_on_cpu_text(on_cpu, plan.n_layer)} on the CPU. Fix: give the devices more memory, or lower the "
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
