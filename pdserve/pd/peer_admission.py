"""Puller side of a peer pull, async: turn a request's peer hint into a verified peer source, or into
nothing (the request is computed here as if it had none).

Invariant: a request reaches the engine with a peer pull only when the peer (on the allow-list when
there is one) pinned a prefix of it by its own hash chain, that chain equals this worker's chain of
the same tokens (over the peer's block size), the peer answered the handshake with this worker's
compatibility hash and a geometry D would accept from P (`pairing_problem`: block sizes that divide
one another, the READ moving units of the smaller; any TP sizes, each rank reading its heads' slice
of the pinned blocks from the peer ranks holding them), its block lists fit its pool, and its data
path is connected. A hint never fails a request: every other outcome is counted
(`pdserve_kv_peer_pull_tokens_total{result}`) and the prompt is computed; a pin taken and not used is
released at once (its lease is the fallback).
A hint is followed only when this worker's own measurements predict the pull faster than computing
and the prefix reaches `--peer-pull-min-tokens` (pd/peer_costs.py, docs/operations.md). A hint
nobody vouched for (no internal token, a listener others reach) is followed only to allow-listed peers.
Torch-free.

    hint {host, port, tokens} ─▶ allow-list, backoff ─▶ POST /internal/kv/peer_pin {token ids} ─▶ peer
                                         ◀── {pin id, nonce, block ids, hash chain, lease}
    chain == own chain of those tokens? ─ no ─▶ release, compute (refused)
    handshake (compat; block and TP sizes pair as in P/D) ─▶ connect ─▶ RemoteSource(num_pull_tokens=k)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Optional

import httpx

from pdserve.api.errors import PdserveError
from pdserve.api.kv_transfer import AgentInfo, KVPullFailed, RemotePrefillParams, url_host
from pdserve.api.peer_pull import PEER_PIN_PATH, PeerHint, PeerPinRequest, PeerPinTicket
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.specs import KVGroupPlan
from pdserve.pd.admission import ConnectPeer, KVAdmission, PeerFailureMemory, check_block_ids, pairing_problem
from pdserve.pd.handshake import TOKEN_HEADER, HandshakeClient
from pdserve.pd.peer_costs import PeerPullCosts
from pdserve.pd.peer_pins import peer_pull_problem
from pdserve.pd.peer_trust import PeerAllowList
from pdserve.pd.tickets import MAX_TICKET_BYTES, TicketClient
from pdserve.request import GenerationRequest, RemoteSource
from pdserve.transfer.token_units import block_size_problem
from pdserve.transfer.transport import PeerInfo, TransferError, handshake_address

logger = logging.getLogger(__name__)

CountPeerTokens = Callable[[str, int], None]  # (result, tokens)


class PeerUnusable(Exception):
    """The hint cannot be used; `result` is the counter's label (failed, refused, miss)."""

    def __init__(self, result: str, reason: str, num_tokens: int):
        super().__init__(reason)
        self.result = result
        self.num_tokens = num_tokens


