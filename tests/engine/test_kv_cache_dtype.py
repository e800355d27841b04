"""A 16-bit KV pool (--kv-cache-dtype bfloat16|float16): the native decode attention reads its pages
exactly as their float32 widening, the torch paths agree with it, the fused layer stores K/V rounded
as torch rounds, and greedy decoding over it follows decoding over a float32 pool (the embedded
model token for token; a tiny random Qwen3 within a stated logit tolerance)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.models.loader import load_model, resolve_quantization
from pdserve.runner.decode_attention import attend_decode, attend_decode_torch, build_decode_rows
from pdserve.runner.decode_step import DecodeStep
from pdserve.runner.model_runner import ModelRunner
from tests.engine.harness import generate, greedy, make_engine
from tests.engine.test_decode_step import BLOCK_SIZE, _chunk, _prefilled
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import QWEN_VOCAB, make_tiny_qwen3, random_prompt

SIXTEEN_BIT = [torch.bfloat16, torch.float16]


def _paged_case(dtype, kv_heads, group, head_dim, lengths, seed=0):
    """K/V caches as strided views of one `dtype` pool, block tables and queries."""
    block_size = 16
    num_blocks = sum(math.ceil(n / block_size) for n in lengths) + 1
    generator = torch.Generator().manual_seed(seed + head_dim)
    pool = torch.randn(num_blocks, kv_heads, 2, 2, block_size, head_dim, generator=generator).to(dtype)
    k_cache, v_cache = pool[:, :, 1, 0].transpose(1, 2), pool[:, :, 1, 1].transpose(1, 2)
    order = torch.randperm(num_blocks - 1, generator=generator).add(1).tolist()
    tables, used = [], 0
    for length in lengths:
        count = math.ceil(length / block_size)
        tables.append(order[used : used + count])
        used += count
    q = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator)
    return k_cache, v_cache, tables, q, block_size


def _reference(q, k_cache, v_cache, tables, positions, spec, block_size, group, scale, k_new=None, v_new=None):
    """float64 softmax over the widened 16-bit keys (widening is exact: the kernel must match it)."""
    outputs = []
    for row, (table, position) in enumerate(zip(tables, positions)):
        last = position if k_new is not None else position + 1
        span = range(spec.needed_from(position), last)
        keys = [k_cache[table[p // block_size], p % block_size].double() for p in span]
        values = [v_cache[table[p // block_size], p % block_size].double() for p in span]
        if k_new is not None:
            keys.append(k_new[row].double())
            values.append(v_new[row].double())
        keys = torch.stack(keys).repeat_interleave(group, dim=1)
        values = torch.stack(values).repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[row].double(), keys) * scale, -1)
        outputs.append(torch.einsum("hl,lhd->hd", weights, values))
    return torch.stack(outputs).float()


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("kv_heads, group, head_dim", [(3, 3, 64), (2, 4, 80), (2, 2, 12)])
@pytest.mark.parametrize("spec", [FullAttentionSpec(), SlidingWindowSpec(40)])
@pytest.mark.parametrize("with_new_key", [False, True])
def test_native_attention_reads_16bit_pages_as_their_exact_float32_widening(dtype, kv_heads, group, head_dim, spec,
                                                                          with_new_key):
    """Vector paths (head_dim 64, 80) and the scalar tails (12), key tiles, splits among threads."""
    require_native_kernels()
    lengths = [1, 9, 150, 700]
    k_cache, v_cache, tables, q, block_size = _paged_case(dtype, kv_heads, group, head_dim, lengths)
    positions = [n - 1 for n in lengths]
    k_new = torch.randn(len(lengths), kv_heads, head_dim) if with_new_key else None
    v_new = torch.randn(len(lengths), kv_heads, head_dim) if with_new_key else None
    rows = build_decode_rows(spec, tables, positions, block_size, torch.device("cpu"), include_query_key=not with_new_key)
    scale = head_dim**-0.5
    out = attend_decode(q, k_cache, v_cache, rows, scale, k_new, v_new, native=True)
    expected = _reference(q, k_cache, v_cache, tables, positions, spec, block_size, group, scale, k_new, v_new)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch_path = attend_decode_torch(q, k_cache, v_cache, rows, scale, k_new, v_new)  # what other devices run
    torch.testing.assert_close(torch_path, expected, rtol=1e-5, atol=1e-5)


def test_the_kernel_refuses_a_pool_of_another_element_type_by_name():
    require_native_kernels()
    k_cache, v_cache, tables, q, block_size = _paged_case(torch.float32, 1, 1, 16, [5])
    rows = build_decode_rows(FullAttentionSpec(), tables, [4], block_size, torch.device("cpu"), include_query_key=True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        attend_decode(q, k_cache.to(torch.int8), v_cache.to(torch.int8), rows, 0.25, native=True)
    with pytest.raises(RuntimeError, match="K and V caches of one dtype"):
        attend_decode(q, k_cache.bfloat16(), v_cache.half(), rows, 0.25, native=True)


def test_a_16bit_pool_holds_twice_the_blocks_of_a_float32_one_in_the_same_bytes():
    plan = plan_groups([FullAttentionSpec()] * 3)
    wide = KVPoolLayout.for_plan(plan, 8, 16, 2, 64, torch.float32)
    for dtype in SIXTEEN_BIT:
        narrow = KVPoolLayout.for_plan(plan, 8, 16, 2, 64, dtype)
        assert narrow.element_bytes == 2 and 2 * narrow.page_bytes == wide.page_bytes
        pool = narrow.allocate("cpu")
        assert pool.dtype == dtype and narrow.canonical_view(pool).shape == (8, narrow.page_bytes)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


def _runner(loaded, dtype) -> ModelRunner:
    spec = loaded.model.spec
    plan = plan_groups(spec.layer_specs)
    layout = KVPoolLayout(200, plan.group_size, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype)
    return ModelRunner(loaded.model, plan, layout, torch.device("cpu"))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_the_fused_step_over_a_16bit_pool_matches_the_per_op_step(tiny_qwen, dtype):
    """The fused layer converts K/V on store as torch's `.to()` does: the pools agree within one
    16-bit rounding step (the float32 K/V themselves differ in rounding order), the logits as closely
    as over a float32 pool (both read the same pages, and each row's own key in float32)."""
    require_native_kernels()
    runner = _runner(tiny_qwen, dtype)
    assert runner.decode_step._fused is not None and runner.pool.dtype == dtype
    per_op = DecodeStep(tiny_qwen.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                        compile_step=False, fuse_layers=False)
    prompts = [random_prompt(n, QWEN_VOCAB, 40 + n) for n in (1, 17, 38)]
    tables = _prefilled(runner, prompts)
    before = runner.pool.clone()
    chunks = [_chunk(i, [7 + i], len(prompts[i]), tables[i]) for i in range(3)]
    runner.pool.copy_(before)
    with torch.inference_mode():
        expected_logits = per_op.run(chunks)
    expected_pool = runner.pool.clone()
    runner.pool.copy_(before)
    with torch.inference_mode():
        logits = runner.decode_step.run(chunks)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    one_step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # relative size of one rounding step
    torch.testing.assert_close(runner.pool.float(), expected_pool.float(), rtol=one_step, atol=1e-6)
    assert not torch.equal(runner.pool, before)


# ---- greedy decoding over a 16-bit pool against a float32 one ---------------------------------------
#
# Token for token: on these prompts every greedy choice over a 16-bit pool is the float32 pool's
# (64 tokens each when this was written), so a tolerance would hide a real regression. A 16-bit
# pool rounds K/V to 8 (bfloat16) or 11 (float16) significant bits; a prompt whose top two logits
# lie closer than that moves could still differ, which is why this compares pools, not transformers.


def _greedy_tokens(loaded, prompts, kv_cache_dtype, num_tokens, block_size=16):
    engine = make_engine(loaded=loaded, kv_cache_dtype=kv_cache_dtype, block_size=block_size, num_blocks=256)
    assert engine.runner.pool.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}[kv_cache_dtype]
    return [result.token_ids for result in generate(engine, prompts, greedy(num_tokens, ignore_eos=True))]


