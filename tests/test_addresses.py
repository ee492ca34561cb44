"""peerd/addresses.py: addresses split, joined and read the same way for IPv4 and IPv6. The swarm-level check is
tests/test_ipv6_netns.py (hosts with IPv6 addresses alone)."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peerd.addresses import host_block, hostport, remote_ip, split_address, split_host
from tests.test_metrics import _ipv6_loopback


def test_split_host_reads_v4_v6_and_names() -> None:
    assert split_host("10.0.0.1:7000") == "10.0.0.1"
    assert split_host("[2001:db8::1]:7000") == "2001:db8::1"
    assert split_host("peer.example:7000") == "peer.example"
    assert split_host("nonsense") == ""
    assert split_host("host:x") == ""  # no port, no address


@pytest.mark.parametrize("bad", ["", "host", "host:", ":80", "host:0", "host:70000", "host:x"])
def test_split_address_refuses_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        split_address(bad)


def test_split_address_reads_v4_and_v6() -> None:
    assert split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert split_address("[::1]:7000") == ("::1", 7000)


def test_hostport_brackets_ipv6_only() -> None:
    assert hostport("10.0.0.2", 7000) == "10.0.0.2:7000"
    assert hostport("fd77::2", 7000) == "[fd77::2]:7000"  # 'fd77::2:7000' would dial nothing
    assert hostport("[fd77::2]", "7000") == "[fd77::2]:7000"
    assert hostport("peer.example", 7000) == "peer.example:7000"
    for address in ("10.0.0.2:7000", "[fd77::2]:7000"):
        assert hostport(*split_address(address)) == address


def test_remote_ip_reads_grpc_peer_strings() -> None:
    assert str(remote_ip("ipv4:1.2.3.4:5678")) == "1.2.3.4"
    assert str(remote_ip("ipv6:%5Bfd77::2%5D:5678")) == "fd77::2"  # how gRPC spells it: percent-encoded
    assert str(remote_ip("ipv6:[fd77::2]:5678")) == "fd77::2"
    assert str(remote_ip("ipv6:%5B::ffff:1.2.3.4%5D:5678")) == "1.2.3.4"  # IPv4 through a dual-stack listener
    assert remote_ip("unix:/tmp/sock") is None and remote_ip("ipv6:%5Bnonsense%5D:1") is None


def test_host_block_is_the_v4_address_or_the_v6_64() -> None:
    import ipaddress

    assert host_block(ipaddress.ip_address("1.2.3.4")) == "1.2.3.4"
    assert host_block(ipaddress.ip_address("2001:db8:1:2:3:4:5:6")) == "2001:db8:1:2::/64"
    assert host_block(ipaddress.ip_address("::ffff:1.2.3.4")) == "1.2.3.4"


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_real_grpc_caller_over_ipv6_is_read_right() -> None:
    """The peer string comes from gRPC itself, over a real IPv6 connection: the format remote_ip reads is gRPC's."""
    seen: list[str] = []

    class Health(health.HealthServicer):
        def Check(self, request, context):
            seen.append(context.peer())
            return super().Check(request, context)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(Health(), server)
    port = server.add_insecure_port("[::1]:0")
    server.start()
    try:
        with grpc.insecure_channel(hostport("::1", port)) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        server.stop(None)
    assert seen and str(remote_ip(seen[0])) == "::1", seen
