"""What fit plans and predicts for devices on rpc-servers: the room each patched server's device keeps for its own
expert copies, each server's host memory against the plan's share of it, and the seconds per ubatch on the network
to each server (from the byte model, pyllama_pp.rpc.network, and the rates fit measured).
"""
from __future__ import annotations

from ..errors import OutOfMemoryError
from ..model_file import expert_bytes_per_layer
from ..plan import MiB, Plan
from ..rpc import network


def server_copy_bytes(model, spec, variant: str, rpc_host: bool) -> int:
    """What a patched RPC server's device needs beside what the client allocates there: the server copies the host
    experts of its layers in (RPC_HOST), into a scheduler of its own - with OVERLAP=2 (the server's default) two expert
    tensors at a time. The client's dry run does not see those copies; fit keeps room for them in each device's
    margin.

    Args:
        model: the GGUF file.
        spec: the parsed device spec.
        variant: "patched" or "baseline".
        rpc_host: whether the patched switch RPC_HOST is on (its default).
    Returns:
        The bytes per device; 0 for devices of this machine, the baseline, or RPC_HOST=0.
    """
    if not spec.remote or variant != "patched" or not rpc_host:
        return 0
    return int(2 * expert_bytes_per_layer(model) / 3 * 1.02) + 4096   # (the largest of three alike, padded)


def check_server_host_memory(plan: Plan, expert_bytes: float) -> str:
    """Each patched RPC server keeps the host experts of its devices' layers in its own RAM (RPC_HOST): the plan's
    share of each server against the host memory that server reported free.

    Args:
        plan: a fit plan whose devices carry their server and its free host memory (DevicePlan.server_host_free).
        expert_bytes: bytes of one layer's expert tensors.
    Returns:
        A sentence for the plan (Plan.copies): each server's share and what it has free.
    Raises:
        OutOfMemoryError: where a server's share is more than it has free.
    """
    need: dict[str, int] = {}
    free: dict[str, int] = {}
    for d in plan.devices:
        if d.server_host_free is not None:
            need[d.server] = need.get(d.server, 0) + int(d.host_expert_layers * expert_bytes)
            free[d.server] = d.server_host_free
    for server, n in need.items():
        if n > free[server]:
            raise OutOfMemoryError(
                f"the RPC server at {server} has {free[server] / MiB:.1f} MiB of host memory free for host experts, "
                f"and this plan keeps {n / MiB:.1f} MiB of them there. Fix: free memory on that host or start its "
                f"server with a larger --host-ram, add a host, or run with fewer layers' experts on the host")
    return "".join(f"; server {k}: {n / MiB:.1f} of its {free[k] / MiB:.1f} MiB free host memory for its experts"
                   for k, n in need.items())


def network_seconds(plan: Plan, hidden: int, n_tokens: int) -> tuple[list, dict]:
    """Seconds per ubatch on the network to each RPC device's server, from the byte model (pyllama_pp.rpc.network)
    and the rates fit measured. The baseline's client computes the host experts of an RPC device's layers itself: a
    round trip of the hidden state per such layer.

    Args:
        plan: a fit plan (its devices' servers, layers and measured networks; n_ubatch; the variant).
        hidden: the model's hidden size (n_embd); 0: nothing is counted.
        n_tokens: the prompt's length.
    Returns:
        (each device's seconds, its way up and down: 0 for a device of this machine or one not measured; each
        server's devices' indices).
    """
    ub = plan.ctx["n_ubatch"]
    n_kv = network.n_kv_mean(n_tokens, ub)
    devs = plan.devices
    per_device, servers = [0.0] * len(devs), {}
    for i, d in enumerate(devs):
        net = d.server_net or {}
        if not (d.server and hidden and net.get("up_gbps", 0) > 0 and net.get("down_gbps", 0) > 0):
            continue
        up, down = network.device_bytes(
            hidden, ub, n_kv, d.n_layers, act_in=i == 0 or devs[i - 1].server != d.server,
            act_out=not d.output_layer and (i + 1 == len(devs) or devs[i + 1].server != d.server),
            round_trips=d.host_expert_layers if plan.variant == "baseline" else 0)
        per_device[i] = up / (net["up_gbps"] * 1e9) + down / (net["down_gbps"] * 1e9)
        servers.setdefault(d.server, []).append(i)
    return per_device, servers
