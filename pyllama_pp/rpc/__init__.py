"""llama.cpp's ggml RPC, the transport: devices of other hosts used as this process's own.

    client     the client's side in this process: connect to servers, ask them for their host memory and network
    relay      `Link`: a loopback relay in front of a server that counts and paces the network
    network    the bytes a ubatch sends over the network (fit's predictions and bench/multihost_paper.py)

The device spec `rpc://HOST:PORT` is the rpc kind of pyllama_pp.devices (devices/rpc.py); the native side is
pyllama_pp/native/rpc.cpp; a server of this machine's devices and fit's sums for servers are pyllama_pp.servers. This
file imports none of its modules: the rpc kind imports `client`.
"""
