"""Which prefill peers a decode worker may contact: one on its allow-list, when it has one.

Invariant: `remote_host` from kv_transfer_params is a bare host — an IP
literal or a DNS name, never a port, path, query or credentials smuggled into
the handshake URL (`bare_host`, applied where the params are parsed) — and,
when the operator gave `--kv-allowed-peers`, a decode worker handshakes and
reads only with listed hosts: a name matches only itself (no DNS lookup that
could answer differently later), an IP literal must lie in a listed address
or CIDR. Torch-free.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Optional

from pdserve.api.config import parse_peer_allow_list
from pdserve.api.errors import PdserveError


class KVPeerNotAllowed(PdserveError):
    """kv_transfer_params point at a prefill worker this decode worker may not contact (403)."""

    status_code = 403
    error_type = "permission_error"


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    names: tuple[str, ...]
    networks: tuple[Any, ...]

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["PeerAllowList"]:
        """None (no restriction) for no text; the format is checked by the config already."""
        if text is None:
            return None
        names, networks = parse_peer_allow_list(text)
        return cls(names, networks)

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower().rstrip(".") in {name.rstrip(".") for name in self.names}
        return any(address in network for network in self.networks)

    def check(self, host: str) -> None:
        if not self.allows(host):
            raise KVPeerNotAllowed(f"kv_transfer_params.remote_host {host!r} is not among this decode worker's "
                                   "allowed prefill peers (--kv-allowed-peers)", param="kv_transfer_params")
