"""Tensor layout of the paged KV pool; with the offload tier's host store, the only modules of `kv/` that import torch.

Invariant: block b is one contiguous page of `page_bytes` bytes at byte offset
b * page_bytes. An attention group's page holds K and V of every layer slot of
the group, heads outermost, in its first `kv_page_bytes`: one KV head's share of
a block (all its layers, K and V) is one contiguous slab, so any range of heads
is one contiguous range of a page. A state group's page holds one request's
recurrent state of every layer slot of the group. Without state layers (or when
the state fits the attention page) page_bytes == kv_page_bytes and the pool is
the attention tensor below; when a state layer needs more, every page grows to
`padded_page_bytes`, the pool is bytes [num_blocks, page_bytes] and the same
views are strided over it (attention pages then end in padding).

    pool: [num_blocks, num_kv_heads, G, 2, block_size, head_dim]  (contiguous; unpadded)
    pool: int8 [num_blocks, page_bytes]                            (padded)

    byte 0        page_bytes    2*page_bytes              b*page_bytes
    +-------------+-------------+-------------+-----+-------------+-----+
    | block 0     | block 1     | block 2     | ... | block b     | ... |
    | (null page) |             |             |     |             |     |
    +-------------+-------------+-------------+-----+------+------+-----+
                                                           |
       one attention page: num_kv_heads head slabs (then padding, if padded)
       +------------------+------------------+-----+------------------+---------+
       | head 0           | head 1           | ... | head H-1         | padding |
       +------------------+------------------+-----+------------------+---------+
       0                  slab_bytes                  (H-1)*slab_bytes  kv_page_bytes
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
                                    element: the pool's dtype (--kv-cache-dtype), 4 bytes
                                    float32, 2 bytes bfloat16 or float16; one dtype per pool

       one state page: L layer slots of state_bytes each, in the spec's dtype (then padding)
       +---------------------+---------------------+-----+---------------------+---------+
       | slot 0              | slot 1              | ... | slot L-1            | padding |
       +---------------------+---------------------+-----+---------------------+---------+
       0                     state_bytes                                      L*state_bytes
         |
         +-> one slot: +--------------------------------+-------------------------------+
                       | conv window                    | recurrent state               |
                       | [conv_channels, conv_window]   | recurrent_shape (row-major)   |
                       | (a channel's window contiguous,| e.g. [heads, key_dim,         |
                       |  oldest input first)           |       value_dim]              |
                       +--------------------------------+-------------------------------+
                       0                                conv_bytes                      state_bytes

    head_bytes  = head_dim * element_bytes         (element_bytes = 4 float32, 2 bfloat16/float16)
    kv_bytes    = block_size * head_bytes          (one head, one layer, K or V)
    slot_bytes  = 2 * kv_bytes
    slab_bytes  = G * slot_bytes                   (one head, every layer of the group)
    kv_page_bytes = num_kv_heads * slab_bytes
    page_bytes  = padded_page_bytes or kv_page_bytes   (kv/page_geometry.py decides)

    offset(b, h, s, kv, t) = b*page_bytes + h*slab_bytes + s*slot_bytes + kv*kv_bytes + t*head_bytes
    state offset(b, s)     = b*page_bytes + s*state_bytes      (conv window, then recurrent state)

Why heads outermost: a tensor-parallel rank holds a range of KV heads, and with
heads outermost its share of a block is one contiguous range whatever the
number of layers, so a decode rank pulls its heads of a remote block as one
descriptor per (block, remote rank) even when P and D split the heads
differently. Within a slab a head's keys for the block's tokens are contiguous,
which is how the attention kernels walk them.

A state page under tensor parallelism: a rank's pool holds its own share, slot-outermost as
above, its spec describing that share (models/state_sharding.py): per slot, its rows of each conv
part, then its heads of the recurrent state. A pull between different splits moves each rank's
share part by part, a few byte ranges per slot (transfer/state_ranges.py). A head-group-outermost
page (each head group's conv channels and recurrent rows of every slot together) would make any
range of head groups one range of the page; it is not used: every split would then need the
layout cut for the largest one, for a saving of a few descriptors per state layer.

Why one page per block: the pool is registered with NIXL once, as the int8
canonical view [num_blocks, page_bytes] (one memory region), and moving a block
between workers is then exactly one descriptor (base + b*page_bytes,
page_bytes) whatever the number of layers, because the block's K and V for all
its group's layers sit together. A layer-major layout ([layer][block] tensors)
would scatter one block over 2 * G small ranges, one per layer and K/V, and
multiply descriptors (and their per-descriptor overhead) by that factor. Every
group's page has the same size (trailing unused slots in smaller groups, padding
after the data of the smaller kind of page), so a peer needs only block ids and
page_bytes, never per-group strides.

A 16-bit pool (--kv-cache-dtype bfloat16 or float16) has the same layout with 2-byte elements:
pages of half the bytes, twice the blocks in the same memory, and the native decode attention
widens each element to float32 in registers. Peers compare the element type in the handshake
(pd/handshake.py), so a page is never read as another type.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.kv.shared_memory import shared_zeros
from pdserve.kv.specs import KVGroup, KVGroupPlan, LayerSpec, RecurrentStateSpec, plan_groups


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


def attention_layer_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One attention layer's K and V of one block: what `plan_groups` needs to size state pages."""
    return page_bytes_for(1, block_size, num_kv_heads, head_dim, dtype)


