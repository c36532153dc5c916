"""The package's floors, lowest first: a module imports only modules on lower floors, so data flows one way and no
import circle is possible (tests/test_layers.py checks every import against this list). docs/DEVELOPING.md shows the
list as `python -m pyllama_pp.layers` prints it (tests/test_layers.py compares them)."""
from __future__ import annotations

# (modules of one floor, what they hold)
FLOORS = (
    (("_version", "errors", "_cdef", "defaults", "layers"),
     "the version; one exception hierarchy; the shim's cdef; the table of defaults; this list"),
    (("binding",), "one variant's cffi module in this process"),
    (("_pin", "devices.base", "params", "counters", "stats", "rpc.network", "rpc.relay", "rpc.client", "expert_trace",
      "workload"),
     "data: the upstream pin, what every device kind shares (`DeviceSpec`, the registry), `Placement` / "
     "`ContextParams` (frozen, checked once), counter sums, statistics (`nmse`, `paired_ci`); ggml RPC's transport: "
     "bytes per ubatch, the loopback relay, the client's side; an expert trace; a `Workload` (steps a user runs)"),
    (("model_file", "switches", "rpc"),
     "a GGUF file: its format, its header read once, a ModelError before native code reads it, the facts fit needs; "
     "the patched build's switches: names, prefix, user values parsed once (`ExpertCache`), how they reach C; the "
     "ggml RPC transport package"),
    (("synth",), "synthetic GGUFs"),
    (("devices.cpu", "devices.cuda", "devices.vdev", "devices.rpc"), "one module per device kind"),
    (("devices",), "the registry of kinds and the public API of device specs"),
    (("plan", "jobs", "row", "expert_cache_sim"),
     "a fit `Plan`; the worker contract (one dataclass per job kind, `Job.load_key`); `Row` (the result row's fields, "
     "types and values, its JSONL/CSV writer, `frame`); expert-cache hit rates simulated on a trace"),
    (("hit_curve", "decode_model"), "the expert cache's hit rate by its size: a trace, a synthetic model's routing, or "
     "a prior; a decoded token's cost by where each layer's experts are (the hybrid's split as the simulator's)"),
    (("session", "servers.planning", "servers.serve", "expert_cache_plan", "overlap_plan", "layer_major_plan"),
     "`Session` over two owners, `LoadedModel` and `Context`; fit's sums for RPC servers; a server of this machine's "
     "devices; one planner per mechanism: the device expert cache, OVERLAP's early copies, LAYER_MAJOR's groups"),
    (("servers", "predict"),
     "this machine's side of ggml RPC above the transport; fit's model of time per phase (`predict`), from rates and "
     "compute handed in"),
    (("worker.client",), "the parent's side of a worker: `run_job`, `ServingWorker`"),
    (("worker",), "the worker package"),
    (("worker.handlers.base",), "what every job handler shares"),
    (("worker.handlers.info", "worker.handlers.schedule", "worker.handlers.logits", "worker.handlers.measure",
      "worker.handlers.workload", "worker.handlers.fit", "worker.handlers.soak", "worker.handlers.trace"),
     "one module per job kind: `handle(job) -> dict`"),
    (("worker.handlers",), "the handlers by job kind"),
    (("worker.loop",), "the worker process: `python -m pyllama_pp.worker [--serve]`"),
    (("worker.__main__",), "its entry point"),
    (("compute", "placement"),
     "the compute probe (a layer's compute on a device, measured); fit's placement (its dry runs, with each "
     "mechanism's plan)"),
    (("decode_probe",), "what a decoded token costs on a device, measured on the compute probe's replicas"),
    (("planner", "memory_plan"), "(n_batch, n_ubatch) chosen by predicted throughput, the probe handed in; each "
     "device's memory between resident expert layers and cache slots, by the workload's predicted time"),
    (("fit", "soak", "check", "trace", "about"),
     "fit as users call it (`fit`, `fit_ubatch` with the probe), the soak's API, the logits check, expert traces, what "
     "this install is (`pyllama-pp info`)"),
    (("config",), "A/B configurations: `RunConfig`, `expand`, `config_key`, `load_key`"),
    (("rows", "planning"), "rows from results; a user's choices to frozen RunConfigs and plans (`plan_runs`)"),
    (("runner",), "the A/B runner: `ab`, `interleaved`, `mixed_workload`"),
    (("report",), "Markdown and text tables, the plot"),
    (("cli",), "the `pyllama-pp` command: parse, plan, run, print"),
    (("",), "the public facade, on top"),
)

# section markers in docs/DEVELOPING.md
BEGIN, END = "<!-- layers:begin -->", "<!-- layers:end -->"


def markdown() -> str:
    """The floors as docs/DEVELOPING.md lists them (between its layers markers): a table, lowest first."""
    lines = ["| floor | modules | what |", "| ---: | --- | --- |"]
    for i, (mods, what) in enumerate(FLOORS):
        lines.append(f"| {i} | {', '.join(f'`{m}`' if m else '`__init__`' for m in mods)} | {what} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
