"""Layer specs (attention, recurrent state) and their grouping into KV groups of one page each.

Invariant: every cache-holding layer lands in exactly one group, every group holds
layers of one spec only, all attention groups have the same slot count `group_size`
(a group with fewer layers leaves its trailing slots unused), and every page has the
same size (kv/page_geometry.py: state groups hold as many layers as a page fits), so
one block id names one page of identical size whichever group owns it. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from pdserve.kv.page_geometry import PageGeometry, plan_page


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every query attends to every earlier key."""

    def needed_from(self, position: int) -> int:
        """First key position a query at `position` attends to."""
        return 0

    def max_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Most blocks one sequence of `num_tokens` tokens holds in a group of this spec."""
        return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """A query at position p attends to keys in [p - window_tokens + 1, p]
    (the window counts the query itself, as Hugging Face's masks do)."""

    window_tokens: int

    def needed_from(self, position: int) -> int:
        return max(0, position - self.window_tokens + 1)

    def max_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """The live window spans at most ceil(W / block_size) + 1 blocks (it
        rarely starts on a block boundary); older blocks are released."""
        return min(-(-num_tokens // block_size), -(-self.window_tokens // block_size) + 1)


AttentionSpec = Union[FullAttentionSpec, SlidingWindowSpec]


# Bytes per element of the dtypes a recurrent state may be kept in (named, so this module stays torch-free).
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """A layer that keeps a fixed-size state per request instead of K/V per token (Gated
    DeltaNet, Mamba2): the last `conv_window` inputs of its short causal convolution, and a
    recurrent tensor. Shapes are one rank's share when the model is split.

        conv window:     [conv_channels, conv_window]   (oldest input first)
        recurrent state: recurrent_shape                 (e.g. [heads, key_dim, value_dim])

    `conv_parts` names the channels of each part of the conv window in order (Gated DeltaNet:
    q, k, v; Mamba2: x, B, C), each part split by rank on its own (models/state_sharding.py);
    empty: one part. The recurrent state splits by its first dimension (heads).
    """

    kind: str  # "gated_delta_net" or "mamba2": which mixer reads it (a peer must agree)
    conv_channels: int
    conv_window: int  # kernel size - 1
    recurrent_shape: tuple[int, ...]
    dtype: str = "float32"  # a key of STATE_DTYPE_BYTES
    conv_parts: tuple[int, ...] = ()  # channels of each conv part, in order (empty: one part)

    def __post_init__(self) -> None:
        if self.conv_parts and (sum(self.conv_parts) != self.conv_channels or min(self.conv_parts) < 1):
            raise ValueError(f"conv parts {self.conv_parts} do not make up {self.conv_channels} channels")
        if self.dtype not in STATE_DTYPE_BYTES:
            raise ValueError(f"recurrent state dtype {self.dtype!r} is not one of {sorted(STATE_DTYPE_BYTES)}")
        if self.conv_channels < 1 or self.conv_window < 0 or not self.recurrent_shape or min(self.recurrent_shape) < 1:
            raise ValueError(f"malformed recurrent state spec {self}")

    @property
    def conv_elements(self) -> int:
        return self.conv_channels * self.conv_window

    @property
    def recurrent_elements(self) -> int:
        count = 1
        for size in self.recurrent_shape:
            count *= size
        return count

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state of this layer (conv window then recurrent tensor)."""
        return (self.conv_elements + self.recurrent_elements) * STATE_DTYPE_BYTES[self.dtype]

    def max_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """A sequence holds one live state page in a state group, whatever its length."""
        return 1 if num_tokens > 0 else 0


LayerSpec = Union[FullAttentionSpec, SlidingWindowSpec, RecurrentStateSpec]


@dataclass(frozen=True, slots=True)
class KVGroup:
    group_id: int
    spec: LayerSpec
    layer_ids: tuple[int, ...]  # model layer ids: at most group_size (a state group: as many as a page holds)

    @property
    def is_state(self) -> bool:
        return isinstance(self.spec, RecurrentStateSpec)


@dataclass(frozen=True, slots=True)
class KVGroupPlan:
    """Which layer lives in which (group, slot) of a block page. Attention groups come first
    (full attention before sliding), state groups last; `geometry` is None without state layers
    (the page is then the attention page)."""

    groups: tuple[KVGroup, ...]
    group_size: int
    num_layers: int
    geometry: Optional[PageGeometry] = None

    def locate(self, layer_id: int) -> tuple[int, int]:
        """(group_id, slot) of a model layer (attention or state)."""
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group.group_id, group.layer_ids.index(layer_id)
        raise KeyError(f"layer {layer_id} is not a cache-holding layer of this plan")

    @property
    def state_group_ids(self) -> tuple[int, ...]:
        return tuple(group.group_id for group in self.groups if group.is_state)

    def is_state_group(self, group_id: int) -> bool:
        return self.groups[group_id].is_state

    @property
    def padded_page_bytes(self) -> int:
        """The page size when state made it larger than the attention page, else 0 (what
        `KVPoolLayout(padded_page_bytes=...)` takes)."""
        if self.geometry is None or not self.geometry.is_padded:
            return 0
        return self.geometry.page_bytes


def plan_groups(layer_specs: Sequence[LayerSpec], attention_layer_bytes: int = 0) -> KVGroupPlan:
    """Bucket layers by spec and cut each bucket into groups.

    Attention: group_size is the size of the smallest attention bucket, so a
    model with only full attention gets one group of all layers, and Gemma 3
    (5 sliding : 1 full) gets one full group of its full layers plus ~5 sliding
    groups. Recurrent state: each bucket is cut into groups of as many layers as
    one page holds (kv/page_geometry.py), which needs `attention_layer_bytes`, the
    bytes one attention layer's K and V of one block take in a page. Layers are
    assigned strided (group j of a bucket takes layers j, j+n, j+2n, ...) so
    groups interleave through the depth of the model.
    """
    if not any(not isinstance(spec, RecurrentStateSpec) for spec in layer_specs):
        raise ValueError("a model needs at least one attention layer")
    buckets: dict[LayerSpec, list[int]] = {}
    for layer_id, spec in enumerate(layer_specs):
        buckets.setdefault(spec, []).append(layer_id)
    attention = {spec: ids for spec, ids in buckets.items() if not isinstance(spec, RecurrentStateSpec)}
    state = [(spec, ids) for spec, ids in buckets.items() if isinstance(spec, RecurrentStateSpec)]
    group_size = min(len(ids) for ids in attention.values())
    groups: list[KVGroup] = []
    # Full attention first so group 0 is the full-attention group when there is one.
    ordered = sorted(attention.items(), key=lambda item: (not isinstance(item[0], FullAttentionSpec), item[1][0]))
    for spec, layer_ids in ordered:
        _cut_bucket(groups, spec, layer_ids, group_size)
    if not state:
        return KVGroupPlan(tuple(groups), group_size, len(layer_specs))
    if attention_layer_bytes < 1:
        raise ValueError("a model with recurrent-state layers needs attention_layer_bytes to size its pages")
    geometry = plan_page(group_size * attention_layer_bytes, [(spec.state_bytes, len(ids)) for spec, ids in state])
    for (spec, layer_ids), per_group in zip(state, geometry.layers_per_group):
        _cut_bucket(groups, spec, layer_ids, per_group)
    return KVGroupPlan(tuple(groups), group_size, len(layer_specs), geometry)


def _cut_bucket(groups: list[KVGroup], spec: LayerSpec, layer_ids: list[int], per_group: int) -> None:
    num_groups = -(-len(layer_ids) // per_group)
    for j in range(num_groups):
        groups.append(KVGroup(len(groups), spec, tuple(layer_ids[j::num_groups])))
