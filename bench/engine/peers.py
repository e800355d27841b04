"""The `transformers` peers on pdserve's weights: in-process `generate`, and `transformers serve`.

Invariant: both peers run the very weights pdserve serves (the embedded GGUF,
dequantized to fp32 by `transformers` itself) and produce exactly
`max_tokens` tokens per request, so tokens/s compare like with like.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from typing import Sequence

import torch

from bench.engine.report import PhaseResult, RequestSample, summarize
from bench.engine.systems import Messages
from bench.engine.workload import chat_messages

logger = logging.getLogger(__name__)

GENERATE_SYSTEM = "transformers generate"
SERVE_SYSTEM = "transformers serve --continuous-batching"
_SERVE_PAGE_TOKENS = 256  # transformers' default continuous-batching page size


def prepare_hf_dir(gguf_path: str, hf_dir: str) -> None:
    """Writes the GGUF as a Hugging Face directory (`transformers serve` cannot take the GGUF file).

    A model loaded from GGUF is flagged as quantized and refuses `save_pretrained`,
    so its dequantized tensors move into a plain model built from the same config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(os.path.join(hf_dir, "config.json")):
        logger.info("reusing the Hugging Face copy in %s", hf_dir)
        return
    started_s = time.monotonic()
    directory, name = os.path.split(gguf_path)
    dequantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config_fields = {k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"}
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config_fields), dtype=torch.float32)
    plain.load_state_dict(dequantized.state_dict(), strict=True)
    plain.generation_config = dequantized.generation_config
    staging = hf_dir + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, hf_dir)  # a crash mid-save never leaves a directory that looks complete
    logger.info("dequantized %s into %s in %.1f s", name, hf_dir, time.monotonic() - started_s)


def load_hf_model(hf_dir: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _encode(tokenizer, indices: Sequence[int], device: str = "cpu", messages: Messages = chat_messages) -> dict:
    texts = [tokenizer.apply_chat_template(messages(i), tokenize=False, add_generation_prompt=True)
             for i in indices]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)


def _timed_generate(model, tokenizer, batch: dict, num_new_tokens: int) -> tuple[float, int]:
    started_s = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **batch, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,  # min = max: EOS never ends it
            do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )
    elapsed_s = time.perf_counter() - started_s
    return elapsed_s, (output.shape[1] - batch["input_ids"].shape[1]) * output.shape[0]


def run_generate_phase(model, tokenizer, indices: Sequence[int], batch_size: int, max_tokens: int) -> PhaseResult:
    """Static batches of `batch_size`; TTFT of a batch is the time of a one-token generate on it."""
    samples: list[RequestSample] = []
    wall_s = 0.0
    for start in range(0, len(indices), batch_size):
        batch = _encode(tokenizer, indices[start:start + batch_size], str(model.device))
        ttft_s, _ = _timed_generate(model, tokenizer, batch, 1)
        e2e_s, num_tokens = _timed_generate(model, tokenizer, batch, max_tokens)
        wall_s += e2e_s
        rows = batch["input_ids"].shape[0]
        samples.extend(RequestSample(ttft_s, e2e_s, num_tokens // rows) for _ in range(rows))
    return summarize(GENERATE_SYSTEM, batch_size, samples, wall_s)


class GenerateSystem:
    """`generate` in this process: a concurrency of c is a static, left-padded batch of c."""

    name = GENERATE_SYSTEM

    def __init__(self, hf_dir: str, device: str = "cpu"):
        self._hf_dir = hf_dir
        self._device = device
        self.model = None
        self._tokenizer = None

    @property
    def pids(self) -> list[int]:
        return []  # runs in the benchmark's own process, which the CPU meter always counts

    def start(self, ready_timeout_s: float) -> None:
        self.model, self._tokenizer = load_hf_model(self._hf_dir, self._device)

    def warm_up(self, indices: Sequence[int], concurrencies: Sequence[int], max_tokens: int) -> None:
        for batch_size in concurrencies:  # every batch shape the phases will use, once
            batch = _encode(self._tokenizer, list(indices[:batch_size]), self._device)
            _timed_generate(self.model, self._tokenizer, batch, max_tokens)

    def prepare(self, concurrency: int) -> None:
        """Nothing to do between phases."""

    def first_token_times(self, indices: Sequence[int], messages: Messages) -> list[float]:
        """One-token `generate` on each prompt alone."""
        encode = lambda i: _encode(self._tokenizer, [i], self._device, messages)  # noqa: E731
        return [_timed_generate(self.model, self._tokenizer, encode(i), 1)[0] for i in indices]

    def run(self, indices: Sequence[int], concurrency: int, max_tokens: int) -> PhaseResult:
        return run_generate_phase(self.model, self._tokenizer, indices, concurrency, max_tokens)

    def close(self) -> None:
        self.model = self._tokenizer = None


def transformers_serve_argv(hf_dir: str, port: int, num_kv_tokens: int, device: str = "cpu") -> list[str]:
    """The `transformers serve` CLI of the running interpreter, pinned to the local directory.

    Left alone, its paged cache takes 90% of free memory (11 GB here); it gets
    the KV capacity pdserve gets instead, in its own 256-token blocks."""
    script = os.path.join(os.path.dirname(sys.executable), "transformers")
    launcher = [script] if os.path.exists(script) else [sys.executable, "-m", "transformers.cli.transformers"]
    return launcher + [
        "serve", hf_dir, "--continuous-batching", "--device", device, "--dtype", "float32",
        "--cb-num-blocks", str(-(-num_kv_tokens // _SERVE_PAGE_TOKENS)),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]


def transformers_serve_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def transformers_serve_extra_body() -> dict:
    """Its continuous batcher takes EOS from a per-request `generation_config` (JSON text):
    -1 disables the stop, the equivalent of pdserve's `ignore_eos`."""
    return {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
