"""pdserve: disaggregated prefill/decode LLM serving.

Packages, in the direction imports may go (each imports only those before it;
tests/test_import_rules.py checks the rules that matter most):

    api        the contract shared with the proxy: OpenAI schemas, validation, bounds,
               errors, settings, flags, sampling records, chat template   (torch-free)
    kv         the hybrid block allocator and the pool's layout           (torch-free but layout)
    transfer   the transport contract, the NIXL agent, the descriptor planner
    request    (module) the engine-thread request record, below pd/ and engine/
    pd         the P/D connector: params, handshake, both sides, leases    (torch-free)
    models     architectures, checkpoint loaders, tokenizer; kernels: native CPU kernels
    engine     scheduler, runner, sampler, the engine thread and its grammar matchers
    grammar, tools    structured outputs and tool calls at the HTTP edge
    server     a worker's HTTP app
    app        composition roots (cli, worker, drain, `pdserve up`); nothing imports it

`metrics` (module) holds the Prometheus metrics every layer feeds. The proxy
(top-level package `proxy`) imports only `pdserve.api` and `pdserve.kv`.
"""
