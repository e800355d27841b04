"""A holder lends a prefix held in its offload tier: it loads the pages into its pool through the KV
manager's own tier read, pins them with its pool's blocks, and names them in the ticket only once the
load landed (the scheduler's poll reports it); a pool short of free blocks pins what fits and never
touches a running request's blocks; a failed or late load names only the pool's leading blocks; a
release or an expired lease, even in the middle of a load, leaves nothing referenced. Torch-free: the
real KV manager, tier, lease table and scheduler over byte pages."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

from pdserve.api.config import SchedulerConfig
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.offload import OffloadTier
from pdserve.kv.specs import FullAttentionSpec, plan_groups
from pdserve.metrics import Metrics
from pdserve.pd.leases import LeaseTable
from pdserve.pd.peer_pins import LoadingPin, await_peer_pin, pin_peer_prefix, settle_peer_pin
from pdserve.pd.prefill import PrefillConnector, PrefillIdentity
from tests.engine.checked_scheduler import CheckedScheduler
from tests.kv.test_offload import BS, FakePages, compute, content, prompt

FULL = plan_groups([FullAttentionSpec()])
LEASE_S = 30.0


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class Silent:
    """The transport as the connector's poll sees it: no reader's message arrives."""

    generation = 0

    def poll_notifications(self) -> list[bytes]:
        return []


class HeldReads:
    """The tier's I/O thread, run when the test says (a file tier's read, in flight until then)."""

    runs_one_at_a_time = True

    def __init__(self):
        self.jobs: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args):
        future: Future = Future()
        self.jobs.append((future, fn, args))
        return future

    def run_all(self) -> None:
        for future, fn, args in self.jobs:
            try:
                future.set_result(fn(*args))
            except Exception as error:  # noqa: BLE001 - the tier reads the outcome from the future
                future.set_exception(error)
        self.jobs = []

    def shutdown(self, wait: bool = True) -> None:
        pass


class Holder:
    """Worker A: a pool of `num_blocks` with a tier behind it, its lease table and its scheduler."""

    def __init__(self, num_blocks: int, held_reads: bool = False):
        self.clock = Clock()
        self.pages = FakePages(num_blocks, 64)
        self.reads = HeldReads() if held_reads else None
        self.tier = OffloadTier(self.pages, [0], executor=self.reads)
        self.kv = KVCacheManager(FULL, num_blocks, BS, offload=self.tier)
        self.connector = PrefillConnector(Silent(), LeaseTable(LEASE_S, clock=self.clock),
                                          PrefillIdentity("A", "epoch-1", "127.0.0.1", 1), FULL, BS,
                                          Metrics().transfer)
        self.scheduler = CheckedScheduler(SchedulerConfig(), self.kv, BS, 10_000, connector=self.connector)
        self.lent: dict[str, int] = {}

    def count(self, medium: str, num_tokens: int) -> None:
        self.lent[medium] = self.lent.get(medium, 0) + num_tokens

    def pin(self, token_ids: list[int]):
        return pin_peer_prefix(self.kv, self.connector, token_ids, self.count, self.clock)

    def settle(self, pin: LoadingPin, give_up: bool = False):
        return settle_peer_pin(self.kv, self.connector, pin, give_up, self.count)

    def tick(self) -> None:
        """One engine-loop turn with nothing to compute: lease news, then the scheduler's tier poll."""
        self.scheduler.apply_kv_events(self.connector.poll())
        assert not self.scheduler.schedule().chunks
        self.check()

    def check(self) -> None:
        self.kv.check_invariants()
        self.tier.check_invariants()

    def evict_all_but(self, num_kept: int) -> None:
        """Take every free block but the `num_kept` per group a finished prompt freed last (its first
        blocks: a prompt's blocks are freed tail first, and its tail goes into the tier first), then
        give them back uncached."""
        num_groups = len(FULL.groups)
        num_taken = (self.kv.pool.num_free_blocks - num_kept * num_groups) // num_groups
        assert self.kv.allocate_slots("hog", 0, num_taken * BS)
        self.kv.free("hog")  # never committed: its blocks go back uncached, A's pages stay in the tier
        self.check()

    def nothing_referenced(self) -> bool:
        return (self.connector.num_pinned_blocks == 0 and not self.kv.has_tier_reads()
                and self.kv.pool.num_free_blocks == self.kv.num_usable_blocks)


