"""What every device kind shares: `DeviceSpec` (the base class each kind subclasses), the registry `KINDS` that
`parse` asks, sizes and rates, the errors that list the accepted forms, and the devices the loaded variant sees.

A kind answers for itself (its class attributes and methods): callers ask the spec, never its name. The registry is
filled in devices/__init__.py, in the order `FORMS` lists the kinds.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from .. import binding
from ..defaults import CONTEXT, CUDA_LINK_GBPS, MARGINS
from ..errors import DeviceSpecError

GiB = 1024**3
# a device's host link where the spec gives none: a PCIe 5 x16 link's measured host -> device rate (docs/RESULTS.md)
DEFAULT_LINK_GBPS = CUDA_LINK_GBPS
# the kind of a JSON spec without "kind"
DEFAULT_JSON_KIND = "vdev"
# the JSON form, after every kind's own forms
JSON_FORM = """
  a JSON file or dict: {"kind": "vdev", "devices": [{"memory": "768MiB", "link_gbps": 4, "link_group": 0,
                         "speed": 1.0, "threads": 1, "direct_read": 0.5, "row_pad": 0,
                         "fail_alloc_after": -1, "fail_copy_after": -1, "fault_abort": false}, ...]}
                                   (-1: no fault)"""

KINDS: dict[str, type["DeviceSpec"]] = {}   # name -> class, in FORMS order (filled in devices/__init__.py)

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


def forms() -> str:
    """The accepted forms, one per line: each registered kind's, then the JSON form."""
    return "\n" + "\n".join(k.forms.strip("\n") for k in KINDS.values()) + JSON_FORM


FORMS_HEADING = "\nAccepted forms:"   # (where a device spec error's list of forms starts)


def bad(spec: Any, why: str) -> DeviceSpecError:
    """A DeviceSpecError that names the spec, says why and lists the accepted forms."""
    err = DeviceSpecError(f"bad device spec {spec!r}: {why}.{FORMS_HEADING}{forms()}")
    err.complete = True   # names the spec and lists the accepted forms: parse() passes it on as it is
    return err


def whole(val: Any) -> Optional[int]:
    """`val` as a whole number (7, 7.0, "7"), else None (bools, fractions, text)."""
    if isinstance(val, bool):
        return None
    try:
        f = float(val)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(f) if f.is_integer() else None


