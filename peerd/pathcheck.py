"""Fresh connections to a peer for checks, and the check that full-size packets reach it (a path MTU blackhole).

A tunnel or PPPoE link whose ICMP "fragmentation needed" is filtered passes TCP handshakes, heartbeats and small
calls but drops every full-size segment, and Linux leaves `tcp_mtu_probing` off by default. Through such a path a
peer looks live and dialable, yet every shard, state download and large rendezvous answer stalls on an open
connection until its deadline; a fresh TCP handshake (Reachability's route check) passes, so the pair was never
blocked (peerd/pairblocks.py) and 3-16 rounds of 40 had all four peers.

The check opens two connections at once and sends on each bytes that are not HTTP/2, which the peer's gRPC transport
reads and refuses by closing the connection: a few on one, PAD_BYTES on the other. The small one closed and the big
one not is a blackhole. Neither closed is no verdict: a host too busy to answer (64 peers on 2 cores) must not be
blocked, which is why the route check trusts a handshake. With TLS (the default) the bytes go after a TLS handshake
of our own, whose packets are small: gRPC's own ClientHello (post-quantum key shares) spans full-size packets, so
across a blackhole gRPC never connects at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time

import grpc

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS

# Several full-size segments, yet within TCP's initial window (10 segments), so a fresh connection sends them at once
# and the big check costs the small one's round trip on a healthy path.
PAD_BYTES = 8192
SLACK_S = 2.0  # the big check may end this much later than the small one (plus 3x its time) on a healthy path
NOT_HTTP2 = b"peerd path check\r\n"  # not the HTTP/2 preface: the server closes the connection once it reads it


def fresh_channel(address: str, cert: bytes = b"", peer_id: str = "") -> grpc.aio.Channel:
    """A channel on a connection of its own (a local subchannel pool): gRPC shares subchannels between channels with
    equal arguments, so a check would otherwise ride the very connection it doubts, and a peer restarted on its old
    address be dialled through the dead one's subchannel, still in reconnect backoff. With `cert` (TLS), pinned to
    the peer `peer_id`'s certificate."""
    fresh = [("grpc.use_local_subchannel_pool", 1)]
    if cert:
        opts = CHANNEL_OPTIONS + tls.channel_options(peer_id) + fresh
        return grpc.aio.secure_channel(address, tls.channel_credentials(cert), options=opts)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + fresh)


async def _read_back(host: str, port: int, size: int, secure: bool, timeout: float) -> float | None:
    """Seconds until the peer closed a fresh connection on which we sent `size` bytes that are not HTTP/2 (gRPC's
    transport, not the peer's Python, reads and refuses them, so a starved process answers as fast as an idle one);
    None: not within `timeout`. With TLS the bytes go after a handshake, whose packets are all small; the peer's
    certificate is not checked, as nothing we send is secret."""
    ctx = None
    if secure:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
    t0 = time.monotonic()
    opened: list[asyncio.StreamWriter] = []

    async def send_and_wait_for_close() -> None:
        reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
        opened.append(writer)
        writer.write(NOT_HTTP2 + bytes(max(0, size - len(NOT_HTTP2))))
        while await reader.read(65536):
            pass

    try:
        await asyncio.wait_for(send_and_wait_for_close(), timeout)
    except (OSError, asyncio.TimeoutError, ssl.SSLError):
        return None
    finally:
        for writer in opened:
            writer.close()
    return time.monotonic() - t0


async def full_size_path(host: str, port: int, timeout: float, secure: bool = False) -> bool | None:
    """Do full-size packets reach the peer at `host`:`port`? True: both checks ended. False: the small one ended within
    `timeout` and the big one (PAD_BYTES) not within SLACK_S + 3x that (a blackhole). None: the small one did not end
    (the route is gone, or the host too busy), which says nothing about packet sizes."""
    big = asyncio.ensure_future(_read_back(host, port, PAD_BYTES, secure, 4 * timeout + SLACK_S))
    try:
        small = await _read_back(host, port, 0, secure, timeout)
        if small is None:
            return None
        done, _ = await asyncio.wait({big}, timeout=SLACK_S + 3 * small)
        return bool(done) and big.result() is not None
    finally:
        if not big.done():
            big.cancel()
            with contextlib.suppress(BaseException):
                await big
