"""Reading the UCX endpoints inside a peer's NIXL metadata (pdserve/transfer/ucx_address.py):
the real library's metadata read whole, forged addresses read back, and anything else refused."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest

from pdserve.pd.peer_trust import is_own_address
from pdserve.transfer.ucx_address import (Reach, UcxEndpoint, UnreadableAddress, metadata_endpoints,
                                          nixl_backend_blobs, transport_checksum, worker_address_endpoints)
from tests.transfer.ucx_packing import Device, nixl_metadata, tcp_device, tcp_loopback_device, worker_address

_AGENT_METADATA = """
import base64, torch
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
agent.register_memory(torch.zeros(4096, dtype=torch.uint8))
print(base64.b64encode(agent.get_agent_metadata()).decode())
"""


@pytest.fixture(scope="module")
def real_metadata() -> bytes:
    """The metadata of a real NIXL agent with UCX, made in a child (UCX keeps threads)."""
    pytest.importorskip("nixl")
    done = subprocess.run([sys.executable, "-c", _AGENT_METADATA], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return base64.b64decode(done.stdout.strip().splitlines()[-1])


def test_the_installed_nixl_and_ucx_pack_an_address_read_whole_with_only_this_hosts_ips(real_metadata):
    # A UCX or NIXL upgrade that packs otherwise fails here, not in a deployment's handshakes.
    endpoints = metadata_endpoints(real_metadata)
    kinds = {endpoint.transport: endpoint.reach for endpoint in endpoints}
    assert Reach.UNKNOWN not in kinds.values(), endpoints
    assert "tcp" in kinds and {"posix", "sysv", "cma", "self"} & set(kinds), endpoints
    network = [endpoint.host for endpoint in endpoints if endpoint.reach is Reach.NETWORK]
    assert network and all(is_own_address(host) for host in network), endpoints
    assert not is_own_address("203.0.113.9")  # TEST-NET-3: no host here has it


@pytest.mark.parametrize("version", [1, 2])
def test_a_packed_address_reads_back_its_endpoints(version):
    address = worker_address([Device(["self"]), tcp_device("10.1.2.3"), tcp_device("fd00::7"),
                              tcp_loopback_device(), Device(["posix", "cma"], b"\x01" * 8),
                              Device(["rc_mlx5", "ud_verbs"], b"\x02" * 18)], version)
    assert worker_address_endpoints(address) == [
        UcxEndpoint("self", Reach.HOST), UcxEndpoint("tcp", Reach.NETWORK, "10.1.2.3"),
        UcxEndpoint("tcp", Reach.NETWORK, "fd00::7"), UcxEndpoint("tcp", Reach.HOST),
        UcxEndpoint("posix", Reach.HOST), UcxEndpoint("cma", Reach.HOST),
        UcxEndpoint("rc_mlx5", Reach.FABRIC), UcxEndpoint("ud_verbs", Reach.FABRIC)]
    assert metadata_endpoints(nixl_metadata(address)) == worker_address_endpoints(address)


def test_an_unknown_transport_is_named_by_its_checksum():
    address = worker_address([Device(["mystery"], b"\x00\x02\x0a\x00\x00\x01")], checksums={"mystery": 0xBEEF})
    assert worker_address_endpoints(address) == [UcxEndpoint("crc16 0xbeef", Reach.UNKNOWN)]
    assert transport_checksum("tcp") != transport_checksum("posix")


@pytest.mark.parametrize("damage", ["truncated", "padded", "version", "tcp_length", "magic", "no_ucx"])
def test_metadata_that_does_not_read_whole_is_unreadable(damage):
    address = worker_address([tcp_device("10.1.2.3"), Device(["posix"], b"\x01" * 8)])
    metadata = nixl_metadata(address)
    if damage == "truncated":
        metadata = nixl_metadata(address[:-3])
    elif damage == "padded":
        metadata = nixl_metadata(address + b"\x00")
    elif damage == "version":
        metadata = nixl_metadata(bytes([0x27]) + address[1:])
    elif damage == "tcp_length":
        metadata = nixl_metadata(worker_address([Device(["tcp"], bytes([0, 2, 10, 1, 2]))]))
    elif damage == "magic":
        metadata = b"pdserve" + metadata
    else:
        metadata = metadata.replace(b"UCX", b"GDS")
    with pytest.raises(UnreadableAddress):
        metadata_endpoints(metadata)


def test_the_backend_blobs_are_found_by_name():
    address = worker_address([tcp_device("10.1.2.3")])
    assert nixl_backend_blobs(nixl_metadata(address)) == {b"UCX": address}
