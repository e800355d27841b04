"""bench/lib/launch.py's ports: `pdserve up` given its workers' ports puts their internal listeners on
port + 1, so the ports drawn for it leave those free too (a port + 1 already taken by another
process stopped a CI run's `pdserve up` with EADDRINUSE)."""

from __future__ import annotations

import socket

from bench.lib.launch import up_ports


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_ports_for_up_leave_each_workers_internal_port_free_and_never_repeat():
    for _ in range(20):
        ports = up_ports()
        taken = [ports["proxy"], ports["prefill"], ports["prefill"] + 1, ports["decode"], ports["decode"] + 1]
        assert len(set(taken)) == 5 and all(bindable(port) for port in taken), ports

