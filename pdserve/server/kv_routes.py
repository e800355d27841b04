"""Internal routes of P/D workers: `GET /internal/kv/agent_info` (the handshake).

Guarded by the shared internal token when one is configured: the reply lets a
caller address this worker's memory.
"""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.errors import EngineNotReady
from pdserve.server.errors import check_internal_token
from pdserve.pd.handshake import AGENT_INFO_PATH, AgentInfo


def create_kv_router(agent_info: Callable[[], Optional[AgentInfo]], internal_token: Optional[str]) -> APIRouter:
    router = APIRouter()

    @router.get(AGENT_INFO_PATH)
    async def get_agent_info(request: Request) -> Response:
        check_internal_token(request, internal_token)
        info = agent_info()
        if info is None:
            raise EngineNotReady("the KV pool is not registered yet (model loading)")
        return Response(info.model_dump_json(), media_type="application/json")

    return router
