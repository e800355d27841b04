"""What rounding a linear layer's input activations costs the embedded model: teacher-forced top-1
agreement of its dequantized float32 self with and without the rounding, over the 512 positions of
the quantized-agreement test. Each block of 32 activations is rounded on its own symmetric scale
(max|x| / (2^(bits-1) - 1)), as an integer dot-product kernel would see it.

    python3 bench/activation_rounding.py [--bits 8 15 22] [--out bench/results/activation_rounding.json]

8 bits is what llama.cpp's CPU kernels use; 22 bits is what pdserve's one-row Q4_1 kernel uses
(15 bits was its first version: accurate on average, but coarse enough to flip near-tied tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.models.loader import load_model  # noqa: E402
from tests.models.test_quantized_agreement import BLOCK_SIZE, NUM_POSITIONS, PASSAGE, _prefill, _runner  # noqa: E402


def round_blocks(x: torch.Tensor, bits: int) -> torch.Tensor:
    blocks = x.reshape(-1, 32)
    largest = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(-1, keepdim=True) / largest
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / scale).clamp(-largest, largest) * scale).reshape(x.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 15, 22])
    parser.add_argument("--out", default="bench/results/activation_rounding.json")
    args = parser.parse_args()
    loaded = load_model(None, torch.float32, torch.device("cpu"), quantization="none")
    model = loaded.model
    tokens = loaded.tokenizer.encode(" ".join(PASSAGE.split()), add_special_tokens=False)[:NUM_POSITIONS]
    table = list(range(1, NUM_POSITIONS // BLOCK_SIZE + 1))
    reference = _prefill(_runner(model), tokens, table)
    linears = [module for name, module in model.named_modules()
               if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2
               and "embed" not in name]
    results = {}
    print("| activations | linear layers | top-1 agreement | mean abs logit error |")
    print("|---|---:|---:|---:|")
    for bits in args.bits:
        hooks = [linear.register_forward_pre_hook(lambda _, inputs, bits=bits: (round_blocks(inputs[0], bits),)
                                                  + tuple(inputs[1:])) for linear in linears]
        try:
            rounded = _prefill(_runner(model), tokens, table)
        finally:
            for hook in hooks:
                hook.remove()
        agreement = (reference.argmax(-1) == rounded.argmax(-1)).float().mean().item()
        error = (reference - rounded).abs().mean().item()
        results[f"{bits} bits"] = {"top1_agreement": agreement, "mean_abs_logit_error": error}
        print(f"| {bits}-bit blocks of 32 | {len(linears)} | {agreement:.4f} | {error:.2e} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"positions": NUM_POSITIONS, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
