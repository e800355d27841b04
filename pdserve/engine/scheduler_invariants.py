"""The scheduler's stated invariants, checked: `Scheduler.check_invariants()` runs this after every
step in the scheduler tests, and the engine loop after every step when PDSERVE_CHECK_INVARIANTS=1.

Each rule names what it protects; a violation raises `SchedulerInvariantError` listing every rule
broken, with the request ids involved. Read-only: checking never changes the scheduler.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Optional, Protocol

from pdserve.api.config import SchedulerConfig
from pdserve.engine.pending_load import PendingLoad
from pdserve.engine.schedule_types import SchedulerOutput
from pdserve.kv.manager import KVCacheManager
from pdserve.request import Request, RequestStatus


class SchedulerState(Protocol):
    """What the checks read of a `Scheduler` (it imports this module, so not the class itself)."""

    config: SchedulerConfig
    kv: KVCacheManager
    requests: Mapping[str, Request]
    waiting: Iterable[Request]
    running: list[Request]
    loading: Mapping[str, PendingLoad]
    last_step: Optional[tuple[SchedulerOutput, int]]


class SchedulerInvariantError(RuntimeError):
    """The scheduler's state broke one of its invariants: a bug, never a request's fault."""


def _queues(scheduler: SchedulerState) -> list[str]:
    """Every request is in exactly one queue, with the status of that queue."""
    problems = []
    queued = ([r.request_id for r in scheduler.waiting] + [r.request_id for r in scheduler.running]
              + list(scheduler.loading))
    twice = sorted(request_id for request_id, n in Counter(queued).items() if n > 1)
    if twice:
        problems.append(f"requests in more than one queue (or twice in one): {twice}")
    if set(queued) != set(scheduler.requests):
        problems.append(f"queued {sorted(set(queued) - set(scheduler.requests))} unknown, "
                        f"known {sorted(set(scheduler.requests) - set(queued))} in no queue")
    for queue, status in ((scheduler.waiting, RequestStatus.WAITING), (scheduler.running, RequestStatus.RUNNING),
                          ([load.request for load in scheduler.loading.values()], RequestStatus.WAITING_FOR_REMOTE_KV)):
        wrong = sorted(r.request_id for r in queue if r.status is not status)
        if wrong:
            problems.append(f"requests queued as {status.value} with another status: {wrong}")
    return problems


def _loads(scheduler: SchedulerState) -> list[str]:
    """A loading request waits for at least one part (a pull, a tier read, its ticket) until it moves on."""
    problems = []
    stale = sorted(request_id for request_id, load in scheduler.loading.items() if not load.in_flight)
    if stale:
        problems.append(f"loading requests with nothing in flight: {stale}")
    misfiled = sorted(request_id for request_id, load in scheduler.loading.items()
                      if load.request.request_id != request_id)
    if misfiled:
        problems.append(f"loads filed under another request's id: {misfiled}")
    return problems


def _capacity(scheduler: SchedulerState) -> list[str]:
    """Running plus loading requests never exceed the running cap."""
    num_busy = len(scheduler.running) + len(scheduler.loading)
    cap = scheduler.config.max_num_running
    return [f"{num_busy} requests running or loading, over the cap of {cap}"] if num_busy > cap else []


def _blocks(scheduler: SchedulerState) -> list[str]:
    """Running and loading requests hold blocks; waiting ones hold none (never admitted, preempted or
    sent back to recompute: their blocks were freed); computed tokens never pass a request's length."""
    problems = []
    busy = [r for r in scheduler.running] + [load.request for load in scheduler.loading.values()]
    without = sorted(r.request_id for r in busy if not scheduler.kv.has_request(r.request_id))
    if without:
        problems.append(f"running or loading requests without blocks: {without}")
    holding = sorted(r.request_id for r in scheduler.waiting if scheduler.kv.has_request(r.request_id))
    if holding:
        problems.append(f"waiting requests that hold blocks: {holding}")
    beyond = sorted(r.request_id for r in scheduler.running if not 0 <= r.num_computed_tokens <= r.num_tokens)
    if beyond:
        problems.append(f"running requests with computed tokens outside [0, their length]: {beyond}")
    return problems


def _last_step(scheduler: SchedulerState) -> list[str]:
    """A step never exceeds its token budget, and names each request at most once."""
    if scheduler.last_step is None:
        return []
    output, budget = scheduler.last_step
    problems = []
    num_tokens = sum(chunk.num_tokens for chunk in output.chunks)
    if num_tokens > budget:
        problems.append(f"the last step scheduled {num_tokens} tokens, over its budget of {budget}")
    ids = [chunk.request_id for chunk in output.chunks]
    if len(ids) != len(set(ids)):
        problems.append(f"the last step scheduled a request twice: {sorted(i for i, n in Counter(ids).items() if n > 1)}")
    return problems


def check_scheduler(scheduler: SchedulerState) -> None:
    problems = [*_queues(scheduler), *_loads(scheduler), *_capacity(scheduler), *_blocks(scheduler),
                *_last_step(scheduler)]
    if problems:
        raise SchedulerInvariantError("scheduler invariants broken: " + "; ".join(problems))
