"""The P and D role hooks over the real KV manager and scheduler, with the fake
transport (in-process copies between two pools) standing in for NIXL."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import SchedulerConfig
from pdserve.engine.decode_role import DecodeRole, RemotePrefill
from pdserve.engine.prefill_role import PrefillIdentity, PrefillRole, remote_block_ids_for
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.metrics import Metrics
from pdserve.request import FinishReason, Request, RequestStatus, SamplingParams
from pdserve.transfer.fake_transport import FakeFabric, FakeTransport
from pdserve.transfer.handshake import AgentInfo, PoolGeometry, groups_to_wire
from pdserve.transfer.leases import LeaseTable
from pdserve.transfer.params import RemotePrefillParams

BLOCK = 4
NUM_BLOCKS = 64
PAGE_BYTES = 32
PLAN = plan_groups([FullAttentionSpec(), SlidingWindowSpec(8), FullAttentionSpec(), SlidingWindowSpec(8)])


class Side:
    """One worker's KV manager, scheduler, pool bytes and transport."""

    def __init__(self, name: str, fabric: FakeFabric, policy: str = "recompute"):
        self.kv = KVCacheManager(PLAN, NUM_BLOCKS, BLOCK)
        self.pool = torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.int8)
        self.transport = FakeTransport(self.pool, name, fabric)
        self.metrics = Metrics()
        if name == "P":
            self.role = PrefillRole(self.kv, self.transport, LeaseTable(30.0),
                                    PrefillIdentity("P", "epoch-1", "127.0.0.1", 1), self.metrics.transfer)
        else:
            self.role = DecodeRole(self.kv, self.transport, self.metrics.transfer, policy, pull_timeout_s=60)
        self.scheduler = Scheduler(SchedulerConfig(), self.kv, BLOCK, 10_000, role_hooks=self.role)
        if name != "P":
            self.role.bind(self.scheduler)


def make_request(request_id: str, num_prompt: int, **params) -> Request:
    prompt = list(range(10, 10 + num_prompt))
    request = Request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0), (0,), 0.0, **params)
    request.block_hashes = hash_full_blocks(prompt, BLOCK, [])
    return request


def prefill_on(p: Side, request_id: str, num_prompt: int) -> RemotePrefillParams:
    """Run a remote-decode prefill on P (no model: the test writes page bytes)."""
    request = make_request(request_id, num_prompt, kv_transfer_params={"do_remote_decode": True})
    p.scheduler.add_request(request)
    step = p.scheduler.schedule()
    for table in step.chunks[0].block_ids:
        for block_id in table:
            if block_id:
                p.pool[block_id] = block_id  # a recognisable pattern per page
    from pdserve.engine.schedule_types import SampledToken

    p.scheduler.update(step, [SampledToken(request_id, 5, 0.0)])
    p.scheduler.finish(request_id, FinishReason.LENGTH)
    return RemotePrefillParams.model_validate(request.kv_transfer_params)


def remote_for(p: Side, params: RemotePrefillParams) -> RemotePrefill:
    agent = AgentInfo(
        protocol_version=1, compat_hash="h", engine_id="P", epoch="epoch-1",
        geometry=PoolGeometry(num_blocks=NUM_BLOCKS, page_bytes=PAGE_BYTES, block_size=BLOCK,
                              group_size=PLAN.group_size, groups=groups_to_wire(PLAN)),
        transport=p.transport.local_peer_info("P", "epoch-1").to_dict(),
    )
    return RemotePrefill(params, agent)


@pytest.fixture
def pair():
    fabric = FakeFabric()
    return Side("P", fabric), Side("D", fabric), fabric


def admit_remote(d: Side, request_id: str, remote: RemotePrefill, num_prompt: int) -> Request:
    request = make_request(request_id, num_prompt, remote_prefill=remote)
    d.scheduler.add_request(request)
    d.scheduler.schedule()
    return request


