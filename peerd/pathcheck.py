"""Fresh connections to a peer for checks, and the check that full-size packets reach it (a path MTU blackhole).

A tunnel or PPPoE link whose ICMP "fragmentation needed" is filtered passes TCP handshakes, heartbeats and small
calls but drops every full-size segment, and Linux leaves `tcp_mtu_probing` off by default. Through such a path a
peer looks live and dialable, yet every shard, state download and large rendezvous answer stalls on an open
connection until its deadline; a fresh TCP handshake (Reachability's route check) passes, so the pair was never
blocked (peerd/pairblocks.py) and 3-16 rounds of 40 had all four peers.

The check sends two echo calls at once, each on a connection of its own: one small, one padded with PAD_BYTES. Small
answered and padded not is a blackhole. Neither answered is no verdict: a process too starved to answer gRPC (64
peers on 2 cores) must not be blocked, which is why the route check trusts a handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import grpc

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc

# Several full-size segments, yet within TCP's initial window (10 segments), so a fresh connection sends them at once
# and the padded echo costs the small one's round trip on a healthy path.
PAD_BYTES = 8192
MAX_PAD_BYTES = 16384  # ProbeEcho refuses more: the call is unauthenticated
SLACK_S = 2.0  # the padded echo may answer this much later than the small one (plus 3x its time) on a healthy path


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


async def _echo(address: str, run_id: bytes, cert: bytes, peer_id: str, pad: int, timeout: float) -> float | None:
    """Seconds until the peer's process answered an echo padded with `pad` bytes (any status it sends counts: an
    unknown nonce is refused); None: no answer in `timeout`."""
    channel = fresh_channel(address, cert, peer_id)
    t0 = time.monotonic()
    try:
        req = pb.ProbeEchoRequest(run_id=run_id, nonce=os.urandom(16), padding=os.urandom(pad))
        await rpc.MembershipStub(channel).ProbeEcho(req, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return None
    finally:
        await channel.close()
    return time.monotonic() - t0


async def full_size_path(
    address: str, run_id: bytes, timeout: float, cert: bytes = b"", peer_id: str = ""
) -> bool | None:
    """Do full-size packets reach the peer at `address`? True: both echoes answered. False: the small one answered
    within `timeout` and the padded one not within SLACK_S + 3x that (a blackhole). None: the small one got no answer
    (the process is starved, or the route is gone), which says nothing about packet sizes."""
    big = asyncio.ensure_future(_echo(address, run_id, cert, peer_id, PAD_BYTES, 4 * timeout + SLACK_S))
    try:
        small = await _echo(address, run_id, cert, peer_id, 0, timeout)
        if small is None:
            return None
        done, _ = await asyncio.wait({big}, timeout=SLACK_S + 3 * small)
        return bool(done) and big.result() is not None
    finally:
        if not big.done():
            big.cancel()
            with contextlib.suppress(BaseException):
                await big
