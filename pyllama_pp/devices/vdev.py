"""Virtual accelerators (VDEV, pyllama_pp/native/vdev.cpp): GPU-like devices computing on the CPU, with a memory
budget, a throttled host link, a speed and injected faults; registered once per process."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..counters import COUNTER_FIELDS
from ..defaults import MARGINS, usable_cores
from ..errors import DeviceSpecError
from .base import DeviceSpec, bad, parse_rate, parse_size, whole

# kernels reading pinned host memory (DIRECT) get this share of a VDEV's link: about what the
# 2xH200 box showed (24-34 of 55 GB/s, docs/results/history-2026-11.md section 2d)
DEFAULT_DIRECT_READ = 0.5
_KEYS = {"memory", "link_gbps", "link", "link_group", "speed", "threads", "d2d_gbps", "direct_read", "row_pad",
         "fail_alloc_after", "fail_copy_after", "fault_abort"}


@dataclass
class VDevConfig:
    """One virtual accelerator: memory budget, host link, link group, speed (1 = CPU speed, 2 = half as fast)."""

    memory: int = 0               # bytes; 0 = unlimited
    link_gbps: float = 0.0        # 0 = unthrottled
    link_group: int = -1          # devices with the same group >= 0 share one link
    speed: float = 1.0            # compute slow-down factor (>= 1)
    threads: int = 1
    d2d_gbps: float = 0.0
    direct_read: float = DEFAULT_DIRECT_READ   # share of the link for kernels reading pinned host memory (DIRECT)
    row_pad: int = 0              # CUDA's row padding of quantized tensors (512 there): alloc sizes as on CUDA; 0 = none
    fail_alloc_after: int = -1    # injected fault: buffer allocations after the first N fail (-1: none)
    fail_copy_after: int = -1     # injected fault: the host<->device copy after the first N fails (-1: none)
    fault_abort: bool = False     # ... and aborts the process itself (SIGABRT) instead of through ggml's abort callback


def _direct_read(val: Any, spec: Any, what: str = "direct") -> float:
    try:
        f = float(val)
    except (TypeError, ValueError):
        raise bad(spec, f"{what} takes a number in (0, 1], not {val!r}") from None
    if not 0.0 < f <= 1.0:
        raise bad(spec, f"{what} takes a number in (0, 1] (a share of the link's rate), not {f:g}")
    return f


def _row_pad(val: Any, spec: Any, what: str = "pad") -> int:
    """0 or a multiple of 256 values up to 4096 (a padding step must hold whole blocks of every quantized type)."""
    n = whole(val)
    if n is None or n < 0 or n > 4096 or n % 256:
        raise bad(spec, f"{what} takes 0 or a multiple of 256 values up to 4096 (CUDA pads rows to 512), not {val!r}")
    return n


def _fault_count(val: Any, spec: Any, what: str) -> int:
    """-1 (no fault) or a count >= 0 of operations that succeed first."""
    n = whole(val)
    if n is None or n < -1 or n > 2**62:
        raise bad(spec, f"{what} takes a count >= 0 of operations that succeed first (-1: no fault), not {val!r}")
    return n


def _flag(val: Any, spec: Any, what: str) -> bool:
    if not isinstance(val, bool):
        raise bad(spec, f"{what} takes true or false, not {val!r}")
    return val


def _device(i: int, dd: Any, text: str) -> VDevConfig:
    """Device `i` of the JSON form."""
    if not isinstance(dd, dict):
        raise bad(text, f"device {i} is not an object")
    unknown = set(dd) - _KEYS
    if unknown:
        raise bad(text, f"device {i} has unknown keys {sorted(unknown)}")
    v = VDevConfig(memory=parse_size(dd.get("memory", 0)),
                   link_gbps=parse_rate(dd.get("link_gbps", dd.get("link", 0))),
                   link_group=int(dd.get("link_group", -1)), speed=float(dd.get("speed", 1.0)),
                   threads=int(dd.get("threads", 1)), d2d_gbps=parse_rate(dd.get("d2d_gbps", 0)),
                   direct_read=_direct_read(dd.get("direct_read", DEFAULT_DIRECT_READ), text, f"device {i}: direct_read"),
                   row_pad=_row_pad(dd.get("row_pad", 0), text, f"device {i}: row_pad"),
                   fail_alloc_after=_fault_count(dd.get("fail_alloc_after", -1), text, f"device {i}: fail_alloc_after"),
                   fail_copy_after=_fault_count(dd.get("fail_copy_after", -1), text, f"device {i}: fail_copy_after"),
                   fault_abort=_flag(dd.get("fault_abort", False), text, f"device {i}: fault_abort"))
    if v.speed < 1.0:
        raise bad(text, f"device {i}: speed is a slow-down factor and must be >= 1")
    return v


class VdevSpec(DeviceSpec):
    """Virtual accelerators (`vdevs`: one VDevConfig each), exact memory budgets and the links the spec gives."""

    kind = "vdev"
    forms = """
  vdev:2x768MiB@4GBps              2 virtual devices (VDEV), 768 MiB each, each on its own 4 GB/s link
  vdev:2x768MiB@4GBps,shared       ... both on ONE 4 GB/s link (PCIe topology)
  vdev:2x768MiB@4GBps,speed=1:2    ... the second device computes 2x slower (mixed GPUs)
  vdev:2x768MiB@4GBps,direct=0.5   ... kernels that read pinned host memory (DIRECT) get half the link's rate
                                   (the default: about what the 2xH200 box shows; 1 = the copy engine's rate)
  vdev:2x0@0,pad=512               ... quantized tensors get CUDA's row padding in their alloc size (VRAM as on CUDA)
  vdev:2x0@0                       2 unthrottled VDEVs without a memory limit (no @RATE: unthrottled too, with a
                                   note)
  vdev:2x0@0,fail_alloc_after=N    injected fault: each device's buffer allocations after its first N fail
                                   (0: at model load; a full device from then on; tests of the error paths)
  vdev:2x0@0,fail_copy_after=N     injected fault: each device's host<->device copy after its first N fails;
                                   ggml cannot report a failed copy, so (as on CUDA) it aborts: pyllama_pp's
                                   abort callback makes that an error (DeviceError)
  vdev:2x0@0,fail_copy_after=N,abort  ... and the failed copy aborts the process itself (SIGABRT: the worker dies)"""
    default_margin = MARGINS["vdev"]   # the budgets are exact

    @classmethod
    def from_text(cls, text: str) -> Optional["VdevSpec"]:
        """The spec for "vdev:NxMEM[@RATE][,OPTION...]" (any case); None for other text.

        Raises:
            DeviceSpecError: for a count, size, rate or option out of range.
        """
        m = re.fullmatch(r"vdev:(\d+)x([0-9.]+[a-z]*)(?:@([0-9.]+[a-z/]*))?((?:,[a-z_]+(?:=[0-9.:]+)?)*)", text.lower())
        if not m:
            return None
        n = int(m.group(1))
        if not 1 <= n <= 16:
            raise bad(text, "the device count must be 1..16")
        mem = parse_size(m.group(2))
        rate = parse_rate(m.group(3) or 0)
        shared, speeds, threads, direct, pad = False, [1.0] * n, 1, DEFAULT_DIRECT_READ, 0
        faults: dict = {"fail_alloc_after": -1, "fail_copy_after": -1, "fault_abort": False}
        for opt in filter(None, (m.group(4) or "").split(",")):
            key, _, val = opt.partition("=")
            if key == "shared" and not val:
                shared = True
            elif key == "speed" and val:
                try:
                    speeds = [float(x) for x in val.split(":")]
                except ValueError:
                    raise bad(text, "speed takes numbers separated by ':'") from None
                if len(speeds) != n or min(speeds) < 1.0:
                    raise bad(text, f"speed needs {n} factors >= 1 separated by ':'")
            elif key == "threads" and val.isdigit():
                threads = int(val)
            elif key == "direct" and val:
                direct = _direct_read(val, text)
            elif key == "pad" and val:
                pad = _row_pad(val, text)
            elif key in ("fail_alloc_after", "fail_copy_after") and val:
                faults[key] = _fault_count(val, text, key)
            elif key == "abort" and not val:
                faults["fault_abort"] = True
            else:
                raise bad(text, f"unknown option {opt!r} (options: shared, speed=A:B, threads=N, direct=F, pad=N, "
                                "fail_alloc_after=N, fail_copy_after=N, abort)")
        devs = [VDevConfig(memory=mem, link_gbps=rate, link_group=0 if shared else -1, speed=speeds[i],
                           threads=threads, direct_read=direct, row_pad=pad, **faults) for i in range(n)]
        return cls(vdevs=devs, text=text)

    @classmethod
    def from_dict(cls, d: dict, text: str) -> "VdevSpec":
        """The spec for {"kind": "vdev", "devices": [{VDevConfig's fields}, ...]} (FORMS' JSON form).

        Raises:
            DeviceSpecError: for no devices, more than 16, or a device with unknown keys or values out of range.
        """
        devs = d.get("devices")
        if not isinstance(devs, list) or not devs:
            raise bad(text, "'devices' must be a non-empty list")
        out = [_device(i, dd, text) for i, dd in enumerate(devs)]
        if len(out) > 16:
            raise bad(text, "at most 16 devices")
        return cls(vdevs=out, text=text)

    @property
    def n_devices(self) -> int:
        """int: the virtual devices."""
        return len(self.vdevs)

    @property
    def label(self) -> str:
        """The text as given, or for a JSON spec the VDEVs written the short way ("vdev:8MiB@1GBps,6MiB@1GBps", equal
        neighbours as "2x8MiB@1GBps", then ",shared" / ",speed=1:2")."""
        if self.text and not self.text.lstrip().startswith("{") and not self.text.endswith(".json"):
            return self.text
        parts: list[list] = []
        for v in self.vdevs:
            mem = "0" if v.memory == 0 else (f"{v.memory / 2**30:g}GiB" if v.memory % 2**30 == 0
                                              else f"{v.memory / 2**20:g}MiB")
            one = f"{mem}@{v.link_gbps:g}GBps"
            if parts and parts[-1][1] == one:
                parts[-1][0] += 1
            else:
                parts.append([1, one])
        out = "vdev:" + ",".join(one if n == 1 else f"{n}x{one}" for n, one in parts)
        if any(v.link_group >= 0 for v in self.vdevs):
            out += ",shared"
        if any(v.speed != 1.0 for v in self.vdevs):
            out += ",speed=" + ":".join(f"{v.speed:g}" for v in self.vdevs)
        return out

    @property
    def notes(self) -> list[str]:
        """The text form without @RATE: its links are unthrottled (as @0), said once."""
        if self.text and self.text.lower().startswith("vdev:") and "@" not in self.text:
            return [f"{self.text} names no link rate: its host links are unthrottled (as @0). Give one, e.g. "
                    f"{self.text.split(',')[0]}@4GBps, for links of that rate"]
        return []

    def link_rates(self) -> Optional[list[float]]:
        """Each VDEV's own link rate (GB/s; 0: unthrottled)."""
        return [v.link_gbps for v in self.vdevs]

    def link_groups(self) -> Optional[list[int]]:
        """Each VDEV's link group (-1: a link of its own)."""
        return [v.link_group for v in self.vdevs]

    def fit_check(self, split_mode: str) -> None:
        """fit needs each VDEV's memory budget, and the layer split (VDEVs have no split buffers for rows).

        Raises:
            DeviceSpecError: for a VDEV without a memory budget, or split mode row.
        """
        if any(v.memory == 0 for v in self.vdevs):
            raise DeviceSpecError(f"fit needs each device's memory, and {self} has a VDEV without a memory budget "
                                  "(0 = unlimited): give one, e.g. vdev:2x256MiB@4GBps")
        if split_mode == "row":
            raise DeviceSpecError(f"split mode row splits tensors by rows over CUDA devices; the VDEVs of {self} "
                                  "have no split buffers (and upstream's fit does not place layers in that mode): use "
                                  "layer")

    @property
    def shares_one_gpu(self) -> bool:
        """bool: the VDEVs compute on this machine's CPU, each with its threads; where those outnumber the cores this
        process may use, the devices take turns on the same cores, as parts of one GPU do."""
        return len(self.vdevs) > 1 and sum(v.threads for v in self.vdevs) > usable_cores()

    @property
    def one_link(self) -> bool:
        """bool: every VDEV is in one link group."""
        return len(self.vdevs) > 1 and len({v.link_group for v in self.vdevs}) == 1 and self.vdevs[0].link_group >= 0

    def expert_read_rates(self, cpu_gbps: float, n_devices: int) -> Optional[list[float]]:
        """A VDEV computes with the host CPU's own kernels: it reads expert weights no faster than the CPU path does,
        slowed by its speed factor (its thread count is not measured apart: the same kernels on the same cores)."""
        return [cpu_gbps / v.speed for v in self.vdevs] if len(self.vdevs) == n_devices else None

    def probe_specs(self, servers: Optional[list] = None) -> list[tuple[list[int], str]]:
        """One unthrottled VDEV without a memory limit per distinct compute speed (only compute is measured), or, where
        the VDEVs share the CPU's cores (shares_one_gpu), all of them together, unthrottled and without limits.

        Returns:
            [(the indices of the devices of that speed and thread count, a JSON spec of one such VDEV), ...].
        """
        if self.shares_one_gpu:
            return [(list(range(len(self.vdevs))), json.dumps({"kind": self.kind, "devices": [
                {"memory": 0, "link_gbps": 0, "speed": v.speed, "threads": v.threads} for v in self.vdevs]}))]
        groups: dict = {}
        for i, v in enumerate(self.vdevs):
            groups.setdefault((v.speed, v.threads), []).append(i)
        return [(idx, json.dumps({"kind": self.kind, "devices": [{"memory": 0, "link_gbps": 0, "speed": speed,
                                                                  "threads": threads}]}))
                for (speed, threads), idx in groups.items()]

    def register(self, native, servers: Optional[list] = None) -> str:
        """Register the VDEVs in this process (once: a process has one set of VDEVs).

        Raises:
            DeviceSpecError: where the process already has another count of VDEVs, or the library refuses the
                configuration.
        """
        lib, ffi = native.lib, native.ffi
        n = len(self.vdevs)
        have = lib.pp_vdev_count()
        if have and have != n:
            raise DeviceSpecError(f"this process already has {have} virtual devices; {n} were asked for. "
                                  "Use one device count per process (workers do this for you).")
        cfg = ffi.new("struct pp_vdev_config[]", n)
        for i, v in enumerate(self.vdevs):
            cfg[i].memory_bytes = v.memory
            cfg[i].link_gbps = v.link_gbps
            cfg[i].link_group = v.link_group
            cfg[i].compute_factor = v.speed
            cfg[i].n_threads = v.threads
            cfg[i].d2d_gbps = v.d2d_gbps
            cfg[i].direct_read = v.direct_read
            cfg[i].row_pad = v.row_pad
            cfg[i].fail_alloc_at = v.fail_alloc_after + 1 if v.fail_alloc_after >= 0 else 0
            cfg[i].fail_copy_at = v.fail_copy_after + 1 if v.fail_copy_after >= 0 else 0
            cfg[i].fault_abort = int(v.fault_abort)
        err = ffi.new("char[512]")
        if lib.pp_vdev_register(cfg, n, err, 512) != 0:
            raise DeviceSpecError(f"cannot set up the virtual devices: {ffi.string(err).decode()}")
        return ",".join(f"VDEV{i}" for i in range(n))

    def device_counters(self, native) -> list[dict]:
        """Each VDEV's counters since the last reset ("device": VDEV0, ...; COUNTER_FIELDS)."""
        lib, ffi = native.lib, native.ffi
        out = []
        for i in range(lib.pp_vdev_count()):
            c = ffi.new("struct pp_vdev_counters *")
            native.check(lib.pp_vdev_get_counters(i, c))
            out.append({"device": f"VDEV{i}", **{k: getattr(c, k) for k in COUNTER_FIELDS}})
        return out
