"""Async side of P/D: turn a request's parsed `kv_transfer_params` into what the engine may act on.

Invariant: the engine thread only ever sees a decode request whose params are
well formed, whose peer is a bare host on the allow-list (when there is one)
and answered the handshake with a matching compatibility hash, engine id and
epoch, whose block lists fit that peer's pool and the prompt, and whose
peer's data path is connected. Everything else is a typed
4xx, or (for a peer that cannot be reached) the failure policy's outcome; a
peer that failed is remembered per (handshake address, engine id, epoch) with a
backoff so later requests get that outcome at once (one address's failures
never hold back another's). The data path is keyed the same way: a handshake
through one address never displaces a connection made through another.
Memory is bounded: at most `max_peers` failures are remembered. Torch-free.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Awaitable, Callable, Literal, Optional, Protocol

from pdserve.api.kv_transfer import (AgentInfo, KVParamsInvalid, KVPinnedFull, KVPullFailed, RemoteDecodeRequest,
                                     RemotePrefillParams)
from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.specs import KVGroupPlan
from pdserve.pd.geometry import handoff_ranges, peer_plan
from pdserve.pd.handshake import HandshakeClient
from pdserve.pd.peer_trust import PeerAllowList
from pdserve.request import GenerationRequest, RemoteSource
from pdserve.transfer.planner import validate_remote_block_ids
from pdserve.transfer.state_ranges import state_splits
from pdserve.transfer.token_units import block_size_problem
from pdserve.transfer.transport import PeerInfo, TransferError, handshake_address, peer_key

logger = logging.getLogger(__name__)

ConnectPeer = Callable[[PeerInfo], Awaitable[Optional[str]]]  # None: connected; else why not


class KVAdmission(Protocol):
    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        """Check and resolve `request.kv_params`; the result carries none (may raise a typed error)."""
        ...


class LocalAdmission:
    """A colocated worker: kv_transfer_params are accepted and ignored (vLLM does the same without a connector)."""

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        return dataclasses.replace(request, kv_params=None)


class PrefillAdmission:
    """P: a do_remote_decode request computes the prompt and one token, then keeps its KV;
    refused at once (503) when its blocks would not fit under the pinned-blocks limit."""

    def __init__(self, plan: Optional[KVGroupPlan] = None, block_size: int = 16,
                 has_room_to_pin: Callable[[int], bool] = lambda num_blocks: True):
        self.plan = plan
        self.block_size = block_size
        self.has_room_to_pin = has_room_to_pin

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        if not isinstance(request.kv_params, RemoteDecodeRequest):
            return dataclasses.replace(request, kv_params=None)
        if self.plan is not None:
            num_prompt_tokens = len(request.prompt_token_ids)
            num_blocks = sum(len(r) for r in handoff_ranges(self.plan, num_prompt_tokens, self.block_size))
            if not self.has_room_to_pin(num_blocks):
                raise KVPinnedFull(f"this prefill worker holds as many blocks for decode workers as it may "
                                   f"({num_blocks} more needed): retry later or elsewhere")
        # Its one token becomes the decode worker's output token 1 (its ticket carries it, pd/first_token.py):
        # keep what shapes that token (seed, penalties, its logprobs, min_tokens' ban on a stop at token 1).
        # A grammar's state is the decode worker's (it computes the first token itself then); prompt logprobs
        # are not asked of a P/D pair.
        # Our proxy moves min_tokens into the params (decode_min_tokens) and drops it from this leg.
        min_tokens = max(request.sampling.min_tokens, request.kv_params.decode_min_tokens or 0)
        sampling = dataclasses.replace(request.sampling, max_tokens=1, min_tokens=min(min_tokens, 1), grammar=None,
                                       prompt_logprobs=None)
        return dataclasses.replace(request, kv_params=None, remote_decode=True, sampling=sampling)


class PeerFailureMemory:
    """Peers (by transport peer key) that failed recently: asked again only after a growing backoff.
    At most `max_peers` are remembered; the least recently failed is forgotten first (it is then
    merely asked again sooner)."""

    def __init__(self, initial_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_peers: int = 1024):
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.max_peers = max_peers
        # key -> (retry at, backoff, reason), least recently failed first
        self._failures: collections.OrderedDict[str, tuple[float, float, str]] = collections.OrderedDict()

    @property
    def num_remembered(self) -> int:
        return len(self._failures)

    def reason_to_skip(self, peer_key: str) -> Optional[str]:
        entry = self._failures.get(peer_key)
        if entry is None or self.clock() >= entry[0]:
            return None
        return f"{entry[2]} (retried in {entry[0] - self.clock():.1f} s)"

    def record_failure(self, peer_key: str, reason: str) -> None:
        previous = self._failures.get(peer_key)
        backoff = self.initial_backoff_s if previous is None else min(previous[1] * 2, self.max_backoff_s)
        self._failures[peer_key] = (self.clock() + backoff, backoff, reason)
        self._failures.move_to_end(peer_key)
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)

    def record_success(self, peer_key: str) -> None:
        self._failures.pop(peer_key, None)


def state_split_problem(plan: KVGroupPlan, num_ranks: int, their_num_ranks: int) -> Optional[str]:
    """Why the recurrent state of `plan` (one rank's of `num_ranks`) cannot move to or from a worker
    of `their_num_ranks` ranks, naming the counts (None: each rank reads its heads' byte ranges)."""
    for split in state_splits(plan, num_ranks):
        problem = split.problem(their_num_ranks)
        if problem is not None:
            return problem
    return None


def pairing_problem(agent: AgentInfo, plan: KVGroupPlan, block_size: int, num_ranks: int = 1) -> Optional[str]:
    """Why this worker (`plan` one rank's of `num_ranks`, pages of `block_size` tokens) cannot read KV
    from the worker `agent` describes, as a phrase to follow its name ("prefill worker P runs ...");
    None when the READ plan covers it (pd/geometry.py `plan_pull_from`): block sizes that divide one
    another, any TP sizes (each rank reads its heads' slice), recurrent state only where both TP sizes
    split it. D's pull from P and a peer pull ask this one question."""
    problem = block_size_problem(block_size, agent.geometry.block_size)
    if problem is not None:
        return f"cannot hand its KV to this worker: {problem}"
    if plan.state_group_ids and agent.tp_size != num_ranks:
        problem = state_split_problem(plan, num_ranks, agent.tp_size)
        if problem is not None:
            return f"runs {agent.tp_size} tensor-parallel rank(s), this worker {num_ranks}: {problem}"
    return None


def check_block_ids(params: RemotePrefillParams, agent: AgentInfo, plan: KVGroupPlan, num_ranks: int = 1) -> None:
    """Shape and range of the block lists against the peer's pool and this prompt, in the peer's
    own block size and state partition. Our prefill workers never send null entries, so none is accepted."""
    their_plan = peer_plan(plan, agent.geometry.groups, num_ranks, agent.tp_size) if plan.state_group_ids else plan
    expected = [len(r) for r in handoff_ranges(their_plan, params.num_prompt_tokens, agent.geometry.block_size)]
    lists = validate_remote_block_ids(params.remote_block_ids, len(expected), agent.geometry.num_blocks, max(expected))
    for group_id, (ids, count) in enumerate(zip(lists, expected)):
        if len(ids) != count or NULL_BLOCK_ID in ids:
            raise KVParamsInvalid(
                f"kv_transfer_params.remote_block_ids[{group_id}] must name {count} non-null blocks "
                f"for {params.num_prompt_tokens} prompt tokens; got {len(ids)}"
            )


class DecodeAdmission:
    """D: verify params and peer, connect its data path, attach a `RemoteSource`."""

    def __init__(self, handshake: HandshakeClient, plan: KVGroupPlan, block_size: int,
                 policy: Literal["recompute", "fail"], connect_peer: ConnectPeer,
                 failures: Optional[PeerFailureMemory] = None, count_failure: Callable[[], None] = lambda: None,
                 allowed_peers: Optional[PeerAllowList] = None, tp_size: int = 1):
        self.tp_size = tp_size  # this worker's tensor-parallel ranks
        self.count_failure = count_failure
        self.allowed_peers = allowed_peers
        self.handshake = handshake
        self.plan = plan
        self.block_size = block_size
        self.policy = policy
        self.connect_peer = connect_peer
        self.failures = failures or PeerFailureMemory()

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        params = request.kv_params
        local = dataclasses.replace(request, kv_params=None)
        if not isinstance(params, RemotePrefillParams):
            return local
        if params.num_prompt_tokens != len(request.prompt_token_ids):
            raise KVParamsInvalid(
                f"kv_transfer_params.num_prompt_tokens is {params.num_prompt_tokens} but the prompt has "
                f"{len(request.prompt_token_ids)} tokens here (different prompt or tokenizer)"
            )

        if self.allowed_peers is not None:
            self.allowed_peers.check(params.remote_host)  # before any connection to it
        via = handshake_address(params.remote_host, params.remote_port)
        key = peer_key(params.remote_engine_id, params.remote_epoch, via)
        reason = self.failures.reason_to_skip(key)
        if reason is not None:
            return self._unreachable(local, reason)
        try:
            agent = await self.handshake.peer_for(params)
        except KVPullFailed as error:
            return self._unreachable(local, error.message, key)
        if params.tp_size != agent.tp_size:
            raise KVParamsInvalid(f"kv_transfer_params.tp_size is {params.tp_size} but prefill worker "
                                  f"{params.remote_engine_id} runs {agent.tp_size} tensor-parallel ranks")
        problem = pairing_problem(agent, self.plan, self.block_size, self.tp_size)
        if problem is not None:
            raise KVParamsInvalid(f"prefill worker {params.remote_engine_id} {problem}", param="kv_transfer_params")
        check_block_ids(params, agent, self.plan, self.tp_size)
        try:
            # The peer's block size rides along (never on the wire): reads between block sizes are cut by it.
            peer = dataclasses.replace(PeerInfo.from_dict(agent.transport, via=via),
                                       block_size=agent.geometry.block_size)
            if (peer.engine_id, peer.epoch) != (agent.engine_id, agent.epoch):  # the handshake checks it too
                raise TransferError(f"the transport record of {via} names engine {peer.engine_id!r} epoch "
                                    f"{peer.epoch!r}, its agent info {agent.engine_id!r} {agent.epoch!r}")
            if self.allowed_peers is not None:
                self.allowed_peers.check_data_path(peer, params.remote_host)  # 403: where UCX would connect
            error_text = await self.connect_peer(peer)
        except TransferError as error:  # the peer's transport record is malformed or not its own
            error_text = error.message
        if error_text is not None:
            return self._unreachable(local, error_text, key)
        self.failures.record_success(key)
        return dataclasses.replace(local, remote=RemoteSource(params, agent))

    def _unreachable(self, local: GenerationRequest, reason: str, peer_key: Optional[str] = None) -> GenerationRequest:
        self.count_failure()
        if peer_key is not None:
            self.failures.record_failure(peer_key, reason)
        if self.policy == "fail":
            raise KVPullFailed(f"prefill worker unreachable: {reason}")
        logger.warning("request %s: prefill worker unreachable (%s); prefilling locally", local.request_id, reason)
        return local


def engine_thread_connector(run_on_engine_thread: Callable[[Callable[[], None]], None],
                            ensure: Callable[[PeerInfo, Callable[[Optional[str]], None]], None],
                            timeout_s: float) -> ConnectPeer:
    """A `ConnectPeer` that asks the engine thread to connect (never waiting there) and awaits the outcome."""

    async def connect(peer: PeerInfo) -> Optional[str]:
        event_loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Optional[str]] = event_loop.create_future()

        def resolve(error: Optional[str]) -> None:  # called on the engine thread
            event_loop.call_soon_threadsafe(_settle, outcome, error)

        run_on_engine_thread(lambda: ensure(peer, resolve))
        try:
            return await asyncio.wait_for(asyncio.shield(outcome), timeout_s)
        except asyncio.TimeoutError:
            return f"no connection outcome from the engine within {timeout_s:g} s"

    return connect


def _settle(future: "asyncio.Future[Optional[str]]", error: Optional[str]) -> None:
    if not future.done():
        future.set_result(error)
