"""The fused decoder layer (one native call per layer) against the per-op decode step it
replaces: same logits, same stored K/V, for float and quantized weights, with biases and q/k
norms; and the models it must not take."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kernels import native
from pdserve.runner.decode_step import DecodeStep
from pdserve.runner.fused_layer import FusedLlamaLayer, fused_layers, unfusable_reason
from pdserve.models.loader import load_model
from tests.engine.step_checks import assert_step_matches_per_op
from tests.engine.test_decode_step import BLOCK_SIZE, _chunk, _prefilled, _runner
from tests.models.hf_oracle import randomize_norms, save_tiny_checkpoint
from tests.models.test_quantized_blocks import require_native_kernels
from tests.tiny_models import QWEN_VOCAB, make_tiny_gemma3, random_prompt, tiny_qwen3_config


@pytest.fixture(scope="module")
def qwen_with_biases_dir(tmp_path_factory):
    """Qwen3 (per-head q/k norms) with q/k/v and o biases, so every optional part is present."""
    import transformers

    directory = str(tmp_path_factory.mktemp("qwen3-bias"))
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config(attention_bias=True)).eval()
    randomize_norms(model, 3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.2)
    save_tiny_checkpoint(model, directory)
    return directory


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_fused_step_matches_the_per_op_step(qwen_with_biases_dir, quantization):
    require_native_kernels()
    loaded = load_model(qwen_with_biases_dir, torch.float32, torch.device("cpu"), quantization)
    runner = _runner(loaded)
    assert runner.decode_step._fused is not None, unfusable_reason(loaded.model, runner.device)
    per_op = DecodeStep(loaded.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                        compile_step=False, fuse_layers=False)
    assert per_op._fused is None
    assert runner.decode_step._stack_norms  # the final norm too runs natively (per_op: torch's rms_norm)
    prompts = [random_prompt(n, QWEN_VOCAB, 40 + n) for n in (1, 17, 38)]
    tables = _prefilled(runner, prompts)
    before = runner.pool.clone()
    # Rounding order differs (norms, rotation, residuals), and grows a little layer by layer (int4
    # rows in 22-bit activation integers included, every row of a step of up to 2 with one-row tiles:
    # their step is float32's rounding; 1.2e-4 seen on a 0.03 logit).
    tolerance = 2e-4
    for rows in ([0], [0, 1, 2]):  # the one-row path and a batch
        chunks = [_chunk(i, [7 + i], len(prompts[i]), tables[i]) for i in rows]
        assert_step_matches_per_op(runner, per_op, chunks, before, tolerance)
        assert not torch.equal(runner.pool, before)


def test_one_row_tiles_give_each_row_of_a_small_step_its_batch_1_bits(qwen_with_biases_dir):
    """The stack's Q4_1 weights copied into one-row tiles (AVX-512 VNNI): a one-row step's logits
    and K/V equal those of a stack without them, bit for bit; in a step of 2 rows each row writes
    the K/V it writes alone (the layers' every product, norm and attention per row), which the
    blocks' float row tiles do not."""
    require_native_kernels()
    loaded = load_model(qwen_with_biases_dir, torch.float32, torch.device("cpu"), "int4")
    runner = _runner(loaded)
    without = DecodeStep(loaded.model, runner.plan, runner.pool, runner.layer_caches, BLOCK_SIZE, runner.device,
                         compile_step=False, one_row_tiles=False)
    assert without._fused_stack.one_row_tile_bytes == 0
    tile_bytes = runner.decode_step._fused_stack.one_row_tile_bytes
    if not native.ops().q4_1_row_tiles_supported():
        assert tile_bytes == 0
        pytest.skip("one-row tiles need AVX-512 VNNI")
    q4_1_bytes = sum(w.nbytes for layer in runner.decode_step._fused for w in layer.weights)
    assert tile_bytes == q4_1_bytes  # every weight of this model has 16k rows: all tiled, as many bytes
    prompts = [random_prompt(n, QWEN_VOCAB, 60 + n) for n in (9, 33, 20)]
    tables = _prefilled(runner, prompts)
    before = runner.pool.clone()
    chunks = [_chunk(i, [11 + i], len(prompts[i]), tables[i]) for i in range(3)]
    assert_step_matches_per_op(runner, without, chunks[1:2], before, tolerance=0)

    def pool_after(step, rows):
        runner.pool.copy_(before)
        with torch.inference_mode():
            step.run([chunks[i] for i in rows])
        return runner.pool.clone()

    def alone(rows):  # each row alone writes its own slots: together they make the step's pool
        pool = before.clone()
        for i in rows:
            after = pool_after(runner.decode_step, [i])
            pool[after != before] = after[after != before]
        return pool

    for rows in ([0, 1], [0, 2], [1, 2]):
        assert torch.equal(pool_after(runner.decode_step, rows), alone(rows))
    assert not torch.equal(pool_after(without, [0, 1]), alone([0, 1]))  # float row tiles round otherwise


def test_the_stack_times_each_part_of_its_layers_only_while_asked(qwen_with_biases_dir):
    """The profile bench.kernels decode reads: every part of a dense layer gets time, the experts
    none; the parts never exceed the call they sit in; reading it unstarted is an error."""
    require_native_kernels()
    loaded = load_model(qwen_with_biases_dir, torch.float32, torch.device("cpu"), "int4")
    runner = _runner(loaded)
    prompts = [random_prompt(30, QWEN_VOCAB, 5)]
    tables = _prefilled(runner, prompts)
    stack = runner.decode_step._fused_stack
    chunks = [_chunk(0, [7], len(prompts[0]), tables[0])]
    stack.start_profile(thread_clock=False)
    started = time.perf_counter()
    with torch.inference_mode():
        runner.decode_step.run(chunks)
    elapsed_s = time.perf_counter() - started
    parts = stack.profile_seconds()
    stack.stop_profile()
    assert list(parts) == ["input_norm", "qkv", "attention", "store_kv", "o_proj", "post_norm", "mlp_gate_up",
                           "mlp_activation", "mlp_down", "experts", "final_norm", "all_reduce"]
    idle = ("experts", "all_reduce")  # no experts in this model; one rank: nothing to sum
    assert all(parts[name] == 0 for name in idle) and all(parts[name] > 0 for name in parts if name not in idle)
    assert sum(parts.values()) <= elapsed_s
    with pytest.raises(RuntimeError, match="not started"):
        stack.profile_seconds()


def test_models_the_kernel_does_not_compute_keep_the_per_op_step(tmp_path):
    require_native_kernels()
    make_tiny_gemma3(str(tmp_path))
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    reason = unfusable_reason(loaded.model, torch.device("cpu"))
    assert reason is not None and "Gemma3" in reason
    assert fused_layers(loaded.model, torch.device("cpu")) is None
    assert _runner(loaded).decode_step._fused is None


def test_a_bfloat16_layer_is_not_fused(qwen_with_biases_dir):
    loaded = load_model(qwen_with_biases_dir, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="float32"):
        FusedLlamaLayer.of(loaded.model.layers[0])


def test_the_kernel_rejects_a_wrong_weight_and_a_write_outside_the_pool(qwen_with_biases_dir):
    require_native_kernels()
    loaded = load_model(qwen_with_biases_dir, torch.float32, torch.device("cpu"))
    runner = _runner(loaded)
    prompts = [random_prompt(9, QWEN_VOCAB, 1)]
    tables = _prefilled(runner, prompts)
    layer = FusedLlamaLayer.of(loaded.model.layers[0])
    wrong = FusedLlamaLayer(layer.norms, layer.qk_norm, (layer.weights[0][:-1], *layer.weights[1:]), layer.formats,
                            (None, *layer.biases[1:]), layer.geometry, layer.eps, layer.scale)
    step = runner.decode_step
    inputs = step.inputs([_chunk(0, [5], len(prompts[0]), tables[0])])
    _, k_cache, v_cache = runner.layer_caches[0]
    with torch.inference_mode():
        h, rope = loaded.model.embed(inputs.input_ids, inputs.positions)
        with pytest.raises(RuntimeError, match="qkv weight"):
            wrong(h, rope, k_cache, v_cache, inputs.rows[0], inputs.write_block_ids[0], inputs.write_offsets)
        before = runner.pool.clone()
        outside = torch.tensor([runner.pool.shape[0]], dtype=torch.int64)
        with pytest.raises(RuntimeError, match="outside the pool"):
            layer(h, rope, k_cache, v_cache, inputs.rows[0], outside, inputs.write_offsets)
        assert torch.equal(runner.pool, before)
