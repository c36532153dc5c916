"""The GPU scripts' clock: seconds since the script started, on every log line and in every budget check (a
device call has a hard limit, so each step asks what is left before it starts)."""
from __future__ import annotations

import time

T0 = time.time()


def left(budget: float) -> float:
    """Seconds of `budget` (counted from the start) not yet used."""
    return budget - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)
