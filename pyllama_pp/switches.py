"""The patched build's scheduler switches as Python knows them: their names, the environment prefix, the user's
values parsed once, and the one way they reach C.

The switch table itself (type, default, range, meaning) lives in the patched library and is printed by `pyllama-pp
info`; Python names only the switches it plans with. A run hands its switches to C through the job's `switches`
(the worker sets them with `pp_ext_set_param` before it makes a scheduler), and so does a fit's dry run: `to_env`
is only for tools that start processes of their own (bench scripts, an RPC server's environment).

`--expert-cache` is parsed here once, into an `ExpertCache` the immutable choices keep: "auto" (fit plans it), a
size (MiB a device: "512MiB", "2GiB") or a slot count a layer ("16slots"; the switch's own form, -16, too), or 0; or a
comma list of sizes, slot counts and 0s, one per device in the device spec's order ("16slots,32slots": the switch's
list form, -16,-32), for devices that differ. The cache's guard and hybrid split (EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID)
take one value for every device or a list of one per device too (`per_device`, `one_or_list`, `check_device_lists`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .defaults import FIT
from .devices.base import parse_size
from .errors import ConfigError, DeviceSpecError

#: the environment variables the patched scheduler reads its switches from: PREFIX + NAME
PREFIX = "GGML_SCHED_PP_"

# the switches Python plans with (the table has more: `pyllama-pp info`)
OVERLAP = "OVERLAP"              # early expert copies beside compute (2: a split early)
UPLOAD_ALL = "UPLOAD_ALL"        # whole expert tensors above the coverage bar
UPLOAD_ALL_MIN = "UPLOAD_ALL_MIN"
UPLOAD_ALL_MIN_COV = "UPLOAD_ALL_MIN_COV"
LINKS = "LINKS"                  # host links the devices upload over (0: counted)
RPC_HOST = "RPC_HOST"            # host experts kept on an RPC server
EXPERT_CACHE = "EXPERT_CACHE"    # the device expert cache: MiB a device, or -N slots a layer
EXPERT_CACHE_MIN_HIT = "EXPERT_CACHE_MIN_HIT"   # its guard: percent of hits below which a layer goes to the CPU
EXPERT_HYBRID = "EXPERT_HYBRID"  # its misses split with the host CPU: the CPU's expert rate in percent of the link's
EXPERT_REFILL = "EXPERT_REFILL"  # with it, a decoded token's misses all on the CPU, N of them into slots after it
#: EXPERT_HYBRID's largest value: the host CPU takes a token's misses but one (with EXPERT_REFILL, decode's all)
HYBRID_ALL_CPU = 100000
LAYER_MAJOR = "LAYER_MAJOR"      # a batch's ubatches through each layer together
STAGING = "STAGING"              # pageable uploads through pinned slots (1: the default copier threads, N >= 2: N)
PREFETCH = "PREFETCH"            # expert copies filled a split early (2: two splits early, in lanes of their own)
#: PREFETCH=2's lanes on each GPU: this many copies of a split's first expert weight (VRAM outside the compute buffers)
PREFETCH_LANES = 3
# the switches of type "ints" (one value for every device, or a comma list of one per device): the cache's; a guard's
# or a split's list names every device (read as 0 past its list, they would be off there unsaid)
PER_DEVICE = (EXPERT_CACHE, EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID)
EVERY_DEVICE = (EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID)
# the switches a plan's expert cache sets (fit's memory planner; dropped with the cache)
CACHE_SWITCHES = PER_DEVICE + (EXPERT_REFILL,)

MiB = 1 << 20
MAX_SLOTS = 65536   # EXPERT_CACHE's range: -65536 slots a layer at most
MAX_DEVICES = 15    # ... its list: a value for each device of a scheduler (GGML_SCHED_MAX_BACKENDS less the CPU)


def var(name: str) -> str:
    """The environment variable of switch `name`."""
    return PREFIX + name


def in_env(env: Optional[dict]) -> dict:
    """The switch variables of `env` alone, NAME -> value."""
    return {k[len(PREFIX):]: v for k, v in (env or {}).items() if k.startswith(PREFIX)}


def set_in(env: Optional[dict]) -> dict:
    """The switch variables of this process's environment and `env` (over it; None there: unset), NAME -> text."""
    return in_env({k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})


