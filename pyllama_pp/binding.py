"""Loading one variant's native binding (cffi, API mode) into this process.

Both variants ship libraries with the same sonames, so a process holds exactly one of them. The A/B
harness runs each variant in its own worker process (pyllama_pp.worker).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .defaults import CONTEXT
from .errors import (BuildError, DecodeError, DeviceError, DeviceSpecError, ModelError, OutOfMemoryError, PyllamaError,
                     UnsupportedError, VariantError, RPC_LOST, is_device_fault, one_statement)

VARIANTS = ("baseline", "patched")
PACKAGE_DIR = Path(__file__).resolve().parent


def _installed_dir(name: str) -> Path:
    """Where the build put pyllama_pp/<name> (the package folder, or site-packages for editable installs)."""
    try:
        spec = importlib.util.find_spec(f"pyllama_pp.{name}")
    except ImportError:
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        return Path(loc)
    # imported from a source checkout (e.g. `python -m pytest` in the repo): use the installed build
    for entry in sys.path:
        cand = Path(entry or ".") / "pyllama_pp" / name
        if cand.is_dir() and cand.resolve() != (PACKAGE_DIR / name).resolve():
            return cand
    return PACKAGE_DIR / name


VARIANTS_DIR = _installed_dir("_variants")
BACKENDS_DIR = _installed_dir("_backends")

_loaded: "Native | None" = None


@dataclass
class Native:
    """The loaded variant: its name, cffi `ffi` and `lib`."""

    variant: str
    ffi: Any
    lib: Any

    def check(self, rc: int) -> int:
        """Raise the exception matching a negative shim return code (with the shim's message)."""
        if rc >= 0:
            return rc
        msg = self.ffi.string(self.lib.pp_last_error()).decode(errors="replace")
        raise error_for(self.lib, rc, msg)

    def last_error(self) -> str:
        return self.ffi.string(self.lib.pp_last_error()).decode(errors="replace")

    def str(self, cdata) -> str:
        return self.ffi.string(cdata).decode(errors="replace")


def error_for(lib, rc: int, msg: str) -> PyllamaError:
    if is_device_fault(msg):
        fix = (". Fix: restart `pyllama-pp rpc-server` there, then make a new Session (this one's calls on it fail)"
               if RPC_LOST in msg else "")
        return DeviceError(one_statement(msg) + fix)
    return {
        lib.PP_ERR_ARG: DeviceSpecError if "device" in msg else DecodeError if "token" in msg else PyllamaError,
        lib.PP_ERR_MODEL: ModelError,
        lib.PP_ERR_MEMORY: OutOfMemoryError,
        lib.PP_ERR_DEVICE: DeviceSpecError,
        lib.PP_ERR_DECODE: DecodeError,
        lib.PP_ERR_UNSUPPORTED: UnsupportedError,
    }.get(rc, PyllamaError)(one_statement(msg) if msg else f"error {rc}")


def installed_json(name: str, default: dict) -> dict:
    """A JSON file the build installed next to the variants (build_info.json, pin.json), or `default`."""
    try:
        return json.loads((VARIANTS_DIR / name).read_text())
    except (OSError, ValueError):
        return default


def backend_modules() -> set[str]:
    """Backend modules by name (CPU, CUDA, RPC, ...): the shared ones in the backends folder (built with both
    variants, or a CUDA module dropped in afterwards: bench/gpu_run.sh with a carried one) and each variant's own
    (RPC, whose protocol is the variant's)."""
    files = list(BACKENDS_DIR.glob("libggml-*.so")) + list(VARIANTS_DIR.glob("*/libggml-*.so"))
    return {f.name[len("libggml-"):-len(".so")].split("-")[0].upper() for f in files
            if f.name != "libggml-base.so"}


def build_info() -> dict:
    """How the package was built (CUDA on or off, the compiler, ...), as the build wrote it.

    Returns:
        dict: build_info.json's fields; empty when the build wrote none.
    """
    return installed_json("build_info.json", {})


def available_variants() -> list[str]:
    """The variants whose native module this installation has.

    Returns:
        list[str]: "baseline" and/or "patched", in that order; empty when neither is built.
    """
    return [v for v in VARIANTS if any((VARIANTS_DIR / v).glob("_native*.so"))]


def log_level_from_env() -> int:
    try:
        return int(os.environ.get("PYLLAMA_PP_LOG", "1"))
    except ValueError:
        return 1


def load(variant: str = CONTEXT.variant) -> Native:
    """Load a variant's native library into this process; loading it again returns the same object.

    Both variants ship libraries with the same names, so a process holds one of them; the worker
    (pyllama_pp.worker) runs the other in its own process.

    Args:
        variant: "patched" (default) or "baseline".
    Returns:
        Native: the loaded variant (its name, cffi `ffi` and `lib`).
    Raises:
        VariantError: for an unknown variant, or the other variant when this process holds one already.
        BuildError: when the variant is not built, or its native module cannot be loaded.
        PyllamaError: when the native library fails to initialise (the shim's message).
    """
    global _loaded
    if variant not in VARIANTS:
        raise VariantError(f"unknown variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    if _loaded is not None:
        if _loaded.variant != variant:
            raise VariantError(
                f"this process already loaded the {_loaded.variant!r} variant; both variants share library "
                f"names, so one process holds one. Run {variant!r} in another process "
                "(pyllama_pp.worker / `pyllama-pp run --variant`).")
        return _loaded
    if variant not in available_variants():
        raise BuildError(f"the {variant!r} variant is not built in {VARIANTS_DIR}: install the package with "
                         "`pip install .` from the source tree (it builds both variants).")
    try:
        # by file: the package may be imported from a source checkout while the build lives in site-packages
        so = sorted((VARIANTS_DIR / variant).glob("_native*.so"))[0]
        spec = importlib.util.spec_from_file_location(f"pyllama_pp._variants.{variant}._native", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as e:
        raise BuildError(f"could not load the {variant!r} variant's native module: {e}") from e
    native = Native(variant, mod.ffi, mod.lib)
    rc = native.lib.pp_init(str(BACKENDS_DIR).encode(), log_level_from_env())
    native.check(rc)
    _loaded = native
    return native


def loaded() -> "Native | None":
    return _loaded
