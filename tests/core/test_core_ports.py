"""Free loopback ports: a process that needs two ports (nats-server's client and monitor
ports) must never be handed the same port twice. Probing one port at a time and closing
the probe did hand one out twice, about once in 11,000 pairs; CI saw nats-server refuse
to start on it."""

from __future__ import annotations

import socket

import pytest

from reinforge.core.ports import free_port, free_ports

PAIRS = 60_000  # enough that probing one at a time shows a repeat (expected ~5 here)


def test_the_ports_of_one_draw_are_always_distinct():
    repeats = sum(1 for _ in range(PAIRS) if len(set(free_ports(2))) != 2)
    assert repeats == 0


def test_a_chosen_port_can_be_listened_on():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port


def test_asking_for_no_ports_is_a_clear_error():
    with pytest.raises(ValueError, match="n >= 1"):
        free_ports(0)
