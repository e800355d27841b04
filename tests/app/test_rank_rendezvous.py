"""Rank 0 binds its rendezvous port before any rank starts, and its store listens on that very socket."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from pdserve.app.ranks import bind_rendezvous


def test_the_rendezvous_port_stays_taken_until_the_store_takes_the_socket_over() -> None:
    listener = bind_rendezvous(0)
    port = listener.getsockname()[1]
    intruder = socket.socket()
    intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with pytest.raises(OSError):  # the window a merely "free" port left open is closed
        intruder.bind(("127.0.0.1", port))
    intruder.close()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False, master_listen_fd=listener.detach())
    rank_one = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=10))
    rank_one.set("greeting", "from rank 1")
    assert store.get("greeting") == b"from rank 1"
    assert store.port == port


def test_a_named_port_that_is_in_use_is_refused_at_once() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        with pytest.raises(OSError):
            bind_rendezvous(holder.getsockname()[1])
