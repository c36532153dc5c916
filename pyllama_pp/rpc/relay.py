"""The network between a client and one RPC host on loopback: `Link`, a TCP relay in front of an rpc-server that
counts what crosses it each way and, with a rate, paces it (tests and bench/multihost_ab.py, bench/net_predict.py).
"""
from __future__ import annotations

import socket
import threading
import time


class Link:
    """A loopback TCP relay in front of an RPC server: the network between a client and one host, counted and, with
    a rate, paced (each direction on its own, as a full-duplex link).

    Args:
        target_port: the server's port on `host`.
        gbps: each direction's rate in GB/s (0: as fast as loopback carries it).
        host: where the server listens, and where the relay listens (on a port of its own, `port`).
    Raises:
        OSError: when the relay cannot listen.

    >>> link = Link(50052, gbps=1.0)          # clients connect to rpc://127.0.0.1:{link.port}
    >>> link.bytes_up, link.bytes_down        # client -> server, server -> client
    """

    def __init__(self, target_port: int, gbps: float = 0.0, host: str = "127.0.0.1"):
        self.target = (host, int(target_port))
        self.rate = float(gbps) * 1e9
        self.bytes_up = 0
        self.bytes_down = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(4)
        self.port = self._sock.getsockname()[1]
        self._open: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._open.append(s)
            threading.Thread(target=self._pump, args=(client, server, "bytes_up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "bytes_down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        due = time.monotonic()
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if self.rate > 0:   # (pace: the bytes leave no sooner than the rate allows)
                    due = max(due, time.monotonic()) + n / self.rate
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                dst.sendall(view[:n])
                setattr(self, counter, getattr(self, counter) + n)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop relaying: the listening socket and every open connection are closed."""
        self._closed = True
        for s in [self._sock] + self._open:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
