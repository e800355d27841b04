"""Typed errors of the serving path; the server maps each to one HTTP status.

Raise these (never `assert`) when input is rejected, so every caller gets a
precise OpenAI-style error body and the engine keeps running.
"""

from __future__ import annotations


class PdserveError(Exception):
    status_code = 500
    error_type = "internal_error"
    retry_after_s: int | None = None  # sent as Retry-After (every 503 has one)

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(PdserveError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus requested tokens) does not fit the model's context."""


class RequestTooLarge(PdserveError):
    status_code = 413
    error_type = "invalid_request_error"


class RequestTimeout(PdserveError):
    """The client did not send its whole body in time."""

    status_code = 408
    error_type = "invalid_request_error"


class ModelNotFound(PdserveError):
    status_code = 404
    error_type = "not_found_error"


class Unauthorized(PdserveError):
    status_code = 401
    error_type = "authentication_error"


class EngineNotReady(PdserveError):
    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1


class EngineOverloaded(PdserveError):
    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1


class EngineFailure(PdserveError):
    """The worker itself failed (its engine loop stopped): another worker may succeed."""

    status_code = 500
    error_type = "internal_error"


class RequestFailed(EngineFailure):
    """The engine failed this request alone and keeps serving others: whatever caused it
    travels with the request, so a proxy passes it through instead of retrying or
    blaming the worker."""

    error_type = "request_failed"
