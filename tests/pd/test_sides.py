"""The prefill and decode connectors driven by real schedulers and KV managers over the fake
transport: block lifetime on both sides, failure policies, leases, the running cap."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.kv_transfer import KVPullFailed
from pdserve.api.sampling import FinishReason, SamplingParams
from pdserve.engine.schedule_types import SampledToken
from pdserve.kv.specs import SlidingWindowSpec
from pdserve.pd.geometry import handoff_ranges, handoff_slices
from pdserve.pd.messages import KVMessage, MessageKind
from pdserve.request import Request, RequestStatus
from pdserve.transfer.fake_transport import FakeTransport
from pdserve.transfer.transport import PeerInfo
from tests.pd.pd_pair import BLOCK, PAGE_BYTES, PLAN, DecodeSide, FakeClock, PrefillSide, make_request, source_for


def admit(d: DecodeSide, p: PrefillSide, clock: FakeClock, request_id: str, num_prompt: int, params):
    request = d.submit(request_id, num_prompt, source_for(p, params, clock()))
    d.scheduler.schedule()
    return request


def test_prefill_pins_blocks_until_the_readers_notification(p, d, clock):
    params = p.prefill("r1", 30)
    assert p.connector.num_pinned_blocks == sum(len(ids) for ids in params.remote_block_ids) > 0
    assert p.kv.has_request("r1")
    request = admit(d, p, clock, "r1-d", 30, params)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    d.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 29
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")
    assert p.scheduler.take_released_ids() == ["r1"]
    p.kv.check_invariants()
    d.kv.check_invariants()


def test_decode_receives_exactly_the_remote_pages_and_sliding_groups_only_their_window(p, d, clock):
    params = p.prefill("r1", 30)
    full_ids, sliding_ids = params.remote_block_ids[0], params.remote_block_ids[1]
    assert len(full_ids) == 8 and len(sliding_ids) <= 8 // BLOCK + 1
    request = admit(d, p, clock, "r1-d", 30, params)
    d.tick()
    local = handoff_slices(d.kv.block_ids(request.request_id), handoff_ranges(PLAN, 30, BLOCK))
    for local_ids, remote_ids in zip(local, params.remote_block_ids):
        assert len(local_ids) == len(remote_ids)
        for local_id, remote_id in zip(local_ids, remote_ids):
            assert int(d.pool[local_id][0]) == remote_id


def test_decode_never_frees_blocks_under_an_inflight_read_even_when_aborted(p, d, clock):
    params = p.prefill("r1", 30)
    d.transport.hold_reads = True
    request = admit(d, p, clock, "r1-d", 30, params)
    d.scheduler.finish(request.request_id, FinishReason.ABORT)
    assert d.kv.has_request("r1-d"), "blocks were freed under an in-flight READ"
    d.tick()
    assert d.kv.has_request("r1-d")
    d.transport.hold_reads = False
    d.tick()
    assert not d.kv.has_request("r1-d")
    assert "r1-d" in d.scheduler.take_released_ids()
    d.kv.check_invariants()


def test_uncancellable_timed_out_read_keeps_its_pages(fabric, clock, p):
    d = DecodeSide(fabric, clock, pull_timeout_s=1.0)
    d.connect(p)
    params = p.prefill("r1", 30)
    d.transport.hold_reads = True
    d.transport.cancellable = False
    request = admit(d, p, clock, "r1-d", 30, params)
    clock.advance(2.0)
    d.tick()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.kv.has_request("r1-d")


def test_failed_pull_under_recompute_policy_prefills_locally(p, d, clock):
    params = p.prefill("r1", 30)
    d.transport.fail_reads = True
    request = admit(d, p, clock, "r1-d", 30, params)
    d.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    assert request in d.scheduler.waiting
    step = d.scheduler.schedule()  # admitted again as an ordinary local request
    assert step.chunks[0].start_position == 0 and step.chunks[0].num_tokens == 30
    assert recomputed_tokens(d, "pull_failed") == 30  # the silent-recompute alarm's count
    d.kv.check_invariants()


def test_failed_pull_under_fail_policy_ends_the_request_with_a_typed_error(fabric, clock, p):
    d = DecodeSide(fabric, clock, policy="fail")
    d.connect(p)
    params = p.prefill("r1", 30)
    d.transport.fail_reads = True
    admit(d, p, clock, "r1-d", 30, params)
    d.tick()
    [ended] = d.scheduler.take_ended()
    assert ended.request_id == "r1-d" and ended.finish_reason is FinishReason.ERROR
    assert isinstance(ended.error, KVPullFailed)
    assert d.metrics.transfer.failures.labels(policy="fail")._value.get() == 1
    assert not d.kv.has_request("r1-d")


def test_dead_prefill_peer_is_handled_per_policy(p, d, clock, fabric):
    params = p.prefill("r1", 30)
    fabric.kill("P")
    request = admit(d, p, clock, "r1-d", 30, params)
    d.tick()
    assert request.status in (RequestStatus.WAITING, RequestStatus.RUNNING)  # recomputed locally
    d.kv.check_invariants()


def test_request_ended_before_its_pull_tells_prefill_to_free_at_once(p, d, clock):
    params = p.prefill("r1", 30)
    request = d.submit("r1-d", 30, source_for(p, params, clock()))
    d.scheduler.finish(request.request_id, FinishReason.ABORT)  # still queued: nothing was read
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")


def test_partial_prefix_hit_on_decode_pulls_only_the_missing_blocks(p, d, clock):
    # D already computed the same 30-token prompt once (blocks committed to its cache).
    d.scheduler.add_request(make_request("warm", 30))
    step = d.scheduler.schedule()
    d.scheduler.update(step, [SampledToken("warm", 5, 0.0)])
    d.scheduler.finish("warm", FinishReason.LENGTH)
    params = p.prefill("r1", 30)
    request = admit(d, p, clock, "r1-d", 30, params)
    assert request.num_cached_tokens == 28  # 7 full blocks of 4
    d.tick()
    # The full groups lack only block 7; the sliding groups have their window cached too.
    assert d.metrics.transfer.descriptors._value.get() == 2
    p.tick()
    assert p.connector.num_pinned_blocks == 0


def test_heartbeat_renews_leases_of_queued_remote_requests(fabric, clock, p):
    d = DecodeSide(fabric, clock, max_running=1, heartbeat_s=5.0)
    d.connect(p)
    params = p.prefill("r1", 30)
    d.scheduler.add_request(make_request("blocker", 5))
    d.scheduler.schedule()  # the running cap keeps the remote request queued
    d.submit("r1-d", 30, source_for(p, params, clock()))
    d.scheduler.schedule()
    for _ in range(8):  # 40 s, past P's 30 s lease, with a renewal every 5 s
        clock.advance(5.0)
        d.tick()
        p.tick()
    assert p.connector.num_pinned_blocks > 0, "the queued request's lease ran out despite renewals"


def test_prefill_cannot_free_pages_while_a_decode_read_of_them_is_in_flight(p, d, clock):
    params = p.prefill("r1", 30)
    d.transport.hold_reads = True
    d.connector.pull_timeout_s = 1e9
    request = admit(d, p, clock, "r1-d", 30, params)
    pinned = handoff_slices(p.kv.block_ids("r1"), handoff_ranges(PLAN, 30, BLOCK))
    for _ in range(12):  # 60 s with the READ in flight: D renews, P keeps the pages
        clock.advance(5.0)
        d.tick()
        p.tick()
        assert p.kv.block_ids("r1") and handoff_slices(p.kv.block_ids("r1"), handoff_ranges(PLAN, 30, BLOCK)) == pinned
        assert p.connector.num_pinned_blocks > 0
    # A new request on P (another prompt: no prefix to share) cannot be handed those pages either.
    p.scheduler.add_request(Request("other", list(range(500, 540)), SamplingParams(max_tokens=1), (0,), 0.0))
    step = p.scheduler.schedule()
    taken = {block for table in step.chunks[0].block_ids for block in table if block}
    assert not taken & {block for ids in pinned for block in ids}
    d.transport.hold_reads = False
    d.tick()
    assert request.status is RequestStatus.RUNNING
    p.tick()
    assert not p.kv.has_request("r1")


def test_a_read_landing_after_half_the_lease_is_not_trusted(fabric, clock, p):
    d = DecodeSide(fabric, clock, heartbeat_s=1e9)  # no renewals reach P
    d.connect(p)
    params = p.prefill("r1", 30)
    d.transport.hold_reads = True
    request = admit(d, p, clock, "r1-d", 30, params)
    clock.advance(params.lease_s / 2 + 1)
    d.transport.hold_reads = False
    d.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0  # recompute policy


def test_remote_block_ids_are_clipped_to_the_window_for_sliding_groups(p):
    params = p.prefill("r1", 40)
    tables = p.kv.block_ids("r1")
    assert params.remote_block_ids[0] == tables[0][:10]
    assert 0 < len(params.remote_block_ids[1]) <= 8 // BLOCK + 1
    assert params.remote_block_ids == handoff_slices(tables, handoff_ranges(PLAN, 40, BLOCK))


def test_decode_does_not_read_blocks_whose_lease_may_have_expired(p, d, clock):
    params = p.prefill("r1", 30)
    request = d.submit("r1-d", 30, source_for(p, params, clock() - params.lease_s))  # queued far too long
    d.scheduler.schedule()
    assert d.metrics.transfer.descriptors._value.get() == 0
    assert d.transport.num_unreleased_handles == 0
    # Recompute policy: admitted as an ordinary local prefill of the whole prompt.
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 0
    assert recomputed_tokens(d, "stale_ticket") == 30
    p.tick()
    assert p.connector.num_pinned_blocks == 0, "P was not told to free blocks D will not read"


def test_running_cap_holds_when_many_remote_loads_land_at_once(fabric, clock, p):
    d = DecodeSide(fabric, clock, max_running=3)
    d.connect(p)
    d.transport.hold_reads = True
    requests = []
    for index in range(6):
        params = p.prefill(f"r{index}", 9)
        requests.append(d.submit(f"r{index}-d", 9, source_for(p, params, clock())))
    d.scheduler.schedule()
    assert d.scheduler.num_waiting_for_kv == 3 and d.scheduler.num_waiting == 3
    d.transport.hold_reads = False
    d.tick()  # all three land in one poll
    assert d.scheduler.num_running == 3 and d.scheduler.num_waiting_for_kv == 0
    for _ in range(40):
        step = d.scheduler.schedule()
        assert d.scheduler.num_running + d.scheduler.num_waiting_for_kv <= 3
        d.scheduler.update(step, [SampledToken(chunk.request_id, 1, 0.0) for chunk in step.chunks if chunk.sample])
        d.tick()
    assert all(request.finished for request in requests)
    d.kv.check_invariants()


def test_an_exception_in_the_finish_hook_fails_that_request_only(p):
    original = p.connector.request_finished

    def broken(request, reason, tables):
        if request.request_id == "bad":
            raise RuntimeError("injected")
        return original(request, reason, tables)

    p.connector.request_finished = broken
    one_token = SamplingParams(max_tokens=1, temperature=0)
    good = make_request("good", 9, one_token, remote_decode=True)
    bad = make_request("bad", 9, one_token, remote_decode=True)
    for request in (good, bad):
        p.scheduler.add_request(request)
    step = p.scheduler.schedule()
    p.scheduler.update(step, [SampledToken(chunk.request_id, 5, 0.0) for chunk in step.chunks])
    assert good.finish_reason is FinishReason.LENGTH and good.kv_transfer_params is not None
    assert bad.finish_reason is FinishReason.ERROR and bad.error is not None and bad.kv_transfer_params is None
    assert not p.kv.has_request("bad") and p.kv.has_request("good")
    p.kv.check_invariants()


def test_an_early_release_frees_a_pinned_prefill_at_the_next_poll(p, clock):
    params = p.prefill("r1", 30)
    assert p.connector.num_pinned_blocks > 0
    p.connector.release_early("unknown", params.remote_pin_nonce)  # nothing pinned under it: nothing happens
    p.connector.release_early(params.remote_request_id, params.remote_pin_nonce)
    assert p.connector.has_pending()
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")
    assert p.scheduler.take_released_ids() == ["r1"]
    p.connector.release_early("r1", params.remote_pin_nonce)  # twice: still once
    p.tick()
    assert p.scheduler.take_released_ids() == []
    p.kv.check_invariants()


def test_an_early_release_without_the_pins_nonce_frees_nothing(p, clock):
    params = p.prefill("r1", 30)
    p.connector.release_early("r1", "0" * 32)  # the id alone, with a made-up nonce
    p.tick()
    assert p.kv.has_request("r1") and p.connector.num_pinned_blocks > 0
    assert p.scheduler.take_released_ids() == [] and rejected_messages(p, "stale") == 1
    p.connector.release_early("r1", params.remote_pin_nonce)
    p.tick()
    assert p.scheduler.take_released_ids() == ["r1"]
    p.kv.check_invariants()


def test_pinned_blocks_never_pass_their_limit(fabric, clock):
    side = PrefillSide(fabric, clock)
    first = side.prefill("r1", 30)
    per_request = sum(len(ids) for ids in first.remote_block_ids)
    side.connector.max_pinned_blocks = per_request + 1  # room for one more block, not a second request
    assert not side.connector.has_room_to_pin(per_request)
    request = make_request("r2", 30, remote_decode=True, sampling=SamplingParams(max_tokens=1, temperature=0))
    side.scheduler.add_request(request)
    step = side.scheduler.schedule()
    side.scheduler.update(step, [SampledToken("r2", 5, 0.0)])
    assert request.finish_reason is FinishReason.ERROR and request.error.status_code == 503
    assert request.kv_transfer_params is None
    assert side.connector.num_pinned_blocks == per_request <= side.connector.max_pinned_blocks
    assert not side.kv.has_request("r2")  # its blocks were freed at once
    assert side.metrics.registry.get_sample_value("pdserve_transfer_pinned_refusals_total") == 1
    side.kv.check_invariants()


def test_a_prefill_larger_than_the_whole_limit_pins_alone(fabric, clock):
    side = PrefillSide(fabric, clock)
    side.connector.max_pinned_blocks = 2
    first = side.prefill("big", 30)  # more blocks than the limit, but nothing else is pinned
    assert first is not None and side.connector.num_pinned_blocks > 2
    assert not side.connector.has_room_to_pin(1)


# ---- pins are capabilities -------------------------------------------------------------------------

def test_messages_without_the_pins_nonce_touch_nothing_and_are_counted(p, fabric, clock):
    p.prefill("r1", 30)
    pinned = p.connector.num_pinned_blocks
    stranger = FakeTransport(torch.zeros(4, PAGE_BYTES, dtype=torch.int8), "stranger", fabric)
    peer_key = stranger.connect(PeerInfo.from_dict(p.agent_info().transport))
    forged = "f" * 32
    for kind in (MessageKind.FREE, MessageKind.DONE, MessageKind.RENEW):
        stranger.send_message(peer_key, KVMessage(kind, "r1", forged).encode())
    stranger.send_message(peer_key, b"free:r1")  # version 1's form
    p.tick()
    assert p.connector.num_pinned_blocks == pinned and p.kv.has_request("r1")
    assert rejected_messages(p, "stale") == 3 and rejected_messages(p, "malformed") == 1
    clock.advance(p.connector.leases.lease_s + 1)  # the forged renew bought nothing: the lease runs out
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")


def test_the_nonce_from_the_params_frees_the_pin(p, fabric):
    params = p.prefill("r1", 30)
    stranger = FakeTransport(torch.zeros(4, PAGE_BYTES, dtype=torch.int8), "holder", fabric)
    peer_key = stranger.connect(PeerInfo.from_dict(p.agent_info().transport))
    stranger.send_message(peer_key, KVMessage(MessageKind.FREE, "r1", params.remote_pin_nonce).encode())
    p.tick()
    assert p.connector.num_pinned_blocks == 0 and not p.kv.has_request("r1")


def test_a_late_message_about_an_earlier_pin_cannot_free_a_newer_pin_of_the_same_id(p, fabric, clock):
    first = p.prefill("r1", 30)
    p.connector.release_early("r1", first.remote_pin_nonce)
    p.tick()
    second = p.prefill("r1", 30)  # the id comes back (a client's own X-Request-Id, say)
    assert second.remote_pin_nonce != first.remote_pin_nonce
    late = FakeTransport(torch.zeros(4, PAGE_BYTES, dtype=torch.int8), "late", fabric)
    peer_key = late.connect(PeerInfo.from_dict(p.agent_info().transport))
    late.send_message(peer_key, KVMessage(MessageKind.DONE, "r1", first.remote_pin_nonce).encode())
    p.tick()
    assert p.kv.has_request("r1") and p.connector.num_pinned_blocks > 0
    assert rejected_messages(p, "stale") == 1


def rejected_messages(side: PrefillSide, reason: str) -> float:
    return sum(sample.value for family in side.metrics.registry.collect() for sample in family.samples
               if sample.name == "pdserve_transfer_rejected_messages_total" and sample.labels.get("reason") == reason)


def test_decode_trusts_no_longer_lease_than_its_own_whatever_the_params_say(p, d, clock):
    params = p.prefill("r1", 30)
    forged = params.model_copy(update={"lease_s": 1e9})
    d.connector.lease_s = 30.0
    d.transport.hold_reads = True
    request = admit(d, p, clock, "r1-d", 30, forged)
    clock.advance(30.0 / 2 + 1)  # past half of D's own lease; far inside the claimed one
    d.transport.hold_reads = False
    d.tick()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0  # not trusted: recompute


def test_a_decode_worker_of_twice_the_block_size_pulls_units_and_keeps_a_half_filled_window_block_uncached(
        fabric, clock, p):
    """P pages in blocks of 4, D in blocks of 8. A 30-token prompt's last token reads keys 22..29 in
    the sliding groups: P hands them over from token 20 (its block 5), D needs them from token 16 (its
    block 2), so tokens 16..19 of D's block 2 receive nothing. The pull lands token for token; that
    block is withheld from D's prefix cache, the full groups' blocks are not."""
    d = DecodeSide(fabric, clock, block_size=2 * BLOCK)
    assert d.connect(p) is None
    params = p.prefill("r1", 30)
    request = admit(d, p, clock, "r1-d", 30, params)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    events = d.connector.poll()
    assert events.landed == ["r1-d"]
    sliding = [group.group_id for group in PLAN.groups if isinstance(group.spec, SlidingWindowSpec)]
    assert events.uncached == {"r1-d": tuple(3 if g in sliding else 0 for g in range(len(PLAN.groups)))}
    d.scheduler.apply_kv_events(events)
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 29
    # Every unit landed where its tokens live: P's page b holds the byte b everywhere (PrefillSide.prefill).
    tables = d.kv.block_ids("r1-d")
    for group_id, remote_ids in enumerate(params.remote_block_ids):
        first_p = handoff_ranges(PLAN, 30, BLOCK)[group_id].start
        for index, remote_id in enumerate(remote_ids):
            token = (first_p + index) * BLOCK
            unit_bytes = PAGE_BYTES // (2 * PLAN.group_size)  # one row of a P page: 2 per layer slot
            rows = d.pool[tables[group_id][token // (2 * BLOCK)]].view(-1, 2, unit_bytes)  # [row][slot][bytes]
            assert torch.all(rows[:, (token % (2 * BLOCK)) // BLOCK] == remote_id), (group_id, token)
    # D computes the last prompt token and a few more; then its prefix cache holds every full block of the
    # full groups but not the sliding groups' block 2 (tokens 16..23), whose first half is stale.
    step = d.scheduler.schedule()
    d.scheduler.update(step, [SampledToken("r1-d", 7, 0.0)])
    cached = {(block.group_id, block.block_hash) for block in d.kv.snapshot_cache().blocks}
    assert len(request.block_hashes) >= 3
    for group_id in range(len(PLAN.groups)):
        assert ((group_id, request.block_hashes[2]) in cached) is (group_id not in sliding), group_id
    d.kv.check_invariants()


def recomputed_tokens(side, reason: str) -> float:
    return side.metrics.transfer.recomputed_prompt_tokens.labels(reason=reason)._value.get()
