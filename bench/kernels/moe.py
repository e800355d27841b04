"""MoE decode on the CPU: a gpt-oss shape against the dense model with the same active parameters.

Two tables, one run: (1) engine decode tokens/s at batch 1 and 16 of a random-weight gpt-oss shape
(24 layers, 32 experts top-4, hidden 512, 256 per expert, windows of 128 alternating with full
layers, sinks), with the native experts (`pdserve_cpu::SparseMoeMlp`, each layer one call in the
fused stack) over float32 experts, over bfloat16 experts (as most MoE checkpoints ship them: kept
16-bit) and over MXFP4 experts (as gpt-oss ships them: kept 4-bit), both giving the float32
results of their widened weights bit for bit, and with the torch
experts they replaced (grouped matmuls, per-op layers), and of a dense Llama-family model with the
same attention and an MLP as wide as the active experts together, in float32 (its layers run the
fused native kernel, as when served); (2) one MoE layer at batch 1 and 16 as the experts grow at
fixed top-k (time follows the active experts' weights, not the total): native float32, bfloat16
and MXFP4, grouped torch (one matmul pair per active expert) and a loop over tokens. Weights are
random, seeded per tensor name.

`--clock cpu` times by the process's CPU time instead of the wall clock: on a shared machine,
with `--threads 1`, it leaves out the time other processes held the core (with more threads it
would add theirs up, so it is refused).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib

import torch

from bench.kernels.clocks import add_timing_arguments, checked_clock
from bench.lib.engine_rounds import decode_seconds
from bench.lib.report import markdown_table
from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.app.engine_factory import build_engine
from pdserve.metrics import Metrics
from pdserve.models.loader import LoadedModel
from pdserve.models.moe import Experts, clamped_swiglu
from pdserve.models.quant.mxfp4 import Mxfp4Weight, quantize_mxfp4
from pdserve.models.registry import build_model
from pdserve.models.tokenizer import Tokenizer
from pdserve.models.weight_loader import WeightLoader, WeightPolicy

CPU = torch.device("cpu")


class RandomWeights:
    """A `WeightSource` whose every tensor is random, shaped by `shapes`, seeded by its name."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], std: float = 0.02):
        self.shapes, self.std = shapes, std

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        tensor = torch.randn(self.shapes[name], generator=generator) * self.std
        return tensor + 1.0 if name.endswith("norm.weight") else tensor

    def get_packed(self, name: str) -> None:
        return None  # plain float tensors only


class Mxfp4RandomWeights(RandomWeights):
    """`RandomWeights` whose fused expert tensors come as the released checkpoints' MXFP4 blocks and
    scales (rows = outputs) of the same random values."""

    MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")

    def _float_name(self, name: str) -> str:
        return name.removesuffix("_blocks").removesuffix("_scales")

    def has(self, name: str) -> bool:
        float_name = self._float_name(name)
        if float_name.endswith(self.MXFP4_TENSORS):
            return name != float_name and super().has(float_name)
        return super().has(name)

    def get(self, name: str) -> torch.Tensor:
        float_name = self._float_name(name)
        if name == float_name:
            return super().get(name)
        blocks, scales = quantize_mxfp4(super().get(float_name).transpose(1, 2))
        return blocks if name.endswith("_blocks") else scales




def median_ms(work, repeats: int, rounds: int, clock=time.perf_counter) -> float:
    """Milliseconds per call of `work`: the median over `rounds` of `repeats` calls in a row, after one
    untimed call (lazy set-up, caches)."""
    work()
    times_ms = []
    for _ in range(rounds):
        started_s = clock()
        for _ in range(repeats):
            work()
        times_ms.append((clock() - started_s) / repeats * 1000)
    return statistics.median(times_ms)


class Bfloat16ExpertWeights(RandomWeights):
    """`RandomWeights` whose fused expert matrices come in bfloat16, as a bfloat16 checkpoint holds them."""

    def get(self, name: str) -> torch.Tensor:
        tensor = super().get(name)
        return tensor.to(torch.bfloat16) if name.endswith(Mxfp4RandomWeights.MXFP4_TENSORS) else tensor


def _attention_shapes(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> dict:
    shapes = {prefix + "q_proj.weight": (heads * head_dim, hidden), prefix + "k_proj.weight": (kv_heads * head_dim, hidden),
              prefix + "v_proj.weight": (kv_heads * head_dim, hidden), prefix + "o_proj.weight": (hidden, heads * head_dim)}
    if bias:
        shapes.update({prefix + "q_proj.bias": (heads * head_dim,), prefix + "k_proj.bias": (kv_heads * head_dim,),
                       prefix + "v_proj.bias": (kv_heads * head_dim,), prefix + "o_proj.bias": (hidden,)})
    return shapes


def _common_shapes(layers: int, hidden: int, vocab: int) -> tuple[dict, dict]:
    """(config, shapes) both shapes share: embeddings, norms and biased attention of 64-wide heads."""
    heads, kv_heads, head_dim = hidden // 64, max(1, hidden // 256), 64
    config = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 4096}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(_attention_shapes(p + "self_attn.", hidden, heads, kv_heads, head_dim, True))
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    return config, shapes


