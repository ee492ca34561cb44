"""The owner's side of one shard of one round: contributions arrive part by part from every member, part k is averaged
as soon as every contributor's part k is in, and the same averaged bytes go back on every member's stream.

A contributor that leaves the round (its stream broke off, or the round saw it lost) is dropped rather than waited
for: the parts not averaged yet average the others, and every averaged part names whom it covers in its signed header
(`included_mask`). Every member decodes the same bytes with the same masks, so members still end bit-identical and
agree on whom the round included. The same class serves a dead owner's shard on its fallback owner, with the dead
owner left out of `contributors`: see allreduce.py for how members pick that peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from peerd import faults
from peerd.codecs import Codec, CodecError
from peerd.codecs.frame import SealedFrame
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.layout import included_mask
from peerd.robust import ContributionGuard, ContributionRejected, mean_of
from peerd.roundtypes import RoundFailed, RoundStats, part_messages, rms, sum_of_squares
from peerd.streams import StreamError, read_tensor
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, codec_to_wire, kind_to_wire

log = logging.getLogger("peerd")

SILENT_SHARE = 0.5
"""An owner stops waiting for contributors of which nothing arrived once this share of the round's time left at its
start has passed, if most of the others' did arrive: a member alive in gossip whose stream to us never came (a stuck
connection, a starved process) otherwise held the round to its timeout and failed it for every member (seen at 64
peers). It is dropped like a member that died: the round completes, partial, and says whom it left out."""


@dataclass
class RoundContext:
    """What a round's shard owners share with its member side (allreduce.ReduceRound)."""

    group: pb.Group
    ids: list[str]
    member: int  # our index among the members
    identity: Identity
    run_id: bytes
    codec: Codec
    executor: Executor
    chunk_bytes: int
    guard: ContributionGuard | None
    on_invalid: Callable[[str, str], None] | None
    result: Callable[[tuple[int, int]], torch.Tensor]  # our result's slice [lo, hi), where an averaged part goes
    on_left: Callable[[str], None]  # a member's stream to us broke off: it left the round
    stats: RoundStats
    deadline: float  # time.monotonic()
    weights: list[float] | None = None  # each member's token weight (the factor it scaled its vector by)
    created: float = field(default_factory=time.perf_counter)
    arrival_s: dict[str, float] = field(default_factory=dict)  # member -> when its contribution arrived (s)
    stream_s: dict[str, tuple[float, int]] = field(default_factory=dict)  # member -> (seconds, bytes) of its stream
    rx: dict[str, tuple[float, int]] = field(default_factory=dict)  # stream key -> (first part's time, bytes so far)

    def invalid(self, peer_id: str, reason: str) -> None:
        if self.on_invalid is not None:
            self.on_invalid(peer_id, reason)


