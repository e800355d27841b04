"""Tiny random-weight checkpoints made with transformers at test time (no hub access):
Gemma 3 text with a sliding window shorter than the test prompts, Qwen3, gpt-oss (sinks, alternating
windows shorter than the prompts, 6 experts top-2), Qwen3-MoE (one dense layer), and the hybrids with
recurrent state: Qwen3.5 and Qwen3-Next (Gated DeltaNet) and Nemotron-H (Mamba2, with or without MoE)."""

from __future__ import annotations

import torch

from tests.models.hf_oracle import randomize_norms, save_tiny_checkpoint

GEMMA_VOCAB = 320
GEMMA_WINDOW = 16
GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention", "full_attention", "sliding_attention"]
QWEN_VOCAB = 300
GPT_OSS_VOCAB = 320
GPT_OSS_WINDOW = 16
GPT_OSS_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
QWEN_MOE_VOCAB = 300
QWEN_MOE_DENSE_LAYERS = [1]


def tiny_gemma3_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=GEMMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.08,
        sliding_window=GEMMA_WINDOW, layer_types=GEMMA_LAYER_TYPES, query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    settings.update(overrides)
    return transformers.Gemma3TextConfig(**settings)


def tiny_qwen3_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.08,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return transformers.Qwen3Config(**settings)


def tiny_gpt_oss_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=GPT_OSS_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.08,
        sliding_window=GPT_OSS_WINDOW, layer_types=GPT_OSS_LAYER_TYPES, num_local_experts=6, num_experts_per_tok=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )
    settings.update(overrides)
    return transformers.GptOssConfig(**settings)


def tiny_qwen3_moe_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=QWEN_MOE_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.08, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=QWEN_MOE_DENSE_LAYERS, tie_word_embeddings=False,
    )
    settings.update(overrides)
    return transformers.Qwen3MoeConfig(**settings)


def randomize_gpt_oss_extras(model, seed: int = 0) -> None:
    """transformers starts sinks near zero and expert biases at zero; make them matter."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator) + 0.5)
            elif name.endswith("_bias") or name.endswith("router.bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def make_tiny_gpt_oss(directory: str, seed: int = 0, **overrides):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss_config(**overrides)).eval()
    randomize_norms(model, seed=seed)
    randomize_gpt_oss_extras(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def make_tiny_qwen3_moe(directory: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides)).eval()
    randomize_norms(model, seed=seed)
    save_tiny_checkpoint(model, directory)
    return model


def make_tiny_gemma3(directory: str, seed: int = 0):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config()).eval()
    randomize_norms(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def make_tiny_qwen3(directory: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(tiny_qwen3_config()).eval()
    randomize_norms(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Nemotron-H: Mamba2, MLP and attention blocks (three Mamba2 blocks, two MLP, one attention).
NEMOTRON_H_VOCAB = 300
NEMOTRON_H_BLOCK_TYPES = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp", "linear_attention"]


def tiny_nemotron_h_config(**overrides):
    import transformers

    settings = dict(
        vocab_size=NEMOTRON_H_VOCAB, hidden_size=64, intermediate_size=96, layers_block_type=NEMOTRON_H_BLOCK_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=64,
        use_mamba_kernels=False, initializer_range=0.08, tie_word_embeddings=False,
    )
    settings.update(overrides)
    return transformers.NemotronHConfig(**settings)


def randomize_mamba2_constants(model, seed: int = 0) -> None:
    """transformers starts A_log at log(1..heads), D at one and dt_bias in a narrow band; spread them
    (decays from slow to fast, time steps from 0.05 to about 1) so a mis-applied one shows."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-0.7, 2.0, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(torch.empty(param.shape).uniform_(-3.0, 0.5, generator=generator))
            elif name.endswith(".D"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 1.0)
            elif name.endswith("conv1d.bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def make_tiny_nemotron_h(directory: str, seed: int = 0, **overrides):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(tiny_nemotron_h_config(**overrides)).eval()
    randomize_norms(model, seed=seed)
    randomize_mamba2_constants(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


# Nemotron-H with mixture-of-experts blocks: 8 experts in 4 groups, 2 groups kept, top-2, a shared expert.
NEMOTRON_H_MOE_BLOCK_TYPES = ["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"]
NEMOTRON_H_MOE_SETTINGS = dict(
    layers_block_type=NEMOTRON_H_MOE_BLOCK_TYPES, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=64, n_group=4, topk_group=2, routed_scaling_factor=2.5,
)


def randomize_nemotron_h_router(model, seed: int = 0) -> None:
    """transformers starts the correction bias at zero and the router weights small; make the bias
    move choices and the scores differ enough that routing matters."""
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
            elif name.endswith("mixer.gate.weight"):
                tensor.mul_(10)


def make_tiny_nemotron_h_moe(directory: str, seed: int = 0, **overrides):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(tiny_nemotron_h_config(**{**NEMOTRON_H_MOE_SETTINGS, **overrides})).eval()
    randomize_norms(model, seed=seed)
    randomize_mamba2_constants(model, seed)
    randomize_nemotron_h_router(model, seed)
    save_tiny_checkpoint(model, directory)
    return model

QWEN3_5_VOCAB = 300
QWEN3_5_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
QWEN3_NEXT_DENSE_LAYERS = [1]


def _qwen3_5_settings(**overrides):
    """Shared by Qwen3.5 and Qwen3-Next: three Gated DeltaNet layers (2 key heads shared by 4 value heads)
    and one gated full-attention layer (partial RoPE over 8 of 32 head dims)."""
    settings = dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.08,
        layer_types=QWEN3_5_LAYER_TYPES, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    settings.update(overrides)
    return settings


def tiny_qwen3_5_config(**overrides):
    import transformers

    return transformers.Qwen3_5TextConfig(**_qwen3_5_settings(**overrides))


def tiny_qwen3_next_config(**overrides):
    import transformers

    settings = _qwen3_5_settings(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, norm_topk_prob=True,
                                 mlp_only_layers=QWEN3_NEXT_DENSE_LAYERS)
    settings.update(overrides)
    return transformers.Qwen3NextConfig(**settings)


def randomize_qwen3_5_extras(model, seed: int = 0) -> None:
    """Norms: the zero-centred ones (1 + w) around 0, the DeltaNet's gated norm (plain w) around 1. The
    decay rates A = exp(A_log) are drawn small (0.005-0.1 a token) so the state remembers across chunks,
    and dt_bias (initialised to ones) is drawn too."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + 1.0)
            elif "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif name.endswith("A_log"):
                param.copy_((torch.rand(param.shape, generator=generator) * 0.095 + 0.005).log())
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def make_tiny_qwen3_5(directory: str, seed: int = 0, **overrides):
    """Returns the HF model (the oracle) after saving it to `directory`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(tiny_qwen3_5_config(**overrides)).eval()
    randomize_qwen3_5_extras(model, seed)
    save_tiny_checkpoint(model, directory)
    return model


def make_tiny_qwen3_next(directory: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(tiny_qwen3_next_config(**overrides)).eval()
    randomize_qwen3_5_extras(model, seed)
    save_tiny_checkpoint(model, directory)
    return model
