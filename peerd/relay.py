"""Relays: a reachable peer carries calls meant for outbound-only peers, so that nobody needs to dial them.

DiLoCo and Streaming never dial an outbound-only peer (it owns no shard and never leads), and NoLoCo lets it
propose. What a relay adds is that outbound-only peers can be *proposed to* as well: two of them can pair, and a
reachable peer can pair with one, so NoLoCo matches them like anyone else.

* An outbound-only peer (`RelayClient`) holds one `Relay.Attach` stream open to a reachable peer that gossips
  `relays = true`, and gossips that peer's id in its own `relay` field while the stream is up.
* A caller (`RelayTransport`, NoLoCo's transport) sends a Match or an Exchange meant for such a peer to its relay
  as a `Relay.Forward` stream. The relay (`RelayServer`) tags the frames with a call number and carries them over the
  Attach stream; the attached peer answers with its own local handlers, and the replies come back the same way.

Payloads are the relayed call's own signed messages (a signed MatchRequest, signed tensor headers and trailers), so
a relay can drop or delay a call but not forge one. A relay limits how many peers attach, and the bytes it carries per
attached peer (`[network] relay_peer_mbit`); relayed bytes are counted in `peerd_relayed_bytes` and `peerd status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from peerd.channels import end_call
from peerd.codecs import CodecError
from peerd.envelope import AuthError, sign
from peerd.limits import LimitExceeded, TokenBucket, paced
from peerd.reachability import dialable
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")

METHODS = ("Match", "Exchange")
QUEUE_FRAMES = 64  # frames buffered per call and direction: backpressure beyond that
BURST_BYTES = 64 << 20
MAX_CALLS_PER_PEER = 16
FIRST_FRAME_S = 10.0
ATTACH_POLL_S = 0.25  # how soon an outbound-only peer attaches once a relay is known
RETRY_S = 1.0  # and how long it waits after a relay stream ended or was refused


def relay_of(daemon: Daemon, peer: pb.PeerInfo) -> pb.PeerInfo | None:
    """The live, dialable relay an outbound-only `peer` is attached to, if any."""
    if not peer.outbound_only or not peer.relay:
        return None
    relay = daemon.membership.get(peer.relay)
    if relay is None or not dialable(relay) or not daemon.membership.is_alive(relay.peer_id):
        return None
    return relay


def pair_targets(daemon: Daemon, peers: list[pb.PeerInfo]) -> list[pb.PeerInfo]:
    """NoLoCo: the peers we can propose to, directly or through their relay; not those we cannot dial although
    others hear them (peerd/pairblocks.py): a proposal to them waits out its deadline for nothing."""
    m = daemon.membership
    out = [p for p in peers if (dialable(p) and not m.cannot_dial(p.peer_id)) or relay_of(daemon, p) is not None]
    return out if out else daemon.reach.dial_targets(peers)  # says so when nobody is reachable


def serves_relay(peer: pb.PeerInfo) -> bool:
    """A peer outbound-only peers can attach to: it offers relaying and can be dialled."""
    return peer.relays and dialable(peer)


async def unrelayed(daemon: Daemon) -> list[str]:
    """NoLoCo: settled outbound-only members (ourselves included) that no peer can propose to yet, because no live
    relay of theirs is known here, while some relay exists. Empty for the other algorithms. A coroutine so that it
    reads the membership table on the daemon's loop (`Daemon.call`)."""
    if daemon.cfg.run.algorithm != "noloco":
        return []
    members = daemon.membership.settled()
    if not any(serves_relay(p) and p.peer_id != daemon.me.peer_id for p in members):
        return []
    out = []
    for p in members:
        if p.peer_id == daemon.me.peer_id:
            if daemon.me.outbound_only and not daemon.relay_client.relay:
                out.append(p.peer_id)
        elif p.outbound_only and relay_of(daemon, p) is None:
            out.append(p.peer_id)
    return out


# -- relay side ---------------------------------------------------------------------------------------------------
class _Attached:
    """One outbound-only peer's Attach stream, seen from its relay."""

    def __init__(self, peer_id: str, rate_bytes: float) -> None:
        self.peer_id = peer_id
        self.outbox: asyncio.Queue[pb.RelayFrame | None] = asyncio.Queue(QUEUE_FRAMES)
        self.calls: dict[int, asyncio.Queue[pb.RelayFrame | None]] = {}
        self.ids = itertools.count(1)
        self.budget = TokenBucket(rate_bytes, BURST_BYTES, time.monotonic())
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for q in self.calls.values():
            q.put_nowait(pb.RelayFrame(error="the peer's relay stream closed"))
        self.calls.clear()
        with contextlib.suppress(asyncio.QueueFull):
            self.outbox.put_nowait(None)


