"""Bandwidth-optimal averaging of one flat fp32 vector across a round's group: reduce-scatter, then all-gather.

The vector is cut into one contiguous shard per reachable member (the owners, in member order; outbound-only members,
which nobody can dial, own none). Owner i owns shard i: every other member streams its encoded shard i to it over a
stream the sender opens, and the owner decodes all contributions, sums them in fp32 in member order, divides by the
group size, encodes the average once, and streams those same bytes back to every member on the same gRPC stream.
Each peer therefore sends and receives (n-1)/n of the vector twice (with all members reachable), nothing is funnelled
through one peer, and because every member (the owner included) decodes the *same bytes* of each averaged shard,
all members end bit-identical.

Shards travel in parts of at most the group's part size (256 KiB; less on slow links: peerd/layout.py) of encoded data,
cut on the codec's blocks so each part is a frame of its own that decodes to what the whole shard's frame would. The
owner averages part k as soon as every member's part k arrived and sends it back while later parts still arrive, so the
gather direction is busy from the first part on instead of starting cold after the whole shard (on a slow link that idle
half-round cost ~20 % of the goodput). Screening needs whole contributions: the owner sums each one's squares part by
part and judges them before its shard's last part leaves, so a refused contribution still fails the round before any
member can complete it.

A round is all-or-nothing: if any contribution is missing when the deadline passes, or any stream fails, the round
fails on every member (owners abort the streams they serve, so a failure spreads in one round trip) and the caller
retries the step with a new group that leaves the failed peer out. A round never averages a subset silently.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
import torch

from peerd import faults
from peerd.codecs import Codec, CodecError
from peerd.codecs.base import check_input, finite_or_raise
from peerd.codecs.frame import SealedFrame
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.layout import PART_BYTES, included_mask, part_bounds, part_elems, shard_bounds
from peerd.robust import ContributionGuard, ContributionRejected, mean_of
from peerd.streams import StreamError, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, codec_to_wire, kind_to_wire

BLAME_GRACE_S = 0.5


class RoundFailed(RuntimeError):
    """The round could not complete. `suspects` are peers that seem to be at fault (unreachable, silent). With
    reason "aborted" they are another member's word, not something we saw: worth skipping in the retry, not
    worth marking unreachable."""

    def __init__(self, message: str, suspects: set[str] | None = None, reason: str = "aborted") -> None:
        super().__init__(message)
        self.suspects = suspects or set()
        self.reason = reason


SUSPECTS_KEY = "peerd-suspects"
"""Trailing metadata of an aborted Reduce stream: whom the owner blames. Without it, a member whose round an owner
aborted retried with the offender again, while the rest of the group retried without it: two groups, one step."""


def suspects_metadata(exc: RoundFailed) -> tuple[tuple[str, str], ...]:
    return ((SUSPECTS_KEY, ",".join(sorted(exc.suspects))),) if exc.suspects else ()


def relayed_suspects(metadata: object, allowed: set[str]) -> set[str]:
    """The suspects an aborting owner named, limited to `allowed` (the round's other members)."""
    named: set[str] = set()
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == SUSPECTS_KEY and isinstance(value, str):
            named |= set(value[:4096].split(",")) & allowed
    return named


@dataclass
class RoundStats:
    raw_bytes: int = 0  # fp32 bytes this peer's sends would have taken uncompressed
    wire_bytes: int = 0  # bytes it actually sent
    received_wire_bytes: int = 0
    seconds: float = 0.0
    messages: int = 0  # stream messages sent (bench.scale: per-peer message rate)


@dataclass
class RoundResult:
    average: torch.Tensor  # CPU fp32, same numel as the input
    group: pb.Group
    included: list[str]
    stats: RoundStats = field(default_factory=RoundStats)
    sent_decoded: torch.Tensor | None = None  # what our contribution decodes to (for error feedback), if asked

    @property
    def partial(self) -> bool:
        return len(self.included) < len(self.group.expected)


def sum_of_squares(t: torch.Tensor) -> float:
    """In float64, so that summing parts' values in part order gives every member the same whole norm."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 if t.numel() else 0.0


def _rms(parts_sumsq: list[float], numel: int) -> float:
    return math.sqrt(sum(parts_sumsq) / numel) if numel else 0.0


def part_messages(
    header: pb.TensorHeader, payload: bytes | SealedFrame, identity: Identity, run_id: bytes, chunk: int, chain: bytes
) -> tuple[list[pb.TensorMessage], bytes]:
    """One part's signed messages and its digest (the next part's chain)."""
    msgs = list(tensor_messages(header, payload, identity, run_id, chunk, chain))
    return msgs, msgs[-1].trailer.digest


def _own_evidence(exc: BaseException) -> bool:
    """A failure that names suspects on what we saw ourselves, not on another member's word."""
    return isinstance(exc, RoundFailed) and bool(exc.suspects) and exc.reason != "aborted"


