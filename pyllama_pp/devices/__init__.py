"""Device specs: which devices a run uses, understood the same way by the API, the CLI and bench/.

Each kind of device is a subclass of `DeviceSpec` in a module of its own (cpu, cuda, vdev, rpc): its forms, how many
devices it names, their links, what fit needs and how a process sets them up. `parse` asks each registered kind in
turn; callers ask the parsed spec (`spec.accelerators`, `spec.link_rates()`, `spec.register(native)`, ...), never its
name. To add a kind: a module with its DeviceSpec subclass, and its class in KINDS below (docs/DEVELOPING.md).

Accepted forms: FORMS (each kind's, in the order of KINDS, then the JSON form).
"""
from __future__ import annotations

from .base import FORMS_HEADING, KINDS, DeviceSpec, forms, list_devices, parse, parse_rate, parse_size
from .cpu import CpuSpec
from .cuda import CudaSpec
from .rpc import RpcSpec, check_baseline_devices
from .vdev import VDevConfig, VdevSpec

KINDS.update((k.kind, k) for k in (CpuSpec, CudaSpec, VdevSpec, RpcSpec))   # the registry, in FORMS order

FORMS = forms()

__all__ = ["DeviceSpec", "FORMS", "FORMS_HEADING", "KINDS", "VDevConfig", "check_baseline_devices", "list_devices",
           "parse", "parse_rate", "parse_size"]
