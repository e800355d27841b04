"""The puller's async side of a peer pull: a hint becomes a peer source only when the peer's pin checks
out (its hash chain is this prompt's, its geometry this worker's); every other outcome computes the
prompt, counted by result, releases a pin it took, and never fails the request. The HTTP edge takes a
hint only with the internal token when one is set."""

from __future__ import annotations

import asyncio
from typing import Optional

import pytest
from starlette.requests import Request as StarletteRequest

from pdserve.api.peer_pull import PEER_HINT_HEADER, PeerHint, PeerPinTicket, parse_peer_hint
from pdserve.api.sampling import SamplingParams
from pdserve.kv.hashing import hash_full_blocks
from pdserve.pd.admission import LocalAdmission
from pdserve.pd.peer_admission import PeerPullAdmission, PeerUnusable
from pdserve.pd.peer_costs import PeerPullCosts
from pdserve.pd.peer_trust import PeerAllowList
from pdserve.request import GenerationRequest
from pdserve.server.peer_routes import peer_hint_from
from pdserve.transfer.fake_transport import FakeFabric
from pdserve.transfer.ucx_address import Reach, UcxEndpoint
from tests.pd.pd_pair import BLOCK, FakeClock, PrefillSide
from tests.pd.test_peer_pull import FULL

PROMPT = tuple(range(10, 10 + 10 * BLOCK + 3))
HINT = PeerHint(host="127.0.0.1", port=1, num_tokens=8 * BLOCK)
NONCE = "ab" * 16


class FakePins:
    def __init__(self, answer):
        self.answer = answer
        self.asked: list[list[int]] = []

    async def pin(self, hint: PeerHint, token_ids: list[int]) -> Optional[PeerPinTicket]:
        self.asked.append(token_ids)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class FakeReleases:
    def __init__(self):
        self.released: list[str] = []

    def release_in_background(self, params) -> None:
        self.released.append(params.remote_request_id)


class FakeHandshake:
    def __init__(self, agent):
        self.agent = agent

    async def peer_for(self, params):
        return self.agent


def ticket(num_tokens: int = 8 * BLOCK, chain: Optional[list[str]] = None, block_size: int = BLOCK) -> PeerPinTicket:
    chain = chain if chain is not None else [h.hex() for h in hash_full_blocks(PROMPT[:num_tokens], BLOCK, [])]
    num_blocks = num_tokens // block_size
    return PeerPinTicket(pin_id="peer-pin-1", engine_id="A", epoch="epoch-1", nonce=NONCE, num_tokens=num_tokens,
                         block_size=block_size, block_ids=[list(range(1, num_blocks + 1))] * len(FULL.groups),
                         block_hashes=chain, lease_left_s=30.0)


@pytest.fixture(scope="module")
def agent():
    return PrefillSide(FakeFabric(), FakeClock(), name="A", plan=FULL).agent_info()


def no_endpoints(peer) -> list[UcxEndpoint]:
    """The fake transport's metadata is an agent name: it offers UCX no endpoint to check."""
    return []


def admit(agent, answer, hint: Optional[PeerHint] = HINT, connect_error: Optional[str] = None, min_tokens: int = 32,
          allowed: Optional[str] = None, vouched: bool = True, costs: Optional[PeerPullCosts] = None,
          tp_size: int = 1, endpoints=no_endpoints):
    pins, releases, counts = FakePins(answer), FakeReleases(), {}

    async def connect(peer):
        return connect_error

    def count(result: str, num_tokens: int) -> None:
        counts[result] = counts.get(result, 0) + num_tokens

    admission = PeerPullAdmission(LocalAdmission(), pins, releases, FakeHandshake(agent), connect, FULL, BLOCK,
                                  tp_size=tp_size, min_tokens=min_tokens, count_tokens=count,
                                  allowed_peers=PeerAllowList.parse(allowed, endpoints) if allowed else None,
                                  vouched=vouched,
                                  costs=costs)
    request = GenerationRequest("r", PROMPT, SamplingParams(max_tokens=1), peer_hint=hint)
    admitted = asyncio.run(admission.admit(request))
    assert admitted.peer_hint is None and admitted.kv_params is None
    return admitted, pins, releases, counts


