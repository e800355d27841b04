"""Test-side packing of NIXL metadata and UCX worker addresses, in the layout
pdserve/transfer/ucx_address.py reads (its module docstring), so tests can forge what a peer sends."""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

from pdserve.transfer.ucx_address import NIXL_MAGIC, transport_checksum


@dataclass(frozen=True)
class Device:
    transports: Sequence[str]  # UCX transport names offered on this device
    address: bytes = b""


def tcp_device(ip: str) -> Device:
    parsed = ipaddress.ip_address(ip)
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    return Device(["tcp"], bytes([0, family]) + parsed.packed)


def tcp_loopback_device() -> Device:
    return Device(["tcp"], bytes([1, socket.AF_INET]) + bytes(16))  # flags LOOPBACK, then host and netns ids


def worker_address(devices: Sequence[Device], version: int = 1, checksums: Optional[dict[str, int]] = None) -> bytes:
    """A packed worker address (v1 as UCX packs by default, or v2) with a worker uuid and one
    transport per name, iface addresses of two bytes and no endpoint addresses."""
    checksums = checksums or {}
    out = bytearray([0x20] if version == 1 else [0x01 | (0x9 << 4), 0x02])
    out += struct.pack("<Q", 0x1234)
    for index, device in enumerate(devices):
        last = index == len(devices) - 1 and version == 2
        out += bytes([index])
        out += bytes([len(device.address) | (0x80 if last else 0)]) + device.address
        for position, name in enumerate(device.transports):
            out += struct.pack("<H", checksums.get(name, transport_checksum(name)))
            out += bytes(16 if version == 1 else 8)
            out += bytes([2 | (0x80 if position == len(device.transports) - 1 else 0)]) + b"\x10\x27"
    if version == 1:
        out += bytes([0x80 | 0x0A, 0x80])  # v1's last entry: an empty device whose md byte carries the release
    return bytes(out)


def nixl_metadata(ucx_address: bytes, agent_name: bytes = b"peer") -> bytes:
    def field(tag: bytes, value: bytes) -> bytes:
        return tag + struct.pack("<Q", len(value)) + value + b"|"

    return (NIXL_MAGIC + field(b"Agent", agent_name) + field(b"Conns", struct.pack("<Q", 1))
            + field(b"t", b"UCX") + field(b"c", ucx_address) + b"MemSection|")
