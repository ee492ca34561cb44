"""Client channels to other peers: one grpc.aio channel per address, reused across RPCs.

Channel options live here so every dial in the daemon shares them: message size limits sized for 1 MiB chunks, and
keepalives so a dead peer's half-open connection is noticed during long rounds.
"""

from __future__ import annotations

import grpc

from peerd.v1 import peerd_pb2_grpc as rpc

MAX_MESSAGE_BYTES = 4 << 20  # a 1 MiB chunk plus its framing fits with room to spare; anything larger is refused

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class Channels:
    """A pool of channels keyed by peer address; must be used from the daemon's event loop."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def membership(self, address: str) -> rpc.MembershipStub:
        return rpc.MembershipStub(self.channel(address))

    def rounds(self, address: str) -> rpc.RoundsStub:
        return rpc.RoundsStub(self.channel(address))

    def state(self, address: str) -> rpc.StateStub:
        return rpc.StateStub(self.channel(address))

    async def drop(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
