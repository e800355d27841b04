"""Composition roots: where processes are wired together from the packages below.

Read in this order: `cli` (`pdserve serve|prefill|decode|proxy|up`), `worker`
(one worker process: config -> metrics, engine, app -> uvicorn), `engine_factory`
(`build_engine`: the engine composed of three sides, `model_side` (device, ranks,
weights, pool geometry, runner), `kv_cache_side` (block manager, offload tier) and
`pd_side` (transport, connector, admission)), `drain`
(SIGTERM: finish what is in flight, then exit), `local_cluster` (`pdserve up`:
prefill, decode and proxy as child processes), `ranks` (a tensor-parallel
worker's other ranks on this host), `children` (what every child process they start
shares: a free port, dying with its parent).

May import: anything, the proxy included. Nothing imports this package.
"""
