"""Paged KV cache: hybrid layer groups, the shared block pool and its tensor layout.

Read in this order: specs (layer specs -> groups; page_geometry: one page size
when recurrent-state groups share the pool), hashing (prefix-cache keys),
block_pool (block ids, refs, LRU), prefix (hit matching across groups),
manager (per-request tables; the scheduler's API; state_pages: live state pages,
snapshots and the page copies the runner performs), layout (the pool tensor;
shared_memory: host memory an isolated NIXL agent's process maps too),
sizing (how many blocks a device's memory holds); then what leaves the
worker: events (what enters and leaves the prefix cache), events_wire (their
NDJSON format) and routing_info (what a router needs to hash prompts itself).

May import: api only. Only `layout` imports torch; importing this package
imports nothing else, so the proxy can use the hashing, prefix and event modules.
"""
