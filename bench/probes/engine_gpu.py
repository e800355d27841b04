"""GPU engine benchmark: decode tokens/s of pdserve's engine (in process, no HTTP) beside
`transformers` generate on the same GPU, same model, same batch, in the same script;
plus a profile of pdserve's decode steps (where the step time goes).

    python -m bench.probes.engine_gpu [--models smollm2 llama3-1b] [--concurrency 1 16 64] [--out ...]

Models are random-weight checkpoints of the named shape written by transformers (tokens/s
does not depend on the weights; EOS is ignored so every run decodes the same count):
SmolLM2-135M (30 layers, 576 wide, 9 heads / 3 KV) and Llama-3.2-1B (16 layers, 2048 wide,
32 heads / 8 KV, vocabulary 128,256). bf16 everywhere.

--compile both (the default) runs the compiled decode step and the eager one side by side.

Decode tokens/s = tokens generated after every request's first token / the time that took
(prefill excluded on both sides: for transformers, a max_new_tokens=1 run of the same
batch is subtracted)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Sequence


import torch

from pdserve.api.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from pdserve.app.engine_factory import build_engine
from pdserve.metrics import Metrics
from pdserve.models.loader import load_model
from pdserve.request import GenerationRequest, SamplingParams

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama3-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 128


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def write_checkpoint(shape: str, directory: str, device: str):
    import transformers

    from bench.lib.tiny_model import save_tiny_checkpoint

    torch.manual_seed(0)
    config = transformers.LlamaConfig(max_position_embeddings=4096, **SHAPES[shape])
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    save_tiny_checkpoint(model, directory)
    return model


def prompts_for(concurrency: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(concurrency)
    return torch.randint(3, vocab, (concurrency, PROMPT_TOKENS), generator=generator).tolist()


def make_engine(loaded, max_running: int, device: str, compile_decode: bool):
    num_blocks = max_running * (PROMPT_TOKENS + OUTPUT_TOKENS) // 16 + 64
    config = WorkerConfig(model=ModelConfig(device=device, dtype="bfloat16", compile=compile_decode),
                          cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_running=max_running))
    return build_engine(config, Metrics(), loaded)


def ours_decode_rate(built, prompts: list[list[int]], tag: str, device: str) -> dict:
    loop = built.engine.engine_loop
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    first: dict[str, float] = {}
    counts: dict[str, int] = {}

    def collect(request_id: str):
        def on_output(output) -> None:
            counts[request_id] = counts.get(request_id, 0) + len(output.new_token_ids)
            first.setdefault(request_id, time.perf_counter())
        return on_output

    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        request_id = f"{tag}-{index}"
        loop.submit(GenerationRequest(request_id, tuple(prompt), sampling), collect(request_id))
    loop.run_until_idle()
    synchronize(device)
    ended = time.perf_counter()
    decode_tokens = sum(counts.values()) - len(prompts)
    all_started_decoding = max(first.values())
    return {"decode_tokens_per_s": decode_tokens / (ended - all_started_decoding),
            "e2e_tokens_per_s": sum(counts.values()) / (ended - started),
            "ttft_last_s": all_started_decoding - started, "tokens": sum(counts.values())}


def hf_decode_rate(hf_model, prompts: list[list[int]], device: str) -> dict:
    ids = torch.tensor(prompts, device=device)
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(new_tokens: int) -> float:
        synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **common)
        synchronize(device)
        return time.perf_counter() - started

    timed(2)  # warm-up
    prefill_s, total_s = timed(1), timed(OUTPUT_TOKENS)
    return {"decode_tokens_per_s": len(prompts) * (OUTPUT_TOKENS - 1) / (total_s - prefill_s),
            "e2e_tokens_per_s": len(prompts) * OUTPUT_TOKENS / total_s}


def profile_decode(built, prompts: list[list[int]], device: str, steps: int = 8) -> str:
    """Profiler table of `steps` decode-only engine steps at this batch."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])

    loop = built.engine.engine_loop
    sampling = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        loop.submit(GenerationRequest(f"prof-{index}", tuple(prompt), sampling), lambda output: None)
    loop._drain_inbox(block=False)
    for _ in range(3):  # prefill, then settle into decode-only steps
        loop.step()
    synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            loop.step()
        synchronize(device)
        step_ms = (time.perf_counter() - started) * 1000 / steps
    loop.run_until_idle()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    if device.startswith("cuda"):
        table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10,
                                                   max_name_column_width=48)
    return f"decode step (profiled): {step_ms:.2f} ms\n{table}"


