"""The handshake client's bounds and identity checks (pdserve/pd/handshake.py), over an in-process
HTTP transport: an answer over 1 MiB is refused, the per-address cache keeps a bounded number of
peers, and a transport record must name the engine and epoch of its agent info."""

from __future__ import annotations

import httpx
import pytest

from pdserve.api.kv_transfer import KVPullFailed
from pdserve.pd.handshake import MAX_HANDSHAKE_BYTES, HandshakeClient
from pdserve.transfer.fake_transport import FakeFabric
from tests.pd.pd_pair import FakeClock, PrefillSide

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def client(handler, **options) -> HandshakeClient:
    return HandshakeClient("h", None, http_transport=httpx.MockTransport(handler), **options)


def good_params(host: str = "10.0.0.1"):
    side = PrefillSide(FakeFabric(), FakeClock())
    return side, side.prefill("r1", 30).model_copy(update={"remote_host": host})


async def test_a_declared_answer_over_one_mib_is_refused():
    _, params = good_params()
    oversized = lambda request: httpx.Response(200, content=b" " * (MAX_HANDSHAKE_BYTES + 1))  # noqa: E731
    with pytest.raises(KVPullFailed, match="handshake answer of"):
        await client(oversized).peer_for(params)


async def test_a_streamed_answer_is_cut_off_past_one_mib():
    _, params = good_params()
    chunks_sent = []

    async def endless():  # 4 MiB in all: enough to tell a cap from none, without filling memory
        for _ in range(64):
            chunks_sent.append(1)
            yield b" " * 65536

    streamed = lambda request: httpx.Response(200, content=endless())  # noqa: E731  (no content-length)
    with pytest.raises(KVPullFailed, match="over 1048576 bytes"):
        await client(streamed).peer_for(params)
    assert len(chunks_sent) <= MAX_HANDSHAKE_BYTES // 65536 + 2  # read no further than the cap


async def test_the_cache_keeps_the_most_recently_used_peers_only():
    side, params = good_params()
    answer = lambda request: httpx.Response(200, content=side.agent_info().model_dump_json())  # noqa: E731
    handshake = client(answer, max_cached_peers=2)
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        await handshake.peer_for(params.model_copy(update={"remote_host": host}))
    assert handshake.num_cached_peers == 2


async def test_an_answer_whose_transport_record_is_another_engines_is_refused_and_not_cached():
    side, params = good_params()
    info = side.agent_info()
    forged = info.model_copy(update={"transport": {**info.transport, "engine_id": "victim"}})
    handshake = client(lambda request: httpx.Response(200, content=forged.model_dump_json()))
    with pytest.raises(KVPullFailed, match="transport record names engine 'victim'"):
        await handshake.peer_for(params)
    assert handshake.num_cached_peers == 0
