"""`RemoteSource`: where a decode request's prompt KV lives, once the async side has verified it.

The record the admission hands the engine thread with a decode request; it sits
below the connector and the request record so both can name it. Torch-free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.pd.handshake import AgentInfo
from pdserve.pd.params import RemotePrefillParams


@dataclass(frozen=True, slots=True)
class RemoteSource:
    """Verified on the async side: where a decode request's prompt KV lives.

    `params` passed every check against the peer's handshake `agent`; the
    transport connection to that peer was ready when the request was admitted.
    `received_s` (monotonic) is when P's lease was last known to be fresh."""

    params: RemotePrefillParams
    agent: AgentInfo
    received_s: float = field(default_factory=time.monotonic)

    @property
    def peer_identity(self) -> tuple[str, str]:
        return self.agent.engine_id, self.agent.epoch
