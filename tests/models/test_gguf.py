"""GGUF loading: llama.cpp's Q/K row permutation is undone, metadata becomes
the HF config, and a GGUF written from an HF checkpoint serves the same logits
as the checkpoint itself (llama and qwen3 architectures)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.contiguous_attention import ContiguousAttention, forward_chunk
from tests.models.hf_oracle import randomize_norms, save_tiny_checkpoint
from pdserve.models.gguf_file import GGUFCheckpoint, hf_tensor_name, unpermute_rows
from pdserve.models.gguf_tokenizer import byte_alphabet
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature
from pdserve.models.loader import load_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The reordering llama.cpp's converter applies to llama Q/K rows (per head,
    halves interleaved), written from its description for this test."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def test_unpermute_rows_inverts_llama_cpp_permutation():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    bias = np.arange(32, dtype=np.float32)
    for num_heads in (1, 2, 4):
        restored = unpermute_rows(torch.from_numpy(llama_cpp_permute(weight, num_heads)), num_heads)
        assert torch.equal(restored, torch.from_numpy(weight))
        restored_bias = unpermute_rows(torch.from_numpy(llama_cpp_permute(bias, num_heads)), num_heads)
        assert torch.equal(restored_bias, torch.from_numpy(bias))


def test_gguf_tensor_names_map_to_hf_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None


def _vocab() -> tuple[list[str], list[int], list[str]]:
    letters = list(byte_alphabet().values())
    tokens = letters + ["Ġt", "Ġth"] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types, ["Ġ t", "Ġt h"]


def _write_gguf(path: str, hf_model, arch: str) -> None:
    config = hf_model.config
    tokens, types, merges = _vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    gguf_names = {hf: gguf_name for gguf_name in _all_gguf_names(config) if (hf := hf_tensor_name(gguf_name))}
    for hf_name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(gguf_names[hf_name], np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _all_gguf_names(config) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    return names + [f"blk.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in per_layer]


def _tiny(arch: str):
    tokens, _, _ = _vocab()
    common = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.08)
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, head_dim=16, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    model.eval()
    randomize_norms(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_written_from_hf_weights_serves_the_same_logits(tmp_path, arch):
    hf_model = _tiny(arch)
    gguf_path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(gguf_path, hf_model, arch)
    from_gguf = load_model(gguf_path, torch.float32, torch.device("cpu"))
    from_dir = load_model(save_tiny_checkpoint(hf_model, str(tmp_path / "hf")), torch.float32, torch.device("cpu"))

    assert from_gguf.name == f"tiny-{arch}"
    assert from_gguf.model.spec == from_dir.model.spec
    prompt = list(range(40, 90))
    logits = forward_chunk(from_gguf.model, ContiguousAttention(from_gguf.model.spec.layer_specs), "s", prompt)
    expected = forward_chunk(from_dir.model, ContiguousAttention(from_dir.model.spec.layer_specs), "s", prompt)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_gguf_tokenizer_and_template_come_from_metadata(tmp_path):
    gguf_path = str(tmp_path / "tiny.gguf")
    _write_gguf(gguf_path, _tiny("llama"), "llama")
    tokenizer = load_model(gguf_path, torch.float32, torch.device("cpu")).tokenizer
    tokens, _, _ = _vocab()
    assert tokenizer.eos_token_ids == (tokens.index("<|im_end|>"),)
    assert tokenizer.bos_token_id == tokens.index("<|im_start|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the"}])
    assert prompt == "<|im_start|>user\nthe<|im_end|>\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == tokens.index("<|im_start|>") and ids[-2] == tokens.index("<|im_end|>")
    assert tokenizer.encode(" the", add_special_tokens=False) == [tokens.index("Ġth"), tokens.index("e")]
    assert tokenizer.decode(ids) == "user\nthe\n"


def test_unknown_gguf_architecture_is_refused(tmp_path):
    path = str(tmp_path / "mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelFeature, match="mamba"):
        GGUFCheckpoint(path)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        GGUFCheckpoint(str(path))
