"""Block-quantized weights: `blocks` (GGUF's Q4_1 and Q8_0 formats, packed and
dequantized with torch), `modules` (linear layers and embeddings that keep them).
May import: the native kernels only."""
