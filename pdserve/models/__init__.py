"""Model architectures, checkpoint loaders and tokenizers.

Read in this order: `base` (the contract with the runner), `registry` (which
class serves which architecture), `llama` and `gemma3` (one file per family,
built from `layers`, `rope` and `weight_targets`), `loader` (a servable model
from a path) with `weights`, `weight_loader` and `quant/` (float or
block-quantized layers), `hf_config`, the GGUF reader (`gguf_reader`,
`gguf_file`, `gguf_tokenizer`), and `tokenizer` (text <-> ids, streaming
detokenization; its chat template renders through `pdserve.api.chat_template`),
and `tensor_parallel` (one rank's shard of a model; `moe_sharding` for experts).

May import: api, kv (layer specs), kernels. Never imports engine, server or app.
"""
