"""D's peer connections: begun and polled, never waited on; each waiter hears once."""

from __future__ import annotations

import torch

from pdserve.pd.peers import PeerConnections
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from tests.pd.pd_pair import FakeClock


def pair():
    fabric = FakeFabric()
    p = FakeTransport(torch.zeros(8, 16, dtype=torch.int8), "P", fabric)
    d = FakeTransport(torch.zeros(8, 16, dtype=torch.int8), "D", fabric)
    return fabric, p, d


def test_a_connection_is_ready_after_a_poll_and_every_waiter_hears_once():
    _, p, d = pair()
    clock = FakeClock()
    peers = PeerConnections(d, connect_timeout_s=5, clock=clock)
    heard = []
    info = p.local_peer_info("P", "e1")
    peers.ensure(info, heard.append)
    peers.ensure(info, heard.append)
    assert heard == [] and peers.has_pending() and peers.key_for(info.key) is None
    peers.poll()
    assert heard == [None, None] and peers.key_for(info.key) == info.key and not peers.has_pending()
    peers.ensure(info, heard.append)  # already connected: answered at once
    assert heard == [None, None, None]


def test_a_data_path_that_never_answers_is_abandoned_after_the_timeout():
    _, p, d = pair()
    clock = FakeClock()
    d.hold_connects = True
    peers = PeerConnections(d, connect_timeout_s=5, clock=clock)
    heard = []
    info = p.local_peer_info("P", "e1")
    peers.ensure(info, heard.append)
    clock.advance(4.9)
    peers.poll()
    assert heard == []
    clock.advance(0.2)
    peers.poll()
    assert len(heard) == 1 and "within 5 s" in heard[0] and peers.key_for(info.key) is None
    assert not peers.has_pending()


def test_an_unreachable_peer_fails_and_forget_drops_a_ready_one():
    fabric, p, d = pair()
    peers = PeerConnections(d, connect_timeout_s=5, clock=FakeClock())
    heard = []
    info = p.local_peer_info("P", "e1")
    peers.ensure(info, heard.append)
    peers.poll()
    peers.forget(info.key)
    assert peers.key_for(info.key) is None
    fabric.kill("P")
    peers.ensure(info, heard.append)
    peers.poll()
    assert heard[0] is None and "not reachable" in heard[1]


def test_a_waiter_that_raises_does_not_reach_the_engine_thread():
    _, p, d = pair()
    peers = PeerConnections(d, connect_timeout_s=5, clock=FakeClock())
    heard = []

    def broken(error):
        raise RuntimeError("waiter bug")

    info = p.local_peer_info("P", "e1")
    peers.ensure(info, broken)
    peers.ensure(info, heard.append)
    peers.poll()
    assert heard == [None]
