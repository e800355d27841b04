"""Drives a real engine (model, paged pool, scheduler) synchronously on the test's thread."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.app.engine_factory import BuiltEngine, build_engine
from pdserve.metrics import Metrics
from pdserve.models.loader import LoadedModel
from pdserve.request import GenerationRequest, RequestOutput


@dataclass
class Collected:
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for output in self.outputs for t in output.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(output.new_text for output in self.outputs)

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def make_engine(
    model_path: Optional[str] = None,
    *,
    block_size: int = 16,
    num_blocks: int = 512,
    budget: int = 512,
    max_running: int = 64,
    prefix_caching: bool = True,
    loaded: Optional[LoadedModel] = None,
    device: str = "cpu",
    dtype: str = "float32",
    compile_decode: bool = False,
    snapshot_interval: Optional[int] = None,
    kv_cache_dtype: str = "auto",
) -> BuiltEngine:
    config = WorkerConfig(
        model=ModelConfig(path=model_path, device=device, dtype=dtype, compile=compile_decode),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          state_snapshot_interval_blocks=snapshot_interval, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_running=max_running),
    )
    return build_engine(config, Metrics(), loaded)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def generate(built: BuiltEngine, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
             prefix: str = "req") -> list[Collected]:
    """Submit every prompt at once, run until all finish, return outputs in prompt order."""
    loop = built.engine.engine_loop
    collected = [Collected() for _ in prompts]
    for index, prompt in enumerate(prompts):
        loop.submit(GenerationRequest(f"{prefix}-{index}", tuple(prompt), sampling), collected[index].outputs.append)
    loop.run_until_idle()
    built.kv_manager.check_invariants()
    return collected


def generate_one_by_one(built: BuiltEngine, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Collected]:
    return [generate(built, [prompt], sampling, prefix=f"seq{index}")[0] for index, prompt in enumerate(prompts)]


def engine_with_tier(loaded, num_blocks: int, offload_bytes: Optional[int], offload_dir: Optional[str] = None,
                     block_size: int = 4) -> BuiltEngine:
    """A CPU engine with a small pool and, given `offload_bytes`, an offload tier (in `offload_dir`: on disk)."""
    config = WorkerConfig(
        model=ModelConfig(device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_offload_bytes=offload_bytes,
                          kv_offload_dir=offload_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_running=4),
    )
    return build_engine(config, Metrics(), loaded)


def two_passes(built: BuiltEngine, prompts):
    """Every prompt once, then every prompt again: (answers of both passes, prompt tokens computed in the second)."""
    sampling = greedy(8, ignore_eos=True)
    first = generate_one_by_one(built, prompts, sampling)
    computed_before = built.engine.engine_loop.stats.num_computed_prompt_tokens
    second = generate_one_by_one(built, prompts, sampling)
    computed = built.engine.engine_loop.stats.num_computed_prompt_tokens - computed_before
    return [r.token_ids for r in first], [r.token_ids for r in second], computed