def gpt_oss_model(layers: int, experts: int, top_k: int, hidden: int, expert_width: int, vocab: int,
                  expert_format: str = "float32"):
    config, shapes = _common_shapes(layers, hidden, vocab)
    config |= {"architectures": ["GptOssForCausalLM"], "intermediate_size": expert_width, "sliding_window": 128,
               "num_local_experts": experts, "num_experts_per_tok": top_k,
               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.sinks": (hidden // 64,), p + "mlp.router.weight": (experts, hidden),
                       p + "mlp.router.bias": (experts,),
                       p + "mlp.experts.gate_up_proj": (experts, hidden, 2 * expert_width),
                       p + "mlp.experts.gate_up_proj_bias": (experts, 2 * expert_width),
                       p + "mlp.experts.down_proj": (experts, expert_width, hidden),
                       p + "mlp.experts.down_proj_bias": (experts, hidden)})
    sources = {"float32": RandomWeights, "bfloat16": Bfloat16ExpertWeights, "mxfp4": Mxfp4RandomWeights}
    return config, sources[expert_format](shapes)


def dense_model(layers: int, hidden: int, intermediate: int, vocab: int):
    config, shapes = _common_shapes(layers, hidden, vocab)
    config |= {"architectures": ["LlamaForCausalLM"], "intermediate_size": intermediate, "attention_bias": True}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate)})
    return config, RandomWeights(shapes)


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Prompts here are token ids; the engine only needs a tokenizer whose ids cover the vocabulary."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    return Tokenizer(Backend(models.WordLevel(vocab=vocab, unk_token="<eos>")), bos_token=None, eos_token="<eos>",
                     eos_token_ids=(0,), chat_template=None)


def decode_tokens_per_s(config: dict, weights: RandomWeights, batch: int, prompt_tokens: int, new_tokens: int,
                        native_experts: bool = True, rounds: int = 3, clock=time.perf_counter,
                        quantization: str = "none") -> float:
    model = build_model(config, weights, torch.float32, CPU, WeightPolicy.for_choice(quantization))
    for module in model.modules():
        if isinstance(module, Experts):
            module.native_enabled = native_experts
    loaded = LoadedModel(model=model, tokenizer=word_tokenizer(config["vocab_size"]), name="bench")
    worker = WorkerConfig(model=ModelConfig(device="cpu", dtype="float32"),
                          cache=CacheConfig(block_size=16, num_blocks=64 + batch * 8, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_running=batch))
    built = build_engine(worker, Metrics(), loaded)
    loop = built.engine.engine_loop

    prompts = [tuple(torch.randint(3, config["vocab_size"], (prompt_tokens,),
                                   generator=torch.Generator().manual_seed(b)).tolist()) for b in range(batch)]
    # The fastest of a few rounds: on a shared machine a slow round is another process's doing.
    decode_s = decode_seconds(loop, prompts, new_tokens, rounds, clock)
    return batch * new_tokens / max(min(s for s in decode_s if s > 0), 1e-9)


def random_experts(num_experts: int, hidden: int, width: int, native: bool = True,
                   expert_format: str = "float32") -> Experts:
    experts = Experts(num_experts, hidden, width, clamped_swiglu(1.702, 7.0), True, torch.float32)
    loader = WeightLoader(RandomWeights({}), WeightPolicy(), CPU)
    generator = torch.Generator().manual_seed(num_experts)

    def linear(layer: torch.nn.Module, rows: int, cols: int) -> torch.nn.Module:
        weight = torch.randn(rows, cols, generator=generator)
        if expert_format == "mxfp4":
            return loader.linear_from_mxfp4(layer, Mxfp4Weight.from_blocks(*quantize_mxfp4(weight)), "expert")
        if expert_format == "bfloat16":
            return loader.linear_from_bfloat16(layer, [weight.to(torch.bfloat16)], "expert")
        return loader.linear_from_tensors(layer, [weight], "expert")

    for e in range(num_experts):
        experts.gate_up[e] = linear(experts.gate_up[e], 2 * width, hidden)
        experts.down[e] = linear(experts.down[e], hidden, width)
        experts.gate_up[e].bias.zero_()
        experts.down[e].bias.zero_()
    experts.native_enabled = native
    return experts


