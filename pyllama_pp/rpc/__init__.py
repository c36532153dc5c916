"""llama.cpp's ggml RPC: devices of other hosts used as this process's own, and this host's devices served to others.

    client     the client's side in this process: connect to servers, ask them for their host memory and network
    server     serve this machine's devices (`pyllama-pp rpc-server`); start a server process (tests, benches)
    relay      `Link`: a loopback relay in front of a server that counts and paces the network
    network    the bytes a ubatch sends over the network (fit's predictions and bench/multihost_paper.py)
    planning   what fit plans and predicts for servers: their devices' own copies, host memory, network seconds

The device spec `rpc://HOST:PORT` is the rpc kind of pyllama_pp.devices (devices/rpc.py); the native side is
pyllama_pp/native/rpc.cpp. This file imports none of them: the rpc kind imports `client`, and `server` imports the
device kinds.
"""
