"""The model-running side of a worker: everything of the engine thread that touches torch.

Read in this order. `model_runner` (`ModelRunner`, the one owner of the pool
tensor and the model; it satisfies `pdserve.engine.step_runner.StepRunner`,
the only thing the loop knows of it), `paged_attention` (steps with a
multi-token chunk), `decode_step`, `decode_attention` and `fused_layer`
(decode-only steps), `sampler`, `logits_processors`, `prompt_logprobs`,
`grammar_matchers` (llguidance masks computed beside the forward pass).
Sizing and placement: `devices`, `memory_budget`. Tensor parallelism:
`tensor_parallel` (rank 0's runner, the other ranks' loop) and
`offload_ranks` (the offload tier's copies repeated on every rank).

May import: api, kv, transfer, request, pd, engine (its contracts: schedule
types, the step-runner protocol), models, kernels, grammar, metrics, parallel.
Never imported by engine/ (the torch line), server or the proxy.
"""
