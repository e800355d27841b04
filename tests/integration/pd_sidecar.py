"""The llm-d routing sidecar's P/D sequence, replayed in Python against real workers.

What is replayed: the `nixlv2` connector of the sidecar in llm-d-inference-scheduler v0.8.0
(commit 05c91f0d655fbd7ea71fc50949c899c360d06f07; the sidecar moved there from
llm-d/llm-d-routing-sidecar, whose last release, v0.3.0, had no fallback), read in
  pkg/sidecar/proxy/chat_completions.go  the prefill target: the first of the comma-separated
                                         `x-prefiller-host-port` values; none: decode alone;
  pkg/sidecar/proxy/connector_nixlv2.go  the two legs, below;
  pkg/sidecar/proxy/proxy_helpers.go     a prefill status outside 2xx falls back to decode alone
                                         unless it is 400..451, which goes back to the client;
  pkg/sidecar/proxy/proxy.go             /v1/completions takes the chat token fields too.
Leg 1 (prefill): the client's JSON with kv_transfer_params = {do_remote_decode: true,
do_remote_prefill: false, remote_engine_id/block_ids/host/port: null}, stream false, no
stream_options, max_tokens and max_completion_tokens both 1; a new version-1 UUID added as
x-request-id to the client's headers. Leg 2 (decode, the worker behind the sidecar): the same JSON
with stream, stream_options and each token field as the client had them (absent if absent) and
kv_transfer_params replaced by the prefill answer's (null if it had none), the same x-request-id.
Fallback: the client's original bytes and headers, untouched. Each leg is a Go reverse proxy hop
(X-Forwarded-For added; a peer that cannot be reached answers 502). Bodies are written as Go's
encoding/json writes the map[string]any that json.Unmarshal made of the client's body: every
number a float64, keys sorted, no spaces, <, > and & escaped (`go_marshal`).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Optional

import httpx

PREFILL_HEADER = "x-prefiller-host-port"
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")  # chat and completions alike
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
_GO_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def go_unmarshal(data: bytes) -> Any:
    """json.Unmarshal into `any`: every number becomes a float64."""
    return json.loads(data, parse_int=float)


def _go_float(value: float) -> str:
    """encoding/json's float64: shortest digits, exponent form only below 1e-6 or from 1e21 on."""
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"json: unsupported value: {value}")
    magnitude = abs(value)
    if magnitude != 0 and (magnitude < 1e-6 or magnitude >= 1e21):
        mantissa, _, exponent = repr(value).partition("e")  # Python's shortest digits are Go's
        if len(exponent) == 3 and exponent.startswith("-0"):
            exponent = "-" + exponent[2:]  # Go writes e-7, not e-07
        return f"{mantissa}e{exponent}"
    return format(Decimal(repr(value)).normalize(), "f")


def go_marshal(value: Any) -> bytes:
    """json.Marshal of what `go_unmarshal` returned (map keys sorted, HTML-safe strings)."""
    return _encode(value).encode()


def _encode(value: Any) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _go_float(float(value))
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return "".join(_GO_ESCAPES.get(char, char) for char in text)
    if isinstance(value, list):
        return "[" + ",".join(_encode(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_encode(key)}:{_encode(value[key])}" for key in sorted(value)) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


@dataclass
class Leg:
    """One request the sidecar sent, as it went out."""

    url: str
    body: bytes
    headers: list[tuple[str, str]]


@dataclass
class SidecarAnswer:
    status_code: int
    body: bytes
    legs: list[Leg]

    def json(self) -> Any:
        return json.loads(self.body)


def prefill_leg_body(client_body: bytes) -> tuple[dict, bytes]:
    """The map after leg 1's edits, and the bytes leg 1 carries."""
    request = go_unmarshal(client_body)
    request["kv_transfer_params"] = dict(REMOTE_DECODE)
    request["stream"] = False
    request.pop("stream_options", None)
    for field in TOKEN_LIMIT_FIELDS:
        request[field] = 1.0
    return request, go_marshal(request)


def decode_leg_body(client_body: bytes, prefill_request: dict, kv_transfer_params: Any) -> bytes:
    """Leg 2's bytes: leg 1's map with the client's stream and token fields put back."""
    original = go_unmarshal(client_body)
    request = dict(prefill_request)
    request.pop("stream")
    for field in ("stream", "stream_options", *TOKEN_LIMIT_FIELDS):
        request.pop(field, None)
        if field in original:
            request[field] = original[field]
    request["kv_transfer_params"] = kv_transfer_params
    return go_marshal(request)


class SidecarReplay:
    """The sidecar in front of one decode worker (`decode_url`), as a function of one request."""

    def __init__(self, decode_url: str, timeout_s: float = 120.0):
        self.decode_url = decode_url
        self.client = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.client.close()

    def post(self, path: str, client_body: bytes, client_headers: Optional[list[tuple[str, str]]] = None) -> SidecarAnswer:
        headers = [("content-type", "application/json"), *(client_headers or [])]
        prefill = next((value.split(",")[0].strip() for name, value in headers if name.lower() == PREFILL_HEADER), "")
        if not prefill:
            return self._decode_alone(path, client_body, headers, [])
        request_id = str(uuid.uuid1())
        prefill_request, prefill_body = prefill_leg_body(client_body)
        leg1 = Leg(f"http://{prefill}{path}", prefill_body, _forwarded([*headers, ("x-request-id", request_id)]))
        status, answer = self._send(leg1)
        if not 200 <= status < 300:
            if 400 <= status <= 451:
                return SidecarAnswer(status, answer, [leg1])
            return self._decode_alone(path, client_body, headers, [leg1])
        kv_transfer_params = go_unmarshal(answer).get("kv_transfer_params")
        leg2 = Leg(self.decode_url + path, decode_leg_body(client_body, prefill_request, kv_transfer_params),
                   _forwarded([*headers, ("x-request-id", request_id)]))
        status, answer = self._send(leg2)
        return SidecarAnswer(status, answer, [leg1, leg2])

    def _decode_alone(self, path: str, body: bytes, headers: list[tuple[str, str]], legs: list[Leg]) -> SidecarAnswer:
        leg = Leg(self.decode_url + path, body, _forwarded(headers))
        status, answer = self._send(leg)
        return SidecarAnswer(status, answer, [*legs, leg])

    def _send(self, leg: Leg) -> tuple[int, bytes]:
        try:
            response = self.client.post(leg.url, content=leg.body, headers=leg.headers)
        except httpx.ConnectError:
            return 502, b""  # httputil.ReverseProxy's answer when the peer cannot be reached
        return response.status_code, response.content


def _forwarded(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [*headers, ("x-forwarded-for", "127.0.0.1")]
