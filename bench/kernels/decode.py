"""Where a decode step's time goes on the embedded model, set against the weight-read bound.

One run times the parts of the engine's decode steps at batch 1 and 16 (interleaved: each round
runs every batch once, so outside load hits all of them alike) on the embedded SmolLM2-135M GGUF
as `pdserve serve` runs it (Q4_1 blocks in the native kernels, Q8_0 head, float32 activations):

    engine step ─┬─ scheduler, update, emit (the loop outside the runner)
                 └─ runner.execute ─┬─ inputs, to-host, unpack (runner glue)
                                    ├─ sampling
                                    └─ decode forward ─┬─ embed, inputs (step glue)
                                                       ├─ the layers: one native call, timed per part
                                                       │  inside it (norms, qkv, attention, kv store,
                                                       │  o, gate|up, activation, down)
                                                       ├─ final norm
                                                       └─ LM head

Each part's median over the steps is set against what reading its bytes takes at a streaming
read bandwidth measured in the same run (a 1 GiB sum on the same threads, the best of one a round): its weights (as
stored: blocks), plus the keys and values attention reads, plus the logits the sampler reads.
Rows whose bound is 0 (pure compute or Python) have no ratio. The layers' native laps cost a
clock read per part (a second row times the step with them off).

`--clock cpu` (with `--threads 1` only) times by CPU time, Python's and the native laps' alike:
on a shared machine it leaves out the time other processes held the core.

`--model gpt-oss-shape` profiles `moe`'s random float32 gpt-oss shape (24 layers, 32 experts top-4)
instead: its layers' "experts" part is routing, grouping and every active expert in one native call
(no read bound: which experts a step reads depends on its tokens). With decode-ab it sets an
experts change against an earlier commit's.

`--kv-cache-dtypes float32 bfloat16` runs one engine per KV pool element type (each its own copy
of the model), interleaved within every round, and adds a side-by-side table of attention and
step times with ratios against the first type. `--batch-activation-bits 22 8` does the same per
`--batch-activation-bits` (the integer Q4_1 lanes of batched steps), with each KV type, and
`--one-row-tiles on off` per setting of `--one-row-tiles` (batch-1 Q4_1 products over weights kept
a second time in 16-row tiles, against the blocks' own one-row kernel).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from bench.engine.roofline import measure_read_bandwidth
from bench.kernels.clocks import add_timing_arguments, checked_clock
from bench.lib.report import markdown_table

# Rows of the table in step order: (key, label); the layers' parts come from the native stack.
OUTER_PARTS = (("embed_and_inputs", "embed, step inputs"), ("layers_call", "layer stack call (outside the parts)"))
TAIL_PARTS = (("final_norm", "final norm"), ("lm_head", "LM head"), ("sampling", "sampling"),
              ("runner_glue", "runner: sort, to host, unpack"), ("engine_outside_runner", "engine: schedule, update, emit"))


class StepTimer:
    """Times the parts of every decode step an engine runs, by wrapping its objects' methods
    (instance attributes shadow the class's); `records` holds one dict of seconds per step."""

    def __init__(self, loop: Any, clock: Callable[[], float], thread_clock: bool):
        self.loop, self.clock, self.thread_clock = loop, clock, thread_clock
        runner = loop.runner
        self.runner, self.decode_step, self.model = runner, runner.decode_step, runner.decode_step.model
        self.stack = self.decode_step._fused_stack
        if self.stack is None:
            raise SystemExit("the decode step does not run the fused native layers here: nothing to profile")
        self.records: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        self.rows = 0
        self.context_tokens = 0
        self.laps_on = True
        self._wrap(loop, "step", "step")
        self._wrap(runner, "execute", "execute")
        self._wrap(runner.sampler, "sample_packed", "sampling")
        self._wrap(self.decode_step, "run", "forward", before=self._note_chunks)
        self._wrap(self.model, "final_norm", "final_norm")
        self._wrap(self.model, "compute_logits", "lm_head")
        self._wrap(self.decode_step, "_fused_stack", "layers", target=self.stack)

    def _wrap(self, owner: Any, name: str, key: str, before: Callable[..., None] | None = None,
              target: Callable[..., Any] | None = None) -> None:
        inner = target if target is not None else getattr(owner, name)
        clock = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(*args)
            started = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[key] = self.current.get(key, 0.0) + clock() - started
                if key == "step":
                    self._close_step()

        object.__setattr__(owner, name, timed) if isinstance(owner, torch.nn.Module) else setattr(owner, name, timed)

    def _note_chunks(self, chunks: Any, *_: Any) -> None:
        self.rows = len(chunks)
        self.context_tokens = sum(chunk.start_position for chunk in chunks)
        if self.laps_on:
            self.stack.start_profile(self.thread_clock)

    def _close_step(self) -> None:
        current, self.current = self.current, {}
        if "forward" not in current:
            return  # a prefill step (or an empty one): not a decode step
        parts = self.stack.profile_seconds() if self.laps_on else {}
        if self.laps_on:
            self.stack.stop_profile()
        record = {"rows": self.rows, "context_tokens": self.context_tokens, "laps": self.laps_on, **current,
                  **{f"layer.{name}": s for name, s in parts.items()}}
        self.records.append(record)


def derived_parts(record: dict[str, float]) -> dict[str, float]:
    """A step record as the table's rows: each part's own seconds, children taken out of parents."""
    layer_parts = {k: v for k, v in record.items() if k.startswith("layer.") and k != "layer.final_norm"}
    native_norm = record.get("layer.final_norm", 0.0)  # the stack's own, where it applies the final norm
    out = {"embed_and_inputs": record["forward"] - record["layers"] - record.get("final_norm", 0.0)
           - record.get("lm_head", 0.0)}
    out |= layer_parts
    out["layers_call"] = record["layers"] - sum(layer_parts.values()) - native_norm if layer_parts else float("nan")
    out["layers_total"] = record["layers"] - native_norm
    out["final_norm"] = record.get("final_norm", 0.0) + native_norm
    out["lm_head"] = record.get("lm_head", 0.0)
    out["sampling"] = record.get("sampling", 0.0)
    out["runner_glue"] = record["execute"] - record["forward"] - out["sampling"]
    out["engine_outside_runner"] = record["step"] - record["execute"]
    out["python_outside_model"] = record["step"] - record["forward"]
    out["step"] = record["step"]
    return out


def model_bytes(model: Any, stack_layers: Any) -> dict[str, int]:
    """Bytes one decode step reads per part (weights as stored), but the KV, which grows per step."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    parts = {"layer.input_norm": 0, "layer.qkv": 0, "layer.o_proj": 0, "layer.post_norm": 0, "layer.mlp_gate_up": 0,
             "layer.mlp_down": 0}
    for layer in stack_layers:
        parts["layer.input_norm"] += size(layer.norms[0])
        parts["layer.post_norm"] += size(layer.norms[1])
        for key, weight in zip(("layer.qkv", "layer.o_proj", "layer.mlp_gate_up", "layer.mlp_down"), layer.weights):
            parts[key] += size(weight)
    head = model.lm_head
    parts["lm_head"] = size(head.packed.blocks) if hasattr(head, "packed") else size(head.weight)
    parts["final_norm"] = size(model.norm)
    return parts


def kv_bytes_per_token(model: Any, element_bytes: int = 4) -> int:
    """Bytes of keys and values one cached token holds over every layer."""
    layer = model.layers[0].self_attn
    return len(model.layers) * 2 * layer.num_kv_heads * layer.head_dim * element_bytes


def load_profiled_model(model: str) -> tuple[Any, dict]:
    """(the loaded model, ModelConfig's arguments) for `--model`."""
    from pdserve.models.loader import LoadedModel, load_model, resolve_quantization

    device = torch.device("cpu")
    if model == "embedded":
        quantization = resolve_quantization("auto", "auto", device)  # what `pdserve serve` loads
        return load_model(None, torch.float32, device, quantization), {}
    from bench.kernels import moe
    from pdserve.models.registry import build_model
    from pdserve.models.weight_loader import WeightPolicy

    config, weights = moe.gpt_oss_model(layers=24, experts=32, top_k=4, hidden=512, expert_width=256, vocab=8192)
    built = build_model(config, weights, torch.float32, device, WeightPolicy())
    return LoadedModel(model=built, tokenizer=moe.word_tokenizer(config["vocab_size"]), name=model), {"dtype": "float32"}


def build_engine_loop(threads: int, batch: int, kv_cache_dtype: str = "auto", model: str = "embedded",
                      batch_activation_bits: int = 22, one_row_tiles: bool = True) -> Any:
    from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from pdserve.app.engine_factory import build_engine
    from pdserve.metrics import Metrics

    torch.set_num_threads(threads)
    loaded, model_config = load_profiled_model(model)
    # "auto" is left unset, so that decode-ab's baseline trees (from before the option) build too.
    kv_dtype = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    bits = {} if batch_activation_bits == 22 else {"batch_activation_bits": batch_activation_bits}  # likewise
    tiles = {} if one_row_tiles else {"one_row_tiles": False}  # likewise
    worker = WorkerConfig(model=ModelConfig(device="cpu", **model_config, **bits, **tiles),
                          cache=CacheConfig(block_size=16, num_blocks=64 + batch * 40, enable_prefix_caching=False,
                                            **kv_dtype),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_running=batch))
    return build_engine(worker, Metrics(), loaded).engine.engine_loop


def run_requests(loop: Any, batch: int, prompt_tokens: int, new_tokens: int, tag: str, vocab: int) -> None:
    from pdserve.api.sampling import SamplingParams
    from pdserve.request import GenerationRequest

    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        prompt = tuple(torch.randint(3, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(b)).tolist())
        loop.submit(GenerationRequest(f"{tag}-{b}", prompt, sampling), lambda output: None)
    loop.run_until_idle()


def summarize(records: list[dict], batch: int, bandwidth: float, weight_bytes: dict[str, int],
              kv_token_bytes: int, vocab: int) -> dict:
    """Per part: median and min seconds over the batch's profiled steps, bytes, and the read bound."""
    steps = [r for r in records if r["rows"] == batch and r["laps"]]
    parts = [derived_parts(r) for r in steps]
    context = statistics.median(r["context_tokens"] for r in steps)
    read_bytes = dict(weight_bytes)
    read_bytes["layer.attention"] = int(context * kv_token_bytes)
    read_bytes["sampling"] = batch * vocab * 4

    def entry(values_s: list[float], nbytes: int) -> dict:
        return {"median_ms": statistics.median(values_s) * 1e3 if values_s else float("nan"),
                "min_ms": min(values_s, default=float("nan")) * 1e3, "bytes": nbytes, "bound_ms": nbytes / bandwidth * 1e3}

    total_bytes = sum(read_bytes.values())
    read_bytes |= {"step": total_bytes, "layers_total": total_bytes - read_bytes["lm_head"] - read_bytes["final_norm"]
                   - read_bytes["sampling"]}
    summary = {key: entry([p[key] for p in parts], read_bytes.get(key, 0)) for key in parts[0]}
    summary["step_without_laps"] = entry([r["step"] for r in records if r["rows"] == batch and not r["laps"]],
                                         total_bytes)
    return {"batch": batch, "num_steps": len(steps), "median_context_tokens": context, "parts": summary}


def table_rows(summaries: list[dict]) -> list[list[Any]]:
    first = summaries[0]["parts"]
    layer_keys = [k for k in first if k.startswith("layer.")]
    keys = ([OUTER_PARTS[0]] + [(k, "  layer " + k[len("layer."):]) for k in layer_keys] + [OUTER_PARTS[1]]
            + [("layers_total", "layers, all parts")] + list(TAIL_PARTS)
            + [("python_outside_model", "Python outside the model (step - forward)"), ("step", "**engine step**"),
               ("step_without_laps", "engine step, native laps off")])
    rows = []
    for key, label in keys:
        row: list[Any] = [label]
        for summary in summaries:
            part = summary["parts"][key]
            step_ms = summary["parts"]["step"]["median_ms"]
            ratio = f"{part['median_ms'] / part['bound_ms']:.1f}x" if part["bound_ms"] > 0 else "-"
            row += [f"{part['median_ms']:.3f}", f"{100 * part['median_ms'] / step_ms:.0f}%", f"{part['bound_ms']:.3f}",
                    ratio]
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser, mode: str) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=200, help="each request's prompt (the KV a step reads)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per request and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs every batch, laps on then off")
    add_timing_arguments(parser, threads=torch.get_num_threads(), clock="wall")
    parser.add_argument("--model", choices=["embedded", "gpt-oss-shape"], default="embedded",
                        help="gpt-oss-shape: `moe`'s random float32 model (24 layers, 32 experts top-4, hidden 512)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="KV pool element types measured side by side, one engine each (auto: the model's)")
    parser.add_argument("--batch-activation-bits", type=int, nargs="+", default=[22], choices=[22, 15, 8],
                        help="--batch-activation-bits values measured side by side, one engine each (with each "
                             "KV dtype)")
    parser.add_argument("--one-row-tiles", nargs="+", default=["on"], choices=["on", "off"],
                        help="--one-row-tiles settings measured side by side, one engine each (with each of the "
                             "above)")


def variant_name(summary: dict) -> str:
    """A measured engine's KV dtype, and its batch activation bits where not the default."""
    bits = summary.get("batch_activation_bits", 22)
    tiles = "" if summary.get("one_row_tiles", True) else ", no one-row tiles"
    return summary["kv_cache_dtype"] + ("" if bits == 22 else f", {bits}-bit batches") + tiles


def dtype_rows(summaries: list[dict]) -> list[list[Any]]:
    """Attention and step medians per KV element type and batch, with ratios against the first type."""
    rows = []
    for summary in summaries:
        base = next(s for s in summaries if s["batch"] == summary["batch"])
        parts, base_parts = summary["parts"], base["parts"]
        row: list[Any] = [variant_name(summary), summary["batch"]]
        for key in ("layer.attention", "layer.store_kv", "step"):
            ms, base_ms = parts[key]["median_ms"], base_parts[key]["median_ms"]
            row += [f"{ms:.3f}", f"{base_ms / ms:.2f}x" if ms > 0 else "-"]
        rows.append(row + [f"{parts['layer.attention']['bytes'] / 1e6:.1f}"])
    return rows


def run(args: argparse.Namespace) -> tuple[str, dict]:
    clock = checked_clock(args)
    timers = {}  # (KV dtype, batch activation bits, one-row tiles) -> the timer of its own engine
    for kv_dtype in args.kv_cache_dtypes:
        for bits in args.batch_activation_bits:
            for tiles in args.one_row_tiles:
                loop = build_engine_loop(args.threads, max(args.batches), kv_dtype, args.model, bits, tiles == "on")
                timers[(kv_dtype, bits, tiles)] = StepTimer(loop, clock, thread_clock=args.clock == "cpu")
    vocab = next(iter(timers.values())).model.args.vocab_size
    for variant, timer in timers.items():
        run_requests(timer.loop, max(args.batches), args.prompt_tokens, 2, "warm-" + "-".join(map(str, variant)), vocab)
        timer.records.clear()
    bandwidths = []  # the best of one measurement a round: on a shared machine others' reads lower some
    for r in range(args.rounds):
        bandwidths.append(measure_read_bandwidth())
        for variant, timer in timers.items():  # interleaved: outside load hits every variant alike
            for batch in args.batches:
                for laps in (True, False):
                    timer.laps_on = laps
                    run_requests(timer.loop, batch, args.prompt_tokens, args.new_tokens + 1,
                                 f"r{r}-{'-'.join(map(str, variant))}-b{batch}-{laps}", vocab)
    bandwidth = max(bandwidths)
    summaries = []
    for (kv_dtype, bits, tiles), timer in timers.items():
        element_bytes = timer.runner.layout.element_bytes
        weight_bytes = model_bytes(timer.model, timer.decode_step._fused)
        for batch in args.batches:
            summary = summarize(timer.records, batch, bandwidth, weight_bytes,
                                kv_bytes_per_token(timer.model, element_bytes), vocab)
            summaries.append({"kv_cache_dtype": kv_dtype, "batch_activation_bits": bits,
                              "one_row_tiles": tiles == "on", **summary})
    several = len(timers) > 1
    label = lambda s: f"b={s['batch']} {variant_name(s)}" if several else f"b={s['batch']}"  # noqa: E731
    header = ["part (ms a step, median)"] + [f"{label(s)} {column}" for s in summaries
                                             for column in ("ms", "share", "read bound ms", "x bound")]
    table = (f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads, {args.clock} clock); "
             f"steps per batch: {', '.join(str(s['num_steps']) for s in summaries)}; median context "
             f"{', '.join(str(int(s['median_context_tokens'])) for s in summaries)} tokens a step\n\n"
             + markdown_table(header, table_rows(summaries)))
    if several:
        table += "\n\n" + markdown_table(
            ["engine", "batch", "attention ms", "x first", "kv store ms", "x first", "step ms", "x first",
             "KV MB read"], dtype_rows(summaries))
    return table, {"read_bandwidth_bytes_per_s": bandwidth, "batches": summaries}
