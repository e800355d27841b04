"""Which prefill peers a decode worker may contact: one on its allow-list, when it has one.

Invariant: `remote_host` from kv_transfer_params is a bare host — an IP
literal or a DNS name, never a port, path, query or credentials smuggled into
the handshake URL (`bare_host`, applied where the params are parsed) — and,
when the operator gave `--kv-allowed-peers`, a decode worker handshakes and
reads only with listed hosts: a name matches only itself (no DNS lookup that
could answer differently later), an IP literal must lie in a listed address
or CIDR. The same holds for the data path: every IP endpoint in the UCX worker
address inside the peer's NIXL metadata must be listed too (`check_data_path`),
or be this host's own when the handshake went to loopback; an address this
worker cannot read is refused. Torch-free.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pdserve.api.config import parse_peer_allow_list
from pdserve.api.errors import PdserveError
from pdserve.transfer.ranked_transport import decode_ranks
from pdserve.transfer.transport import PeerInfo, TransferError
from pdserve.transfer.ucx_address import NIXL_MAGIC, Reach, UcxEndpoint, UnreadableAddress, metadata_endpoints


class KVPeerNotAllowed(PdserveError):
    """kv_transfer_params point at a prefill worker this decode worker may not contact (403)."""

    status_code = 403
    error_type = "permission_error"


def peer_endpoints(peer: PeerInfo) -> list[UcxEndpoint]:
    """The UCX endpoints in a peer's NIXL metadata, every tensor-parallel rank's; UnreadableAddress
    when it is neither one agent's metadata nor a rank list of them."""
    if peer.agent_metadata.startswith(NIXL_MAGIC):
        return metadata_endpoints(peer.agent_metadata)
    try:
        ranks = decode_ranks(peer)
    except TransferError as error:
        raise UnreadableAddress(error.message) from None
    return [endpoint for rank in ranks for endpoint in metadata_endpoints(rank.agent_metadata)]


def is_own_address(host: str) -> bool:
    """Whether `host` (an IP literal) is an address of this host: only those can be bound. Any
    failure to tell counts as not (the caller then refuses the peer)."""
    address = ipaddress.ip_address(host)
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
    except OSError:  # EADDRNOTAVAIL: not ours; EINVAL: a scoped address without its scope; others: unknown
        return False
    return True


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    names: tuple[str, ...]
    networks: tuple[Any, ...]
    # Reads a peer's data-path endpoints; the NIXL metadata reader unless a test's fake transport says otherwise.
    read_endpoints: Callable[[PeerInfo], list[UcxEndpoint]] = field(default=peer_endpoints, compare=False)

    @classmethod
    def parse(cls, text: Optional[str],
              read_endpoints: Callable[[PeerInfo], list[UcxEndpoint]] = peer_endpoints) -> Optional["PeerAllowList"]:
        """None (no restriction) for no text; the format is checked by the config already."""
        if text is None:
            return None
        names, networks = parse_peer_allow_list(text)
        return cls(names, networks, read_endpoints)

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

    def check_data_path(self, peer: PeerInfo, handshake_host: str) -> None:
        """403 unless UCX can reach only allowed hosts through the peer's metadata: every IP endpoint
        listed (or this host's own, when the handshake itself went to loopback). Same-host transports
        (shared memory, CMA, GPU IPC, TCP on loopback) reach no other host; RDMA fabric addresses are
        not IPs and pass (the fabric's partitions govern them); an unknown transport or an address
        this worker cannot read is refused."""
        try:
            endpoints = self.read_endpoints(peer)
        except UnreadableAddress as error:
            raise KVPeerNotAllowed(f"the transport record of prefill peer {peer.engine_id!r} has a data-path address "
                                   f"this decode worker cannot check against --kv-allowed-peers: {error}",
                                   param="kv_transfer_params") from None
        local_peer = _is_loopback(handshake_host)
        for endpoint in endpoints:
            if endpoint.reach is Reach.UNKNOWN:
                raise KVPeerNotAllowed(f"prefill peer {peer.engine_id!r} offers a UCX transport this decode worker "
                                       f"does not know ({endpoint.transport}); --kv-allowed-peers cannot vouch for it",
                                       param="kv_transfer_params")
            if endpoint.reach is not Reach.NETWORK or endpoint.host is None:
                continue
            if not self.allows(endpoint.host) and not (local_peer and is_own_address(endpoint.host)):
                raise KVPeerNotAllowed(f"prefill peer {peer.engine_id!r} offers a UCX data path to "
                                       f"{endpoint.host} ({endpoint.transport}), which is not among this decode "
                                       "worker's allowed prefill peers (--kv-allowed-peers)",
                                       param="kv_transfer_params")
