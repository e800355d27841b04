"""Decode side, async: kv_transfer_params are tickets; the blocks to read and the prompt they hold come from P.

Invariant: a decode request reaches the engine with remote KV only when P, asked
on its internal HTTP channel (`POST /internal/kv/pin`, one bounded exchange per
request), handed this worker the pin's ticket, and the ticket's prompt digest
equals the digest of this request's own prompt. The block ids the READ uses
are the ticket's; whatever block ids the params carried are dropped here.
Every other outcome is computed locally (and counted, by reason) or, under
`--kv-failure-policy fail`, a typed error: never a READ. Torch-free.

    client params ──▶ allow-list ──▶ POST /internal/kv/pin {id, nonce, engine, epoch} ──▶ P
                                           ◀── {block ids, prompt sha256, tokens, lease left}
                      own prompt's sha256 == P's? ── no ──▶ recompute (counted) | 409
                                 │ yes
                      params with P's block ids ──▶ DecodeAdmission (handshake, geometry, connect)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Callable, Literal, Optional

import httpx

from pdserve.api.errors import PdserveError
from pdserve.api.kv_transfer import (AwaitedPrefillParams, KVParamsInvalid, KVParamsStale, KVPullFailed,
                                     KVTicketUnusable, PinTicket, RemotePrefillParams, parse_kv_transfer_params,
                                     prompt_digest, url_host)
from pdserve.pd.admission import KVAdmission, PeerFailureMemory
from pdserve.pd.first_token import usable_first_token
from pdserve.pd.handshake import TOKEN_HEADER
from pdserve.pd.peer_trust import PeerAllowList
from pdserve.pd.ticket_inbox import TicketInbox
from pdserve.request import GenerationRequest
from pdserve.transfer.transport import handshake_address, peer_key as transport_peer_key

logger = logging.getLogger(__name__)

# Served by pdserve/server/kv_routes.py on the prefill worker (our proxy spells the release path in
# proxy/kv_release.py: it may not import pd/).
PIN_PATH = "/internal/kv/pin"
RELEASE_PATH = "/internal/kv/release"
MAX_TICKET_BYTES = 4 << 20  # block ids of the longest prompt of a large pool, with room; past it: refused

# Why D computed a prompt that came as P/D (the label of pdserve_pd_recomputed_prompt_tokens_total).
RecomputeReason = Literal["pull_failed", "prompt_mismatch", "stale_ticket"]
CountRecompute = Callable[[str, int], None]  # (reason, prompt tokens)
CountFirstTokenRecompute = Callable[[str], None]  # (reason): D computes the first token P sampled


class TicketUnreachable(Exception):
    """P did not answer the claim usably (network, timeout, oversized or malformed answer, 5xx)."""


class TicketNotHeld(Exception):
    """P holds no claimable pin for these params: unknown id, wrong nonce, read, released, expired (404),
    or its ticket went to another reader (409 `kv_ticket_claimed`)."""


class TicketClient:
    """Claims a pin's ticket from P. Bounded: `timeout_s` for the whole exchange, `MAX_TICKET_BYTES` of body.
    Like the handshake, it speaks plain http to P's internal endpoint and ignores proxy settings."""

    def __init__(self, token: Optional[str], timeout_s: float = 5.0,
                 http_transport: Optional[httpx.AsyncBaseTransport] = None, max_bytes: int = MAX_TICKET_BYTES):
        self.token = token
        self.timeout_s = timeout_s
        self.http_transport = http_transport
        self.max_bytes = max_bytes
        self._releases: set[asyncio.Task] = set()

    async def claim(self, params: RemotePrefillParams) -> PinTicket:
        """P's ticket for the params' pin. TicketNotHeld: P holds no claimable pin for them. KVParamsStale
        (409): the address serves another engine or a later start of it (P restarted). TicketUnreachable:
        anything else."""
        try:
            status, body = await asyncio.wait_for(self._post(params), self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError) as error:
            raise TicketUnreachable(f"no ticket from {params.remote_host}:{params.remote_port}: {error!r}") from None
        if status == 404 or (status == 409 and _error_type(body) == "kv_ticket_claimed"):
            raise TicketNotHeld(f"prefill worker {params.remote_engine_id} holds no claimable pin "
                                f"{params.remote_request_id} for these params (HTTP {status})")
        if status == 409:
            raise KVParamsStale(f"kv_transfer_params name engine {params.remote_engine_id!r}, epoch "
                                f"{params.remote_epoch!r}: not the prefill worker at that address now")
        if status != 200:
            raise TicketUnreachable(f"prefill worker {params.remote_engine_id} refused the ticket (HTTP {status})")
        try:
            ticket = PinTicket.model_validate_json(body)
        except ValueError:  # pydantic's ValidationError included
            raise TicketUnreachable(f"prefill worker {params.remote_engine_id} sent a malformed ticket") from None
        if ticket.request_id != params.remote_request_id:
            raise TicketUnreachable(f"prefill worker {params.remote_engine_id} sent the ticket of another pin")
        return ticket

    def release_in_background(self, params: RemotePrefillParams) -> None:
        """Tell P, without waiting, that this worker will not read a pin it claimed (its lease is the fallback)."""
        task = asyncio.get_running_loop().create_task(self._release(params))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, params: RemotePrefillParams) -> None:
        try:
            status, _ = await asyncio.wait_for(self._post(params, RELEASE_PATH), self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError, TicketUnreachable) as error:
            status = repr(error)
        if status != 202:
            logger.info("pin %s: release on %s failed (%s); its lease frees it", params.remote_request_id,
                        params.remote_engine_id, status)

    async def _post(self, params: RemotePrefillParams, path: str = PIN_PATH) -> tuple[int, bytes]:
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        url = f"http://{url_host(params.remote_host)}:{params.remote_port}{path}"
        body = {"remote_request_id": params.remote_request_id, "remote_pin_nonce": params.remote_pin_nonce,
                "remote_engine_id": params.remote_engine_id, "remote_epoch": params.remote_epoch}
        async with httpx.AsyncClient(timeout=self.timeout_s, transport=self.http_transport, verify=False,
                                     trust_env=False) as client:
            async with client.stream("POST", url, json=body, headers=headers) as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise TicketUnreachable(f"the ticket passed {self.max_bytes} bytes")
                    chunks.append(chunk)
                return response.status_code, b"".join(chunks)


