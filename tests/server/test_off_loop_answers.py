"""Large answers are formatted off the event loop; small ones stay on it (a thread hop costs more
than they do)."""

from __future__ import annotations

import asyncio
import json
import threading

from pdserve.api.protocol import ModelCard, ModelList
from pdserve.server.generation import GenerationResult
from pdserve.server.openai_routes import OFF_LOOP_ENTRIES, answer_size, final_json_response


def test_the_size_counts_tokens_alternatives_and_prompt_logprobs():
    plain = GenerationResult(num_prompt_tokens=3, token_ids=[1, 2, 3])
    rich = GenerationResult(num_prompt_tokens=3, token_ids=[1, 2], top_logprobs=[((1, -0.1), (4, -2.0)), ((2, -0.2),)],
                            prompt_logprobs=(None, ((5, -1.0), (6, -1.5)), ((7, -0.5),)))
    assert answer_size([plain]) == 3
    assert answer_size([plain, rich]) == 3 + 2 + 3 + (1 + 2) + (1 + 1)


def test_a_large_answer_is_built_on_another_thread_and_a_small_one_on_the_loop():
    built_on = {}

    def build(label: str):
        def make() -> ModelList:
            built_on[label] = threading.get_ident()
            return ModelList(data=[ModelCard(id=label, created=0, max_model_len=8)])
        return make

    async def both() -> tuple[int, list]:
        loop_thread = threading.get_ident()
        small = await final_json_response(build("small"), OFF_LOOP_ENTRIES, {"x-request-id": "a"})
        large = await final_json_response(build("large"), OFF_LOOP_ENTRIES + 1, {"x-request-id": "b"})
        return loop_thread, [small, large]

    loop_thread, (small, large) = asyncio.run(both())
    assert built_on["small"] == loop_thread != built_on["large"]
    assert json.loads(large.body)["data"][0]["id"] == "large" and large.headers["x-request-id"] == "b"
