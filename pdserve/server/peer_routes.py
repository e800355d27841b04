"""Peer pulls at the HTTP edge: the holder's `POST /internal/kv/peer_pin` (internal listener) and the
puller's reading of the `X-Pdserve-Peer-Hint` header (serving port).

Invariants: the pin route is guarded by the internal token like every internal route, reads a bounded
body, and pins on the engine thread (the KV manager is the engine thread's), awaiting a tier load there
without blocking it (pd/peer_pins.py); a hint is taken only from
a caller that shows the internal token when one is configured (a client must not aim a worker at an
arbitrary address: our proxy strips the header from client input and sets its own), and a malformed
or unauthenticated hint is ignored, never an error: the request is then computed here.
"""

from __future__ import annotations

import hmac
import logging
from typing import Awaitable, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import EngineNotReady
from pdserve.api.kv_transfer import TicketNotFound
from pdserve.api.peer_pull import MAX_PEER_PIN_TOKENS, PEER_HINT_HEADER, PEER_PIN_PATH, PeerHint, PeerPinRequest, \
    PeerPinTicket, parse_peer_hint
from pdserve.server.errors import INTERNAL_TOKEN_HEADER, internal_request_body

logger = logging.getLogger(__name__)

# Token ids as JSON: at most ~12 bytes each with the comma.
_PIN_BODY_LIMITS = LimitsConfig(max_body_bytes=12 * MAX_PEER_PIN_TOKENS)

# token ids -> the ticket (None: no block of them held); None as a whole: the engine is not built yet
PinPrefix = Callable[[list[int]], Optional[Awaitable[Optional[PeerPinTicket]]]]


def create_peer_pin_router(pin: PinPrefix, internal_token: Optional[str]) -> APIRouter:
    router = APIRouter()

    @router.post(PEER_PIN_PATH)
    async def peer_pin(request: Request) -> Response:
        body = await internal_request_body(request, PeerPinRequest, _PIN_BODY_LIMITS, internal_token)
        pinning = pin(body.token_ids)
        if pinning is None:
            raise EngineNotReady("the engine is not built yet (model loading)")
        ticket = await pinning
        if ticket is None:
            raise TicketNotFound("this worker holds no block of that prefix")
        return Response(ticket.model_dump_json(), media_type="application/json")

    return router


def peer_hint_from(request: Request, internal_token: Optional[str], enabled: bool = True) -> Optional[PeerHint]:
    """The request's peer hint, when it may have one (see the module's invariant); None otherwise."""
    text = request.headers.get(PEER_HINT_HEADER)
    if text is None or not enabled:
        return None
    if internal_token is not None:
        given = request.headers.get(INTERNAL_TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), internal_token.encode()):
            logger.info("ignoring a peer hint sent without the internal token")
            return None
    hint = parse_peer_hint(text)
    if hint is None:
        logger.info("ignoring a malformed peer hint %r", text[:120])
    return hint