def test_a_checked_pin_becomes_a_peer_source_of_the_pinned_prefix(agent):
    admitted, pins, releases, counts = admit(agent, ticket())
    assert admitted.remote is not None and admitted.remote.num_pull_tokens == 8 * BLOCK
    assert admitted.remote.params.remote_block_ids == ticket().block_ids  # the holder's ids, from its ticket
    assert pins.asked == [list(PROMPT[:8 * BLOCK])] and releases.released == [] and counts == {}


def test_the_puller_never_asks_for_the_last_prompt_token(agent):
    hint = PeerHint(host="127.0.0.1", port=1, num_tokens=10_000)
    _, pins, _, _ = admit(agent, ticket(), hint=hint)
    assert pins.asked == [list(PROMPT[:10 * BLOCK])]  # whole blocks, the last prompt token always computed


@pytest.mark.parametrize("answer, result", [
    (ticket(chain=["00" * 32] * 8), "refused"),  # another prompt's blocks
    (ticket(block_size=6), "refused"),  # a block size that does not pair with this worker's
    (ticket(chain=[h.hex() for h in hash_full_blocks(PROMPT[:8 * BLOCK], BLOCK, [])], block_size=2 * BLOCK),
     "refused"),  # a chain over another block size than the peer says it pages
    (ticket(num_tokens=BLOCK), "miss"),  # holds less than worth pulling
])
def test_a_pin_that_does_not_check_out_is_released_and_the_prompt_computed(agent, answer, result):
    admitted, _, releases, counts = admit(agent, answer)
    assert admitted.remote is None and releases.released == ["peer-pin-1"]
    assert counts == {result: answer.num_tokens}


def test_a_peer_of_another_block_size_is_checked_by_its_own_chain():
    wide = PrefillSide(FakeFabric(), FakeClock(), name="A", plan=FULL, block_size=2 * BLOCK).agent_info()
    chain = [h.hex() for h in hash_full_blocks(PROMPT[:8 * BLOCK], 2 * BLOCK, [])]
    admitted, _, releases, counts = admit(wide, ticket(chain=chain, block_size=2 * BLOCK))
    assert admitted.remote is not None and admitted.remote.num_pull_tokens == 8 * BLOCK and counts == {}


@pytest.mark.parametrize("their_ranks, our_ranks", [(2, 1), (1, 2), (4, 2)])
def test_a_peer_of_another_tp_size_lends_as_p_hands_to_d(agent, their_ranks, our_ranks):
    """The READ covers the peer's ranks' slices of the pinned ids (pd/geometry.py `plan_pull_from`)."""
    split = agent.model_copy(update={"tp_size": their_ranks})
    admitted, _, releases, counts = admit(split, ticket(), tp_size=our_ranks)
    assert admitted.remote is not None and admitted.remote.num_pull_tokens == 8 * BLOCK
    assert admitted.remote.agent.tp_size == their_ranks and releases.released == [] and counts == {}


def test_a_pin_in_another_block_size_than_the_peers_handshake_is_refused_by_name(agent, caplog):
    """The chain checked out over the pin's block size, but the peer pages another: its ids would be read
    in the wrong units. Refused whatever the TP sizes, the pin released, the prompt computed."""
    chain = [h.hex() for h in hash_full_blocks(PROMPT[:8 * BLOCK], 2 * BLOCK, [])]
    with caplog.at_level("INFO", logger="pdserve.pd.peer_admission"):
        admitted, _, releases, counts = admit(agent.model_copy(update={"tp_size": 2}),
                                              ticket(chain=chain, block_size=2 * BLOCK))
    assert admitted.remote is None and releases.released == ["peer-pin-1"] and counts == {"refused": 8 * BLOCK}
    assert f"the peer pinned {2 * BLOCK}-token blocks but pages {BLOCK}-token ones" in caplog.text


