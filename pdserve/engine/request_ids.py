"""The one owner of request-id uniqueness in a worker: ids in use by any live request or held blocks.

Invariant: no two requests in a worker's engine share an id, from the moment
an id is reserved until every block held under it is back in the pool (a
prefill worker's pinned blocks keep their id reserved). The id a client sends
is used as is; only when it is taken does the worker serve the request as
`<id>#<n>` (smallest free n >= 2), and says so in the X-Request-Id it
answers with. Each reservation is released exactly once: by the HTTP layer
if the request never reached the engine, else by the engine loop. Thread-safe,
torch-free.
"""

from __future__ import annotations

import threading
import uuid
from typing import Optional

# The rule itself lives with the rest of the edge validation, which the proxy shares.
from pdserve.api.validation import MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER, check_request_id

__all__ = ["MAX_REQUEST_ID_CHARS", "REQUEST_ID_HEADER", "RequestIdRegistry", "check_request_id"]

_SUFFIX_SEPARATOR = "#"


class RequestIdRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: set[str] = set()

    def reserve(self, wanted: Optional[str]) -> str:
        """The id to serve a request under (a fresh uuid when none is given)."""
        if not wanted:
            wanted = uuid.uuid4().hex
        check_request_id(wanted)
        with self._lock:
            request_id, suffix = wanted, 2
            while request_id in self._in_use:
                request_id = f"{wanted}{_SUFFIX_SEPARATOR}{suffix}"
                suffix += 1
            self._in_use.add(request_id)
        return request_id

    def release(self, request_id: str) -> None:
        with self._lock:
            self._in_use.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._in_use

    def __len__(self) -> int:
        with self._lock:
            return len(self._in_use)
