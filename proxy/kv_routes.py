"""`/internal/routing/explain`: given a request body, each candidate's cached prefix, load and score.

GET (with a body, as the issue names it) and POST both work. Guarded by the
internal token when the proxy has one: the answer reveals which worker has
seen which prompts. Changes nothing (no round-robin turn is taken).
"""

from __future__ import annotations

import hmac
import json
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxy.backends import INTERNAL_TOKEN_HEADER
from proxy.errors import error_body
from proxy.routing.kv_routing import KVRouting

EXPLAIN_PATH = "/internal/routing/explain"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def _error(status: int, message: str, error_type: str) -> Response:
    return Response(error_body(status, message, error_type), status, media_type="application/json")


def explain_route(kv: Optional[KVRouting], internal_token: Optional[str]) -> Route:
    async def explain(request: Request) -> Response:
        if internal_token is not None:
            given = request.headers.get(INTERNAL_TOKEN_HEADER, "")
            if not hmac.compare_digest(given.encode(), internal_token.encode()):
                return _error(401, f"this needs the internal token (header {INTERNAL_TOKEN_HEADER})",
                              "authentication_error")
        if kv is None:
            return _error(404, "KV-aware routing is off: start the proxy with --policy kv_aware", "not_found_error")
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "send the request body (a JSON object) to explain", "invalid_request_error")
        path = request.query_params.get("path") or (CHAT_PATH if "messages" in body else COMPLETIONS_PATH)
        return JSONResponse(await kv.explain(path, body))

    return Route(EXPLAIN_PATH, explain, methods=["GET", "POST"])