class RelayServer(rpc.RelayServicer):
    """The relay's servicer: Attach streams from outbound-only peers, Forward streams from callers."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.attached: dict[str, _Attached] = {}
        self.relayed_bytes = 0

    def _count(self, att: _Attached, nbytes: int) -> None:
        if not att.budget.take(time.monotonic(), nbytes):
            raise LimitExceeded(f"relayed traffic for {att.peer_id[:8]} is over its limit")
        self.relayed_bytes += nbytes
        if self.d.metrics is not None:
            self.d.metrics.relayed_bytes.inc(nbytes)

    async def _first(self, it: AsyncIterator[pb.RelayFrame], method: str, context: Any) -> tuple[pb.RelayFrame, str]:
        try:
            first = await asyncio.wait_for(it.__anext__(), FIRST_FRAME_S)
            sender = self.d.verifier.verify(method, first)
            self.d.limits.check_rate(f"key:{sender}")
        except (StopAsyncIteration, TimeoutError, StreamError):
            await self.d.checks.refuse(
                context, "truncated", grpc.StatusCode.INVALID_ARGUMENT, f"{method}: no first frame"
            )
        except AuthError as exc:
            await self.d.checks.refuse(context, exc.reason, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except LimitExceeded as exc:
            await self.d.checks.refuse(context, exc.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {exc}")
        if not self.d.cfg.network.relay or self.d.me.outbound_only:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{method}: this peer does not relay")
        return first, sender

    async def Attach(
        self, request_iterator: AsyncIterator[pb.RelayFrame], context: Any
    ) -> AsyncIterator[pb.RelayFrame]:
        it = request_iterator.__aiter__()
        _, sender = await self._first(it, "RelayAttach", context)
        net = self.d.cfg.network
        if sender not in self.attached and len(self.attached) >= net.relay_max_peers:
            await self.d.checks.refuse(
                context,
                "rate_limited",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"RelayAttach: {net.relay_max_peers} peers are attached here already",
            )
        old = self.attached.pop(sender, None)
        if old is not None:
            old.close()
        att = self.attached[sender] = _Attached(sender, net.relay_peer_mbit * 125_000)
        log.info("relaying for outbound-only peer %s", sender[:8])
        reader = asyncio.ensure_future(self._from_attached(att, it))
        try:
            yield pb.RelayFrame()  # the acknowledgement: the peer may now gossip us as its relay
            while (frame := await att.outbox.get()) is not None:
                yield frame
        finally:
            reader.cancel()
            att.close()
            if self.attached.get(sender) is att:
                del self.attached[sender]
            log.info("stopped relaying for %s", sender[:8])

    async def _from_attached(self, att: _Attached, it: AsyncIterator[pb.RelayFrame]) -> None:
        """Replies of the attached peer: to the caller waiting on that call number."""
        try:
            async for frame in it:
                q = att.calls.get(frame.call)
                if q is None:
                    continue  # the caller went away meanwhile
                try:
                    self._count(att, len(frame.payload))
                except LimitExceeded as exc:
                    frame = pb.RelayFrame(error=str(exc))
                await q.put(frame)
        except (StreamError, grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the attached peer went away: Attach ends below
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                att.outbox.put_nowait(None)

    async def Forward(
        self, request_iterator: AsyncIterator[pb.RelayFrame], context: Any
    ) -> AsyncIterator[pb.RelayFrame]:
        it = paced(request_iterator, self.d.cfg.network.round_timeout + 5.0).__aiter__()
        first, _ = await self._first(it, "RelayForward", context)
        att = self.attached.get(first.target)
        if att is None or att.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"Forward: {first.target[:8]} is not attached here")
        if first.method not in METHODS:
            await self.d.checks.refuse(
                context, "malformed", grpc.StatusCode.INVALID_ARGUMENT, f"Forward: cannot relay {first.method[:40]!r}"
            )
        if len(att.calls) >= MAX_CALLS_PER_PEER:
            await self.d.checks.refuse(
                context,
                "rate_limited",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Forward: {MAX_CALLS_PER_PEER} calls to {att.peer_id[:8]} are open already",
            )
        call = next(att.ids)
        replies: asyncio.Queue[pb.RelayFrame | None] = asyncio.Queue(QUEUE_FRAMES)
        att.calls[call] = replies
        pump = asyncio.ensure_future(self._to_attached(att, call, first, it))
        ended = False
        try:
            while True:
                frame = await replies.get()
                if frame is None:
                    return
                ended = frame.end or bool(frame.error)
                yield pb.RelayFrame(payload=frame.payload, end=frame.end, error=frame.error)
                if ended:
                    return
        finally:
            pump.cancel()
            if att.calls.pop(call, None) is not None and not att.closed and not ended:
                with contextlib.suppress(asyncio.QueueFull):  # tell the attached peer to drop the call
                    att.outbox.put_nowait(pb.RelayFrame(call=call, error="the caller went away"))

    async def _to_attached(self, att: _Attached, call: int, first: pb.RelayFrame, it: AsyncIterator[Any]) -> None:
        """The caller's frames, to the attached peer, tagged with the call number."""
        try:
            frame = first
            head = True
            while True:
                self._count(att, len(frame.payload))
                out = pb.RelayFrame(call=call, payload=frame.payload, end=frame.end)
                if head:
                    out.method, head = first.method, False
                await att.outbox.put(out)
                if frame.end:
                    return
                frame = await it.__anext__()
        except (StopAsyncIteration, StreamError, TimeoutError):
            await att.outbox.put(pb.RelayFrame(call=call, end=True))
        except LimitExceeded as exc:
            self.d.checks.count_rejected("rate_limited")
            q = att.calls.get(call)
            if q is not None:
                q.put_nowait(pb.RelayFrame(error=str(exc)))
            await att.outbox.put(pb.RelayFrame(call=call, error=str(exc)))