@dataclass
class DeviceSpec(ABC):
    """A parsed device spec (make one with `parse_devices`): one subclass per kind (devices/cpu.py, cuda.py, vdev.py,
    rpc.py), each answering for its devices: how its text and JSON forms read, how many devices it names, their
    links, what fit needs and how a process sets them up.

    Attributes:
        cuda_ids: the CUDA device indices (kind cuda; empty: every device).
        vdevs: one VDevConfig per virtual device (kind vdev): memory, link rate, link group, speed, faults.
        text: the spec as given ("vdev:2x768MiB@4GBps", a JSON text or file name).
        endpoints: the rpc-servers' "HOST:PORT" or "HOST:PORT/N" (kind rpc).
        local: kind rpc: this machine's devices (a cuda or vdev spec), placed before the servers' (None: none).
        kind: (of the class) its name in the registry and in the JSON form: "cpu", "cuda", "vdev" or "rpc".
    """

    kind: ClassVar[str] = ""
    forms: ClassVar[str] = ""            # its lines of the accepted forms (FORMS)
    accelerators: ClassVar[bool] = True  # it names accelerator devices (the CPU alone: not)
    remote: ClassVar[bool] = False       # its devices sit on rpc-servers: a network in between, the servers' own RAM
    default_margin: ClassVar[int] = MARGINS["other"]   # what fit leaves free on each device by default
    default_link_gbps: ClassVar[float] = DEFAULT_LINK_GBPS   # a device's host link where the spec gives none
    # how fast the kind's devices read expert weights in their own memory in decode (GB/s); None: not known, and the
    # expert cache's break-even is not computed for them
    expert_read_gbps: ClassVar[Optional[float]] = None

    cuda_ids: list[int] = field(default_factory=list)
    vdevs: list = field(default_factory=list)
    text: str = ""
    endpoints: list[str] = field(default_factory=list)
    local: Optional["DeviceSpec"] = None

    # -- parsing ----------------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_text(cls, text: str) -> Optional["DeviceSpec"]:
        """This kind's spec for a string form.

        Args:
            text: the spec, stripped ("cuda:0,1"; not JSON).
        Returns:
            The spec, or None where the text is none of this kind's forms.
        Raises:
            DeviceSpecError: for one of its forms with a value out of range.
        """

    @classmethod
    @abstractmethod
    def from_dict(cls, d: dict, text: str) -> "DeviceSpec":
        """This kind's spec for the JSON form.

        Args:
            d: the JSON object (its "kind" is this kind's).
            text: the spec as given, for the spec's text and for errors.
        Returns:
            The spec.
        Raises:
            DeviceSpecError: for keys or values it does not take.
        """

    # -- what it names --------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def n_devices(self) -> int:
        """int: the number of devices the spec names (0 where it names them only once they are found: the CPU,
        "cuda" for every device, an rpc-server's)."""

    @property
    def label(self) -> str:
        """A short name for tables and plots: the text as given (a kind may write its JSON form the short way)."""
        return self.text or self.kind

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

    # -- links and what fit needs ------------------------------------------------------------------------------
    def link_rates(self) -> Optional[list[float]]:
        """Each device's host link rate in GB/s as the spec gives it.

        Returns:
            One rate per device (0: unthrottled), or None where the spec gives none (the machine's links).
        """
        return None

    def link_groups(self) -> Optional[list[int]]:
        """Which devices share one host link (a kind that gives link_rates() gives these too).

        Returns:
            One group per device (devices with the same group >= 0 share a link; -1: a link of its own), or None
            where the spec gives no rates.
        """
        return None

    def link_shares(self) -> Optional[list[float]]:
        """Each device's share of its host link: the rate the spec gives, split among the devices of a link group.

        Returns:
            One rate per device (GB/s), or None where the spec gives no rates.
        """
        rates, groups = self.link_rates(), self.link_groups()
        if rates is None:
            return None
        n = Counter(g for g in groups if g >= 0)
        return [r / n[g] if g >= 0 else r for r, g in zip(rates, groups)]

    def fit_check(self, split_mode: str) -> None:
        """Refuse what fit cannot plan on these devices (a kind without accelerators, a device without a memory
        budget, a split mode its devices lack).

        Args:
            split_mode: "layer", "none" or "row".
        """

    @property
    def shares_one_gpu(self) -> bool:
        """bool: the devices are parts of one processor (one GPU split in parts; VDEVs on a CPU with fewer cores than
        their threads): their compute runs side by side on the same cores, so it does not add up as separate
        devices' would (the compute probe runs them together)."""
        return False

    @property
    def one_link(self) -> bool:
        """bool: every device's host copies cross one link (their bytes add up on it)."""
        return False

    def expert_read_rates(self, cpu_gbps: float, n_devices: int) -> Optional[list[float]]:
        """Each device's read of expert weights in its own memory in decode (GB/s), for the expert cache's break-even.

        Args:
            cpu_gbps: the host CPU's decode expert op at the run's thread count (fit's "cpu_expert" rate).
            n_devices: how many devices the plan has.
        Returns:
            One rate per device, or None where the kind's is not known.
        """
        return [self.expert_read_gbps] * n_devices if self.expert_read_gbps else None

    def probe_specs(self, servers: Optional[list] = None) -> list[tuple[list[int], str]]:
        """The device specs the compute probe runs on, with the devices each stands for.

        Args:
            servers: each device's RPC server (HOST:PORT, None for a device of this machine), as a fit plan names
                them; kinds whose devices sit on servers probe there.
        Returns:
            [(device indices, device spec), ...]; here the CPU for every device ([-1]).
        """
        return [([-1], "cpu")]

    def unbuilt(self, backend_modules: set[str]) -> Optional[str]:
        """Why this build cannot run these devices.

        Args:
            backend_modules: the backend modules the build installed (binding.backend_modules()).
        Returns:
            A sentence with the fix, or None where it can.
        """
        return None

    @property
    def notes(self) -> list[str]:
        """What a user should know about how the spec was read (a default it left to us), one sentence each."""
        return []

    def unreachable(self) -> Optional[str]:
        """Why a process cannot use these devices now, found without loading a variant (a server that does not
        answer): checked before any worker starts.

        Returns:
            A sentence with the fix, or None where nothing stands in the way.
        """
        return None

    # -- how a process sets the devices up --------------------------------------------------------------------
    def connect(self, native) -> list[tuple[str, list[str]]]:
        """Connect to the spec's servers (ggml RPC).

        Args:
            native: the loaded variant.
        Returns:
            (endpoint, the names of the devices used there) per server; none for devices of this machine.
        """
        return []

    @abstractmethod
    def register(self, native, servers: Optional[list] = None) -> str:
        """Set up the devices in this process (registered once per process where the kind needs it).

        Args:
            native: the loaded variant.
            servers: what connect() returned (default: connect where the spec has servers).
        Returns:
            The device names for pp_model_params.devices, comma-separated ("none": CPU only).
        Raises:
            DeviceSpecError: where the devices cannot be set up.
        """

    def device_counters(self, native) -> list[dict]:
        """The counters of devices of ours (VDEV) since the last reset.

        Args:
            native: the loaded variant.
        Returns:
            One dict per device ("device" and its counters); none for other kinds.
        """
        return []

    def driver_devices(self, found: list[dict]) -> list[dict]:
        """The spec's devices whose driver reports the memory in use (CUDA's cudaMemGetInfo), in the spec's order.

        Args:
            found: list_devices()'s entries.
        Returns:
            The entries of `found` that are such devices of the spec; none for devices whose memory is a budget of
            ours (VDEV) or the host's.
        """
        return []


