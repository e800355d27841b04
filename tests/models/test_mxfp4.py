"""MXFP4 expert weights (the format of the released gpt-oss checkpoints): our dequantization against
transformers' own (an oracle we did not write), bit for bit, on every code and a wide range of
scales and on a whole checkpoint's experts as our loader fills them; and the teacher-forced top-1
agreement of the MXFP4 model with the float32 model it was quantized from."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.models.loader import load_model
from pdserve.models.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.hf_oracle import hf_prompt_logits
from tests.tiny_models import GPT_OSS_VOCAB, make_tiny_gpt_oss, random_prompt

mxfp4_integration = pytest.importorskip("transformers.integrations.mxfp4")
CPU = torch.device("cpu")


def _oracle(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization, [E, in, out], turned back to rows = outputs."""
    return mxfp4_integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def test_dequantization_is_bit_exact_against_transformers_over_every_code_and_scale():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    scales = torch.randint(127 - 20, 127 + 20, (3, 40, 4), dtype=torch.uint8, generator=generator)
    ours, theirs = dequantize_mxfp4(blocks, scales), _oracle(blocks, scales)
    assert ours.shape == theirs.shape == (3, 40, 128)
    assert torch.equal(ours.view(torch.int32), theirs.contiguous().view(torch.int32))  # same bits, -0.0 included


def _mxfp4_checkpoint(float_dir: str, target_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The float checkpoint with every expert tensor replaced by MXFP4 blocks and scales, laid out
    as the released checkpoints lay them out; returns them by tensor name."""
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2).contiguous()  # rows = outputs
        blocks, scales = quantize_mxfp4(weight)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        packed[name] = (blocks, scales)
    save_file(tensors, os.path.join(target_dir, "model.safetensors"))
    for name in os.listdir(float_dir):
        if not name.endswith(".safetensors"):
            with open(os.path.join(float_dir, name), "rb") as src, open(os.path.join(target_dir, name), "wb") as dst:
                dst.write(src.read())
    config_path = os.path.join(target_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    json.dump(config, open(config_path, "w"))
    return packed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    float_dir, mxfp4_dir = str(tmp_path_factory.mktemp("float")), str(tmp_path_factory.mktemp("mxfp4"))
    hf_model = make_tiny_gpt_oss(float_dir)
    packed = _mxfp4_checkpoint(float_dir, mxfp4_dir)
    return hf_model, load_model(mxfp4_dir, torch.float32, CPU), packed


def test_loaded_expert_weights_equal_transformers_dequantization(models):
    _, mxfp4, packed = models
    for layer_id, layer in enumerate(mxfp4.model.layers):
        prefix = f"model.layers.{layer_id}.mlp.experts."
        gate_up, down = _oracle(*packed[prefix + "gate_up_proj"]), _oracle(*packed[prefix + "down_proj"])
        for e, (ours_gate_up, ours_down) in enumerate(zip(layer.mlp.experts.gate_up, layer.mlp.experts.down)):
            expected = torch.cat([gate_up[e, 0::2], gate_up[e, 1::2]])  # interleaved gate/up rows, split
            assert torch.equal(ours_gate_up.weight, expected)
            assert torch.equal(ours_down.weight, down[e])


def test_mxfp4_model_agrees_with_the_float_model_teacher_forced(models):
    hf_model, mxfp4, _ = models
    prompt = random_prompt(200, GPT_OSS_VOCAB, 11)
    ours = forward_chunk(mxfp4.model, ContiguousAttention(mxfp4.model.spec.layer_specs), "s", prompt)
    reference = hf_prompt_logits(hf_model, prompt)
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(f"MXFP4 vs float32 teacher-forced top-1 agreement: {agreement:.3f} over {len(prompt)} positions")
    assert agreement >= 0.5  # measured 0.62: a random tiny model has near ties that 4-bit experts (12% error) flip
    assert not torch.allclose(ours, reference, atol=1e-3)  # the experts really are 4-bit
