"""The upstream pin and the patch series this installation was built from (written by the build)."""
from __future__ import annotations

import json

from .binding import VARIANTS_DIR


def _load() -> dict:
    try:
        return json.loads((VARIANTS_DIR / "pin.json").read_text())
    except (OSError, ValueError):
        return {"pin": {}, "patches": []}


_DATA = _load()
PIN: dict = _DATA.get("pin", {})
PATCHES: list = _DATA.get("patches", [])