def from_dict(d: dict, text: str) -> DeviceSpec:
    """The spec of a JSON object, by its "kind" (default DEFAULT_JSON_KIND)."""
    kind = d.get("kind", DEFAULT_JSON_KIND)
    cls = KINDS.get(kind)
    if cls is None:
        raise bad(text, f"unknown kind {kind!r}")
    return cls.from_dict(d, text)


def parse(spec: Union[str, dict, "DeviceSpec", None]) -> DeviceSpec:
    """Parse a device spec, as the API, the CLI and bench/ all understand it (the forms: FORMS).

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
        return parse_part(spec)
    except DeviceSpecError as e:
        if getattr(e, "complete", False):
            raise
        raise bad(spec, str(e)) from None
    except (TypeError, ValueError) as e:
        raise bad(spec, str(e)) from None


def parse_part(spec: Union[str, dict, "DeviceSpec", Path, None]) -> DeviceSpec:
    """parse() without its wrapping of errors: also for a part of a spec (rpc's devices of this machine)."""
    if isinstance(spec, DeviceSpec):
        return spec
    if spec is None or spec == "":
        return parse_part("cpu")
    if isinstance(spec, dict):
        return from_dict(spec, json.dumps(spec))
    text = str(spec).strip()
    if text.startswith("{"):
        try:
            return from_dict(json.loads(text), text)
        except json.JSONDecodeError as e:
            raise bad(text, f"invalid JSON ({e})") from None
    if text.endswith(".json"):
        try:
            return from_dict(json.loads(Path(text).read_text()), text)
        except OSError as e:
            raise bad(text, f"cannot read the file ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise bad(text, f"invalid JSON ({e})") from None
    for cls in KINDS.values():
        got = cls.from_text(text)
        if got is not None:
            return got
    raise bad(text, "not one of the accepted forms")


def list_devices(variant: Optional[str] = None) -> list[dict]:
    """The devices the loaded variant sees (CPU, CUDA GPUs, registered VDEVs, connected RPC servers' devices).

    Args:
        variant: the variant to load when this process holds none yet (default: "patched"); ignored when one is
            loaded.
    Returns:
        list[dict]: one dict per device: name, description, backend, type, memory_free, memory_total, and its caps
        (async, events, host_buffer).
    Raises:
        VariantError: for an unknown variant.
        BuildError: when the variant to load is not built.
    """
    native = binding.loaded() or binding.load(variant or CONTEXT.variant)
    lib, ffi, s = native.lib, native.ffi, native.str
    out = []
    for i in range(lib.pp_device_count()):
        d = ffi.new("pp_device_info *")
        native.check(lib.pp_device_get(i, d))
        out.append({"name": s(d.name), "description": s(d.description), "backend": s(d.backend), "type": d.type,
                    "memory_free": d.memory_free, "memory_total": d.memory_total, "async": bool(d.caps_async),
                    "events": bool(d.caps_events), "host_buffer": bool(d.caps_host_buffer)})
    return out
