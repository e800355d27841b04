"""The proxy computes exactly the block hashes a worker's scheduler computes: chat and completion prompts,
token-id prompts, for the embedded SmolLM2 (its GGUF tokenizer and template) and a tokenizer and template
in the style of every supported architecture. Worker side: the worker's own tokenizer loading, request
parsing and preprocessing, and `Scheduler.add_request`; proxy side: `PromptHasher` built from the routing
info the worker serves, sent through its JSON wire form."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from pdserve.api.config import SchedulerConfig
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.manager import KVCacheManager
from pdserve.kv.routing_info import RoutingInfo
from pdserve.kv.specs import FullAttentionSpec, SlidingWindowSpec, plan_groups
from pdserve.models.gguf_file import GGUFCheckpoint
from pdserve.models.loader import embedded_model_path
from pdserve.models.tokenizer import Tokenizer
from pdserve.request import Request
from pdserve.server.kv_events_routes import routing_info
from pdserve.server.openai_routes import parse_body
from pdserve.server.preprocess import prepare_chat, prepare_completion
from proxy.routing.kv_prompt import PromptHasher
from tests.chat_styles import STYLES, write_hf_tokenizer

pytestmark = pytest.mark.anyio
BLOCK = 4  # small blocks: many of them per prompt, and a partial tail more often than not

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and politely."}
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Tell me a joke about numbers 12345 🦀."},
    {"role": "assistant", "content": "  Why was 6 afraid of 7? Because 7 8 9.  "},
    {"role": "user", "content": [{"type": "text", "text": "naïve café,"}, {"type": "text", "text": "ok?"}]},
]
CHAT_BODIES = [
    {"messages": CONVERSATION[:1]},
    {"messages": [SYSTEM, *CONVERSATION[:1]]},
    *({"messages": [SYSTEM, *CONVERSATION[:n]]} for n in (3, 5)),  # a conversation growing turn by turn
    {"messages": [{"role": "developer", "content": "Be terse."}, *CONVERSATION[:1]], "stream": True},
    {"messages": [SYSTEM, *CONVERSATION[:2]], "add_generation_prompt": False},
    {"messages": CONVERSATION[:1], "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]},
]
COMPLETION_BODIES = [
    {"prompt": "The quick brown fox jumps over the lazy dog. " * 3},
    {"prompt": ["def add(a, b):\n    return a + b\n"]},
    {"prompt": [5, 17, 3, 99, 42, 8, 8, 8, 1, 2, 3]},
    {"prompt": [[7, 6, 5, 4, 3, 2, 1]]},
]


@dataclass
class WorkerSide:
    """Just what the worker's preprocessing reads of an engine."""

    tokenizer: Tokenizer
    model_name: str = "m"
    max_model_len: int = 4096


@pytest.fixture
def anyio_backend():
    return "asyncio"


def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_vocab(GGUFCheckpoint(embedded_model_path()).vocab())


@pytest.fixture(scope="module", params=["smollm2-gguf", *STYLES])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "smollm2-gguf":
        return smollm2_tokenizer()
    directory = str(tmp_path_factory.mktemp(request.param))
    write_hf_tokenizer(directory, STYLES[request.param])
    return Tokenizer.from_hf_dir(directory)


async def worker_hashes(worker: WorkerSide, kv: KVCacheManager, path: str, body: dict) -> tuple[int, list[bytes]]:
    import json

    if path.endswith("/chat/completions"):
        prepared = await prepare_chat(worker, parse_body(ChatCompletionRequest, json.dumps(body).encode()))
    else:
        prepared = await prepare_completion(worker, parse_body(CompletionRequest, json.dumps(body).encode()))
    scheduler = Scheduler(SchedulerConfig(), kv, kv.block_size, worker.max_model_len)
    request = Request("r", list(prepared.prompts[0]), SamplingParams(max_tokens=1), (), time.monotonic())
    scheduler.add_request(request)
    return request.num_prompt_tokens, request.block_hashes


