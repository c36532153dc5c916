"""CUDA GPUs: every one ("cuda") or the ones listed ("cuda:0,1"), in the order given."""
from __future__ import annotations

import os
import re
from typing import Optional

from ..defaults import CUDA_EXPERT_READ_GBPS, MARGINS
from ..errors import DeviceSpecError
from .base import DeviceSpec, bad, list_devices

BACKEND = "CUDA"   # the ggml backend registry of these devices, and the module the build installs for them
REBUILD = "Rebuild with CMAKE_ARGS='-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90'"


def _cuda(found: list[dict]) -> list[dict]:
    """The CUDA devices among list_devices()'s entries, in CUDA's order."""
    return [d for d in found if d["backend"] == BACKEND]


class CudaSpec(DeviceSpec):
    """CUDA devices, by index (`cuda_ids`; empty: every device the machine has)."""

    kind = "cuda"
    default_margin = MARGINS["cuda"]   # upstream's fit_params_target
    expert_read_gbps = CUDA_EXPERT_READ_GBPS
    forms = """
  cuda                             every CUDA device
  cuda:0,1                         CUDA devices 0 and 1"""

    @classmethod
    def from_text(cls, text: str) -> Optional["CudaSpec"]:
        """The spec for "cuda" or "cuda:IDS" (any case); None for other text.

        Raises:
            DeviceSpecError: for a device listed twice.
        """
        low = text.lower()
        if low == "cuda":
            return cls(text=text)
        m = re.fullmatch(r"cuda:(\d+(?:,\d+)*)", low)
        if not m:
            return None
        ids = [int(x) for x in m.group(1).split(",")]
        if len(set(ids)) != len(ids):
            raise bad(text, "a CUDA device is listed twice")
        return cls(cuda_ids=ids, text=text)

    @classmethod
    def from_dict(cls, d: dict, text: str) -> "CudaSpec":
        """The spec for {"kind": "cuda", "ids": [...]} ("ids" as a user writes it; "cuda_ids" as to_dict writes it)."""
        return cls(cuda_ids=[int(i) for i in d.get("ids", d.get("cuda_ids")) or []], text=text)

    @property
    def n_devices(self) -> int:
        """int: the devices listed (0 for "cuda": every device, counted once found)."""
        return len(self.cuda_ids)

    @property
    def shares_one_gpu(self) -> bool:
        """bool: GGML_CUDA_DEVICES splits a GPU into that many devices, and the spec uses more than one of them: their
        compute runs side by side on the same multiprocessors, so it does not add up as separate GPUs' would."""
        return int(os.environ.get("GGML_CUDA_DEVICES") or 1) > 1 and (not self.cuda_ids or len(self.cuda_ids) > 1)

    @property
    def one_link(self) -> bool:
        """bool: parts of one GPU (shares_one_gpu) copy over its one link."""
        return self.shares_one_gpu

    def probe_specs(self, servers: Optional[list] = None) -> list[tuple[list[int], str]]:
        """The first device for every device (the devices are taken to be alike), or every device together where they
        are parts of one GPU (shares_one_gpu).

        Returns:
            [(device indices, device spec)]: [-1] for every device of "cuda".
        """
        if self.shares_one_gpu:
            return [(list(range(len(self.cuda_ids))) if self.cuda_ids else [-1], self.label)]
        first = self.cuda_ids[0] if self.cuda_ids else 0
        return [(list(range(max(self.n_devices, 1))) if self.cuda_ids else [-1], f"cuda:{first}")]

    def unbuilt(self, backend_modules: set[str]) -> Optional[str]:
        """Why a build without the CUDA backend module cannot run these devices (None: it has it)."""
        if BACKEND in backend_modules:
            return None
        return f"this build has no CUDA backend. {REBUILD}, or use --devices cpu / vdev:2x768MiB@4GBps"

    def register(self, native, servers: Optional[list] = None) -> str:
        """The names of the CUDA devices the spec uses (the CUDA backend registers them itself).

        Raises:
            DeviceSpecError: where the build or the machine has no CUDA device, or not the ones listed.
        """
        cuda = _cuda(list_devices())
        if not cuda:
            raise DeviceSpecError(f"no CUDA device found: this build has no CUDA backend or the machine has no GPU. "
                                  f"{REBUILD} or use --devices cpu / vdev:2x768MiB@4GBps")
        ids = self.cuda_ids or list(range(len(cuda)))
        missing = [i for i in ids if i >= len(cuda)]
        if missing:
            raise DeviceSpecError(f"CUDA device(s) {missing} do not exist; this machine has {len(cuda)}")
        return ",".join(cuda[i]["name"] for i in ids)

    def driver_devices(self, found: list[dict]) -> list[dict]:
        """The CUDA devices the spec uses, as `found` lists them (CUDA reports their memory in use)."""
        cuda = _cuda(found)
        return [cuda[i] for i in (self.cuda_ids or range(len(cuda)))]
