"""Which prefill peers a decode worker may contact: a bare host, and (optionally) one on its allow-list.

Invariant: `remote_host` from kv_transfer_params is a bare host — an IP
literal or a DNS name, never a port, path, query or credentials smuggled into
the handshake URL — and, when the operator gave `--kv-allowed-peers`, a
decode worker handshakes and reads only with listed hosts: a name matches
only itself (no DNS lookup that could answer differently later), an IP
literal must lie in a listed address or CIDR. Torch-free.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Optional

from pdserve.api.config import parse_peer_allow_list
from pdserve.api.errors import PdserveError

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


class KVPeerNotAllowed(PdserveError):
    """kv_transfer_params point at a prefill worker this decode worker may not contact (403)."""

    status_code = 403
    error_type = "permission_error"


def bare_host(host: str) -> str:
    """The host itself when it is an IP literal (IPv6 with or without brackets) or a DNS name;
    ValueError otherwise. IPv6 comes back without brackets."""
    unbracketed = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(unbracketed))
    except ValueError:
        pass
    if len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ValueError("must be a bare host name or IP address (no port, path, query or user)")
    return host


def url_host(host: str) -> str:
    """How `host` is written in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


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