def _error_type(body: bytes) -> Optional[str]:
    """`error.type` of an OpenAI-style error body, None when it is not one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("type") if isinstance(error, dict) else None


def ticketed_params(params: RemotePrefillParams, ticket: PinTicket) -> RemotePrefillParams:
    """The params the engine may act on: P's block ids, prompt length and remaining lease, never the client's."""
    return params.model_copy(update={"remote_block_ids": ticket.block_ids, "num_prompt_tokens": ticket.num_prompt_tokens,
                                     "lease_s": max(ticket.lease_left_s, 1e-3)})


def prompt_matches(ticket: PinTicket, prompt_token_ids: "tuple[int, ...] | list[int]") -> bool:
    return (ticket.num_prompt_tokens == len(prompt_token_ids)
            and ticket.prompt_sha256 == prompt_digest(prompt_token_ids))


class TicketAdmission:
    """D's admission: the ticket first (this module's invariant), then `inner` (handshake, geometry, connection)
    on params that carry P's block ids. Counts every P/D request it turns into a local prefill."""

    def __init__(self, inner: KVAdmission, client: TicketClient, policy: Literal["recompute", "fail"],
                 count_recompute: CountRecompute = lambda reason, num_tokens: None,
                 allowed_peers: Optional[PeerAllowList] = None, failures: Optional[PeerFailureMemory] = None,
                 count_failure: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 takes_first_token: bool = True,
                 count_first_token_recompute: CountFirstTokenRecompute = lambda reason: None,
                 observe_ticket_s: Callable[[float], None] = lambda seconds: None,
                 inbox: Optional[TicketInbox] = None):
        """`failures`: the inner admission's memory of dead peers, so a dead P costs no claim either;
        `count_failure`: the inner admission's count of unreachable peers (pdserve_transfer_failures_total);
        `takes_first_token`: whether this worker may start from P's first token (not with recurrent state);
        `count_first_token_recompute`: a usable ticket whose first token D computes again, by reason;
        `observe_ticket_s`: seconds from admission's start to a claimed ticket (handoff component d_ticket);
        `inbox`: where a decode leg sent beside its prefill leg waits for P's params (pd/ticket_inbox.py)."""
        self.inbox = inbox
        self.observe_ticket_s = observe_ticket_s
        self.takes_first_token = takes_first_token
        self.count_first_token_recompute = count_first_token_recompute
        self.inner = inner
        self.count_failure = count_failure
        self.failures = failures or PeerFailureMemory()
        self.client = client
        self.policy = policy
        self.count_recompute = count_recompute
        self.allowed_peers = allowed_peers
        self.clock = clock

    async def admit(self, request: GenerationRequest) -> GenerationRequest:
        if isinstance(request.kv_params, AwaitedPrefillParams):
            request = dataclasses.replace(request, kv_params=await self._delivered(request.kv_params))
        params = request.kv_params
        if not isinstance(params, RemotePrefillParams):
            return await self.inner.admit(request)
        admitted_s = self.clock()
        if self.allowed_peers is not None:
            self.allowed_peers.check(params.remote_host)  # before any contact with it
        # The key the inner admission remembers failures under (handshake address, engine, epoch).
        peer_key = transport_peer_key(params.remote_engine_id, params.remote_epoch,
                                      handshake_address(params.remote_host, params.remote_port))
        skip = self.failures.reason_to_skip(peer_key)
        if skip is not None:
            self.count_failure()
            return self._local(request, "pull_failed", KVPullFailed(f"prefill worker unreachable: {skip}"))
        try:
            ticket = await self.client.claim(params)
        except TicketUnreachable as error:
            self.count_failure()
            self.failures.record_failure(peer_key, str(error))
            return self._local(request, "pull_failed", KVPullFailed(f"prefill worker unreachable: {error}"))
        except TicketNotHeld as error:
            return self._local(request, "stale_ticket", KVTicketUnusable(str(error)))
        ticket_s = self.clock() - admitted_s
        self.observe_ticket_s(ticket_s)
        logger.debug("request %s: ticket claimed in %.1f ms", request.request_id, ticket_s * 1e3)
        if not prompt_matches(ticket, request.prompt_token_ids):
            self.client.release_in_background(params)
            return self._local(request, "prompt_mismatch", KVTicketUnusable(
                f"the KV pinned as {params.remote_request_id} on prefill worker {params.remote_engine_id} was "
                f"computed from another prompt than this request's"))
        first_token, why_not = usable_first_token(ticket, request.sampling, self.takes_first_token)
        if why_not is not None:
            self.count_first_token_recompute(why_not)
        try:
            admitted = await self.inner.admit(dataclasses.replace(request, kv_params=ticketed_params(params, ticket),
                                                                  first_token=first_token))
        except PdserveError:
            self.client.release_in_background(params)
            raise
        if admitted.remote is None:  # the inner admission fell back to a local prefill (peer unreachable)
            self.client.release_in_background(params)
            self.count_recompute("pull_failed", len(request.prompt_token_ids))
            # D computes the prompt, then goes on from P's token 1 (the client may hold it already).
            return dataclasses.replace(admitted, pd_recomputed=True, first_token=first_token)
        return admitted

    async def _delivered(self, awaited: AwaitedPrefillParams) -> RemotePrefillParams:
        """P's params for a decode leg sent beside its prefill leg, once the proxy delivers them (bounded by
        the inbox's wait; cancelled with the leg). They are a ticket like any other: claimed from P below."""
        if self.inbox is None:
            raise KVParamsInvalid("kv_transfer_params.awaited_ticket: this worker takes no concurrent legs",
                                  param="kv_transfer_params")
        params = parse_kv_transfer_params(await self.inbox.wait(awaited.awaited_ticket))
        if not isinstance(params, RemotePrefillParams):
            raise KVParamsInvalid("the delivered kv_transfer_params name no prefill worker's pin",
                                  param="kv_transfer_params")
        return params

    def _local(self, request: GenerationRequest, reason: RecomputeReason, error: PdserveError) -> GenerationRequest:
        if self.policy == "fail":
            raise error
        logger.warning("request %s: %s; prefilling locally", request.request_id, error.message)
        self.count_recompute(reason, len(request.prompt_token_ids))
        return dataclasses.replace(request, kv_params=None, pd_recomputed=True)
