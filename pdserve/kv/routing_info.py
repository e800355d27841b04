"""What a routing proxy needs to compute a worker's block hashes itself, and the internal paths.

Invariant: a proxy that tokenizes with `tokenizer_json`, renders chat with
`chat_template` and chains hashes with `hash_scheme` over `block_size` tokens
gets exactly the keys the worker's prefix cache uses (kv/hashing.py); the
group list lets it apply the worker's own prefix-matching rule (kv/prefix.py).
Torch-free: the proxy imports this module.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict

from pdserve.kv.specs import FullAttentionSpec, KVGroup, KVGroupPlan, LayerSpec, RecurrentStateSpec, SlidingWindowSpec

ROUTING_INFO_PATH = "/internal/kv/routing_info"
EVENTS_PATH = "/internal/kv/events"
RESET_PREFIX_CACHE_PATH = "/internal/kv/reset_prefix_cache"


class GroupInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    kind: Literal["full", "sliding", "state"]  # "state": recurrent state, hit only at its snapshots
    window_tokens: Optional[int] = None


# What a router's matcher needs of a state group: that it is one (its shapes play no part in matching).
_MATCHED_STATE = RecurrentStateSpec("any", conv_channels=1, conv_window=0, recurrent_shape=(1,))


def _matched_spec(group: GroupInfo) -> LayerSpec:
    if group.kind == "full":
        return FullAttentionSpec()
    if group.kind == "state":
        return _MATCHED_STATE
    return SlidingWindowSpec(group.window_tokens or 0)


class RoutingInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    model: str
    epoch: str
    hash_scheme: str
    block_size: int
    prefix_caching: bool
    groups: list[GroupInfo]
    tokenizer_json: str  # `tokenizers.Tokenizer.to_str()` of the worker's tokenizer
    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None

    def group_plan(self) -> KVGroupPlan:
        """The groups as the prefix matcher needs them (layer ids play no part in matching)."""
        groups = tuple(KVGroup(group_id, _matched_spec(g), ()) for group_id, g in enumerate(self.groups))
        return KVGroupPlan(groups, group_size=1, num_layers=0)


def describe_groups(plan: KVGroupPlan) -> list[GroupInfo]:
    return [GroupInfo(kind="full") if isinstance(g.spec, FullAttentionSpec)
            else GroupInfo(kind="state") if isinstance(g.spec, RecurrentStateSpec)
            else GroupInfo(kind="sliding", window_tokens=g.spec.window_tokens) for g in plan.groups]