def plan_for_model(layer_specs: Sequence[LayerSpec], block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> KVGroupPlan:
    """The group plan of a model's layers: attention grouped as always, recurrent-state layers in
    state groups sized against the attention page (`plan_groups`). One rule for every rank."""
    return plan_groups(layer_specs, attention_layer_bytes(block_size, num_kv_heads, head_dim, dtype))


def plan_page_bytes(plan: KVGroupPlan, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of every page of a pool for `plan`, padding included: what `num_blocks_for_budget` takes."""
    return plan.padded_page_bytes or page_bytes_for(plan.group_size, block_size, num_kv_heads, head_dim, dtype)


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


STATE_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVPoolLayout:
    """Geometry of the pool tensor; the same on every worker that shares KV."""

    num_blocks: int
    group_size: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    padded_page_bytes: int = 0  # pages larger than the attention page (state layers need more); 0: not padded

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (the null block plus one), got {self.num_blocks}")
        for name in ("group_size", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.padded_page_bytes and (self.padded_page_bytes < self.kv_page_bytes
                                       or self.padded_page_bytes % self.element_bytes):
            raise ValueError(f"padded_page_bytes {self.padded_page_bytes} must be 0 or a multiple of "
                             f"{self.element_bytes} of at least the attention page's {self.kv_page_bytes}")

    @classmethod
    def for_plan(cls, plan: KVGroupPlan, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> "KVPoolLayout":
        """The layout of a pool for `plan`, its pages padded when the plan's state needs them larger."""
        return cls(num_blocks, plan.group_size, block_size, num_kv_heads, head_dim, dtype, plan.padded_page_bytes)

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
    def kv_page_bytes(self) -> int:
        """Bytes of an attention page's data: the first kv_page_bytes of every page."""
        return self.num_kv_heads * self.slab_bytes

    @property
    def page_bytes(self) -> int:
        return self.padded_page_bytes or self.kv_page_bytes

    @property
    def is_padded(self) -> bool:
        """Whether the pool is bytes with strided attention views (pages larger than the attention page)."""
        return self.page_bytes != self.kv_page_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the pool tensor `allocate` returns (dtype `pool_dtype`)."""
        if self.is_padded:
            return (self.num_blocks, self.page_bytes)
        return (self.num_blocks, self.num_kv_heads, self.group_size, 2, self.block_size, self.head_dim)

    @property
    def pool_dtype(self) -> torch.dtype:
        return torch.int8 if self.is_padded else self.dtype

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
        dtype = self.pool_dtype
        if torch.device(device).type == "cpu" and shared:
            return torch.frombuffer(shared_zeros(self.pool_bytes), dtype=dtype).view(self.shape)
        if torch.device(device).type == "cpu":
            return huge_page_zeros(self.pool_bytes, dtype).view(self.shape)
        return torch.zeros(self.shape, dtype=dtype, device=device)

    def layer_view(self, pool: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer slot, each a strided view
        [num_blocks, block_size, num_kv_heads, head_dim] indexed by block id (head_dim contiguous,
        tokens head_dim apart, heads a slab apart)."""
        self._check_pool(pool)
        if not 0 <= slot < self.group_size:
            raise ValueError(f"slot {slot} outside 0..{self.group_size - 1}")
        if not self.is_padded:
            return pool[:, :, slot, 0].transpose(1, 2), pool[:, :, slot, 1].transpose(1, 2)
        pages = self._typed_pages(pool, self.dtype)
        item = self.element_bytes
        size = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        stride = (pages.stride(0), self.head_dim, self.slab_bytes // item, 1)
        first = pages.storage_offset() + slot * self.slot_bytes // item
        return (pages.as_strided(size, stride, first), pages.as_strided(size, stride, first + self.kv_bytes // item))

    def state_views(self, pool: torch.Tensor, group: KVGroup, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [num_blocks, conv_channels, conv_window], recurrent [num_blocks, *recurrent_shape]) of
        one layer slot of a state group: strided views in the spec's dtype, indexed by page id."""
        self._check_pool(pool)
        spec = group.spec
        if not isinstance(spec, RecurrentStateSpec):
            raise ValueError(f"group {group.group_id} holds no recurrent state")
        if not 0 <= slot < len(group.layer_ids) or (slot + 1) * spec.state_bytes > self.page_bytes:
            raise ValueError(f"slot {slot} outside group {group.group_id}'s {len(group.layer_ids)} state slots")
        dtype = STATE_TORCH_DTYPES[spec.dtype]
        pages = self._typed_pages(pool, dtype)
        first = pages.storage_offset() + slot * spec.state_bytes // dtype.itemsize
        page_stride = pages.stride(0)
        conv = pages.as_strided((self.num_blocks, spec.conv_channels, spec.conv_window),
                                (page_stride, spec.conv_window, 1), first)
        inner = [1] * len(spec.recurrent_shape)
        for dim in range(len(spec.recurrent_shape) - 2, -1, -1):
            inner[dim] = inner[dim + 1] * spec.recurrent_shape[dim + 1]
        recurrent = pages.as_strided((self.num_blocks, *spec.recurrent_shape), (page_stride, *inner),
                                     first + spec.conv_elements)
        return conv, recurrent

    def canonical_view(self, pool: torch.Tensor) -> torch.Tensor:
        """int8 [num_blocks, page_bytes] over the same storage (no copy): the
        region registered with the transfer engine, one row per descriptor."""
        self._check_pool(pool)
        return pool.view(torch.int8).view(self.num_blocks, self.page_bytes)

    def _typed_pages(self, pool: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[num_blocks, page_bytes / itemsize] in `dtype` over the pool's storage."""
        if self.page_bytes % dtype.itemsize:
            raise ValueError(f"pages of {self.page_bytes} bytes cannot be viewed as {dtype}")
        return self.canonical_view(pool).view(dtype)

    def _check_pool(self, pool: torch.Tensor) -> None:
        if tuple(pool.shape) != self.shape or pool.dtype != self.pool_dtype:
            raise ValueError(f"pool {tuple(pool.shape)} {pool.dtype} does not match layout {self.shape} "
                             f"{self.pool_dtype}")
        if not pool.is_contiguous():
            raise ValueError("the pool tensor must be contiguous for its pages to be contiguous")