def held_prefix(holder: Holder, num_blocks: int, num_in_pool: int) -> tuple[list[int], list[bytes]]:
    """A computes a prompt of `num_blocks` full blocks and one token; the pool keeps its first
    `num_in_pool` blocks, the tier the rest."""
    tokens = prompt(num_blocks * BS + 1, 500)
    hashes = compute(holder.kv, holder.pages, "a", tokens)
    holder.evict_all_but(num_in_pool)
    for index, block_hash in enumerate(hashes):
        in_pool = holder.kv.pool.lookup(block_hash, 0) is not None
        assert in_pool == (index < num_in_pool) and (in_pool or holder.tier.lookup(block_hash, 0) is not None)
    return tokens, hashes


def read_by_peer(holder: Holder, ticket) -> list[list[bytes]]:
    """What a READ of the ticket's blocks would see, per group."""
    return [[holder.pages.pool[block_id] for block_id in ids] for ids in ticket.block_ids]


def expected(hashes: list[bytes], num_blocks: int) -> list[list[bytes]]:
    return [[content(block_hash, group) for block_hash in hashes[:num_blocks]] for group in range(len(FULL.groups))]


def test_a_prefix_held_only_in_the_tier_is_loaded_then_pinned_and_released():
    holder = Holder(num_blocks=21)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=0)
    pin = holder.pin(tokens + [7, 7])
    assert isinstance(pin, LoadingPin) and pin.loaded == frozenset(range(4))
    assert holder.settle(pin) is pin  # loading: no ticket names a block whose load has not landed
    holder.tick()  # the scheduler's poll reports the load: its pages join the prefix cache
    ticket = holder.settle(pin)
    assert ticket.num_tokens == 4 * BS and ticket.block_hashes == [h.hex() for h in hashes]
    assert read_by_peer(holder, ticket) == expected(hashes, 4)
    assert holder.lent == {"offload": 4 * BS} and holder.connector.num_pinned_blocks == 4 * len(FULL.groups)
    holder.check()
    holder.connector.release_early(ticket.pin_id, ticket.nonce)  # the puller's release
    holder.tick()
    assert not holder.kv.has_request(ticket.pin_id) and holder.nothing_referenced()
    assert holder.kv.pool.lookup(hashes[3], 0) is not None  # the loaded pages stay cached, unreferenced


def test_pool_blocks_and_tier_pages_of_one_prefix_are_pinned_together():
    holder = Holder(num_blocks=21)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=1)
    pin = holder.pin(tokens)
    assert pin.loaded == frozenset({1, 2, 3})
    holder.tick()
    ticket = holder.settle(pin)
    assert read_by_peer(holder, ticket) == expected(hashes, 4)
    assert holder.lent == {"device": BS, "offload": 3 * BS}


def test_a_pool_short_of_free_blocks_pins_what_fits_and_spares_running_requests():
    holder = Holder(num_blocks=21)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=0)
    # A running request leaves 5 free blocks: the pin's tier pages may take half of them, 2.
    assert holder.kv.allocate_slots("running", 0, (holder.kv.num_free_blocks - 5) * BS)
    running = holder.kv.block_ids("running")
    pin = holder.pin(tokens)
    assert pin.loaded == frozenset({0, 1})
    holder.tick()
    ticket = holder.settle(pin)
    assert ticket.num_tokens == 2 * BS and read_by_peer(holder, ticket) == expected(hashes, 2)
    assert holder.kv.block_ids("running") == running
    assert not {b for ids in ticket.block_ids for b in ids} & {b for ids in running for b in ids}
    holder.kv.free("running")
    holder.clock.now_s += LEASE_S + 1  # nobody read or released it: the lease frees it
    holder.tick()
    assert holder.nothing_referenced()


def test_a_failed_load_names_only_the_pools_leading_blocks_or_nothing():
    holder = Holder(num_blocks=21)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=1)
    holder.pages.fail_reads = True
    pin = holder.pin(tokens)
    holder.tick()  # the load failed: its pages left the tier, their blocks were never cached
    ticket = holder.settle(pin)
    assert ticket.num_tokens == BS and read_by_peer(holder, ticket) == expected(hashes, 1)
    assert holder.lent == {"device": BS}
    holder.connector.release_early(ticket.pin_id, ticket.nonce)
    holder.tick()
    assert holder.nothing_referenced()
    # Nothing of it in the pool: no ticket, and the pin is gone at once.
    other = prompt(3 * BS + 1, 900)
    compute(holder.kv, holder.pages, "b", other)
    holder.evict_all_but(0)
    holder.pages.fail_reads = True
    pin = holder.pin(other)
    holder.tick()
    assert holder.settle(pin) is None and holder.nothing_referenced()