class ShardOwner:
    """Contributions to shard `shard` (its parts' absolute bounds in `parts`) from the members in `contributors`."""

    def __init__(
        self,
        ctx: RoundContext,
        shard: int,
        parts: list[tuple[int, int]],
        contributors: set[int],
        leave_out_silent: bool = True,
    ) -> None:
        """`leave_out_silent`: drop the silent minority at SILENT_SHARE (our own shard). A fallback owner waits for
        every member it has not seen lost instead: members that went to the shard's owner never come to it, and
        waiting for them is what keeps the two from completing one shard twice."""
        loop = asyncio.get_running_loop()
        self.ctx = ctx
        self.shard = shard
        self.parts = parts
        n, n_parts = len(ctx.ids), len(parts)
        self.n = n
        self.expected = set(contributors)  # member indices this shard waits for
        self.dropped: set[int] = set()  # contributors that left: the parts averaged after that leave them out
        self.contrib: list[list[torch.Tensor | None]] = [[None] * n for _ in range(n_parts)]
        # Contributions decoded into fresh memory may be summed into in place; ours may be the caller's vector.
        self.private: list[list[bool]] = [[True] * n for _ in range(n_parts)]
        self.got = [0] * n  # parts received from each member
        self.sumsq: list[list[float]] = [[0.0] * n_parts for _ in range(n)]  # per member, per part
        self.frames: list[asyncio.Future[tuple[SealedFrame | bytes | bytearray, bytes]]] = [
            loop.create_future() for _ in parts
        ]
        self.reply_sumsq = [0.0] * n_parts  # the averaged parts' squares (for the members' reply screening)
        self.screened: asyncio.Future[None] = loop.create_future()  # every whole contribution passed the guard
        self.reduced: asyncio.Future[None] = loop.create_future()  # every part averaged and screened
        self._started: set[int] = set()  # parts whose averaging began
        self.relayed_from: str | None = None  # the lost owner whose own average we serve instead (shard_relay.py)
        self._left = n_parts  # parts not averaged yet
        self._tasks: set[asyncio.Future] = set()
        self.silent_s = SILENT_SHARE * max(ctx.deadline - time.monotonic(), 0.0)
        if leave_out_silent:
            timer = loop.call_later(self.silent_s, self.drop_silent)
            self.reduced.add_done_callback(lambda _: timer.cancel())

    @property
    def waiting_for(self) -> set[int]:
        return self.expected - self.dropped

    @property
    def whole_first(self) -> bool:
        return self.ctx.guard is not None and self.ctx.guard.needs_whole

    # -- contributions ------------------------------------------------------------------------------------------
    def max_wire(self, sender: str, header: pb.TensorHeader, part: int = 0) -> int:
        """Size limit for a contribution's part, checked against the round's layout before anything is allocated."""
        ctx = self.ctx
        if sender not in ctx.ids or sender == ctx.identity.peer_id:
            raise StreamError("not_member", f"{sender[:8]} is not a member of this round")
        lo, hi = self.parts[part] if part < len(self.parts) else (0, -1)
        if header.shard != self.shard or header.part != part or header.numel != hi - lo:
            raise StreamError(
                "wrong_shape",
                f"contribution for shard {header.shard} part {header.part} of {header.numel} elements does not "
                f"match this peer's shard {self.shard} part {part} of {hi - lo}",
            )
        if codec_name(header.codec) != ctx.codec.name:
            theirs = codec_name(header.codec) or header.codec
            raise StreamError("wrong_codec", f"contribution uses codec {theirs!r}, the run uses {ctx.codec.name!r}")
        return ctx.codec.max_encoded_size(hi - lo)

    async def add_contribution(self, sender: str, part: int, payload: bytes | bytearray) -> None:
        ctx = self.ctx
        lo, hi = self.parts[part]
        now = time.perf_counter()  # C4-style timing: when its parts arrived, and how fast they came
        start, got = ctx.rx.get(sender, (now, 0))
        ctx.rx[sender] = (start, got + len(payload))
        ctx.arrival_s[sender] = now - ctx.created
        ctx.stream_s[sender] = (now - start, got + len(payload))
        loop = asyncio.get_running_loop()
        decoded, sumsq = await loop.run_in_executor(ctx.executor, self._decode_part, payload, hi - lo)
        ctx.stats.received_wire_bytes += len(payload)
        self.accept(ctx.ids.index(sender), part, decoded, sumsq)

    def _decode_part(self, payload: bytes | bytearray, numel: int) -> tuple[torch.Tensor, float]:
        decoded = self.ctx.codec.decode(payload, numel)
        return decoded, sum_of_squares(decoded)

    def accept(self, index: int, part: int, decoded: torch.Tensor, sumsq: float, private: bool = True) -> None:
        """Take one member's decoded part; the last awaited contributor's part k starts averaging part k."""
        if self.reduced.done() or index not in self.expected or index in self.dropped:  # aborted, or dropped
            return
        if self.got[index] != part:
            raise StreamError("duplicate", f"{self.ctx.ids[index][:8]} sent part {part} out of order")
        self.got[index] = part + 1
        self.contrib[part][index] = decoded
        self.private[part][index] = private
        self.sumsq[index][part] = sumsq
        if not self.whole_first:
            self._start_if_complete(part)
        self._check_whole()

    def drop(self, index: int) -> None:
        """Contributor `index` left the round: stop waiting for its parts. The parts it already sent stay in the
        averages not yet computed (every averaged part's mask says whom it covers)."""
        if index not in self.waiting_for or index == self.ctx.member or self.reduced.done():
            return
        if self.got[index] == len(self.parts):
            return  # it delivered everything: nothing to wait for, and its contribution counts in full
        self.dropped.add(index)
        if not self.whole_first:
            for k in range(len(self.parts)):
                self._start_if_complete(k)
        self._check_whole()

    def drop_silent(self) -> list[str]:
        """Drop the contributors of which nothing arrived, if they are a minority of those we wait for (when most
        are silent, the trouble is more likely ours: we keep waiting). Returns whom it dropped."""
        others = self.waiting_for - {self.ctx.member}
        silent = sorted(i for i in others if self.got[i] == 0)
        if self.reduced.done() or self.relayed_from is not None or not silent or 2 * len(silent) >= len(others):
            return []
        for i in silent:
            self.drop(i)
        names = [self.ctx.ids[i] for i in silent]
        log.warning(
            "shard %d: left out %s: nothing of theirs arrived in %.0f s (half the round's time), from %d of %d "
            "members it did", self.shard, [p[:8] for p in names], self.silent_s, len(others) - len(silent), len(others),
        )  # fmt: skip
        return names

    def _start_if_complete(self, k: int) -> None:
        if self.relayed_from is not None:
            return
        if k not in self._started and all(self.contrib[k][i] is not None for i in self.waiting_for):
            self._started.add(k)
            self._spawn(self._reduce_part(k, None))

    def _check_whole(self) -> None:
        if (
            self.relayed_from is not None
            or self.screened.done()
            or any(self.got[i] < len(self.parts) for i in self.waiting_for)
        ):
            return
        self._screen()
        if self.whole_first and self.screened.done() and not self.screened.exception():
            norms = [math.sqrt(sum(s)) for s in self.sumsq]
            for k in range(len(self.parts)):
                self._started.add(k)
                self._spawn(self._reduce_part(k, norms))

    def _screen(self) -> None:
        """Judge every whole contribution (its squares summed over its parts) before our shard's last part leaves:
        a refused one aborts the round, naming its sender, though earlier parts of the average went out already
        (members keep nothing of a failed round). A dropped contributor is judged on the parts it sent."""
        ctx = self.ctx
        if ctx.guard is not None:
            numel = [hi - lo for lo, hi in self.parts]
            norms = [
                rms(self.sumsq[i][: self.got[i]], sum(numel[: self.got[i]])) if i in self.expected else 0.0
                for i in range(self.n)
            ]
            try:
                ctx.guard.screen_norms(ctx.group.fragment, ctx.member, norms, ctx.weights)
            except ContributionRejected as exc:
                offenders = {ctx.ids[i] for i in exc.offenders}
                for pid in offenders:
                    ctx.invalid(pid, "too_large")
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
        keep = self.waiting_for if self.whole_first else self.expected  # whole_first: nothing averaged before drops
        idx = [i for i in range(self.n) if i in keep and self.contrib[k][i] is not None]
        try:
            frame, sumsq, mask = await loop.run_in_executor(self.ctx.executor, self._reduce, k, idx, norms)
        except Exception as exc:  # e.g. an average that overflowed to Inf: the round cannot complete
            self.abort(RoundFailed(f"averaging part {k} failed: {exc}", set(), "local"))
            return
        self.reply_sumsq[k] = sumsq
        if not self.frames[k].done():
            self.frames[k].set_result((frame, mask))
        self._left -= 1
        self._check_reduced()

    def _check_reduced(self) -> None:
        if self._left == 0 and self.screened.done() and not self.reduced.done():
            self.reduced.set_result(None)

    def _reduce(self, k: int, idx: list[int], norms: list[float] | None) -> tuple[SealedFrame, float, bytes]:
        """Average part k in fp32 in member order over the contributions `idx`, encode once, and keep what those
        bytes decode to, so we match every other member (a lossless codec's bytes decode to the average itself).
        With a guard, the run's aggregation rule (the clipped mean gets the whole contributions' norms)."""
        ctx = self.ctx
        contribs = [self.contrib[k][i] for i in idx]
        private = [self.private[k][i] for i in idx]
        self.contrib[k] = [None] * self.n  # nothing keeps a part's contributions once it is averaged
        if ctx.guard is not None:
            acc = ctx.guard.aggregate(contribs, private, [norms[i] for i in idx] if norms else None)  # type: ignore[arg-type]
        else:
            acc = mean_of(contribs, private)  # type: ignore[arg-type]
        if ctx.weights and len(idx) < self.n:
            # members scaled their vectors by w_i = tokens_i / mean(tokens) over the whole group, so the mean of a
            # subset is off by mean(w) over that subset: divide it out, keeping the token-weighted mean
            acc.mul_(len(idx) / sum(ctx.weights[i] for i in idx))
        out = ctx.result(self.parts[k])
        if ctx.codec.lossless:
            encoded, own = ctx.codec.encode_frame(acc), out.copy_(acc)
        else:
            encoded, own = ctx.codec.encode_frame_into(acc, out), out
        return encoded, sum_of_squares(own), included_mask(self.n, idx)

    # -- a lost owner's average instead of ours (shard_relay.py) ---------------------------------------------------
    def can_adopt(self) -> bool:
        """Nobody's average is in yet: ours has not begun, and no relayed one is being adopted."""
        return self.relayed_from is None and not self._started and not self.reduced.done()

    async def adopt(self, frames: list[tuple[bytes | bytearray, bytes]], source: str) -> bool:
        """Serve `source`'s averaged parts (payload, mask) instead of averaging ourselves: decode them into our
        result like any reply (a frame that does not decode is refused), then resolve. False: too late, our own
        averaging began (it only can once every member we wait for contributed, so nobody holds the relayed one)."""
        if not self.can_adopt():
            return False
        self.relayed_from = source  # no part starts averaging from now on
        loop = asyncio.get_running_loop()
        sums = []
        for (lo, hi), (payload, _) in zip(self.parts, frames, strict=True):
            try:
                decoded, sumsq = await loop.run_in_executor(self.ctx.executor, self._decode_part, payload, hi - lo)
            except CodecError as exc:
                raise StreamError("malformed", f"a relayed part of {source[:8]}'s does not decode: {exc}") from exc
            self.ctx.result((lo, hi)).copy_(decoded)
            sums.append(sumsq)
        self.adopt_known(frames, sums, source)
        return True

    def adopt_known(self, frames: list[tuple[bytes | bytearray, bytes]], sumsq: list[float], source: str) -> None:
        """`adopt` for parts already decoded into our result (we received them as a member)."""
        if self.reduced.done():
            return
        self.relayed_from = source
        for k, (payload, mask) in enumerate(frames):
            if not self.frames[k].done():
                self.frames[k].set_result((payload, mask))
            self.reply_sumsq[k] = sumsq[k]
        if not self.screened.done():
            self.screened.set_result(None)
        self.reduced.set_result(None)

    def abort(self, exc: BaseException) -> None:
        for fut in (*self.frames, self.screened, self.reduced):
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: waiters see it, asyncio does not log it

    def missing(self) -> set[str]:
        return {self.ctx.ids[i] for i in self.waiting_for if self.got[i] < len(self.parts)}

    # -- the stream ---------------------------------------------------------------------------------------------
    async def serve(
        self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str
    ) -> AsyncIterator[pb.TensorMessage]:
        """Server side of one Reduce stream (whose header the service already verified as `sender`'s): read the
        member's parts while replying with each averaged part as soon as it is known. A stream that breaks off
        drops its sender from the round (it left: its round failed, or it died) instead of failing everyone's."""
        ctx = self.ctx
        reader = asyncio.ensure_future(self._read_parts(messages, verifier, sender))
        broke = False
        try:
            chain = b""
            last = len(self.parts) - 1
            for k, (lo, hi) in enumerate(self.parts):
                frame, mask = await self._until(self.frames[k], reader)
                if k == last:  # the whole contributions must pass the guard before the round can complete
                    await self._until(self.screened, reader)
                header = pb.TensorHeader(
                    round_id=ctx.group.round_id,
                    shard=self.shard,
                    part=k,
                    numel=hi - lo,
                    codec=codec_to_wire(ctx.codec.name),
                    included_mask=mask,
                    kind=kind_to_wire("gather"),
                )
                await faults.GATHER_EXIT.claim()
                try:
                    msgs, chain = part_messages(
                        header, frame, ctx.identity, ctx.run_id, ctx.chunk_bytes, chain, ctx.stats
                    )
                    for msg in msgs:
                        yield msg
                finally:  # also when the member ends the call at our last message: a claim never done hangs the rest
                    faults.GATHER_EXIT.done()
            await reader  # done by now (our last part needed all of its parts); raises what it raised
        except asyncio.CancelledError:
            broke = True  # the member cancelled the call, or its process died
            raise
        except StreamError as exc:
            broke = exc.reason in ("truncated", "timeout")  # it stopped sending: it left, or a slow loris
            raise
        finally:
            if not reader.done():
                reader.cancel()
            reader.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: the round failed anyway
            if broke and not self.reduced.done():
                ctx.on_left(sender)

    async def _until(self, fut: asyncio.Future, reader: asyncio.Future) -> object:
        """`fut`'s result, failing at once if the stream's reader failed or the round's deadline passed. The reader
        may have failed before we got here (a corrupt part read while we sent earlier averaged parts back): that is
        checked before waiting, or we would wait for `fut` alone until the deadline (60 s rounds, seen in CI)."""
        while not fut.done():
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            remaining = self.ctx.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait({fut} if reader.done() else {fut, reader}, timeout=remaining,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        return fut.result()

    async def _read_parts(self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str) -> None:
        chain = b""
        try:
            for k in range(len(self.parts)):

                async def limit(who: str, header: pb.TensorHeader, k: int = k) -> int:
                    return self.max_wire(who, header, k)

                first = sender if k == 0 else None
                rx = await read_tensor(messages, verifier, limit, verified_sender=first, chain=chain)
                if rx.sender != sender:
                    raise StreamError("malformed", f"part {k} is signed by another peer")
                if rx.header.round_id != self.ctx.group.round_id:
                    raise StreamError("wrong_round", "contribution names another round")
                chain = rx.digest
                try:
                    await self.add_contribution(sender, k, rx.payload)
                except CodecError as exc:  # a member's frame does not decode: the round cannot complete with it
                    raise StreamError("malformed", f"contribution part {k} does not decode: {exc}") from exc
        except StreamError as exc:
            exc.sender = exc.sender or sender  # the stream's first header was the sender's: so is what follows it
            raise
