"""The contract: what crosses a process boundary, shared by the workers and the proxy.

Read in this order: `errors` (typed errors, each with its HTTP status),
`config` (frozen settings, one home per setting) and `flags` (the command line
generated from them), `sampling` (what a request asks of the engine, how it
ended), `protocol` with `structured_protocol` and `tokenize_protocol` (the
OpenAI and vLLM wire schemas), `validation` and `http_bounds` (the one edge
check, run by proxy and workers alike), `chat_template` (prompt rendering),
`kv_transfer` (what P and D tell each other: kv_transfer_params, the handshake).

May import: nothing of pdserve outside this package. Torch-free and nixl-free,
so the proxy's slim image carries it without the engine.
"""
