"""The proxy's segment-caching tokenizer: equal to encoding the whole text, repeated pieces from its cache,
whole-text encoding for added tokens that do not split simply, a bounded cache, long text off the loop."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from proxy.routing import token_cache
from proxy.routing.token_cache import SegmentTokenizer
from tests.chat_styles import STYLES, build_tokenizer

pytestmark = pytest.mark.anyio

TURN = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def whole(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


async def test_a_repeated_conversation_is_tokenized_once_and_stays_exact():
    tokenizer = build_tokenizer(STYLES["qwen2"])
    segments = SegmentTokenizer(tokenizer)
    assert segments.splits_simply
    first = TURN + "<|im_start|>user\nAnd of Spain?<|im_end|>\n"
    assert await segments.encode(first) == whole(tokenizer, first)
    misses = segments.num_misses
    second = first + "<|im_start|>assistant\nMadrid.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
    assert await segments.encode(second) == whole(tokenizer, second)
    assert segments.num_misses - misses == 2 and segments.num_hits >= misses  # only the two new pieces


async def test_added_tokens_that_strip_whitespace_make_it_encode_whole_texts():
    tokenizer = build_tokenizer(STYLES["qwen2"])
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    segments = SegmentTokenizer(tokenizer)
    assert not segments.splits_simply
    text = "a sentence <mask> and more <|im_end|>  tail"
    assert await segments.encode(text) == whole(tokenizer, text)
    assert segments.num_misses == segments.num_hits == 0


async def test_the_cache_stays_within_its_bounds():
    tokenizer = build_tokenizer(STYLES["qwen2"])
    segments = SegmentTokenizer(tokenizer, max_pieces=3, max_chars=10_000)
    for index in range(10):
        text = f"<|im_start|>user\nquestion number {index}<|im_end|>"
        assert await segments.encode(text) == whole(tokenizer, text)
    assert len(segments._pieces) <= 3


async def test_long_text_is_encoded_off_the_event_loop_with_the_same_ids(monkeypatch):
    tokenizer = build_tokenizer(STYLES["llama3"])
    monkeypatch.setattr(token_cache, "ASYNC_MIN_CHARS", 16)
    segments = SegmentTokenizer(tokenizer)
    text = "<|start_header_id|>user<|end_header_id|>\n\n" + "The quick brown fox jumps. " * 40 + "<|eot_id|>"
    assert await segments.encode(text) == whole(tokenizer, text)
