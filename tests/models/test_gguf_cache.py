"""The GGUF conversion cache: a miss converts and stores, a hit serves exactly what the GGUF serves without
converting, and a torn, altered or foreign cache file is rebuilt, never read. A tiny llama GGUF whose
matrices are Q8_0, Q4_1 and Q4_0 blocks (Q/K rows in llama.cpp's order) and whose norms are F32."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pdserve.models import gguf_cache
from pdserve.models.gguf_cache import ConvertedGGUF, cache_dir, converted_gguf
from pdserve.models.gguf_file import GGUFCheckpoint
from pdserve.models.gguf_tokenizer import byte_alphabet
from pdserve.models.loader import load_model

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16
MATRIX_TYPES = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
                "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


def write_tiny_gguf(path: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tokens = [*byte_alphabet().values(), "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    writer.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.random(HIDDEN).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.random(HIDDEN).astype(np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", rng.random(HIDDEN).astype(np.float32))
    for key, shape in shapes.items():
        kind = gguf.GGMLQuantizationType[MATRIX_TYPES[key]]
        blocks = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), kind)
        writer.add_tensor(f"blk.0.{key}.weight", blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path) -> str:
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def assert_serves_what_the_gguf_serves(source, path: str, keep_packed: bool) -> None:
    original = GGUFCheckpoint(path)
    assert source.hf_config() == original.hf_config()
    assert source.vocab() == original.vocab()
    for name in original.tensor_names():
        assert source.has(name)
        assert torch.equal(source.get(name), original.get(name)), name
        packed, expected = source.get_packed(name), original.get_packed(name)
        assert (packed is None) == (expected is None), name
        if expected is not None:
            assert packed.format is expected.format and packed.in_features == expected.in_features
            assert torch.equal(packed.blocks, expected.blocks), name


def cache_files(directory) -> list:
    return sorted(directory.glob("*.safetensors"))


@pytest.mark.parametrize("keep_packed", [False, True], ids=["float", "packed"])
def test_a_miss_converts_and_stores_and_a_hit_serves_the_same_without_converting(tiny_gguf, tmp_path, keep_packed,
                                                                                 monkeypatch):
    directory = tmp_path / "cache"
    first = converted_gguf(tiny_gguf, keep_packed, directory)
    assert isinstance(first, ConvertedGGUF)
    assert_serves_what_the_gguf_serves(first, tiny_gguf, keep_packed)
    (file,) = cache_files(directory)
    assert ("packed" if keep_packed else "float") in file.name

    def no_conversion(*args):
        raise AssertionError("a hit converted again")

    monkeypatch.setattr(gguf_cache, "convert", no_conversion)
    second = converted_gguf(tiny_gguf, keep_packed, directory)
    assert_serves_what_the_gguf_serves(second, tiny_gguf, keep_packed)
    assert cache_files(directory) == [file]


def torn(data: bytes) -> bytes:
    return data[: len(data) // 2]


def flipped_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def garbage(data: bytes) -> bytes:
    return b"\xff" * 64


@pytest.mark.parametrize("damage", [torn, flipped_last_byte, garbage, lambda data: b""],
                         ids=["torn", "one-bit-altered", "garbage", "empty"])
def test_a_damaged_cache_file_is_never_read_but_rebuilt(tiny_gguf, tmp_path, damage, caplog):
    directory = tmp_path / "cache"
    converted_gguf(tiny_gguf, True, directory)
    (file,) = cache_files(directory)
    whole = file.read_bytes()
    file.write_bytes(damage(whole))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        rebuilt = converted_gguf(tiny_gguf, True, directory)
    assert "unusable" in caplog.text
    assert_serves_what_the_gguf_serves(rebuilt, tiny_gguf, True)
    assert file.read_bytes() == whole


def test_another_gguf_or_converter_version_is_a_miss_and_a_file_under_a_wrong_name_is_refused(tiny_gguf, tmp_path,
                                                                                              monkeypatch):
    directory = tmp_path / "cache"
    converted_gguf(tiny_gguf, True, directory)
    other = str(tmp_path / "other.gguf")
    write_tiny_gguf(other, seed=1)
    converted_gguf(other, True, directory)
    assert len(cache_files(directory)) == 2
    monkeypatch.setattr(gguf_cache, "CONVERTER_VERSION", gguf_cache.CONVERTER_VERSION + 1)
    newer = converted_gguf(tiny_gguf, True, directory)
    assert_serves_what_the_gguf_serves(newer, tiny_gguf, True)
    files = cache_files(directory)
    assert len(files) == 3
    # A file renamed to another key says whose it is in its header: refused, then rebuilt.
    mine = next(f for f in files if f"-v{gguf_cache.CONVERTER_VERSION}-" in f.name)
    mine.write_bytes(next(f for f in files if f != mine and "-v1-" in f.name).read_bytes())
    assert_serves_what_the_gguf_serves(converted_gguf(tiny_gguf, True, directory), tiny_gguf, True)


def test_an_unwritable_cache_serves_the_conversion_and_off_serves_the_gguf_itself(tiny_gguf, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        source = converted_gguf(tiny_gguf, False, blocked / "cache")
    assert "cannot write" in caplog.text
    assert_serves_what_the_gguf_serves(source, tiny_gguf, False)
    assert cache_dir({"PDSERVE_CACHE_DIR": "off"}) is None
    assert cache_dir({"PDSERVE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pdserve" / "gguf"


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_model_loaded_through_the_cache_equals_one_loaded_from_the_gguf(tiny_gguf, tmp_path, monkeypatch,
                                                                          quantization):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "off")
    direct = load_model(tiny_gguf, torch.float32, torch.device("cpu"), quantization).model.state_dict()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    for _ in ("miss", "hit"):
        cached = load_model(tiny_gguf, torch.float32, torch.device("cpu"), quantization).model.state_dict()
        assert cached.keys() == direct.keys()
        for name, tensor in direct.items():
            assert torch.equal(cached[name], tensor), name
