"""Typed failures of the proxy and their one mapping to OpenAI-style error answers.

Invariant: every answer the proxy itself makes up is `{"error": {message,
type, param, code}}` with the right status, and a 503 always carries
`Retry-After`; answers relayed from a worker keep the worker's own body.
"""

from __future__ import annotations

import json
from typing import Optional

from starlette.responses import Response

from pdserve.api.errors import PdserveError


class ProxyError(PdserveError):
    """An answer the proxy makes up itself: a `PdserveError` (status, type, message, param) whose 503s
    carry the proxy's configured Retry-After rather than the class's `retry_after_s`."""


class RejectedRequest(ProxyError):
    """The workers' own edge validation (pdserve/api/validation.py) refused the request:
    the client gets exactly the status, type, message and param a worker would give."""

    def __init__(self, error: PdserveError):
        super().__init__(error.message, param=error.param)
        self.status_code = error.status_code
        self.error_type = error.error_type


class NoBackendAvailable(ProxyError):
    """Every worker of a role is down, open-circuited or saturated (503 + Retry-After)."""

    status_code = 503
    error_type = "service_unavailable"


class UpstreamFailed(ProxyError):
    """A worker was reached but its answer was unusable (502)."""

    status_code = 502
    error_type = "bad_gateway"


class UpstreamTimeout(ProxyError):
    status_code = 504
    error_type = "gateway_timeout"


def error_body(status_code: int, message: str, error_type: str, param: Optional[str] = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status_code}}).encode()


def error_response(exc: ProxyError, request_id: Optional[str], retry_after_s: int) -> Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if exc.status_code == 503:
        headers["Retry-After"] = str(retry_after_s)
    body = error_body(exc.status_code, exc.message, exc.error_type, exc.param)
    return Response(body, status_code=exc.status_code, media_type="application/json", headers=headers)