# -- attached (outbound-only) side --------------------------------------------------------------------------------
class RelayClient:
    """Keeps an outbound-only peer attached to a relay, and answers the calls that arrive over it."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.relay: str = ""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(ATTACH_POLL_S)
            if not self.d.me.outbound_only or self.d.cfg.run.algorithm != "noloco":
                continue  # only NoLoCo calls are relayed (calls that come before pairing starts are refused)
            relays = [p for p in self.d.membership.alive(include_self=False) if serves_relay(p)]
            if not relays:
                continue
            # rendezvous hashing: outbound-only peers spread over the relays, and each keeps its relay while it lives
            me = self.d.identity.peer_id
            relay = min(relays, key=lambda p: hashlib.sha256(f"{me}/{p.peer_id}".encode()).digest())
            try:
                await self._attach(relay)
            except Exception as exc:  # the relay went away or refused us: try again (maybe another) shortly
                log.info("relay stream to %s ended: %s", relay.peer_id[:8], str(exc)[:200])
                await asyncio.sleep(RETRY_S)

    def _set_relay(self, peer_id: str) -> None:
        if self.d.me.relay != peer_id:
            self.d.me.relay = peer_id
            self.d.me.heartbeat += 1  # gossip carries it
        self.relay = peer_id

    async def _attach(self, relay: pb.PeerInfo) -> None:
        d = self.d
        assert d.channels is not None
        outbox: asyncio.Queue[pb.RelayFrame] = asyncio.Queue(QUEUE_FRAMES)
        await outbox.put(sign(pb.RelayFrame(), "RelayAttach", d.identity, d.run_id))
        calls: dict[int, tuple[asyncio.Queue, asyncio.Task]] = {}

        async def frames() -> AsyncIterator[pb.RelayFrame]:
            while True:
                yield await outbox.get()

        stream = rpc.RelayStub(d.channels.channel(relay.address, relay)).Attach(frames())
        try:
            async for frame in stream:
                if not self.relay:
                    self._set_relay(relay.peer_id)
                    log.info("attached to relay %s: peers can now reach us through it", relay.peer_id[:8])
                if frame.call == 0:
                    continue  # the relay's acknowledgement
                entry = calls.get(frame.call)
                if frame.method in METHODS and entry is None and len(calls) < MAX_CALLS_PER_PEER:
                    inbox: asyncio.Queue[pb.RelayFrame] = asyncio.Queue(QUEUE_FRAMES)
                    task = asyncio.ensure_future(self._serve(frame.call, frame.method, inbox, outbox))
                    task.add_done_callback(lambda _t, c=frame.call: calls.pop(c, None))
                    calls[frame.call] = entry = (inbox, task)
                if entry is None:
                    continue
                if frame.error:
                    entry[1].cancel()
                else:
                    await entry[0].put(frame)
        finally:
            for _, task in calls.values():
                task.cancel()
            end_call(stream)
            self._set_relay("")

    async def _serve(self, call: int, method: str, inbox: asyncio.Queue, outbox: asyncio.Queue) -> None:
        """Answer one relayed call with the same handlers the Rounds service uses."""
        d = self.d
        try:
            if method == "Match":
                req = pb.MatchRequest.FromString((await inbox.get()).payload)
                sender = d.verifier.verify("Match", req)
                d.limits.check_rate(f"key:{sender}")
                resp = await d.answer_match(req, sender)
                await outbox.put(pb.RelayFrame(call=call, payload=resp.SerializeToString(), end=True))
                return
            limit = d.cfg.network.round_timeout + 5.0
            messages = paced(_tensor_messages(inbox), limit, first_timeout=limit)
            async for msg in d.serve_exchange(messages):
                await outbox.put(pb.RelayFrame(call=call, payload=msg.SerializeToString()))
            await outbox.put(pb.RelayFrame(call=call, end=True))
        except (AuthError, LimitExceeded, StreamError, CodecError, DecodeError) as exc:  # one line to the caller
            d.checks.count_rejected(getattr(exc, "reason", "malformed"))
            await outbox.put(pb.RelayFrame(call=call, error=f"{method} refused: {str(exc)[:200]}"))
        except Exception as exc:  # RoundFailed, a broken stream: the caller hears why, we go on serving
            await outbox.put(pb.RelayFrame(call=call, error=f"{method} failed: {str(exc)[:200]}"))


async def _tensor_messages(inbox: asyncio.Queue) -> AsyncIterator[pb.TensorMessage]:
    while True:
        frame = await inbox.get()
        if frame.payload:
            yield pb.TensorMessage.FromString(frame.payload)
        if frame.end:
            return


# -- caller side --------------------------------------------------------------------------------------------------
class RelayTransport:
    """NoLoCo's transport: direct gRPC to peers we can dial, through their relay to attached outbound-only ones."""

    def __init__(self, daemon: Daemon, direct: Any) -> None:
        self.d = daemon
        self.direct = direct

    def _forward(self, relay: pb.PeerInfo, frames: AsyncIterator[pb.RelayFrame], timeout: float) -> Any:
        assert self.d.channels is not None
        return rpc.RelayStub(self.d.channels.channel(relay.address, relay)).Forward(frames, timeout=timeout)

    def _head(self, peer: pb.PeerInfo, method: str, payload: bytes = b"", end: bool = False) -> pb.RelayFrame:
        frame = pb.RelayFrame(target=peer.peer_id, method=method, payload=payload, end=end)
        return sign(frame, "RelayForward", self.d.identity, self.d.run_id)

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse:
        self.d.count_sent("rendezvous", 0, request.ByteSize())  # a proposal: NoLoCo's rendezvous traffic
        relay = relay_of(self.d, peer)
        if relay is None:
            return await self.direct.match(peer, request, timeout)

        async def frames() -> AsyncIterator[pb.RelayFrame]:
            yield self._head(peer, "Match", request.SerializeToString(), end=True)

        call = self._forward(relay, frames(), timeout)
        try:
            async for frame in call:
                if frame.error:
                    raise ConnectionError(f"relay {relay.peer_id[:8]}: {frame.error}")
                if frame.payload:
                    return pb.MatchResponse.FromString(frame.payload)
        finally:
            end_call(call)
        raise ConnectionError(f"relay {relay.peer_id[:8]} ended the call without an answer")

    def exchange(self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float) -> Any:
        relay = relay_of(self.d, peer)
        if relay is None:
            return self.direct.exchange(peer, requests, timeout)

        async def frames() -> AsyncIterator[pb.RelayFrame]:
            yield self._head(peer, "Exchange")
            async for msg in requests:
                yield pb.RelayFrame(payload=msg.SerializeToString())
            yield pb.RelayFrame(end=True)

        return _RelayedCall(self._forward(relay, frames(), timeout), relay.peer_id)


class _RelayedCall:
    """An Exchange call through a relay, looking like the gRPC call pairing.py expects."""

    def __init__(self, call: Any, relay: str) -> None:
        self.call = call
        self.relay = relay

    def __aiter__(self) -> AsyncIterator[pb.TensorMessage]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[pb.TensorMessage]:
        async for frame in self.call:
            if frame.error:
                raise ConnectionError(f"relay {self.relay[:8]}: {frame.error}")
            if frame.payload:
                yield pb.TensorMessage.FromString(frame.payload)
            if frame.end:
                return

    def cancel(self) -> bool:
        return end_call(self.call)
