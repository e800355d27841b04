"""KV transfer: pages move between workers' pools through a small transport contract.

Read in this order: `transport` (the contract: `KVTransport`, `PeerInfo`,
handles that are begun and polled, never waited on), `planner` (block ids ->
descriptor indices; wire block-id checks), `nixl_transport` (the only module
that imports nixl), `fake_transport` (in-process, for unit tests),
`ranked_transport` (a tensor-parallel worker: rank 0 drives every rank's agent).

May import: api, kv. Torch-free but for `nixl_transport`.
"""
