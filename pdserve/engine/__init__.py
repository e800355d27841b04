"""The engine: one thread that schedules, runs and samples every step, and its async face.

Read in this order. What the HTTP layer sees: `api` (the `EngineClient`
contract), `async_engine` (a `RequestStream` per request), `request_ids`.
The engine thread: `loop` (poll P/D -> schedule -> run -> update -> emit,
supervised), `scheduler` with `schedule_types` and `stop_rules` (torch-free:
every request-state change and block allocation), `emitter` and `outputs`
(text, stop strings, sinks), `stats`. On the device: `runner` (the one owner
of the pool tensor and the model), `paged_attention`, `decode_step`,
`decode_attention` and `fused_layer` (decode-only steps), `sampler`,
`logits_processors`, `prompt_logprobs`, `grammar_matchers` (llguidance masks
computed beside the forward pass). Assembly: `devices`, `memory_budget`,
`factory`. Tensor parallelism: `tensor_parallel` (rank 0's runner, the other
ranks' loop).

May import: api, kv, transfer, request, pd, models, kernels, grammar, metrics, parallel.
Never imports server or app.
"""
