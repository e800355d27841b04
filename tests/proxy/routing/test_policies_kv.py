"""The kv_aware score: prompt tokens to compute plus priced load; ties rotate; reasons say what decided."""

from __future__ import annotations

from proxy.routing.policies_kv import CACHE_HIT, LOAD, NO_HIT, KVAwarePolicy, rank, score_candidate
from tests.proxy.routing.test_policies import URLS, backend

PROMPT_TOKENS = 100


def scored(cached_and_load: list[tuple[int, int]], load_tokens: float = 10.0):
    return [score_candidate(backend(url, queued=queued), cached, PROMPT_TOKENS, load_tokens)
            for url, (cached, queued) in zip(URLS, cached_and_load)]


def test_score_is_tokens_to_compute_plus_priced_load():
    candidate = scored([(40, 3)])[0]
    assert (candidate.cached_tokens, candidate.load, candidate.score) == (40, 3.0, 60 + 10 * 3)


def test_the_longest_cached_prefix_wins_when_loads_are_equal():
    choice, reason = KVAwarePolicy().choose(scored([(16, 1), (64, 1), (32, 1)]))
    assert (choice.backend.url, reason) == (URLS[1], CACHE_HIT)


def test_load_can_outweigh_a_longer_prefix_and_the_reason_says_so():
    choice, reason = KVAwarePolicy().choose(scored([(16, 0), (64, 6)]))  # 84 vs 36 + 60
    assert (choice.backend.url, reason) == (URLS[0], LOAD)


def test_with_nothing_cached_ties_rotate_like_least_loaded():
    policy = KVAwarePolicy()
    chosen = [policy.choose(scored([(0, 0), (0, 0), (0, 2)]))[0].backend.url for _ in range(4)]
    assert chosen == [URLS[0], URLS[1], URLS[0], URLS[1]]
    assert policy.choose(scored([(0, 0), (0, 0)]))[1] == NO_HIT


def test_rank_is_pure_and_breaks_score_ties_by_the_longer_prefix():
    candidates = scored([(0, 1), (10, 2), (20, 0)], load_tokens=10.0)  # scores 110, 110, 80
    assert [c.backend.url for c in rank(candidates)] == [URLS[2], URLS[1], URLS[0]]
    assert rank(candidates) == rank(candidates)
