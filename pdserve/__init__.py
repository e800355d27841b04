"""pdserve: disaggregated prefill/decode LLM serving.

Packages, in the direction imports go (each imports only packages above it;
tests/test_import_rules.py checks that pdserve's packages form no cycle and
the rules that matter most):

    api        the contract: OpenAI schemas, validation, bounds, errors, settings, flags,
               sampling records, chat template, kv_transfer records       (torch-free)
    kv         the hybrid block allocator and the pool's layout           (torch-free but layout)
    transfer   the transport contract, the NIXL agent, the descriptor planner
    request    (module) the engine's request records, below pd/ and engine/ (imports api only)
    metrics    (module) the Prometheus metrics every layer feeds
    pd         the P/D connector: handshake, both sides, leases, admission (torch-free)
    kernels    native CPU kernels;  models: architectures, checkpoint loaders, tokenizer
    grammar    structured outputs compiled at the HTTP edge;  tools: tool-call parsers
    engine     scheduler, runner, sampler, the engine thread and its grammar matchers
    server     a worker's HTTP app
    app        composition roots (cli, worker, drain, `pdserve up`); nothing imports it

The proxy (top-level package `proxy`) imports only `pdserve.api` and `pdserve.kv`.
"""
