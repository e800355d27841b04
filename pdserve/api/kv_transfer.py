"""`kv_transfer_params`: the dict that travels P -> proxy -> D, parsed once at the edge into typed records.

Field names follow vLLM's NIXL P/D proxy protocol so its proxy can drive us;
fields of our own are documented in docs/protocol.md. Invariant: past the
HTTP layer nothing handles the raw dict: a request carries a
`RemoteDecodeRequest` (P: keep the KV for a decode worker) or a
`RemotePrefillParams` (D: pull the KV from there), and every failure is a
typed error with its HTTP status. Also here: the handshake's answer
(`AgentInfo`, what P tells D about itself; the client is pdserve/pd/handshake.py)
and `bare_host`, the one rule for how a peer's host is written. Torch-free.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import sys
from array import array
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from pdserve.api.errors import InvalidRequest, PdserveError
from pdserve.api.handoff import parse_prefill_parts

# 2: pins carry a nonce (remote_pin_nonce) that D's done/free/renew must echo; 3: pages hold heads outermost
# (pdserve/kv/layout.py), so a version-2 peer's pages would be read wrongly; 4: the block size is
# negotiated, not hashed (P and D may page in different block sizes, one dividing the other); 5: params are
# tickets: D claims the pin's record from P (POST /internal/kv/pin) and reads only the block ids P names there,
# after checking its prompt against P's digest; remote_block_ids on the wire is accepted and ignored; 6: models
# with recurrent state: the handshake's groups describe state groups, and a state group's block list is one
# page, P's handoff page (the state after all but the last prompt token), which D pulls into its live page;
# 7: the first token comes from P: the ticket carries the token P sampled (`first_token`), D pulls the KV of
# every prompt token and starts decoding from that token, computing no prompt token (pd/first_token.py).
PROTOCOL_VERSION = 7
# D's answer to a P/D leg whose prompt it computed itself (pull failed, stale ticket, prompt mismatch): the
# proxy counts such legs (pdserve_proxy_pd_legs_recomputed_total). Absent when D pulled the KV.
KV_RECOMPUTED_HEADER = "X-Pdserve-KV-Recomputed"
# Concurrent legs (docs/protocol.md): the decode leg names, instead of a pin, the key under which the proxy
# will deliver P's kv_transfer_params to D's `POST /internal/kv/ticket` once P answers.
AWAITED_TICKET_FIELD = "awaited_ticket"
AWAITED_TICKET_PATTERN = r"[0-9a-f]{32,64}"
PIN_NONCE_PATTERN = r"[0-9a-f]{16,64}"  # a pin's nonce as params and messages carry it (P makes 32 hex digits)
_PARAM = "kv_transfer_params"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def bare_host(host: str) -> str:
    """The host itself when it is an IP literal (IPv6 with or without brackets) or a DNS name;
    ValueError otherwise. IPv6 comes back without brackets."""
    unbracketed = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(unbracketed))
    except ValueError:
        pass
    if len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ValueError("must be a bare host name or IP address (no port, path, query or user)")
    return host


def url_host(host: str) -> str:
    """How `host` is written in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


class KVParamsInvalid(InvalidRequest):
    """Malformed or forged kv_transfer_params (400)."""


class KVParamsStale(PdserveError):
    """Params name a prefill engine or epoch that is no longer there (409)."""

    status_code = 409
    error_type = "kv_params_stale"


class KVPullFailed(PdserveError):
    """The prompt's KV could not be pulled and the policy is `fail`; the proxy may
    retry the request on another prefill worker (503, distinct type)."""

    status_code = 503
    error_type = "kv_pull_failed"


class KVPinnedFull(PdserveError):
    """P holds as many blocks for decode workers as it may: another prefill worker (or later) (503)."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1


class KVTicketUnusable(PdserveError):
    """The prefill worker holds no claimable pin for these params (unknown id, wrong nonce, already read,
    released, expired), or the pin is of another prompt; under `--kv-failure-policy fail` (409)."""

    status_code = 409
    error_type = "kv_params_stale"


class TicketNotFound(PdserveError):
    """P: no live pin of that id carries that nonce (never pinned, released, expired, or a forged nonce)."""

    status_code = 404
    error_type = "not_found_error"


class TicketAlreadyClaimed(PdserveError):
    """P: the pin's ticket went to a reader already; a second one may not read the same blocks."""

    status_code = 409
    error_type = "kv_ticket_claimed"


class KVTicketNotDelivered(PdserveError):
    """D: a decode leg sent beside its prefill leg got no ticket in time, or the proxy called it off
    (P failed): nothing was reserved for it any more (503: the proxy may try elsewhere)."""

    status_code = 503
    error_type = "kv_ticket_not_delivered"


