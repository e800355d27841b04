"""Per-request records shared by the server, the scheduler, the P/D side and the engine loop.

Torch-free. A `Request` is owned by the engine thread only; the server sees
`GenerationRequest` going in and `RequestOutput` coming out. This module sits
below both `pd/` and `engine/` and imports only the contract (`pdserve.api`),
so the connectors can take a `Request` without `pd/` importing `engine/`. What
a request asks for (`SamplingParams`) and how it ended (`FinishReason`), and the
kv_transfer records a request carries, are contract too: `pdserve.api.sampling`,
`pdserve.api.kv_transfer`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pdserve.api.kv_transfer import AgentInfo, FirstToken, RemotePrefillParams
from pdserve.api.sampling import FinishReason, SamplingParams, TopLogprobs

if TYPE_CHECKING:
    from pdserve.api.errors import PdserveError
    from pdserve.api.kv_transfer import KVTransferRequest
    from pdserve.api.peer_pull import PeerHint


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no blocks yet (or preempted and reset)
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, a KV pull (or P's ticket) on its way
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Verified on the async side: where a decode request's prompt KV lives.

    `params` passed every check against the peer's handshake `agent`; the
    transport connection to that peer was ready when the request was admitted.
    `received_s` (monotonic) is when P's lease was last known to be fresh."""

    params: RemotePrefillParams
    agent: AgentInfo
    received_s: float = field(default_factory=time.monotonic)
    # A peer pull (pd/peer_pull.py): the pull brings only the prompt's first `num_pull_tokens` tokens (whole
    # blocks a peer held) and the rest is computed here; None: a P/D handoff, the whole prompt.
    num_pull_tokens: Optional[int] = None

    @property
    def peer_identity(self) -> tuple[str, str]:
        return self.agent.engine_id, self.agent.epoch


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the server hands the engine."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # kv_transfer_params as parsed at the HTTP edge; the worker's P/D admission
    # turns them into `remote_decode` (P) or `remote` (D) before the engine sees them.
    kv_params: Optional["KVTransferRequest"] = None
    remote_decode: bool = False  # P: keep the prompt's KV for a decode worker
    remote: Optional["RemoteSource"] = None  # D: verified source of the prompt's KV
    pd_recomputed: bool = False  # D: came as P/D, but the admission chose to compute the prompt here
    first_token: Optional[FirstToken] = None  # D: the token P sampled, from P's ticket (pd/first_token.py)
    # Internal: a peer the proxy says holds a prefix of this prompt (pd/peer_admission.py may pull it).
    peer_hint: Optional["PeerHint"] = None
    # D, a decode leg sent beside its prefill leg: the engine reserves its blocks now and waits for P's
    # ticket, delivered under this key once admission has it (engine/async_engine.py); None: not awaited.
    awaited_ticket: Optional[str] = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One increment of a request's answer, produced once per engine step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[float, ...] = ()
    new_top_logprobs: tuple["TopLogprobs", ...] = ()  # per new token, when asked
    prompt_logprobs: Optional[tuple[Optional["TopLogprobs"], ...]] = None  # first output only; None for token 0
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Optional["PdserveError"] = None  # set with FinishReason.ERROR
    kv_transfer_params: Optional["RemotePrefillParams"] = None  # P's answer for the decode worker
    pd_recomputed: bool = False  # D: the request came as P/D and its prompt was computed here


@dataclass(slots=True)
class Request:
    """Engine-side state of one request. Only the engine thread touches it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time_s: float
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prefix-cache hit at (last) admission
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of all_token_ids
    num_preemptions: int = 0
    first_scheduled_time_s: Optional[float] = None
    first_token_time_s: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    remote_decode: bool = False  # P: keep the prompt's KV for a decode worker (input)
    remote: Optional["RemoteSource"] = None  # D: where to pull the prompt's KV; None once consumed
    kv_transfer_params: Optional["RemotePrefillParams"] = None  # P: the finish hook's answer (output)
    pd_recomputed: bool = False  # D: came as P/D, but its prompt is computed here (admission or failed pull)
    error: Optional["PdserveError"] = None  # why it ended with FinishReason.ERROR
    # P: the first token it sampled, for the pin's ticket; D: P's first token, from the ticket, until it
    # becomes output token 1 when the pull lands (None again if D computes it after all).
    first_token: Optional[FirstToken] = None
    # D: when P's token went out as output token 1 (engine clock), until D's first step adds token 2.
    first_token_from_prefill_s: Optional[float] = None
    # Logprobs of prompt tokens 1.. (when asked), filled as prefill chunks run; sent with the first output.
    prompt_logprobs: list["TopLogprobs"] = field(default_factory=list)
    # D: the key its P ticket comes under while it waits for one (reserved, never computed); None once delivered.
    awaited_ticket: Optional[str] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's load as routing proxies see it (GET /load)."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    kv_usage: float = 0.0  # fraction of the pool's usable blocks in use (all groups)
    num_pinned_blocks: int = 0  # prefill workers: blocks held for decode workers
