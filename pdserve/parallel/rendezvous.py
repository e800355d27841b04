"""Where rank 0's rendezvous store listens: a socket bound to the one address the ranks meet at.

Invariant: the socket is bound (and listening) before the store, or any other rank, starts, and only
to the address given (never every interface), so no other process can take the port in between and
no other interface of the host exposes the store. Torch-free (the composition root binds it before
torch loads).
"""

from __future__ import annotations

import socket


def listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` (0: a free port), the address `host` resolves to first;
    binding it before the store starts leaves no window for another process to take the port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    return listener
