"""Client channels to other peers: one grpc.aio channel per address (and, with TLS, per pinned certificate), reused
across RPCs.

Channel options live here so every dial in the daemon shares them: message size limits sized for 1 MiB chunks, and
keepalives so a dead peer's half-open connection is noticed during long rounds.

With TLS (peerd/tls.py) a channel trusts only the certificate of the peer it is meant to reach, checked against that
peer's public key first. Callers may name the peer; otherwise the peer that gossip says lives at the address is
used, or the certificate read on first contact with a bootstrap address. An address with no certificate that checks
out gets a channel that never leaves this host, so callers see the usual UNAVAILABLE, never plaintext.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import grpc

from peerd import faults, tls
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc

log = logging.getLogger("peerd")

MAX_MESSAGE_BYTES = 4 << 20  # a 1 MiB chunk plus its framing fits with room to spare; anything larger is refused

# Status codes of a call that got no answer: the peer is down, cut off, or did not answer in time.
UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


def end_call(call: object) -> bool:
    """Cancel a gRPC call, and the task grpc.aio feeds a request-streaming call's request iterator from.

    grpc.aio cancels that task only when `cancel()` itself ends the call (it returns False for a call that already
    ended: a refusal, a deadline, a dead peer). A feeder waiting on our iterator (the next part of a Reduce stream,
    a relay outbox nobody fills any more) then stays pending, and once the call is garbage asyncio logs "Task was
    destroyed but it is pending!": 151 such ERROR lines in one 64-peer churn run (run AR). grpc/grpc pull 37355
    proposed the fix upstream and was closed; grpcio 1.85 still behaves so (tests/test_end_call.py). Where a later
    grpc has no such task, this is a plain `cancel()`."""
    ended = bool(call.cancel())  # type: ignore[attr-defined]
    feeder = getattr(call, "_async_request_poller", None)
    if feeder is not None and not feeder.done():
        feeder.cancel()
    return ended


def connection_failed(exc: BaseException) -> bool:
    """The peer is down (UNAVAILABLE, or a socket error), as opposed to a slow or refusing peer. Narrower than
    UNREACHABLE on purpose: a NoLoCo exchange that overruns its deadline on a slow link, or that we cancelled
    ourselves, says nothing about whether the partner is alive, so it must not mark the partner unreachable."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return isinstance(exc, ConnectionError)


def turned_away(exc: BaseException) -> bool:
    """The peer's host answered and turned the connection away (refused, or reset): the route to it works, and the
    process we meant is gone. A dial that gets no answer at all is the other kind (a broken route or a dead host;
    peerd/pairblocks.py tells them apart)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        details = (exc.details() or "").lower()
        return exc.code() == grpc.StatusCode.UNAVAILABLE and ("refused" in details or "reset" in details)
    return isinstance(exc, (ConnectionRefusedError, ConnectionResetError))


def dial_failure(exc: BaseException | None) -> str:
    """How a failed dial failed, as membership records it (peerd/pairblocks.py): "refused" when the host turned it
    away, else "no_answer" (for a round's OwnerLost, pass its cause: UNAVAILABLE covers both)."""
    return "refused" if exc is not None and turned_away(exc) else "no_answer"


RETIRE_S = 120.0  # Channels.renew: how long replaced channels stay open for the calls still on them

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),  # pings queue behind MBs of data on a slow link
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


