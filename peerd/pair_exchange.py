"""NoLoCo pair exchange: the tensors a group's members swap once matchmaking (peerd/matchmaking.py) formed it.

The exchange (``Rounds.Exchange``, one bidirectional stream per proposer/accepter pair) carries each member's
tensors by kind ("phi" first, then "pair"; without send-ahead the single combination "mix"), each encoded with
the run's codec and framed by ``peerd.streams`` (signed header, chunks, signed trailer). The proposer sends its own
tensors, the accepter sends its own back on the same stream, and in groups larger than two the proposer relays
every other member's encoded bytes unchanged, so all members decode the same bytes for each contribution. The two
directions are independent: a peer may send its "phi" long before its "pair" (send-ahead).

A `Session` is one group, from the proposal until every contribution settled (arrived complete, or lost); the
`Exchange` keeps this peer's sessions, runs their streams, stores what arrives and retires groups once done. This
module knows nothing of models: it moves named flat fp32 tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from peerd import faults
from peerd.allreduce import RoundFailed, RoundStats
from peerd.channels import connection_failed, dial_failure, end_call
from peerd.codecs import Codec, CodecError
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.shutdown import PAIR_DRAIN_S
from peerd.streams import ReceivedTensor, StreamError, prepend, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, codec_to_wire, kind_name, kind_to_wire

log = logging.getLogger("peerd")

KINDS = ("phi", "pair")  # the order each member sends its tensors in: slow weights first, so they can go ahead
MIXED_KINDS = ("mix",)  # without send-ahead: the one combination of both the NoLoCo update uses (peerd/noloco.py)


def kinds_for(send_ahead: bool) -> tuple[str, ...]:
    """The tensors each member sends: two with send-ahead (phi goes early), else one combined tensor."""
    return KINDS if send_ahead else MIXED_KINDS


RETIRE_S = 5.0  # how long a finished group stays known, so the partner can finish reading our last bytes


class PairingError(ValueError):
    """Bad arguments to the pairing layer (wrong tensor kinds, sizes or settings)."""


@dataclass(frozen=True)
class PairSettings:
    """NoLoCo pairing settings: matchmaking reads the group size, staleness bound, match timeout and send-ahead; the
    exchange reads the exchange timeout and chunk size. They live here, below both."""

    group_size: int = 2
    max_staleness: int = 1
    match_timeout: float = 10.0
    exchange_timeout: float = 120.0
    chunk_bytes: int = 1 << 20
    send_ahead: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise PairingError("group_size must be >= 2")
        if self.max_staleness < 0:
            raise PairingError("max_staleness must be >= 0")
        if not (self.match_timeout > 0 and self.exchange_timeout > 0):
            raise PairingError("match_timeout and exchange_timeout must be positive")
        if not 0 < self.chunk_bytes <= 1 << 20:
            raise PairingError("chunk_bytes must be in (0, 1 MiB]")

    @property
    def horizon(self) -> float:
        """How soon (seconds) a peer must expect to reach its boundary to accept a proposer waiting at its own."""
        return self.match_timeout / 2


class ExchangeCall(Protocol):
    def __aiter__(self) -> AsyncIterator[pb.TensorMessage]: ...

    def cancel(self) -> bool: ...


class ExchangeTransport(Protocol):
    """How the exchange reaches a group's other members: gRPC in the daemon, direct calls in unit tests."""

    def exchange(
        self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float
    ) -> ExchangeCall: ...


