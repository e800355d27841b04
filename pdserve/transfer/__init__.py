"""KV transfer: pages move between workers' pools through a small transport contract.

Read in this order: `transport` (the contract: `KVTransport`, `PeerInfo`,
handles that are begun and polled, never waited on), `planner` (the two sides'
handoffs -> unit ids of one READ, in units of the smaller block size; wire
block-id checks), `token_units` (a unit of one row -> the chunks it occupies
when P and D block sizes differ), `descriptor_runs` (chunk pairs -> the fewest
descriptors, directly or through staging), `staging` (the staging-buffer cache),
`nixl_transport` (the only module that imports nixl), `staged_copy` (staging
memory and the copy into the pool), `agent_client` / `agent_process` /
`agent_restart` (the NIXL agent in a child process of its own, so a crash in
NIXL or UCX costs reads, not the worker), `ucx_environment`, `fake_transport`
(in-process, for unit tests), `ranked_transport` (a tensor-parallel worker:
rank 0 drives every rank's agent).

May import: api, kv. Torch-free but for `nixl_transport`.
"""
