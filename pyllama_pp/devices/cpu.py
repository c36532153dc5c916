"""The CPU alone: no accelerator (the spec "cpu", None or "")."""
from __future__ import annotations

from typing import Optional

from ..errors import DeviceSpecError
from .base import DeviceSpec


class CpuSpec(DeviceSpec):
    """The host's CPU device only: llama.cpp places no layer elsewhere."""

    kind = "cpu"
    forms = """
  cpu                              CPU only (no accelerator)"""
    accelerators = False

    @classmethod
    def from_text(cls, text: str) -> Optional["CpuSpec"]:
        """The spec for "cpu" (any case); None for other text."""
        return cls(text=text) if text.lower() == "cpu" else None

    @classmethod
    def from_dict(cls, d: dict, text: str) -> "CpuSpec":
        """The spec for {"kind": "cpu"}."""
        return cls(text=text)

    @property
    def n_devices(self) -> int:
        """int: 0 (the CPU is not an accelerator)."""
        return 0

    def fit_check(self, split_mode: str) -> None:
        """fit places layers on accelerators, and the CPU is none.

        Raises:
            DeviceSpecError: always.
        """
        raise DeviceSpecError("fit places layers on accelerators, and the device spec 'cpu' has none: "
                              "give --devices cuda, cuda:0,1 or vdev:2x768MiB@4GBps")

    def register(self, native, servers: Optional[list] = None) -> str:
        """Nothing to set up: "none" (the model's devices: no accelerator)."""
        return "none"
