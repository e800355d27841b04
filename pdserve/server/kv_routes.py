"""Internal routes of P/D workers: `GET /internal/kv/agent_info` (the handshake); on a prefill
worker, `POST /internal/kv/pin` (a decode worker claims a pin's ticket: where its blocks are and which
prompt they hold) and `POST /internal/kv/release` (the proxy gives up on a prefill's KV once its decode
leg failed, or a puller on a peer pin it will not read; a decode worker that lends its prefixes to
peers has this route too); on a decode worker, `POST /internal/kv/ticket` (the proxy delivers P's kv_transfer_params
to a decode leg it sent beside the prefill leg, or calls that leg off: pd/ticket_inbox.py).

Guarded by the shared internal token when one is configured: the handshake
lets a caller address this worker's memory, a release frees it. A ticket
claim and a release name the engine id and epoch the KV came from, so a
stale one (this worker restarted since) gets nothing, and the pin's nonce:
without it a caller learns and frees nothing (an unknown id and a wrong
nonce answer the same 404).
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import EngineNotReady
from pdserve.api.kv_transfer import (AgentInfo, KVParamsInvalid, KVParamsStale, KVTicketNotDelivered, PinReference,
                                     PinTicket, RemotePrefillParams, TicketAlreadyClaimed, TicketDelivery, TicketNotFound,
                                     parse_kv_transfer_params)
from pdserve.pd.handshake import AGENT_INFO_PATH
from pdserve.pd.leases import Claim, ClaimOutcome
from pdserve.pd.ticket_inbox import Delivery
from pdserve.pd.tickets import PIN_PATH, RELEASE_PATH  # one home for the paths D calls and P serves

TICKET_PATH = "/internal/kv/ticket"  # D's: the proxy delivers P's params (proxy/both_legs.py spells it too)
from pdserve.server.errors import check_internal_token, internal_request_body

# A release or a claim names four short ids: read at most this much of its body (413 past it, never the rest).
_PIN_BODY_LIMITS = LimitsConfig(max_body_bytes=4096)
# A delivery carries P's params, whose informative block ids grow with the prompt.
_TICKET_BODY_LIMITS = LimitsConfig(max_body_bytes=4 << 20)

ReleasePin = Callable[[str, str], None]  # (request id, nonce): free at the engine thread's next turn
ClaimTicket = Callable[[str, str], Optional[Claim[PinTicket]]]  # (request id, nonce); None: engine not built
DeliverTicket = Callable[[str, Optional[dict]], Optional[Delivery]]  # (key, params or None); None: not built


def create_kv_router(agent_info: Callable[[], Optional[AgentInfo]], internal_token: Optional[str],
                     release: Optional[ReleasePin] = None, claim: Optional[ClaimTicket] = None,
                     deliver: Optional[DeliverTicket] = None) -> APIRouter:
    """`claim` is a prefill worker's, `release` a worker's that lends (P; D with peer pulls on), `deliver`
    a decode worker's (None elsewhere: the routes are absent)."""
    router = APIRouter()

    def ready_agent() -> AgentInfo:
        info = agent_info()
        if info is None:
            raise EngineNotReady("the KV pool is not registered yet (model loading)")
        return info

    async def pin_reference(request: Request) -> PinReference:
        body = await internal_request_body(request, PinReference, _PIN_BODY_LIMITS, internal_token)
        info = ready_agent()
        if (body.remote_engine_id, body.remote_epoch) != (info.engine_id, info.epoch):
            raise KVParamsStale("the KV names another engine or an earlier start of this one: no such pin here")
        return body

    @router.get(AGENT_INFO_PATH)
    async def get_agent_info(request: Request) -> Response:
        check_internal_token(request, internal_token)
        return Response(ready_agent().model_dump_json(), media_type="application/json")

    if release is not None:
        @router.post(RELEASE_PATH)
        async def release_pinned(request: Request) -> Response:
            body = await pin_reference(request)
            release(body.remote_request_id, body.remote_pin_nonce)
            return JSONResponse({"status": "accepted"}, status_code=202)

    if claim is not None:
        @router.post(PIN_PATH)
        async def claim_ticket(request: Request) -> Response:
            body = await pin_reference(request)
            answer = claim(body.remote_request_id, body.remote_pin_nonce)
            if answer is None:
                raise EngineNotReady("the engine is not built yet (model loading)")
            if answer.outcome is ClaimOutcome.ALREADY_CLAIMED:
                raise TicketAlreadyClaimed(f"pin {body.remote_request_id}: its ticket was claimed already")
            if answer.outcome is not ClaimOutcome.GRANTED or answer.ticket is None:
                raise TicketNotFound(f"no live pin {body.remote_request_id} with that nonce")
            return Response(answer.ticket.model_dump_json(), media_type="application/json")

    if deliver is not None:
        @router.post(TICKET_PATH)
        async def deliver_ticket(request: Request) -> Response:
            body = await internal_request_body(request, TicketDelivery, _TICKET_BODY_LIMITS, internal_token)
            if body.kv_transfer_params is not None and \
                    not isinstance(parse_kv_transfer_params(body.kv_transfer_params), RemotePrefillParams):
                raise KVParamsInvalid("kv_transfer_params must name a prefill worker's pin (do_remote_prefill)",
                                      param="kv_transfer_params")
            outcome = deliver(body.awaited_ticket, body.kv_transfer_params)
            if outcome is None:
                raise EngineNotReady("the engine is not built yet (model loading)")
            if outcome is Delivery.FULL:
                raise KVTicketNotDelivered("too many decode legs wait for their prefill: retry later")
            if outcome is Delivery.DUPLICATE:
                return JSONResponse({"status": "duplicate"}, status_code=409)
            return JSONResponse({"status": "accepted"}, status_code=202)

    return router
