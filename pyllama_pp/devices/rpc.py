"""The devices of rpc-servers (llama.cpp's ggml RPC; `pyllama-pp rpc-server`), after this machine's own where the
spec names them first ("cuda:0+rpc://..." or "vdev:...+rpc://...")."""
from __future__ import annotations

import re
from typing import Optional

from ..errors import ConfigError, DeviceSpecError
from ..rpc.client import connect_servers, tcp_probe
from .base import DeviceSpec, bad, from_dict, parse, parse_part

_ENDPOINT = re.compile(r"(?:rpc://)?([A-Za-z0-9._-]+):(\d{1,5})(?:/(\d{1,2}))?")
PREFIX = "rpc://"


def _endpoints(items: list, text: str) -> list[str]:
    """The rpc-servers' "HOST:PORT" (or "HOST:PORT/N": only the server's device N) of an rpc spec, checked (a port
    1..65535; a server either whole or by device, each once)."""
    out: list[str] = []
    for item in items:
        m = _ENDPOINT.fullmatch(item.strip())
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise bad(text, f"bad RPC endpoint {item.strip()!r}: expected HOST:PORT[/DEVICE] with a port 1..65535")
        ep = f"{m.group(1)}:{int(m.group(2))}" + (f"/{int(m.group(3))}" if m.group(3) else "")
        server = ep.split("/")[0]
        if ep in out or (server in out) or ("/" not in ep and any(o.startswith(server + "/") for o in out)):
            raise bad(text, f"the RPC endpoint {ep} is listed twice")
        out.append(ep)
    if len(out) > 16:
        raise bad(text, "at most 16 RPC servers")
    return out


def _local(spec: DeviceSpec, text: str, why: str) -> DeviceSpec:
    """`spec` as the devices of this machine before the servers': accelerators of this machine (cuda, vdev)."""
    if not spec.accelerators or spec.remote:
        raise bad(text, why)
    return spec


def _refuse_unreachable(spec: DeviceSpec) -> None:
    why = spec.unreachable()
    if why:
        raise DeviceSpecError(why)


