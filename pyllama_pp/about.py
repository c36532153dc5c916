"""What this install is (`pyllama-pp info`): the pinned upstream tree, each variant with its patches, switch table,
devices and environment problems, and the backends (`about`, `about_text`); the switch table as the README's
Markdown (`switches_markdown`)."""
from __future__ import annotations

from . import _pin
from ._version import __version__
from .binding import VARIANTS, available_variants, backend_modules, build_info
from .defaults import TIMEOUTS
from .errors import PyllamaError, UnsupportedError
from .worker.client import run_job


def accepted_values(sw: dict) -> str:
    """What a switch of the patched build's table accepts, as a user writes it: "0/1", "-1..100", "0, 2"."""
    if sw.get("values"):
        return ", ".join(str(v) for v in sw["values"])
    if sw.get("type") == "bool":
        return "0/1"
    return f"{sw['min']}..{sw['max']}" + (", or a comma list of those, one per device" if sw.get("type") == "ints" else "")


def switches_markdown(switches: list[dict]) -> str:
    """The README's switch section (between <!-- switches:begin --> and <!-- switches:end -->), made from the
    patched library's table (`pyllama-pp info --markdown-switches` prints it)."""
    lines = ["| switch (`GGML_SCHED_PP_<NAME>`, `--switch NAME=V`) | type | default | accepted | meaning |",
             "| --- | --- | --- | --- | --- |"]
    for sw in switches:
        meaning = sw["meaning"].replace("|", "\\|")
        lines.append(f"| `{sw['name']}` | {sw['type']} | {sw['default']} | {accepted_values(sw)} | {meaning} |")
    return "\n".join(lines)


def switch_table() -> list[dict]:
    """The patched build's switch table (one info job): name, type, default, min, max, values, meaning, value.

    Raises:
        UnsupportedError: when the patched variant is not built.
    """
    if "patched" not in available_variants():
        raise UnsupportedError("the switch table is the patched build's, and the patched variant is not built")
    return run_job({"kind": "info"}, "patched", timeout=TIMEOUTS.info).get("switches", [])


def _variant(v: str) -> dict:
    entry = {"name": v, "built": v in available_variants()}
    if entry["built"]:
        try:
            r = run_job({"kind": "info"}, v, timeout=TIMEOUTS.info)
            entry.update(ext_version=r["ext_version"], devices=r["devices"], system_info=r["system_info"],
                         switches=r.get("switches", []), env_problems=r.get("env_problems", []))
        except PyllamaError as e:
            entry["error"] = str(e)
    entry["patches"] = _pin.PATCHES if v == "patched" else []
    return entry


def about() -> dict:
    """This install: version, upstream pin, each variant (built or not, patches, switches, devices, environment
    problems; an info worker each) and the backends (modules built for both variants, and the devices' own)."""
    pin = _pin.PIN
    variants = [_variant(v) for v in VARIANTS]
    backends = sorted(backend_modules() | {d["backend"] for e in variants for d in e.get("devices", [])} | {"VDEV"})
    upstream = {"commit": pin.get("commit"), "commit_date": pin.get("commit_date"),
                "package": f"{pin.get('package')}=={pin.get('version')}", "sha256": pin.get("sha256")}
    return {"version": __version__, "upstream": upstream, "variants": variants, "backends": backends,
            "build": build_info()}


def _variant_lines(e: dict) -> list[str]:
    lines = [f"variant {e['name']}: {'built' if e['built'] else 'NOT BUILT'}"
             + (f", scheduler extension v{e.get('ext_version')}" if e.get("ext_version") else "")]
    lines += [f"  {p}" for p in e["patches"]]
    if e.get("switches"):
        lines.append("  switches (GGML_SCHED_PP_<NAME>=V, --switch NAME=V):")
        lines += [f"    {sw['name']}={sw['value']} ({sw.get('type', 'int')}, default {sw.get('default')}, "
                  f"{accepted_values(sw) if 'min' in sw else '?'}): {sw['meaning']}" for sw in e["switches"]]
    lines += [f"  NOT ACCEPTED (the patched runs would refuse it): {p}" for p in e.get("env_problems", [])]
    lines += [f"  device {d['name']} ({d['backend']}): {d['description']}, {d['memory_total'] / 2**30:.1f} GiB"
              for d in e.get("devices", [])]
    return lines


def about_text(data: dict) -> str:
    """`about()` as `pyllama-pp info` prints it."""
    up = data["upstream"]
    lines = [f"pyllama_pp {data['version']}", f"upstream llama.cpp {up['commit']} ({up['commit_date']}, from "
             f"{up['package']})", f"backends: {', '.join(data['backends'])}"]
    for e in data["variants"]:
        lines += _variant_lines(e)
    return "\n".join(lines)
