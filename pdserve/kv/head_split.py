"""How a model's KV heads are split over tensor-parallel ranks, and where a rank finds its heads on
a worker split differently. Torch-free: the one rule shared by the model shards
(pdserve/models/tensor_parallel.py) and the KV transfer (pdserve/transfer/ranked_transport.py).

Rank r of N holds heads [r*K//N, r*K//N + max(1, K//N)): a share when K >= N, one replicated head
when K < N (N a multiple of K). With heads outermost in a page (pdserve/kv/layout.py), the heads a
decode rank needs from one prefill rank are one contiguous range of both pages:

    K = 4 heads    prefill TP=1: rank 0 [h0 h1 h2 h3]
                   decode  TP=2: rank 0 [h0 h1] <- prefill rank 0, heads 0-1 of its page
                                 rank 1 [h2 h3] <- prefill rank 0, heads 2-3 of its page

    K = 4 heads    prefill TP=2: rank 0 [h0 h1]   rank 1 [h2 h3]
                   decode  TP=1: rank 0 [h0 h1 | h2 h3] <- first half from prefill rank 0,
                                                           second half from prefill rank 1

    K = 2 heads    prefill TP=4: ranks 0,1 [h0] (replicas)  ranks 2,3 [h1]
                   decode  TP=1: rank 0 [h0 | h1] <- h0 from prefill rank 0 only, h1 from rank 2 only

Every range moved is `chunk_heads` heads long, so one descriptor moves one (block, source).
"""

from __future__ import annotations

from dataclasses import dataclass


def rank_kv_heads(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) rank `rank` of `size` holds."""
    return rank * num_kv_heads // size, max(1, num_kv_heads // size)


def heads_split_problem(num_kv_heads: int, size: int) -> str | None:
    """Why `size` ranks cannot split `num_kv_heads` KV heads (None when they can)."""
    if num_kv_heads % size and size % num_kv_heads:
        return (f"{size} ranks and the model's {num_kv_heads} KV heads: one must divide the other "
                f"(KV heads are split when there are more of them than ranks, replicated when fewer)")
    return None


@dataclass(frozen=True, slots=True)
class HeadSource:
    """A run of heads a local rank reads from one remote rank."""

    remote_rank: int
    local_offset: int  # first head of the run, counted in the local rank's page
    remote_offset: int  # the same head, counted in the remote rank's page
    num_heads: int


def head_sources(num_kv_heads: int, local_size: int, local_rank: int, remote_size: int) -> list[HeadSource]:
    """Where the local rank finds each of its heads: the lowest remote rank holding it (replicas are
    read once), runs of heads from the same remote rank merged."""
    first, count = rank_kv_heads(num_kv_heads, local_size, local_rank)
    holders = [rank_kv_heads(num_kv_heads, remote_size, rank) for rank in range(remote_size)]
    sources: list[HeadSource] = []
    head = first
    while head < first + count:
        remote_rank = next(rank for rank, (start, num) in enumerate(holders) if start <= head < start + num)
        remote_first, remote_count = holders[remote_rank]
        run = min(first + count, remote_first + remote_count) - head
        sources.append(HeadSource(remote_rank, head - first, head - remote_first, run))
        head += run
    return sources


def chunk_heads(num_kv_heads: int, local_size: int, remote_size: int) -> int:
    """Heads one descriptor moves between these two splits: the smaller of the two ranks' shares."""
    return min(rank_kv_heads(num_kv_heads, local_size, 0)[1], rank_kv_heads(num_kv_heads, remote_size, 0)[1])
