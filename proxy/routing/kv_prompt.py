"""A request's prompt blocks as a worker will hash them: same validation, template, tokenizer and chain;
and `KVRoute`, the routing state a request carries (its blocks, what was predicted per worker).

Invariant: for every request a worker accepts, `PromptHasher.prompt_blocks`
returns the token ids that worker's scheduler computes, and their chained block
hashes for the worker's block size, because it runs the workers' own code on
the worker's own data:
`pdserve.api.protocol` (message normalization), `pdserve.api.chat_template`
(rendering), the worker's serialized tokenizer, `pdserve.kv.hashing` (the
chain). Rendering and tokenizing happen once per request, hashing once per
block size asked for: workers may differ in block size, while the tokenizer,
template and KV group plan are the model's, the same on every worker. A
request the worker would reject yields None (routing then falls back to
load). Everything imported here is torch-free (tests/test_import_rules.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import tokenizers
from pydantic import ValidationError

from pdserve.api.chat_template import ChatTemplate
from pdserve.api.errors import PdserveError
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.kv.hashing import HASH_SCHEME, hash_full_blocks
from pdserve.kv.routing_info import RoutingInfo
from pdserve.kv.specs import KVGroupPlan
from proxy.routing.token_cache import ASYNC_MIN_CHARS, SegmentTokenizer

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the token ids a block hash can pack


class IncompatibleWorker(ValueError):
    """The worker hashes blocks in a way this proxy cannot reproduce."""


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's token ids, and its chained block hashes for any block size.

    Invariant: `block_hashes(n)` equals `hash_full_blocks(token_ids, n, [])`, the
    chain a worker with blocks of n tokens computes, and never raises for n >= 1
    (every id is an int64); each size is hashed at most once per prompt, however
    many candidates ask. Equality compares the token ids alone.
    """

    token_ids: tuple[int, ...]
    _hashes_by_block_size: dict[int, tuple[bytes, ...]] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def block_hashes(self, block_size: int) -> tuple[bytes, ...]:
        hashes = self._hashes_by_block_size.get(block_size)
        if hashes is None:
            hashes = tuple(hash_full_blocks(self.token_ids, block_size, []))
            self._hashes_by_block_size[block_size] = hashes
        return hashes


class PromptHasher:
    """Built once from a worker's routing info (GET /internal/kv/routing_info)."""

    def __init__(self, info: RoutingInfo):
        if info.hash_scheme != HASH_SCHEME:
            raise IncompatibleWorker(f"worker hashes with {info.hash_scheme!r}, this proxy with {HASH_SCHEME!r}")
        if info.block_size < 1:
            raise IncompatibleWorker(f"worker has blocks of {info.block_size} tokens")
        self.model = info.model
        self.block_size = info.block_size  # the answering worker's; each worker is matched with its own
        self.prefix_caching = info.prefix_caching
        self.plan: KVGroupPlan = info.group_plan()
        self._tokenizer = tokenizers.Tokenizer.from_str(info.tokenizer_json)
        self._segments = SegmentTokenizer(self._tokenizer)
        specials = {"bos_token": info.bos_token, "eos_token": info.eos_token}
        self._template = ChatTemplate(info.chat_template, specials) if info.chat_template else None

    @property
    def segments(self) -> SegmentTokenizer:
        return self._segments

    async def prompt_blocks(self, path: str, body: dict[str, Any]) -> Optional[PromptBlocks]:
        try:
            token_ids = await self._token_ids(path, body)
        except (ValidationError, PdserveError, ValueError, TypeError) as exc:
            logger.debug("no prompt blocks for this request: %s", exc)
            return None
        if not token_ids:
            return None
        return PromptBlocks(tuple(token_ids))

    async def _token_ids(self, path: str, body: dict[str, Any]) -> Optional[list[int]]:
        if path.endswith("/chat/completions"):
            if self._template is None:
                return None
            chat = ChatCompletionRequest.model_validate(body)
            tools = chat.template_tools()  # the workers render them into the prompt too
            text = self._template.render(chat.template_messages(), add_generation_prompt=chat.add_generation_prompt,
                                         **({"tools": tools} if tools else {}))
            # The rendered template spells out its special tokens (pdserve/server/preprocess.py).
            return await self._segments.encode(text)
        # A batch is computed by the decode worker alone: its first prompt routes it.
        prompt = CompletionRequest.model_validate(body).prompt_inputs()[0]
        if not isinstance(prompt, str):
            return _hashable_token_ids(prompt)
        if len(prompt) >= ASYNC_MIN_CHARS:
            return (await self._tokenizer.async_encode(prompt, add_special_tokens=True)).ids
        return self._tokenizer.encode(prompt, add_special_tokens=True).ids


def _hashable_token_ids(token_ids: Sequence[int]) -> list[int]:
    """A client's token ids, or ValueError when one does not fit the int64 a block hash packs."""
    if min(token_ids) < INT64_MIN or max(token_ids) > INT64_MAX:
        raise ValueError("a prompt token id does not fit in 64 bits")
    return list(token_ids)


@dataclass(slots=True)
class KVRoute:
    """One request's routing state: its prompt blocks and what was predicted for each worker chosen."""

    blocks: Optional[PromptBlocks]
    predicted: dict[str, int] = field(default_factory=dict)  # backend url -> cached tokens predicted
