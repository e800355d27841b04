"""KV pulls between tensor-parallel shapes (`--mode tp`): a decode worker of TP size D pulls a prompt
from a prefill worker of TP size P, every decode rank through its own agent and `RankReader`, block
ids contiguous (runs coalesce at equal TP) or scattered, against 1->1 and a memcpy. Each side's TP
sizes carve their rank pools from one buffer (rank r of T at offset r * size / T), so every pair is
timed in one run.

Invariant: every pair moves the same bytes (each block's whole page, every KV head once) between the
same two processes; a pull runs from the first rank's `start_read` until every rank's reads are DONE.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import time
from typing import Optional, Sequence

import torch

from bench.lib.report import cell, markdown_table
from bench.transfer import pools
from bench.transfer.pools import (
    SHAPES, TIMEOUT_S, PoolShape, allocate_bytes, huge_page_kib, medians_with_memcpy, memory_modes, prefill_child,
    serve_until_stopped)
from pdserve.kv.head_split import heads_split_problem, rank_kv_heads
from pdserve.kv.layout import KVPoolLayout
from pdserve.transfer.transport import PeerInfo, TransferState


PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1))  # (prefill TP, decode TP)
ALLOCATIONS = ("contiguous", "scattered")
PROMPT_TOKENS = (2048, 8192)
SEED = 4321

TP_SHAPES = {
    "llama3-8b": SHAPES["llama3-8b"],  # 32 layers, 8 KV heads x 128, bf16: 2 MiB pages
    # For the end-to-end test: 2 layers, 4 KV heads x 16, fp32 (8 KiB pages).
    "tiny": PoolShape("tiny", group_size=2, num_kv_heads=4, head_dim=16, dtype=torch.float32, num_pool_blocks=64),
}


# ---- cases and their expectations (pure) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TpCase:
    prefill_tp: int
    decode_tp: int
    allocation: str  # "contiguous" or "scattered"

    @property
    def label(self) -> str:
        return f"{self.prefill_tp}->{self.decode_tp}"


parse_pair = pools.parse_pair  # "P:D" TP sizes


def cases(pairs: Sequence[tuple[int, int]], allocations: Sequence[str] = ALLOCATIONS) -> list[TpCase]:
    """Every (pair, allocation), pairs in the order given, 1->1 first (the reference) and duplicates dropped."""
    ordered = [(1, 1)] + [pair for pair in pairs if pair != (1, 1)]
    unique = list(dict.fromkeys(ordered))
    for allocation in allocations:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation {allocation!r} is not one of {ALLOCATIONS}")
    return [TpCase(p, d, allocation) for p, d in unique for allocation in allocations]


def split_problem(num_kv_heads: int, pairs: Sequence[tuple[int, int]]) -> Optional[str]:
    """Why a TP size of these pairs cannot split the heads (this bench wants every rank to own a share)."""
    for size in sorted({size for pair in pairs for size in pair}):
        problem = heads_split_problem(num_kv_heads, size)
        if problem is None and num_kv_heads % size:
            problem = f"{size} ranks and {num_kv_heads} KV heads: this bench needs heads split, not replicated"
        if problem is not None:
            return problem
    return None


def sources_per_rank(prefill_tp: int, decode_tp: int) -> int:
    """Prefill ranks one decode rank reads from (heads split on both sides, no replicas)."""
    return max(1, prefill_tp // decode_tp)


def expected_descriptors(prefill_tp: int, decode_tp: int, num_blocks: int, allocation: str) -> int:
    """Descriptors one request takes, summed over the decode ranks.

    Every decode rank moves one chunk per (block, source rank). Chunks coalesce into one descriptor
    only where consecutive on both sides, which needs whole rank pages on both sides (equal TP) and
    consecutive block ids on both sides (contiguous allocation); then each rank's read is one run.
    A split (P != D) strides the chunk ids of one side (a page holds several chunks), so nothing merges."""
    if num_blocks == 0:
        return 0
    reads = decode_tp * sources_per_rank(prefill_tp, decode_tp)  # one READ per (decode rank, source)
    if allocation == "contiguous" and prefill_tp == decode_tp:
        return reads
    return reads * num_blocks


def block_ids(num_blocks: int, num_pool_blocks: int, allocation: str, seed: int) -> tuple[list[int], list[int]]:
    """(local, remote) block ids of one request, never the null block 0.

    contiguous: 1..n on both sides. scattered: random ids on both sides, redrawn until no pair
    follows its predecessor on both sides (so not one run merges)."""
    if num_blocks > num_pool_blocks - 1:
        raise ValueError(f"{num_blocks} blocks do not fit a pool of {num_pool_blocks} (block 0 is the null block)")
    if allocation == "contiguous":
        ids = list(range(1, num_blocks + 1))
        return ids, list(ids)
    if allocation != "scattered":
        raise ValueError(f"allocation {allocation!r} is not one of {ALLOCATIONS}")
    generator = torch.Generator().manual_seed(seed)
    while True:
        local = (torch.randperm(num_pool_blocks - 1, generator=generator)[:num_blocks] + 1).tolist()
        remote = (torch.randperm(num_pool_blocks - 1, generator=generator)[:num_blocks] + 1).tolist()
        if not any(local[i] == local[i - 1] + 1 and remote[i] == remote[i - 1] + 1 for i in range(1, num_blocks)):
            return local, remote


def rank_layouts(shape: PoolShape, tp: int) -> list[tuple[int, KVPoolLayout]]:
    """(byte offset in the side's buffer, pool layout) of each rank of a TP size: rank r holds its heads'
    slabs of every block, its pool slice at r * (buffer bytes / tp)."""
    layouts = []
    offset = 0
    for rank in range(tp):
        num_heads = rank_kv_heads(shape.num_kv_heads, tp, rank)[1]
        layout = KVPoolLayout(num_blocks=shape.num_pool_blocks, group_size=shape.group_size,
                              block_size=shape.block_size, num_kv_heads=num_heads, head_dim=shape.head_dim,
                              dtype=shape.dtype)
        layouts.append((offset, layout))
        offset += layout.pool_bytes
    return layouts


def add_ratios(rows: list[dict]) -> list[dict]:
    """vs_1to1: GB/s over the 1->1 pull of the same memory, prompt and allocation; and vs_memcpy."""
    return pools.add_ratios(rows, "vs_1to1", lambda r: (r["memory"], r["prompt_tokens"], r["allocation"]),
                            lambda r: (r["prefill_tp"], r["decode_tp"]) == (1, 1))


def coalescing_gains(rows: list[dict]) -> dict[tuple[str, int, str], float]:
    """(memory, prompt tokens, pair) -> GB/s contiguous over GB/s scattered."""
    by_key = {(r["memory"], r["prompt_tokens"], f"{r['prefill_tp']}->{r['decode_tp']}", r["allocation"]): r["pull_gbps"]
              for r in rows}
    return {key[:3]: gbps / by_key[(*key[:3], "scattered")] for key, gbps in by_key.items()
            if key[3] == "contiguous" and by_key.get((*key[:3], "scattered"))}


def format_table(rows: list[dict]) -> str:
    """A markdown table, one line per (memory, prompt, pair, allocation)."""
    return markdown_table(
        ["memory", "tokens", "P->D", "blocks", "descriptors", "MB", "pull ms", "GB/s", "vs 1->1", "vs memcpy",
         "memcpy GB/s", "other CPU"],
        [(r["memory"], r["prompt_tokens"], f"{r['prefill_tp']}->{r['decode_tp']}", r["allocation"], r["descriptors"],
          f"{r['num_bytes'] / 1e6:.1f}", f"{r['pull_s'] * 1e3:.1f}", f"{r['pull_gbps']:.2f}", cell(r.get("vs_1to1")),
          cell(r.get("vs_memcpy")), f"{r['memcpy_gbps']:.2f}", cell(r.get("foreign_cpu_fraction"), ".0%", missing="?"))
         for r in rows])


# ---- the prefill child ---------------------------------------------------------------------------


def serve_ranks(shape: PoolShape, mode: str, tps: Sequence[int], out: multiprocessing.Queue,
                stop: multiprocessing.Event) -> None:
    """Child: one patterned buffer (int64 word i holds i), every prefill TP size's rank pools carved
    from it, each rank registered with its own agent; publishes {tp: [PeerInfo dict per rank]}."""
    from pdserve.transfer.nixl_transport import NixlTransport

    buffer = allocate_bytes(shape.num_pool_blocks * shape.layout().page_bytes, mode)
    torch.arange(buffer.numel() // 8, dtype=torch.int64, out=buffer.view(torch.int64))
    transports, published = [], {}
    for tp in tps:
        infos = []
        for rank, (view, _) in enumerate(rank_views(buffer, shape, tp)):
            transport = NixlTransport(view, f"bench-tp-prefill-{tp}-{rank}-{mode}")
            transports.append(transport)
            infos.append(transport.local_peer_info(f"bench-prefill-tp{tp}", mode).to_dict())
        published[tp] = infos
    out.put(json.dumps(published))
    serve_until_stopped(transports, stop)


def rank_views(buffer: torch.Tensor, shape: PoolShape, tp: int) -> list[tuple[torch.Tensor, int]]:
    """(canonical int8 view [blocks, rank page bytes], byte offset) of each rank's pool inside `buffer`."""
    views = []
    for offset, layout in rank_layouts(shape, tp):
        pool = buffer[offset:offset + layout.pool_bytes].view(layout.dtype).view(layout.shape)
        views.append((layout.canonical_view(pool), offset))
    return views


# ---- the decode side -----------------------------------------------------------------------------


@dataclasses.dataclass
class DecodeWorker:
    """One decode TP size: a transport and a reader per rank, over carved views of the shared buffer."""

    tp: int
    views: list[tuple[torch.Tensor, int]]
    transports: list
    readers: list


def open_decode_workers(buffer: torch.Tensor, shape: PoolShape, mode: str, tps: Sequence[int]) -> dict[int, DecodeWorker]:
    from pdserve.transfer.nixl_transport import NixlTransport
    from pdserve.transfer.ranked_transport import RankReader

    workers = {}
    for tp in tps:
        views = rank_views(buffer, shape, tp)
        transports = [NixlTransport(view, f"bench-tp-decode-{tp}-{rank}-{mode}") for rank, (view, _) in enumerate(views)]
        readers = [RankReader(transport, rank, tp, shape.num_kv_heads, shape.group_size) for rank, transport in enumerate(transports)]
        workers[tp] = DecodeWorker(tp, views, transports, readers)
    return workers


def connect_all(workers: dict[int, DecodeWorker], published: dict[int, list[PeerInfo]],
                pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """Every decode rank of each pair connected to the prefill ranks it reads from; pair -> peer key."""
    keys = {}
    for prefill_tp, decode_tp in pairs:
        ranks = published[prefill_tp]
        for reader in workers[decode_tp].readers:
            reader.connect(ranks[0].key, ranks)
        keys[(prefill_tp, decode_tp)] = ranks[0].key
    deadline_s = time.monotonic() + TIMEOUT_S
    for (prefill_tp, decode_tp), key in keys.items():
        for reader in workers[decode_tp].readers:
            while True:
                state, error = reader.connect_state(key)
                if state is TransferState.DONE:
                    break
                if state is TransferState.FAILED or time.monotonic() > deadline_s:
                    raise RuntimeError(f"{prefill_tp}->{decode_tp} rank {reader.rank}: cannot connect: {error}")
    return keys


class Puller:
    """Pulls one request through every rank of a decode worker; counts descriptors and bytes."""

    def __init__(self, worker: DecodeWorker, peer_key: str, local_ids: list[int], remote_ids: list[int]):
        self.worker, self.peer_key, self.local_ids, self.remote_ids = worker, peer_key, local_ids, remote_ids
        self._next_id = 1
        self.descriptors = self.num_bytes = 0

    def __call__(self) -> float:
        """Seconds from the first rank's start_read until every rank's reads are DONE."""
        handle_id, self._next_id = self._next_id, self._next_id + 1
        readers = self.worker.readers
        started_s = time.perf_counter()
        handles = [reader.start_read(handle_id, self.peer_key, self.local_ids, self.remote_ids) for reader in readers]
        pending = list(readers)
        while pending:
            still = []
            for reader in pending:
                state, error = reader.read_state(handle_id)
                if state is TransferState.FAILED:
                    raise RuntimeError(f"rank {reader.rank}: read failed: {error}")
                if state is TransferState.PENDING:
                    still.append(reader)
            pending = still
            if pending and time.perf_counter() - started_s > TIMEOUT_S:
                raise RuntimeError("read did not finish in time")
        elapsed_s = time.perf_counter() - started_s
        self.descriptors = sum(h.num_blocks for rank_handles in handles for h in rank_handles)
        self.num_bytes = sum(h.num_bytes for rank_handles in handles for h in rank_handles)
        for reader in readers:
            while not reader.release(handle_id):
                pass
        return elapsed_s


def sample_blocks(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int]]:
    pairs = list(zip(local_ids, remote_ids))
    return list(dict.fromkeys(pairs[:4] + pairs[len(pairs) // 2:len(pairs) // 2 + 1] + pairs[-4:]))


def check_landed(shape: PoolShape, case: TpCase, worker: DecodeWorker, puller: Puller) -> int:
    """Pulls once onto zeroed pages and checks every decode rank's sampled pages hold exactly its heads'
    slabs of the source pages: head h of remote block b comes from the prefill rank h * P // K, whose
    buffer word at (rank offset + b * rank page + local head * slab) / 8 + i holds that index.
    Returns the number of slabs checked."""
    samples = sample_blocks(puller.local_ids, puller.remote_ids)
    for view, _ in worker.views:
        for local_id, _ in samples:
            view[local_id].zero_()
    puller()
    prefill = rank_layouts(shape, case.prefill_tp)
    heads_per_prefill_rank = shape.num_kv_heads // case.prefill_tp
    slab_words = shape.layout().slab_bytes // 8
    checked = 0
    for rank, (view, _) in enumerate(worker.views):
        first, count = rank_kv_heads(shape.num_kv_heads, case.decode_tp, rank)
        words = view.view(torch.int64)
        for local_id, remote_id in samples:
            for local_head in range(count):
                head = first + local_head
                source = head * case.prefill_tp // shape.num_kv_heads
                offset, layout = prefill[source]
                start = (offset + remote_id * layout.page_bytes + (head - source * heads_per_prefill_rank)
                         * layout.slab_bytes) // 8
                expected = torch.arange(start, start + slab_words, dtype=torch.int64)
                got = words[local_id, local_head * slab_words:(local_head + 1) * slab_words]
                if not torch.equal(got, expected):
                    raise RuntimeError(f"{case.label} {case.allocation}: decode rank {rank} block {local_id} "
                                       f"head {head} does not hold remote block {remote_id}'s slab")
                checked += 1
    return checked


def measure_mode(shape: PoolShape, mode: str, prompt_tokens: Sequence[int], tp_cases: list[TpCase],
                 reps: int) -> list[dict]:
    """Every prompt and case in one memory mode, against a fresh prefill child."""
    pairs = list(dict.fromkeys((c.prefill_tp, c.decode_tp) for c in tp_cases))
    prefill_tps = sorted({p for p, _ in pairs})
    decode_tps = sorted({d for _, d in pairs})
    with prefill_child(serve_ranks, shape, mode, prefill_tps) as (infos_by_tp, child_pid):
        published = {int(tp): [PeerInfo.from_dict(info) for info in infos] for tp, infos in infos_by_tp.items()}
        buffer = allocate_bytes(shape.num_pool_blocks * shape.layout().page_bytes, mode)
        workers = open_decode_workers(buffer, shape, mode, decode_tps)
        try:
            keys = connect_all(workers, published, pairs)
            return [row for num_tokens in prompt_tokens
                    for row in measure_prompt(shape, mode, num_tokens, tp_cases, workers, keys, reps, child_pid)]
        finally:
            for worker in workers.values():
                for transport in worker.transports:
                    transport.close()


def measure_prompt(shape: PoolShape, mode: str, num_tokens: int, tp_cases: list[TpCase],
                   workers: dict[int, DecodeWorker], keys: dict[tuple[int, int], str], reps: int,
                   child_pid: int) -> list[dict]:
    num_blocks = math.ceil(num_tokens / shape.block_size)
    ids = {allocation: block_ids(num_blocks, shape.num_pool_blocks, allocation, SEED + num_tokens)
           for allocation in {c.allocation for c in tp_cases}}
    pullers = [Puller(workers[c.decode_tp], keys[(c.prefill_tp, c.decode_tp)], *ids[c.allocation]) for c in tp_cases]
    num_bytes = num_blocks * shape.layout().page_bytes
    medians, memcpy_s, foreign = medians_with_memcpy(pullers, num_bytes, mode, reps, child_pid)
    rows = []
    for case, puller, pull_s in zip(tp_cases, pullers, medians):
        expected = expected_descriptors(case.prefill_tp, case.decode_tp, num_blocks, case.allocation)
        if puller.descriptors != expected or puller.num_bytes != num_bytes:
            raise RuntimeError(f"{case.label} {case.allocation}: {puller.descriptors} descriptors / "
                               f"{puller.num_bytes} bytes, expected {expected} / {num_bytes}")
        slabs_checked = check_landed(shape, case, workers[case.decode_tp], puller)
        rows.append({
            "memory": mode, "shape": shape.label, "prompt_tokens": num_tokens, "num_blocks": num_blocks,
            "prefill_tp": case.prefill_tp, "decode_tp": case.decode_tp, "allocation": case.allocation,
            "descriptors": puller.descriptors, "num_bytes": num_bytes, "pull_s": pull_s,
            "pull_gbps": num_bytes / pull_s / 1e9, "memcpy_s": memcpy_s, "memcpy_gbps": num_bytes / memcpy_s / 1e9,
            "slabs_checked": slabs_checked, "foreign_cpu_fraction": foreign, "huge_page_kib": huge_page_kib(),
        })
    return rows


def run(args, parser) -> tuple[PoolShape, dict]:  # noqa: ANN001 - kv_pull's namespace and parser
    """`--mode tp`: every tensor-parallel pair asked for, in every memory mode."""
    max_blocks = math.ceil(max(args.prompt_tokens) / TP_SHAPES[args.shape].block_size)
    # Room to scatter: twice the largest prompt's blocks, plus the null block.
    shape = dataclasses.replace(TP_SHAPES[args.shape], num_pool_blocks=2 * max_blocks + 1)
    problem = split_problem(shape.num_kv_heads, args.pairs)
    if problem is not None:
        parser.error(problem)
    tp_cases = cases(args.pairs)
    rows = add_ratios([row for mode in memory_modes(args)
                       for row in measure_mode(shape, mode, args.prompt_tokens, tp_cases, args.reps)])
    print(f"{shape.label} pool (page {shape.layout().page_bytes:,} B, {shape.num_pool_blocks} blocks a side), "
          f"median of {args.reps} reps")
    print(format_table(rows))
    gains = coalescing_gains(rows)
    print("\ncontiguous / scattered GB/s: " + ", ".join(f"{m} {t} {pair}: {g:.2f}" for (m, t, pair), g in gains.items()))
    return shape, {"pulls": rows, "coalescing_gain": [
        {"memory": m, "prompt_tokens": t, "pair": pair, "contiguous_over_scattered": g}
        for (m, t, pair), g in gains.items()]}
