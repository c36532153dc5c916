"""Device specs: which devices a run uses, understood the same way by the API, the CLI and bench/.

Accepted forms:
  cpu                              CPU only (no accelerator)
  cuda                             every CUDA device
  cuda:0,1                         CUDA devices 0 and 1
  vdev:2x768MiB@4GBps              2 virtual devices (VDEV), 768 MiB each, each on its own 4 GB/s link
  vdev:2x768MiB@4GBps,shared       ... both on ONE 4 GB/s link (PCIe topology)
  vdev:2x768MiB@4GBps,speed=1:2    ... the second device computes 2x slower (mixed GPUs)
  vdev:2x768MiB@4GBps,direct=0.5   ... kernels that read pinned host memory (DIRECT) get half the link's rate
                                   (the default: about what the 2xH200 box shows; 1 = the copy engine's rate)
  vdev:2x0@0,pad=512               ... quantized tensors get CUDA's row padding in their alloc size (VRAM as on CUDA)
  vdev:2x0@0                       2 unthrottled VDEVs without a memory limit
  vdev:2x0@0,fail_alloc_after=N    injected fault: each device's buffer allocations after its first N fail
                                   (0: at model load; a full device from then on; tests of the error paths)
  vdev:2x0@0,fail_copy_after=N     injected fault: each device's host<->device copy after its first N fails;
                                   ggml cannot report a failed copy, so (as on CUDA) it aborts: pyllama_pp's
                                   abort callback makes that an error (DeviceError)
  vdev:2x0@0,fail_copy_after=N,abort  ... and the failed copy aborts the process itself (SIGABRT: the worker dies)
  rpc://HOST:PORT                  the devices of an rpc-server (llama.cpp's ggml RPC; `pyllama-pp rpc-server`)
  rpc://10.0.0.2:50052,10.0.0.3:50052  ... of several servers, in this order
  rpc://10.0.0.2:50052/1           ... only a server's device 1 (its devices count from 0)
  cuda:0+rpc://10.0.0.2:50052      this machine's devices first (cuda[:IDS] or vdev:...), then the servers'
  a JSON file or dict: {"kind": "vdev", "devices": [{"memory": "768MiB", "link_gbps": 4, "link_group": 0,
                         "speed": 1.0, "threads": 1, "direct_read": 0.5, "row_pad": 0,
                         "fail_alloc_after": -1, "fail_copy_after": -1, "fault_abort": false}, ...]}
                                   (-1: no fault)
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .errors import DeviceSpecError

FORMS = __doc__.split("Accepted forms:", 1)[1].rstrip()

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: Union[str, int, float]) -> int:
    """'768MiB' -> bytes; plain numbers are bytes."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise DeviceSpecError(f"bad memory size {text!r}: it cannot be negative")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise DeviceSpecError(f"bad memory size {text!r}: use e.g. 768MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_rate(text: Union[str, int, float]) -> float:
    """'4GBps' / '250MBps' / 4 -> GB/s (1e9 bytes/s)."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise DeviceSpecError(f"bad bandwidth {text!r}: it cannot be negative (0 means unthrottled)")
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gbps|gb/s|mbps|mb/s|)\s*", str(text).lower())
    if not m:
        raise DeviceSpecError(f"bad bandwidth {text!r}: use e.g. 4GBps, 250MBps or a number of GB/s")
    v = float(m.group(1))
    return v / 1000.0 if m.group(2) in ("mbps", "mb/s") else v


# kernels reading pinned host memory (DIRECT) get this share of a VDEV's link: about what the
# 2xH200 box showed (24-34 of 55 GB/s, docs/results/history-2026-11.md section 2d)
DEFAULT_DIRECT_READ = 0.5


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


@dataclass
class DeviceSpec:
    """A parsed device spec (make one with `parse_devices`).

    Attributes:
        kind: "cpu", "cuda", "vdev" or "rpc".
        cuda_ids: the CUDA device indices (kind cuda; empty: every device).
        vdevs: one VDevConfig per virtual device (kind vdev): memory, link rate, link group, speed, faults.
        endpoints: the rpc-servers' "HOST:PORT" (kind rpc).
        local: kind rpc: this machine's devices (a cuda or vdev spec), placed before the servers' (None: none).
        text: the spec as given ("vdev:2x768MiB@4GBps", a JSON text or file name).
    """

    kind: str
    cuda_ids: list[int] = field(default_factory=list)   # empty = all (kind cuda)
    vdevs: list[VDevConfig] = field(default_factory=list)
    text: str = ""
    endpoints: list[str] = field(default_factory=list)   # kind rpc
    local: Optional["DeviceSpec"] = None                 # kind rpc: this machine's devices, before the servers'

    @property
    def n_devices(self) -> int:
        """int: the number of devices the spec names (0 for cpu, for "cuda", which names every device, and for
        rpc, whose servers tell their devices only when connected)."""
        return len(self.vdevs) if self.kind == "vdev" else len(self.cuda_ids)

    @property
    def label(self) -> str:
        """A short name for tables and plots: the text as given, or for a JSON spec the VDEVs written the short
        way ("vdev:8MiB@1GBps,6MiB@1GBps", equal neighbours as "2x8MiB@1GBps", then ",shared" / ",speed=1:2")."""
        if self.kind != "vdev" or (self.text and not self.text.lstrip().startswith("{")
                                   and not self.text.endswith(".json")):
            return self.text or self.kind
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

    def to_dict(self) -> dict:
        """The spec as JSON-ready data.

        Returns:
            dict: kind, cuda_ids, devices (one dict of VDevConfig fields per VDEV), endpoints, local and text.
        """
        return {"kind": self.kind, "cuda_ids": self.cuda_ids, "devices": [asdict(v) for v in self.vdevs],
                "endpoints": self.endpoints, "local": self.local.to_dict() if self.local else None,
                "text": self.text}

    def __str__(self) -> str:
        return self.text or self.kind


def _direct_read(val: Any, spec: Any, what: str = "direct") -> float:
    try:
        f = float(val)
    except (TypeError, ValueError):
        raise _bad(spec, f"{what} takes a number in (0, 1], not {val!r}") from None
    if not 0.0 < f <= 1.0:
        raise _bad(spec, f"{what} takes a number in (0, 1] (a share of the link's rate), not {f:g}")
    return f


def _whole(val: Any) -> Optional[int]:
    """`val` as a whole number (7, 7.0, "7"), else None (bools, fractions, text)."""
    if isinstance(val, bool):
        return None
    try:
        f = float(val)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(f) if f.is_integer() else None


def _row_pad(val: Any, spec: Any, what: str = "pad") -> int:
    """0 or a multiple of 256 values up to 4096 (a padding step must hold whole blocks of every quantized type)."""
    n = _whole(val)
    if n is None or n < 0 or n > 4096 or n % 256:
        raise _bad(spec, f"{what} takes 0 or a multiple of 256 values up to 4096 (CUDA pads rows to 512), not {val!r}")
    return n


def _fault_count(val: Any, spec: Any, what: str) -> int:
    """-1 (no fault) or a count >= 0 of operations that succeed first."""
    n = _whole(val)
    if n is None or n < -1 or n > 2**62:
        raise _bad(spec, f"{what} takes a count >= 0 of operations that succeed first (-1: no fault), not {val!r}")
    return n


def _flag(val: Any, spec: Any, what: str) -> bool:
    if not isinstance(val, bool):
        raise _bad(spec, f"{what} takes true or false, not {val!r}")
    return val


def _bad(spec: Any, why: str) -> DeviceSpecError:
    err = DeviceSpecError(f"bad device spec {spec!r}: {why}.\nAccepted forms:{FORMS}")
    err.complete = True   # names the spec and lists the accepted forms: parse() passes it on as it is
    return err


_ENDPOINT = re.compile(r"(?:rpc://)?([A-Za-z0-9._-]+):(\d{1,5})(?:/(\d{1,2}))?")


def _endpoints(items: list, text: str) -> list[str]:
    """The rpc-servers' "HOST:PORT" (or "HOST:PORT/N": only the server's device N) of an rpc spec, checked (a port
    1..65535; a server either whole or by device, each once)."""
    out: list[str] = []
    for item in items:
        m = _ENDPOINT.fullmatch(item.strip())
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise _bad(text, f"bad RPC endpoint {item.strip()!r}: expected HOST:PORT[/DEVICE] with a port 1..65535")
        ep = f"{m.group(1)}:{int(m.group(2))}" + (f"/{int(m.group(3))}" if m.group(3) else "")
        server = ep.split("/")[0]
        if ep in out or (server in out) or ("/" not in ep and any(o.startswith(server + "/") for o in out)):
            raise _bad(text, f"the RPC endpoint {ep} is listed twice")
        out.append(ep)
    if len(out) > 16:
        raise _bad(text, "at most 16 RPC servers")
    return out


def _from_dict(d: dict, text: str) -> DeviceSpec:
    kind = d.get("kind", "vdev")
    if kind == "cpu":
        return DeviceSpec("cpu", text=text)
    if kind == "cuda":
        # ("ids" as a user writes it; "cuda_ids" as DeviceSpec.to_dict writes it)
        return DeviceSpec("cuda", cuda_ids=[int(i) for i in d.get("ids", d.get("cuda_ids")) or []], text=text)
    if kind == "rpc":
        eps = d.get("endpoints")
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise _bad(text, "'endpoints' must be a non-empty list of \"HOST:PORT\" strings")
        local = d.get("local")
        if local is not None:
            local = _from_dict(local, text) if isinstance(local, dict) else None
            if local is None or local.kind not in ("cuda", "vdev"):
                raise _bad(text, "'local' must be a cuda or vdev spec (this machine's devices)")
        return DeviceSpec("rpc", endpoints=_endpoints(eps, text), text=text, local=local)
    if kind != "vdev":
        raise _bad(text, f"unknown kind {kind!r}")
    devs = d.get("devices")
    if not isinstance(devs, list) or not devs:
        raise _bad(text, "'devices' must be a non-empty list")
    out = []
    for i, dd in enumerate(devs):
        if not isinstance(dd, dict):
            raise _bad(text, f"device {i} is not an object")
        unknown = set(dd) - {"memory", "link_gbps", "link", "link_group", "speed", "threads", "d2d_gbps", "direct_read",
                             "row_pad", "fail_alloc_after", "fail_copy_after", "fault_abort"}
        if unknown:
            raise _bad(text, f"device {i} has unknown keys {sorted(unknown)}")
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
            raise _bad(text, f"device {i}: speed is a slow-down factor and must be >= 1")
        out.append(v)
    if len(out) > 16:
        raise _bad(text, "at most 16 devices")
    return DeviceSpec("vdev", vdevs=out, text=text)


def parse(spec: Union[str, dict, "DeviceSpec", None]) -> DeviceSpec:
    """Parse a device spec, as the API, the CLI and bench/ all understand it (the forms: this module's docstring).

    Args:
        spec: a string ("cpu", "cuda", "cuda:0,1", "vdev:2x768MiB@4GBps[,shared,speed=1:2,...]", "rpc://HOST:PORT"), a JSON text, the
            path of a .json file, a dict of the JSON form, a DeviceSpec (returned as it is), or None / "" (cpu).
    Returns:
        DeviceSpec: the parsed spec.
    Raises:
        DeviceSpecError: for a spec that is none of the accepted forms, or has a value out of range (the message
            names the spec and lists the forms); it is a ValueError too.
        TypeError: for a spec that is not a string, dict, path or DeviceSpec (a number, a list).
    """
    if not isinstance(spec, (str, dict, DeviceSpec, Path, type(None))):
        raise TypeError(f"devices must be a device spec string (e.g. 'vdev:2x768MiB@4GBps'), its JSON dict or a "
                        f"DeviceSpec, not {type(spec).__name__}")
    try:
        return _parse(spec)
    except DeviceSpecError as e:
        if getattr(e, "complete", False):
            raise
        raise _bad(spec, str(e)) from None
    except (TypeError, ValueError) as e:
        raise _bad(spec, str(e)) from None


def _parse(spec: Union[str, dict, "DeviceSpec", None]) -> DeviceSpec:
    if isinstance(spec, DeviceSpec):
        return spec
    if spec is None or spec == "":
        return DeviceSpec("cpu", text="cpu")
    if isinstance(spec, dict):
        return _from_dict(spec, json.dumps(spec))
    text = str(spec).strip()
    if text.startswith("{"):
        try:
            return _from_dict(json.loads(text), text)
        except json.JSONDecodeError as e:
            raise _bad(text, f"invalid JSON ({e})") from None
    if text.endswith(".json"):
        try:
            return _from_dict(json.loads(Path(text).read_text()), text)
        except OSError as e:
            raise _bad(text, f"cannot read the file ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise _bad(text, f"invalid JSON ({e})") from None
    low = text.lower()
    if "+rpc://" in low:   # this machine's devices, then the servers'
        head, _, tail = text.partition("+")
        local = _parse(head)
        if local.kind not in ("cuda", "vdev"):
            raise _bad(text, f"before +rpc:// come this machine's devices (cuda[:IDS] or vdev:...), not {head!r}")
        return DeviceSpec("rpc", endpoints=_endpoints(tail.strip()[len("rpc://"):].split(","), text), text=text,
                          local=local)
    if low == "cpu":
        return DeviceSpec("cpu", text=text)
    if low == "cuda":
        return DeviceSpec("cuda", text=text)
    if low.startswith("rpc://"):
        return DeviceSpec("rpc", endpoints=_endpoints(text[len("rpc://"):].split(","), text), text=text)
    m = re.fullmatch(r"cuda:(\d+(?:,\d+)*)", low)
    if m:
        ids = [int(x) for x in m.group(1).split(",")]
        if len(set(ids)) != len(ids):
            raise _bad(text, "a CUDA device is listed twice")
        return DeviceSpec("cuda", cuda_ids=ids, text=text)
    m = re.fullmatch(r"vdev:(\d+)x([0-9.]+[a-z]*)(?:@([0-9.]+[a-z/]*))?((?:,[a-z_]+(?:=[0-9.:]+)?)*)", low)
    if not m:
        raise _bad(text, "not one of the accepted forms")
    n = int(m.group(1))
    if not 1 <= n <= 16:
        raise _bad(text, "the device count must be 1..16")
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
                raise _bad(text, "speed takes numbers separated by ':'") from None
            if len(speeds) != n or min(speeds) < 1.0:
                raise _bad(text, f"speed needs {n} factors >= 1 separated by ':'")
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
            raise _bad(text, f"unknown option {opt!r} (options: shared, speed=A:B, threads=N, direct=F, pad=N, "
                             "fail_alloc_after=N, fail_copy_after=N, abort)")
    devs = [VDevConfig(memory=mem, link_gbps=rate, link_group=0 if shared else -1, speed=speeds[i], threads=threads,
                       direct_read=direct, row_pad=pad, **faults) for i in range(n)]
    return DeviceSpec("vdev", vdevs=devs, text=text)