def per_token_loop(experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The layout the grouped MoE replaces: every token runs its k experts on its own."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = experts.gate_up[e](x[t : t + 1]).split(experts.intermediate_size, dim=-1)
            out[t] += (experts.down[e](experts.activation(gate, up)) * weights[t, j])[0]
    return out


def moe_layer_rows(hidden: int, width: int, top_k: int, expert_counts: list[int], repeats: int,
                   clock=time.perf_counter) -> list[dict]:
    rows = []
    for num_experts in expert_counts:
        experts = random_experts(num_experts, hidden, width)
        bfloat16_experts = random_experts(num_experts, hidden, width, expert_format="bfloat16")
        mxfp4_experts = random_experts(num_experts, hidden, width, expert_format="mxfp4")
        torch_experts = random_experts(num_experts, hidden, width, native=False)
        for batch in (1, 16):
            generator = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, hidden, generator=generator)
            logits = torch.randn(batch, num_experts, generator=generator)
            top, ids = torch.topk(logits, top_k, dim=-1)
            routing = (torch.softmax(top, -1), ids)
            with torch.inference_mode():
                native_ms = median_ms(lambda: experts(x, routing), repeats, 1, clock)
                bfloat16_ms = median_ms(lambda: bfloat16_experts(x, routing), repeats, 1, clock)
                mxfp4_ms = median_ms(lambda: mxfp4_experts(x, routing), repeats, 1, clock)
                grouped_ms = median_ms(lambda: torch_experts(x, routing), repeats, 1, clock)
                loop_ms = median_ms(lambda: per_token_loop(torch_experts, x, *routing), repeats, 1, clock)
            rows.append({"experts": num_experts, "top_k": top_k, "batch": batch,
                         "active_experts": int(ids.unique().numel()),
                         "total_params_m": round(num_experts * 3 * hidden * width / 1e6, 1),
                         "native_ms": round(native_ms, 3), "native_bfloat16_ms": round(bfloat16_ms, 3), "native_mxfp4_ms": round(mxfp4_ms, 3), "grouped_ms": round(grouped_ms, 3), "per_token_ms": round(loop_ms, 3)})
        del experts, bfloat16_experts, mxfp4_experts, torch_experts
    return rows


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    for flag, default in (("--layers", 24), ("--experts", 32), ("--top-k", 4), ("--hidden", 512),
                          ("--expert-width", 256), ("--vocab", 8192), ("--prompt-tokens", 64), ("--new-tokens", 32)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--quantization", choices=["none", "int8", "int4"], default="none",
                        help="the engine models' linear weights (both models alike)")
    add_timing_arguments(parser, threads=torch.get_num_threads(), clock="wall")


def run(args: argparse.Namespace) -> tuple[str, dict]:
    clock = checked_clock(args)
    torch.set_num_threads(args.threads)
    moe = gpt_oss_model(args.layers, args.experts, args.top_k, args.hidden, args.expert_width, args.vocab)
    models = {  # name -> (config, weights, native experts)
        f"gpt-oss shape ({args.experts} experts top-{args.top_k}), native experts": (*moe, True),
        **{f"gpt-oss shape ({args.experts} experts top-{args.top_k}), native {label} experts":
           (*gpt_oss_model(args.layers, args.experts, args.top_k, args.hidden, args.expert_width, args.vocab,
                           expert_format), True)
           for expert_format, label in (("bfloat16", "bfloat16"), ("mxfp4", "MXFP4"))},
        f"gpt-oss shape ({args.experts} experts top-{args.top_k}), torch experts": (*moe, False),
        f"dense, same active params (MLP {args.top_k * args.expert_width})":
            (*dense_model(args.layers, args.hidden, args.top_k * args.expert_width, args.vocab), True),
    }
    engine_rows = [{"model": name, "batch": batch,
                    "decode_tokens_per_s": round(decode_tokens_per_s(config, weights, batch, args.prompt_tokens,
                                                                     args.new_tokens, native, clock=clock,
                                                                     quantization=args.quantization), 1)}
                   for name, (config, weights, native) in models.items() for batch in (1, 16)]
    dense = {row["batch"]: row["decode_tokens_per_s"] for row in engine_rows if row["model"].startswith("dense")}
    for row in engine_rows:
        row["vs_dense"] = round(row["decode_tokens_per_s"] / max(dense[row["batch"]], 1e-9), 2)
    layer_rows = moe_layer_rows(args.hidden, args.expert_width, args.top_k, [8, 32, 128], repeats=20, clock=clock)
    table = markdown_table(["model", "batch", "decode tok/s", "x dense"], [r.values() for r in engine_rows]) + \
        "\n\n" + markdown_table(["experts", "batch", "active", "total Mparams", "native ms", "native bf16 ms",
                                   "native MXFP4 ms", "grouped torch ms", "per-token ms"],
                                  [(r["experts"], r["batch"], r["active_experts"], r["total_params_m"], r["native_ms"],
                                    r["native_bfloat16_ms"], r["native_mxfp4_ms"], r["grouped_ms"], r["per_token_ms"])
                                   for r in layer_rows])
    return table, {"engine": engine_rows, "moe_layer": layer_rows}
