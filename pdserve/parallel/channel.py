"""What rank 0 tells the other ranks, and how it hears back.

Rank 0 sends one `RankMessage` per engine step (the step's chunks) and
whenever its transport needs the other ranks (commands, a report); while idle
it sends an empty one every `heartbeat_s`, so a follower that hears nothing
for the group's timeout knows rank 0 is gone. Followers answer only messages
that ask for a report.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from pdserve.parallel.ranks import RankGroup


@dataclass(frozen=True, slots=True)
class RankMessage:
    step: Any = None  # the chunks to run (pdserve.runner.tensor_parallel), None: no step
    decode_step: bool = False  # which forward path rank 0 takes, so every rank takes it
    logit_rows: tuple[tuple[int, ...], ...] = ()  # eager path: the rows of each logits computation, in order
    commands: tuple[Any, ...] = ()  # offload tier and transport commands, applied before the step
    want_report: bool = False  # followers answer with a RankReport
    stop: bool = False  # the worker is shutting down: leave the loop and exit 0


@dataclass(frozen=True, slots=True)
class RankReport:
    """A follower's answer to a message that asked for one."""

    transport: Any = None  # its transport's report (pdserve.transfer.ranked_transport), None without one
    tier_reads: tuple[tuple[str, Optional[str]], ...] = ()  # file tier: (load id, error) of reads ended since


@dataclass(frozen=True, slots=True)
class RankSetup:
    """Sent once at start-up, after rank 0 sized the pool: every rank's slice has as many blocks."""

    num_blocks: int
    with_transport: bool  # P and D workers: each rank registers its slice with its own NIXL agent
    num_offload_slots: int = 0  # pages of each rank's offload tier (pdserve.runner.offload_ranks)
    offload_dir: Optional[str] = None  # a file tier: each rank r > 0 keeps its pages under <dir>/rank-<r>
    num_offload_staging_rows: int = 0  # a file tier's staging rows, as many on every rank


class LeaderChannel:
    """Rank 0's side: queues commands and sends them with the next message; the file tier's read
    outcomes in the followers' answers collect in `tier_reads`, whoever asked for the answers."""

    def __init__(self, group: RankGroup, clock: Callable[[], float] = time.monotonic):
        self.group = group
        self.heartbeat_s = group.timeout_s / 4
        self._clock = clock
        self._commands: list[Any] = []
        self._last_sent_s = clock()
        self.tier_reads: deque[tuple[str, Optional[str]]] = deque()

    def queue(self, command: Any) -> None:
        self._commands.append(command)

    @property
    def has_queued(self) -> bool:
        return bool(self._commands)

    def send(self, step: Any = None, decode_step: bool = False, logit_rows: tuple[tuple[int, ...], ...] = (),
             want_report: bool = False) -> list[Any]:
        """Send a message (with every queued command); the followers' transport reports in rank order
        when asked."""
        message = RankMessage(step, decode_step, logit_rows, tuple(self._commands), want_report)
        self._commands.clear()
        self.group.broadcast(message)
        self._last_sent_s = self._clock()
        if not want_report:
            return []
        reports: list[Optional[RankReport]] = (self.group.gather(None) or [None])[1:]
        for report in reports:
            if report is not None:
                self.tier_reads.extend(report.tier_reads)
        return [report.transport if report is not None else None for report in reports]

    def keep_alive(self) -> None:
        """While idle: flush queued commands, and tell the followers rank 0 lives at least every heartbeat."""
        if self._commands or self._clock() - self._last_sent_s >= self.heartbeat_s:
            self.send()

    def stop(self) -> None:
        """Tell the followers to exit (best effort: they exit on their own when rank 0 is gone)."""
        try:
            self.group.broadcast(RankMessage(stop=True))
        except Exception:  # noqa: BLE001 - a lost rank is exactly when this may fail
            pass

