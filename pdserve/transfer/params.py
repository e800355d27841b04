"""`kv_transfer_params`: the dict that travels P -> proxy -> D, and its validation.

Field names follow vLLM's NIXL P/D proxy protocol so its proxy can drive us;
fields of our own are prefixed by nothing but documented in docs/protocol.md.
Invariant: D acts on params only after every field is checked here and
against the peer's handshake; anything else is a typed 4xx. Torch-free.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pdserve.errors import InvalidRequest, PdserveError

PROTOCOL_VERSION = 1
KV_PULL_FAILED_PREFIX = "kv_pull_failed:"  # how the engine marks RequestOutput.error for KVPullFailed


class KVParamsInvalid(InvalidRequest):
    """Malformed or forged kv_transfer_params (400)."""


class KVParamsStale(PdserveError):
    """Params name a prefill engine or epoch that is no longer there (409)."""

    status_code = 409
    error_type = "kv_params_stale"


class KVPullFailed(PdserveError):
    """The KV pull failed and the policy is `fail`; the proxy may retry the
    request on another prefill worker (503, distinct type)."""

    status_code = 503
    error_type = "kv_pull_failed"


class RemoteDecodeRequest(BaseModel):
    """What the proxy sends P: 'prefill this, keep the KV for a decode worker'."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    do_remote_decode: StrictBool
    do_remote_prefill: StrictBool = False


class RemotePrefillParams(BaseModel):
    """What P returns and D receives: where the prompt's KV blocks are."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    do_remote_prefill: StrictBool
    do_remote_decode: StrictBool = False
    remote_engine_id: StrictStr = Field(min_length=1, max_length=128)
    remote_request_id: StrictStr = Field(min_length=1, max_length=256)
    remote_block_ids: list[list[StrictInt]]
    remote_host: StrictStr = Field(min_length=1, max_length=255)
    remote_port: StrictInt = Field(ge=1, le=65535)
    tp_size: StrictInt = Field(1, ge=1)
    # Our own fields.
    remote_epoch: StrictStr = Field(min_length=1, max_length=64)
    num_prompt_tokens: StrictInt = Field(ge=1)
    lease_s: float = Field(gt=0)
    protocol_version: StrictInt = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump()


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "kv_transfer_params"
    return f"kv_transfer_params.{where}: {first['msg']}"


def parse_remote_decode(params: dict[str, Any]) -> Optional[RemoteDecodeRequest]:
    """P side: None when the request is an ordinary local one."""
    try:
        parsed = RemoteDecodeRequest.model_validate(params)
    except ValidationError as error:
        raise KVParamsInvalid(_describe(error), param="kv_transfer_params") from None
    return parsed if parsed.do_remote_decode else None


def parse_remote_prefill(params: dict[str, Any]) -> Optional[RemotePrefillParams]:
    """D side: None unless `do_remote_prefill` is true; malformed params are a 400."""
    if not isinstance(params, dict):
        raise KVParamsInvalid("kv_transfer_params must be an object", param="kv_transfer_params")
    if params.get("do_remote_prefill") is not True:
        return None
    try:
        parsed = RemotePrefillParams.model_validate(params)
    except ValidationError as error:
        raise KVParamsInvalid(_describe(error), param="kv_transfer_params") from None
    if parsed.protocol_version != PROTOCOL_VERSION:
        raise KVParamsInvalid(
            f"kv_transfer_params.protocol_version {parsed.protocol_version} is not supported (this worker speaks {PROTOCOL_VERSION})",
            param="kv_transfer_params",
        )
    if parsed.tp_size != 1:
        raise KVParamsInvalid("kv_transfer_params.tp_size: only tp_size=1 is supported", param="kv_transfer_params")
    return parsed
