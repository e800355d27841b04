"""The decode step (pure pass, new K/V stored after it) against the eager paged path it
replaces for single-token steps, on tiny models with several KV groups; and the compiled step
against the eager one."""

from __future__ import annotations

import pytest
import torch

from pdserve.runner.decode_step import DecodeStep, _layer_step_static, should_compile
from pdserve.runner.paged_attention import PagedAttention
from pdserve.runner.model_runner import ModelRunner
from pdserve.engine.schedule_types import ScheduledChunk
from pdserve.kv.layout import KVPoolLayout
from pdserve.kv.specs import plan_groups
from pdserve.models.loader import load_model
from tests.engine.harness import generate, greedy, make_engine
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import GEMMA_VOCAB, QWEN_VOCAB, make_tiny_gemma3, make_tiny_qwen3, random_prompt

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3"))
    make_tiny_gemma3(directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_qwen3(directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


def _runner(loaded, compile_decode: bool = False) -> ModelRunner:
    spec = loaded.model.spec
    plan = plan_groups(spec.layer_specs)
    layout = KVPoolLayout(200, plan.group_size, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32)
    return ModelRunner(loaded.model, plan, layout, torch.device("cpu"), compile_decode=compile_decode)


def _chunk(request: int, tokens: list[int], start: int, tables: tuple[list[int], ...]) -> ScheduledChunk:
    return ScheduledChunk(f"r{request}", tokens, start, tables, sample=True, sampling=greedy(1))


def _prefilled(runner: ModelRunner, prompts: list[list[int]]) -> list[tuple[list[int], ...]]:
    """Prefill `prompts` eagerly; returns each request's block tables (one per KV group), with
    room for one more token. Sliding groups get their null-padded tables like the allocator's."""
    num_groups = len(runner.plan.groups)
    next_block, tables = 1, []
    for prompt in prompts:
        count = len(prompt) // BLOCK_SIZE + 1
        tables.append(tuple(list(range(next_block + g * count, next_block + (g + 1) * count)) for g in range(num_groups)))
        next_block += num_groups * count
    chunks = [_chunk(i, prompt, 0, tables[i]) for i, prompt in enumerate(prompts)]
    with torch.inference_mode():
        for chunk in chunks:  # one multi-token chunk per step: the eager path
            attention = PagedAttention(runner.plan, runner.layer_caches, [chunk], BLOCK_SIZE, runner.device)
            runner.model(torch.tensor(chunk.token_ids), torch.arange(len(chunk.token_ids)), attention)
    return tables


def _eager_decode_logits(runner: ModelRunner, chunks: list[ScheduledChunk]) -> torch.Tensor:
    with torch.inference_mode():
        attention = PagedAttention(runner.plan, runner.layer_caches, chunks, BLOCK_SIZE, runner.device)
        ids = torch.tensor([c.token_ids[0] for c in chunks])
        positions = torch.tensor([c.start_position for c in chunks])
        return runner.model.compute_logits(runner.model(ids, positions, attention))


@pytest.mark.parametrize("model_name, vocab", [("tiny_gemma", GEMMA_VOCAB), ("tiny_qwen", QWEN_VOCAB)])
def test_decode_step_matches_the_eager_paged_path_logits_and_stored_kv(request, model_name, vocab):
    loaded = request.getfixturevalue(model_name)
    runner = _runner(loaded)
    prompts = [random_prompt(n, vocab, seed) for seed, n in enumerate((3, 22, 41))]  # 41 > the sliding window
    tables = _prefilled(runner, prompts)
    chunks = [_chunk(i, [5 + i], len(prompt), tables[i]) for i, prompt in enumerate(prompts)]
    before = runner.pool.clone()
    expected_logits = _eager_decode_logits(runner, chunks)
    expected_pool = runner.pool.clone()
    runner.pool.copy_(before)
    with torch.inference_mode():
        logits = runner.decode_step.run(chunks)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.pool, expected_pool, rtol=1e-5, atol=1e-5)
    assert not torch.equal(runner.pool, before)  # the new tokens' K/V did land


def test_static_shape_step_for_cuda_graphs_matches_the_eager_paged_path(tiny_gemma):
    """The padded, fixed-shape path other devices compile (into CUDA graphs on a GPU), traced
    whole by dynamo on the CPU (its eager backend: no inductor build): padding rows and columns
    change nothing, and only real rows are stored."""
    runner = _runner(tiny_gemma)
    step = DecodeStep(runner.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                      compile_step=True, native=False)
    step._compiled_layer = torch.compile(_layer_step_static, backend="eager", fullgraph=True, dynamic=False)
    prompts = [random_prompt(n, GEMMA_VOCAB, seed) for seed, n in enumerate((6, 29, 44))]  # 3 rows -> bucket of 4
    tables = _prefilled(runner, prompts)
    chunks = [_chunk(i, [9 + i], len(prompt), tables[i]) for i, prompt in enumerate(prompts)]
    inputs = step.inputs(chunks)
    assert inputs.input_ids.shape == (4,) and all(r.block_table.shape[1] in (2, 4, 8, 16) for r in inputs.rows)
    before = runner.pool.clone()
    expected_logits = _eager_decode_logits(runner, chunks)
    expected_pool = runner.pool.clone()
    runner.pool.copy_(before)
    with torch.inference_mode():
        logits = step.run(chunks)
    assert logits.shape[0] == 3
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.pool, expected_pool, rtol=1e-5, atol=1e-5)


def test_compiled_decode_step_generates_what_the_eager_one_does(tiny_qwen):
    require_native_kernels()
    prompts = [random_prompt(n, QWEN_VOCAB, 30 + n) for n in (5, 19, 33)]
    sampling = greedy(12, ignore_eos=True)
    eager = generate(make_engine(loaded=tiny_qwen, block_size=BLOCK_SIZE, compile_decode=False), prompts, sampling)
    compiled_engine = make_engine(loaded=tiny_qwen, block_size=BLOCK_SIZE, compile_decode=True)
    assert compiled_engine.runner.decode_step.compiled
    compiled = generate(compiled_engine, prompts, sampling)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
    single = generate(compiled_engine, prompts[:1], sampling, prefix="alone")  # the one-row graph
    assert single[0].token_ids == eager[0].token_ids


def test_compilation_is_opt_in_on_cuda_and_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not should_compile(None, cuda, torch.float32) and not should_compile(False, cuda, torch.float32)
    assert not should_compile(None, cpu, torch.float32)  # a cold compile costs more start-up than it saves
    require_native_kernels()
    assert should_compile(True, cpu, torch.float32)
