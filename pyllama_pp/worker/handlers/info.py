"""Job kind "info": what the variant is (no model)."""
from __future__ import annotations

from ... import binding
from ...devices import list_devices
from ...jobs import InfoJob
from ...session import env_problems


def handle(job: InfoJob) -> dict:
    """The variant's extension version, switch table, system info and devices, and the GGML_SCHED_PP_* variables
    of the environment its switch table does not accept."""
    native = binding.load(job.variant)
    switches = []
    if native.lib.pp_ext_version() > 0:
        ffi = native.ffi
        name, desc, val = ffi.new("char[64]"), ffi.new("char[512]"), ffi.new("int64_t *")
        typ, values, lo, hi, dflt = ffi.new("char[16]"), ffi.new("char[64]"), ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int64_t *")
        for i in range(64):
            if native.lib.pp_ext_param_info(i, name, 64, val, desc, 512) != 0:
                break
            native.check(native.lib.pp_ext_param_spec(i, typ, 16, dflt, lo, hi, values, 64))
            accepted = [int(v) for v in native.str(values).split(",") if v]
            switches.append({"name": native.str(name), "type": native.str(typ), "default": int(dflt[0]),
                             "min": int(lo[0]), "max": int(hi[0]), "values": accepted or None,
                             "meaning": native.str(desc), "value": int(val[0])})
    return {"variant": native.variant, "ext_version": native.lib.pp_ext_version(), "switches": switches,
            "env_problems": env_problems(native),
            "system_info": native.str(native.lib.pp_system_info()), "devices": list_devices()}
