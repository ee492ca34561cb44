"""Fallback owners: who reduces a shard once its owner is lost, and how one shard never completes twice.

A member whose exchange with a shard's owner failed sends that shard to the next owner in member order it has not
seen lost (`_line`). The asked peer takes it over only when its own evidence (this round's, or its gossip view's) has
every owner between the lost one and itself gone (`owner_for`), so members whose views differ fail the round rather
than split it. A fallback that can get the owner's own average serves that instead of averaging anew: its own copy
as a member, a copy a member relays when it sees the owner gone, or one it pulls from the members it waits for
(shard_relay.py). This is the part of a round (allreduce.ReduceRound) that runs on other members' word; the rest of
ReduceRound is the ordinary reduce-scatter and all-gather.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine

import grpc
import torch

from peerd.codecs import Codec
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.roundtypes import RoundFailed, refuses
from peerd.shard_owner import RoundContext, ShardOwner
from peerd.shard_relay import HeldShard, pull_request, pull_until_reduced, read_relay, relay_stream
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

FALLBACK_GRACE_S = 10.0
"""How long a peer asked to take over a shard waits for its own view to agree that every owner before it in line is
lost (its own exchanges with them fail a moment after the asker's did: seconds later on a starved event loop, as with
64 daemons on 2 cores), before it refuses."""

PROBE_TIMEOUT_S = 3.0  # a probe of an owner between the lost one and us (`_probe`)

StubFor = Callable[[pb.PeerInfo], object]  # returns a RoundsStub for a member


class Takeover:
    """The fallback-owner half of allreduce.ReduceRound, which sets every attribute below."""

    group: pb.Group
    identity: Identity
    run_id: bytes
    codec: Codec
    chunk_bytes: int
    ids: list[str]
    n: int
    member: int
    owners: list[int]
    n_shards: int
    parts: list[list[tuple[int, int]]]
    deadline: float
    ctx: RoundContext
    owned: dict[int, ShardOwner]
    held: dict[int, HeldShard]
    lost: set[str]
    left: set[str]
    reply_sumsq: list[list[float]]
    average: torch.Tensor | None
    seen_gone: Callable[[str], bool] | None
    on_unreachable: Callable[[str, str], None] | None
    _probed: dict[str, str]  # owners we probed in this round, and what the probe found so far (`_probe`)
    _probed_gone: set[str]  # those whose process did not answer for it
    _said: set[int]
    _relayed: set[int]
    _tasks: set[asyncio.Future]
    _stub_for: StubFor | None
    _verifier: Verifier | None
    _done: bool
    _failed: BaseException | None
    refused: dict[str, str]  # member -> why our own checks refused its data in this round (ReduceRound.abort)
    me: int
    _poisoning: bool
    _aborted: BaseException | None

    def member_left(self, peer_id: str) -> None:
        """Stop waiting for `peer_id` in every shard we reduce (allreduce.ReduceRound defines it)."""
        raise NotImplementedError

    async def _adopt_relay(
        self, messages: AsyncIterator[pb.TensorMessage], verifier: Verifier, sender: str, shard: int
    ) -> None:
        if sender not in self.ids or not 0 <= shard < self.n_shards:
            raise StreamError("not_member", f"{sender[:8]} relayed shard {shard} of a round it is not in")
        known = self.owned.get(shard)
        if known is not None and known.reduced.done():
            return  # it reached us already (we held it, or another member relayed it first): skip the copy
        held = await read_relay(
            messages, verifier, sender, round_id=self.group.round_id, shard=shard, parts=self.parts[shard],
            codec=self.codec, n=self.n, sources=self._line_before(shard),
        )  # fmt: skip
        owner = await self.wait_owner(shard, held.source)
        if (self.average is not None or self._done) and await owner.adopt(held.frames(), held.source):
            log.debug("shard %d of a lost owner reached us through %s", shard, sender[:8])
            if not self._done:  # members of this round wait for it (after completion: only if one asks)
                self._say_relayed(shard, held.source)

    def _say_relayed(self, shard: int, source: str) -> None:
        if shard not in self._said:  # once per shard: every member that missed it comes here
            self._said.add(shard)
            log.info("shard %d of a lost owner: serving %s's own average to the members that missed it", shard,
                     source[:8])  # fmt: skip

    def _line(self, shard: int) -> list[int]:
        """Who reduces `shard`, in order: its owner, then the owners after it in member order (the fallbacks)."""
        return [self.owners[(shard + step) % self.n_shards] for step in range(self.n_shards)]

    def _line_before(self, shard: int) -> list[str]:
        """Who may have averaged `shard` before us: its owner, then the owners after it in member order up to us."""
        line = self._line(shard)
        if self.member not in line:
            return []  # we own no shard: nothing is ever relayed to us
        return [self.ids[i] for i in line[: line.index(self.member)]]

    def owner_for(self, shard: int, sender: str) -> ShardOwner:
        """Our owner side of `shard`: our own, or a lost owner's shard when we are next in line for it."""
        owner = self.owned.get(shard)
        if owner is not None:
            return owner
        if sender not in self.ids or sender == self.identity.peer_id:
            raise StreamError("not_member", f"{sender[:8]} is not a member of this round")
        if not 0 <= shard < self.n_shards:
            raise StreamError("wrong_shape", f"contribution for shard {shard} of a round with {self.n_shards}")
        # A round aborted here failed everyone's (bad data, the deadline): nothing to take over. One that failed only
        # here (self._failed alone) keeps serving what we reduce, a lost owner's shard too: refusing it failed the
        # round of every member sent to us, and they refused in turn (seen at 64 peers under churn).
        self.say_if_refused(sender)
        if self._aborted is not None:
            raise RoundFailed(f"this peer's round failed: {self._aborted}", set(), "aborted")
        # The asker's word stands for the owner itself; for the owners between it and us, our own evidence: this
        # round's (our exchange with one failed) or our gossip view's. The latter matters at scale: a peer killed
        # after its exchange with us completed is lost to this round only once it has been silent for twice the
        # peer timeout (30 s), while our own dials and gossip see it gone in seconds, or see its new process.
        gone = {self.ids[self.owners[shard]]} | self._probed_gone
        if self.seen_gone is not None:
            gone |= {p for p in self._line_before(shard) if self.seen_gone(p)}
        if self._next_in_line(shard, gone) != self.member:
            why = f"it has not seen the owners lost{self._probes(shard)}"
            raise RoundFailed(f"this peer is not next in line for shard {shard} ({why})")
        return self._take_over(shard)

    async def wait_owner(self, shard: int, sender: str) -> ShardOwner:
        """`owner_for`, giving our own view up to FALLBACK_GRACE_S to see the owners before us lost, as the asker
        did a moment earlier."""
        until = min(time.monotonic() + FALLBACK_GRACE_S, self.deadline)
        while True:
            try:
                return self.owner_for(shard, sender)
            except RoundFailed:
                if time.monotonic() >= until or self._aborted is not None:
                    raise
                self._probe_between(shard)
            await asyncio.sleep(0.05)

    def _probe_between(self, shard: int) -> None:
        """Dial, once per round, each owner between `shard`'s and us that our views still hold alive: the asker saw
        it lost, and our gossip may take 15-30 s to (64 peers under churn: 89 refused takeovers in one run)."""
        for pid in self._line_before(shard)[1:]:
            if pid in self._probed or pid in self.lost or (self.seen_gone is not None and self.seen_gone(pid)):
                continue
            self._probed[pid] = "no answer yet"
            self._spawn(self._probe(shard, pid))

    def _probes(self, shard: int) -> str:
        """What our probes of the owners between `shard`'s and us found, for a refusal: it tells a starved owner (an
        answer, a slow one) from a fallback that could not probe at all (its own round had not begun)."""
        found = [f"{pid[:8]} {self._probed[pid]}" for pid in self._line_before(shard)[1:] if pid in self._probed]
        return f"; probed: {', '.join(found)}" if found else ""

    async def _probe(self, shard: int, pid: str) -> None:
        """A PULL for `shard` addressed to `pid`'s process in this round, its answer ignored: refused or reset (the
        process is dead) or NOT_FOUND (a new one took its id) is our own evidence that it is gone. A slow answer
        is none: a starved owner is alive, and taking its shard over would leave two fallbacks waiting on each other."""
        if self._stub_for is None:
            return
        member, call = self._pull_call(self._stub_for, shard, pid, PROBE_TIMEOUT_S)
        t0 = time.monotonic()
        try:
            async for _ in call:
                pass
            self._probed[pid] = f"answered in {time.monotonic() - t0:.1f} s"
        except grpc.aio.AioRpcError as exc:
            self._probed[pid] = f"{exc.code().name} after {time.monotonic() - t0:.1f} s"
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND):
                self._probed_gone.add(pid)
                log.info("shard %d: %s, before us in line, is gone (%s): taking the shard over",
                         shard, pid[:8], exc.code().name)  # fmt: skip
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self.on_unreachable is not None:
                    self.on_unreachable(pid, member.address)
        finally:
            call.cancel()

    def _take_over(self, shard: int) -> ShardOwner:
        left = {self.owners[shard]} | {self.ids.index(p) for p in self.lost | self.left}
        owner = ShardOwner(self.ctx, shard, self.parts[shard], set(range(self.n)) - left, leave_out_silent=False)
        self.owned[shard] = owner
        held = self.held.get(shard)
        if held is not None and held.source in self._line_before(shard):  # we have its average: serve that
            owner.adopt_known(held.frames(), self.reply_sumsq[shard], held.source)
            if not self._done:
                self._say_relayed(shard, held.source)
        else:  # members that finished with a live owner hold its average and will never come: ask them for it
            self._spawn(self._pull(shard, owner))
        return owner

    async def _pull(self, shard: int, owner: ShardOwner) -> None:
        source = await pull_until_reduced(owner, lambda pid: self._pull_from(shard, pid), self.deadline, 1.0)
        if source is not None:
            log.info("shard %d: members that finished with %s hold its average: serving that", shard, source[:8])
            self._said.add(shard)

    async def _pull_from(self, shard: int, pid: str) -> HeldShard | None:
        """`pid`'s copy of `shard`'s average, signed by an owner before us in line; None if it holds none."""
        if self._stub_for is None or self._verifier is None:
            return None  # our own run() has not begun: nobody to dial with yet
        _, call = self._pull_call(self._stub_for, shard, pid, FALLBACK_GRACE_S)
        try:
            return await read_relay(
                call.__aiter__(), self._verifier, pid, round_id=self.group.round_id, shard=shard,
                parts=self.parts[shard], codec=self.codec, n=self.n, sources=self._line_before(shard), own_first=False,
            )  # fmt: skip
        except (grpc.aio.AioRpcError, StreamError) as exc:  # it holds none ("truncated"), or is gone: ask others
            log.debug("pulling shard %d from %s: %s", shard, pid[:8], exc)
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.ABORTED:
                # Its round failed and it retries without us: its contribution will never come. Waiting for it held
                # a fallback whose every other owner had aborted (bad data) until they left the run (tests, loaded).
                log.info("shard %d: %s's round failed there (%s): leaving it out", shard, pid[:8], exc.details())
                self.member_left(pid)
            return None
        finally:
            call.cancel()

    def say_if_refused(self, sender: str) -> None:
        """Answer a member whose data our own checks refused in this round with a failure naming it, as the owner
        that refused it did: it sits the step out instead of reducing the shards itself (see `refused_by`)."""
        why = self.refused.get(sender)
        if why is not None:
            raise RoundFailed(f"this peer's round failed on {sender[:8]}'s data: {self._failed}", {sender}, why)

    async def refused_by(self, timeout: float = PROBE_TIMEOUT_S) -> list[str]:
        """The members we lost whose own checks refused our contribution, by their word: each is asked, as a PULL,
        and one whose round failed on our data answers ABORTED naming us (allreduce.ReduceRound.serve). An owner's
        refusal can reach us as its stream ending while we still wrote (grpc then reports its own failed write, not
        the owner's status): we took every owner for lost and completed a round of ourselves alone (CI stop 57). A
        member that died answers nothing, and we retry as before."""
        others = [p for p in self.lost | self.left if p != self.identity.peer_id]
        if self._stub_for is None or self._poisoning or not others:  # an injected poisoner plays an attacker: retry
            return []
        shard = max(self.me, 0)
        stub_for = self._stub_for

        async def ask(pid: str) -> bool:
            _, call = self._pull_call(stub_for, shard, pid, timeout)
            try:
                async for _ in call:  # type: ignore[attr-defined]
                    return False  # it holds that shard's average: no refusal, and we need none of its bytes
            except grpc.aio.AioRpcError as exc:
                said = exc.trailing_metadata() if exc.code() == grpc.StatusCode.ABORTED else None
                return refuses(said, self.identity.peer_id, set(self.ids) - {pid})
            finally:
                call.cancel()  # type: ignore[attr-defined]
            return False

        answers = await asyncio.gather(*(ask(p) for p in others), return_exceptions=True)
        return [p for p, said in zip(others, answers, strict=True) if said is True]

    def _pull_call(self, stub_for: StubFor, shard: int, pid: str, timeout: float) -> tuple[pb.PeerInfo, object]:
        """A PULL for `shard` addressed to `pid`'s process in this round: the member, and the open call."""
        member = self.group.members[self.ids.index(pid)]
        msgs = pull_request(self.group.round_id, shard, self.identity, self.run_id, self.chunk_bytes,
                            member.incarnation)  # fmt: skip
        return member, stub_for(member).Reduce(msgs, timeout=timeout)  # type: ignore[attr-defined]

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Run `coro` alongside the round, held in `_tasks` until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_in_line(self, shard: int, also_lost: set[str] | None = None) -> int | None:
        """The member that reduces `shard`: its owner, or else the next owner in member order not seen lost."""
        lost = self.lost | (also_lost or set())
        return next((i for i in self._line(shard) if self.ids[i] not in lost), None)

    def source_gone(self, peer_id: str) -> None:
        """`peer_id` looks gone: relay every shard we hold from it to whoever is next in line for that shard, in case
        it died before every member had it (shard_relay.py). Harmless when it did not: nobody asks the fallback."""
        for j, held in self.held.items():
            if held.source != peer_id or j in self._relayed or self._stub_for is None:
                continue
            self._relayed.add(j)
            nxt = self._next_in_line(j, {peer_id})
            if nxt is not None and nxt != self.member:  # ourselves: _take_over serves what we hold when asked
                self._spawn(self._relay(j, self.group.members[nxt], self._stub_for))

    async def _relay(self, j: int, to: pb.PeerInfo, stub_for: StubFor) -> None:
        msgs = relay_stream(
            self.held[j], self.group.round_id, j, self.identity, self.run_id, self.chunk_bytes, to.incarnation
        )
        call = stub_for(to).Reduce(msgs, timeout=FALLBACK_GRACE_S + 5.0)  # type: ignore[attr-defined]
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:  # it may not need it (every member had the shard): nothing to do
            log.debug("relaying shard %d to %s: %s", j, to.peer_id[:8], exc.code().name)