StubFor = Callable[[pb.PeerInfo], object]  # returns a RoundsStub for a member


class ReduceRound:
    """This peer's part in one group's reduce-scatter + all-gather, part by part."""

    def __init__(
        self,
        group: pb.Group,
        identity: Identity,
        run_id: bytes,
        vector: torch.Tensor,
        codec: Codec,
        executor: Executor,
        timeout_s: float,
        chunk_bytes: int,
        want_decoded: bool = False,
        *,
        guard: ContributionGuard | None = None,
        on_invalid: Callable[[str, str], None] | None = None,
        part_bytes: int = PART_BYTES,
    ) -> None:
        """`guard` checks contributions and replies and picks the aggregation rule (peerd/robust.py); `on_invalid`
        (peer id, reason) hears of every member whose signed data it refused. `part_bytes` bounds one part's frame."""
        self.want_decoded = want_decoded
        self.guard = guard
        self.on_invalid = on_invalid
        self.group = group
        self.identity = identity
        self.run_id = run_id
        self.vector = vector
        self.codec = codec
        self.executor = executor
        self.chunk_bytes = chunk_bytes
        self.ids = [m.peer_id for m in group.members]
        self.all_mask = included_mask(len(self.ids), range(len(self.ids)))  # every member: rounds are all-or-nothing
        self.member = self.ids.index(identity.peer_id)  # our index among the members (contributions)
        self.n = len(self.ids)
        # Shard owners: the members others can dial. Every member opens a stream to every other owner, so an
        # outbound-only member sends and receives everything on connections it opened itself.
        # outbound-only members cannot be dialled, flagged ones (group.no_shards) would slow every shard they own
        no_shards = set(group.no_shards)
        self.created = time.perf_counter()
        self.arrival_s: dict[str, float] = {}  # member -> seconds after this round began that its contribution arrived
        self.stream_s: dict[str, tuple[float, int]] = {}  # member -> (seconds its contribution stream took, bytes)
        self._rx: dict[str, tuple[float, int]] = {}  # member -> (when its first part arrived, bytes so far)
        self.reply_s: dict[str, float] = {}  # owner -> seconds after this round began that its averaged shard arrived
        self.reply_stream_s: dict[str, tuple[float, int]] = {}  # owner -> (seconds its averaged parts took, bytes)
        self.owners = [
            i for i, m in enumerate(group.members) if not m.outbound_only and m.peer_id not in no_shards
        ]  # none: run() refuses
        self.me = self.owners.index(self.member) if self.member in self.owners else -1  # our shard, -1: none
        self.n_shards = len(self.owners)
        self.bounds = shard_bounds(vector.numel(), self.n_shards) if self.owners else []
        size = part_elems(codec, part_bytes)
        self.parts = [part_bounds(lo, hi, size) for lo, hi in self.bounds]  # absolute [lo, hi) of every part
        self.deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        # -- our shard (owner side): contributions arrive part by part, in order, from every member
        n_parts = len(self.parts[self.me]) if self.me >= 0 else 0
        self.contrib: list[list[torch.Tensor | None]] = [[None] * self.n for _ in range(n_parts)]
        # Contributions decoded into fresh memory may be summed into in place; ours may be the caller's vector.
        self.private: list[list[bool]] = [[True] * self.n for _ in range(n_parts)]
        self.got = [0] * self.n  # parts received from each member
        self.sumsq: list[list[float]] = [[0.0] * n_parts for _ in range(self.n)]  # per member, per part
        self.frames: list[asyncio.Future[SealedFrame]] = [loop.create_future() for _ in range(n_parts)]
        self.screened: asyncio.Future[None] = loop.create_future()  # every whole contribution passed the guard
        self.reduced: asyncio.Future[None] = loop.create_future()  # every part averaged and screened
        self._left = n_parts  # parts not averaged yet
        self._tasks: set[asyncio.Future] = set()
        self._sent: set[int] = set()  # shards whose every part we handed to grpc
        # -- every shard (member side): the averaged parts' squares, for the replies' screening
        self.reply_sumsq: list[list[float]] = [[0.0] * len(p) for p in self.parts]
        self.average: torch.Tensor | None = None  # allocated in run(), filled part by part as averages are known
        self._decoded: torch.Tensor | None = None  # what our contribution decodes to, when asked for (lossy codecs)
        self.sent_decoded: torch.Tensor | None = None
        probe = vector[:1]
        self._poisoning = faults.poisoned(probe) is not probe  # a test-only injector is on
        self.stats = RoundStats()
        self._deadline_handle = loop.call_later(timeout_s, self._on_deadline)

    # -- owner side: contributions to our shard ---------------------------------------------------------------
    def max_wire(self, sender: str, header: pb.TensorHeader, part: int = 0) -> int:
        """Size limit for a contribution's part, checked against the round's layout before anything is allocated."""
        if sender not in self.ids or sender == self.identity.peer_id:
            raise StreamError("not_member", f"{sender[:8]} is not a member of this round")
        if self.me < 0:
            raise StreamError("wrong_shape", "this peer owns no shard in this round (it is outbound-only)")
        lo, hi = self.parts[self.me][part]
        if header.shard != self.me or header.part != part or header.numel != hi - lo:
            raise StreamError(
                "wrong_shape",
                f"contribution for shard {header.shard} part {header.part} of {header.numel} elements does not "
                f"match this peer's shard {self.me} part {part} of {hi - lo}",
            )
        if codec_name(header.codec) != self.codec.name:
            theirs = codec_name(header.codec) or header.codec
            raise StreamError("wrong_codec", f"contribution uses codec {theirs!r}, the run uses {self.codec.name!r}")
        return self.codec.max_encoded_size(hi - lo)

    async def add_contribution(self, sender: str, part: int, payload: bytes | bytearray) -> None:
        index = self.ids.index(sender)
        lo, hi = self.parts[self.me][part]
        loop = asyncio.get_running_loop()
        now = time.perf_counter()  # C4-style timing: when its parts arrived, and how fast they came
        start, got = self._rx.get(sender, (now, 0))
        self._rx[sender] = (start, got + len(payload))
        self.arrival_s[sender] = now - self.created
        self.stream_s[sender] = (now - start, got + len(payload))
        decoded, sumsq = await loop.run_in_executor(self.executor, self._decode_part, payload, hi - lo)
        self.stats.received_wire_bytes += len(payload)
        self._accept(index, part, decoded, sumsq)

    def _decode_part(self, payload: bytes | bytearray, numel: int) -> tuple[torch.Tensor, float]:
        decoded = self.codec.decode(payload, numel)
        return decoded, sum_of_squares(decoded)

    def _accept(self, index: int, part: int, decoded: torch.Tensor, sumsq: float, private: bool = True) -> None:
        """Take one member's decoded part of our shard; the last member's part k starts averaging part k."""
        if self.got[index] != part:
            raise StreamError("duplicate", f"{self.ids[index][:8]} sent part {part} out of order")
        if self.reduced.done():  # aborted: keep nothing more
            return
        self.got[index] = part + 1
        self.contrib[part][index] = decoded
        self.private[part][index] = private
        self.sumsq[index][part] = sumsq
        whole_first = self.guard is not None and self.guard.needs_whole
        if not whole_first and all(c is not None for c in self.contrib[part]):
            self._spawn(self._reduce_part(part, None))
        if all(g == len(self.frames) for g in self.got):
            self._screen()
            if whole_first and self.screened.done() and not self.screened.exception():
                norms = [math.sqrt(sum(s)) for s in self.sumsq]
                for k in range(len(self.frames)):
                    self._spawn(self._reduce_part(k, norms))

    def _screen(self) -> None:
        """Judge every whole contribution (its squares summed over its parts) before our shard's last part leaves:
        a refused one aborts the round, naming its sender, though earlier parts of the average went out already
        (members keep nothing of a failed round)."""
        numel = self.bounds[self.me][1] - self.bounds[self.me][0]
        if self.guard is not None:
            try:
                self.guard.screen_norms(self.group.fragment, self.member, [_rms(s, numel) for s in self.sumsq])
            except ContributionRejected as exc:
                offenders = {self.ids[i] for i in exc.offenders}
                for pid in offenders:
                    self._invalid(pid, "too_large")
                names = sorted(p[:8] for p in offenders)
                self.abort(RoundFailed(f"refused contributions from {names}: {exc}", offenders, "rejected"))
                return
        if not self.screened.done():
            self.screened.set_result(None)
            self._check_reduced()

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reduce_part(self, k: int, norms: list[float] | None) -> None:
        loop = asyncio.get_running_loop()
        try:
            frame, sumsq = await loop.run_in_executor(self.executor, self._reduce, k, norms)
        except Exception as exc:  # e.g. an average that overflowed to Inf: the round cannot complete
            self.abort(RoundFailed(f"averaging part {k} failed: {exc}", set(), "local"))
            return
        self.reply_sumsq[self.me][k] = sumsq
        if not self.frames[k].done():
            self.frames[k].set_result(frame)
        self._left -= 1
        self._check_reduced()

    def _check_reduced(self) -> None:
        if self._left == 0 and self.screened.done() and not self.reduced.done():
            self.reduced.set_result(None)

    def _invalid(self, peer_id: str, reason: str) -> None:
        if self.on_invalid is not None:
            self.on_invalid(peer_id, reason)

    def _reduce(self, k: int, norms: list[float] | None) -> tuple[SealedFrame, float]:
        """Average part k in fp32 in member order, encode once, and decode our own bytes so we match every other
        member (a lossless codec's bytes decode to the average itself, so it is used as is). With a guard, the run's
        aggregation rule (the clipped mean gets the whole contributions' norms)."""
        contribs = [c for c in self.contrib[k] if c is not None]
        self.contrib[k] = [None] * self.n  # nothing keeps a part's contributions once it is averaged
        if self.guard is not None:
            acc = self.guard.aggregate(contribs, self.private[k], norms)
        else:
            acc = mean_of(contribs, self.private[k])
        encoded = self.codec.encode_frame(acc)
        own = acc if self.codec.lossless else self.codec.decode(bytes(encoded), acc.numel())
        self._place(self.parts[self.me][k], own)
        return encoded, sum_of_squares(own)

    async def serve(
        self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str
    ) -> AsyncIterator[pb.TensorMessage]:
        """Server side of one Reduce stream (whose header the service already verified as `sender`'s): read the
        member's parts while replying with each averaged part as soon as it is known."""
        reader = asyncio.ensure_future(self._read_parts(messages, verifier, sender))
        try:
            chain = b""
            last = len(self.frames) - 1
            for k, (lo, hi) in enumerate(self.parts[self.me]):
                frame = await self._until(self.frames[k], reader)
                if k == last:  # the whole contributions must pass the guard before the round can complete
                    await self._until(self.screened, reader)
                header = pb.TensorHeader(
                    round_id=self.group.round_id,
                    shard=self.me,
                    part=k,
                    numel=hi - lo,
                    codec=codec_to_wire(self.codec.name),
                    included_mask=self.all_mask,
                    kind=kind_to_wire("gather"),
                )
                msgs, chain = part_messages(header, frame, self.identity, self.run_id, self.chunk_bytes, chain)
                self.stats.wire_bytes += len(frame)
                self.stats.messages += len(msgs)
                self.stats.raw_bytes += 4 * (hi - lo)
                for msg in msgs:
                    yield msg
            await reader  # done by now (our last part needed all of its parts); raises what it raised
        finally:
            if not reader.done():
                reader.cancel()
            reader.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: the round failed anyway

    async def _until(self, fut: asyncio.Future, reader: asyncio.Future) -> object:
        """`fut`'s result, failing at once if the stream's reader failed or the round's deadline passed."""
        while not fut.done():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait({fut} if reader.done() else {fut, reader}, timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        return fut.result()

    async def _read_parts(self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str) -> None:
        chain = b""
        try:
            for k in range(len(self.frames)):

                async def limit(who: str, header: pb.TensorHeader, k: int = k) -> int:
                    return self.max_wire(who, header, k)

                first = sender if k == 0 else None
                rx = await read_tensor(messages, verifier, limit, verified_sender=first, chain=chain)
                if rx.sender != sender:
                    raise StreamError("malformed", f"part {k} is signed by another peer")
                if rx.header.round_id != self.group.round_id:
                    raise StreamError("wrong_round", "contribution names another round")
                chain = rx.digest
                try:
                    await self.add_contribution(sender, k, rx.payload)
                except CodecError as exc:  # a member's frame does not decode: the round cannot complete with it
                    raise StreamError("malformed", f"contribution part {k} does not decode: {exc}") from exc
        except StreamError as exc:
            exc.sender = exc.sender or sender  # the stream's first header was the sender's: so is what follows it
            raise

    def abort(self, exc: BaseException) -> None:
        for fut in (*self.frames, self.screened, self.reduced):
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: waiters see it, asyncio does not log it

    def _on_deadline(self) -> None:
        missing = {self.ids[i] for i, g in enumerate(self.got) if g < len(self.frames)}
        self.abort(RoundFailed(f"round timed out waiting for {sorted(p[:8] for p in missing)}", missing, "timeout"))

    # -- member side ------------------------------------------------------------------------------------------
    async def run(self, stub_for: StubFor, verifier: Verifier) -> RoundResult:
        if not self.owners:  # a failed round like any other, so the caller retries with a new group
            self._deadline_handle.cancel()
            raise RoundFailed("no reachable peer in the group: nobody can own a shard", set(), "no_reachable")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        tasks: dict[int, asyncio.Future] = {}
        try:
            await loop.run_in_executor(self.executor, self._prepare)
            tasks = {
                j: asyncio.ensure_future(self._exchange(j, stub_for, verifier))
                for j in range(self.n_shards)
                if j != self.me
            }
            waiting: list[asyncio.Future] = list(tasks.values())
            own_wait: asyncio.Future | None = None
            if self.me >= 0:  # an outbound-only member owns no shard: nothing to reduce here
                self._spawn(self._feed_own())
                own_wait = asyncio.ensure_future(asyncio.shield(self.reduced))
                waiting.append(own_wait)
            remaining = max(self.deadline - time.monotonic(), 0.01)
            try:
                # Fail as soon as any part fails (not when the parts before it in member order are done), so a
                # failure anywhere in the group reaches every member in one round trip.
                done, pending = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
                failed = [f.exception() for f in done if not f.cancelled() and f.exception() is not None]
                if failed and pending and not any(_own_evidence(e) for e in failed):
                    # A stream that broke off names nobody, and another member's abort names whom *it* blames (a
                    # hostile owner may name an honest peer): our own evidence, a moment later, is worth waiting
                    # for, so that every honest member leaves the same peer out of the retry
                    more, _ = await asyncio.wait(pending, timeout=BLAME_GRACE_S, return_when=asyncio.FIRST_EXCEPTION)
                    failed += [f.exception() for f in more if not f.cancelled() and f.exception() is not None]
                if failed:
                    named = [e for e in failed if isinstance(e, RoundFailed) and e.suspects]
                    raise next((e for e in named if _own_evidence(e)), named[0] if named else failed[0])
                if pending:
                    raise TimeoutError
            except BaseException:
                if own_wait is not None:
                    own_wait.cancel()
                raise
        except BaseException as exc:
            for task in tasks.values():
                task.cancel()
            self.abort(exc if isinstance(exc, RoundFailed) else RoundFailed(str(exc)))
            raise self._as_failure(exc, tasks) from exc
        finally:
            self._deadline_handle.cancel()
        if self.guard is not None:  # the same verdict on every member: it depends only on bytes they all received
            norms = [_rms(self.reply_sumsq[j], hi - lo) for j, (lo, hi) in enumerate(self.bounds)]
            bad = [self.owners[j] for j in self.guard.screen_reply_norms(self.me, norms)]
            for i in bad:
                self._invalid(self.ids[i], "too_large")
            if bad:
                names = sorted(self.ids[i][:8] for i in bad)
                raise RoundFailed(f"averaged shards from {names} are far larger than the others'",
                                  {self.ids[i] for i in bad}, "rejected")  # fmt: skip
        assert self.average is not None  # every part was placed by whoever produced it
        self.stats.seconds = time.perf_counter() - t0
        if self.want_decoded and not self._poisoning:
            self.sent_decoded = self.vector.detach().float().cpu() if self.codec.lossless else self._decoded
        return RoundResult(self.average, self.group, list(self.ids), self.stats, self.sent_decoded)

    def _prepare(self) -> None:
        """Refuse a vector no codec would send (what encoding it whole used to refuse) before any stream opens, and
        allocate the result (and, for error feedback, what our parts decode to)."""
        finite_or_raise(check_input(self.vector), "input tensor")
        self.average = torch.empty(self.vector.numel(), dtype=torch.float32)
        if self.want_decoded and not self.codec.lossless:
            self._decoded = torch.empty(self.vector.numel(), dtype=torch.float32)

    def _place(self, bounds: tuple[int, int], values: torch.Tensor) -> None:
        """Copy an averaged part into the result as soon as it is known (in the executor, overlapping the waits
        for the others) rather than assembling all of them at the end."""
        assert self.average is not None
        self.average[bounds[0] : bounds[1]] = values

    def _encode_part(self, j: int, k: int) -> bytes | SealedFrame:
        """Our contribution's part k of shard j as a frame (in the executor, one part ahead of the stream)."""
        lo, hi = self.parts[j][k]
        x = self.vector[lo:hi]
        if self._poisoning:
            bad = faults.poisoned(x)
            if j == self.me and not bool(torch.isfinite(bad).all()):
                bad = x  # a NaN frame would not decode for us either
            frame: bytes | SealedFrame = faults.forge_frame(self.codec, bad.contiguous())
        else:
            frame = self.codec.encode_frame(x.contiguous())
            if self._decoded is not None:  # for error feedback
                self._decoded[lo:hi] = self.codec.decode(bytes(frame), hi - lo)
        return frame if j == self.me else faults.corrupt(frame, k)

    async def _feed_own(self) -> None:
        """Our own contribution to our shard, part by part (a lossless codec's: our vector itself, not a frame)."""
        loop = asyncio.get_running_loop()
        try:
            for k, (lo, hi) in enumerate(self.parts[self.me]):
                if self.codec.lossless and not self._poisoning:
                    own = self.vector[lo:hi].cpu()  # the caller's memory (or a copy): never summed into
                    sumsq = await loop.run_in_executor(self.executor, sum_of_squares, own)
                    if self.reduced.done():
                        return
                    self._accept(self.member, k, own, sumsq, private=False)
                else:
                    payload = await loop.run_in_executor(self.executor, self._encode_part, self.me, k)
                    await self.add_contribution(self.identity.peer_id, k, bytes(payload))
        except Exception as exc:
            self.abort(exc if isinstance(exc, RoundFailed) else RoundFailed(f"our own contribution failed: {exc!r}"))

    async def _send_parts(self, j: int) -> AsyncIterator[pb.TensorMessage]:
        """Our contribution to shard j, part by part: each part is encoded while the one before it is on the wire."""
        loop = asyncio.get_running_loop()
        parts = self.parts[j]
        chain = b""
        pending = loop.run_in_executor(self.executor, self._encode_part, j, 0)
        for k, (lo, hi) in enumerate(parts):
            payload = await pending
            if k + 1 < len(parts):
                pending = loop.run_in_executor(self.executor, self._encode_part, j, k + 1)
            header = pb.TensorHeader(
                round_id=self.group.round_id,
                shard=j,
                part=k,
                numel=hi - lo,
                codec=codec_to_wire(self.codec.name),
                kind=kind_to_wire("reduce"),
            )
            msgs, chain = part_messages(header, payload, self.identity, self.run_id, self.chunk_bytes, chain)
            self.stats.wire_bytes += len(payload)
            self.stats.messages += len(msgs)
            self.stats.raw_bytes += 4 * (hi - lo)
            for msg in msgs:
                yield msg
        self._sent.add(j)

    async def _exchange(self, j: int, stub_for: StubFor, verifier: Verifier) -> None:
        member = self.group.members[self.owners[j]]
        pid = member.peer_id
        stub = stub_for(member)
        remaining = max(self.deadline - time.monotonic(), 0.01)
        call = stub.Reduce(self._send_parts(j), timeout=remaining)  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        chain = b""
        try:
            replies = call.__aiter__()
            for k, (lo, hi) in enumerate(self.parts[j]):
                rx = await read_tensor(replies, verifier, self.codec.max_encoded_size(hi - lo), chain=chain)
                h = rx.header
                if rx.sender != pid or h.shard != j or h.part != k or h.round_id != self.group.round_id:
                    raise RoundFailed(f"reply from {pid[:8]} does not match the round", {pid}, "malformed")
                if bytes(h.included_mask) != self.all_mask:
                    raise RoundFailed(f"{pid[:8]} averaged a different set of peers", {pid})
                chain = rx.digest
                self.stats.received_wire_bytes += len(rx.payload)
                now = time.perf_counter()  # C4-style timing: how late and how fast this owner's average came back
                start, got = self._rx.get(f"reply:{pid}", (now, 0))
                self._rx[f"reply:{pid}"] = (start, got + len(rx.payload))
                self.reply_s[pid] = now - self.created
                self.reply_stream_s[pid] = (now - start, got + len(rx.payload))
                try:
                    self.reply_sumsq[j][k] = await loop.run_in_executor(
                        self.executor, self._decode_reply, (lo, hi), rx.payload
                    )
                except CodecError as exc:
                    self._invalid(pid, "nan" if "NaN" in str(exc) else "malformed")
                    raise RoundFailed(f"{pid[:8]} sent an undecodable average: {exc}", {pid}) from exc
        except StreamError as exc:
            if exc.sender == pid:
                self._invalid(pid, exc.reason)
            raise RoundFailed(f"reply from {pid[:8]} refused: {exc}", {pid}, "malformed") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                others = set(self.ids) - {pid, self.identity.peer_id}
                named = relayed_suspects(exc.trailing_metadata(), others)
                raise RoundFailed(f"{pid[:8]} aborted the round: {exc.details()}", named) from exc
            if exc.code() == grpc.StatusCode.INTERNAL and j not in self._sent:
                # The owner ended the stream (an abort) while our parts were still going out: grpc then reports
                # its own failed write, not the owner's status, so this names nobody rather than blaming the owner
                raise RoundFailed(f"{pid[:8]} ended the stream while we were sending: {exc.details()}") from exc
            raise RoundFailed(
                f"exchange with {pid[:8]} failed: {exc.code().name} {exc.details()}", {pid}, "peer_lost"
            ) from exc
        finally:
            call.cancel()

    def _decode_reply(self, bounds: tuple[int, int], payload: bytearray) -> float:
        reply = self.codec.decode(payload, bounds[1] - bounds[0])
        self._place(bounds, reply)
        return sum_of_squares(reply)

    def _as_failure(self, exc: BaseException, tasks: dict[int, asyncio.Future]) -> RoundFailed:
        if isinstance(exc, RoundFailed):
            return exc
        for task in tasks.values():
            if task.done() and not task.cancelled() and isinstance(task.exception(), RoundFailed):
                return task.exception()  # type: ignore[return-value]
        if isinstance(exc, asyncio.TimeoutError):
            missing = {self.ids[i] for i, g in enumerate(self.got) if g < len(self.frames)}
            return RoundFailed("round timed out", missing, "timeout")
        return RoundFailed(f"round failed: {exc!r}")
