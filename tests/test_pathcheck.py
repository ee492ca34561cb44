"""The full-size packet check (peerd/pathcheck.py) against real daemons, and against a server with an injected fault.

The namespace test (tests/test_mtu_blackhole.py) makes the real blackhole; here the verdict logic is pinned down on
loopback: a server that never closes a connection on which a full-size segment's worth of bytes arrived stands in
for a path that drops them, and one that closes nothing for a host too busy to answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from peerd.pathcheck import full_size_path
from tests.swarm import Swarm, tiny_config


async def _verdict(close_up_to: int | None, timeout: float = 0.5) -> bool | None:
    """full_size_path against a server that closes a connection once it read the client's first bytes, unless it
    read `close_up_to` bytes or more by then (None: it never closes)."""
    held: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await asyncio.sleep(0.05)  # the client's bytes have all arrived on loopback
        data = await reader.read(65536)
        if close_up_to is not None and len(data) < close_up_to:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await full_size_path("127.0.0.1", port, timeout)
    finally:
        for writer in held:
            writer.close()
        server.close()


def test_only_the_small_check_closed_is_a_blackhole() -> None:
    assert asyncio.run(_verdict(close_up_to=1024)) is False


def test_both_closed_is_a_working_path() -> None:
    assert asyncio.run(_verdict(close_up_to=1 << 20)) is True


def test_neither_closed_is_no_verdict() -> None:
    """A host too busy to answer says nothing about packet sizes, and must not be blocked for it."""
    assert asyncio.run(_verdict(close_up_to=None)) is None


def test_nobody_listening_is_no_verdict() -> None:
    async def closed_port() -> int:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return port

    async def check() -> bool | None:
        return await full_size_path("127.0.0.1", await closed_port(), 0.5)

    assert asyncio.run(check()) is None


@pytest.mark.parametrize("secure", [False, True])
def test_a_real_daemon_passes_with_and_without_tls(tmp_path: Path, secure: bool) -> None:
    """gRPC's transport closes a connection that does not start with HTTP/2, after a TLS handshake of ours too, and
    keeps serving."""
    with Swarm(tmp_path, 1, tiny_config(tmp_path, run__outer_steps=1000), secure=secure) as swarm:
        host, port = swarm.peers[0].address.rsplit(":", 1)
        assert asyncio.run(full_size_path(host, int(port), 2.0, secure=secure)) is True
        assert asyncio.run(full_size_path(host, int(port), 2.0, secure=secure)) is True
        assert swarm.peers[0].proc.poll() is None
        assert "Traceback" not in swarm.peers[0].log()
