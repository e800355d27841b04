"""A decode worker's P/D request whose prefix is in its own offload tier: the tier's pages load
while the rest of the prompt is pulled from the prefill worker, and the request runs only when
both landed. Each order of events is forced by the test (the pull's end is reported by hand)."""

from __future__ import annotations

import types

from pdserve.api.errors import RequestFailed
from pdserve.api.sampling import FinishReason
from pdserve.pd.connector import ADMIT_REMOTE, KVEvents, LoadFailure, NoConnector
from pdserve.request import RequestStatus
from tests.engine.test_scheduler import make_request, run_step
from tests.engine.test_scheduler_offload import finish_alone, make_offload_scheduler


class PullingConnector(NoConnector):
    """Decode's side as the scheduler sees it: every remote request pulls; the test ends each pull."""

    def __init__(self) -> None:
        self.pulls: dict[str, int] = {}  # request id -> prompt tokens it had locally when the pull started
        self.pending = KVEvents()

    def plan_admission(self, request):  # noqa: ANN001
        return ADMIT_REMOTE

    def start_pull(self, request, block_tables, num_cached_tokens):  # noqa: ANN001
        self.pulls[request.request_id] = num_cached_tokens
        return True

    def poll(self) -> KVEvents:
        events, self.pending = self.pending, KVEvents()
        return events


def decode_worker_with_a_tiered_prefix(fail_reads: bool = False):
    """The first 16 tokens of a 25-token prompt are in the tier only, not in the pool; the request
    was admitted (the tier copies its pages at once and reports them from the next poll)."""
    scheduler, kv, pages = make_offload_scheduler()
    connector = scheduler.connector = PullingConnector()
    finish_alone(scheduler, kv, make_request("a", 17, max_tokens=1))
    finish_alone(scheduler, kv, make_request("b", 32, max_tokens=1, first_token=500))  # evicts a's pages
    request = make_request("pd", 25, max_tokens=2)
    # The scheduler only asks whether a source is there and whether it is a peer pull (a prefix only).
    request.remote = types.SimpleNamespace(num_pull_tokens=None)
    scheduler.add_request(request)
    pages.fail_reads = fail_reads
    step, _ = run_step(scheduler, kv)
    assert step.chunks == [] and scheduler.num_waiting_for_kv == 1
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.pulls == {"pd": 16}  # the pull starts after the tier's prefix
    assert kv.prefix_stats.num_offload_hit_tokens == 16
    return scheduler, kv, pages, connector, request


def report(scheduler, connector, *, landed=(), failed=()) -> None:
    """The pull's end, as D's connector would report it from its next poll."""
    connector.pending.landed.extend(landed)
    connector.pending.failed.extend(failed)
    scheduler.apply_kv_events(connector.poll())


def computed(steps) -> list[tuple[int, int]]:
    return [(chunk.start_position, chunk.num_tokens) for step in steps for chunk in step.chunks]


def finish(scheduler, kv) -> list:
    steps = []
    while scheduler.has_work():
        steps.append(run_step(scheduler, kv)[0])
    return steps


def test_the_tier_landing_first_waits_for_the_pull_then_only_the_last_token_is_computed():
    scheduler, kv, pages, connector, request = decode_worker_with_a_tiered_prefix()
    step, _ = run_step(scheduler, kv)  # the tier's pages are reported here
    assert step.chunks == [] and pages.num_reads == 4
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV  # the pull still writes its blocks
    report(scheduler, connector, landed=["pd"])
    assert computed(finish(scheduler, kv)) == [(24, 1), (25, 1)]
    assert request.finish_reason is FinishReason.LENGTH and kv.pool.num_in_use == 0


def test_the_pull_landing_first_waits_for_the_tier():
    scheduler, kv, pages, connector, request = decode_worker_with_a_tiered_prefix()
    report(scheduler, connector, landed=["pd"])
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV  # the tier's report comes from the next step
    assert computed(finish(scheduler, kv)) == [(24, 1), (25, 1)]


def test_a_failed_tier_load_waits_for_the_pull_to_stop_writing_then_recomputes_everything():
    scheduler, kv, _, connector, request = decode_worker_with_a_tiered_prefix(fail_reads=True)
    step, _ = run_step(scheduler, kv)
    assert step.chunks == [] and kv.offload.stats.num_failed_loads == 1
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and kv.has_request("pd")  # blocks still held
    report(scheduler, connector, landed=["pd"])
    assert request.status is RequestStatus.WAITING
    assert computed(finish(scheduler, kv)) == [(0, 25), (25, 1)]
    assert request.finish_reason is FinishReason.LENGTH and kv.pool.num_in_use == 0


def test_a_failed_pull_waits_for_the_tier_then_recomputes_after_the_loaded_prefix():
    scheduler, kv, _, connector, request = decode_worker_with_a_tiered_prefix()
    report(scheduler, connector, failed=[LoadFailure("pd", RequestFailed("peer gone"), recompute=True)])
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV  # the tier still writes its blocks
    # The tier's pages landed into the prefix cache, so the local recompute starts after them.
    assert computed(finish(scheduler, kv)) == [(16, 9), (25, 1)]
    assert request.finish_reason is FinishReason.LENGTH and kv.pool.num_in_use == 0


def test_a_pull_that_fails_the_request_ends_it_once_the_tier_stopped_writing():
    scheduler, kv, _, connector, request = decode_worker_with_a_tiered_prefix()
    report(scheduler, connector, failed=[LoadFailure("pd", RequestFailed("forged parameters"), recompute=False)])
    assert scheduler.take_ended() == [] and kv.has_request("pd")
    run_step(scheduler, kv)
    assert scheduler.take_ended() == [request]
    assert request.finish_reason is FinishReason.ERROR and str(request.error) == "forged parameters"
    assert not scheduler.has_work() and kv.pool.num_in_use == 0


def test_an_abort_while_both_load_frees_everything_once_the_tier_read_ended():
    scheduler, kv, _, connector, request = decode_worker_with_a_tiered_prefix()
    scheduler.finish("pd", FinishReason.ABORT)
    report(scheduler, connector, landed=["pd"])  # a late report of the pull is ignored
    run_step(scheduler, kv)
    assert not scheduler.has_work() and scheduler.num_waiting_for_kv == 0 and kv.pool.num_in_use == 0