def test_a_late_load_is_given_up_and_its_blocks_wait_for_the_read_to_end():
    holder = Holder(num_blocks=21, held_reads=True)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=1)
    pin = holder.pin(tokens)
    holder.tick()
    assert holder.settle(pin) is pin  # the read is still on the I/O thread
    ticket = holder.settle(pin, give_up=True)  # past the wait: the pool's part only
    assert ticket.num_tokens == BS and holder.lent == {"device": BS}
    holder.reads.run_all()
    holder.tick()  # the late pages land and join the cache, still under the pin
    holder.connector.release_early(ticket.pin_id, ticket.nonce)
    holder.tick()
    assert holder.nothing_referenced() and holder.kv.pool.lookup(hashes[3], 0) is not None
    # With no pool block to name, giving up releases the pin while its read is in flight: the blocks
    # are parked until the read ends, and the scheduler keeps polling for it.
    other = prompt(3 * BS + 1, 900)
    compute(holder.kv, holder.pages, "b", other)
    holder.evict_all_but(0)
    pin = holder.pin(other)
    assert holder.settle(pin, give_up=True) is None
    assert holder.connector.num_pinned_blocks == 0 and holder.scheduler.has_offload_loads()
    holder.reads.run_all()
    holder.tick()
    assert holder.nothing_referenced()


def test_a_lease_that_runs_out_during_the_load_frees_everything():
    holder = Holder(num_blocks=21, held_reads=True)
    tokens, _ = held_prefix(holder, num_blocks=4, num_in_pool=0)
    pin = holder.pin(tokens)
    holder.clock.now_s += LEASE_S + 1
    holder.tick()  # the lease expired: the scheduler freed the pin, its blocks parked behind the read
    assert holder.settle(pin) is None
    holder.reads.run_all()
    holder.tick()
    assert holder.nothing_referenced()


def test_the_answer_waits_for_the_load_and_gives_up_after_its_bound():
    holder = Holder(num_blocks=21, held_reads=True)
    tokens, hashes = held_prefix(holder, num_blocks=4, num_in_pool=1)
    polls: list[bool] = []

    async def run_on_engine(function):
        polls.append(True)
        if len(polls) == 3:  # the read ends while the answer waits
            holder.reads.run_all()
        holder.tick()
        return function()

    ticket = asyncio.run(await_peer_pin(run_on_engine, lambda: holder.pin(tokens), holder.settle,
                                        wait_s=60.0, poll_s=0.0, clock=holder.clock))
    assert len(polls) == 3 and ticket.num_tokens == 4 * BS and read_by_peer(holder, ticket) == expected(hashes, 4)
    holder.connector.release_early(ticket.pin_id, ticket.nonce)
    holder.tick()

    other = prompt(3 * BS + 1, 900)  # a second prefix, its first block in the pool, the rest in the tier
    compute(holder.kv, holder.pages, "b", other)
    holder.evict_all_but(1)

    async def never_lands(function):
        holder.clock.now_s += 1.0
        holder.tick()
        return function()

    late = asyncio.run(await_peer_pin(never_lands, lambda: holder.pin(other), holder.settle,
                                      wait_s=2.5, poll_s=0.0, clock=holder.clock))
    assert late.num_tokens == BS  # given up after the bound: the pool's block only
    holder.reads.run_all()
    holder.connector.release_early(late.pin_id, late.nonce)
    holder.tick()
    assert holder.nothing_referenced()


def test_a_prefix_wholly_in_the_pool_is_answered_at_once_and_one_held_nowhere_gets_none():
    holder = Holder(num_blocks=21)
    tokens, _ = held_prefix(holder, num_blocks=2, num_in_pool=2)
    ticket = holder.pin(tokens)
    assert ticket.num_tokens == 2 * BS and holder.lent == {"device": 2 * BS}
    holder.connector.release_early(ticket.pin_id, ticket.nonce)
    holder.tick()
    assert holder.pin(prompt(2 * BS, 7000)) is None and holder.nothing_referenced()
