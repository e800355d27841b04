"""Randomized allocate/commit/free/find_prefix sequences over a hybrid plan.

Besides the allocator's own invariants, a shadow record of what each block
holds checks the properties that matter to the model: a running request's
computed blocks are never handed to anyone else, and a prefix hit only ever
returns blocks holding exactly the requested content.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.hashing import hash_full_blocks
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.prefix import PrefixHit
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups

BS = 4


@dataclass
class SimRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    num_computed_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)


@dataclass
class Harness:
    manager: KVCacheManager
    rng: random.Random
    bases: list[list[int]]
    requests: dict[str, SimRequest] = field(default_factory=dict)
    contents: dict[int, object] = field(default_factory=dict)  # block id -> what was written into it
    counts: dict[str, int] = field(default_factory=dict)
    next_id: int = 0

    def bump(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def check(self) -> None:
        self.manager.check_invariants()
        for request_id, req in self.requests.items():
            for table in self.manager.block_ids(request_id):
                for index in range(req.num_computed_tokens // BS):
                    if table[index] != NULL_BLOCK_ID:
                        assert self.contents[table[index]] == req.hashes[index], f"{request_id} lost block {index}"

    def check_hit(self, hit: PrefixHit, hashes: list[bytes]) -> None:
        for ids in hit.block_ids:
            assert len(ids) == hit.num_tokens // BS
            for index, block_id in enumerate(ids):
                if block_id != NULL_BLOCK_ID:
                    assert self.contents[block_id] == hashes[index], "prefix hit returned a block of other content"

    def compute(self, request_id: str, req: SimRequest, num_new: int) -> None:
        """Pretend the model wrote KV for tokens [computed, computed + num_new)."""
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        req.hashes = hash_full_blocks(req.token_ids[:end], BS, req.hashes)
        for table in self.manager.block_ids(request_id):
            for index in range(start // BS, (end - 1) // BS + 1):
                if table[index] == NULL_BLOCK_ID:
                    continue  # outside a sliding window: a remote pull skips it too
                full = (index + 1) * BS <= end
                self.contents[table[index]] = req.hashes[index] if full else ("partial", request_id, index)
        req.num_computed_tokens = end
        self.manager.commit(request_id, req.hashes, end)

    def allocate(self, request_id: str, req: SimRequest, num_new: int, hit: PrefixHit | None = None) -> bool:
        held_before = self.manager.block_ids(request_id)
        predicted = self.manager.can_allocate_slots(request_id, req.num_computed_tokens, num_new, hit)
        num_needed = self.manager.num_blocks_needed(request_id, req.num_computed_tokens, num_new, hit)
        ok = self.manager.allocate_slots(request_id, req.num_computed_tokens, num_new, hit)
        assert ok == predicted
        if ok:
            before = hit.block_ids if hit else held_before
            # By position: a block released from the window may come straight back.
            new = [b for old, ids in zip(before, self.manager.block_ids(request_id)) for i, b in enumerate(ids)
                   if b != NULL_BLOCK_ID and (i >= len(old) or old[i] != b)]
            assert len(new) == num_needed
            for block_id in new:
                self.contents[block_id] = None  # fresh blocks hold garbage until computed
        self.bump("allocated" if ok else "refused")
        return ok

    def admit(self) -> None:
        base = self.rng.choice(self.bases)
        suffix = [self.rng.randrange(5000) for _ in range(self.rng.randint(0, 6))]
        prompt = base[: self.rng.randint(1, len(base))] + suffix
        req = SimRequest(list(prompt), len(prompt), self.rng.randint(1, 24))
        request_id = f"r{self.next_id}"
        self.next_id += 1
        hashes = hash_full_blocks(prompt, BS, [])
        hit = self.manager.find_prefix(hashes, len(prompt))
        self.check_hit(hit, hashes)
        self.bump("hit" if hit.num_tokens else "miss")
        if any(NULL_BLOCK_ID in ids for ids in hit.block_ids):
            self.bump("hit_with_null")
        req.hashes = hashes[: hit.num_tokens // BS]
        if self.rng.random() < 0.3:
            # Like a decode worker: all but the last prompt token arrive by pull.
            req.num_computed_tokens, num_new = len(prompt) - 1, 1
        else:
            req.num_computed_tokens = hit.num_tokens
            num_new = min(self.rng.choice([4, 8, 16, 64]), len(prompt) - hit.num_tokens)
        if self.allocate(request_id, req, num_new, hit):
            self.requests[request_id] = req
            num_new += req.num_computed_tokens - hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            self.compute(request_id, req, num_new)

    def step(self) -> None:
        request_id = self.rng.choice(sorted(self.requests))
        req = self.requests[request_id]
        if req.num_computed_tokens < req.num_prompt_tokens:
            num_new = min(self.rng.choice([1, 4, 8, 16]), req.num_prompt_tokens - req.num_computed_tokens)
        else:
            req.token_ids.append(self.rng.randrange(5000))  # the sampled token, computed next step
            num_new = len(req.token_ids) - req.num_computed_tokens
        if not self.allocate(request_id, req, num_new):
            self.finish(request_id)  # preempted by recompute: it gives its blocks back
            return
        self.compute(request_id, req, num_new)
        if len(req.token_ids) - req.num_prompt_tokens >= req.max_tokens:
            self.finish(request_id)

    def finish(self, request_id: str) -> None:
        self.manager.free(request_id)
        del self.requests[request_id]
        self.bump("freed")


def test_random_operations_keep_invariants_and_never_serve_wrong_blocks():
    specs = [SlidingWindowSpec(8), FullAttentionSpec(), SlidingWindowSpec(8), FullAttentionSpec(),
             SlidingWindowSpec(13)]
    plan = plan_groups(specs)
    assert len(plan.groups) == 5
    rng = random.Random(20240611)
    bases = [[rng.randrange(5000) for _ in range(60)] for _ in range(3)]
    harness = Harness(KVCacheManager(plan, num_blocks=90, block_size=BS), rng, bases)
    for _ in range(3000):
        roll = rng.random()
        if not harness.requests or (roll < 0.25 and len(harness.requests) < 6):
            harness.admit()
        elif roll < 0.9:
            harness.step()
        else:
            harness.finish(rng.choice(sorted(harness.requests)))
        harness.check()
    for request_id in list(harness.requests):
        harness.finish(request_id)
        harness.check()
    manager = harness.manager
    assert manager.pool.num_in_use == 0 and manager.num_free_blocks == 89
    # The run must have exercised the interesting paths, not just the easy ones.
    for name in ("hit", "miss", "hit_with_null", "refused", "freed"):
        assert harness.counts.get(name, 0) > 10, (name, harness.counts)
    stats = manager.prefix_stats
    assert 0 < stats.num_hit_tokens < stats.num_query_tokens
