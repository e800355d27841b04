"""Multi-host tensor-parallel rendezvous (issue 36, item 5): rank 0's store listens on --tp-master-addr
only, and a control record is unpickled only once its HMAC, keyed by the internal token, checks out.
torch.distributed is faked where a test plays the network; the codec is the real one."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch

from pdserve.parallel import ranks as ranks_module
from pdserve.parallel.control import ControlRecordRejected, control_key, is_loopback, seal, unseal
from pdserve.parallel.ranks import RankGroup

CPU = torch.device("cpu")
RAN = []


class Planted:
    """What an intruder would send: unpickling it runs code."""

    def __reduce__(self):
        return (RAN.append, ("planted code ran",))


class FakeStore:
    """A rendezvous store where the one other rank has already checked in."""

    def add(self, key: str, amount: int) -> int:
        return 1


class FakeDistributed:
    """torch.distributed as far as RankGroup uses it, in one process: what a follower receives is what
    the test (standing in for whoever reached the ranks' connections) put on the wire."""

    def __init__(self, wire: bytes = b""):
        self.wire = wire
        self.store_args: dict = {}

    def TCPStore(self, *args, **kwargs):  # noqa: N802 - torch's name
        self.store_args = kwargs
        return FakeStore()

    def init_process_group(self, *args, **kwargs):
        pass

    def broadcast(self, tensor, src, group=None):
        if tensor.dtype == torch.int64:
            tensor[0] = len(self.wire)
        else:
            tensor.copy_(torch.frombuffer(bytearray(self.wire), dtype=torch.uint8))

    def broadcast_object_list(self, box, src, group=None):  # what the code before issue 36 called
        box[0] = pickle.loads(self.wire)


@pytest.fixture
def fake_dist(monkeypatch):
    fake = FakeDistributed()
    monkeypatch.setattr(ranks_module, "dist", fake)
    return fake


def test_rank_zeros_store_listens_on_the_master_address_only(fake_dist):
    RankGroup(0, 2, "127.0.0.2", 0, 5.0, CPU, internal_token="t0ken")
    fd = fake_dist.store_args["master_listen_fd"]
    with socket.socket(fileno=fd) as listener:
        assert listener.getsockname()[0] == "127.0.0.2"  # not 0.0.0.0


def test_ranks_meeting_off_loopback_without_a_token_are_refused(fake_dist):
    with pytest.raises(ValueError, match="--internal-token"):
        RankGroup(1, 2, "10.11.12.13", 29500, 5.0, CPU)
    assert not is_loopback("10.11.12.13") and is_loopback("127.0.0.1") and is_loopback("localhost")


def test_a_follower_never_unpickles_a_record_without_the_right_tag(fake_dist):
    follower = RankGroup(1, 2, "127.0.0.1", 29500, 5.0, CPU, internal_token="t0ken")
    fake_dist.wire = pickle.dumps(Planted())  # a bare pickle, as the ranks sent before issue 36
    with pytest.raises(ControlRecordRejected):
        follower.broadcast()
    fake_dist.wire = seal(control_key("other token", "127.0.0.1"), Planted(), 2, 0)  # keyed by another token
    with pytest.raises(ControlRecordRejected):
        follower.broadcast()
    assert RAN == []


def test_a_follower_takes_rank_zeros_sealed_record(fake_dist):
    follower = RankGroup(1, 2, "127.0.0.1", 29500, 5.0, CPU, internal_token="t0ken")
    fake_dist.wire = seal(control_key("t0ken", "127.0.0.1"), {"step": [1, 2]}, 1, 0)
    assert follower.broadcast() == {"step": [1, 2]}
    with pytest.raises(ControlRecordRejected):  # the same record again: a replay
        follower.broadcast()


def test_a_sealed_record_is_bound_to_its_place_and_sender():
    key = control_key("t0ken", "10.0.0.1")
    sealed = seal(key, ("report", 3), 7, 2)
    assert unseal(key, sealed, 7, 2) == ("report", 3)
    for sequence, sender in ((8, 2), (7, 1)):
        with pytest.raises(ControlRecordRejected):
            unseal(key, sealed, sequence, sender)
    tampered = bytearray(sealed)
    tampered[-1] ^= 1
    with pytest.raises(ControlRecordRejected):
        unseal(key, bytes(tampered), 7, 2)
    with pytest.raises(ControlRecordRejected):
        unseal(key, sealed[:10], 7, 2)
