"""Generate the cffi API-mode C source of pyllama_pp's binding (run by CMake at build time).

The cdef lives in one place, pyllama_pp/_cdef.py; the module is compiled against shim.h and linked with
the variant's shim library, so both variants get the same binding.
"""
import argparse
import importlib.util

import cffi


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cdef", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("_cdef", args.cdef)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ffi = cffi.FFI()
    ffi.cdef(mod.CDEF)
    ffi.set_source("_native", '#include "shim.h"')
    ffi.emit_c_code(args.out)


if __name__ == "__main__":
    main()
