"""D's and P's async-side admission: params checked against the handshake, peers connected before the
engine sees a request, failed peers remembered with a backoff, outcomes per failure policy."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import httpx
import pytest

from pdserve.api.errors import InvalidRequest
from pdserve.api.kv_transfer import (KVParamsInvalid, KVParamsStale, KVPullFailed, RemoteDecodeRequest,
                                     RemotePrefillParams, parse_kv_transfer_params)
from pdserve.api.sampling import SamplingParams
from pdserve.pd.admission import DecodeAdmission, PeerFailureMemory, PrefillAdmission, pairing_problem
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, plan_groups
from pdserve.pd.handshake import HandshakeClient, compatibility_document, compatibility_hash, incompatibilities
from pdserve.pd.peer_trust import KVPeerNotAllowed, PeerAllowList
from pdserve.request import GenerationRequest
from pdserve.transfer.fake_transport import FakeFabric
from pdserve.transfer.ranked_transport import encode_ranks
from tests.pd.pd_pair import BLOCK, PLAN, FakeClock, PrefillSide
from tests.transfer.ucx_packing import Device, nixl_metadata, tcp_device, tcp_loopback_device, worker_address

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class StubPrefill:
    """Answers the handshake like a prefill worker (or fails as told); counts the calls."""

    def __init__(self):
        self.side = PrefillSide(FakeFabric(), FakeClock())
        self.status = 200
        self.calls = 0
        self.metadata = None  # bytes: the transport record's agent metadata instead of the fake's

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.status != 200:
            return httpx.Response(self.status)
        info = self.side.agent_info()
        if self.metadata is not None:
            info.transport["agent_metadata"] = base64.b64encode(self.metadata).decode()
        return httpx.Response(200, content=info.model_dump_json())

    def params(self, num_prompt: int = 30, **changes) -> RemotePrefillParams:
        params = self.side.prefill(f"r{self.calls}-{num_prompt}", num_prompt)
        return params.model_copy(update=changes)


class Connector:
    def __init__(self):
        self.error = None
        self.calls = 0

    async def __call__(self, peer):
        self.calls += 1
        return self.error


def admission(stub: StubPrefill, connect: Connector, policy: str = "recompute", clock=None,
              answer_after_s: float = 0.0) -> DecodeAdmission:
    async def slow_handler(request: httpx.Request) -> httpx.Response:  # a handshake that takes time on the wire
        await asyncio.sleep(answer_after_s)
        return stub.handler(request)

    handler = slow_handler if answer_after_s else stub.handler
    handshake = HandshakeClient("h", None, http_transport=httpx.MockTransport(handler))
    memory = PeerFailureMemory(clock=clock or FakeClock())
    return DecodeAdmission(handshake, PLAN, BLOCK, policy, connect, memory)


def request(params, num_prompt: int = 30) -> GenerationRequest:
    return GenerationRequest("req", tuple(range(10, 10 + num_prompt)), SamplingParams(), kv_params=params)


async def test_valid_params_from_a_connected_peer_become_a_remote_source():
    stub, connect = StubPrefill(), Connector()
    admitted = await admission(stub, connect).admit(request(stub.params()))
    assert admitted.kv_params is None and admitted.remote is not None
    assert admitted.remote.agent.engine_id == "P" and connect.calls == 1


async def test_a_prompt_of_another_length_is_a_400():
    stub = StubPrefill()
    with pytest.raises(KVParamsInvalid, match="num_prompt_tokens"):
        await admission(stub, Connector()).admit(request(stub.params(30), num_prompt=31))


async def test_a_tp_size_the_prefill_worker_does_not_run_is_a_400_before_any_connection():
    stub, connect = StubPrefill(), Connector()
    with pytest.raises(KVParamsInvalid, match="tp_size is 2 but prefill worker P runs 1 tensor-parallel ranks"):
        await admission(stub, connect).admit(request(stub.params(tp_size=2)))
    assert stub.calls == 1 and connect.calls == 0


async def test_block_lists_that_do_not_fit_the_prompt_are_a_400():
    stub = StubPrefill()
    params = stub.params()
    short = params.model_copy(update={"remote_block_ids": [ids[1:] for ids in params.remote_block_ids]})
    with pytest.raises(KVParamsInvalid, match="non-null blocks"):
        await admission(stub, Connector()).admit(request(short))


async def test_a_prefill_block_size_that_does_not_divide_ours_is_a_400_that_says_so():
    stub, connect = StubPrefill(), Connector()
    info = stub.side.agent_info()
    odd = info.model_copy(update={"geometry": info.geometry.model_copy(update={"block_size": BLOCK + 1})})
    stub.handler = lambda request: httpx.Response(200, content=odd.model_dump_json())
    with pytest.raises(KVParamsInvalid, match=f"block sizes {BLOCK} here and {BLOCK + 1} there: one must divide"):
        await admission(stub, connect).admit(request(stub.params()))
    assert connect.calls == 0


def test_one_pairing_rule_serves_p_to_d_and_peer_pulls_and_names_what_does_not_pair():
    """`pairing_problem`: any TP sizes pair (each rank reads its heads' slice), block sizes only when one
    divides the other, recurrent state only between TP sizes that split it."""
    full = plan_groups([FullAttentionSpec(), FullAttentionSpec()])
    agent = PrefillSide(FakeFabric(), FakeClock(), plan=full).agent_info()
    for their_ranks, our_ranks in ((2, 1), (1, 2), (4, 2)):
        assert pairing_problem(agent.model_copy(update={"tp_size": their_ranks}), full, BLOCK, our_ranks) is None
    assert pairing_problem(agent, full, 2 * BLOCK) is None
    odd = agent.model_copy(update={"geometry": agent.geometry.model_copy(update={"block_size": BLOCK + 2})})
    assert pairing_problem(odd, full, BLOCK) == (f"cannot hand its KV to this worker: block sizes {BLOCK} here and "
                                                 f"{BLOCK + 2} there: one must divide the other (KV moves in units "
                                                 f"of the smaller block)")
    state = RecurrentStateSpec("gated_delta_net", conv_channels=16, conv_window=3, recurrent_shape=(4, 2, 2),
                               conv_parts=(4, 4, 8))
    hybrid = plan_groups([state, FullAttentionSpec()], attention_layer_bytes=64)
    assert pairing_problem(agent.model_copy(update={"tp_size": 2}), hybrid, BLOCK) is None
    assert pairing_problem(agent.model_copy(update={"tp_size": 3}), hybrid, BLOCK) == (
        "runs 3 tensor-parallel rank(s), this worker 1: 3 ranks do not divide part 0 of a state layer "
        "(4 rows: conv channels or heads)")


async def test_block_lists_are_checked_in_the_prefill_workers_block_size():
    """A peer paging in blocks twice ours sends half as many ids per group."""
    stub, connect = StubPrefill(), Connector()
    info = stub.side.agent_info()
    doubled = info.model_copy(update={"geometry": info.geometry.model_copy(update={"block_size": BLOCK * 2})})
    stub.handler = lambda request: httpx.Response(200, content=doubled.model_dump_json())
    params = stub.params()
    with pytest.raises(InvalidRequest, match="group 0 has 8 blocks, at most 4"):  # twice what the peer's blocks need
        await admission(stub, connect).admit(request(params))
    halved = params.model_copy(update={"remote_block_ids": [ids[: -(-len(ids) // 2)] for ids in params.remote_block_ids]})
    admitted = await admission(stub, connect).admit(request(halved))
    assert admitted.remote is not None and connect.calls == 1


async def test_a_stale_epoch_is_a_409_and_not_remembered_as_a_dead_peer():
    stub, connect = StubPrefill(), Connector()
    gate = admission(stub, connect)
    with pytest.raises(KVParamsStale):
        await gate.admit(request(stub.params(remote_epoch="gone")))
    assert (await gate.admit(request(stub.params()))).remote is not None


async def test_an_unreachable_peer_is_served_locally_under_recompute_and_then_skipped_for_a_while():
    stub, connect, clock = StubPrefill(), Connector(), FakeClock()
    gate = admission(stub, connect, clock=clock)
    params = stub.params()
    stub.status = 503
    calls = stub.calls
    first = await gate.admit(request(params))
    assert first.remote is None and first.kv_params is None and stub.calls == calls + 1
    second = await gate.admit(request(params))
    assert second.remote is None and stub.calls == calls + 1, "a remembered dead peer was asked again"
    stub.status = 200
    clock.advance(1.01)  # first backoff is one second
    assert (await gate.admit(request(params))).remote is not None


async def test_a_peer_whose_data_path_fails_gets_the_fail_policy_at_once_next_time():
    stub, connect, clock = StubPrefill(), Connector(), FakeClock()
    gate = admission(stub, connect, policy="fail", clock=clock)
    connect.error = "warm-up read never landed"
    with pytest.raises(KVPullFailed, match="warm-up"):
        await gate.admit(request(stub.params()))
    with pytest.raises(KVPullFailed, match="retried in"):
        await gate.admit(request(stub.params()))
    assert connect.calls == 1


def test_the_failure_backoff_doubles_up_to_its_cap_and_a_success_resets_it():
    clock = FakeClock()
    memory = PeerFailureMemory(initial_backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    waits = []
    for _ in range(4):
        memory.record_failure("P@e1", "down")
        started = clock()
        while memory.reason_to_skip("P@e1") is not None:
            clock.advance(0.25)
        waits.append(clock() - started)
    assert waits == [1.0, 2.0, 4.0, 4.0]
    memory.record_failure("P@e1", "down")
    memory.record_success("P@e1")
    assert memory.reason_to_skip("P@e1") is None


async def test_prefill_admission_keeps_the_kv_only_when_asked_and_computes_one_token():
    gate = PrefillAdmission()
    asked = await gate.admit(request(RemoteDecodeRequest(do_remote_decode=True)))
    assert asked.remote_decode and asked.sampling.max_tokens == 1 and asked.kv_params is None
    stub = StubPrefill()
    other = await gate.admit(request(stub.params()))  # params meant for a decode worker: served locally
    assert not other.remote_decode and other.kv_params is None


async def test_prefill_admission_keeps_what_shapes_the_first_token_the_decode_worker_continues_from():
    """Protocol 7: P's token is D's output token 1, so P draws it as the whole request would: logprobs and
    seed kept, min_tokens' ban on a stop at draw 0 kept (from decode_min_tokens when our proxy moved it)."""
    sampling = SamplingParams(max_tokens=9, temperature=0.8, seed=4, logprobs=True, top_logprobs=2,
                              presence_penalty=0.5)
    gate = PrefillAdmission()
    base = request(RemoteDecodeRequest(do_remote_decode=True, decode_min_tokens=3))
    asked = await gate.admit(dataclasses.replace(base, sampling=sampling))
    assert asked.sampling == dataclasses.replace(sampling, max_tokens=1, min_tokens=1)
    plain = await gate.admit(dataclasses.replace(base, kv_params=RemoteDecodeRequest(do_remote_decode=True)))
    assert plain.sampling.min_tokens == 0


@pytest.mark.parametrize("host", ["evil.example:80", "127.0.0.1/internal", "h?x=1", "user@h", "h#frag", " h",
                                  "h/../x", "", "a" * 254, "[::1]:80"])
def test_remote_host_must_be_a_bare_host(host):
    wire = StubPrefill().params().to_wire()
    with pytest.raises(KVParamsInvalid):
        parse_kv_transfer_params({**wire, "remote_host": host})


@pytest.mark.parametrize("host, parsed", [("10.0.0.5", "10.0.0.5"), ("::1", "::1"), ("[::1]", "::1"),
                                          ("pd-prefill-0.pd-prefill.llm.svc.cluster.local", None)])
def test_bare_hosts_are_accepted(host, parsed):
    wire = StubPrefill().params().to_wire()
    assert parse_kv_transfer_params({**wire, "remote_host": host}).remote_host == (parsed or host)


def test_params_of_an_older_protocol_get_the_version_refusal_and_version_2_needs_the_pins_nonce():
    wire = StubPrefill().params().to_wire()
    assert parse_kv_transfer_params(wire).remote_pin_nonce == wire["remote_pin_nonce"]
    older = {key: value for key, value in wire.items() if key != "remote_pin_nonce"}
    with pytest.raises(KVParamsInvalid, match="protocol_version 1 is not supported"):
        parse_kv_transfer_params({**older, "protocol_version": 1})
    with pytest.raises(KVParamsInvalid, match="remote_pin_nonce is required"):
        parse_kv_transfer_params(older)
    with pytest.raises(KVParamsInvalid):
        parse_kv_transfer_params({**wire, "remote_pin_nonce": "not-hex!"})


async def test_a_peer_off_the_allow_list_is_refused_before_any_contact():
    stub, connect = StubPrefill(), Connector()
    gate = admission(stub, connect)
    gate.allowed_peers = PeerAllowList.parse("prefill-0.svc, 10.0.0.0/24")
    params = stub.params()
    for host in ("127.0.0.1", "10.0.1.1", "prefill-1.svc"):
        with pytest.raises(KVPeerNotAllowed) as caught:
            await gate.admit(request(params.model_copy(update={"remote_host": host})))
        assert caught.value.status_code == 403
    assert stub.calls == 0 and connect.calls == 0
    for host in ("10.0.0.7", "prefill-0.svc", "PREFILL-0.svc."):
        assert PeerAllowList.parse("prefill-0.svc, 10.0.0.0/24").allows(host)


def _metadata(*devices: Device) -> bytes:
    return nixl_metadata(worker_address([*devices, Device(["posix", "cma"], b"\x01" * 8)]))


def _two_ranks(second: bytes) -> bytes:
    rank = {"agent_name": "r", "mem_type": "DRAM", "device_id": 0, "base_address": 0}
    return encode_ranks([{**rank, "agent_metadata": base64.b64encode(_metadata(tcp_device("10.0.0.7"))).decode()},
                         {**rank, "agent_metadata": base64.b64encode(second).decode()}])


@pytest.mark.parametrize("case, metadata, host, refused", [
    ("listed", _metadata(tcp_device("10.0.0.7"), tcp_loopback_device()), "10.0.0.7", None),
    ("off the list", _metadata(tcp_device("10.0.0.7"), tcp_device("203.0.113.9")), "10.0.0.7", "203.0.113.9"),
    ("ipv6 off the list", _metadata(tcp_device("fd00::9")), "10.0.0.7", "fd00::9"),
    ("second rank", _two_ranks(_metadata(tcp_device("203.0.113.9"))), "10.0.0.7", "203.0.113.9"),
    ("ranks listed", _two_ranks(_metadata(tcp_device("10.0.0.8"))), "10.0.0.7", None),
    ("this host's, over loopback", _metadata(tcp_device("127.0.0.2")), "127.0.0.1", None),
    ("this host's, over the network", _metadata(tcp_device("127.0.0.2")), "10.0.0.7", "127.0.0.2"),
    ("another host, over loopback", _metadata(tcp_device("203.0.113.9")), "127.0.0.1", "203.0.113.9"),
    ("unknown transport", nixl_metadata(worker_address([Device(["rdma_x"], b"")])), "10.0.0.7", "does not know"),
    ("unreadable", _metadata(tcp_device("10.0.0.7"))[:-20], "10.0.0.7", "cannot check"),
])
async def test_a_peer_whose_metadata_lets_ucx_reach_a_host_off_the_allow_list_is_refused_before_connecting(
        case, metadata, host, refused):
    # Issue 36, item 3: the handshake address passes the list, but UCX connects where the metadata says.
    stub, connect = StubPrefill(), Connector()
    stub.metadata = metadata
    gate = admission(stub, connect)
    gate.allowed_peers = PeerAllowList.parse("10.0.0.0/24, 127.0.0.1")
    params = stub.params(remote_host=host)
    if refused is None:
        assert (await gate.admit(request(params))).remote is not None and connect.calls == 1
        return
    with pytest.raises(KVPeerNotAllowed, match=refused) as caught:
        await gate.admit(request(params))
    assert caught.value.status_code == 403 and connect.calls == 0 and stub.calls == 1


async def test_without_an_allow_list_the_data_path_is_not_read():
    stub, connect = StubPrefill(), Connector()
    stub.metadata = b"opaque to this worker"
    assert (await admission(stub, connect).admit(request(stub.params()))).remote is not None


async def test_requests_that_need_the_same_new_peer_at_once_share_one_handshake():
    stub, connect = StubPrefill(), Connector()
    decode = admission(stub, connect, answer_after_s=0.05)
    lengths = [30, 31, 32, 33]
    params = [stub.params(n) for n in lengths]
    admitted = await asyncio.gather(*(decode.admit(request(p, n)) for p, n in zip(params, lengths)))
    assert all(a.remote is not None for a in admitted)
    assert stub.calls == 1
    await decode.admit(request(stub.params(34), 34))  # cached afterwards
    assert stub.calls == 1


async def test_a_failed_shared_handshake_fails_every_waiter():
    stub, connect = StubPrefill(), Connector()
    decode = admission(stub, connect, policy="fail", answer_after_s=0.05)
    stub.status = 503
    lengths = [30, 31, 32]
    params = [stub.params(n) for n in lengths]
    results = await asyncio.gather(*(decode.admit(request(p, n)) for p, n in zip(params, lengths)),
                                   return_exceptions=True)
    assert all(isinstance(r, KVPullFailed) for r in results), results
    assert stub.calls == 1


async def test_an_incompatible_prefill_worker_is_a_400_that_names_what_differs():
    plan = plan_groups([FullAttentionSpec()] * 2)
    ours = compatibility_document("m|llama|2|64|300", "torch.float32", 2, 16, plan)
    theirs = compatibility_document("m|llama|2|64|300", "torch.float32", 2, 32, plan)
    assert incompatibilities(ours, theirs) == "head_dim: 16 here, 32 there"
    assert incompatibilities(ours, ours) == "their compatibility hashes differ"
    stub, connect = StubPrefill(), Connector()
    info = stub.side.agent_info().model_copy(update={"compatibility": theirs})
    stub.handler = lambda request: httpx.Response(200, content=info.model_dump_json())
    handshake = HandshakeClient(compatibility_hash(ours), None, http_transport=httpx.MockTransport(stub.handler),
                                own_compatibility=ours)
    gate = DecodeAdmission(handshake, PLAN, BLOCK, "recompute", connect)
    with pytest.raises(KVParamsInvalid, match=r"incompatible model or KV layout \(head_dim: 16 here, 32 there\)"):
        await gate.admit(request(stub.params()))
    assert connect.calls == 0


async def test_a_prefill_worker_with_another_kv_cache_dtype_is_refused_by_name_before_any_read():
    """A bfloat16 page read as float32 would be garbage of the right size: the element type is part
    of what the handshake compares, and the refusal names it."""
    plan = plan_groups([FullAttentionSpec()] * 2)
    ours = compatibility_document("m|llama|2|64|300", "torch.float32", 2, 16, plan, kv_cache_dtype="torch.float32")
    theirs = compatibility_document("m|llama|2|64|300", "torch.float32", 2, 16, plan,
                                    kv_cache_dtype="torch.bfloat16")
    assert compatibility_hash(ours) != compatibility_hash(theirs)
    assert compatibility_document("m|llama|2|64|300", "torch.float32", 2, 16, plan) == ours  # default: the model's
    stub, connect = StubPrefill(), Connector()
    info = stub.side.agent_info().model_copy(update={"compatibility": theirs})
    stub.handler = lambda request: httpx.Response(200, content=info.model_dump_json())
    handshake = HandshakeClient(compatibility_hash(ours), None, http_transport=httpx.MockTransport(stub.handler),
                                own_compatibility=ours)
    gate = DecodeAdmission(handshake, PLAN, BLOCK, "recompute", connect)
    with pytest.raises(KVParamsInvalid,
                       match=r'kv_cache_dtype: "torch.float32" here, "torch.bfloat16" there'):
        await gate.admit(request(stub.params()))
    assert connect.calls == 0


# ---- issue 36 item 3: handshake identity and bounded memory ---------------------------------------


@pytest.mark.parametrize("field", ["engine_id", "epoch"])
async def test_a_transport_record_naming_another_engine_or_epoch_is_refused_before_any_connection(field):
    stub, connect = StubPrefill(), Connector()
    info = stub.side.agent_info()
    forged = info.model_copy(update={"transport": {**info.transport, field: "someone-else"}})
    stub.handler = lambda request: httpx.Response(200, content=forged.model_dump_json())
    with pytest.raises(KVPullFailed, match="transport record names"):
        await admission(stub, connect, policy="fail").admit(request(stub.params()))
    assert connect.calls == 0


async def test_a_failure_through_one_address_never_holds_back_the_same_engine_through_another():
    """A peer at another address claiming P's engine and epoch fails to connect: P's own address
    is not put in backoff by it."""
    stub = StubPrefill()

    class ByAddress(Connector):
        async def __call__(self, peer):
            self.calls += 1
            return "unreachable" if peer.via.startswith("10.9.9.9:") else None

    connect = ByAddress()
    gate = admission(stub, connect)
    impostor = stub.params(remote_host="10.9.9.9")
    assert (await gate.admit(request(impostor))).remote is None  # recomputed locally, remembered
    genuine = await gate.admit(request(stub.params()))
    assert genuine.remote is not None and connect.calls == 2


async def test_connections_are_asked_for_by_handshake_address_engine_and_epoch():
    stub = StubPrefill()
    seen = []

    class Recording(Connector):
        async def __call__(self, peer):
            seen.append(peer)
            return None

    params = stub.params()
    await admission(stub, Recording()).admit(request(params))
    assert seen[0].via == f"{params.remote_host}:{params.remote_port}"  # an IPv4 literal: no brackets
    assert seen[0].key == f"P@epoch-1@{params.remote_host}:{params.remote_port}"


def test_the_failure_memory_forgets_the_least_recently_failed_past_its_bound():
    memory = PeerFailureMemory(clock=FakeClock(), max_peers=3)
    for number in range(5):
        memory.record_failure(f"peer-{number}", "down")
    assert memory.num_remembered == 3
    assert memory.reason_to_skip("peer-0") is None and memory.reason_to_skip("peer-1") is None
    assert memory.reason_to_skip("peer-4") is not None