_INTS = re.compile(r"-?\d+(\s*,\s*-?\d+)*")


def value_of(text):
    """A switch's value from its text: an int, or for a comma list of ints (a switch of type "ints": one per device,
    EXPERT_CACHE's) the list's text without spaces ("-2,-4"); None for anything else."""
    t = str(text).strip()
    if not _INTS.fullmatch(t):
        return None
    return int(t) if "," not in t else ",".join(str(int(x)) for x in t.split(","))


def in_force(variant: str, env: Optional[dict] = None) -> dict:
    """The patched switches the environment sets (this process's, then `env` over it), NAME -> int (a list: its text,
    value_of); {} for the baseline (it reads none). A switch not set takes its table default where it is read."""
    if variant != "patched":
        return {}
    return {k: value_of(v) for k, v in set_in(env).items() if value_of(v) is not None}


def user_set(given: Optional[dict], env: Optional[dict] = None, variant: str = FIT.variant) -> dict:
    """The switches a user set, NAME -> value, whichever way: the GGML_SCHED_PP_* variables (this process's environment,
    then `env` over it) with `given` (--switch, a caller's) over them; for the baseline `given` alone (it reads none).
    Planning reads the environment here, where the switches given enter it, so that a variable is planned as --switch
    is (EXPERT_CACHE as --expert-cache: take_expert_cache); its workers then get them in their jobs (`unset`)."""
    return {**in_force(variant, env), **(given or {})}


def staging_threads(given: Optional[dict]) -> int:
    """The copier threads STAGING sets among the switches `given` (NAME -> value): N for N >= 2, else 0 (the build's
    default, ggml_backend_sched_pp_stage_default_threads, or off); what fit's staging probe copies with."""
    try:
        n = int((given or {}).get(STAGING) or 0)
    except (TypeError, ValueError):
        return 0
    return n if n >= 2 else 0


def unset(env: Optional[dict]) -> dict:
    """`env` with every switch variable of this process's environment and of `env` unset (None: the worker drops it),
    for the workers of a plan whose jobs carry what user_set read from them: no variable acts beside the job's own."""
    return {**(env or {}), **{var(k): None for k in set_in(env)}}


def off_defaults(given: dict, defaults: Optional[dict]) -> dict:
    """The switches of `given`, NAME -> value, whose value differs from the switch table's default (`defaults`, NAME ->
    value, as the run's worker returned them); all of `given` where the defaults are not known (an older result)."""
    if not defaults:
        return dict(given)

    def differs(name, value) -> bool:
        try:
            return int(value) != defaults[str(name).upper()]
        except (KeyError, TypeError, ValueError):
            return True
    return {k: v for k, v in given.items() if differs(k, v)}


def of_run(env: Optional[dict], given: Optional[dict], defaults: Optional[dict]) -> dict:
    """The switches a patched run set, NAME -> value, as rows and tables list them: the variables of this process's
    environment and `env` (the worker's), then `given` over them (`--switch`, a plan's), each only where its value
    differs from the table default (off_defaults): one rule for all three ways a switch is set."""
    return off_defaults({**in_force("patched", env), **(given or {})}, defaults)


def per_device(value, n: int) -> list[int]:
    """A switch of type "ints" as each of `n` devices reads it: one value for every device, or a list's entries in
    order (0 past the list)."""
    v = value_of(value) if isinstance(value, str) else value
    if isinstance(v, str):
        own = [int(x) for x in v.split(",")]
        return (own + [0] * n)[:n]
    return [int(v or 0)] * n


