"""Where a peer's NIXL metadata lets UCX connect: the endpoints inside its packed worker address.

A decode worker with `--kv-allowed-peers` checks more than the handshake address: the NIXL
metadata a prefill peer sends carries a UCX worker address, and UCX connects wherever that
address says. This module reads it without NIXL or UCX.

Invariant: a blob is read whole or not at all. Every length is bounded by the bytes left, the
walk must end exactly at the blob's last byte, and anything else (a UCX version that packs
differently, unified mode, a truncated or padded blob) raises `UnreadableAddress`: a caller that
checks endpoints refuses what it cannot read. Torch-free and nixl-free.

NIXL's metadata (its serializer: a magic, then tag, 8-byte little-endian length, value, "|"):

    "nixlSerDes|" "Agent" len name "|" "Conns" len count(8 bytes) "|"
        then per backend: "t" len "UCX" "|" "c" len <worker address> "|"   ... memory sections

UCX's packed worker address (UCX 1.23, src/ucp/wireup/address.c; default UCX_ADDRESS_VERSION=v1):

    v1: [ header: version(4 bits)=0 | flags(4 bits) ] [ uuid: 8 ]? [ client id: 8 ]? [ name ]?
    v2: [ version(4)=1 | release(4) ] [ flags: 1 ]     [ uuid: 8 ]? [ client id: 8 ]? [ name ]?
    then devices until one has LAST:
      [ md: 1 (0x80 = no transports; v2: 0x7f = index in next byte) ]
      [ LAST 0x80 | NUM_PATHS 0x40 | SYS_DEVICE 0x20 | length: 5 bits (v2: 31 = next byte) ]
      [ paths: 1 ]? [ sys device: 1 ]? [ device address: length ]
      then, unless the device has no transports, transports until one has LAST:
        [ crc16(transport name): 2 ] [ attributes: 16 (v1) or 8 (v2) ]
        [ LAST 0x80 | HAS_EP 0x40 | length: 6 bits (v2: 63 = next byte) ] [ iface address ]
        then, with HAS_EP, endpoint addresses until one's lane byte has LAST:
          [ length: 1 ] [ ep address ] [ LAST 0x80 | lane: 7 bits ]

A TCP device address is [ flags: 1 ] [ sa_family: 1 ] then the IPv4/IPv6 address, or, with the
loopback flag, a host and network-namespace id (reachable only on the same host).
"""

from __future__ import annotations

import enum
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Optional

NIXL_MAGIC = b"nixlSerDes|"
UCX_BACKEND = b"UCX"

_LAST = 0x80
_MD_EMPTY = 0x80
_DEVICE_NUM_PATHS = 0x40
_DEVICE_SYS_DEVICE = 0x20
_DEVICE_LENGTH_MASK = 0x1F
_IFACE_HAS_EP = 0x40
_IFACE_LENGTH_MASK = 0x3F
_HEADER_DEBUG_INFO = 0x1
_HEADER_WORKER_UUID = 0x2
_HEADER_CLIENT_ID = 0x4
_NULL_RESOURCE = 0xFF
_V1, _V2 = 0, 1
_IFACE_ATTR_BYTES = {_V1: 16, _V2: 8}  # v1: three floats and packed flags; v2: fp8s, priority, segment, flags
_TCP_LOOPBACK = 0x1


class Reach(enum.Enum):
    """Whom an endpoint lets UCX reach."""

    NETWORK = "network"  # an IP address: checkable against an allow-list
    HOST = "host"  # the same host only (shared memory, CMA, GPU IPC, TCP on loopback)
    FABRIC = "fabric"  # an RDMA fabric address (LID/GID), not an IP
    UNKNOWN = "unknown"  # a transport this module does not know


class UnreadableAddress(ValueError):
    """The metadata or worker address does not parse as this module reads them."""


@dataclass(frozen=True, slots=True)
class UcxEndpoint:
    transport: str  # UCX's transport name, or "crc16 0x...." when unknown
    reach: Reach
    host: Optional[str] = None  # the IP literal of a NETWORK endpoint


_HOST_TRANSPORTS = ("self", "posix", "sysv", "xpmem", "cma", "knem", "cuda_copy", "cuda_ipc", "gdr_copy",
                    "rocm_cpy", "rocm_ipc", "rocm_gdr", "ze_cpy", "ze_ipc", "gaudi_gdr")
_FABRIC_TRANSPORTS = ("rc_verbs", "ud_verbs", "rc_mlx5", "ud_mlx5", "dc_mlx5", "rc_gda", "srd", "gga_mlx5",
                      "ugni_rdma", "ugni_smsg", "ugni_udt")


def transport_checksum(name: str) -> int:
    """UCX's name checksum: CRC-16/X.25 of the name's bytes (ucs_crc16_string)."""
    crc = 0xFFFF
    for byte in name.encode():
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


# The names by checksum, computed once (recomputing them was 80% of reading an address).
_TRANSPORT_NAMES = {transport_checksum(name): name for name in ("tcp", *_HOST_TRANSPORTS, *_FABRIC_TRANSPORTS)}


class _Reader:
    def __init__(self, blob: bytes):
        self.blob, self.at = blob, 0

    def take(self, count: int) -> bytes:
        if count < 0 or self.at + count > len(self.blob):
            raise UnreadableAddress(f"{count} bytes wanted at offset {self.at} of {len(self.blob)}")
        piece = self.blob[self.at:self.at + count]
        self.at += count
        return piece

    def byte(self) -> int:
        return self.take(1)[0]

    def extended(self, first: int, mask: int, version: int) -> int:
        """A length or index in `first & mask`, or, in v2 when it is all ones, in the next byte."""
        value = first & mask
        return self.byte() if version == _V2 and value == mask else value

    @property
    def done(self) -> bool:
        return self.at == len(self.blob)


