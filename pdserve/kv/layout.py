"""Tensor layout of the paged KV pool; with the offload tier's host store, the only modules of `kv/` that import torch.

Invariant: block b is one contiguous page of `page_bytes` bytes at byte offset
b * page_bytes, holding K and V of every layer slot of the group that owns it,
heads outermost: one KV head's share of a block (all its layers, K and V) is
one contiguous slab, so any range of heads is one contiguous range of a page.

    pool: [num_blocks, num_kv_heads, G, 2, block_size, head_dim]  (contiguous)

    byte 0        page_bytes    2*page_bytes              b*page_bytes
    +-------------+-------------+-------------+-----+-------------+-----+
    | block 0     | block 1     | block 2     | ... | block b     | ... |
    | (null page) |             |             |     |             |     |
    +-------------+-------------+-------------+-----+------+------+-----+
                                                           |
       one page: num_kv_heads head slabs
       +------------------+------------------+-----+------------------+
       | head 0           | head 1           | ... | head H-1         |
       +------------------+------------------+-----+------------------+
       0                  slab_bytes                  (H-1)*slab_bytes
         |
         +-> one head slab: G slots (slot s holds layer group.layer_ids[s])
             +------------------+------------------+-----+------------------+
             | slot 0           | slot 1           | ... | slot G-1         |
             +------------------+------------------+-----+------------------+
               |
               +-> one slot:  +--------------------+--------------------+
                              | K                  | V                  |
                              +--------------------+--------------------+
                                |
                                +-> K (or V): block_size tokens of head_dim elements,
                                    token t at t*head_bytes (a head's keys are contiguous)

    head_bytes  = head_dim * element_bytes
    kv_bytes    = block_size * head_bytes          (one head, one layer, K or V)
    slot_bytes  = 2 * kv_bytes
    slab_bytes  = G * slot_bytes                   (one head, every layer of the group)
    page_bytes  = num_kv_heads * slab_bytes

    offset(b, h, s, kv, t) = b*page_bytes + h*slab_bytes + s*slot_bytes + kv*kv_bytes + t*head_bytes

Why heads outermost: a tensor-parallel rank holds a range of KV heads, and with
heads outermost its share of a block is one contiguous range whatever the
number of layers, so a decode rank pulls its heads of a remote block as one
descriptor per (block, remote rank) even when P and D split the heads
differently. Within a slab a head's keys for the block's tokens are contiguous,
which is how the attention kernels walk them.

Why one page per block: the pool is registered with NIXL once, as the int8
canonical view [num_blocks, page_bytes] (one memory region), and moving a block
between workers is then exactly one descriptor (base + b*page_bytes,
page_bytes) whatever the number of layers, because the block's K and V for all
its group's layers sit together. A layer-major layout ([layer][block] tensors)
would scatter one block over 2 * G small ranges, one per layer and K/V, and
multiply descriptors (and their per-descriptor overhead) by that factor. Every
group's page has the same shape (trailing unused slots in smaller groups), so a
peer needs only block ids and page_bytes, never per-group strides.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from pdserve.kv.shared_memory import shared_zeros


def huge_page_zeros(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on anonymous memory advised for transparent huge pages.

    UCX moves host memory between processes page by page (it pins every page
    on each transfer), so 2 MiB pages make KV pulls 2-3x faster than 4 KiB ones
    (see docs/benchmarks.md). The tensor keeps the mapping alive."""
    backing = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            backing.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages still work
            pass
    return torch.frombuffer(backing, dtype=dtype)


def page_bytes_for(group_size: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block page (see the module diagram)."""
    return group_size * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


def num_blocks_for_budget(kv_memory_bytes: int, page_bytes: int) -> int:
    """Number of whole pages (the null block included) that fit in `kv_memory_bytes`."""
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
    num_blocks = kv_memory_bytes // page_bytes
    if num_blocks < 2:
        raise ValueError(
            f"kv memory of {kv_memory_bytes} bytes holds {num_blocks} pages of {page_bytes} bytes;"
            " need the null block plus at least one more"
        )
    return num_blocks


@dataclass(frozen=True, slots=True)
class KVPoolLayout:
    """Geometry of the pool tensor; the same on every worker that shares KV."""

    num_blocks: int
    group_size: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (the null block plus one), got {self.num_blocks}")
        for name in ("group_size", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        """Bytes of K (or of V) of one head of one layer slot of one block."""
        return self.block_size * self.head_dim * self.element_bytes

    @property
    def slot_bytes(self) -> int:
        return 2 * self.kv_bytes

    @property
    def slab_bytes(self) -> int:
        """Bytes of one KV head's share of a page (every slot, K and V)."""
        return self.group_size * self.slot_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.slab_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.group_size, 2, self.block_size, self.head_dim)

    def byte_offset(self, block_id: int, slot: int, kv: int, token: int, head: int = 0) -> int:
        """Byte offset of one head vector inside the pool (the diagram's formula)."""
        head_bytes = self.head_dim * self.element_bytes
        return (block_id * self.page_bytes + head * self.slab_bytes + slot * self.slot_bytes + kv * self.kv_bytes
                + token * head_bytes)

    def head_range_bytes(self, first_head: int, num_heads: int) -> tuple[int, int]:
        """(offset inside a page, length) of heads [first_head, first_head + num_heads): one range."""
        if first_head < 0 or num_heads < 1 or first_head + num_heads > self.num_kv_heads:
            raise ValueError(f"heads {first_head}..{first_head + num_heads - 1} outside 0..{self.num_kv_heads - 1}")
        return first_head * self.slab_bytes, num_heads * self.slab_bytes

    def allocate(self, device: torch.device | str, shared: bool = False) -> torch.Tensor:
        """`shared`: host memory another process can map (an isolated NIXL agent's; see
        pdserve/kv/shared_memory.py). Ignored on a GPU."""
        # Zeros, not empty: the null page is read under masks, and garbage NaNs
        # would survive a zero attention weight (0 * NaN = NaN).
        if torch.device(device).type == "cpu" and shared:
            return torch.frombuffer(shared_zeros(self.pool_bytes), dtype=self.dtype).view(self.shape)
        if torch.device(device).type == "cpu":
            return huge_page_zeros(self.pool_bytes, self.dtype).view(self.shape)
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def layer_view(self, pool: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer slot, each a strided view
        [num_blocks, block_size, num_kv_heads, head_dim] indexed by block id (head_dim contiguous,
        tokens head_dim apart, heads a slab apart)."""
        self._check_pool(pool)
        if not 0 <= slot < self.group_size:
            raise ValueError(f"slot {slot} outside 0..{self.group_size - 1}")
        return pool[:, :, slot, 0].transpose(1, 2), pool[:, :, slot, 1].transpose(1, 2)

    def canonical_view(self, pool: torch.Tensor) -> torch.Tensor:
        """int8 [num_blocks, page_bytes] over the same storage (no copy): the
        region registered with the transfer engine, one row per descriptor."""
        self._check_pool(pool)
        return pool.view(torch.int8).view(self.num_blocks, self.page_bytes)

    def _check_pool(self, pool: torch.Tensor) -> None:
        if tuple(pool.shape) != self.shape or pool.dtype != self.dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match layout {self.shape} {self.dtype}")
        if not pool.is_contiguous():
            raise ValueError("the pool tensor must be contiguous for its pages to be contiguous")
