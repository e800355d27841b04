"""Randomized admissions, chunks, commits and frees over a plan with state groups, attention and a window.

A shadow of every page's content plays the device: a freshly allocated page is garbage at once (as if a
pull or a tier read wrote it during the schedule), the copies `take_state_copies` returns are applied in
order at the end of each schedule, then the forward pass appends the chunk's tokens to each live state
page. The property that matters to the model: a request's live state is always exactly the tokens it
computed so far, whether it started from zero, from a restored snapshot or from a pull.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, plan_groups

BS = 4
STATE = RecurrentStateSpec("mamba2", conv_channels=4, conv_window=3, recurrent_shape=(2, 4, 4))


@dataclass
class SimRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0


@dataclass
class StateHarness:
    manager: KVCacheManager
    rng: random.Random
    bases: list[list[int]]
    requests: dict[str, SimRequest] = field(default_factory=dict)
    pages: dict[int, object] = field(default_factory=dict)  # page id -> what the device holds there
    counts: dict[str, int] = field(default_factory=dict)
    next_id: int = 0

    def bump(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def live_pages(self, request_id: str) -> list[int]:
        tables = self.manager.block_ids(request_id)
        return [tables[g][0] for g in self.manager.plan.state_group_ids]

    def schedule(self, request_id: str, req: SimRequest, num_new: int, hit=None, pulled: bool = False) -> bool:
        """Allocate (new pages are garbage at once), then the end of the schedule: take the copies."""
        before = {b for table in self.manager.block_ids(request_id) for b in table}
        ok = self.manager.allocate_slots(request_id, req.num_computed_tokens, num_new, hit)
        self.bump("allocated" if ok else "refused")
        if ok:
            after = {b for table in self.manager.block_ids(request_id) for b in table}
            for block_id in after - before - {NULL_BLOCK_ID}:
                self.pages[block_id] = ("garbage", block_id)
            if pulled:  # a decode worker's pull lands the prompt's state in the live pages
                for page in self.live_pages(request_id):
                    self.pages[page] = tuple(req.token_ids[:req.num_computed_tokens])
        for source, destination in self.manager.take_state_copies():
            self.pages[destination] = self.pages.get(source)
            self.bump("copied")
        self.manager.check_invariants()
        return ok

    def forward(self, request_id: str, req: SimRequest, num_new: int) -> None:
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        for page in self.live_pages(request_id):
            state = () if start == 0 else self.pages.get(page)
            assert state == tuple(req.token_ids[:start]), f"{request_id}: state at {start} is {state!r:.60}"
            self.pages[page] = tuple(req.token_ids[:end])
        req.num_computed_tokens = end
        hashes = hash_full_blocks(req.token_ids[:end], BS, [])
        boundary = end == self.manager.prompt_boundary_tokens(req.num_prompt_tokens)
        self.manager.commit(request_id, hashes, end, prompt_boundary=boundary)
        self.manager.check_invariants()

    def admit(self) -> None:
        base = self.rng.choice(self.bases)
        prompt = base[: self.rng.randint(1, len(base))] + [self.rng.randrange(5000)
                                                          for _ in range(self.rng.randint(0, 6))]
        req = SimRequest(list(prompt), len(prompt), self.rng.randint(1, 12))
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hit = self.manager.find_prefix(hash_full_blocks(prompt, BS, []), len(prompt))
        self.bump("hit" if hit.num_tokens else "miss")
        pulled = self.rng.random() < 0.2
        if hit.num_tokens and not pulled:
            self.bump("restored")
        if pulled:  # like a decode worker: everything but the last prompt token arrives by pull
            req.num_computed_tokens, num_new = len(prompt) - 1, 1
        else:
            req.num_computed_tokens = hit.num_tokens
            num_new = min(self.rng.choice([4, 8, 16, 64]), len(prompt) - hit.num_tokens)
        if self.schedule(request_id, req, num_new, hit, pulled):
            self.requests[request_id] = req
            self.forward(request_id, req, num_new)

    def step(self) -> None:
        request_id = self.rng.choice(sorted(self.requests))
        req = self.requests[request_id]
        if req.num_computed_tokens < req.num_prompt_tokens:
            num_new = min(self.rng.choice([1, 4, 8, 16]), req.num_prompt_tokens - req.num_computed_tokens)
            due = self.manager.next_snapshot_tokens(req.num_computed_tokens, req.num_prompt_tokens)
            if due is not None and self.rng.random() < 0.7:  # a scheduler that cuts chunks at snapshots
                num_new = min(num_new, due - req.num_computed_tokens)
        else:
            req.token_ids.append(self.rng.randrange(5000))
            num_new = len(req.token_ids) - req.num_computed_tokens
        if not self.schedule(request_id, req, num_new):
            self.finish(request_id)  # preempted by recompute
            return
        self.forward(request_id, req, num_new)
        if len(req.token_ids) - req.num_prompt_tokens >= req.max_tokens:
            self.finish(request_id)

    def finish(self, request_id: str) -> None:
        self.manager.free(request_id)
        del self.requests[request_id]
        self.manager.check_invariants()
        self.bump("freed")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_keep_every_live_state_exactly_the_tokens_computed(seed: int):
    specs = [STATE, FullAttentionSpec(), STATE, SlidingWindowSpec(8), STATE, STATE, STATE]
    plan = plan_groups(specs, attention_layer_bytes=200)  # pages of 200 bytes: one 176-byte state each
    assert len(plan.state_group_ids) == 5
    rng = random.Random(seed)
    bases = [[rng.randrange(5000) for _ in range(48)] for _ in range(3)]
    harness = StateHarness(KVCacheManager(plan, num_blocks=40, block_size=BS, snapshot_interval_blocks=3), rng, bases)
    for _ in range(2500):
        roll = rng.random()
        if not harness.requests or (roll < 0.25 and len(harness.requests) < 5):
            harness.admit()
        elif roll < 0.9:
            harness.step()
        else:
            harness.finish(rng.choice(sorted(harness.requests)))
    for request_id in list(harness.requests):
        harness.finish(request_id)
    for _ in range(2):
        harness.manager.take_state_copies()
    manager = harness.manager
    assert manager.pool.num_in_use == 0 and manager.num_free_blocks == manager.num_usable_blocks
    for name in ("hit", "restored", "miss", "refused", "freed", "copied"):
        assert harness.counts.get(name, 0) > 10, (name, harness.counts)