def test_greedy_decoding_of_a_tiny_qwen3_over_16bit_pools_follows_the_float32_pool(tiny_qwen):
    prompts = [random_prompt(n, QWEN_VOCAB, 40 + n) for n in (5, 17, 38, 60)]  # several blocks of 4
    expected = _greedy_tokens(tiny_qwen, prompts, "float32", 24, block_size=4)
    for dtype in ("bfloat16", "float16"):
        assert _greedy_tokens(tiny_qwen, prompts, dtype, 24, block_size=4) == expected, dtype


@pytest.mark.slow
def test_greedy_decoding_of_the_embedded_model_over_16bit_pools_follows_the_float32_pool():
    """As `pdserve serve` loads it (Q4_1 blocks in the native kernels, the fused layers)."""
    device = torch.device("cpu")
    loaded = load_model(None, torch.float32, device, resolve_quantization("auto", "auto", device))
    tokenizer = loaded.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Explain gravity in one sentence.", "List three prime numbers and say why they are prime."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                add_special_tokens=False) for q in questions]
    expected = _greedy_tokens(loaded, prompts, "float32", 32)
    for dtype in ("bfloat16", "float16"):
        assert _greedy_tokens(loaded, prompts, dtype, 32) == expected, dtype


def test_auto_is_bfloat16_only_where_the_fused_layers_run_outside_the_exact_mode(tiny_qwen, tmp_path):
    from pdserve.runner.devices import pick_kv_dtype
    from tests.tiny_models import make_tiny_gemma3

    require_native_kernels()
    cpu = torch.device("cpu")
    assert pick_kv_dtype("auto", "auto", tiny_qwen.model, torch.float32, cpu) == torch.bfloat16
    assert pick_kv_dtype("auto", "float32", tiny_qwen.model, torch.float32, cpu) == torch.float32  # the exact mode
    assert pick_kv_dtype("float16", "float32", tiny_qwen.model, torch.float32, cpu) == torch.float16
    make_tiny_gemma3(str(tmp_path))  # no fused layers: the model's dtype
    gemma = load_model(str(tmp_path), torch.float32, cpu)
    assert pick_kv_dtype("auto", "auto", gemma.model, torch.float32, cpu) == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_greedy_decoding_on_cuda_over_a_16bit_pool_follows_the_float32_pool(tmp_path, kv_cache_dtype):
    """The torch paths (padded gather and SDPA, cast on store and gather) on the GPU, float32 model."""
    make_tiny_qwen3(str(tmp_path))
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cuda"))
    prompts = [random_prompt(n, QWEN_VOCAB, 40 + n) for n in (5, 17, 38, 60)]

    def tokens(dtype: str) -> list[list[int]]:
        engine = make_engine(loaded=loaded, device="cuda", kv_cache_dtype=dtype, block_size=4, num_blocks=256)
        return [result.token_ids for result in generate(engine, prompts, greedy(24, ignore_eos=True))]

    assert tokens(kv_cache_dtype) == tokens("float32")
