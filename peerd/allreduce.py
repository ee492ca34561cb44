"""Bandwidth-optimal averaging of one flat fp32 vector across a round's group: reduce-scatter, then all-gather.

The vector is cut into one contiguous shard per reachable member (the owners, in member order; outbound-only members,
which nobody can dial, own none). Owner i owns shard i: every other member streams its encoded shard i to it over a
stream the sender opens, and the owner decodes all contributions, sums them in fp32 in member order, divides by the
group size, encodes the average once, and streams those same bytes back to every member on the same gRPC stream.
Each peer therefore sends and receives (n-1)/n of the vector twice (with all members reachable), nothing is funnelled
through one peer, and because every member (the owner included) decodes the *same bytes* of each averaged shard,
all members end bit-identical.

A round is all-or-nothing: if any contribution is missing when the deadline passes, or any stream fails, the round
fails on every member (owners abort the streams they serve, so a failure spreads in one round trip) and the caller
retries the step with a new group that leaves the failed peer out. A round never averages a subset silently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
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
from peerd.robust import ContributionGuard, ContributionRejected, mean_of
from peerd.streams import StreamError, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, codec_to_wire, kind_to_wire


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


def shard_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal shards; the first numel % n shards get one extra element."""
    base, extra = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


StubFor = Callable[[pb.PeerInfo], object]  # returns a RoundsStub for a member