def one_or_list(values: Sequence[int], matters: Optional[Sequence[bool]] = None):
    """The switch value that gives each device its own of `values`: one int where every device it matters for (all,
    where `matters` is not given) takes the same (the others then take it too: it changes nothing there), else the
    comma list's text, one per device (0 where it does not matter)."""
    m = list(matters) if matters is not None else [True] * len(values)
    own = {int(v) for v, x in zip(values, m) if x}
    if len(own) <= 1:
        return own.pop() if own else 0
    return ",".join(str(int(v) if x else 0) for v, x in zip(values, m))


def check_device_lists(given: Optional[dict], n: int, spec: str = "") -> None:
    """Refuse a guard's or a split's list (EXPERT_CACHE_MIN_HIT, EXPERT_HYBRID) whose length is not the `n` devices of
    the spec it runs on (0: a spec that names its devices only once they are found, not checked here; the scheduler
    logs it). EXPERT_CACHE's own list may be shorter (ExpertCache.check_devices).

    Raises:
        ConfigError: naming the switch, the counts and the fix.
    """
    for name in EVERY_DEVICE:
        v = value_of((given or {}).get(name, 0))
        if not n or not isinstance(v, str) or len(v.split(",")) == n:
            continue
        k = len(v.split(","))
        raise ConfigError(f"{name}={v}: {k} values for the {n} device{'s' if n != 1 else ''} of "
                          f"{spec or 'the device spec'}. Fix: one value for every device ({name}={v.split(',')[0]}), "
                          f"or {n} values, one per device in the spec's order")


def to_env(switches: Optional[dict]) -> dict:
    """Switches, NAME -> value, as environment variables (for a process this package does not start as a worker)."""
    return {var(k): str(v) for k, v in (switches or {}).items()}


def parse_given(given: Optional[Iterable[str]]) -> dict:
    """`--switch NAME=VALUE` strings (repeatable) as {NAME: int}, names upper-cased; a comma list of integers (one per
    device, for a switch of type "ints" such as EXPERT_CACHE=-2,-4) as its text (value_of).

    Raises:
        ConfigError: for a string without '=' or a value that is neither an integer nor a list of them.
    """
    switches = {}
    for kv in given or ():
        name, sep, value = str(kv).partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--switch takes NAME=VALUE (e.g. UPLOAD_ALL=0), not {kv!r}")
        if value_of(value) is None:
            raise ConfigError(f"--switch {kv!r}: the value must be an integer (e.g. UPLOAD_ALL=0), or for "
                              f"{', '.join(PER_DEVICE)} a comma list of one per device (e.g. {EXPERT_CACHE}=-2,-4)")
        switches[name.strip().upper()] = value_of(value)
    return switches


_SLOTS = re.compile(r"(\d+)\s*slots?", re.IGNORECASE)


