"""The full-size packet check (peerd/pathcheck.py) against a real daemon, and against servers with injected faults.

The namespace test (tests/test_mtu_blackhole.py) makes the real blackhole; here the verdict logic is pinned down on
loopback: a servicer that withholds its answer to padded echoes stands in for a path that drops full-size packets,
and one that answers nothing for a starved process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from peerd.pathcheck import MAX_PAD_BYTES, full_size_path
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from tests.swarm import Swarm, tiny_config


class _Echo(rpc.MembershipServicer):
    """Answers ProbeEcho after `delay` seconds; padded ones never, when `drop_padded` (a blackhole's effect)."""

    def __init__(self, drop_padded: bool = False, delay: float = 0.0) -> None:
        self.drop_padded = drop_padded
        self.delay = delay

    async def ProbeEcho(self, request: pb.ProbeEchoRequest, context: grpc.aio.ServicerContext) -> pb.ProbeEchoResponse:
        if self.drop_padded and request.padding:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay)
        return pb.ProbeEchoResponse()


async def _verdict(servicer: _Echo, timeout: float = 0.5) -> bool | None:
    server = grpc.aio.server()
    rpc.add_MembershipServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await full_size_path(f"127.0.0.1:{port}", b"run", timeout)
    finally:
        await server.stop(0)


def test_only_small_echoes_answered_is_a_blackhole() -> None:
    assert asyncio.run(_verdict(_Echo(drop_padded=True))) is False


def test_both_answered_is_a_working_path() -> None:
    assert asyncio.run(_verdict(_Echo())) is True


def test_no_answer_at_all_is_no_verdict() -> None:
    """A process too starved to answer says nothing about packet sizes, and must not be blocked for it."""
    assert asyncio.run(_verdict(_Echo(delay=2.0))) is None


def test_a_real_daemon_passes_and_refuses_oversized_padding(tmp_path: Path) -> None:
    with Swarm(tmp_path, 1, tiny_config(tmp_path, run__outer_steps=1000)) as swarm:
        address = swarm.peers[0].address
        assert asyncio.run(full_size_path(address, b"run", 2.0)) is True
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
            req = pb.ProbeEchoRequest(nonce=b"n" * 16, padding=b"p" * (MAX_PAD_BYTES + 1))
            rpc.MembershipStub(ch).ProbeEcho(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "padding over" in (err.value.details() or "")
        assert swarm.peers[0].proc.poll() is None  # still serving
