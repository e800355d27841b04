"""GGUF checkpoints: config, tensors and vocabulary read from one llama.cpp file.

The file is translated into the Hugging Face vocabulary the model files speak:
a config dict with HF keys and a `WeightSource` serving HF tensor names. The
invariant: tensors come out exactly as the HF checkpoint holds them, so the
Q/K row permutation llama.cpp applies to llama-arch models is undone here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np
import torch

from pdserve.models.gguf_reader import GGUFContainer
from pdserve.models.hf_config import ModelLoadError, UnsupportedModelFeature
from pdserve.models.quant.blocks import BlockFormat, PackedWeight, q4_0_as_q4_1

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF architecture class, HF model_type).
GGUF_ARCHITECTURES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
})

GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
})

LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})

# ggml type id -> how its blocks are served packed (see quant/blocks.py); others are dequantized.
PACKED_GGML_TYPES: Mapping[int, str] = MappingProxyType({2: "q4_0", 3: "q4_1", 8: "q8_0"})

LAYER_TENSOR_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
ROPE_FREQS_TENSOR = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str  # "gpt2" for byte-level BPE
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors with no HF counterpart."""
    match = LAYER_TENSOR_NAME.match(gguf_name)
    if match:
        layer, key, kind = match.groups()
        hf = LAYER_TENSORS.get(key)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    base, _, kind = gguf_name.rpartition(".")
    hf = GLOBAL_TENSORS.get(base)
    return f"{hf}.{kind}" if hf else None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleave of a Q or K projection.

    llama.cpp reorders each head's rows from [first half | second half] to
    pairs (r0, r_half, r1, r_half+1, ...) for its interleaved RoPE; HF
    checkpoints keep the halves. Works for weights [rows, in] and biases [rows].
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = tuple(weight.shape[1:])
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


