"""Typed errors of the serving path; the server maps each to one HTTP status.

Raise these (never `assert`) when input is rejected, so every caller gets a
precise OpenAI-style error body and the engine keeps running.
"""

from __future__ import annotations


class PdserveError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(PdserveError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus requested tokens) does not fit the model's context."""


class ModelNotFound(PdserveError):
    status_code = 404
    error_type = "not_found_error"


class Unauthorized(PdserveError):
    status_code = 401
    error_type = "authentication_error"


class EngineNotReady(PdserveError):
    status_code = 503
    error_type = "service_unavailable"


class EngineOverloaded(PdserveError):
    status_code = 503
    error_type = "service_unavailable"


class EngineFailure(PdserveError):
    status_code = 500
    error_type = "internal_error"