@dataclass(frozen=True)
class ExpertCache:
    """What `--expert-cache` asks of the device expert cache (EXPERT_CACHE, patch 0014).

    Attributes:
        auto: fit plans its size from the memory the plan leaves free.
        mib: MiB a device (EXPERT_CACHE=M), split evenly over the host-expert layers the device owns.
        slots: slots a layer (EXPERT_CACHE=-N), whatever they take.
        devices: one cache per device, in the device spec's order (EXPERT_CACHE=A,B,...: each entry a size, a slot
            count or none; devices past the list: none), for devices that differ.
    At most one is set; none: no cache.
    """

    auto: bool = False
    mib: int = 0
    slots: int = 0
    devices: tuple = ()

    @staticmethod
    def parse(value, variant: str = FIT.variant) -> "ExpertCache":
        """The cache `value` asks for: "auto", a size ("512MiB", "2GiB", bytes as an int), a slot count a layer
        ("16slots", or the switch's own -16), 0 / "0" / None (none), a comma list of sizes, slot counts and 0s, one
        per device ("16slots,32slots", "1GiB,512MiB", "-16,-32"), or an ExpertCache (as it is).

        Raises:
            ConfigError: for a value that is none of these, a size that is not a whole number of MiB, more slots than
                the switch takes, auto in a list, or a cache for the baseline.
        """
        if isinstance(value, ExpertCache):
            cache = value
        elif value is None:
            cache = ExpertCache()
        elif "," in str(value):
            cache = ExpertCache.of_list([ExpertCache._entry(value, i, x) for i, x in enumerate(str(value).split(","))],
                                        value)
        else:
            cache = ExpertCache._parse_text(value)
        if cache and variant != "patched":
            raise ConfigError(f"--expert-cache {value}: the {variant} build has no expert cache (patch 0014). Fix: "
                              "drop --expert-cache, or plan for --variant patched")
        return cache

    @staticmethod
    def of_list(entries, asked=None) -> "ExpertCache":
        """One cache per device from `entries` (ExpertCaches of a size, a slot count or none; none at all: no cache).

        Raises:
            ConfigError: for auto among them (auto plans every device) or a list longer than a scheduler's devices.
        """
        entries = tuple(entries)
        if any(e.auto or e.devices for e in entries):
            raise ConfigError(f"--expert-cache {asked or ','.join(e.text or '0' for e in entries)}: auto plans every "
                              "device; a list takes a size, Nslots or 0 for each device")
        if len(entries) > MAX_DEVICES:
            raise ConfigError(f"--expert-cache {asked}: {len(entries)} values; a scheduler has at most {MAX_DEVICES} "
                              "devices")
        return ExpertCache(devices=entries) if any(entries) else ExpertCache()

    def at(self, i: int) -> "ExpertCache":
        """What the cache asks of device `i` (the device spec's order): a size, a slot count or none."""
        if not self.devices:
            return self
        return self.devices[i] if i < len(self.devices) else ExpertCache()

    def check_devices(self, n: int, spec: str = "") -> None:
        """Refuse a per-device list with more values than the `n` devices of the spec it runs on (0: a spec that
        names its devices only once they are found, "cuda": not checked here; the scheduler logs it).

        Raises:
            ConfigError: naming the count, the devices and the fix.
        """
        if n and len(self.devices) > n:
            raise ConfigError(f"--expert-cache {self.text}: {len(self.devices)} values for the {n} device"
                              f"{'s' if n != 1 else ''} of {spec or 'the device spec'}. Fix: one value per device "
                              "in the spec's order, or one value for every device")

    @staticmethod
    def _entry(value, i: int, text: str) -> "ExpertCache":
        try:
            return ExpertCache._parse_text(text)
        except ConfigError as e:   # (the whole list named, and which of its values)
            raise ConfigError(f"--expert-cache {value}: its value {i + 1} ({text.strip()!r}): "
                              f"{str(e).split(': ', 1)[-1]}") from None

    @staticmethod
    def _parse_text(value) -> "ExpertCache":
        text = str(value).strip()
        if text.lower() == "auto":
            return ExpertCache(auto=True)
        m = _SLOTS.fullmatch(text) or re.fullmatch(r"-(\d+)", text)
        if m:
            n = int(m.group(1))
            if n > MAX_SLOTS:
                raise ConfigError(f"--expert-cache {value}: at most {MAX_SLOTS} slots a layer")
            return ExpertCache(slots=n)
        try:
            size = parse_size(text if isinstance(value, str) else value)
        except DeviceSpecError:
            raise ConfigError(f"--expert-cache {value!r}: give auto (what fit leaves free on each device), a size "
                              "such as 512MiB or 2GiB, slots a layer such as 16slots, or 0 (no cache)") from None
        if size % MiB:
            lo = size // MiB
            raise ConfigError(f"--expert-cache {value}: {size / MiB:.2f} MiB; the cache takes whole MiB a device "
                              f"(EXPERT_CACHE). Fix: give {max(lo, 1)}MiB or {lo + 1}MiB, auto, or 0 (no cache)")
        return ExpertCache(mib=size // MiB)

    def __bool__(self) -> bool:
        return self.auto or self.mib > 0 or self.slots > 0 or any(self.devices)

    @property
    def switch(self):
        """EXPERT_CACHE's value for a size or slot count (0 for auto, which only a plan turns into a value); for a
        per-device list its text, one entry a device ("-16,-32")."""
        if self.devices:
            return ",".join(str(e.switch) for e in self.devices)
        return self.mib or -self.slots

    @property
    def bytes(self) -> int:
        """The bytes a size asks of every device (0 for auto, slots and a per-device list: at(i).bytes)."""
        return self.mib * MiB

    @property
    def text(self) -> str:
        """How plans, rows and messages name it: "auto", "512MiB", "16slots", a per-device list such as
        "16slots,32slots" (0: none on that device), or "" (none)."""
        if self.devices:
            return ",".join(e.text or "0" for e in self.devices)
        return "auto" if self.auto else f"{self.mib}MiB" if self.mib else f"{self.slots}slots" if self.slots else ""

    @staticmethod
    def of_switch(switch) -> "ExpertCache":
        """The cache an EXPERT_CACHE value asks for (M > 0: M MiB a device; -N: N slots a layer; 0: none; a comma
        list: one of those per device).

        Raises:
            ConfigError: for a value that is not an integer or a list of them, or has more slots than the switch takes.
        """
        v = value_of(switch) if isinstance(switch, str) else switch
        if isinstance(v, str):
            return ExpertCache.of_list([ExpertCache.of_switch(x) for x in v.split(",")], switch)
        try:
            v = int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{EXPERT_CACHE}={switch!r}: the value must be an integer (MiB a device, or -N: N "
                              "slots a layer) or a comma list of them, one per device") from None
        return ExpertCache.parse(f"{-v}slots" if v < 0 else f"{v}MiB" if v else 0)


def take_expert_cache(given: dict, asked=None) -> tuple:
    """`--switch EXPERT_CACHE=V` read as `--expert-cache` would be (ExpertCache.of_switch), where the cache is not
    asked otherwise (`asked` None): (the cache, `given` without the switch), so that fit plans it the one way; (asked,
    given) as they are where it is asked (a switch beside it is a conflict its caller names) or not set."""
    if asked is not None or EXPERT_CACHE not in (given or {}):
        return asked, given
    rest = dict(given)
    return ExpertCache.of_switch(rest.pop(EXPERT_CACHE)), rest


def shown(name: str, value) -> str:
    """A switch's value as tables and messages print it: EXPERT_CACHE in --expert-cache's form ("16slots" for -16,
    "512MiB" for 512), the others as they are."""
    if str(name).upper() == EXPERT_CACHE:
        try:
            return ExpertCache.of_switch(value).text or "0"
        except ConfigError:
            pass
    return str(value)


__all__ = ["PREFIX", "var", "in_env", "set_in", "value_of", "in_force", "user_set", "unset", "off_defaults", "of_run",
           "to_env", "parse_given", "per_device", "one_or_list", "check_device_lists", "PER_DEVICE", "EVERY_DEVICE", "CACHE_SWITCHES",
           "ExpertCache", "take_expert_cache", "shown", "OVERLAP", "UPLOAD_ALL", "UPLOAD_ALL_MIN",
           "UPLOAD_ALL_MIN_COV", "LINKS", "RPC_HOST", "EXPERT_CACHE", "EXPERT_CACHE_MIN_HIT", "EXPERT_HYBRID",
           "EXPERT_REFILL", "HYBRID_ALL_CPU", "LAYER_MAJOR", "staging_threads", "STAGING", "PREFETCH", "PREFETCH_LANES"]
