"""Loader dispatch and errors, sharded safetensors, and RoPE frequencies
against transformers' own rope initialisers."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.hf_oracle import save_tiny_checkpoint, write_word_tokenizer
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature, flat_rope
from pdserve.models.loader import load_model
from pdserve.models.registry import architecture_of, model_registry
from pdserve.models.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def test_registry_names_every_supported_architecture():
    assert set(model_registry()) == {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
        "GptOssForCausalLM", "Qwen3MoeForCausalLM",
        "NemotronHForCausalLM",
        "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM",
    }
    assert architecture_of({"model_type": "gemma3_text"}) == "Gemma3ForCausalLM"
    assert architecture_of({"model_type": "gpt_oss"}) == "GptOssForCausalLM"


def test_unknown_architecture_fails_with_the_supported_list(tmp_path):
    directory = save_tiny_checkpoint(_tiny_llama(), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelFeature, match="FalconForCausalLM.*LlamaForCausalLM"):
        load_model(directory, torch.float32, torch.device("cpu"))


def test_path_that_is_neither_directory_nor_gguf_is_refused(tmp_path):
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_model(str(stray), torch.float32, torch.device("cpu"))
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "missing"), torch.float32, torch.device("cpu"))


def test_directory_without_weights_or_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_llama().config.to_dict()))
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    write_word_tokenizer(str(tmp_path), 64)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf_model = _tiny_llama()
    single = load_model(save_tiny_checkpoint(hf_model, str(tmp_path / "one")), torch.float32, torch.device("cpu"))
    sharded_dir = save_tiny_checkpoint(hf_model, str(tmp_path / "many"), max_shard_size="20KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    sharded = load_model(sharded_dir, torch.float32, torch.device("cpu"))
    prompt = list(range(3, 30))
    a = forward_chunk(single.model, ContiguousAttention(single.model.spec.layer_specs), "s", prompt)
    b = forward_chunk(sharded.model, ContiguousAttention(sharded.model.spec.layer_specs), "s", prompt)
    assert torch.equal(a, b)
    assert sharded.name == "many"


def test_missing_tensor_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = save_tiny_checkpoint(_tiny_llama(), str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(directory, torch.float32, torch.device("cpu"))


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 500000.0, **ROPE_CASES[case]}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                                      rope_parameters=dict(params))
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    ours, scaling = inverse_frequencies(flat_rope(config.to_dict()), rotary_dim=64)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(expected_scaling)


def test_legacy_rope_scaling_key_is_understood():
    config = {"max_position_embeddings": 100, "rope_theta": 123.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    rope = flat_rope(config)
    assert rope == {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}


def test_unsupported_rope_type_is_refused():
    with pytest.raises(UnsupportedModelFeature, match="dynamic"):
        inverse_frequencies({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 64)