def test_prefill_pins_blocks_until_the_readers_notification(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    assert p.role.num_pinned_blocks == sum(len(ids) for ids in params.remote_block_ids) > 0
    assert p.kv.has_request("r1")
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    d.role.tick()
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 29
    p.role.tick()
    assert p.role.num_pinned_blocks == 0 and not p.kv.has_request("r1")
    p.kv.check_invariants()
    d.kv.check_invariants()


def test_decode_receives_exactly_the_remote_pages_and_sliding_groups_only_their_window(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    full_ids, sliding_ids = params.remote_block_ids[0], params.remote_block_ids[1]
    assert len(full_ids) == 8 and len(sliding_ids) <= 8 // BLOCK + 1
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    d.role.tick()
    for local_table, remote_ids in zip(d.kv.block_ids(request.request_id), params.remote_block_ids):
        tail = local_table[8 - len(remote_ids):8]
        for local_id, remote_id in zip(tail, remote_ids):
            assert int(d.pool[local_id][0]) == remote_id


def test_decode_never_frees_blocks_under_an_inflight_read_even_when_aborted(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    d.transport.hold_reads = True
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    d.scheduler.finish(request.request_id, FinishReason.ABORT)
    assert d.kv.has_request("r1-d"), "blocks were freed under an in-flight READ"
    d.role.tick()
    assert d.kv.has_request("r1-d")
    d.transport.hold_reads = False
    d.role.tick()
    assert not d.kv.has_request("r1-d")
    d.kv.check_invariants()


def test_uncancellable_timed_out_read_keeps_its_pages(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    d.transport.hold_reads = True
    d.transport.cancellable = False
    d.role.pull_timeout_s = 0.0
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    d.role.tick()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV and d.kv.has_request("r1-d")


def test_failed_pull_under_recompute_policy_prefills_locally(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    d.transport.fail_reads = True
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    assert d.role.tick() == []
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    assert request in d.scheduler.waiting
    step = d.scheduler.schedule()  # admitted again as an ordinary local request
    assert step.chunks[0].start_position == 0 and step.chunks[0].num_tokens == 30
    d.kv.check_invariants()


def test_failed_pull_under_fail_policy_ends_the_request_with_a_distinct_error():
    fabric = FakeFabric()
    p, d = Side("P", fabric), Side("D", fabric, policy="fail")
    params = prefill_on(p, "r1", 30)
    d.transport.fail_reads = True
    admit_remote(d, "r1-d", remote_for(p, params), 30)
    failed = d.role.tick()
    assert [request_id for request_id, _ in failed] == ["r1-d"]
    assert failed[0][1].startswith("kv_pull_failed:")
    assert d.metrics.transfer.failures.labels(policy="fail")._value.get() == 1


def test_dead_prefill_peer_is_handled_per_policy(pair):
    p, d, fabric = pair
    params = prefill_on(p, "r1", 30)
    remote = remote_for(p, params)
    fabric.kill("P")
    request = admit_remote(d, "r1-d", remote, 30)
    d.role.tick()
    assert request.status in (RequestStatus.WAITING, RequestStatus.RUNNING)  # recomputed locally
    d.kv.check_invariants()


def test_request_ended_before_its_pull_tells_prefill_to_free_at_once(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    request = make_request("r1-d", 30, remote_prefill=remote_for(p, params))
    d.scheduler.add_request(request)
    d.scheduler.finish("r1-d", FinishReason.ABORT)  # still queued: nothing was read
    p.role.tick()
    assert p.role.num_pinned_blocks == 0 and not p.kv.has_request("r1")


def test_partial_prefix_hit_on_decode_pulls_only_the_missing_blocks(pair):
    p, d, _ = pair
    # D already computed the same 30-token prompt once (blocks committed to its cache).
    local = make_request("warm", 30)
    d.scheduler.add_request(local)
    from pdserve.engine.schedule_types import SampledToken

    step = d.scheduler.schedule()
    d.scheduler.update(step, [SampledToken("warm", 5, 0.0)])
    d.scheduler.finish("warm", FinishReason.LENGTH)
    params = prefill_on(p, "r1", 30)
    request = admit_remote(d, "r1-d", remote_for(p, params), 30)
    assert request.num_cached_tokens == 28  # 7 full blocks of 4
    # The full groups lack only block 7; the sliding groups have their window cached too.
    d.role.tick()
    assert d.metrics.transfer.descriptors._value.get() == 2  # block 7 of each full group
    p.role.tick()
    assert p.role.num_pinned_blocks == 0


def test_heartbeat_renews_leases_of_queued_remote_requests(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    d.scheduler.config = SchedulerConfig(max_num_running=1)
    d.scheduler.add_request(make_request("blocker", 5))
    d.scheduler.schedule()  # the running cap keeps the remote request queued
    d.scheduler.add_request(make_request("r1-d", 30, remote_prefill=remote_for(p, params)))
    lease = p.role.leases._leases["r1"]
    lease.expires_at_s -= 20
    before = lease.expires_at_s
    d.role.heartbeat_s = 0.0
    d.role.tick()
    p.role.tick()
    assert p.role.leases._leases["r1"].expires_at_s > before


def test_remote_block_ids_are_clipped_to_the_window_for_sliding_groups(pair):
    p, _, _ = pair
    params = prefill_on(p, "r1", 40)
    tables = p.kv.block_ids("r1")
    clipped = remote_block_ids_for(p.kv, "r1", 40)
    assert clipped[0] == tables[0][:10]
    assert 0 < len(clipped[1]) <= 8 // BLOCK + 1
    assert params.remote_block_ids == clipped


def test_decode_does_not_read_blocks_whose_lease_may_have_expired(pair):
    p, d, _ = pair
    params = prefill_on(p, "r1", 30)
    remote = remote_for(p, params)
    remote.lease_confirmed_s -= params.lease_s  # queued far too long without a renewal
    request = admit_remote(d, "r1-d", remote, 30)
    assert d.metrics.transfer.descriptors._value.get() == 0
    assert d.transport.num_unreleased_handles == 0
    # Recompute policy: admitted as an ordinary local prefill of the whole prompt.
    assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == 0
