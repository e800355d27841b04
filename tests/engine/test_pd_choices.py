"""n > 1 on a decode worker in one process: one KV pull serves every choice, the siblings reuse the
pulled blocks (they compute only the prompt's last partial block) and answer like a colocated run."""

from __future__ import annotations

import pytest

from pdserve.transfer.fake_transport import FakeFabric
from tests.engine.inprocess import metric_value, start_worker
from tests.engine.test_pd_in_process import (  # noqa: F401
    BODY, PROMPTS, anyio_backend, prefill_params, qwen_dir, wait_until,
)

pytestmark = pytest.mark.anyio


async def test_one_pull_serves_all_choices_and_they_equal_the_colocated_answer(qwen_dir):
    fabric = FakeFabric()
    colocated = start_worker("colocated", qwen_dir, fabric)
    prefill = start_worker("prefill", qwen_dir, fabric)
    decode = start_worker("decode", qwen_dir, fabric, prefill_app=prefill.app)
    try:
        prompt = PROMPTS[0]  # 30 tokens: 7 full blocks of 4, then 2
        async with colocated.client() as client:
            local = (await client.post("/v1/completions", json={**BODY, "prompt": prompt})).json()
        params = await prefill_params(prefill, prompt, "fan-out")
        async with decode.client() as client:
            response = await client.post("/v1/completions", headers={"X-Request-Id": "fan-out"},
                                         json={**BODY, "prompt": prompt, "n": 3, "kv_transfer_params": params})
        assert response.status_code == 200, response.text
        body = response.json()
        assert [choice["text"] for choice in body["choices"]] == [local["choices"][0]["text"]] * 3
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == 3 * BODY["max_tokens"]
        assert metric_value(decode.metrics, "pdserve_transfer_duration_seconds_count") == 1  # one pull
        # The leader starts from P's first token and computes no prompt token; each sibling the 2 tokens of
        # the partial block (the leader's full blocks joined the prefix cache when its token 1 went out).
        assert metric_value(decode.metrics, "pdserve_engine_computed_prompt_tokens_total") == 0 + 2 * 2
        assert metric_value(decode.metrics, "pdserve_pd_first_token_from_prefill_total") == 1
        # The engine thread frees the ids once the blocks are back, which may be just after the answer left.
        assert await wait_until(lambda: len(decode.built.engine.request_ids) == 0)
    finally:
        for worker in (decode, prefill, colocated):
            worker.close()
