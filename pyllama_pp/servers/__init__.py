"""This machine's side of ggml RPC above the transport (pyllama_pp.rpc): a server of this machine's devices, and what
fit plans and predicts for devices on servers.

    serve      serve this machine's devices (`pyllama-pp rpc-server`); start a server process (tests, benches)
    planning   what fit plans and predicts for servers: their devices' own copies, host memory, network seconds

This file imports none of them: `serve` imports the device kinds, `planning` the plan.
"""
