"""Job kind "info": what the variant is (no model)."""
from __future__ import annotations

from ... import binding
from ...devices import list_devices
from ...jobs import InfoJob
from ...session import env_problems
from .base import switch_table


def handle(job: InfoJob) -> dict:
    """The variant's extension version, switch table, system info and devices, and the GGML_SCHED_PP_* variables
    of the environment its switch table does not accept."""
    native = binding.load(job.variant)
    switches = switch_table(native)
    return {"variant": native.variant, "ext_version": native.lib.pp_ext_version(), "switches": switches,
            "env_problems": env_problems(native),
            "system_info": native.str(native.lib.pp_system_info()), "devices": list_devices()}
