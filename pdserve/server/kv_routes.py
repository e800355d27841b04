"""Internal routes of P/D workers: `GET /internal/kv/agent_info` (the handshake) and, on a prefill
worker, `POST /internal/kv/release` (the proxy gives up on a prefill's KV once its decode leg failed).

Guarded by the shared internal token when one is configured: the handshake
lets a caller address this worker's memory, a release frees it. A release
names the engine id and epoch the KV came from, so a stale one (this worker
restarted since) frees nothing.
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import EngineNotReady
from pdserve.api.http_bounds import read_body
from pdserve.api.kv_transfer import AgentInfo, KVParamsStale, KVReleaseRequest
from pdserve.api.validation import invalid_request_from_validation
from pdserve.pd.handshake import AGENT_INFO_PATH
from pdserve.server.errors import check_internal_token

RELEASE_PATH = "/internal/kv/release"
# A release names three short ids: read at most this much of its body (413 past it, never the rest).
_RELEASE_BODY_LIMITS = LimitsConfig(max_body_bytes=4096)


def create_kv_router(agent_info: Callable[[], Optional[AgentInfo]], internal_token: Optional[str],
                     release: Optional[Callable[[str], None]] = None) -> APIRouter:
    """`release(request_id)` asks the engine thread to free a pinned prefill (prefill workers only)."""
    router = APIRouter()

    def ready_agent() -> AgentInfo:
        info = agent_info()
        if info is None:
            raise EngineNotReady("the KV pool is not registered yet (model loading)")
        return info

    @router.get(AGENT_INFO_PATH)
    async def get_agent_info(request: Request) -> Response:
        check_internal_token(request, internal_token)
        return Response(ready_agent().model_dump_json(), media_type="application/json")

    if release is not None:
        @router.post(RELEASE_PATH)
        async def release_pinned(request: Request) -> Response:
            check_internal_token(request, internal_token)
            try:
                body = KVReleaseRequest.model_validate_json(await read_body(request, _RELEASE_BODY_LIMITS))
            except ValidationError as error:
                raise invalid_request_from_validation(error) from None
            info = ready_agent()
            if (body.remote_engine_id, body.remote_epoch) != (info.engine_id, info.epoch):
                raise KVParamsStale("the KV names another engine or an earlier start of this one: nothing to release")
            release(body.remote_request_id)
            return JSONResponse({"status": "accepted"}, status_code=202)

    return router