class PinReference(BaseModel):
    """Which pin, on which engine start: the body of `POST /internal/kv/release` (the proxy gives up on a
    prefill's KV) and of `POST /internal/kv/pin` (D claims its ticket). Without the pin's nonce a caller
    can neither free nor read a pin, whatever request id it names."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    remote_request_id: StrictStr = Field(min_length=1, max_length=256)
    remote_engine_id: StrictStr = Field(min_length=1, max_length=128)
    remote_epoch: StrictStr = Field(min_length=1, max_length=64)
    remote_pin_nonce: StrictStr = Field(pattern=f"^{PIN_NONCE_PATTERN}$")



class FirstToken(BaseModel):
    """The token P sampled after the prompt, as P's ticket carries it to D: its id and, when P's request
    asked for logprobs, its logprob and its `num_top_logprobs` alternatives ((token id, logprob) pairs)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    token_id: StrictInt = Field(ge=0)
    logprob: Optional[float] = None  # None: P's request did not ask (the sampler computed none)
    num_top_logprobs: StrictInt = Field(default=0, ge=0, le=1024)
    top_logprobs: list[tuple[StrictInt, float]] = Field(default_factory=list, max_length=1025)
    # sha256 of the sampling fields that shaped the token (pd/first_token.py `first_draw_key`): D continues
    # from it only when its own request's are the same.
    sampling_sha256: Optional[StrictStr] = Field(default=None, pattern="^[0-9a-f]{64}$")


class PinTicket(BaseModel):
    """P's own record of a pin, the only source of the block ids D reads (`POST /internal/kv/pin`).

    `prompt_sha256` is `prompt_digest` of the prompt tokens P computed the pinned KV from; D reads
    only when its own prompt has the same digest. `lease_left_s`: what remained of the lease when
    P answered (D trusts no longer)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    request_id: StrictStr = Field(min_length=1, max_length=256)
    block_ids: list[list[StrictInt]]
    num_prompt_tokens: StrictInt = Field(ge=1)
    prompt_sha256: StrictStr = Field(pattern="^[0-9a-f]{64}$")
    lease_left_s: float = Field(ge=0)
    # Since version 7: the token P sampled from the pinned KV (None: P had none to give; D then computes
    # the last prompt token itself). Only P writes it: D never takes a first token from the client.
    first_token: Optional[FirstToken] = None


def prompt_digest(token_ids: "list[int] | tuple[int, ...]") -> str:
    """The identity of a prompt on the wire: sha256 over its token ids as little-endian int64."""
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return hashlib.sha256(packed.tobytes()).hexdigest()


class RemoteDecodeRequest(BaseModel):
    """What the proxy sends P: 'prefill this, keep the KV for a decode worker'. Our proxy adds
    the decode leg's token budget, so P refuses what D would refuse before computing anything."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    do_remote_decode: StrictBool
    do_remote_prefill: StrictBool = False
    decode_max_tokens: Optional[StrictInt] = Field(None, ge=1)
    decode_min_tokens: Optional[StrictInt] = Field(None, ge=0)
    # Our proxy, for a streamed client request: answer also with the stream events of token 1
    # (pdserve/server/first_events.py), which it sends the client before D's stream starts.
    want_first_events: StrictBool = False


class RemotePrefillParams(BaseModel):
    """What P returns and D receives: which pin on which prefill worker holds the prompt's KV.

    D takes from it only who to ask (engine, epoch, host, port) and which pin (request id, nonce);
    `remote_block_ids`, `num_prompt_tokens` and `lease_s` are informative (vLLM's proxy copies them):
    D reads the block ids of P's own record (`PinTicket`), never these."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    do_remote_prefill: StrictBool
    do_remote_decode: StrictBool = False
    remote_engine_id: StrictStr = Field(min_length=1, max_length=128)
    remote_request_id: StrictStr = Field(min_length=1, max_length=256)
    remote_block_ids: list[list[StrictInt]]
    remote_host: StrictStr = Field(min_length=1, max_length=255)
    remote_port: StrictInt = Field(ge=1, le=65535)
    tp_size: StrictInt = Field(1, ge=1, le=64)  # P's tensor-parallel ranks (D's may differ)
    # Our own fields.
    remote_epoch: StrictStr = Field(min_length=1, max_length=64)
    num_prompt_tokens: StrictInt = Field(ge=1)
    lease_s: float = Field(gt=0)
    protocol_version: StrictInt = PROTOCOL_VERSION
    # The pin's capability: D's messages about the pin must carry it (required since version 2; optional in
    # the schema only so that an older peer's params get the version refusal, not a missing-field one).
    remote_pin_nonce: Optional[StrictStr] = Field(None, pattern=f"^{PIN_NONCE_PATTERN}$")
    # P's own handoff components, seconds on its clock (pdserve/api/handoff.py): informative, for the proxy's
    # log and metrics; D ignores them, and unknown names or non-durations are dropped, never refused.
    handoff_s: Optional[dict[str, float]] = None

    @field_validator("handoff_s", mode="before")
    @classmethod
    def _known_parts(cls, raw: Any) -> Optional[dict[str, float]]:
        return None if raw is None else parse_prefill_parts(raw)

    @field_validator("remote_host")
    @classmethod
    def _bare_host(cls, host: str) -> str:
        return bare_host(host)  # it becomes part of the handshake URL: nothing but a host may hide in it

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump()


class AwaitedPrefillParams(BaseModel):
    """A decode leg sent while its prefill leg still runs (concurrent legs): D parses and tokenizes it,
    then waits for P's kv_transfer_params, which the proxy delivers under `awaited_ticket` (a random key
    of the proxy's, `TicketDelivery`). A decode worker older than this field refuses such params (400:
    `remote_engine_id` is missing), never computes from them."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    do_remote_prefill: Literal[True]
    awaited_ticket: StrictStr = Field(pattern=f"^{AWAITED_TICKET_PATTERN}$")
    protocol_version: StrictInt = PROTOCOL_VERSION


