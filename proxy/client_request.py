"""A client's request as the proxy sees it, and the bodies of the two legs built from it.

Invariants: a request is validated by the workers' own rules
(`pdserve/api/validation.py`) before any leg is sent, so a prefill worker never
computes a request the decode worker would refuse; whatever
`kv_transfer_params` a client sends is dropped before anything is forwarded
(only the proxy may tell a worker to pin or pull KV), and the prefill leg
never streams and never generates more than one token. The proxy has no
tokenizer: prompt sizes are estimated (see `estimate_text_tokens`).
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import PdserveError
from pdserve.api.validation import (MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER, check_request_id, parse_json_body,
                                schema_for_path, validate_request)
from proxy.errors import RejectedRequest

if TYPE_CHECKING:
    from proxy.routing.kv_prompt import KVRoute

__all__ = ["MAX_REQUEST_ID_CHARS", "REQUEST_ID_HEADER"]
# A chat template wraps each message in a few tokens of markup (role, separators).
CHAT_TOKENS_PER_MESSAGE = 4
REMOTE_DECODE_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
_DROPPED_ON_PREFILL = ("stream_options", "min_tokens", "kv_transfer_params")


@dataclass(slots=True)
class ClientRequest:
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]  # the client's body without kv_transfer_params
    request_id: str
    stream: bool
    prompt_text: str  # what prefix routing and the size estimate look at
    num_prompt_tokens: int  # exact for token-id prompts, estimated for text
    max_tokens: Optional[int] = None  # what decode will be asked for: the prefill worker checks it fits
    min_tokens: Optional[int] = None
    needs_local_prompt: bool = False  # the decode worker must compute the prompt itself (see below)
    kv_route: Optional["KVRoute"] = None  # set by kv_aware routing (proxy/routing/kv_routing.py)
    prefill_url: Optional[str] = None  # a known prefill backend the client named (x-prefiller-host-port)
    client_key: str = ""  # who it counts for in the SLO window (proxy.slo.client_key)
    peer_hint_headers: dict[str, str] = field(default_factory=dict)  # the next prefill leg's (routing/peer_hints.py)
    want_first_events: bool = False  # ask P for token 1's stream events (proxy/early_stream.py)

    def prefix_key(self, num_chars: int) -> bytes:
        return self.prompt_text[:num_chars].encode("utf-8", "surrogatepass")


def choose_request_id(client_value: Optional[str]) -> str:
    """The client's X-Request-Id (rejected by the workers' rule, 400, when they would refuse it),
    or a fresh one when it sent none."""
    if not client_value:
        return uuid.uuid4().hex
    try:
        check_request_id(client_value)
    except PdserveError as error:
        raise RejectedRequest(error) from None
    return client_value


def parse_client_request(path: str, raw_body: bytes, request_id: str, chars_per_token: float,
                         limits: LimitsConfig = LimitsConfig()) -> ClientRequest:
    """Validate with the workers' rules (400/413 as they would answer), then keep the body as sent."""
    try:
        body = parse_json_body(raw_body, limits)
        typed = validate_request(schema_for_path(path), body, limits)
    except PdserveError as error:
        raise RejectedRequest(error) from None
    body.pop("kv_transfer_params", None)
    if path.endswith("/chat/completions"):
        text, num_tokens = _chat_prompt(body.get("messages"), chars_per_token)
    else:
        text, num_tokens = _completion_prompt(body.get("prompt"), chars_per_token)
    return ClientRequest(path, body, request_id, typed.stream is True, text, num_tokens,
                         typed.requested_max_tokens, typed.min_tokens, needs_local_prompt=_needs_local_prompt(body))


def _needs_local_prompt(body: dict[str, Any]) -> bool:
    """Requests one prefill leg cannot serve: a batch of prompts (one kv_transfer_params per leg),
    and echo with logprobs (the prompt's logprobs come from the worker that computes it)."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    return batched or (body.get("echo") is True and body.get("logprobs") is not None)


def estimate_text_tokens(text: str, chars_per_token: float) -> int:
    """English BPE vocabularies average about 4 characters per token; round up."""
    return math.ceil(len(text) / chars_per_token)


def _completion_prompt(prompt: Any, chars_per_token: float) -> tuple[str, int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, estimate_text_tokens(prompt, chars_per_token)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # Token ids: the count is exact, and their decimal spelling is a fine prefix key.
        return ",".join(map(str, prompt)), len(prompt)
    return "", 0  # malformed: the worker will say why


def _chat_prompt(messages: Any, chars_per_token: float) -> tuple[str, int]:
    if not isinstance(messages, list):
        return "", 0
    pieces: list[str] = []
    for message in messages:
        if isinstance(message, dict):
            pieces.append(f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n")
    text = "".join(pieces)
    return text, estimate_text_tokens(text, chars_per_token) + CHAT_TOKENS_PER_MESSAGE * len(pieces)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def prefill_body(request: ClientRequest) -> bytes:
    """The first leg: compute the prompt's KV, keep it for a decode worker, answer in one piece.
    `decode_max_tokens`/`decode_min_tokens` (our extension) let the prefill worker refuse a
    request whose decode leg would not fit the context before computing anything."""
    leg = {key: value for key, value in request.body.items() if key not in _DROPPED_ON_PREFILL}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    params = dict(REMOTE_DECODE_PARAMS)
    if request.max_tokens is not None:
        params["decode_max_tokens"] = request.max_tokens
    if request.min_tokens:
        params["decode_min_tokens"] = request.min_tokens
    if request.want_first_events:
        params["want_first_events"] = True
    leg["kv_transfer_params"] = params
    return json.dumps(leg).encode()


def decode_body(body: dict[str, Any], kv_transfer_params: Optional[dict[str, Any]]) -> bytes:
    """The second leg: the client's request, plus where its KV is (None: decode prefills itself)."""
    if kv_transfer_params is None:
        return json.dumps(body).encode()
    return json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()
