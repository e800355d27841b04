"""Recurrent-state models: decode speed against a dense model of the same size, and P->D bytes.

Three tables, one run:
(1) engine decode tokens/s at batch 1 and 16 of a random-weight Qwen3.5 shape (Gated DeltaNet layers,
    one full-attention layer in four) and of a dense Qwen3 with the same attention, hidden size and
    depth whose MLP is widened until it has the same parameter count;
(2) the bytes a decode worker pulls for a prompt of P tokens (the attention blocks of its first P-1
    tokens plus one page per state group, as `pdserve.kv` plans the pool), for a Qwen3.5-27B-shaped
    pool against the same model with every layer full attention, at several prompt lengths. Pages are
    moved whole, padding included; the "data" column is what the pages hold;
(3) the prefix cache's state snapshots against `--state-snapshot-interval`: pages the snapshots of
    eight cached 256-token prompts hold, prompt tokens a second pass recomputes when each prompt
    shares a random prefix with one of them (against what the KV alone would allow), and both passes'
    time.
Weight names and shapes come from transformers' own classes built on the meta device (no memory,
no download); values are random, seeded per tensor name.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Optional

import torch

from bench.kernels.moe import RandomWeights, decode_tokens_per_s, word_tokenizer
from bench.lib.report import markdown_table
from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.api.sampling import SamplingParams
from pdserve.app.engine_factory import build_engine
from pdserve.kv.layout import plan_for_model, plan_page_bytes
from pdserve.kv.specs import FullAttentionSpec, LayerSpec, RecurrentStateSpec
from pdserve.metrics import Metrics
from pdserve.models.loader import LoadedModel
from pdserve.models.registry import build_model
from pdserve.request import GenerationRequest

# Qwen3.5-27B as its published config reads (to our knowledge): 64 layers, one full-attention layer in
# four (24 query / 4 KV heads of 256), Gated DeltaNet with 16 key heads and 48 value heads of 128, kernel 4.
QWEN3_5_27B = {"layers": 64, "full_every": 4, "kv_heads": 4, "head_dim": 256, "key_heads": 16, "value_heads": 48,
               "key_dim": 128, "value_dim": 128, "conv_kernel": 4}


def _shapes_of(model_class_name: str, config: dict) -> dict[str, tuple[int, ...]]:
    import transformers

    config_class = getattr(transformers, model_class_name.replace("ForCausalLM", "Config").replace("Qwen3_5Config",
                                                                                                   "Qwen3_5TextConfig"))
    with torch.device("meta"):
        model = getattr(transformers, model_class_name)(config_class(**config))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _qwen3_5_config(args: argparse.Namespace) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64, "num_key_value_heads": 2,
            "head_dim": 64, "linear_num_key_heads": args.hidden // 128, "linear_num_value_heads": args.hidden // 64,
            "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
            "layer_types": layer_types, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _dense_config(args: argparse.Namespace, intermediate: int) -> dict:
    return {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _num_params(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


def state_model(args: argparse.Namespace) -> tuple[dict, RandomWeights, int]:
    """The Qwen3.5-shaped model of these flags: (config, random weights, parameters)."""
    config = _qwen3_5_config(args)
    shapes = _shapes_of("Qwen3_5ForCausalLM", config)
    return {**config, "architectures": ["Qwen3_5ForCausalLM"]}, RandomWeights(shapes), _num_params(shapes)


def matched_models(args: argparse.Namespace) -> dict[str, tuple[dict, RandomWeights, int]]:
    """{name: (config, weights, parameters)}: the state model and the dense one of the same size."""
    state = state_model(args)
    target = state[2]
    base = _num_params(_shapes_of("Qwen3ForCausalLM", _dense_config(args, 64)))
    per_width = (_num_params(_shapes_of("Qwen3ForCausalLM", _dense_config(args, 128))) - base) / 64
    intermediate = max(64, round((64 + (target - base) / per_width) / 32) * 32)
    dense_config = _dense_config(args, intermediate)
    dense_shapes = _shapes_of("Qwen3ForCausalLM", dense_config)
    return {
        "Qwen3.5 shape (3 DeltaNet : 1 attention)": state,
        f"dense Qwen3, same size (MLP {intermediate})": (
            {**dense_config, "architectures": ["Qwen3ForCausalLM"]}, RandomWeights(dense_shapes),
            _num_params(dense_shapes)),
    }


def layer_specs_27b(all_full: bool, state_dtype: str) -> list[LayerSpec]:
    shape = QWEN3_5_27B
    state = RecurrentStateSpec(
        "gated_delta_net", 2 * shape["key_heads"] * shape["key_dim"] + shape["value_heads"] * shape["value_dim"],
        shape["conv_kernel"] - 1, (shape["value_heads"], shape["key_dim"], shape["value_dim"]), state_dtype)
    return [FullAttentionSpec() if all_full or (i + 1) % shape["full_every"] == 0 else state
            for i in range(shape["layers"])]


def pull_bytes_rows(prompt_lengths: list[int], block_size: int, state_dtype: str) -> list[dict]:
    """Bytes pulled P->D per prompt length for the 27B shape, hybrid against all-full-attention (bf16 KV)."""
    rows = []
    for name, all_full in (("Qwen3.5-27B shape", False), ("same, every layer full attention", True)):
        specs = layer_specs_27b(all_full, state_dtype)
        plan = plan_for_model(specs, block_size, QWEN3_5_27B["kv_heads"], QWEN3_5_27B["head_dim"], torch.bfloat16)
        page_bytes = plan_page_bytes(plan, block_size, QWEN3_5_27B["kv_heads"], QWEN3_5_27B["head_dim"],
                                     torch.bfloat16)
        kv_page_bytes = plan.geometry.kv_page_bytes if plan.geometry is not None else page_bytes
        state_data = sum(g.spec.state_bytes * len(g.layer_ids) for g in plan.groups if g.is_state)
        num_attention = sum(1 for g in plan.groups if not g.is_state)
        num_state = len(plan.groups) - num_attention
        for length in prompt_lengths:
            blocks = -(-(length - 1) // block_size)
            rows.append({"model": name, "block_size": block_size, "prompt_tokens": length,
                         "attention_pages": blocks * num_attention, "state_pages": num_state,
                         "page_bytes": page_bytes,
                         "pulled_gib": round((blocks * num_attention + num_state) * page_bytes / 2**30, 3),
                         "data_gib": round((blocks * num_attention * kv_page_bytes + state_data) / 2**30, 3)})
    return rows


SNAPSHOT_PROMPTS, SNAPSHOT_PROMPT_TOKENS, SNAPSHOT_TAIL_TOKENS, SNAPSHOT_BLOCK = 8, 256, 32, 16


def snapshot_row(config: dict, weights: RandomWeights, interval: Optional[int],
                 num_prompts: int = SNAPSHOT_PROMPTS) -> dict:
    """Two passes through one engine with the prefix cache on: eight prompts, then eight that each share a
    random prefix (seeded) with one of them. The second pass's recomputed tokens beyond what the KV hit
    would allow are the price of snapshotting less often; the snapshot pages the first pass left, its memory."""
    loaded = LoadedModel(model=build_model(config, weights, torch.float32, torch.device("cpu")),
                         tokenizer=word_tokenizer(config["vocab_size"]), name="bench")
    worker = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=SNAPSHOT_BLOCK, num_blocks=2048,
                                            state_snapshot_interval_blocks=interval),
                          scheduler=SchedulerConfig(max_num_batched_tokens=4096))
    built = build_engine(worker, Metrics(), loaded)
    loop, manager = built.engine.engine_loop, built.kv_manager
    draw = random.Random(7)
    firsts = [[draw.randrange(3, config["vocab_size"]) for _ in range(SNAPSHOT_PROMPT_TOKENS)]
              for _ in range(num_prompts)]
    shared = [draw.randrange(SNAPSHOT_BLOCK, SNAPSHOT_PROMPT_TOKENS) for _ in firsts]
    seconds = [first[:n] + [draw.randrange(3, config["vocab_size"]) for _ in range(SNAPSHOT_TAIL_TOKENS)]
               for first, n in zip(firsts, shared)]

    def run(prompts: list[list[int]], tag: str) -> tuple[float, int]:
        computed_before = loop.stats.num_computed_prompt_tokens
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):  # one at a time: each second prompt finds its first's snapshots
            loop.submit(GenerationRequest(f"{tag}-{i}", tuple(prompt), SamplingParams(max_tokens=1)), lambda out: None)
            loop.run_until_idle()
        return time.perf_counter() - started, loop.stats.num_computed_prompt_tokens - computed_before

    first_s, _ = run(firsts, "first")
    state_groups = set(built.plan.state_group_ids)
    snapshot_pages = sum(1 for block in manager.pool.cached_blocks() if block.group_id in state_groups)
    kv_pages = sum(1 for block in manager.pool.cached_blocks() if block.group_id not in state_groups)
    second_s, recomputed = run(seconds, "second")
    kv_only = sum(len(p) - n // SNAPSHOT_BLOCK * SNAPSHOT_BLOCK for p, n in zip(seconds, shared))
    return {"interval_blocks": manager.state.snapshot_interval_blocks, "default": interval is None,
            "snapshot_pages": snapshot_pages, "kv_pages": kv_pages, "recomputed_tokens": recomputed,
            "recomputed_kv_bound": kv_only, "first_pass_s": round(first_s, 3), "second_pass_s": round(second_s, 3)}


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    for flag, default in (("--layers", 16), ("--hidden", 512), ("--intermediate", 1024), ("--vocab", 8192),
                          ("--prompt-tokens", 64), ("--new-tokens", 32), ("--threads", torch.get_num_threads())):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--snapshot-intervals", type=int, nargs="*", default=[0, 1, 2, 4],
                        help="snapshot intervals (blocks) measured besides the default one")
    parser.add_argument("--snapshot-repeats", type=int, default=3, help="runs of every interval (fastest kept)")


def run(args: argparse.Namespace) -> tuple[str, dict]:
    torch.set_num_threads(args.threads)
    engine_rows = []
    for name, (config, weights, num_params) in matched_models(args).items():
        for batch in (1, 16):
            tokens_per_s = decode_tokens_per_s(config, weights, batch, args.prompt_tokens, args.new_tokens)
            engine_rows.append({"model": name, "params_m": round(num_params / 1e6, 1), "batch": batch,
                                "decode_tokens_per_s": round(tokens_per_s, 1)})
    pull_rows = [row for block_size in args.block_sizes
                 for row in pull_bytes_rows(args.prompt_lengths, block_size, args.state_dtype)]
    state_config, state_weights, _ = state_model(args)
    intervals = (None, *args.snapshot_intervals)
    runs = [[snapshot_row(state_config, state_weights, interval) for interval in intervals]  # interleaved
            for _ in range(args.snapshot_repeats)]
    snapshot_rows = [{**rows[0], **{key: min(row[key] for row in rows) for key in ("first_pass_s", "second_pass_s")}}
                     for rows in zip(*runs)]  # counts are the same every run; times: the least disturbed run
    table = markdown_table(["model", "Mparams", "batch", "decode tok/s"], [r.values() for r in engine_rows])
    table += "\n\n" + markdown_table(
        ["model", "block", "prompt", "attention pages", "state pages", "page bytes", "pulled GiB", "data GiB"],
        [r.values() for r in pull_rows])
    table += "\n\n" + markdown_table(
        ["snapshot every (blocks)", "default", "snapshot pages", "KV pages", "recomputed tokens",
         "recomputed with KV alone", "first pass s", "second pass s"], [r.values() for r in snapshot_rows])
    return table, {"engine": engine_rows, "pull_bytes": pull_rows, "snapshots": snapshot_rows,
                   "qwen3_5_27b_shape": QWEN3_5_27B}
