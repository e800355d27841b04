"""The proxy's own error answers: `PdserveError`'s fields, the workers' OpenAI body shape, and a
503's Retry-After from the proxy's config."""

from __future__ import annotations

import json

from pdserve.api.errors import InvalidRequest, PdserveError, RequestTooLarge
from proxy.errors import NoBackendAvailable, ProxyError, RejectedRequest, UpstreamFailed, error_response


def _body(response) -> dict:
    return json.loads(response.body)


def test_proxy_errors_are_pdserve_errors_with_their_own_status():
    assert issubclass(ProxyError, PdserveError)
    assert (ProxyError("x").status_code, ProxyError("x").error_type) == (500, "internal_error")
    assert (NoBackendAvailable("x").status_code, NoBackendAvailable("x").error_type) == (503, "service_unavailable")
    assert (UpstreamFailed("x").status_code, UpstreamFailed("x").error_type) == (502, "bad_gateway")


def test_a_503_answer_carries_the_configured_retry_after_and_the_openai_body():
    response = error_response(NoBackendAvailable("no decode worker"), "req-1", 7)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "7"
    assert response.headers["X-Request-Id"] == "req-1"
    assert response.body == (b'{"error": {"message": "no decode worker", "type": "service_unavailable", '
                             b'"param": null, "code": 503}}')


def test_a_rejected_request_answers_as_the_worker_would():
    response = error_response(RejectedRequest(InvalidRequest("bad n", param="n")), None, 1)
    assert response.status_code == 400 and "Retry-After" not in response.headers
    assert _body(response) == {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n",
                                         "code": 400}}
    assert error_response(RejectedRequest(RequestTooLarge("too big")), None, 1).status_code == 413