class PeerPinClient:
    """Asks a peer to pin a prefix (one bounded exchange: `timeout_s`, MAX_TICKET_BYTES of answer)."""

    def __init__(self, token: Optional[str], timeout_s: float = 5.0,
                 http_transport: Optional[httpx.AsyncBaseTransport] = None):
        self.token = token
        self.timeout_s = timeout_s
        self.http_transport = http_transport

    async def pin(self, hint: PeerHint, token_ids: list[int]) -> Optional[PeerPinTicket]:
        """The peer's ticket; None when it holds no block of the prefix (404). PeerUnusable otherwise."""
        try:
            status, body = await asyncio.wait_for(self._post(hint, token_ids), self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as error:
            raise PeerUnusable("failed", f"peer {hint.host}:{hint.port} unreachable: {error!r}", len(token_ids)) from None
        if status == 404:
            return None
        if status != 200:
            result = "failed" if status >= 500 or status == 401 else "refused"
            raise PeerUnusable(result, f"peer {hint.host}:{hint.port} refused the pin (HTTP {status})", len(token_ids))
        try:
            return PeerPinTicket.model_validate_json(body)
        except ValueError:
            raise PeerUnusable("failed", f"peer {hint.host}:{hint.port} sent a malformed pin", len(token_ids)) from None

    async def _post(self, hint: PeerHint, token_ids: list[int]) -> tuple[int, bytes]:
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        url = f"http://{url_host(hint.host)}:{hint.port}{PEER_PIN_PATH}"
        body = PeerPinRequest(token_ids=token_ids).model_dump_json()
        async with httpx.AsyncClient(timeout=self.timeout_s, transport=self.http_transport, verify=False,
                                     trust_env=False) as client:
            async with client.stream("POST", url, content=body, headers={**headers, "content-type": "application/json"}) \
                    as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_TICKET_BYTES:
                        raise ValueError(f"the pin passed {MAX_TICKET_BYTES} bytes")
                    chunks.append(chunk)
                return response.status_code, b"".join(chunks)


class PeerPullAdmission:
    """Runs `inner` first (P's or D's own admission); a request it left without remote KV and that carries
    a peer hint may then get a peer pull."""

    def __init__(self, inner: KVAdmission, pins: PeerPinClient, releases: TicketClient, handshake: HandshakeClient,
                 connect_peer: ConnectPeer, plan: KVGroupPlan, block_size: int, tp_size: int = 1,
                 min_tokens: int = 1, count_tokens: CountPeerTokens = lambda result, num_tokens: None,
                 allowed_peers: Optional[PeerAllowList] = None, failures: Optional[PeerFailureMemory] = None,
                 clock: Callable[[], float] = time.monotonic, vouched: bool = True,
                 costs: Optional[PeerPullCosts] = None):
        """`costs`: the decision from measured costs (default: `min_tokens` alone decides).
        `vouched`: a hint's sender proved itself (this worker has an internal token, which the HTTP edge
        checked) or could only be local (a loopback listener). Otherwise a hint may come from anyone who
        reaches the serving port, and is followed only to peers `allowed_peers` names."""
        self.vouched = vouched
        self.inner = inner
        self.pins = pins
        self.releases = releases
        self.handshake = handshake
        self.connect_peer = connect_peer
        self.plan = plan
        self.block_size = block_size
        self.tp_size = tp_size
        self.costs = costs or PeerPullCosts(min_tokens, measured=False)
        self.count_tokens = count_tokens
        self.allowed_peers = allowed_peers
        self.failures = failures or PeerFailureMemory()
        self.clock = clock
        self.model_problem = peer_pull_problem(plan)

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        hint = request.peer_hint
        admitted = await self.inner.admit(dataclasses.replace(request, peer_hint=None))
        if hint is None or admitted.remote is not None:
            return admitted
        num_ask = min(hint.num_tokens, len(request.prompt_token_ids) - 1) // self.block_size * self.block_size
        verdict = self.costs.verdict(num_ask)
        if not verdict.pull:
            logger.info("request %s: peer hint of %d tokens from %s:%d not followed (%s); computing the prompt",
                        request.request_id, hint.num_tokens, hint.host, hint.port, verdict.reason)
            self.count_tokens(verdict.result, hint.num_tokens)
            return admitted
        try:
            source = await self._source(request.request_id, hint, list(request.prompt_token_ids[:num_ask]))
        except PeerUnusable as error:
            logger.info("request %s: no peer pull from %s:%d (%s); computing the prompt", request.request_id,
                        hint.host, hint.port, error)
            self.count_tokens(error.result, error.num_tokens)
            return admitted
        except Exception:  # noqa: BLE001 - our bug: a peer pull never fails the request
            logger.exception("request %s: peer pull from %s:%d failed; computing the prompt", request.request_id,
                             hint.host, hint.port)
            self.count_tokens("failed", num_ask)
            return admitted
        return dataclasses.replace(admitted, remote=source)

    async def _source(self, request_id: str, hint: PeerHint, token_ids: list[int]) -> RemoteSource:
        num_ask = len(token_ids)
        if self.model_problem is not None:
            raise PeerUnusable("refused", self.model_problem, num_ask)
        if self.allowed_peers is None and not self.vouched:
            raise PeerUnusable("refused", "a hint without the internal token is followed only to peers "
                                          "--kv-allowed-peers names", num_ask)
        if self.allowed_peers is not None and not self.allowed_peers.allows(hint.host):
            raise PeerUnusable("refused", f"{hint.host} is not among the allowed peers (--kv-allowed-peers)", num_ask)
        address = handshake_address(hint.host, hint.port)
        skip = self.failures.reason_to_skip(address)
        if skip is not None:
            raise PeerUnusable("failed", f"peer failed recently: {skip}", num_ask)
        asked_s = self.clock()
        try:
            ticket = await self.pins.pin(hint, token_ids)
            self.costs.observe_pin(self.clock() - asked_s)
        except PeerUnusable as error:
            if error.result == "failed":
                self.failures.record_failure(address, str(error))
            raise
        if ticket is None:
            raise PeerUnusable("miss", "the peer holds no block of the prefix", num_ask)
        params = _params(hint, ticket)
        try:
            return await self._verified(request_id, hint, ticket, params, token_ids, address)
        except PeerUnusable:
            self.releases.release_in_background(params)
            raise

    async def _verified(self, request_id: str, hint: PeerHint, ticket: PeerPinTicket, params: RemotePrefillParams,
                        token_ids: list[int], address: str) -> RemoteSource:
        num_tokens = ticket.num_tokens
        problem = block_size_problem(self.block_size, ticket.block_size)
        if problem is not None:
            raise PeerUnusable("refused", f"the peer cannot lend to this worker: {problem}", num_tokens)
        if num_tokens > len(token_ids) or num_tokens % ticket.block_size:
            raise PeerUnusable("refused", f"the peer pinned {num_tokens} tokens of {len(token_ids)} asked", num_tokens)
        if num_tokens < self.costs.min_tokens:
            raise PeerUnusable("miss", f"the peer holds {num_tokens} tokens, under --peer-pull-min-tokens", num_tokens)
        # The peer's chain is over its own block size: this prompt's chain over the same size must equal it.
        own_chain = [h.hex() for h in hash_full_blocks(token_ids[:num_tokens], ticket.block_size, [])]
        if ticket.block_hashes != own_chain:
            raise PeerUnusable("refused", "the peer's hash chain differs from this prompt's", num_tokens)
        try:
            agent = await self.handshake.peer_for(params)
            self._check_geometry(agent, ticket, params, num_tokens)
            peer = dataclasses.replace(PeerInfo.from_dict(agent.transport, via=address),
                                       block_size=agent.geometry.block_size)
            if self.allowed_peers is not None:
                self.allowed_peers.check_data_path(peer, params.remote_host)
            error_text = await self.connect_peer(peer)
        except KVPullFailed as error:
            self.failures.record_failure(address, error.message)
            raise PeerUnusable("failed", error.message, num_tokens) from None
        except (PdserveError, TransferError) as error:  # incompatible model, stale epoch, malformed record
            raise PeerUnusable("refused", error.message, num_tokens) from None
        if error_text is not None:
            self.failures.record_failure(address, error_text)
            raise PeerUnusable("failed", f"no data path to the peer: {error_text}", num_tokens)
        self.failures.record_success(address)
        logger.info("request %s: pulling %d prompt tokens from peer %s (%s)", request_id, num_tokens, agent.engine_id,
                    self.costs.describe(num_tokens))
        return RemoteSource(params, agent, num_pull_tokens=num_tokens)

    def _check_geometry(self, agent: AgentInfo, ticket: PeerPinTicket, params: RemotePrefillParams,
                        num_tokens: int) -> None:
        """What D asks of P (`pairing_problem`: block sizes, TP sizes; the block lists against the peer's pool),
        and that the pin's block size is the one the peer's handshake pages by (its chain was checked over it)."""
        if agent.geometry.block_size != ticket.block_size:
            raise PeerUnusable("refused", f"the peer pinned {ticket.block_size}-token blocks but pages "
                                          f"{agent.geometry.block_size}-token ones", num_tokens)
        problem = pairing_problem(agent, self.plan, self.block_size, self.tp_size)
        if problem is not None:
            raise PeerUnusable("refused", f"the peer {problem}", num_tokens)
        check_block_ids(params, agent, self.plan, self.tp_size)


def _params(hint: PeerHint, ticket: PeerPinTicket) -> RemotePrefillParams:
    """The peer's pin in the record the engine's pull and the release call read (ids from the ticket only)."""
    return RemotePrefillParams(
        do_remote_prefill=True, remote_engine_id=ticket.engine_id, remote_request_id=ticket.pin_id,
        remote_block_ids=ticket.block_ids, remote_host=hint.host, remote_port=hint.port, remote_epoch=ticket.epoch,
        num_prompt_tokens=ticket.num_tokens, lease_s=max(ticket.lease_left_s, 1e-3), remote_pin_nonce=ticket.nonce)

