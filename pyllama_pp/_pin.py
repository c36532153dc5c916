"""The upstream pin and the patch series this installation was built from (written by the build)."""
from __future__ import annotations

from .binding import installed_json

_DATA = installed_json("pin.json", {"pin": {}, "patches": []})
PIN: dict = _DATA.get("pin", {})
PATCHES: list = _DATA.get("patches", [])
