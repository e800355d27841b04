"""KV pulls between block sizes (`--mode block-size`): a decode pool of D-token pages pulls one
prompt from a prefill pool of P-token pages (16->16, 16->32, 32->16) over NIXL between two processes,
direct (one descriptor per (unit, row): pdserve/transfer/token_units.py) or staged (one descriptor
per remote run into a staging buffer, then a local copy), against 16->16 and a memcpy.

Invariant: every case of a prompt moves the same bytes (every token of every row once) between the
same two processes, scattered block ids on both sides; landed bytes are checked token by token.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import time
from typing import Optional, Sequence

import numpy as np
import torch

from bench.lib.report import cell, markdown_table
from bench.transfer import pools
from bench.transfer.pools import (
    SHAPES, TIMEOUT_S, PoolShape, allocate_bytes, huge_page_kib, medians_with_memcpy, memory_modes, prefill_child,
    serve_until_stopped, time_read)
from pdserve.transfer.descriptor_runs import choose_runs
from pdserve.transfer.token_units import UnitGeometry, unit_chunk_ids, unit_geometry
from pdserve.transfer.transport import PeerInfo, TransferState

PAIRS = ((16, 16), (16, 32), (32, 16))  # (prefill block size, decode block size)
PROMPT_TOKENS = (2048, 8192)
SEED = 2020
TAG_SHIFT = 40  # int64 word i of the pool of prefill block size b holds i + (b << TAG_SHIFT)

BS_SHAPES = {
    "smollm2": SHAPES["smollm2"],  # 30 slots, 3 KV heads x 64, fp32: 180 rows of 4 KiB units
    "llama3-8b": SHAPES["llama3-8b"],  # 32 slots, 8 KV heads x 128, bf16: 512 rows of 4 KiB units
    # For the end-to-end test: 2 slots, 2 KV heads x 16, fp32 (8 rows of 1 KiB units).
    "tiny": PoolShape("tiny", group_size=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, num_pool_blocks=0),
}


# ---- cases and ids (pure) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    prefill_block: int
    decode_block: int
    read: str  # "pages" (equal block sizes: one descriptor per page), "direct" or "staged"

    @property
    def label(self) -> str:
        return f"{self.prefill_block}->{self.decode_block}"


def parse_pair(text: str) -> tuple[int, int]:
    """"P:D" (or "P->D") -> (P, D); ValueError unless one block size divides the other."""
    prefill, decode = pools.parse_pair(text)
    small, large = sorted((prefill, decode))
    if large % small:
        raise ValueError(f"pair {text!r}: one block size must divide the other")
    return prefill, decode


def cases(pairs: Sequence[tuple[int, int]]) -> list[Case]:
    """The 16->16 page pull first (the reference), then every other pair, direct and staged."""
    ordered = list(dict.fromkeys([(16, 16), *pairs]))
    return [Case(p, d, read) for p, d in ordered for read in (("pages",) if p == d else ("direct", "staged"))]


def pool_blocks(max_tokens: int, block_size: int) -> int:
    """Pages a side's pool holds for one block size: the largest prompt's, half again as many to
    scatter in, and the null block."""
    needed = math.ceil(max_tokens / block_size)
    return needed + needed // 2 + 1


def scattered_ids(count: int, num_pool_blocks: int, generator: torch.Generator) -> list[int]:
    """`count` distinct block ids in random order, never the null block 0."""
    return (torch.randperm(num_pool_blocks - 1, generator=generator)[:count] + 1).tolist()


def chunk_pairs(geometry: UnitGeometry, prefill_ids: Sequence[int], decode_ids: Sequence[int], prefill_block: int,
                decode_block: int, num_tokens: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) chunk ids of a prompt: unit k covers tokens [k*u, (k+1)*u), u the smaller
    block size, and each of its `rows` rows is one chunk pair."""
    unit = min(prefill_block, decode_block)
    starts = np.arange(0, num_tokens, unit)
    remote_units = np.asarray(prefill_ids)[starts // prefill_block] * (prefill_block // unit) \
        + (starts % prefill_block) // unit
    local_units = np.asarray(decode_ids)[starts // decode_block] * (decode_block // unit) \
        + (starts % decode_block) // unit
    return unit_chunk_ids(geometry.local, local_units, 0, rows), unit_chunk_ids(geometry.remote, remote_units, 0, rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """vs_pages: GB/s over the 16->16 page pull of the same memory and prompt; and vs_memcpy."""
    return pools.add_ratios(rows, "vs_pages", lambda r: (r["memory"], r["prompt_tokens"]),
                            lambda r: r["read"] == "pages")


def format_table(rows: list[dict]) -> str:
    return markdown_table(
        ["memory", "tokens", "P->D", "read", "descriptors", "MB", "pull ms", "GB/s", "vs 16->16", "vs memcpy",
         "memcpy GB/s", "auto picks", "other CPU"],
        [(r["memory"], r["prompt_tokens"], f"{r['prefill_block']}->{r['decode_block']}", r["read"], r["descriptors"],
          f"{r['num_bytes'] / 1e6:.1f}", f"{r['pull_s'] * 1e3:.1f}", f"{r['pull_gbps']:.2f}", cell(r.get("vs_pages")),
          cell(r.get("vs_memcpy")), f"{r['memcpy_gbps']:.2f}", r["auto_picks"],
          cell(r.get("foreign_cpu_fraction"), ".0%", missing="?")) for r in rows])


# ---- pools ------------------------------------------------------------------------------------------


def block_shape(shape: PoolShape, block_size: int, max_tokens: int) -> PoolShape:
    return dataclasses.replace(shape, block_size=block_size, num_pool_blocks=pool_blocks(max_tokens, block_size))


def rows_of(shape: PoolShape) -> int:
    """Rows of a page: one per (KV head, layer slot, K|V)."""
    return shape.num_kv_heads * shape.group_size * 2


def token_bytes(shape: PoolShape) -> int:
    """Bytes one token takes in a page, whatever the block size: one head vector per row."""
    return rows_of(shape) * shape.head_dim * shape.dtype.itemsize


def serve_pools(shape: PoolShape, mode: str, block_sizes: Sequence[int], max_tokens: int,
                out: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """Child: one patterned pool per prefill block size, each with its own agent; publishes {block size: PeerInfo}."""
    from pdserve.transfer.nixl_transport import NixlTransport

    transports, published = [], {}
    for block_size in block_sizes:
        layout = block_shape(shape, block_size, max_tokens).layout()
        buffer = allocate_bytes(layout.pool_bytes, mode)
        torch.arange(buffer.numel() // 8, dtype=torch.int64, out=buffer.view(torch.int64))
        buffer.view(torch.int64).add_(block_size << TAG_SHIFT)
        transport = NixlTransport(buffer.view(layout.num_blocks, layout.page_bytes),
                                  f"bench-bs-prefill-{block_size}-{mode}")
        transports.append(transport)
        published[block_size] = transport.local_peer_info(f"bench-prefill-block{block_size}", mode).to_dict()
    out.put(json.dumps(published))
    serve_until_stopped(transports, stop)


@dataclasses.dataclass
class Reader:
    """One case's transport on a decode pool, connected to the prefill pool it reads from."""

    case: Case
    transport: object  # NixlTransport
    key: str
    view: torch.Tensor  # the decode pool, int8 [blocks, page bytes]
    geometry: Optional[UnitGeometry]  # None for whole pages
    descriptors: int = 0

    def pull(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> float:
        """Seconds from start_read until DONE (descriptor selection and the staged copy included)."""
        elapsed_s, self.descriptors = time_read(self.transport, self.key, local_ids, remote_ids)
        return elapsed_s


def open_reader(case: Case, view: torch.Tensor, peer: PeerInfo, rows: int, name: str) -> Reader:
    """A transport on `view` reading in the case's mode, connected to `peer`: whole pages at equal block
    sizes, else in chunks of one unit of one row."""
    from pdserve.transfer.nixl_transport import NixlTransport

    geometry = None if case.read == "pages" else unit_geometry(view.shape[1], rows, peer.page_bytes, rows)
    chunk_bytes = geometry.unit_bytes if geometry is not None else None
    transport = NixlTransport(view, name, read_mode="staged" if case.read == "staged" else "direct")
    key = transport.begin_connect(peer, chunk_bytes=chunk_bytes)
    deadline_s = time.monotonic() + TIMEOUT_S
    while (state := transport.poll_connect(key)) is TransferState.PENDING and time.monotonic() < deadline_s:
        time.sleep(0.001)
    if state is not TransferState.DONE:
        transport.close()
        raise RuntimeError(f"{case}: cannot connect in chunks of {chunk_bytes}: {transport.connect_failure(key)}")
    return Reader(case, transport, key, view, geometry)


# ---- measurements -----------------------------------------------------------------------------------


def check_landed(shape: PoolShape, reader: Reader, prefill_pages: dict[int, int], prefill_ids: list[int],
                 decode_ids: list[int], num_tokens: int, local_ids, remote_ids) -> int:
    """Pulls once onto zeroed sampled pages and checks every token of every row of them against the
    prefill pattern. Returns the number of decode pages checked."""
    case, rows = reader.case, rows_of(shape)
    decode_block, prefill_block = case.decode_block, case.prefill_block
    samples = sorted(set(range(min(3, len(decode_ids)))) | {len(decode_ids) // 2}
                     | set(range(max(0, len(decode_ids) - 3), len(decode_ids))))
    for j in samples:
        reader.view[decode_ids[j]].zero_()
    reader.pull(local_ids, remote_ids)
    page_words = prefill_pages[prefill_block] // 8
    words = reader.view.view(torch.int64)
    for j in samples:
        got = words[decode_ids[j]].view(rows, decode_block, -1)
        for offset in range(0, decode_block, min(decode_block, prefill_block)):
            token = j * decode_block + offset
            if token >= num_tokens:
                break
            source, source_offset = divmod(token, prefill_block)
            page = (torch.arange(page_words, dtype=torch.int64) + prefill_ids[source] * page_words
                    + (prefill_block << TAG_SHIFT)).view(rows, prefill_block, -1)
            span = min(decode_block, prefill_block)
            if not torch.equal(got[:, offset:offset + span], page[:, source_offset:source_offset + span]):
                raise RuntimeError(f"{case} {case.read}: decode page {decode_ids[j]} tokens {offset}.. do not hold "
                                   f"prefill page {prefill_ids[source]} tokens {source_offset}..")
    return len(samples)


def measure_mode(shape: PoolShape, mode: str, prompt_tokens: Sequence[int], bs_cases: list[Case],
                 reps: int) -> list[dict]:
    """Every prompt and case in one memory mode, against a fresh prefill child."""
    max_tokens = max(prompt_tokens)
    views = {}
    for size in sorted({c.decode_block for c in bs_cases}):
        layout = block_shape(shape, size, max_tokens).layout()
        views[size] = allocate_bytes(layout.pool_bytes, mode).view(layout.num_blocks, layout.page_bytes)
    readers: list[Reader] = []
    with prefill_child(serve_pools, shape, mode, sorted({c.prefill_block for c in bs_cases}), max_tokens) as (
            infos, child_pid):
        try:
            published = {int(size): PeerInfo.from_dict(info) for size, info in infos.items()}
            for index, case in enumerate(bs_cases):
                readers.append(open_reader(case, views[case.decode_block], published[case.prefill_block],
                                           rows_of(shape), f"bench-bs-decode-{index}-{mode}"))
            pages = {size: info.page_bytes for size, info in published.items()}
            return [row for num_tokens in prompt_tokens
                    for row in measure_prompt(shape, mode, num_tokens, max_tokens, readers, pages, reps, child_pid)]
        finally:
            for reader in readers:
                reader.transport.close()


def measure_prompt(shape: PoolShape, mode: str, num_tokens: int, max_tokens: int, readers: list[Reader],
                   pages: dict[int, int], reps: int, child_pid: int) -> list[dict]:
    from pdserve.transfer.descriptor_runs import DEFAULT_STAGED_DESCRIPTOR_FACTOR, DEFAULT_STAGED_MAX_DESCRIPTOR_BYTES

    generator = torch.Generator().manual_seed(SEED + num_tokens)
    ids = {}  # block size -> (prefill ids, decode ids) of this prompt; pools of one block size match
    for size in sorted({r.case.prefill_block for r in readers} | {r.case.decode_block for r in readers}):
        count, num_pool = math.ceil(num_tokens / size), pool_blocks(max_tokens, size)
        ids[size] = scattered_ids(count, num_pool, generator), scattered_ids(count, num_pool, generator)
    rows_per_page = rows_of(shape)
    plans = []
    for reader in readers:
        case = reader.case
        prefill_ids, decode_ids = ids[case.prefill_block][0], ids[case.decode_block][1]
        if reader.geometry is None:
            plans.append((decode_ids, prefill_ids, prefill_ids, decode_ids))
        else:
            local, remote = chunk_pairs(reader.geometry, prefill_ids, decode_ids, case.prefill_block,
                                        case.decode_block, num_tokens, rows_per_page)
            plans.append((local, remote, prefill_ids, decode_ids))
    num_bytes = num_tokens * token_bytes(shape)
    pulls = [(lambda reader=reader, plan=plan: reader.pull(plan[0], plan[1])) for reader, plan in zip(readers, plans)]
    medians, memcpy_s, foreign = medians_with_memcpy(pulls, num_bytes, mode, reps, child_pid)
    rows = []
    for reader, plan, pull_s in zip(readers, plans, medians):
        local, remote, prefill_ids, decode_ids = plan
        checked = check_landed(shape, reader, pages, prefill_ids, decode_ids, num_tokens, local, remote)
        auto = "pages" if reader.geometry is None else \
            ("staged" if choose_runs(local, remote, reader.geometry.unit_bytes, "auto", DEFAULT_STAGED_DESCRIPTOR_FACTOR,
                                     DEFAULT_STAGED_MAX_DESCRIPTOR_BYTES)[1] is not None else "direct")
        rows.append({
            "memory": mode, "shape": shape.label, "prompt_tokens": num_tokens, "prefill_block": reader.case.prefill_block,
            "decode_block": reader.case.decode_block, "read": reader.case.read, "descriptors": reader.descriptors,
            "num_bytes": num_bytes, "pull_s": pull_s, "pull_gbps": num_bytes / pull_s / 1e9, "memcpy_s": memcpy_s,
            "memcpy_gbps": num_bytes / memcpy_s / 1e9, "auto_picks": auto, "pages_checked": checked,
            "staging_bytes": reader.transport.staging_bytes, "foreign_cpu_fraction": foreign,
            "huge_page_kib": huge_page_kib(),
        })
    return rows


def run(args, parser) -> tuple[PoolShape, dict]:  # noqa: ANN001 - kv_pull's namespace and parser
    """`--mode block-size`: every block-size pair asked for, in every memory mode."""
    bs_cases = cases(args.pairs)
    largest = max(size for case in bs_cases for size in (case.prefill_block, case.decode_block))
    if any(tokens < 1 or tokens % largest for tokens in args.prompt_tokens):
        parser.error(f"--prompt-tokens must be multiples of the largest block size, {largest}")
    shape = BS_SHAPES[args.shape]
    rows = add_ratios([row for mode in memory_modes(args)
                       for row in measure_mode(shape, mode, args.prompt_tokens, bs_cases, args.reps)])
    print(f"{shape.label}: {rows_of(shape)} rows a page, median of {args.reps} reps, scattered block ids")
    print(format_table(rows))
    return shape, {"pulls": rows}
