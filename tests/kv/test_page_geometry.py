"""The page rule (kv/page_geometry.py) and plan_groups with recurrent-state layers."""

from __future__ import annotations

import pytest

from pdserve.kv.page_geometry import PAGE_ALIGN_BYTES, plan_page
from pdserve.kv.routing_info import RoutingInfo, describe_groups
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, plan_groups

# Qwen3-Next / Qwen3.5-like: Gated DeltaNet with 16 key heads and 32 value heads of 128, conv kernel 4,
# float32 state; attention with 2 KV heads of 256 in bfloat16, 16-token blocks; 3 DeltaNet : 1 full.
QWEN_STATE = RecurrentStateSpec("gated_delta_net", conv_channels=2 * 16 * 128 + 32 * 128, conv_window=3,
                                recurrent_shape=(32, 128, 128))
QWEN_ATTENTION_LAYER_BYTES = 2 * 16 * 2 * 256 * 2  # K and V, 16 tokens, 2 heads, 256 dims, bf16
# Nemotron-H-8B-like: Mamba2 with 128 heads of 64, state 128, 8 groups, conv kernel 4; attention with
# 8 KV heads of 128 in bfloat16; 24 Mamba2 layers and 4 attention layers (the MLP blocks hold no cache).
NEMOTRON_STATE = RecurrentStateSpec("mamba2", conv_channels=128 * 64 + 2 * 8 * 128, conv_window=3,
                                    recurrent_shape=(128, 64, 128))
NEMOTRON_ATTENTION_LAYER_BYTES = 2 * 16 * 8 * 128 * 2


def qwen_like_specs(num_layers: int = 48) -> list:
    return [FullAttentionSpec() if layer % 4 == 3 else QWEN_STATE for layer in range(num_layers)]


def nemotron_like_specs() -> list:
    attention_at = {3, 10, 17, 24}
    return [FullAttentionSpec() if layer in attention_at else NEMOTRON_STATE for layer in range(28)]


# ---- the rule --------------------------------------------------------------------------


def test_a_state_layer_that_fits_packs_as_many_layers_as_the_attention_page_holds():
    geometry = plan_page(4096, [(1000, 10)])
    assert geometry.page_bytes == 4096 and not geometry.is_padded
    assert geometry.layers_per_group == (4,)
    assert geometry.attention_padding_fraction == 0.0
    assert geometry.state_padding_fractions == (pytest.approx(1 - 4000 / 4096),)
    assert geometry.block_size_factor == 1


def test_a_state_group_never_takes_more_layers_than_its_bucket():
    assert plan_page(4096, [(1000, 3)]).layers_per_group == (3,)


def test_a_state_layer_larger_than_the_attention_page_grows_every_page_to_one_aligned_layer():
    geometry = plan_page(4096, [(5000, 6)])
    assert geometry.page_bytes == 5120 == -(-5000 // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES
    assert geometry.layers_per_group == (1,) and geometry.is_padded
    assert geometry.attention_padding_fraction == pytest.approx(1 - 4096 / 5120)
    assert geometry.block_size_factor == 2  # blocks of twice the tokens would fill the attention page
    assert "padding" in geometry.describe() and "--block-size 2x" in geometry.describe()


def test_with_two_state_buckets_the_largest_sets_the_page_and_the_other_packs_into_it():
    geometry = plan_page(1024, [(3000, 4), (700, 8)])
    assert geometry.page_bytes == 3072 and geometry.layers_per_group == (1, 4)


def test_malformed_geometry_is_rejected():
    with pytest.raises(ValueError):
        plan_page(0, [(100, 1)])
    with pytest.raises(ValueError):
        plan_page(100, [(0, 1)])


# ---- plans of real-shaped models ---------------------------------------------------------


def test_qwen35_like_plan_puts_the_full_layers_in_one_group_and_one_deltanet_layer_per_padded_page():
    plan = plan_groups(qwen_like_specs(), attention_layer_bytes=QWEN_ATTENTION_LAYER_BYTES)
    assert plan.group_size == 12
    assert plan.groups[0].spec == FullAttentionSpec() and plan.groups[0].layer_ids == tuple(range(3, 48, 4))
    assert len(plan.state_group_ids) == 36 and plan.state_group_ids == tuple(range(1, 37))
    assert all(len(plan.groups[g].layer_ids) == 1 for g in plan.state_group_ids)
    geometry = plan.geometry
    assert geometry.kv_page_bytes == 12 * QWEN_ATTENTION_LAYER_BYTES == 393216
    assert QWEN_STATE.state_bytes == (8192 * 3 + 32 * 128 * 128) * 4 == 2195456
    assert geometry.page_bytes == plan.padded_page_bytes == 2195456
    assert geometry.attention_padding_fraction == pytest.approx(0.821, abs=1e-3)
    assert geometry.block_size_factor == 6
    assert plan.locate(0) == (1, 0) and plan.locate(3) == (0, 0)
    assert not plan.is_state_group(0) and plan.is_state_group(36)


def test_nemotron_like_plan_has_one_attention_group_and_a_state_group_per_mamba_layer():
    plan = plan_groups(nemotron_like_specs(), attention_layer_bytes=NEMOTRON_ATTENTION_LAYER_BYTES)
    assert [len(g.layer_ids) for g in plan.groups] == [4] + [1] * 24
    assert plan.groups[0].layer_ids == (3, 10, 17, 24)
    assert plan.geometry.page_bytes == -(-NEMOTRON_STATE.state_bytes // 256) * 256
    assert plan.geometry.attention_padding_fraction > 0.9  # 16-token blocks waste most of the pool
    assert sorted(layer for g in plan.groups for layer in g.layer_ids) == list(range(28))


def test_small_state_layers_share_pages_strided_through_the_depth():
    state = RecurrentStateSpec("gated_delta_net", conv_channels=4, conv_window=3, recurrent_shape=(2, 4, 4))
    specs = [FullAttentionSpec() if layer % 4 == 3 else state for layer in range(8)]  # 6 state, 2 full
    plan = plan_groups(specs, attention_layer_bytes=200)  # attention page 400 bytes: 2 states of 176
    assert plan.geometry.page_bytes == 400 and plan.padded_page_bytes == 0
    assert [g.layer_ids for g in plan.groups] == [(3, 7), (0, 4), (1, 5), (2, 6)]
    assert plan.state_group_ids == (1, 2, 3)
    assert plan.locate(5) == (2, 1)


def test_plans_without_state_are_unchanged_and_state_needs_the_attention_layer_size():
    plan = plan_groups([SlidingWindowSpec(8)] * 5 + [FullAttentionSpec()])
    assert plan.geometry is None and plan.state_group_ids == () and plan.padded_page_bytes == 0
    assert [len(g.layer_ids) for g in plan.groups] == [1, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError):
        plan_groups(qwen_like_specs(8))
    with pytest.raises(ValueError):
        plan_groups([QWEN_STATE] * 4, attention_layer_bytes=1024)  # no attention layer


def test_routing_info_names_state_groups_so_a_router_applies_the_snapshot_rule():
    plan = plan_groups(qwen_like_specs(8), attention_layer_bytes=QWEN_ATTENTION_LAYER_BYTES)
    groups = describe_groups(plan)
    assert [g.kind for g in groups] == ["full"] + ["state"] * 6
    info = RoutingInfo(model="m", epoch="e", hash_scheme="h", block_size=16, prefix_caching=True, groups=groups,
                       tokenizer_json="{}")
    assert info.group_plan().state_group_ids == tuple(range(1, 7))
