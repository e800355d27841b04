"""The one place where failures become HTTP answers: OpenAI-style error bodies with the right status.

Invariant: user input never produces a 500. Typed `PdserveError`s carry their
status, pydantic validation errors and malformed JSON are 400s, unknown routes
keep their 404/405, and only genuine bugs fall through to a logged 500.
"""

from __future__ import annotations

import hmac

import logging
from typing import Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import PdserveError, Unauthorized
from pdserve.api.http_bounds import read_body
from pdserve.api.protocol import ErrorInfo, ErrorResponse
from pdserve.api.validation import invalid_request_from_validation
from pdserve.metrics import RequestMetrics
from pdserve.server.context import REQUEST_ID_HEADER

logger = logging.getLogger(__name__)

__all__ = ["invalid_request_from_validation", "install_error_handlers", "check_internal_token"]

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; there is nobody to answer."""


class RequestAbortedByEngine(PdserveError):
    """The engine dropped a request whose client is still connected (e.g. while draining)."""

    status_code = 503
    error_type = "service_unavailable"


INTERNAL_TOKEN_HEADER = "X-Pdserve-Internal-Token"


BodyT = TypeVar("BodyT", bound=BaseModel)

def check_internal_token(request: Request, expected: str | None) -> None:
    """Internal endpoints and kv_transfer_params need the shared token when one is configured."""
    if expected is None:
        return
    given = request.headers.get(INTERNAL_TOKEN_HEADER)
    if given is None or not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized(f"this needs the internal token (header {INTERNAL_TOKEN_HEADER})")


async def internal_request_body(request: Request, schema: type[BodyT], limits: LimitsConfig,
                                internal_token: str | None) -> BodyT:
    """An internal route's JSON body as `schema`: the token checked first (401), then the body read within
    `limits` and validated (400 naming the field)."""
    check_internal_token(request, internal_token)
    try:
        return schema.model_validate_json(await read_body(request, limits))
    except ValidationError as error:
        raise invalid_request_from_validation(error) from None


def error_response_body(
    status_code: int, message: str, error_type: str, param: Optional[str] = None
) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status_code))


def body_for_exception(exc: PdserveError) -> ErrorResponse:
    return error_response_body(exc.status_code, exc.message, exc.error_type, exc.param)


def _headers(request: Request) -> dict[str, str]:
    request_id = getattr(request.state, "request_id", None)
    return {REQUEST_ID_HEADER: request_id} if request_id else {}


def _json_error(request: Request, metrics: RequestMetrics, body: ErrorResponse, status_code: int,
                retry_after_s: Optional[int] = None) -> JSONResponse:
    metrics.count_error(status_code)
    headers = _headers(request)
    if status_code == 503:
        headers["Retry-After"] = str(retry_after_s or 1)
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI, metrics: RequestMetrics) -> None:
    """Register the handlers; raw pydantic `ValidationError`s are not mapped here on purpose:
    request parsing converts them with `invalid_request_from_validation`, so a
    bug that fails to build a response still surfaces as a 500."""

    async def on_pdserve_error(request: Request, exc: PdserveError) -> Response:
        # Client mistakes are routine; an unavailable engine deserves attention; a 5xx is a fault.
        log = logger.info if exc.status_code < 500 else logger.warning if exc.status_code == 503 else logger.error
        log("request %s rejected (%d): %s", getattr(request.state, "request_id", "-"), exc.status_code, exc.message)
        return _json_error(request, metrics, body_for_exception(exc), exc.status_code, exc.retry_after_s)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return await on_pdserve_error(request, invalid_request_from_validation(exc))

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = _TYPE_BY_STATUS.get(exc.status_code, "invalid_request_error")
        body = error_response_body(exc.status_code, str(exc.detail), error_type)
        return _json_error(request, metrics, body, exc.status_code)

    async def on_client_disconnected(request: Request, exc: Exception) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps access logs honest.
        return Response(status_code=499)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("request %s failed", getattr(request.state, "request_id", "-"), exc_info=exc)
        body = error_response_body(500, "internal server error", "internal_error")
        return _json_error(request, metrics, body, 500)

    app.add_exception_handler(PdserveError, on_pdserve_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(ClientDisconnected, on_client_disconnected)
    app.add_exception_handler(ClientDisconnect, on_client_disconnected)  # gone while sending its body
    app.add_exception_handler(Exception, on_unexpected)
