"""Turn a validated OpenAI request into the engine's `GenerationRequest`.

Everything the engine would choke on is rejected here with a typed error:
unknown model, empty prompt, token ids outside the vocabulary, prompts that
do not fit the context. The engine only ever sees well-formed requests.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pdserve.errors import EngineNotReady, InvalidRequest, ModelNotFound, PdserveError
from pdserve.pd.params import RemoteDecodeRequest, parse_kv_transfer_params
from pdserve.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIRequest, check_token_budget,
                              to_sampling_params)
from pdserve.request import GenerationRequest

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient

logger = logging.getLogger(__name__)


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
    size = getattr(engine.tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else None


async def prepare_completion(
    engine: "EngineClient", body: CompletionRequest, request_id: str
) -> GenerationRequest:
    prompt = body.prompt_input()
    if isinstance(prompt, str):
        # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
        token_ids = await asyncio.to_thread(engine.tokenizer.encode, prompt, add_special_tokens=True)
    else:
        token_ids = prompt
        check_token_ids(token_ids, _vocab_size(engine), "prompt")
    return _build(engine, body, list(token_ids), request_id, prompt_param="prompt")


async def prepare_chat(
    engine: "EngineClient", body: ChatCompletionRequest, request_id: str
) -> GenerationRequest:
    token_ids = await asyncio.to_thread(_tokenize_chat, engine.tokenizer, body)
    return _build(engine, body, token_ids, request_id, prompt_param="messages")


def _tokenize_chat(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt
        )
    except PdserveError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template raising on odd messages is the user's input, not a bug
        logger.debug("chat template rejected the messages", exc_info=exc)
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
    # The rendered template already holds the special tokens (BOS, role markers).
    return list(tokenizer.encode(text, add_special_tokens=False))


def _build(
    engine: "EngineClient",
    body: OpenAIRequest,
    token_ids: list[int],
    request_id: str,
    *,
    prompt_param: str,
) -> GenerationRequest:
    if not token_ids:
        raise InvalidRequest(f"{prompt_param} must not be empty", param=prompt_param)
    check_token_ids(body.stop_token_ids or (), _vocab_size(engine), "stop_token_ids")
    sampling = to_sampling_params(
        body, num_prompt_tokens=len(token_ids), max_model_len=engine.max_model_len, prompt_param=prompt_param
    )
    kv_params = parse_kv_transfer_params(body.kv_transfer_params)
    if isinstance(kv_params, RemoteDecodeRequest):  # P: would the decode leg fit? Ask before computing.
        check_token_budget(len(token_ids), kv_params.decode_max_tokens, kv_params.decode_min_tokens,
                           engine.max_model_len, prompt_param=prompt_param)
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=tuple(token_ids),
        sampling=sampling,
        kv_params=kv_params,
    )
