"""Tokenizer built from the embedded GGUF vs transformers' tokenizer of the
same file; chat templates; streaming detokenization; HF-directory tokenizers."""

from __future__ import annotations

import json

import pytest

from pdserve.api.errors import InvalidRequest
from pdserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.models.hf_oracle import write_word_tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "naïve café — “quotes” and ‘apostrophes’ don't it's we'll",
    "Emoji: 🦀🚀👍🏽 and CJK: 你好，世界。日本語のテキスト。한국어",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n",
]

MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke about 🦀."},
    ],
]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2) -> Tokenizer:
    return smollm2.tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_encodes_like_transformers(gguf_tokenizer, hf_smollm2_tokenizer, text):
    assert gguf_tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
    assert gguf_tokenizer.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(
        text, add_special_tokens=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_gguf_tokenizer_decodes_like_transformers(gguf_tokenizer, hf_smollm2_tokenizer, skip_special_tokens):
    for text in TEXTS:
        ids = hf_smollm2_tokenizer.encode(text)
        expected = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert gguf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.slow
@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(gguf_tokenizer, hf_smollm2_tokenizer, messages, add_generation_prompt):
    ours = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert gguf_tokenizer.encode(ours, add_special_tokens=False) == hf_smollm2_tokenizer.encode(
        theirs, add_special_tokens=False
    )


@pytest.mark.slow
def test_gguf_special_tokens_and_ids(gguf_tokenizer, hf_smollm2_tokenizer):
    assert gguf_tokenizer.eos_token_ids == (hf_smollm2_tokenizer.eos_token_id,) == (2,)
    assert gguf_tokenizer.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert gguf_tokenizer.vocab_size == 49152
    assert gguf_tokenizer.id_to_token(2) == "<|im_end|>"
    assert gguf_tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]


def _stream(tokenizer: Tokenizer, ids: list[int], step: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas, "".join(deltas)


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer_never_emits_broken_characters(gguf_tokenizer, step):
    text = "Crabs 🦀 go fast 🚀🚀! 你好，世界 — 日本語 👍🏽 done"
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE splits these characters over several tokens, so holding back matters.
    assert any("\ufffd" in gguf_tokenizer.decode([i]) for i in ids)
    deltas, joined = _stream(gguf_tokenizer, ids, step)
    assert all("\ufffd" not in d for d in deltas)
    assert joined == gguf_tokenizer.decode(ids) == text


@pytest.mark.slow
def test_incremental_detokenizer_skips_special_tokens_and_matches_full_decode(gguf_tokenizer):
    ids = gguf_tokenizer.encode("<|im_start|>assistant\nParis is nice.<|im_end|>", add_special_tokens=False)
    deltas, joined = _stream(gguf_tokenizer, ids)
    assert joined == gguf_tokenizer.decode(ids) == "assistant\nParis is nice."


@pytest.mark.slow
def test_incremental_detokenizer_flush_releases_an_unfinished_character(gguf_tokenizer):
    ids = gguf_tokenizer.encode("ok 🦀", add_special_tokens=False)
    truncated = ids[:-1]  # the crab's last byte never arrives
    detok = IncrementalDetokenizer(gguf_tokenizer)
    streamed = "".join(detok.push([i]) for i in truncated)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == gguf_tokenizer.decode(truncated)


def test_hf_dir_tokenizer_reads_template_special_tokens_and_generation_eos(tmp_path):
    write_word_tokenizer(str(tmp_path), vocab_size=16, eos_token_ids=(1, 7))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    assert tokenizer.eos_token_ids == (1, 7, 9)  # generation config first, then config, then the eos token
    assert tokenizer.bos_token_id == 2
    assert tokenizer.vocab_size == 16
    assert tokenizer.encode("w3 w4") == [3, 4]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "w5"}])
    assert prompt == "<bos>w5 "


def test_chat_template_file_wins_over_tokenizer_config(tmp_path):
    write_word_tokenizer(str(tmp_path), vocab_size=8)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}|{{ messages[0] | tojson }}")
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "<b>&é"}])
    assert rendered == '1|{"role": "user", "content": "<b>&é"}'  # no HTML escaping, no ASCII escaping


def test_chat_template_raise_exception_is_an_invalid_request(tmp_path):
    write_word_tokenizer(str(tmp_path), vocab_size=8)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_cannot_reach_python_internals(tmp_path):
    write_word_tokenizer(str(tmp_path), vocab_size=8)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_dir(str(tmp_path))
    with pytest.raises(InvalidRequest):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