class GGUFCheckpoint:
    """One opened GGUF file; doubles as the `WeightSource` of its tensors."""

    def __init__(self, path: str):
        import gguf  # imported here: only GGUF loading needs its dequantizers

        self._gguf = gguf
        try:
            self._container = GGUFContainer(path)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
        self.architecture = str(self._field("general.architecture"))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise UnsupportedModelFeature(
                f"GGUF architecture {self.architecture!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})"
            )
        self._tensors = self._container.tensors
        self._by_hf_name = {hf: name for name in self._tensors if (hf := hf_tensor_name(name)) is not None}

    def _field(self, key: str, default: Any = None) -> Any:
        return self._container.metadata.get(key, default)

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    @property
    def name(self) -> str | None:
        return self._field("general.name")

    def hf_config(self) -> dict[str, Any]:
        """The config.json an HF checkpoint of these weights would carry."""
        hf_arch, model_type = GGUF_ARCHITECTURES[self.architecture]
        num_heads = int(self._require_arch("attention.head_count"))
        tokens = self._field("tokenizer.ggml.tokens") or ()
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "num_hidden_layers": int(self._require_arch("block_count")),
            "max_position_embeddings": int(self._require_arch("context_length")),
            "hidden_size": int(self._require_arch("embedding_length")),
            "intermediate_size": int(self._require_arch("feed_forward_length")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv", num_heads)),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "vocab_size": int(self._arch_field("vocab_size", len(tokens))),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        key_length = self._arch_field("attention.key_length")
        if key_length:
            config["head_dim"] = int(key_length)
        rope = self._rope_scaling()
        if rope:
            config["rope_scaling"] = rope
        return config

    def _require_arch(self, key: str) -> Any:
        value = self._arch_field(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata has no {self.architecture}.{key}")
        return value

    def _rope_scaling(self) -> dict[str, Any] | None:
        if ROPE_FREQS_TENSOR in self._tensors:
            factors = self._dequantize(ROPE_FREQS_TENSOR)
            return {"rope_type": "freq_factors", "factors": factors.tolist()}
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = float(self._arch_field("rope.scaling.factor", 1.0))
        if kind == "linear":
            return {"rope_type": "linear", "factor": factor}
        if kind == "yarn":
            original = int(self._arch_field("rope.scaling.original_context_length"))
            return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        raise UnsupportedModelFeature(f"GGUF rope scaling {kind!r} is not supported")

    def vocab(self) -> GGUFVocab:
        model = self._field("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("GGUF file has no tokenizer metadata")
        return GGUFVocab(
            model=str(model),
            pre=self._field("tokenizer.ggml.pre"),
            tokens=tuple(self._field("tokenizer.ggml.tokens") or ()),
            token_types=tuple(int(t) for t in self._field("tokenizer.ggml.token_type") or ()),
            merges=tuple(self._field("tokenizer.ggml.merges") or ()),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token", False)),
            add_eos_token=bool(self._field("tokenizer.ggml.add_eos_token", False)),
            chat_template=self._field("tokenizer.chat_template"),
        )

    # WeightSource -------------------------------------------------------
    # What these serve is what gguf_cache.py stores: bump its CONVERTER_VERSION when it changes.

    def tensor_names(self) -> list[str]:
        """The HF names of every tensor this checkpoint serves."""
        return list(self._by_hf_name)

    def converted_bytes(self, name: str, keep_packed: bool) -> int:
        """At most the bytes of the tensor as `get` serves it (float32) or, when keep_packed and it is
        packable, as `get_packed` does (blocks: under 2 bytes a weight)."""
        info = self._tensors[self._by_hf_name[name]]
        num_elements = int(np.prod(info.dims, dtype=np.int64))
        packable = keep_packed and info.ggml_type in PACKED_GGML_TYPES and len(info.dims) == 2
        return num_elements * (2 if packable else 4)

    def has(self, name: str) -> bool:
        return name in self._by_hf_name

    def get(self, name: str) -> torch.Tensor:
        gguf_name = self._by_hf_name.get(name)
        if gguf_name is None:
            raise ModelLoadError(f"GGUF file has no tensor for {name!r}")
        return self._hf_rows(name, torch.from_numpy(self._dequantize(gguf_name)))

    def get_packed(self, name: str) -> PackedWeight | None:
        """The tensor's blocks when it is a Q4_0/Q4_1/Q8_0 matrix (rows in HF order), else None."""
        gguf_name = self._by_hf_name.get(name)
        if gguf_name is None:
            raise ModelLoadError(f"GGUF file has no tensor for {name!r}")
        info = self._tensors[gguf_name]
        kind = PACKED_GGML_TYPES.get(info.ggml_type)
        if kind is None or len(info.dims) != 2:
            return None
        block_size, type_size = self._gguf.GGML_QUANT_SIZES[self._gguf.GGMLQuantizationType(info.ggml_type)]
        raw = torch.from_numpy(self._container.raw(info, block_size, type_size).copy())
        in_features = info.dims[0]
        if kind == "q4_0":
            packed = q4_0_as_q4_1(raw, in_features)
        else:
            packed = PackedWeight(raw, BlockFormat.Q4_1 if kind == "q4_1" else BlockFormat.Q8_0, in_features)
        order = self._hf_rows(name, torch.arange(packed.out_features))
        return packed if order is None or torch.equal(order, torch.arange(packed.out_features)) else packed.rows(order)

    def _hf_rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (rows in GGUF order) with llama.cpp's Q/K row interleave undone."""
        if self.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute_rows(tensor, int(self._require_arch("attention.head_count")))
        if self.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            num_heads = int(self._require_arch("attention.head_count"))
            return unpermute_rows(tensor, int(self._arch_field("attention.head_count_kv", num_heads)))
        return tensor

    def _dequantize(self, gguf_name: str) -> np.ndarray:
        """float32 array in HF orientation ([out, in] for matrices)."""
        info = self._tensors[gguf_name]
        try:
            qtype = self._gguf.GGMLQuantizationType(info.ggml_type)
            block_size, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise UnsupportedModelFeature(f"{gguf_name}: unknown ggml type {info.ggml_type}") from exc
        raw = self._container.raw(info, block_size, type_size)
        try:
            array = self._gguf.dequantize(raw, qtype)
        except NotImplementedError as exc:
            raise UnsupportedModelFeature(f"{gguf_name}: cannot dequantize {qtype.name}: {exc}") from exc
        array = array.reshape(tuple(reversed(info.dims)))
        # Plain F32 tensors come back as read-only views of the memory map.
        return array if array.flags.writeable else array.copy()