class Channels:
    """A pool of channels keyed by (address, certificate); must be used from the daemon's event loop.

    `own` is this peer's TLS identity (None: plaintext, --insecure). `resolve` maps an address to the peer gossip
    says lives there, for callers that pass only an address.
    """

    def __init__(
        self,
        own: tls.TlsIdentity | None = None,
        resolve: Callable[[str], pb.PeerInfo | None] | None = None,
    ) -> None:
        self._channels: dict[tuple[str, bytes], grpc.aio.Channel] = {}
        self.own = own
        self.resolve = resolve
        self._first_contact: dict[str, bytes] = {}  # bootstrap address -> certificate read there (TOFU)
        self._warned: set[tuple[str, str]] = set()
        self.renewed = 0  # times renew() replaced every channel (our source address went away)
        self._retiring: set[asyncio.Task] = set()
        self._old: list[grpc.aio.Channel] = []  # replaced by renew(), not closed yet

    def pin(self, address: str, cert_der: bytes) -> None:
        """Trust `cert_der` at `address` when no gossiped peer claims the address (bootstrap, first contact)."""
        self._first_contact[address] = cert_der

    def _cert_for(self, address: str, peer: pb.PeerInfo | None) -> tuple[bytes, str]:
        """(certificate, peer id) to dial `address` with; (b"", "") when none checks out."""
        info = peer if peer is not None else (self.resolve(address) if self.resolve is not None else None)
        if info is not None and info.tls_cert:
            try:
                return info.tls_cert, tls.verify_cert(info.tls_cert, info.public_key)
            except tls.TlsError as exc:
                self._warn(address, f"certificate gossiped for peer {info.peer_id[:8]} at {address} refused: {exc}")
                return b"", ""
        cert = self._first_contact.get(address)
        if cert is not None and (info is None or not info.tls_cert):
            pid = tls.verify_cert(cert)
            if info is None or info.peer_id == pid:
                return cert, pid
        self._warn(address, f"no valid TLS certificate known for {address}; not dialing it")
        return b"", ""

    def _warn(self, address: str, msg: str) -> None:
        if (address, msg) not in self._warned and len(self._warned) < 1024:
            self._warned.add((address, msg))
            log.warning(msg)

    def channel(self, address: str, peer: pb.PeerInfo | None = None) -> grpc.aio.Channel:
        cert, pid = self._cert_for(address, peer) if self.own is not None else (b"", "")
        key = (address, cert)
        ch = self._channels.get(key)
        if ch is None:
            # After a renewal a channel must not share gRPC's global subchannel (its connection) with the old one.
            base = CHANNEL_OPTIONS + [("grpc.use_local_subchannel_pool", 1)] * (self.renewed > 0)
            if self.own is None:
                ch = grpc.aio.insecure_channel(address, options=base, interceptors=faults.uplink_client_interceptors())
            elif cert:
                opts = base + tls.channel_options(pid)
                ch = grpc.aio.secure_channel(
                    address,
                    tls.channel_credentials(cert),
                    options=opts,
                    interceptors=faults.uplink_client_interceptors(),
                )
            else:  # refuse locally: a socket nobody listens on. Dialing the address with a trust root that cannot
                # match also fails, but makes gRPC's C core log "Handshake failed ... self signed certificate" on
                # every try. Still TLS with an unmatchable name, in case something does listen there.
                opts = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", "unverified.invalid")]
                ch = grpc.aio.secure_channel(
                    f"unix-abstract:peerd-unverified-{os.getpid()}",
                    tls.channel_credentials(self.own.cert_der),
                    options=opts,
                )
            self._channels[key] = ch
        return ch

    def connected(self, address: str, peer: pb.PeerInfo | None = None) -> bool:
        """Is our connection to `address` up? A call that timed out on a connected channel met a slow or busy link,
        not a dead peer."""
        return self.channel(address, peer).get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    async def ready(self, address: str, peer: pb.PeerInfo | None, timeout: float) -> bool:
        """Wait up to `timeout` for a connection to `address`; False if none came. A dial whose SYNs a broken route
        drops fails only at gRPC's 20 s connect deadline, and a call on that channel waits as long: a rendezvous with
        a leader we cannot reach (peerd/pairblocks.py) held a step for 17 s."""
        ch = self.channel(address, peer)
        if ch.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return True
        try:
            await asyncio.wait_for(ch.channel_ready(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def membership(self, address: str, peer: pb.PeerInfo | None = None) -> rpc.MembershipStub:
        return rpc.MembershipStub(self.channel(address, peer))

    def rounds(self, address: str, peer: pb.PeerInfo | None = None) -> rpc.RoundsStub:
        return rpc.RoundsStub(self.channel(address, peer))

    def state(self, address: str, peer: pb.PeerInfo | None = None) -> rpc.StateStub:
        return rpc.StateStub(self.channel(address, peer))

    def renew(self) -> int:
        """Our source address went away (peerd/netchange.py): every connection we hold is dead, though none has
        failed yet. New calls get new channels at once; the old ones are closed RETIRE_S later, when the calls still
        hanging on them have met their deadlines (closing a channel cancels its calls, which grpc.aio raises in the
        caller as asyncio.CancelledError). Returns how many channels were replaced."""
        old = list(self._channels.values())
        self._channels.clear()
        self.renewed += 1
        if old:
            self._old.extend(old)
            task = asyncio.ensure_future(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return len(old)

    async def _retire(self, channels: list[grpc.aio.Channel]) -> None:
        await asyncio.sleep(RETIRE_S)
        for ch in channels:
            self._old.remove(ch)
            await ch.close()

    async def drop(self, address: str) -> None:
        for key in [k for k in self._channels if k[0] == address]:
            await self._channels.pop(key).close()

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        for ch in [*self._channels.values(), *self._old]:
            await ch.close()
        self._channels.clear()
        self._old.clear()
