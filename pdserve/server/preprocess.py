"""Turn a validated OpenAI request into a `PreparedRequest`: token ids and sampling per prompt.

Everything the engine would choke on is rejected here with a typed error:
unknown model, empty prompt, token ids outside the vocabulary, prompts that
do not fit the context. The engine only ever sees well-formed requests.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pdserve.api.config import LimitsConfig
from pdserve.api.errors import EngineNotReady, InvalidRequest, ModelNotFound, PdserveError
from pdserve.api.kv_transfer import (AwaitedPrefillParams, KVTransferRequest, RemoteDecodeRequest, RemotePrefillParams,
                                     parse_kv_transfer_params)
from pdserve.api.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIRequest, check_token_budget,
                              to_sampling_params)
from pdserve.api.sampling import SamplingParams
from pdserve.api.validation import answer_entries, check_output_budget
from pdserve.grammar.compiler import compile_constraint
from pdserve.grammar.errors import GrammarTokenizerUnavailable

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient

logger = logging.getLogger(__name__)
DEFAULT_LIMITS = LimitsConfig()  # frozen: the bounds a caller that passes none gets


def ensure_ready(engine: "EngineClient") -> None:
    if not engine.is_ready():
        raise EngineNotReady("the model is not ready to serve yet; retry later")


def check_model(engine: "EngineClient", requested: Optional[str]) -> None:
    if requested is not None and requested != engine.model_name:
        raise ModelNotFound(
            f"The model '{requested}' does not exist; this server serves '{engine.model_name}'.", param="model"
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: Optional[int], param: str) -> None:
    if not token_ids:
        return
    low, high = min(token_ids), max(token_ids)
    if low < 0:
        raise InvalidRequest(f"{param}: token id {low} is negative", param=param)
    if vocab_size is not None and high >= vocab_size:
        raise InvalidRequest(f"{param}: token id {high} is out of range (vocabulary size {vocab_size})", param=param)


def _vocab_size(engine: "EngineClient") -> Optional[int]:
    return engine.tokenizer.vocab_size


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request ready to fan out: one entry per prompt, `num_choices` answers each."""

    prompts: tuple[tuple[int, ...], ...]
    sampling: tuple[SamplingParams, ...]  # per prompt (the default max_tokens depends on its length)
    num_choices: int
    kv_params: Optional[KVTransferRequest] = None

    def num_output_entries(self) -> int:
        """Token entries the whole answer could hold (`max_output_entries` bounds it)."""
        return self.num_choices * sum(
            answer_entries(s.max_tokens, s.top_logprobs, len(ids), s.prompt_logprobs)
            for ids, s in zip(self.prompts, self.sampling))


async def prepare_completion(engine: "EngineClient", body: CompletionRequest,
                             limits: LimitsConfig = DEFAULT_LIMITS) -> PreparedRequest:
    prompts = []
    for prompt in body.prompt_inputs():
        if isinstance(prompt, str):
            # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
            prompts.append(await asyncio.to_thread(engine.tokenizer.encode, prompt, add_special_tokens=True))
        else:
            check_token_ids(prompt, _vocab_size(engine), "prompt")
            prompts.append(list(prompt))
    return await _build(engine, body, prompts, limits, prompt_param="prompt")


async def prepare_chat(engine: "EngineClient", body: ChatCompletionRequest,
                       limits: LimitsConfig = DEFAULT_LIMITS) -> PreparedRequest:
    token_ids = await asyncio.to_thread(tokenize_chat, engine.tokenizer, body)
    return await _build(engine, body, [token_ids], limits, prompt_param="messages")


def tokenize_chat(tokenizer: Any, body: Any) -> list[int]:
    """The prompt of a chat request (`ChatCompletionRequest`, or a /tokenize body with messages)."""
    extra = {}
    tools = body.template_tools() if hasattr(body, "template_tools") else None
    if tools:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt, **extra
        )
    except PdserveError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template raising on odd messages is the user's input, not a bug
        logger.debug("chat template rejected the messages", exc_info=exc)
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
    # The rendered template already holds the special tokens (BOS, role markers).
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _build(engine: "EngineClient", body: OpenAIRequest, prompts: list[list[int]], limits: LimitsConfig, *,
                 prompt_param: str) -> PreparedRequest:
    kv_params = parse_kv_transfer_params(body.kv_transfer_params)
    _check_pd_combinations(body, kv_params, len(prompts))
    check_token_ids(body.stop_token_ids or (), _vocab_size(engine), "stop_token_ids")
    check_token_ids([token_id for token_id, _ in body.logit_bias_pairs()], _vocab_size(engine), "logit_bias")
    prefill_leg = isinstance(kv_params, RemoteDecodeRequest)
    # Compiled on a prefill leg too, though only decode runs it: a grammar the decode worker would
    # refuse must be refused before the prompt is computed and pinned.
    grammar = await _grammar(engine, body)
    sampling = []
    for token_ids in prompts:
        if not token_ids:
            raise InvalidRequest(f"{prompt_param} must not be empty", param=prompt_param)
        sampling.append(to_sampling_params(body, num_prompt_tokens=len(token_ids), max_model_len=engine.max_model_len,
                                           prompt_param=prompt_param, grammar=None if prefill_leg else grammar))
        if isinstance(kv_params, RemoteDecodeRequest):  # P: would the decode leg fit? Ask before computing.
            check_token_budget(len(token_ids), kv_params.decode_max_tokens, kv_params.decode_min_tokens,
                               engine.max_model_len, prompt_param=prompt_param)
    # A prefill leg computes the prompt once, whatever n: the decode worker fans out.
    num_choices = 1 if prefill_leg else body.num_choices
    prepared = PreparedRequest(tuple(tuple(ids) for ids in prompts), tuple(sampling), num_choices, kv_params)
    check_output_budget(prepared.num_output_entries(), limits)
    return prepared


def _check_pd_combinations(body: OpenAIRequest, kv_params: Optional[KVTransferRequest], num_prompts: int) -> None:
    if kv_params is not None and num_prompts > 1:
        raise InvalidRequest("kv_transfer_params serve one prompt: send batched prompts without them", param="prompt")
    if isinstance(kv_params, (RemotePrefillParams, AwaitedPrefillParams)) and body.prompt_logprobs_count is not None:
        # The prefill worker computed the prompt; this worker has none of its logits.
        raise InvalidRequest("echo with logprobs needs the prompt computed here: send it without kv_transfer_params "
                             "(the pdserve proxy does)", param="echo")


async def _grammar(engine: "EngineClient", body: OpenAIRequest) -> Optional[str]:
    constraint = body.output_constraint()
    if constraint is None:
        return None
    grammar = await asyncio.to_thread(compile_constraint, constraint)
    tokenizer = engine.grammar_tokenizer
    if tokenizer is not None:  # built once, here rather than on the engine thread
        try:
            await asyncio.to_thread(tokenizer.get)
        except GrammarTokenizerUnavailable as error:
            param = constraint.param or "response_format"
            raise InvalidRequest(f"{param}: structured outputs are not available for this model: {error}",
                                 param=param) from None
    return grammar