class TicketDelivery(BaseModel):
    """The body of D's `POST /internal/kv/ticket`: P's answer for the decode leg waiting under `awaited_ticket`
    (`kv_transfer_params` as P sent them), or None: P failed, the leg is called off. The params are a
    ticket like any other: D still claims the blocks, digest and first token from P itself."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    awaited_ticket: StrictStr = Field(pattern=f"^{AWAITED_TICKET_PATTERN}$")
    kv_transfer_params: Optional[dict[str, Any]] = None


KVTransferRequest = Union[RemoteDecodeRequest, RemotePrefillParams, AwaitedPrefillParams]


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or _PARAM
    return f"{_PARAM}.{where}: {first['msg']}"


def _validate(schema: type[BaseModel], params: dict[str, Any]) -> Any:
    try:
        return schema.model_validate(params)
    except ValidationError as error:
        raise KVParamsInvalid(_describe(error), param=_PARAM) from None


def parse_kv_transfer_params(params: Any) -> Optional[KVTransferRequest]:
    """The one parser of the wire dict. None: an ordinary request (no field set,
    or both flags false). A malformed dict, or one asking for both directions, is a 400."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise KVParamsInvalid(f"{_PARAM} must be an object", param=_PARAM)
    if params.get("do_remote_prefill") is True and AWAITED_TICKET_FIELD in params:
        awaited = _validate(AwaitedPrefillParams, params)
        if awaited.protocol_version != PROTOCOL_VERSION:
            raise KVParamsInvalid(f"{_PARAM}.protocol_version {awaited.protocol_version} is not supported "
                                  f"(this worker speaks {PROTOCOL_VERSION})", param=_PARAM)
        return awaited
    if params.get("do_remote_prefill") is True:
        parsed = _validate(RemotePrefillParams, params)
        if parsed.do_remote_decode:
            raise KVParamsInvalid(f"{_PARAM}: do_remote_prefill and do_remote_decode cannot both be true", param=_PARAM)
        _check_version(parsed)
        return parsed
    if "do_remote_decode" not in params:
        return None
    decode = _validate(RemoteDecodeRequest, params)
    return decode if decode.do_remote_decode else None


def _check_version(parsed: RemotePrefillParams) -> None:
    if parsed.protocol_version != PROTOCOL_VERSION:
        raise KVParamsInvalid(
            f"{_PARAM}.protocol_version {parsed.protocol_version} is not supported "
            f"(this worker speaks {PROTOCOL_VERSION})", param=_PARAM,
        )
    if parsed.remote_pin_nonce is None:
        raise KVParamsInvalid(f"{_PARAM}.remote_pin_nonce is required", param=_PARAM)


# ---- the handshake's answer: GET /internal/kv/agent_info on P (pd/handshake.py) ----------------

class StateWire(BaseModel):
    """A state group's per-layer state (pdserve.kv.specs.RecurrentStateSpec) on the wire."""

    model_config = ConfigDict(frozen=True)
    mixer: str  # "gated_delta_net" or "mamba2"
    conv_channels: int
    conv_window: int
    recurrent_shape: list[int]
    dtype: str


class GroupWire(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: Literal["full", "sliding", "state"]
    window_tokens: Optional[int] = None
    state: Optional[StateWire] = None  # kind "state" only
    layer_ids: list[int]


class PoolGeometry(BaseModel):
    model_config = ConfigDict(frozen=True)
    num_blocks: int
    page_bytes: int
    block_size: int
    group_size: int
    groups: list[GroupWire]


class AgentInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    protocol_version: int
    compat_hash: str
    engine_id: str
    epoch: str
    geometry: PoolGeometry
    transport: dict[str, Any]  # the transport's own peer record (JSON-safe): every rank's agent
    tp_size: int = Field(1, ge=1, le=64)  # tensor-parallel ranks of the worker (pool geometry is one rank's)
    compatibility: dict[str, Any] = Field(default_factory=dict)  # what compat_hash hashes, so D can name a mismatch