class Session:
    """One group this peer is in, for one outer step, from the proposal until every contribution settled."""

    def __init__(
        self,
        round_id: bytes,
        step: int,
        role: str,
        members: list[pb.PeerInfo],
        me: str,
        kinds: tuple[str, ...] = KINDS,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.kinds = kinds
        self.round_id = round_id
        self.step = step
        self.role = role  # "proposer" (opens the streams, relays) or "accepter"
        self.members = members
        self.me = me
        self.deadline = math.inf
        self.own: dict[str, asyncio.Future[bytes]] = {k: loop.create_future() for k in kinds}
        self.received: dict[str, dict[str, torch.Tensor]] = {}
        self.raw: dict[str, dict[str, bytes]] = {}  # encoded bytes as received, for relaying (proposer only)
        self.settled: dict[str, asyncio.Future[bool]] = {}  # per other member: True = complete, False = lost
        self.confirmed = role == "proposer"
        self.closed: asyncio.Future[None] = loop.create_future()
        self.changed = asyncio.Event()
        self.stats = RoundStats()
        self.tasks: list[asyncio.Future] = []
        self.delivering: list[asyncio.Future] = []  # done once a stream has delivered our tensors (or failed)
        self.calls: list[ExchangeCall] = []
        self.errors: dict[str, str] = {}
        # The round id each stream carries: an accepter knows only the id it gave the proposer, so in groups of
        # three or more the proposer labels each accepter's stream with that accepter's id.
        self.stream_round: dict[str, bytes] = {}
        self.peer_steps: dict[str, int] = {}  # each partner's own outer step for this exchange
        for m in members:
            self.expect(m.peer_id)

    @property
    def member_ids(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def proposer(self) -> str:
        return self.members[0].peer_id

    def round_for(self, peer_id: str) -> bytes:
        return self.stream_round.get(peer_id, self.round_id)

    def expect(self, peer_id: str) -> None:
        if peer_id != self.me and peer_id not in self.settled:
            self.settled[peer_id] = asyncio.get_running_loop().create_future()
            self.changed.set()

    def settle(self, peer_id: str, ok: bool, why: str = "") -> None:
        fut = self.settled.get(peer_id)
        if fut is not None and not fut.done():
            fut.set_result(ok)
            if not ok:
                self.errors[peer_id] = why
                log.info("group %s: contribution of %s lost (%s)", self.round_id.hex()[:8], peer_id[:8], why)
            self.changed.set()

    def all_settled(self) -> bool:
        return all(f.done() for f in self.settled.values())

    def got_any(self) -> bool:
        return any(self.received.values())

    def complete(self, peer_id: str) -> bool:
        fut = self.settled.get(peer_id)
        return fut is not None and fut.done() and fut.result()

    def close(self, why: str) -> None:
        """Stop waiting: members that have not delivered by now are lost."""
        for pid in list(self.settled):
            self.settle(pid, False, why)
        if not self.closed.done():
            self.closed.set_result(None)
        for task in self.tasks:
            if not task.done():
                task.cancel()
        for call in self.calls:
            end_call(call)


class Exchange:
    """This peer's groups and their Exchange streams. Every coroutine runs on the daemon's event loop."""

    def __init__(
        self,
        *,
        identity: Identity,
        run_id: bytes,
        verifier: Verifier,
        codec: Codec,
        executor: Executor | None,
        numel: int,
        settings: PairSettings,
        transport: ExchangeTransport,
        on_rejected: Callable[[str], None],
        on_unreachable: Callable[[str, str], None],
        still_training: Callable[[], bool],
    ) -> None:
        self.identity = identity
        self.my_id = identity.peer_id
        self.run_id = run_id
        self.verifier = verifier
        self.codec = codec
        self.executor = executor
        self.numel = numel
        self.settings = settings
        self.transport = transport
        self.on_rejected = on_rejected
        self.on_unreachable = on_unreachable  # (peer, how the dial failed) we could not connect: leave it out a while
        self.still_training = still_training  # not yet at our boundary: we may still accept another proposal
        self.max_wire = codec.max_encoded_size(numel)
        self.session: Session | None = None  # the group we are in now, if any
        self.sessions: dict[bytes, Session] = {}  # by round id, for streams that arrive

    # -- sessions ------------------------------------------------------------------------------------------------
    def open(self, round_id: bytes, step: int, role: str, members: list[pb.PeerInfo]) -> Session:
        sess = Session(round_id, step, role, members, self.my_id, kinds_for(self.settings.send_ahead))
        self.session = sess
        self.sessions[round_id] = sess
        return sess

    def drop(self, sess: Session, why: str) -> None:
        log.info("leaving group %s: %s", sess.round_id.hex()[:8], why)
        sess.close(why)
        self.sessions.pop(sess.round_id, None)
        if self.session is sess:
            self.session = None

    def set_own(self, sess: Session, encoded: Mapping[str, bytes]) -> None:
        """Hand our encoded tensors to the group's streams. They are counted as sent here, once per stream that
        carries them: a stream may still be uploading them after we have the partner's tensors and moved on."""
        streams = len(sess.members) - 1 if sess.role == "proposer" else 1
        for kind, payload in encoded.items():
            fut = sess.own[kind]
            if not fut.done():
                fut.set_result(payload)
                sess.stats.wire_bytes += len(payload) * streams
                sess.stats.raw_bytes += 4 * self.numel * streams

    def watch(self, sess: Session) -> None:
        """Close the group when its deadline (which moves once we reach our boundary) passes."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if sess.closed.done():
                return
            left = sess.deadline - time.monotonic()
            if left > 0:
                loop.call_later(min(left, 5.0) + 0.01, check)
                return
            sess.close("exchange deadline passed")
            self.sessions.pop(sess.round_id, None)
            if self.session is sess:
                self.session = None

        loop.call_later(1.0, check)

    def retire(self, sess: Session) -> None:
        """We have what we need. Streams may still be delivering to others (our last bytes on a slow link, relays
        in groups of three or more): let them run until the group's deadline, then forget the group."""
        loop = asyncio.get_running_loop()
        sess.received = {}  # the outcome holds the decoded tensors now; relays use the raw bytes

        def forget() -> None:
            sess.close("retired")
            self.sessions.pop(sess.round_id, None)

        delay = min(sess.deadline - time.monotonic(), self.settings.exchange_timeout)
        loop.call_later(max(delay, RETIRE_S), forget)

    async def wait_settled(self, sess: Session) -> None:
        """Until every other member's contribution settled, or the group's deadline passed (then close it)."""
        while not sess.all_settled():
            remaining = sess.deadline - time.monotonic()
            if remaining <= 0:
                sess.close(f"nothing within the exchange timeout of {self.settings.exchange_timeout:.0f}s")
                return
            sess.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sess.changed.wait(), remaining)

    async def _own(self, sess: Session, kind: str) -> bytes:
        """Our encoded tensor of `kind` for this group, once the trainer provides it."""
        fut = sess.own[kind]
        if not fut.done():
            await asyncio.wait({fut, sess.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            raise RoundFailed("the group closed before our contribution was ready", reason="aborted")
        return fut.result()

    def _messages(
        self, sess: Session, to: str, kind: str, payload: bytes, origin: int, relay: bool = False
    ) -> Iterator[pb.TensorMessage]:
        header = pb.TensorHeader(
            round_id=sess.round_for(to),
            shard=origin,
            numel=self.numel,
            codec=codec_to_wire(self.codec.name),
            included=sess.member_ids,
            kind=kind_to_wire(kind),
        )
        if relay:  # our own tensors were counted when handed over (_set_own)
            sess.stats.wire_bytes += len(payload)
            sess.stats.raw_bytes += 4 * self.numel
        for msg in tensor_messages(header, payload, self.identity, self.run_id, self.settings.chunk_bytes):
            yield msg
            if msg.WhichOneof("part") == "chunk":
                faults.EXCHANGE_EXIT.on_chunk()

    async def _store(self, sess: Session, rx: ReceivedTensor, from_peer: str) -> None:
        """Check and decode one received tensor; settle its origin once all its kinds are in."""
        h = rx.header
        ids = sess.member_ids
        if rx.sender != from_peer or h.round_id != sess.round_for(from_peer):
            raise StreamError("malformed", "tensor names another group or sender", rx.sender)
        if not 0 <= h.shard < len(ids):
            raise StreamError("malformed", f"origin index {h.shard} is outside the group", rx.sender)
        origin = ids[h.shard]
        if origin == self.my_id or (origin != from_peer and from_peer != sess.proposer):
            raise StreamError("malformed", "a peer may only send its own tensors (the proposer relays)", rx.sender)
        kind = kind_name(h.kind)
        if kind not in sess.kinds:
            raise StreamError("malformed", f"unknown tensor kind {h.kind!r}", rx.sender)
        got = sess.received.setdefault(origin, {})
        if kind in got:
            raise StreamError("duplicate", f"{kind} of {origin[:8]} arrived twice", rx.sender)
        payload = bytes(rx.payload)
        loop = asyncio.get_running_loop()
        got[kind] = await loop.run_in_executor(self.executor, self.codec.decode, payload, self.numel)
        sess.stats.received_wire_bytes += len(payload)
        if sess.role == "proposer" and len(ids) > 2:
            sess.raw.setdefault(origin, {})[kind] = payload
        if len(got) == len(sess.kinds):
            sess.settle(origin, True)

    def _limit(
        self, sess_for: Callable[[str, pb.TensorHeader], Session]
    ) -> Callable[[str, pb.TensorHeader], Awaitable[int]]:
        """Size limit for an incoming tensor, checked against the group before anything is allocated."""

        async def limit(sender: str, header: pb.TensorHeader) -> int:
            if header.numel != self.numel:
                raise StreamError("wrong_shape", f"tensor of {header.numel} values; this run's has {self.numel}")
            if codec_name(header.codec) != self.codec.name:
                theirs = codec_name(header.codec) or header.codec
                raise StreamError("wrong_codec", f"codec {theirs!r}; this run uses {self.codec.name!r}")
            sess = sess_for(sender, header)
            if sender not in sess.member_ids:
                raise StreamError("not_member", f"{sender[:8]} is not in this group")
            return self.max_wire

        return limit

    # -- proposer side of a stream -------------------------------------------------------------------------------
    def start_streams(self, sess: Session) -> None:
        """Proposer: open one Exchange stream per accepter (once; accepters wait for them)."""
        if not sess.tasks:
            for member in sess.members[1:]:
                task = asyncio.ensure_future(self._client(sess, member))
                sess.tasks.append(task)
                sess.delivering.append(task)

    async def _client(self, sess: Session, member: pb.PeerInfo) -> None:
        pid = member.peer_id
        call: ExchangeCall | None = None
        try:
            timeout = max(sess.deadline - time.monotonic(), 1.0)
            call = self.transport.exchange(member, self._client_requests(sess, member), timeout)
            sess.calls.append(call)
            it = call.__aiter__()
            limit = self._limit(lambda sender, header: sess)
            while not sess.settled[pid].done():
                rx = await _next_tensor(it, self.verifier, limit)
                if rx is None:
                    raise StreamError("truncated", "stream ended before the partner's tensors arrived")
                await self._store(sess, rx, pid)
            # The accepter ends the stream once it has read all we send: wait for that, then let the call go.
            with contextlib.suppress(grpc.aio.AioRpcError):
                if await _next_tensor(it, self.verifier, limit) is not None:
                    raise StreamError("malformed", "unexpected tensor after the partner's contribution", pid)
        except (StreamError, CodecError) as exc:
            sess.settle(pid, False, _describe(exc))
            self.on_rejected(getattr(exc, "reason", "malformed"))
        except (grpc.aio.AioRpcError, RoundFailed, OSError) as exc:
            sess.settle(pid, False, _describe(exc))
            if connection_failed(exc):
                self.on_unreachable(pid, dial_failure(exc))
        except Exception as exc:
            log.warning("exchange with %s failed unexpectedly: %r", pid[:8], exc)
            sess.settle(pid, False, _describe(exc))
        finally:
            sess.settle(pid, False, "stream ended")
            if call is not None:
                end_call(call)

    async def _client_requests(self, sess: Session, member: pb.PeerInfo) -> AsyncIterator[pb.TensorMessage]:
        to = member.peer_id
        for kind in sess.kinds:
            payload = await self._own(sess, kind)
            for msg in self._messages(sess, to, kind, payload, 0):
                yield msg
        # groups of three or more: relay every other member's bytes as received, once they are complete
        for index, other in enumerate(sess.member_ids):
            if index == 0 or other == to:
                continue
            fut = sess.settled[other]
            await asyncio.wait({fut, sess.closed}, return_when=asyncio.FIRST_COMPLETED)
            if sess.complete(other):
                for kind in sess.kinds:
                    for msg in self._messages(sess, to, kind, sess.raw[other][kind], index, relay=True):
                        yield msg

    # -- accepter side of a stream -------------------------------------------------------------------------------
    async def serve(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
        """Server side of `Rounds.Exchange`: read the proposer's tensors, send ours back on the same stream."""
        it = messages.__aiter__()
        found: list[Session] = []

        def sess_for(sender: str, header: pb.TensorHeader) -> Session:
            sess = self.sessions.get(header.round_id)
            if sess is None or sess.role != "accepter" or sess.closed.done():
                raise StreamError("unknown_round", "Exchange: no such group here")
            if sender != sess.proposer:
                raise StreamError("not_member", "only the proposer opens a group's exchange")
            if sess.confirmed:
                raise StreamError("duplicate", "this group's exchange is already open")
            sess.confirmed = True  # the exchange has begun: from now on a failure means the partner is lost
            found.append(sess)
            return sess

        try:
            first = await _next_tensor(it, self.verifier, self._limit(sess_for))
            if first is None:
                raise StreamError("truncated", "Exchange: the proposer's stream ended before its first tensor")
        except BaseException as exc:
            if found:
                self._lost_proposer(found[0], _describe(exc))
            raise
        sess = found[0]
        ids = list(first.header.included)
        if (
            len(ids) > self.settings.group_size
            or len(set(ids)) != len(ids)
            or ids[:1] != [sess.proposer]
            or self.my_id not in ids
        ):
            self._lost_proposer(sess, "invalid member list")
            raise StreamError("malformed", "the group's member list is not valid", first.sender)
        known = {m.peer_id: m for m in sess.members}
        sess.members = [known.get(pid) or pb.PeerInfo(peer_id=pid) for pid in ids]
        for pid in ids:
            sess.expect(pid)
        my_index = ids.index(self.my_id)
        reader = asyncio.ensure_future(self._read_from_proposer(sess, it, first))
        sess.tasks.append(reader)
        delivered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sess.delivering.append(delivered)
        try:
            for kind in sess.kinds:
                try:
                    payload = await self._own(sess, kind)
                except RoundFailed:
                    if reader.done() and not reader.cancelled() and reader.result() is not None:
                        raise reader.result() from None  # the proposer broke the protocol: refuse it
                    raise
                for msg in self._messages(sess, sess.proposer, kind, payload, my_index):
                    yield msg
            await asyncio.wait({reader})
            error = None if reader.cancelled() else reader.result()
            if error is not None:
                raise error
        finally:
            if not reader.done():
                reader.cancel()
            if not delivered.done():
                delivered.set_result(None)
            self._lost_proposer(sess, "stream ended")

    def _lost_proposer(self, sess: Session, why: str) -> None:
        """The proposer's stream is gone: whatever has not arrived will not. If nothing did and we are still
        training, leave the group so that we can accept another proposal for this step."""
        for pid in sess.member_ids:
            sess.settle(pid, False, why)
        if not sess.got_any() and self.session is sess and self.still_training():
            self.drop(sess, f"the proposer went away ({why})")

    async def _read_from_proposer(
        self, sess: Session, it: AsyncIterator[pb.TensorMessage], first: ReceivedTensor
    ) -> Exception | None:
        """Read until the proposer closes its side; returns (does not raise) a protocol error to refuse with."""
        limit = self._limit(lambda sender, header: sess)
        try:
            rx: ReceivedTensor | None = first
            while rx is not None:
                if list(rx.header.included) != sess.member_ids:
                    raise StreamError("malformed", "the member list changed mid-stream", rx.sender)
                await self._store(sess, rx, sess.proposer)
                rx = await _next_tensor(it, self.verifier, limit)
            return None
        except (StreamError, CodecError) as exc:
            sess.close(_describe(exc))
            return exc  # serve() raises it, and the service refuses the stream (and counts it)
        except (grpc.aio.AioRpcError, OSError, RoundFailed) as exc:
            for pid in sess.member_ids:
                sess.settle(pid, False, _describe(exc))
            return None
        finally:
            for pid in sess.member_ids:
                sess.settle(pid, False, "the proposer closed the stream early")

    async def close(self) -> None:
        """Let streams that carry our finished contributions deliver them (up to PAIR_DRAIN_S, so a partner in its
        last exchange with us does not lose our tensors), then abandon every group."""
        pending = [
            f
            for sess in self.sessions.values()
            if all(own.done() for own in sess.own.values())
            for f in sess.delivering
            if not f.done()
        ]
        if pending:
            await asyncio.wait(pending, timeout=PAIR_DRAIN_S)
        for sess in list(self.sessions.values()):
            sess.close("shutting down")
        self.sessions.clear()
        self.session = None


async def _next_tensor(
    it: AsyncIterator[pb.TensorMessage], verifier: Verifier, limit: Callable[[str, pb.TensorHeader], Awaitable[int]]
) -> ReceivedTensor | None:
    """The next framed tensor on a stream, or None if the stream ended cleanly between tensors."""
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return None
    return await read_tensor(prepend(first, it), verifier, limit)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
