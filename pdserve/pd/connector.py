"""The contract between the scheduler and the P/D side: questions one way, events the other.

Invariant (one direction): the scheduler owns every request-state change and
every block allocation or free. The connector never touches the scheduler's
queues or the KV manager: it answers the scheduler's questions
(`plan_admission`, `start_pull`, `request_finished`) and reports, from its own
`poll`, which loads landed or failed and which blocks it held may now be
freed. Everything here runs on the engine thread and never blocks. Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from pdserve.api.errors import PdserveError
from pdserve.api.kv_transfer import RemotePrefillParams

if TYPE_CHECKING:
    from pdserve.api.sampling import FinishReason
    from pdserve.request import Request


class AdmissionKind(enum.Enum):
    LOCAL = "local"  # compute the whole prompt here
    REMOTE = "remote"  # allocate for the whole prompt, then `start_pull`
    FAIL = "fail"  # end the request with `Admission.error`


@dataclass(frozen=True, slots=True)
class Admission:
    kind: AdmissionKind
    error: Optional[PdserveError] = None


ADMIT_LOCAL = Admission(AdmissionKind.LOCAL)
ADMIT_REMOTE = Admission(AdmissionKind.REMOTE)


@dataclass(frozen=True, slots=True)
class FinishAction:
    """The connector's answer when a request finishes."""

    free_blocks: bool = True  # False: the connector holds them until it reports them in `released`
    kv_transfer_params: Optional[RemotePrefillParams] = None  # P: what the decode worker needs
    error: Optional[PdserveError] = None  # the request ends with this error instead (e.g. no room to pin)


FREE_NOW = FinishAction()


@dataclass(frozen=True, slots=True)
class LoadFailure:
    request_id: str
    error: PdserveError
    recompute: bool  # True: prefill locally from scratch; False: end the request with `error`


@dataclass(slots=True)
class KVEvents:
    """What happened since the last poll. Each request id appears at most once per list."""

    landed: list[str] = field(default_factory=list)  # prompt KV (all but the last token) is in place
    failed: list[LoadFailure] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # blocks held past finish may be freed now
    # Of landed requests: per group, table entries [0, n) hold tokens the pull did not fill (a sliding
    # window that starts inside a larger decode block); they must never enter the prefix cache.
    uncached: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.landed or self.failed or self.released)


class KVConnector(Protocol):
    """The P or D side as the scheduler sees it (engine thread only, never blocking)."""

    def request_added(self, request: "Request") -> None:
        """A request entered the waiting queue (D renews leases of queued remote requests)."""
        ...

    def plan_admission(self, request: "Request") -> Admission:
        """Asked before admitting a waiting request: compute locally, load remotely, or fail."""
        ...

    def start_pull(self, request: "Request", block_tables: Sequence[Sequence[int]], num_cached_tokens: int) -> bool:
        """Blocks for the whole prompt are allocated: start pulling what is missing.
        False: nothing to pull (D's prefix cache holds it all), the request may run now.
        A load that cannot start is reported as failed by the next `poll`."""
        ...

    def request_finished(self, request: "Request", reason: "FinishReason",
                         block_tables: Sequence[Sequence[int]]) -> FinishAction:
        """A request ends (any reason, any state): free its blocks now, or hold them."""
        ...

    def poll(self) -> KVEvents:
        """Advance transfers, messages and leases; report what changed."""
        ...

    def has_pending(self) -> bool:
        """True while something needs polling even with no step to run."""
        ...

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held for remote readers (P), 0 elsewhere."""
        ...


class NoConnector:
    """A colocated worker: every request is computed here, blocks are freed at finish."""

    num_pinned_blocks = 0

    def request_added(self, request: "Request") -> None:
        pass

    def plan_admission(self, request: "Request") -> Admission:
        return ADMIT_LOCAL

    def start_pull(self, request: "Request", block_tables: Sequence[Sequence[int]], num_cached_tokens: int) -> bool:
        return False

    def request_finished(self, request: "Request", reason: "FinishReason",
                         block_tables: Sequence[Sequence[int]]) -> FinishAction:
        return FREE_NOW

    def poll(self) -> KVEvents:
        return KVEvents()

    def has_pending(self) -> bool:
        return False
