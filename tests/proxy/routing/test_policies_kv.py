"""The kv_aware score: prompt tokens to compute plus priced load, a tier hit worth less than a device hit
and more than a miss; ties rotate; reasons say what decided."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from proxy.config import RoutingConfig
from proxy.routing.kv_index import CachedPrefix
from proxy.routing.candidates import Candidate, RoleTurns, RouteRequest
from proxy.routing.policies_kv import (CACHE_HIT, LOAD, NO_BLOCKS, NO_HIT, KVAwarePolicy, choose_scored,
                                       decode_alone_suffices, rank, score_candidate)
from tests.proxy.routing.test_policies import URLS, backend

PROMPT_TOKENS = 100
OFFLOAD_HIT_WEIGHT = RoutingConfig().kv_offload_hit_weight


def scored(cached_and_load: list[tuple[int, int]], load_tokens: float = 10.0):
    return [score_candidate(backend(url, queued=queued), CachedPrefix(cached), PROMPT_TOKENS, load_tokens,
                            OFFLOAD_HIT_WEIGHT)
            for url, (cached, queued) in zip(URLS, cached_and_load)]


def scored_prefixes(prefixes: list[CachedPrefix], load_tokens: float = 10.0, weight: float = OFFLOAD_HIT_WEIGHT):
    """Equally loaded candidates with these cached prefixes (device and tier tokens)."""
    return [score_candidate(backend(url), prefix, PROMPT_TOKENS, load_tokens, weight)
            for url, prefix in zip(URLS, prefixes)]


def test_score_is_tokens_to_compute_plus_priced_load():
    candidate = scored([(40, 3)])[0]
    assert (candidate.cached_tokens, candidate.load, candidate.score) == (40, 3.0, 60 + 10 * 3)


def test_a_tier_token_counts_at_the_offload_weight_and_the_default_is_half():
    candidate = scored_prefixes([CachedPrefix(64, num_offload_tokens=48)])[0]
    assert OFFLOAD_HIT_WEIGHT == 0.5
    assert (candidate.cached_tokens, candidate.offload_tokens, candidate.cached_worth_tokens) == (64, 48, 16 + 24)
    assert candidate.score == PROMPT_TOKENS - 40
    assert candidate.as_dict()["offload_tokens"] == 48


def test_a_device_hit_beats_a_tier_hit_which_beats_a_miss():
    miss, tier, device = CachedPrefix(0), CachedPrefix(64, num_offload_tokens=64), CachedPrefix(64)
    for weight in (0.01, OFFLOAD_HIT_WEIGHT, 0.99):
        ranked = rank(scored_prefixes([miss, tier, device], weight=weight))
        assert [c.backend.url for c in ranked] == [URLS[2], URLS[1], URLS[0]], weight
    choice, reason = choose_scored(scored_prefixes([miss, tier]), 0)
    assert (choice.backend.url, reason) == (URLS[1], CACHE_HIT)


def test_a_longer_prefix_in_the_tier_can_outweigh_a_shorter_one_on_the_device():
    device, tier = CachedPrefix(16), CachedPrefix(64, num_offload_tokens=48)  # worth 16 vs 16 + 24
    choice, reason = choose_scored(scored_prefixes([device, tier]), 0)
    assert (choice.backend.url, reason) == (URLS[1], CACHE_HIT)
    shorter = CachedPrefix(64, num_offload_tokens=64)  # worth 32 against a device prefix of 40
    choice, reason = choose_scored(scored_prefixes([CachedPrefix(40), shorter]), 0)
    assert (choice.backend.url, reason) == (URLS[0], CACHE_HIT)


@pytest.mark.parametrize("weight", [0.0, 1.0, -0.5, 2.0])
def test_the_offload_weight_stays_strictly_between_a_miss_and_a_device_hit(weight):
    with pytest.raises(ValidationError):
        RoutingConfig(kv_offload_hit_weight=weight)


def test_the_longest_cached_prefix_wins_when_loads_are_equal():
    choice, reason = choose_scored(scored([(16, 1), (64, 1), (32, 1)]), 0)
    assert (choice.backend.url, reason) == (URLS[1], CACHE_HIT)


def test_load_can_outweigh_a_longer_prefix_and_the_reason_says_so():
    choice, reason = choose_scored(scored([(16, 0), (64, 6)]), 0)  # 84 vs 36 + 60
    assert (choice.backend.url, reason) == (URLS[0], LOAD)


def test_with_nothing_cached_ties_rotate_like_least_loaded():
    chosen = [choose_scored(scored([(0, 0), (0, 0), (0, 2)]), turn)[0].backend.url for turn in range(4)]
    assert chosen == [URLS[0], URLS[1], URLS[0], URLS[1]]
    assert choose_scored(scored([(0, 0), (0, 0)]), 0)[1] == NO_HIT


def test_rank_is_pure_and_breaks_score_ties_by_the_longer_prefix():
    candidates = scored([(0, 1), (10, 2), (20, 0)], load_tokens=10.0)  # scores 110, 110, 80
    assert [c.backend.url for c in rank(candidates)] == [URLS[2], URLS[1], URLS[0]]
    assert rank(candidates) == rank(candidates)


def test_the_policy_scores_each_candidates_predicted_prefix_and_keeps_the_prediction():
    offered = [Candidate(URLS[0], True, 0.0, cached=CachedPrefix(16)),
               Candidate(URLS[1], True, 1.0, cached=CachedPrefix(64))]
    pick = KVAwarePolicy(10.0, OFFLOAD_HIT_WEIGHT).choose(offered, RouteRequest(PROMPT_TOKENS, blocks_known=True),
                                                         RoleTurns())
    assert (pick.url, pick.reason, pick.cached_tokens) == (URLS[1], CACHE_HIT, 64)  # 84 vs 36 + 10


def test_without_the_prompts_blocks_the_policy_is_least_loaded_on_its_fallback_rotation():
    offered = [Candidate(URLS[0], True, 2.0), Candidate(URLS[1], True, 0.0), Candidate(URLS[2], True, 0.0)]
    policy = KVAwarePolicy(10.0, OFFLOAD_HIT_WEIGHT)
    picks = [policy.choose(offered, RouteRequest(PROMPT_TOKENS), RoleTurns(fallback=turn)) for turn in range(2)]
    assert [(p.url, p.reason, p.cached_tokens) for p in picks] == [(URLS[1], NO_BLOCKS, None),
                                                                   (URLS[2], NO_BLOCKS, None)]


def test_the_decode_worker_alone_suffices_only_within_the_limit_and_with_a_hit():
    assert decode_alone_suffices(100, 40, 64)
    assert not decode_alone_suffices(100, 30, 64)
    assert not decode_alone_suffices(10, 0, 64)  # nothing cached: never skip on size alone
    assert not decode_alone_suffices(100, 100, 0)  # 0: never