def proxy_hasher(worker: WorkerSide, kv: KVCacheManager) -> PromptHasher:
    served = routing_info(worker.tokenizer, worker.model_name, "epoch", kv).model_dump_json()
    return PromptHasher(RoutingInfo.model_validate_json(served))


async def test_proxy_block_hashes_equal_the_workers_for_every_prompt_form(tokenizer):
    worker = WorkerSide(tokenizer)
    kv = KVCacheManager(plan_groups([SlidingWindowSpec(8), FullAttentionSpec(), SlidingWindowSpec(8)]), 64, BLOCK)
    hasher = proxy_hasher(worker, kv)
    assert [g.spec for g in hasher.plan.groups] == [g.spec for g in kv.plan.groups]
    bodies = [("/v1/chat/completions", b) for b in CHAT_BODIES] + [("/v1/completions", b) for b in COMPLETION_BODIES]
    for _ in range(2):  # the second round reads chat pieces from the proxy's segment cache
        for path, body in bodies:
            expected_count, expected = await worker_hashes(worker, kv, path, body)
            blocks = await hasher.prompt_blocks(path, body)
            assert blocks is not None, body
            assert (blocks.num_tokens, list(blocks.block_hashes(BLOCK))) == (expected_count, expected), body
    assert hasher.segments.num_hits > 0


async def test_a_request_the_worker_would_reject_has_no_blocks(tokenizer):
    worker = WorkerSide(tokenizer)
    kv = KVCacheManager(plan_groups([FullAttentionSpec()]), 16, BLOCK)
    hasher = proxy_hasher(worker, kv)
    for path, body in [("/v1/chat/completions", {"messages": []}), ("/v1/completions", {"prompt": ""}),
                       ("/v1/completions", {"prompt": ["a", ""]}), ("/v1/chat/completions", {"messages": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})]:
        assert await hasher.prompt_blocks(path, body) is None


async def test_a_batch_of_prompts_is_routed_by_its_first_prompt(tokenizer):
    worker = WorkerSide(tokenizer)
    kv = KVCacheManager(plan_groups([FullAttentionSpec()]), 16, BLOCK)
    hasher = proxy_hasher(worker, kv)
    first = await hasher.prompt_blocks("/v1/completions", {"prompt": "the first prompt of the batch " * 4})
    batch = await hasher.prompt_blocks("/v1/completions", {"prompt": ["the first prompt of the batch " * 4, "b"]})
    assert batch is not None and batch == first


async def test_one_tokenization_gives_every_block_sizes_worker_its_own_hashes(tokenizer):
    """The hasher comes from a worker of 4-token blocks; a worker of 8-token blocks gets its own chain too."""
    worker = WorkerSide(tokenizer)
    specs = [SlidingWindowSpec(8), FullAttentionSpec()]
    hasher = proxy_hasher(worker, KVCacheManager(plan_groups(specs), 64, BLOCK))
    wider = KVCacheManager(plan_groups(specs), 64, 2 * BLOCK)
    bodies = [("/v1/chat/completions", CHAT_BODIES[3]), ("/v1/completions", COMPLETION_BODIES[0])]
    for path, body in bodies:
        blocks = await hasher.prompt_blocks(path, body)
        expected_count, expected = await worker_hashes(worker, wider, path, body)
        assert blocks is not None and (blocks.num_tokens, list(blocks.block_hashes(2 * BLOCK))) == (
            expected_count, expected), body
        assert len(expected) == blocks.num_tokens // (2 * BLOCK) > 0
        assert blocks.block_hashes(2 * BLOCK) is blocks.block_hashes(2 * BLOCK)  # hashed once per block size


async def test_a_token_id_the_block_hash_cannot_pack_routes_by_load():
    hasher = proxy_hasher(WorkerSide(smollm2_tokenizer()), KVCacheManager(plan_groups([FullAttentionSpec()]), 16,
                                                                          BLOCK))
    assert await hasher.prompt_blocks("/v1/completions", {"prompt": [5, 2**63]}) is None
    blocks = await hasher.prompt_blocks("/v1/completions", {"prompt": [5, 2**63 - 1, 7, 8, 9]})
    assert blocks is not None and len(blocks.block_hashes(1)) == 5
