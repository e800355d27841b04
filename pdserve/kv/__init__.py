"""Paged KV cache: hybrid layer groups, the shared block pool and its tensor layout.

Module map: specs (layer specs -> groups), hashing (prefix-cache keys),
block_pool (block ids, refs, LRU), prefix (hit matching across groups),
manager (per-request tables; the scheduler's API), layout (the pool tensor).
Only `layout` imports torch; importing this package imports nothing else.
"""