class ReduceRound:
    """This peer's part in one group's reduce-scatter + all-gather."""

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
    ) -> None:
        """`guard` checks contributions and replies and picks the aggregation rule (peerd/robust.py); `on_invalid`
        (peer id, reason) hears of every member whose signed data it refused."""
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
        self.member = self.ids.index(identity.peer_id)  # our index among the members (contributions)
        self.n = len(self.ids)
        # Shard owners: the members others can dial. Every member opens a stream to every other owner, so an
        # outbound-only member sends and receives everything on connections it opened itself.
        # outbound-only members cannot be dialled, flagged ones (group.no_shards) would slow every shard they own
        no_shards = set(group.no_shards)
        self.created = time.perf_counter()
        self.arrival_s: dict[str, float] = {}  # member -> seconds after this round began that its contribution arrived
        self.stream_s: dict[str, tuple[float, int]] = {}  # member -> (seconds its contribution stream took, bytes)
        self.reply_s: dict[str, float] = {}  # owner -> seconds after this round began that its averaged shard arrived
        self.owners = [
            i for i, m in enumerate(group.members) if not m.outbound_only and m.peer_id not in no_shards
        ]  # none: run() refuses
        self.me = self.owners.index(self.member) if self.member in self.owners else -1  # our shard, -1: none
        self.n_shards = len(self.owners)
        self.bounds = shard_bounds(vector.numel(), self.n_shards) if self.owners else []
        self.deadline = time.monotonic() + timeout_s
        loop = asyncio.get_running_loop()
        self.contrib: list[torch.Tensor | None] = [None] * self.n
        # Contributions decoded into fresh memory may be summed into in place; ours may be the caller's vector.
        self.private = [True] * self.n
        self.reduced: asyncio.Future[tuple[SealedFrame, torch.Tensor]] = loop.create_future()
        # Filled shard by shard as each average is known (allocated with our own encoding, which always comes
        # before any average: our shard's needs our contribution, the others' replies need our sends).
        self.average: torch.Tensor | None = None
        self.stats = RoundStats()
        self._deadline_handle = loop.call_later(timeout_s, self._on_deadline)

    # -- owner side: contributions to our shard ---------------------------------------------------------------
    def shard_numel(self, index: int) -> int:
        lo, hi = self.bounds[index]
        return hi - lo

    def max_wire(self, sender: str, header: pb.TensorHeader) -> int:
        """Size limit for a contribution, checked against the round's layout before anything is allocated."""
        if sender not in self.ids or sender == self.identity.peer_id:
            raise StreamError("not_member", f"{sender[:8]} is not a member of this round")
        if self.me < 0:
            raise StreamError("wrong_shape", "this peer owns no shard in this round (it is outbound-only)")
        if header.shard != self.me or header.numel != self.shard_numel(self.me):
            raise StreamError(
                "wrong_shape",
                f"contribution for shard {header.shard} of {header.numel} elements "
                f"does not match this peer's shard {self.me} of {self.shard_numel(self.me)}",
            )
        if codec_name(header.codec) != self.codec.name:
            theirs = codec_name(header.codec) or header.codec
            raise StreamError("wrong_codec", f"contribution uses codec {theirs!r}, the run uses {self.codec.name!r}")
        return self.codec.max_encoded_size(self.shard_numel(self.me))

    async def add_contribution(self, sender: str, payload: bytes | bytearray) -> None:
        index = self.ids.index(sender)
        if self.contrib[index] is not None:
            raise StreamError("duplicate", f"{sender[:8]} already contributed to this round")
        numel = self.shard_numel(self.me)
        loop = asyncio.get_running_loop()
        self.arrival_s[sender] = time.perf_counter() - self.created  # C4-style timing: how late it came
        decoded = await loop.run_in_executor(self.executor, self.codec.decode, payload, numel)
        self.stats.received_wire_bytes += len(payload)
        await self._accept(index, decoded)

    async def _accept(self, index: int, decoded: torch.Tensor) -> None:
        """Take one member's decoded contribution to our shard; the last one to arrive triggers the reduction."""
        if self.contrib[index] is not None:
            raise StreamError("duplicate", f"{self.ids[index][:8]} already contributed to this round")
        self.contrib[index] = decoded
        loop = asyncio.get_running_loop()
        if all(c is not None for c in self.contrib) and not self.reduced.done():
            try:
                encoded, avg = await loop.run_in_executor(self.executor, self._reduce)
            except ContributionRejected as exc:
                offenders = {self.ids[i] for i in exc.offenders}
                for pid in offenders:
                    self._invalid(pid, "too_large")
                names = sorted(p[:8] for p in offenders)
                self.abort(RoundFailed(f"refused contributions from {names}: {exc}", offenders, "rejected"))
                return
            if not self.reduced.done():
                self.reduced.set_result((encoded, avg))

    def _invalid(self, peer_id: str, reason: str) -> None:
        if self.on_invalid is not None:
            self.on_invalid(peer_id, reason)

    def _reduce(self) -> tuple[SealedFrame, torch.Tensor]:
        """Average in fp32 in member order, encode once, and decode our own bytes so we match every other member
        (a lossless codec's bytes decode to the average itself, so it is used as is). With a guard, contributions
        are screened first (ContributionRejected) and the run's aggregation rule used."""
        contribs = [c for c in self.contrib if c is not None]
        if self.guard is not None:
            self.guard.screen(self.group.fragment, self.member, contribs)
            acc = self.guard.aggregate(contribs, self.private)
        else:
            acc = mean_of(contribs, self.private)
        encoded = self.codec.encode_frame(acc)
        own = acc if self.codec.lossless else self.codec.decode(bytes(encoded), acc.numel())
        self._place(self.me, own)
        return encoded, own

    async def serve(
        self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str
    ) -> AsyncIterator[pb.TensorMessage]:
        """Server side of one Reduce stream (whose header the service already verified as `sender`'s): take the
        member's contribution, then reply with the averaged shard."""
        t_first = time.perf_counter()  # the service read the header just before calling us
        rx = await read_tensor(messages, verifier, self._max_wire_async, verified_sender=sender)
        if rx.header.round_id != self.group.round_id:
            raise StreamError("wrong_round", "contribution names another round")
        # C4-style timing: how fast this member's stream moved (its uplink, or the path to us)
        self.stream_s[rx.sender] = (time.perf_counter() - t_first, len(rx.payload))
        try:
            await self.add_contribution(rx.sender, rx.payload)
        except CodecError as exc:  # a member's frame does not decode: the round cannot complete with it
            raise StreamError("malformed", f"contribution does not decode: {exc}", sender=rx.sender) from exc
        remaining = self.deadline - time.monotonic()
        encoded, _ = await asyncio.wait_for(asyncio.shield(self.reduced), max(remaining, 0.01))
        header = pb.TensorHeader(
            round_id=self.group.round_id,
            shard=self.me,
            numel=self.shard_numel(self.me),
            codec=codec_to_wire(self.codec.name),
            included=self.ids,
            kind=kind_to_wire("gather"),
        )
        self.stats.wire_bytes += len(encoded)
        self.stats.raw_bytes += 4 * self.shard_numel(self.me)
        for msg in tensor_messages(header, encoded, self.identity, self.run_id, self.chunk_bytes):
            yield msg

    async def _max_wire_async(self, sender: str, header: pb.TensorHeader) -> int:
        return self.max_wire(sender, header)

    def abort(self, exc: BaseException) -> None:
        if not self.reduced.done():
            self.reduced.set_exception(exc)
            self.reduced.exception()  # mark retrieved: waiters see it, asyncio does not log it

    def _on_deadline(self) -> None:
        missing = {self.ids[i] for i, c in enumerate(self.contrib) if c is None}
        self.abort(RoundFailed(f"round timed out waiting for {sorted(p[:8] for p in missing)}", missing, "timeout"))

    # -- member side ------------------------------------------------------------------------------------------
    async def run(self, stub_for: StubFor, verifier: Verifier) -> RoundResult:
        if not self.owners:  # a failed round like any other, so the caller retries with a new group
            self._deadline_handle.cancel()
            raise RoundFailed("no reachable peer in the group: nobody can own a shard", set(), "no_reachable")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        try:
            payloads = await loop.run_in_executor(self.executor, self._encode_all)
            if self.me >= 0:
                await self._add_own(payloads[self.me])
            tasks = {
                j: asyncio.ensure_future(self._exchange(j, payloads[j], stub_for, verifier))
                for j in range(self.n_shards)
                if j != self.me
            }
            remaining = max(self.deadline - time.monotonic(), 0.01)
            results: dict[int, torch.Tensor] = {}
            waiting: dict[asyncio.Future, int] = {t: j for j, t in tasks.items()}
            own_wait: asyncio.Future | None = None
            if self.me >= 0:  # an outbound-only member owns no shard: nothing to reduce here
                own_wait = asyncio.ensure_future(asyncio.shield(self.reduced))
                waiting[own_wait] = self.me
            try:
                # Fail as soon as any part fails (not when the parts before it in member order are done), so a
                # failure anywhere in the group reaches every member in one round trip.
                done, pending = await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
                failed = [f.exception() for f in done if not f.cancelled() and f.exception() is not None]
                if failed:
                    raise next((e for e in failed if isinstance(e, RoundFailed) and e.suspects), failed[0])
                if pending:
                    raise TimeoutError
                for fut, j in waiting.items():
                    results[j] = fut.result()[1] if j == self.me else fut.result()
            except BaseException as exc:
                if own_wait is not None:
                    own_wait.cancel()
                for task in tasks.values():
                    task.cancel()
                self.abort(exc if isinstance(exc, RoundFailed) else RoundFailed(str(exc)))
                raise self._as_failure(exc, tasks) from exc
        finally:
            self._deadline_handle.cancel()
        if self.guard is not None:  # the same verdict on every member: it depends only on bytes they all received
            bad = [
                self.owners[j] for j in self.guard.screen_replies(self.me, [results[j] for j in range(self.n_shards)])
            ]
            for i in bad:
                self._invalid(self.ids[i], "too_large")
            if bad:
                names = sorted(self.ids[i][:8] for i in bad)
                raise RoundFailed(f"averaged shards from {names} are far larger than the others'",
                                  {self.ids[i] for i in bad}, "rejected")  # fmt: skip
        assert self.average is not None  # every shard was placed by whoever produced it
        self.stats.seconds = time.perf_counter() - t0
        return RoundResult(self.average, self.group, list(self.ids), self.stats, self.sent_decoded)

    def _place(self, j: int, shard: torch.Tensor) -> None:
        """Copy averaged shard j into the result as soon as it is known (in the executor, overlapping the waits
        for the other shards) rather than assembling all of them at the end."""
        assert self.average is not None
        lo, hi = self.bounds[j]
        self.average[lo:hi] = shard

    def _encode_all(self) -> list[bytes | SealedFrame | torch.Tensor]:
        """One frame per other member; for ourselves a frame, or with a lossless codec our part of the vector itself
        (encoding it only to decode it again would cost two copies of the shard)."""
        self.average = torch.empty(self.vector.numel(), dtype=torch.float32)
        parts = [self.vector[lo:hi] for lo, hi in self.bounds]
        bad = [faults.poisoned(part) for part in parts]  # a test-only injector: each part itself unless enabled
        if any(b is not part for b, part in zip(bad, parts, strict=True)):
            self.sent_decoded = None
            if self.me >= 0 and not bool(torch.isfinite(bad[self.me]).all()):
                bad[self.me] = parts[self.me]  # a NaN frame would not decode for us either
            return [faults.forge_frame(self.codec, b.contiguous()) for b in bad]
        out: list[bytes | SealedFrame | torch.Tensor] = []
        for j, part in enumerate(parts):
            if j == self.me and self.codec.lossless:
                own = check_input(part.cpu())
                finite_or_raise(own, "input tensor")  # the refusal encoding it would have made
                out.append(own)
            else:
                out.append(self.codec.encode_frame(part.contiguous()))
        # What our contribution decodes to, for error feedback (a lossless codec's: the vector itself).
        self.sent_decoded = None
        if self.want_decoded and self.codec.lossless:
            self.sent_decoded = self.vector.detach().float().cpu()
        elif self.want_decoded:
            self.sent_decoded = torch.cat(
                [self.codec.decode(bytes(f), hi - lo) for f, (lo, hi) in zip(out, self.bounds, strict=True)]
            )
        return [f if j == self.me else faults.corrupt(f) for j, f in enumerate(out)]

    async def _add_own(self, payload: bytes | SealedFrame | torch.Tensor) -> None:
        if isinstance(payload, torch.Tensor):
            self.private[self.member] = False  # the caller's memory: never summed into
            await self._accept(self.member, payload)
        else:
            await self.add_contribution(self.identity.peer_id, bytes(payload))

    async def _exchange(
        self, j: int, payload: bytes | SealedFrame, stub_for: StubFor, verifier: Verifier
    ) -> torch.Tensor:
        member = self.group.members[self.owners[j]]
        header = pb.TensorHeader(
            round_id=self.group.round_id,
            shard=j,
            numel=self.shard_numel(j),
            codec=codec_to_wire(self.codec.name),
            kind=kind_to_wire("reduce"),
        )
        self.stats.wire_bytes += len(payload)
        self.stats.raw_bytes += 4 * self.shard_numel(j)
        stub = stub_for(member)
        remaining = max(self.deadline - time.monotonic(), 0.01)
        call = stub.Reduce(  # type: ignore[attr-defined]
            tensor_messages(header, payload, self.identity, self.run_id, self.chunk_bytes), timeout=remaining
        )
        first: list[float] = []

        async def timed(messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
            async for msg in messages:
                first.append(first[0] if first else time.perf_counter())
                yield msg

        try:
            rx = await read_tensor(timed(call.__aiter__()), verifier, self.codec.max_encoded_size(self.shard_numel(j)))
            if first:  # C4-style timing: how fast this owner's averaged shard streamed back to us, and how late
                self.stream_s.setdefault(member.peer_id, (time.perf_counter() - first[0], len(rx.payload)))
            self.reply_s[member.peer_id] = time.perf_counter() - self.created
        except StreamError as exc:
            if exc.sender == member.peer_id:
                self._invalid(member.peer_id, exc.reason)
            raise RoundFailed(f"reply from {member.peer_id[:8]} refused: {exc}", {member.peer_id}, "malformed") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                others = set(self.ids) - {member.peer_id, self.identity.peer_id}
                named = relayed_suspects(exc.trailing_metadata(), others)
                raise RoundFailed(f"{member.peer_id[:8]} aborted the round: {exc.details()}", named) from exc
            raise RoundFailed(
                f"exchange with {member.peer_id[:8]} failed: {exc.code().name} {exc.details()}",
                {member.peer_id},
                "peer_lost",
            ) from exc
        finally:
            call.cancel()
        if rx.sender != member.peer_id or rx.header.shard != j or rx.header.round_id != self.group.round_id:
            raise RoundFailed(
                f"reply from {member.peer_id[:8]} does not match the round", {member.peer_id}, "malformed"
            )
        if list(rx.header.included) != self.ids:
            raise RoundFailed(f"{member.peer_id[:8]} averaged a different set of peers", {member.peer_id})
        self.stats.received_wire_bytes += len(rx.payload)
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.run_in_executor(self.executor, self._decode_reply, j, rx.payload)
        except CodecError as exc:
            self._invalid(member.peer_id, "nan" if "NaN" in str(exc) else "malformed")
            raise RoundFailed(f"{member.peer_id[:8]} sent an undecodable average: {exc}", {member.peer_id}) from exc
        return reply

    def _decode_reply(self, j: int, payload: bytearray) -> torch.Tensor:
        reply = self.codec.decode(payload, self.shard_numel(j))
        self._place(j, reply)
        return reply

    def _as_failure(self, exc: BaseException, tasks: dict[int, asyncio.Future]) -> RoundFailed:
        if isinstance(exc, RoundFailed):
            return exc
        for task in tasks.values():
            if task.done() and not task.cancelled() and isinstance(task.exception(), RoundFailed):
                return task.exception()  # type: ignore[return-value]
        if isinstance(exc, asyncio.TimeoutError):
            missing = {self.ids[i] for i, c in enumerate(self.contrib) if c is None}
            return RoundFailed("round timed out", missing, "timeout")
        return RoundFailed(f"round failed: {exc!r}")
