"""Bandwidth-optimal averaging of one flat fp32 vector across a round's group: reduce-scatter, then all-gather.

The vector is cut into one contiguous shard per reachable member (the owners, in member order; outbound-only members,
which nobody can dial, own none). Owner i owns shard i: every other member streams its encoded shard i to it over a
stream the sender opens, and the owner (shard_owner.py) decodes all contributions, sums them in fp32 in member order,
divides, encodes the average once, and streams those same bytes back to every member on the same gRPC stream. Each
peer therefore sends and receives (n-1)/n of the vector twice, nothing is funnelled through one peer, and because
every member (the owner included) decodes the *same bytes* of each averaged shard, all members end bit-identical.

Shards travel in parts of at most the group's part size (256 KiB; less on slow links: peerd/layout.py) of encoded data,
cut on the codec's blocks so each part is a frame of its own. The owner averages part k as soon as every member's part
k arrived and sends it back while later parts still arrive, so the gather direction is busy from the first part on.

A member's death does not restart the round (with n peers that each fail with probability p, an all-or-nothing round
succeeds with probability (1-p)^n: 0.53 at 64 peers and 1 %). The round goes on without it:
- its contributions: every owner drops it (its stream broke, our own exchange with it failed, or another owner's
  average left it out), and the parts not yet averaged average the others; each averaged part's signed header names
  whom it covers (`included_mask`);
- its shard: every member that loses it (the owner's stream fails with UNAVAILABLE, ends while we still send, or the
  owner falls silent) sends that shard instead to the next owner in member order that it has not seen lost (the
  fallback owner), which reduces it over the members still in the round. A fallback refuses a shard it is not next
  in line for, and waits for every member it has not seen lost, so members whose views differ fail the round (and
  retry) rather than split it.
- an owner that dies after some members got its whole shard and before others did: those that have it relay its own
  signed parts to the fallback, which serves them instead of averaging anew (shard_relay.py), so the round does not
  end with two versions of the shard.
Every member decodes the same bytes with the same masks, so members stay bit-identical and agree on whom the round
included (the intersection of the masks); a round that lost someone is partial, and says so. Bad data still fails the
round on every member (owners abort the streams they serve, naming whom they blame), and the caller retries the step
with a group that leaves the offender out. A round never averages a subset silently. A member whose round fails for
any other reason (a refused fallback, an owner that timed out) fails alone: the shards it reduces keep serving the
others until the deadline (roundtypes.SHARED_FAILURES), it still takes over a lost owner's shard when next in line,
and it downloads the state the others reach.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
import torch

from peerd import faults
from peerd.channels import dial_failure, end_call
from peerd.codecs import Codec, CodecError, hostmem
from peerd.codecs.base import check_input, finite_or_raise
from peerd.codecs.frame import SealedFrame
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.layout import PART_BYTES, mask_members, part_bounds, part_elems, shard_bounds
from peerd.robust import ContributionGuard
from peerd.roundtypes import (
    REFUSED_REASONS,
    ContributionRefused,
    OwnerLost,
    StreamLate,
    own_evidence,
    part_messages,
    refused_stream,
    refuses,
    rms,
    shared,
    sum_of_squares,
)
from peerd.roundtypes import SUSPECTS_KEY as SUSPECTS_KEY
from peerd.roundtypes import RoundFailed as RoundFailed
from peerd.roundtypes import RoundStats as RoundStats
from peerd.roundtypes import relayed_suspects as relayed_suspects
from peerd.roundtypes import suspects_metadata as suspects_metadata
from peerd.shard_owner import RoundContext, ShardOwner
from peerd.shard_relay import HeldShard, pull_reply
from peerd.streams import ReceivedTensor, StreamError, read_tensor
from peerd.takeover import StubFor, Takeover
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_to_wire, kind_to_wire

log = logging.getLogger("peerd")

BLAME_GRACE_S = 0.5


@dataclass
class RoundResult:
    average: torch.Tensor  # CPU fp32, same numel as the input
    group: pb.Group
    included: list[str]  # members whose contributions every averaged part covers
    stats: RoundStats = field(default_factory=RoundStats)
    sent_decoded: torch.Tensor | None = None  # what our contribution decodes to (for error feedback), if asked
    lost: list[str] = field(default_factory=list)  # members that left mid-round (dropped, not waited for)
    fallbacks: int = 0  # shards we took from a fallback owner because theirs was lost
    carried: list[str] = field(default_factory=list)  # sponsored peers whose work an included member carried
    join_offset_s: float = 0.0  # how much later than the group's median we joined (peerd/timings.join_offset_s)

    @property
    def partial(self) -> bool:
        return len(self.included) < len(self.group.expected)


class ReduceRound(Takeover):
    """This peer's part in one group's reduce-scatter + all-gather: its contributions to every shard (member side)
    and the shards it owns (shard_owner.py), its own and those it took over from a lost owner."""

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
        weights: list[float] | None = None,
        on_unreachable: Callable[[str, str, str], None] | None = None,
        seen_gone: Callable[[str], bool] | None = None,
    ) -> None:
        """`guard` checks contributions and replies and picks the aggregation rule (peerd/robust.py); `on_invalid`
        (peer id, reason) hears of every member whose signed data it refused. `part_bytes` bounds one part's frame.
        `weights`: each member's token weight, when the group is weighted (a subset's mean is re-weighted);
        `on_unreachable` (peer id, address, "refused" or "no_answer") hears of an owner whose dial failed mid-round
        (membership marks it; peerd/pairblocks.py tells the two apart).
        `seen_gone(peer id)`: our own evidence, outside this round, that a member's process in it is gone (not live in
        our gossip view, or restarted since the group formed), which a takeover may rely on (`owner_for`)."""
        self.on_unreachable = on_unreachable
        self.seen_gone = seen_gone
        self.want_decoded = want_decoded
        self.guard = guard
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
        # Shard owners: the members others can dial. Outbound-only members cannot be dialled, and flagged ones
        # (group.no_shards) would slow every shard they own.
        no_shards = set(group.no_shards)
        self.owners = [i for i, m in enumerate(group.members) if not m.outbound_only and m.peer_id not in no_shards]
        self.me = self.owners.index(self.member) if self.member in self.owners else -1  # our shard, -1: none
        self.n_shards = len(self.owners)
        self.bounds = shard_bounds(vector.numel(), self.n_shards) if self.owners else []
        size = part_elems(codec, part_bytes)
        self.parts = [part_bounds(lo, hi, size) for lo, hi in self.bounds]  # absolute [lo, hi) of every part
        self.deadline = time.monotonic() + timeout_s
        self.stats = RoundStats()
        self.ctx = RoundContext(
            group, self.ids, self.member, identity, run_id, codec, executor, chunk_bytes, guard, on_invalid,
            self._result, self.member_left, self.stats, self.deadline, weights,
        )  # fmt: skip
        self.created = self.ctx.created
        self.arrival_s = self.ctx.arrival_s  # member -> seconds after this round began that its contribution arrived
        self.stream_s = self.ctx.stream_s  # member -> (seconds its contribution stream took, bytes)
        self.reply_s: dict[str, float] = {}  # owner -> seconds after this round began that its averaged shard arrived
        self.reply_stream_s: dict[str, tuple[float, int]] = {}  # owner -> (seconds its averaged parts took, bytes)
        self.owned: dict[int, ShardOwner] = {}  # shard -> our owner side: ours, and any we took over
        if self.me >= 0:
            self.owned[self.me] = ShardOwner(self.ctx, self.me, self.parts[self.me], set(range(self.n)))
        self.lost: set[str] = set()  # members seen gone mid-round (refused, reset, silent): their shards move on
        self.left: set[str] = set()  # members whose streams to us broke off (dead, or their round failed)
        self.fallbacks = 0
        # every shard we received whole, as its sender signed it: relayed to the next in line if that sender is lost
        # before every member had it (shard_relay.py)
        self.held: dict[int, HeldShard] = {}
        self._relayed: set[int] = set()
        self._tasks: set[asyncio.Future] = set()
        self._stub_for: StubFor | None = None
        self._verifier: Verifier | None = None
        self._said: set[int] = set()  # shards whose relayed average we said we serve
        self._probed: dict[str, str] = {}
        self._probed_gone: set[str] = set()
        self._done = False  # completed here (finished()): we linger only to serve and relay what we hold
        self._failed: BaseException | None = None
        self.refused: dict[str, str] = {}  # member -> why our own checks refused its data in this round
        self._aborted: BaseException | None = None  # failed for every member: what we reduce ended too
        self._attempts: dict[int, tuple[str, asyncio.Future]] = {}  # shard -> (owner asked, the exchange)
        self._sent: set[tuple[int, str]] = set()  # (shard, owner) whose every part we handed to grpc
        # -- every shard (member side): whom each averaged part covers, and its squares for the replies' screening
        self.masks: list[list[set[int]]] = [[set() for _ in p] for p in self.parts]
        self.reply_sumsq: list[list[float]] = [[0.0] * len(p) for p in self.parts]
        self.average: torch.Tensor | None = None  # allocated in run(), filled part by part as averages are known
        self._decoded: torch.Tensor | None = None  # what our contribution decodes to, when asked for (lossy codecs)
        self.sent_decoded: torch.Tensor | None = None
        probe = vector[:1]
        self._poisoning = faults.poisoned(probe) is not probe  # a test-only injector is on
        self._deadline_handle = asyncio.get_running_loop().call_later(timeout_s, self._on_deadline)

    # -- owner side: the shards we reduce ---------------------------------------------------------------------
    async def serve(
        self,
        messages: AsyncIterator[pb.TensorMessage],
        verifier: Verifier,
        sender: str,
        shard: int,
        kind: str = "reduce",
    ) -> AsyncIterator[pb.TensorMessage]:
        """Server side of one Reduce stream for `shard` (the service verified its first header as `sender`'s): a
        contribution, answered with the average, or a lost owner's shard relayed to us (answered with nothing)."""
        if kind == "relay":
            await self._adopt_relay(messages, verifier, sender, shard)
            return
        if kind == "pull":  # a fallback owner asks for the shard's average: what we hold of it, or nothing
            if sender not in self.ids or not 0 <= shard < self.n_shards:
                raise StreamError("not_member", f"{sender[:8]} asked for shard {shard} of a round it is not in")
            self.say_if_refused(sender)
            held = self.held.get(shard)
            if held is None and self._failed is not None:
                # Our round failed here: we are retrying and will never contribute to that fallback, which must
                # stop waiting for us (ABORTED: Takeover._pull_from) rather than until the round's deadline.
                raise RoundFailed(f"this peer's round failed: {self._failed}", set(), "aborted")
            for msg in pull_reply(held, self.chunk_bytes):
                yield msg
            return
        owner = await self.wait_owner(shard, sender)
        if owner.relayed_from is not None:
            self._say_relayed(shard, owner.relayed_from)
        async for msg in owner.serve(messages, verifier, sender):
            yield msg

    def member_left(self, peer_id: str) -> None:
        """`peer_id`'s stream to us broke off, or another owner's averaged part left it out: every shard we reduce
        stops waiting for it. That alone does not make
        it lost as an owner: its round may have failed (bad data elsewhere), and then our own exchange with it
        brings its abort a moment later, which must fail our round too rather than send us to a fallback."""
        if peer_id == self.identity.peer_id or peer_id not in self.ids:
            return
        self.left.add(peer_id)
        index = self.ids.index(peer_id)
        for owner in self.owned.values():
            owner.drop(index)

    def member_lost(self, peer_id: str) -> None:
        """`peer_id` is gone (our exchange with it failed with UNAVAILABLE, or it fell silent in gossip): every
        shard we reduce stops waiting for it, and an exchange with it moves on to the next in line."""
        if peer_id in self.lost or peer_id == self.identity.peer_id or peer_id not in self.ids:
            return
        self.lost.add(peer_id)
        self.member_left(peer_id)
        for target, attempt in self._attempts.values():
            if target == peer_id and not attempt.done():
                attempt.cancel()
        self.source_gone(peer_id)

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def open_to(self, peer_id: str) -> bool:
        """In flight here, with `peer_id` still counted in: it could yet join (round_registry.RoundRegistry.naming)."""
        return not self._done and not self.failed and peer_id in self.ids and peer_id not in self.lost | self.left

    def finished(self) -> None:
        """The round completed here: drop what only contributing needed; what we hold stays for relays. The result
        is the caller's now: a shard relayed to us later is decoded (to check it) into scratch, never into it, and
        its buffer goes back to the pool once the caller lets go (hostmem.RESULTS)."""
        self._done = True
        self.vector = self.vector.new_empty(0)
        self._decoded = None
        self.average = None

    def abort(self, exc: BaseException) -> None:
        self._failed = self._failed or exc
        self._aborted = self._aborted or exc
        if isinstance(exc, RoundFailed) and exc.reason in REFUSED_REASONS:  # our own checks: kept for pulls
            self.refused.update(dict.fromkeys(exc.suspects - self.refused.keys(), exc.reason))
        for owner in list(self.owned.values()):
            owner.abort(exc)

    def _on_deadline(self) -> None:
        missing = set().union(*(o.missing() for o in self.owned.values())) if self.owned else set()
        self.abort(RoundFailed(f"round timed out waiting for {sorted(p[:8] for p in missing)}", missing, "timeout"))

    # -- member side ------------------------------------------------------------------------------------------
    async def run(self, stub_for: StubFor, verifier: Verifier) -> RoundResult:
        if not self.owners:  # a failed round like any other, so the caller retries with a new group
            self._deadline_handle.cancel()
            raise RoundFailed("no reachable peer in the group: nobody can own a shard", set(), "no_reachable")
        t0 = time.perf_counter()
        self._stub_for = stub_for
        self._verifier = verifier
        loop = asyncio.get_running_loop()
        tasks: dict[int, asyncio.Future] = {}
        try:
            await loop.run_in_executor(self.executor, self._prepare)
            tasks = {j: asyncio.ensure_future(self._obtain(j, stub_for, verifier)) for j in range(self.n_shards)}
            remaining = max(self.deadline - time.monotonic(), 0.01)
            # Fail as soon as any shard fails (not when the shards before it are done), so a failure anywhere in
            # the group reaches every member in one round trip.
            done, pending = await asyncio.wait(tasks.values(), timeout=remaining, return_when=asyncio.FIRST_EXCEPTION)
            failed = [f.exception() for f in done if not f.cancelled() and f.exception() is not None]
            if failed and pending and not any(own_evidence(e) for e in failed):
                # Another member's abort names whom *it* blames (a hostile owner may name an honest peer): our own
                # evidence, a moment later, is worth waiting for, so that every honest member leaves the same peer
                # out of the retry
                more, _ = await asyncio.wait(pending, timeout=BLAME_GRACE_S, return_when=asyncio.FIRST_EXCEPTION)
                failed += [f.exception() for f in more if not f.cancelled() and f.exception() is not None]
            if failed:
                # an owner that refused our own contribution decides our retry, whatever else failed: we sit it out
                refused = [e for e in failed if isinstance(e, ContributionRefused)]
                if refused:
                    raise refused[0]
                named = [e for e in failed if isinstance(e, RoundFailed) and e.suspects]
                raise next((e for e in named if own_evidence(e)), named[0] if named else failed[0])
            if pending:
                raise TimeoutError
        except BaseException as exc:
            failure = self._as_failure(exc, tasks)
            loud = shared(exc) and shared(failure)
            for j, task in tasks.items():
                if loud or j not in self.owned:
                    task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: our round failed
            if loud:
                self.abort(failure)
                self._deadline_handle.cancel()
            else:  # only ours failed: the shards we reduce keep serving their members (roundtypes.SHARED_FAILURES)
                self._failed = self._failed or failure
            raise failure from exc
        self._deadline_handle.cancel()
        if self.guard is not None:  # the same verdict on every member: it depends only on bytes they all received
            norms = [rms(self.reply_sumsq[j], hi - lo) for j, (lo, hi) in enumerate(self.bounds)]
            bad = [self.owners[j] for j in self.guard.screen_reply_norms(self.me, norms)]
            for i in bad:
                self.ctx.invalid(self.ids[i], "too_large")
            if bad:
                names = sorted(self.ids[i][:8] for i in bad)
                raise RoundFailed(f"averaged shards from {names} are far larger than the others'",
                                  {self.ids[i] for i in bad}, "rejected")  # fmt: skip
        assert self.average is not None  # every part was placed by whoever produced it
        self.stats.seconds = time.perf_counter() - t0
        if self.want_decoded and not self._poisoning:
            self.sent_decoded = self.vector.detach().float().cpu() if self.codec.lossless else self._decoded
        covered = set(range(self.n)).intersection(*(m for shard in self.masks for m in shard))
        included = [self.ids[i] for i in sorted(covered)]
        lost = [p for p in self.ids if p in self.lost or p not in included]
        return RoundResult(self.average, self.group, included, self.stats, self.sent_decoded, lost, self.fallbacks)

    async def _obtain(self, j: int, stub_for: StubFor, verifier: Verifier) -> None:
        """Shard j's average: from its owner, or, once that owner is lost, from the next in line (perhaps us)."""
        target = self.owners[j]
        if faults.round_fails(self.group.round_id):  # others' parts reach our shard, then ours fails, then we feed it
            await asyncio.sleep(2.0 if target == self.member else 1.0)
            if target != self.member:
                raise RoundFailed("fault injection: this member's round fails here", set(), "peer_lost")
        while True:
            if target == self.member:
                await self._reduce_here(j)
                return
            pid = self.ids[target]
            attempt = asyncio.ensure_future(self._exchange(j, target, stub_for, verifier))
            self._attempts[j] = (pid, attempt)
            try:
                await asyncio.wait({attempt})
            except asyncio.CancelledError:
                attempt.cancel()
                raise
            if not attempt.cancelled():  # cancelled: member_lost(pid) moved us on
                exc = attempt.exception()
                if exc is None:
                    return
                if isinstance(exc, StreamLate) and self.deadline - time.monotonic() > 5.0:
                    continue  # our first part was late (a starved process): send it again to the same owner
                if not isinstance(exc, OwnerLost):
                    raise exc
                self.member_lost(pid)
                if exc.suspects and self.on_unreachable is not None:  # UNAVAILABLE: a failed dial, seen now
                    # Refused or reset (the process is gone), or no connection at all: a route broken between us
                    # is the latter, and taking it for a refusal ended the pair block it was (a streaming run's
                    # pair then sat out every round, CI).
                    self.on_unreachable(pid, self.group.members[target].address, dial_failure(exc.__cause__))
            nxt = self._next_in_line(j)
            if nxt is None:
                raise RoundFailed(f"every peer that could reduce shard {j} is lost", set(self.lost), "peer_lost")
            self.fallbacks += 1
            target = nxt

    async def _reduce_here(self, j: int) -> None:
        """Shard j is ours to reduce (our own, or taken over): feed our own contribution, wait for the average."""
        owner = self.owned.get(j) or self._take_over(j)
        loop = asyncio.get_running_loop()
        for k, (lo, hi) in enumerate(self.parts[j]):
            if owner.reduced.done():
                break
            if self.codec.lossless and not self._poisoning:
                own = self.vector[lo:hi].cpu()  # the caller's memory (or a copy): never summed into
                sumsq = await loop.run_in_executor(self.executor, sum_of_squares, own)
                if owner.reduced.done():
                    break
                owner.accept(self.member, k, own, sumsq, private=False)
            elif not self._poisoning:
                own, sumsq, private = await loop.run_in_executor(self.executor, self._own_part, j, k)
                if owner.reduced.done():
                    break
                owner.accept(self.member, k, own, sumsq, private)
            else:  # an injected poisoner's forged frame goes through the owner's checks like anyone's
                payload = await loop.run_in_executor(self.executor, self._encode_part, j, k, True)
                await owner.add_contribution(self.identity.peer_id, k, bytes(payload))
        await asyncio.shield(owner.reduced)
        for k, fut in enumerate(owner.frames):
            self.masks[j][k] = mask_members(fut.result()[1], self.n) or set()
        self.reply_sumsq[j] = list(owner.reply_sumsq)

    def _prepare(self) -> None:
        """Refuse a vector no codec would send (what encoding it whole used to refuse) before any stream opens, and
        allocate the result (and, for error feedback, what our parts decode to)."""
        finite_or_raise(check_input(self.vector), "input tensor")
        self.average = hostmem.RESULTS.empty(self.vector.numel(), torch.float32)
        if self.want_decoded and not self.codec.lossless:
            self._decoded = hostmem.RESULTS.empty(self.vector.numel(), torch.float32)

    def _result(self, bounds: tuple[int, int]) -> torch.Tensor:
        """Where an averaged part goes in the result: it is decoded or copied there as soon as it is known (in the
        executor, overlapping the waits for the others) rather than assembled at the end. After `finished`: scratch."""
        if self.average is None:
            assert self._done, "a part was placed before the round allocated its result"
            return torch.empty(bounds[1] - bounds[0])
        return self.average[bounds[0] : bounds[1]]

    def _own_part(self, j: int, k: int) -> tuple[torch.Tensor, float, bool]:
        """Part k of our contribution to a shard we reduce, with a lossy codec: what its frame decodes to (the
        others average what ours would have decoded to), taken from encoding rather than by decoding the frame."""
        lo, hi = self.parts[j][k]
        private = self._decoded is None
        out = torch.empty(hi - lo) if private else self._decoded[lo:hi]  # type: ignore[index]
        self.codec.encode_frame_into(self.vector[lo:hi].contiguous(), out)
        return out, sum_of_squares(out), private

    def _encode_part(self, j: int, k: int, ours: bool = False) -> bytes | SealedFrame:
        """Our contribution's part k of shard j as a frame (in the executor, one part ahead of the stream)."""
        lo, hi = self.parts[j][k]
        x = self.vector[lo:hi]
        if self._poisoning:
            bad = faults.poisoned(x)
            if ours and not bool(torch.isfinite(bad).all()):
                bad = x  # a NaN frame would not decode for us either
            frame: bytes | SealedFrame = faults.forge_frame(self.codec, bad.contiguous())
        else:
            if self._decoded is not None:  # for error feedback
                frame = self.codec.encode_frame_into(x.contiguous(), self._decoded[lo:hi])
            else:
                frame = self.codec.encode_frame(x.contiguous())
        return frame if ours else faults.corrupt(frame, k)

    async def _send_parts(self, j: int, owner: str) -> AsyncIterator[pb.TensorMessage]:
        """Our contribution to shard j, part by part: each part is encoded while the one before it is on the wire."""
        loop = asyncio.get_running_loop()
        parts = self.parts[j]
        chain = b""
        to = self.group.members[self.ids.index(owner)].incarnation  # a restarted owner answers NOT_FOUND at once
        if faults.reduce_silent(self.group.round_id):
            await asyncio.sleep(max(self.deadline - time.monotonic(), 0.0))
            return
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
                to_incarnation=to,
            )
            msgs, chain = part_messages(
                header, payload, self.identity, self.run_id, self.chunk_bytes, chain, self.stats
            )
            for msg in msgs:
                yield msg
            faults.REDUCE_EXIT.on_chunk()
        self._sent.add((j, owner))

    async def _exchange(self, j: int, target: int, stub_for: StubFor, verifier: Verifier) -> None:
        member = self.group.members[target]
        pid = member.peer_id
        if j == 0 and target == self.owners[0] and faults.owner_looks_lost(self.group.round_id):
            raise OwnerLost(f"fault injection: {pid[:8]} looks lost to this member")
        stub = stub_for(member)
        remaining = max(self.deadline - time.monotonic(), 0.01)
        call = stub.Reduce(self._send_parts(j, pid), timeout=remaining)  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        chain = b""
        received: list[ReceivedTensor] = []
        try:
            replies = call.__aiter__()
            for k, (lo, hi) in enumerate(self.parts[j]):
                rx = await read_tensor(replies, verifier, self.codec.max_encoded_size(hi - lo), chain=chain)
                h = rx.header
                if rx.sender != pid or h.shard != j or h.part != k or h.round_id != self.group.round_id:
                    raise RoundFailed(f"reply from {pid[:8]} does not match the round", {pid}, "malformed")
                covers = mask_members(bytes(h.included_mask), self.n)
                if covers is None or (target not in covers and self.owners[j] == target):
                    raise RoundFailed(f"{pid[:8]} sent a malformed set of included peers", {pid}, "malformed")
                self.masks[j][k] = covers
                for i in set(range(self.n)) - covers:  # that owner dropped them: they left, so we stop waiting too
                    self.member_left(self.ids[i])  # (our own exchange with one may have ended before it died)
                chain = rx.digest
                received.append(rx)
                self.stats.received_wire_bytes += len(rx.payload)
                now = time.perf_counter()  # C4-style timing: how late and how fast this owner's average came back
                start, got = self.ctx.rx.get(f"reply:{pid}", (now, 0))
                self.ctx.rx[f"reply:{pid}"] = (start, got + len(rx.payload))
                self.reply_s[pid] = now - self.created
                self.reply_stream_s[pid] = (now - start, got + len(rx.payload))
                try:
                    self.reply_sumsq[j][k] = await loop.run_in_executor(
                        self.executor, self._decode_reply, (lo, hi), rx.payload
                    )
                except CodecError as exc:
                    self.ctx.invalid(pid, "nan" if "NaN" in str(exc) else "malformed")
                    raise RoundFailed(f"{pid[:8]} sent an undecodable average: {exc}", {pid}) from exc
            self.held[j] = HeldShard(pid, received)
            fallback = self.owned.get(j) if j != self.me else None
            if fallback is not None and fallback.can_adopt():  # we took it over meanwhile: serve what its owner sent
                fallback.adopt_known(self.held[j].frames(), self.reply_sumsq[j], pid)
                self._say_relayed(j, pid)
        except StreamError as exc:
            if exc.sender == pid:
                self.ctx.invalid(pid, exc.reason)
            raise RoundFailed(f"reply from {pid[:8]} refused: {exc}", {pid}, "malformed") from exc
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                metadata = exc.trailing_metadata()
                named = relayed_suspects(metadata, set(self.ids) - {pid})
                refused = refuses(metadata, self.identity.peer_id, set(self.ids) - {pid})
                if refused and not self._poisoning:  # an injected poisoner plays an attacker: it retries
                    raise ContributionRefused(f"{pid[:8]} refused our contribution: {exc.details()}") from exc
                raise RoundFailed(f"{pid[:8]} aborted the round: {exc.details()}", named) from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and faults.REFUSAL_LOOKS_LOST:
                raise OwnerLost(f"fault injection: {pid[:8]} ended the stream while we were sending") from exc
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and refused_stream(exc.trailing_metadata()):
                # The owner's checks refused the data we sent it (and aborted its round naming us): blaming it as
                # lost made the sender of a corrupt part avoid that leader and retry with the others, who were
                # retrying without it (CI: a run of test_a_corrupt_later_part_aborts_the_round_naming_its_sender)
                if not self._poisoning:
                    raise ContributionRefused(f"{pid[:8]} refused our contribution: {exc.details()}") from exc
                raise RoundFailed(f"{pid[:8]} refused our contribution: {exc.details()}", set(), "aborted") from exc
            if exc.code() == grpc.StatusCode.INTERNAL and (j, pid) not in self._sent:
                # The owner ended the stream while our parts were still going out: grpc then reports its own failed
                # write, not the owner's status. The owner died, or aborted its round. Either way its shard moves
                # on: if it aborted, its round failed and so will the fallback's (the abort reaches every member), so
                # a live owner's shard is never reduced twice; where the fallback is us and every other owner went
                # the same way, the round client fails our round of one (roundclient.py). It names nobody: an
                # aborting owner may be honest.
                raise OwnerLost(f"{pid[:8]} ended the stream while we were sending: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "sent nothing" in (exc.details() or ""):
                raise StreamLate(f"our stream to {pid[:8]} was late: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # a new process took its id, or its rendezvous settled on
                raise OwnerLost(f"{pid[:8]} is not in the round: {exc.details()}") from exc  # another round
            kind = OwnerLost if exc.code() == grpc.StatusCode.UNAVAILABLE else RoundFailed
            why = f"exchange with {pid[:8]} failed: {exc.code().name} {exc.details()}"
            raise kind(why, {pid}, "peer_lost") from exc
        finally:
            end_call(call)

    def _decode_reply(self, bounds: tuple[int, int], payload: bytearray) -> float:
        return sum_of_squares(self.codec.decode_into(payload, self._result(bounds)))

    def _as_failure(self, exc: BaseException, tasks: dict[int, asyncio.Future]) -> RoundFailed:
        if isinstance(exc, RoundFailed):
            return exc
        for task in tasks.values():
            if task.done() and not task.cancelled() and isinstance(task.exception(), RoundFailed):
                return task.exception()  # type: ignore[return-value]
        if isinstance(exc, asyncio.TimeoutError):
            missing = set().union(*(o.missing() for o in self.owned.values())) if self.owned else set()
            return RoundFailed("round timed out", missing, "timeout")
        return RoundFailed(f"round failed: {exc!r}")