def bench_model(shape: str, concurrency: Sequence[int], profile_at: int, device: str,
                compile_modes: Sequence[bool]) -> tuple[list[dict], dict[str, str]]:
    """Every concurrency level with each compile mode, transformers measured once per level beside them."""
    rows, profiles = [], {}
    with tempfile.TemporaryDirectory() as directory:
        hf_model = write_checkpoint(shape, directory, device)
        loaded = load_model(directory, torch.bfloat16, torch.device(device))
        engines = {}
        for compile_decode in compile_modes:
            started = time.perf_counter()
            try:
                built = make_engine(loaded, max(concurrency), device, compile_decode)
                ours_decode_rate(built, prompts_for(2, SHAPES[shape]["vocab_size"]), "warm", device)
            except Exception as error:  # a mode that cannot run is reported, the others still measured
                print(f"{shape}: compile={compile_decode} failed: {error!r}", flush=True)
                profiles[f"compile={compile_decode} failed"] = repr(error)
                continue
            engines[compile_decode] = built
            print(f"{shape}: engine with compile={compile_decode} built and warm in "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
        for level in concurrency:
            prompts = prompts_for(level, SHAPES[shape]["vocab_size"])
            theirs = hf_decode_rate(hf_model, prompts, device)
            for compile_decode, built in engines.items():
                ours = ours_decode_rate(built, prompts, f"c{level}-{compile_decode}", device)
                rows.append({"model": shape, "concurrency": level, "compile": compile_decode, "pdserve": ours,
                             "transformers": theirs,
                             "ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]})
                print(format_row(rows[-1]), flush=True)
        for compile_decode, built in engines.items():
            profiles[f"compile={compile_decode}"] = profile_decode(
                built, prompts_for(profile_at, SHAPES[shape]["vocab_size"]), device)
    return rows, profiles


def format_row(r: dict) -> str:
    return (f"{r['model']:>10} {r['concurrency']:>4} {'on' if r['compile'] else 'off':>7} | "
            f"{r['pdserve']['decode_tokens_per_s']:>10.1f} "
            f"{r['transformers']['decode_tokens_per_s']:>12.1f} | {r['ratio']:>5.2f}x | "
            f"{r['pdserve']['e2e_tokens_per_s']:>8.1f} {r['transformers']['e2e_tokens_per_s']:>8.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["smollm2", "llama3-1b"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--profile-at", type=int, default=16, help="batch size of the profiled decode steps")
    parser.add_argument("--out", default="bench/results/engine_gpu.json")
    parser.add_argument("--compile", choices=["on", "off", "both"], default="both",
                        help="the decode step compiled (CUDA graphs), eager, or both side by side")
    parser.add_argument("--device", default="cuda", help="cuda / cuda:N (cpu only to smoke-test the script)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("needs CUDA")
    compile_modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.compile]
    print(f"{'model':>10} {'conc':>4} {'compile':>7} | {'pdserve t/s':>10} {'transformers':>12} | ratio | "
          f"e2e: ours  theirs")
    rows, profiles = [], {}
    for shape in args.models:
        model_rows, model_profiles = bench_model(shape, args.concurrency, args.profile_at, args.device, compile_modes)
        rows += model_rows
        profiles.update({f"{shape} {mode}": text for mode, text in model_profiles.items()})
    for name, text in profiles.items():
        print(f"\n== profile: {name}, batch {args.profile_at}\n{text}")
    report = {"command": " ".join(["python3", "bench.probes.engine_gpu", *(argv if argv is not None else sys.argv[1:])]),
              "device": torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu",
              "torch": torch.__version__, "platform": platform.platform(),
              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "rows": rows, "profiles": profiles}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
