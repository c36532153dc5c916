"""The cffi cdef of pyllama_pp's binding, kept in one place.

It is derived from the C headers of the native sub-folder (shim.h, vdev.h), so the C API is written once:
preprocessor lines, comments and the extern "C" braces are dropped, integer #defines are kept, and
declarations that mention ggml types (not part of the Python-facing API) are left out. Used at build time
by native/build_cffi.py; the compiled module carries it afterwards.
"""
from __future__ import annotations

import re
from pathlib import Path

NATIVE = Path(__file__).resolve().parent / "native"
HEADERS = ("vdev.h", "shim.h")


def header_to_cdef(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        code = re.sub(r"//.*$", "", line).rstrip()
        s = code.strip()
        if not s:
            continue
        if s.startswith("#"):
            m = re.fullmatch(r"#define\s+(\w+)\s+(-?\d+)", s)
            if m:
                out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        if s in ('extern "C" {', "}") or "ggml_" in s:
            continue
        out.append(code)
    return "\n".join(out) + "\n"


CDEF = "".join(header_to_cdef((NATIVE / h).read_text()) for h in HEADERS)

if __name__ == "__main__":
    print(CDEF)
