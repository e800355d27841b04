"""One page size for every KV group: how attention pages and recurrent-state pages share one pool.

Invariant: every page of the pool has `page_bytes` bytes; an attention page's data is its first
`kv_page_bytes`, and a state page's data is its first `layers_per_group * state_bytes` (one
slot per layer); the rest of a page is padding nobody reads. Torch-free: the caller turns its
dtypes into byte counts.

    kv_page_bytes >= state_bytes: the page stays the attention page, a state group takes
    floor(kv_page_bytes / state_bytes) layers (at most its bucket)

        attention page | K/V of G layers .................................. |
        state page     | layer 0 | layer 1 | ... | layer L-1 | padding       |

    kv_page_bytes < state_bytes: the page grows to one layer's state (rounded up to
    PAGE_ALIGN_BYTES), one layer per state group, attention pages padded

        attention page | K/V of G layers | padding .......................... |
        state page     | layer 0 ................................ | padding   |

A larger block size grows the attention page (it is linear in block_size) and fills the
padding: `block_size_factor` says by how much.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# A grown page is rounded up to this many bytes, so every page (a NIXL descriptor, a tier slot)
# starts at an address as aligned as the pool's base, whatever the state's element size.
PAGE_ALIGN_BYTES = 256


@dataclass(frozen=True, slots=True)
class PageGeometry:
    """The pool's page size and how a state group fills a page (one entry per state bucket)."""

    kv_page_bytes: int  # the attention page: group_size layers of K and V of one block
    page_bytes: int  # every page of the pool
    state_bytes: tuple[int, ...]  # per state bucket: one layer's state
    layers_per_group: tuple[int, ...]  # per state bucket: layer slots a state group holds

    @property
    def is_padded(self) -> bool:
        """Whether attention pages carry padding (the page grew for a state layer)."""
        return self.page_bytes > self.kv_page_bytes

    @property
    def attention_padding_fraction(self) -> float:
        """Share of each attention page that holds nothing."""
        return 1.0 - self.kv_page_bytes / self.page_bytes

    @property
    def state_padding_fractions(self) -> tuple[float, ...]:
        """Per state bucket: share of each of its pages that holds nothing."""
        return tuple(1.0 - layers * size / self.page_bytes
                     for size, layers in zip(self.state_bytes, self.layers_per_group))

    @property
    def block_size_factor(self) -> int:
        """How many times the block size it takes for the attention page to fill the page
        (1 when attention pages are not padded)."""
        return -(-self.page_bytes // self.kv_page_bytes)

    def describe(self) -> str:
        """One line for the worker's start-up log: what padding costs and how to avoid it."""
        state = ", ".join(f"{layers} layer(s) of {size} bytes ({fraction:.0%} padding)" for size, layers, fraction
                          in zip(self.state_bytes, self.layers_per_group, self.state_padding_fractions))
        line = (f"KV pages of {self.page_bytes} bytes: attention pages use {self.kv_page_bytes} "
                f"({self.attention_padding_fraction:.0%} padding); state pages hold {state or 'nothing'}")
        if self.is_padded:
            line += f"; a --block-size {self.block_size_factor}x larger would fill the attention pages"
        return line


def plan_page(kv_page_bytes: int, state_buckets: Sequence[tuple[int, int]]) -> PageGeometry:
    """The page size and each state bucket's layers per group.

    `state_buckets`: (one layer's state bytes, number of layers) per spec of state layers.
    The page is the attention page unless some state layer does not fit in it; then it grows
    to the largest layer's state, rounded up to PAGE_ALIGN_BYTES. Each bucket then packs as
    many layers as the page holds, at most all of them.
    """
    if kv_page_bytes < 1:
        raise ValueError(f"kv_page_bytes must be >= 1, got {kv_page_bytes}")
    if any(size < 1 or count < 1 for size, count in state_buckets):
        raise ValueError(f"malformed state buckets {list(state_buckets)}")
    page_bytes = kv_page_bytes
    largest = max((size for size, _ in state_buckets), default=0)
    if largest > kv_page_bytes:
        page_bytes = -(-largest // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES
    layers = tuple(min(page_bytes // size, count) for size, count in state_buckets)
    return PageGeometry(kv_page_bytes, page_bytes, tuple(size for size, _ in state_buckets), layers)