def test_a_dead_peer_or_a_lost_data_path_costs_a_recompute(agent):
    admitted, _, releases, counts = admit(agent, PeerUnusable("failed", "connection refused", 8 * BLOCK))
    assert admitted.remote is None and releases.released == [] and counts == {"failed": 8 * BLOCK}
    admitted, _, releases, counts = admit(agent, ticket(), connect_error="peer agent is not reachable")
    assert admitted.remote is None and releases.released == ["peer-pin-1"] and counts == {"failed": 8 * BLOCK}
    admitted, _, _, counts = admit(agent, RuntimeError("a bug of ours"))  # not even a bug fails the request
    assert admitted.remote is None and counts == {"failed": 8 * BLOCK}


def test_nothing_is_asked_below_the_threshold_nor_of_a_peer_off_the_allow_list(agent):
    _, pins, _, counts = admit(agent, ticket(), min_tokens=9 * BLOCK)
    assert pins.asked == [] and counts == {"skipped": 8 * BLOCK}
    admitted, pins, _, counts = admit(agent, None)
    assert admitted.remote is None and counts == {"miss": 8 * BLOCK}  # the peer holds none of it
    _, pins, _, counts = admit(agent, ticket(), allowed="10.0.0.0/8")
    assert pins.asked == [] and counts == {"refused": 8 * BLOCK}


def test_a_hint_is_followed_only_when_the_measured_pull_is_predicted_faster(agent):
    slow_read = PeerPullCosts(min_tokens=32, compute_s_per_token=1e-4, pull_s_per_token=2e-4, pin_s=1e-3)
    admitted, pins, _, counts = admit(agent, ticket(), costs=slow_read)
    assert admitted.remote is None and pins.asked == [] and counts == {"costlier": 8 * BLOCK}
    fast_read = PeerPullCosts(min_tokens=32, compute_s_per_token=1e-4, pull_s_per_token=1e-5, pin_s=1e-3)
    admitted, pins, _, counts = admit(agent, ticket(), costs=fast_read)
    assert admitted.remote is not None and counts == {}


def test_a_hint_nobody_vouched_for_is_followed_only_to_allow_listed_peers(agent):
    _, pins, _, counts = admit(agent, ticket(), vouched=False)  # no token, a listener others reach
    assert pins.asked == [] and counts == {"refused": 8 * BLOCK}
    admitted, pins, _, _ = admit(agent, ticket(), vouched=False, allowed="127.0.0.1")
    assert admitted.remote is not None and pins.asked


def test_a_peer_whose_data_path_leaves_the_allow_list_is_not_pulled_from(agent):
    # Issue 36, item 3: the hint's host is listed, but the peer's UCX address offers another host.
    elsewhere = lambda peer: [UcxEndpoint("tcp", Reach.NETWORK, "203.0.113.9")]  # noqa: E731
    admitted, pins, releases, counts = admit(agent, ticket(), allowed="127.0.0.1", endpoints=elsewhere)
    assert admitted.remote is None and counts == {"refused": 8 * BLOCK}
    assert pins.asked and releases.released  # the pin it took is handed back


def http_request(headers: dict[str, str]) -> StarletteRequest:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    return StarletteRequest({"type": "http", "headers": raw, "method": "POST", "path": "/"})


def test_a_hint_is_taken_only_with_the_internal_token_when_one_is_set():
    header = {PEER_HINT_HEADER: HINT.to_header()}
    assert peer_hint_from(http_request(header), None) == HINT
    assert peer_hint_from(http_request(header), "secret") is None
    assert peer_hint_from(http_request({**header, "X-Pdserve-Internal-Token": "wrong"}), "secret") is None
    assert peer_hint_from(http_request({**header, "X-Pdserve-Internal-Token": "secret"}), "secret") == HINT
    assert peer_hint_from(http_request({PEER_HINT_HEADER: "http://evil/;tokens=5"}), None) is None
    assert parse_peer_hint("[::1]:8101;tokens=64;medium=offload") == PeerHint(host="::1", port=8101, num_tokens=64,
                                                                             medium="offload")