class RpcSpec(DeviceSpec):
    """The devices of rpc-servers (`endpoints`, in order), after this machine's (`local`, None: none)."""

    kind = "rpc"
    forms = """
  rpc://HOST:PORT                  the devices of an rpc-server (llama.cpp's ggml RPC; `pyllama-pp rpc-server`)
  rpc://10.0.0.2:50052,10.0.0.3:50052  ... of several servers, in this order
  rpc://10.0.0.2:50052/1           ... only a server's device 1 (its devices count from 0)
  cuda:0+rpc://10.0.0.2:50052      this machine's devices first (cuda[:IDS] or vdev:...), then the servers'"""
    remote = True

    @classmethod
    def from_text(cls, text: str) -> Optional["RpcSpec"]:
        """The spec for "rpc://ENDPOINT,..." or "LOCAL+rpc://ENDPOINT,..." (any case); None for other text.

        Raises:
            DeviceSpecError: for a bad endpoint, one listed twice, more than 16, or a part before "+rpc://" that is not
                this machine's accelerators.
        """
        low = text.lower()
        if "+" + PREFIX in low:   # this machine's devices, then the servers'
            head, _, tail = text.partition("+")
            local = _local(parse_part(head), text, f"before +{PREFIX} come this machine's devices (cuda[:IDS] or "
                                                   f"vdev:...), not {head!r}")
            return cls(endpoints=_endpoints(tail.strip()[len(PREFIX):].split(","), text), text=text, local=local)
        if low.startswith(PREFIX):
            return cls(endpoints=_endpoints(text[len(PREFIX):].split(","), text), text=text)
        return None

    @classmethod
    def from_dict(cls, d: dict, text: str) -> "RpcSpec":
        """The spec for {"kind": "rpc", "endpoints": ["HOST:PORT", ...], "local": {a cuda or vdev spec} or null}.

        Raises:
            DeviceSpecError: for no endpoints, bad ones, or a "local" that is not this machine's accelerators.
        """
        eps = d.get("endpoints")
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) for e in eps):
            raise bad(text, "'endpoints' must be a non-empty list of \"HOST:PORT\" strings")
        local = d.get("local")
        if local is not None:
            why = "'local' must be a cuda or vdev spec (this machine's devices)"
            if not isinstance(local, dict):
                raise bad(text, why)
            local = _local(from_dict(local, text), text, why)
        return cls(endpoints=_endpoints(eps, text), text=text, local=local)

    @property
    def n_devices(self) -> int:
        """int: 0 (a server tells its devices only once connected)."""
        return 0

    def unreachable(self) -> Optional[str]:
        """The first server that does not take a TCP connection, with the fix (None: every one does)."""
        for ep in dict.fromkeys(e.split("/")[0] for e in self.endpoints):
            why = tcp_probe(ep)
            if why:
                host, _, port = ep.rpartition(":")
                return (f"cannot reach the RPC server at {ep} ({why}). Fix: start `pyllama-pp rpc-server --host {host} "
                        f"--port {port}` on {host}, or correct the address")
        return None

    def fit_check(self, split_mode: str) -> None:
        """Refuse servers that cannot be reached (before fit's worker starts).

        Raises:
            DeviceSpecError: naming the first server that does not answer, and the fix.
        """
        _refuse_unreachable(self)

    def probe_specs(self, servers: Optional[list] = None) -> list[tuple[list[int], str]]:
        """This machine's devices as their kind probes them, and one device of each server for that server's devices:
        a server computes its devices' layers on its own hardware (the client's CPU stands for none of it).

        Args:
            servers: each device's server (HOST:PORT; None: a device of this machine), as a fit plan names them;
                without them the first server's first device stands for every device.
        Returns:
            [(device indices, device spec), ...]: "rpc://HOST:PORT/N" for a server's devices.
        """
        one = lambda ep: PREFIX + (ep if "/" in ep else ep + "/0")   # (a server's first device, or the one named)
        if not servers:
            return [([-1], one(self.endpoints[0]))]
        local = [i for i, s in enumerate(servers) if s is None]
        out = []
        if local and self.local is not None:
            out += [(local if idx == [-1] else [local[j] for j in idx], spec) for idx, spec in self.local.probe_specs()]
        seen: set = set()
        for ep in self.endpoints:
            server = ep.split("/")[0]
            idx = [i for i, s in enumerate(servers) if s == server]
            if idx and server not in seen:
                seen.add(server)
                out.append((idx, one(ep)))
        return out

    def connect(self, native) -> list[tuple[str, list[str]]]:
        """Connect to the servers (rpc.client.connect_servers).

        Raises:
            DeviceSpecError: for a server that cannot be reached (named with the fix, as `unreachable` says it),
                speaks another protocol, or lacks a device asked for.
        """
        _refuse_unreachable(self)
        return connect_servers(native, self.endpoints)

    def register(self, native, servers: Optional[list] = None) -> str:
        """This machine's devices first, then each server's (connected once per endpoint, unless `servers` gives what
        connect() returned).

        Raises:
            DeviceSpecError: where this machine's devices cannot be set up or a server cannot be used.
        """
        names = self.local.register(native).split(",") if self.local else []
        names += [n for _, served in (servers or self.connect(native)) for n in served]
        return ",".join(names)


def check_baseline_devices(devices, baseline_devices) -> None:
    """The baseline's servers match `devices`: both RPC specs, the same devices of this machine first, as many
    servers, each with the same device form (all of a server's devices, or device N). That they run on the same
    hosts is the caller's to keep (a host's servers listen on different ports). Upstream's client speaks RPC protocol
    7.0 and refuses the patched servers (7.1), so an A/B or a logits check over RPC needs a server of each variant per
    host.

    Raises:
        ConfigError: where they do not match.
        DeviceSpecError: for a spec that does not parse.
    """
    a, b = parse(devices), parse(baseline_devices)
    if not a.remote or not b.remote:
        raise ConfigError(f"baseline devices {baseline_devices!r} are for RPC devices: both --devices and "
                          "--baseline-devices name rpc-servers (rpc://HOST:PORT,...). Fix: drop --baseline-devices")
    local = lambda s: s.local.text if s.local else ""
    dev = lambda e: e.partition("/")[2]
    if local(a) != local(b) or len(a.endpoints) != len(b.endpoints) or \
            [dev(e) for e in a.endpoints] != [dev(e) for e in b.endpoints]:
        raise ConfigError(f"the baseline's devices {baseline_devices!r} do not match {devices!r}: give a baseline "
                          "server for each server, in the same order, with the same devices of this machine first "
                          "(e.g. --devices rpc://h1:50052,h2:50052 --baseline-devices rpc://h1:50053,h2:50053)")
