"""What the routes of one app share: the engine, the metrics, the config and the in-flight request ids.

Built by `create_app` and handed to each router factory (no module-level
state). `RequestIdRegistry` guarantees that no two in-flight requests reach
the engine with the same id, whatever clients put in `X-Request-Id`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pdserve.config import ServerConfig
from pdserve.errors import InvalidRequest
from pdserve.metrics import Metrics

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256


def _is_printable_ascii(text: str) -> bool:
    return all(" " < char <= "~" for char in text)


@dataclass(slots=True)
class RequestIdRegistry:
    """Ids of the requests in flight; a client-chosen id that is taken gets a suffix."""

    in_flight_ids: set[str] = field(default_factory=set)

    def reserve(self, wanted: Optional[str]) -> str:
        if wanted is None or wanted == "":
            request_id = uuid.uuid4().hex
        else:
            if len(wanted) > MAX_REQUEST_ID_CHARS or not _is_printable_ascii(wanted):
                raise InvalidRequest(
                    f"{REQUEST_ID_HEADER} must be at most {MAX_REQUEST_ID_CHARS} printable ASCII "
                    "characters without spaces",
                    param=REQUEST_ID_HEADER,
                )
            request_id = wanted
            suffix = 1
            while request_id in self.in_flight_ids:
                request_id = f"{wanted}-{suffix}"
                suffix += 1
        self.in_flight_ids.add(request_id)
        return request_id

    def release(self, request_id: str) -> None:
        self.in_flight_ids.discard(request_id)


@dataclass(slots=True)
class ServingContext:
    engine: "EngineClient"
    metrics: Metrics
    config: ServerConfig
    request_ids: RequestIdRegistry = field(default_factory=RequestIdRegistry)
    created_s: int = field(default_factory=lambda: int(time.time()))  # the `created` of /v1/models
