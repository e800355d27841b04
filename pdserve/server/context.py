"""What the routes of one app share: the engine, the metrics and the config.

Built by `create_app` and handed to each router factory (no module-level
state). Request ids are reserved in the engine's own registry
(`pdserve/engine/request_ids.py`), the one owner of their uniqueness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.api.config import LimitsConfig, ServerConfig
from pdserve.engine.request_ids import REQUEST_ID_HEADER, RequestIdRegistry
from pdserve.metrics import Metrics

if TYPE_CHECKING:
    from pdserve.engine.api import EngineClient

__all__ = ["REQUEST_ID_HEADER", "ServingContext"]


@dataclass(slots=True)
class ServingContext:
    engine: "EngineClient"
    metrics: Metrics
    config: ServerConfig
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    created_s: int = field(default_factory=lambda: int(time.time()))  # the `created` of /v1/models
    num_open_streams: int = 0  # streamed answers under way (bounded by config.max_concurrent_streams)

    @property
    def request_ids(self) -> RequestIdRegistry:
        return self.engine.request_ids