def nixl_backend_blobs(metadata: bytes) -> dict[bytes, bytes]:
    """The connection blob of each backend in a NIXL agent's metadata, by backend name."""
    reader = _Reader(metadata)
    if reader.take(len(NIXL_MAGIC)) != NIXL_MAGIC:
        raise UnreadableAddress("not NIXL agent metadata (no serializer magic)")
    _field(reader, b"Agent")
    count_bytes = _field(reader, b"Conns")
    if len(count_bytes) != 8:
        raise UnreadableAddress("NIXL metadata's connection count is not 8 bytes")
    (count,) = struct.unpack("<Q", count_bytes)
    if count > 16:
        raise UnreadableAddress(f"NIXL metadata lists {count} backends")
    return {_field(reader, b"t"): _field(reader, b"c") for _ in range(count)}


def _field(reader: _Reader, tag: bytes) -> bytes:
    if reader.take(len(tag)) != tag:
        raise UnreadableAddress(f"NIXL metadata lacks its {tag.decode()!r} field where expected")
    (length,) = struct.unpack("<Q", reader.take(8))
    value = reader.take(length)
    if reader.take(1) != b"|":
        raise UnreadableAddress(f"NIXL metadata's {tag.decode()!r} field is not terminated")
    return value


def worker_address_endpoints(address: bytes) -> list[UcxEndpoint]:
    """Every transport endpoint a packed UCX worker address offers (see the module's layout)."""
    reader = _Reader(address)
    first = reader.byte()
    version = first & 0x0F
    if version == _V1:
        flags = first >> 4
    elif version == _V2:
        flags = reader.byte()
    else:
        raise UnreadableAddress(f"UCX worker address version {version} is not read here")
    if flags & _HEADER_WORKER_UUID:
        reader.take(8)
    if flags & _HEADER_CLIENT_ID:
        reader.take(8)
    if flags & _HEADER_DEBUG_INFO:
        reader.take(reader.byte())
    endpoints: list[UcxEndpoint] = []
    if reader.blob[reader.at:reader.at + 1] == bytes([_NULL_RESOURCE]):
        reader.take(1)
    else:
        last_device = False
        while not last_device:
            last_device = _read_device(reader, version, endpoints)
    if not reader.done:
        raise UnreadableAddress(f"{len(address) - reader.at} bytes left after the last device "
                                "(another UCX address layout, or unified mode)")
    return endpoints


def _read_device(reader: _Reader, version: int, endpoints: list[UcxEndpoint]) -> bool:
    md = reader.byte()
    reader.extended(md, 0x7F, version)
    length_byte = reader.byte()
    device_length = reader.extended(length_byte, _DEVICE_LENGTH_MASK, version)
    if length_byte & _DEVICE_NUM_PATHS:
        reader.byte()
    if length_byte & _DEVICE_SYS_DEVICE:
        reader.byte()
    device = reader.take(device_length)
    last_transport = bool(md & _MD_EMPTY)
    while not last_transport:
        (checksum,) = struct.unpack("<H", reader.take(2))
        reader.take(_IFACE_ATTR_BYTES[version])
        iface_byte = reader.byte()
        last_transport = bool(iface_byte & _LAST)
        reader.take(reader.extended(iface_byte, _IFACE_LENGTH_MASK, version))
        if iface_byte & _IFACE_HAS_EP:
            last_ep = False
            while not last_ep:
                reader.take(reader.byte())
                last_ep = bool(reader.byte() & _LAST)
        endpoints.append(_endpoint(_TRANSPORT_NAMES.get(checksum), checksum, device))
    return bool(length_byte & _LAST)


def _endpoint(name: Optional[str], checksum: int, device: bytes) -> UcxEndpoint:
    if name is None:
        return UcxEndpoint(f"crc16 {checksum:#06x}", Reach.UNKNOWN)
    if name in _HOST_TRANSPORTS:
        return UcxEndpoint(name, Reach.HOST)
    if name in _FABRIC_TRANSPORTS:
        return UcxEndpoint(name, Reach.FABRIC)
    return _tcp_endpoint(device)


def _tcp_endpoint(device: bytes) -> UcxEndpoint:
    if len(device) < 2:
        raise UnreadableAddress(f"a TCP device address of {len(device)} bytes")
    flags, family, rest = device[0], device[1], device[2:]
    if flags & _TCP_LOOPBACK:
        return UcxEndpoint("tcp", Reach.HOST)
    sizes = {socket.AF_INET: 4, socket.AF_INET6: 16}
    if sizes.get(family) != len(rest):
        raise UnreadableAddress(f"a TCP device address of family {family} with {len(rest)} address bytes")
    return UcxEndpoint("tcp", Reach.NETWORK, str(ipaddress.ip_address(rest)))


def metadata_endpoints(metadata: bytes) -> list[UcxEndpoint]:
    """The endpoints of the UCX backend in one NIXL agent's metadata."""
    blobs = nixl_backend_blobs(metadata)
    if UCX_BACKEND not in blobs:
        raise UnreadableAddress(f"NIXL metadata has no UCX backend (backends: {sorted(blobs)})")
    return worker_address_endpoints(blobs[UCX_BACKEND])
