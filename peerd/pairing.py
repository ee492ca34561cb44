"""NoLoCo matchmaking and group exchange: each outer step, a peer finds a random partner and swaps tensors with it.

There is no leader and no global barrier. A peer that reaches the end of its inner steps (or, with send-ahead, the
start of them) *proposes* to a live peer drawn uniformly at random among those whose outer step is within
``max_staleness`` of its own (``Rounds.Match``); the target *accepts* when it is free and due at about the same
time. Rules that keep groups disjoint:

* A peer is in at most one group at a time, and refuses proposals while it is in one ("busy"). Nobody pairs with
  itself.
* A peer has at most one proposal outstanding, and never accepts while it has one, since that proposal could be
  accepted too. An incoming proposal from a *higher* peer id is held until the outstanding proposal resolves
  (then accepted if we are still free); one from a lower id is refused at once. When two peers propose to each
  other at the same moment, the lower id therefore refuses and then accepts the higher id's proposal: a
  deterministic tie break. Holds only ever wait on lower ids, so chains of holds cannot form a cycle.
* An acceptance is provisional until the proposer opens the exchange stream; if it never does (its RPC timed out
  after we answered, it died), the accepter drops the group after ``match_timeout`` plus a grace period.

Timing: a peer accepts only a proposer that will be ready at about the same time it will be, so nobody waits long
on a partner. Without send-ahead, proposers are at their boundary, and a peer accepts while it expects to reach its
own boundary within ``match_timeout / 2`` (the trainer tells it its inner step time). With send-ahead, proposers and
accepters are both at the start of their inner steps: a peer accepts during the first ``match_timeout`` seconds of
its inner phase, and does not look again at its boundary.

The exchange (``Rounds.Exchange``, one bidirectional stream per proposer/accepter pair) carries each member's
tensors by kind ("phi" first, then "pair"), each encoded with the run's codec and framed by ``peerd.streams``
(signed header, chunks, signed trailer). The proposer sends its own tensors, the accepter sends its own back on the
same stream, and in groups larger than two the proposer relays every other member's encoded bytes unchanged, so
all members decode the same bytes for each contribution. The two directions are independent: a peer may send its
"phi" long before its "pair" (send-ahead).

This module knows nothing of models: it moves named flat fp32 tensors and returns what each member contributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from peerd import faults
from peerd.allreduce import RoundFailed, RoundStats
from peerd.channels import connection_failed
from peerd.codecs import Codec, CodecError
from peerd.envelope import Verifier, sign
from peerd.identity import Identity
from peerd.membership import copy_peer
from peerd.shutdown import PAIR_DRAIN_S
from peerd.streams import ReceivedTensor, StreamError, prepend, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

KINDS = ("phi", "pair")  # the order each member sends its tensors in: slow weights first, so they can go ahead
HOLD_S = 1.0  # longest we hold a proposal from a higher id while our own proposal is outstanding
MATCH_RPC_S = 2 * HOLD_S + 1.0  # a Match call may be held once, plus a round trip
CONFIRM_GRACE_S = 5.0  # an accepter waits match_timeout + this for the proposer to open the exchange
BACKOFF_S = (0.01, 0.05)  # random pause after a refusal; lets proposals we hold be answered in between
RETIRE_S = 5.0  # how long a finished group stays known, so the partner can finish reading our last bytes
PACE_SLACK = 3  # peers more than max_staleness + this many steps behind are catching up (downloading state)


class PairingError(ValueError):
    """Bad arguments to the pairing layer (wrong tensor kinds, sizes or settings)."""


@dataclass(frozen=True)
class PairSettings:
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


class Transport(Protocol):
    """How a Pairing reaches other peers: gRPC in the daemon, direct calls in unit tests."""

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse: ...

    def exchange(
        self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float
    ) -> ExchangeCall: ...


class GrpcTransport:
    """The daemon's transport: `Rounds.Match` and `Rounds.Exchange` over its pooled channels."""

    def __init__(self, channels: Callable[[], Any]) -> None:
        self._channels = channels

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse:
        return await self._channels().rounds(peer.address, peer).Match(request, timeout=timeout)

    def exchange(self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float) -> ExchangeCall:
        return self._channels().rounds(peer.address, peer).Exchange(requests, timeout=timeout)


@dataclass
class PairOutcome:
    """What one outer step's exchange produced for this peer."""

    step: int
    round_id: bytes  # empty when no partner was found
    members: list[pb.PeerInfo]  # the group, proposer first; just ourselves when no partner was found
    contributions: dict[str, dict[str, torch.Tensor]]  # peer id -> kind -> tensor, for every included peer
    lost: list[str]  # members whose contribution did not arrive complete
    match_seconds: float
    stats: RoundStats
    note: str

    @property
    def expected(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def included(self) -> list[str]:
        return [m.peer_id for m in self.members if m.peer_id in self.contributions]

    @property
    def solo(self) -> bool:
        return len(self.members) == 1


class _Session:
    """One group this peer is in, for one outer step, from the proposal until every contribution settled."""

    def __init__(self, round_id: bytes, step: int, role: str, members: list[pb.PeerInfo], me: str) -> None:
        loop = asyncio.get_running_loop()
        self.round_id = round_id
        self.step = step
        self.role = role  # "proposer" (opens the streams, relays) or "accepter"
        self.members = members
        self.me = me
        self.deadline = math.inf
        self.own: dict[str, asyncio.Future[bytes]] = {k: loop.create_future() for k in KINDS}
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
            call.cancel()


class Pairing:
    """One peer's matchmaking and exchange endpoint. Every coroutine runs on the daemon's event loop; only
    `progress` is called from the training thread."""

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
        transport: Transport,
        candidates: Callable[[], Sequence[pb.PeerInfo]],
        lookup: Callable[[str], pb.PeerInfo | None],
        me: Callable[[], pb.PeerInfo],
        on_rejected: Callable[[str], None] | None = None,
        on_unreachable: Callable[[str], None] | None = None,
        note_step: Callable[[str, int], None] | None = None,
        yield_s: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if numel < 1:
            raise PairingError("numel must be positive")
        self.identity = identity
        self.my_id = identity.peer_id
        self.run_id = run_id
        self.verifier = verifier
        self.codec = codec
        self.executor = executor
        self.numel = numel
        self.settings = settings
        self.transport = transport
        self.candidates = candidates
        self.lookup = lookup
        self.me = me
        self.on_rejected = on_rejected or (lambda reason: None)
        self.on_unreachable = on_unreachable or (lambda peer_id: None)  # we could not connect: leave it out a while
        # A partner finished a step with us: noted beside its gossiped entry (which its own signature covers, so it
        # is never edited), ahead of its gossip.
        self.note_step = note_step or (lambda peer_id, step: None)
        # How long to wait at our boundary for a proposal before proposing ourselves: outbound-only peers can only
        # propose (nobody dials them), so reachable peers leave them the first move (peerd/reachability.py).
        self.yield_s = yield_s or (lambda: 0.0)
        self.rng = rng or random.Random(int.from_bytes(os.urandom(8), "little"))
        self.max_wire = codec.max_encoded_size(numel)
        self._session: _Session | None = None  # the group we are in now, if any
        self._sessions: dict[bytes, _Session] = {}  # by round id, for streams that arrive
        self._proposing: str | None = None  # target of our outstanding proposal
        self._proposal_done: asyncio.Event | None = None
        # what the trainer told us (plain attribute writes from its thread; see progress())
        self._avail_step: int | None = None
        self._eta: tuple[float, float] = (math.inf, 0.0)  # (seconds to our boundary, when that was measured)
        self._phase_s = math.inf
        self._at_boundary: dict[str, bytes] | None = None  # our encoded tensors while we are at the boundary
        self._ahead: tuple[int, bytes, float] | None = None  # send-ahead: (step, encoded phi, phase start)
        self._ahead_task: asyncio.Task | None = None
        self._ahead_stop = False  # the send-ahead window closed: propose no more (one in flight may still land)
        self._last_round = -1  # the newest step run_round was called for
        self._closing = False

    # -- what the trainer tells us -------------------------------------------------------------------------------
    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        """Called from the training thread after each inner step: we are working towards outer step `step`, due in
        about `eta_s` seconds; a whole inner phase takes about `phase_s`. Plain attribute writes, read on the loop."""
        self._eta = (eta_s, time.monotonic())
        self._phase_s = phase_s
        self._avail_step = step

    def _eta_now(self) -> float:
        eta, at = self._eta
        return max(eta - (time.monotonic() - at), 0.0)

    # -- accepting -----------------------------------------------------------------------------------------------
    async def answer(self, request: pb.MatchRequest, sender: str) -> pb.MatchResponse:
        """Answer a verified `Rounds.Match` from `sender`."""
        if sender == self.my_id:
            return _refuse("a peer does not pair with itself")
        if request.group_size != self.settings.group_size:
            return _refuse(f"group size {request.group_size} differs from this run's {self.settings.group_size}")
        proposer = self.lookup(sender)
        if proposer is None:
            return _refuse("unknown peer: join the swarm first")
        hold_until = time.monotonic() + HOLD_S
        while self._proposing is not None:
            # Our own proposal could still be accepted, so we must not accept now. Hold higher ids until it
            # resolves; refuse lower ids at once (crossed proposals: the lower id's refusal breaks the tie).
            remaining = hold_until - time.monotonic()
            if sender < self.my_id or remaining <= 0 or self._proposal_done is None:
                return _refuse(f"proposing to {self._proposing[:8]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proposal_done.wait(), remaining)
        why = self._why_not(request.step)
        if why:
            return _refuse(why)
        assert self._avail_step is not None
        step = self._avail_step
        h = hashlib.sha256(self.run_id)
        h.update(f"noloco/{sender}/{self.my_id}/{request.step}/{step}/".encode())
        h.update(request.auth.nonce)
        members = [copy_peer(proposer, suspects=False), copy_peer(self.me(), suspects=False)]
        sess = self._open(h.digest(), step, "accepter", members)
        sess.stream_round[sender] = sess.round_id
        sess.peer_steps[sender] = request.step
        if self._at_boundary is not None:
            self._set_own(sess, self._at_boundary)
        elif self._ahead is not None and self._ahead[0] == step:
            self._set_own(sess, {"phi": self._ahead[1]})
        if self._at_boundary is not None:
            eta = 0.0
        elif self.settings.send_ahead:
            eta = self._phase_s if math.isfinite(self._phase_s) else self.settings.exchange_timeout
        else:
            eta = self._eta_now()
        sess.deadline = time.monotonic() + eta + self.settings.exchange_timeout
        self._watch(sess)
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.match_timeout + CONFIRM_GRACE_S, self._expire_unconfirmed, sess)
        log.debug("accepted %s's proposal for step %d (ours %d)", sender[:8], request.step, step)
        return pb.MatchResponse(accepted=True, round_id=sess.round_id, members=members, step=step)

    def _why_not(self, their_step: int) -> str:
        """Why we cannot accept a proposal for `their_step` right now ('' if we can)."""
        if self._closing:
            return "shutting down"
        if self._session is not None:
            return "busy: already in a group"
        step = self._avail_step
        if step is None:
            return "not ready"
        if abs(their_step - step) > self.settings.max_staleness:
            return f"stale: our outer step is {step}, more than {self.settings.max_staleness} from {their_step}"
        if self.settings.send_ahead:
            ahead = self._ahead
            if ahead is None or ahead[0] != step or self._at_boundary is not None:
                return "not in our matching window"
            if time.monotonic() - ahead[2] > self.settings.match_timeout:
                return "our matching window has closed"
            return ""
        if self._at_boundary is None and self._eta_now() > self.settings.horizon:
            return f"not ready for another {self._eta_now():.1f}s"
        return ""

    def _expire_unconfirmed(self, sess: _Session) -> None:
        if not sess.confirmed and not sess.closed.done():
            sess.close("the proposer never opened the exchange")
            if self._session is sess:
                self._session = None

    # -- proposing -----------------------------------------------------------------------------------------------
    def _eligible(self, step: int, exclude: set[str]) -> list[pb.PeerInfo]:
        s = self.settings.max_staleness
        return [
            p
            for p in self.candidates()
            if p.peer_id != self.my_id and p.peer_id not in exclude and not p.left and abs(p.outer_step - step) <= s
        ]

    async def _propose(self, target: pb.PeerInfo, step: int) -> pb.MatchResponse | None:
        self._proposing = target.peer_id
        done = self._proposal_done = asyncio.Event()
        try:
            req = sign(
                pb.MatchRequest(step=step, group_size=self.settings.group_size), "Match", self.identity, self.run_id
            )
            return await self.transport.match(target, req, MATCH_RPC_S)
        except (grpc.aio.AioRpcError, TimeoutError, OSError, StreamError) as exc:
            log.debug("proposal to %s failed: %s", target.peer_id[:8], exc)
            if connection_failed(exc):
                self.on_unreachable(target.peer_id)
            return None
        finally:
            self._proposing = None
            done.set()

    def _valid_accept(self, resp: pb.MatchResponse | None, target: pb.PeerInfo, step: int) -> bool:
        if resp is None or not resp.accepted:
            return False
        ok = (
            len(resp.round_id) == 32
            and len(resp.members) == 2
            and resp.members[0].peer_id == self.my_id
            and resp.members[1].peer_id == target.peer_id
            and abs(resp.step - step) <= self.settings.max_staleness
        )
        if not ok:
            log.warning("ignoring a malformed acceptance from %s", target.peer_id[:8])
        return ok

    async def _find_group(
        self, step: int, deadline: float, eta: float, stop: Callable[[], bool] = lambda: False
    ) -> _Session | None:
        """Propose to random eligible peers until a group forms, `deadline` passes or `stop()`. Returns our group,
        which may also be one we accepted in between our own proposals. `eta`: seconds until our own boundary.
        Never cancel this mid-proposal: the target may have accepted already, and would wait for us in vain."""
        sess: _Session | None = None
        busy: set[str] = set()
        try:
            while True:
                if self._session is not None and self._session is not sess:
                    return self._session  # we accepted someone between two of our proposals
                if sess is not None and len(sess.members) >= self.settings.group_size:
                    return sess
                if time.monotonic() >= deadline or self._closing or stop():
                    return sess
                if not self.candidates():
                    return sess  # nobody else is alive: no point waiting for the deadline
                taken = set(sess.member_ids) if sess is not None else set()
                cands = self._eligible(step, taken | busy)
                if not cands:
                    if all(p.outer_step > step + self.settings.max_staleness for p in self.candidates()):
                        return sess  # everyone is past our window and only moves further away: do not wait
                    busy.clear()  # peers that were busy may be free by the next sweep
                    await asyncio.sleep(min(self.rng.uniform(0.05, 0.2), max(deadline - time.monotonic(), 0.0)))
                    continue
                target = self.rng.choice(cands)  # uniform over the eligible peers: pairings are unbiased
                resp = await self._propose(target, step)
                if self._valid_accept(resp, target, step):
                    assert resp is not None
                    if sess is None:
                        sess = self._open(resp.round_id, step, "proposer", [copy_peer(self.me(), suspects=False)])
                        sess.deadline = time.monotonic() + eta + self.settings.exchange_timeout
                        self._watch(sess)
                    sess.members.append(copy_peer(target, suspects=False))
                    sess.expect(target.peer_id)
                    sess.stream_round[target.peer_id] = resp.round_id
                    sess.peer_steps[target.peer_id] = resp.step
                    continue
                if resp is not None and resp.reason.startswith("busy"):
                    busy.add(target.peer_id)
                await asyncio.sleep(self.rng.uniform(*BACKOFF_S))
        finally:
            # Open the streams even when cancelled (shutdown): accepters wait for them.
            if sess is not None and not sess.tasks:
                for member in sess.members[1:]:
                    task = asyncio.ensure_future(self._client(sess, member))
                    sess.tasks.append(task)
                    sess.delivering.append(task)

    # -- the trainer's entry points ------------------------------------------------------------------------------
    async def start_ahead(self, step: int, phi: torch.Tensor) -> None:
        """Send-ahead: at the start of the inner phase for outer step `step`, encode our slow weights and look for
        a partner in the background; the slow weights stream to it while we train."""
        if not self.settings.send_ahead:
            raise PairingError("start_ahead needs noloco.send_ahead = true")
        self._check({"phi": phi}, ("phi",))
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self.executor, self.codec.encode, phi)
        if step <= self._last_round or self._closing:
            return  # the boundary came first (encoding waited behind other work): too late to go ahead
        if self._ahead_task is not None and not self._ahead_task.done():
            self._ahead_stop = True
            await self._ahead_task
        self._ahead_stop = False
        self._ahead = (step, encoded, time.monotonic())
        self._avail_step = step
        eta = self._phase_s if math.isfinite(self._phase_s) else self.settings.exchange_timeout
        self._ahead_task = asyncio.ensure_future(self._match_ahead(step, encoded, eta))

    async def _match_ahead(self, step: int, encoded_phi: bytes, eta: float) -> None:
        deadline = time.monotonic() + self.settings.match_timeout
        sess = await self._find_group(step, deadline, eta, stop=lambda: self._ahead_stop)
        if sess is not None and sess.step == step:
            self._set_own(sess, {"phi": encoded_phi})

    async def run_round(self, step: int, tensors: Mapping[str, torch.Tensor]) -> PairOutcome:
        """At the end of the inner steps for outer step `step`: exchange `tensors` ({"phi", "pair"}, flat fp32 CPU)
        with a group, or step alone if none forms by `match_timeout`. Network trouble never raises: a partner
        that fails shows up in the outcome's `lost`."""
        self._check(tensors, KINDS)
        t0 = time.monotonic()
        self._last_round = max(self._last_round, step)
        loop = asyncio.get_running_loop()
        if self._ahead_task is not None and not self._ahead_task.done():
            self._ahead_stop = True  # the matching window is over; a proposal in flight may still form our group
            with contextlib.suppress(asyncio.CancelledError):
                await self._ahead_task
        encoded = {k: await loop.run_in_executor(self.executor, self._encode, tensors[k]) for k in KINDS}
        self._avail_step = step
        self._at_boundary = encoded
        sess: _Session | None = None
        try:
            if not self.settings.send_ahead:
                await self._pace(step, time.monotonic() + self.settings.match_timeout, until_matched=True)
            match_deadline = time.monotonic() + self.settings.match_timeout
            match_s = 0.0
            outcome: PairOutcome | None = None
            while outcome is None:
                sess = self._session
                if sess is not None and sess.step != step:
                    self._drop(sess, f"group was for step {sess.step}, we are at {step}")
                    sess = None
                if sess is not None and sess.all_settled() and not sess.got_any() and not self.settings.send_ahead:
                    self._drop(sess, "the proposer went away before sending anything")
                    sess = None
                if sess is None and not self.settings.send_ahead:
                    t_match = time.monotonic()
                    wait_until = min(t_match + self.yield_s(), match_deadline)
                    while self._session is None and time.monotonic() < wait_until and not self._closing:
                        await asyncio.sleep(0.02)
                    sess = await self._find_group(step, match_deadline, 0.0)
                    match_s += time.monotonic() - t_match
                if sess is None:
                    outcome = self._solo(step, tensors, match_s, time.monotonic() - t0)
                    break
                self._set_own(sess, encoded)
                sess.deadline = min(sess.deadline, time.monotonic() + self.settings.exchange_timeout)
                await self._wait_settled(sess)
                unconfirmed = not sess.confirmed and not sess.got_any()
                if unconfirmed and not self.settings.send_ahead and time.monotonic() < match_deadline:
                    self._drop(sess, "the proposer never opened the exchange")
                    continue  # look again while the matching deadline allows
                outcome = self._outcome(sess, tensors, match_s, time.monotonic() - t0)
            if self.settings.send_ahead:  # with send-ahead, pace before the next inner phase starts
                await self._pace(step + 1, time.monotonic() + self.settings.match_timeout, until_matched=False)
            return outcome
        finally:
            self._at_boundary = None
            self._avail_step = None
            self._ahead = None
            if sess is not None:
                self._retire(sess)
            if self._session is sess:
                self._session = None

    def _encode(self, t: torch.Tensor) -> bytes:
        bad = faults.poisoned(t)  # a test-only injector: `t` itself unless enabled
        return self.codec.encode(t) if bad is t else faults.forge_frame(self.codec, bad.contiguous())

    async def _pace(self, step: int, deadline: float, *, until_matched: bool) -> None:
        """Bounded staleness: do not start matching for `step` while a live peer is still more than max_staleness
        steps behind (up to `deadline`). Without this, peers that happen to run faster pull ahead together,
        then can only pair among themselves, and the swarm splits into groups whose weights drift apart. We are at
        our boundary meanwhile, so a slower peer's proposal is accepted at once (`until_matched`: stop waiting
        then). Peers far behind are ignored: they will download state rather than catch up step by step."""
        s = self.settings.max_staleness
        while time.monotonic() < deadline and not self._closing and not (until_matched and self._session is not None):
            lagging = [p for p in self.candidates() if step - s - PACE_SLACK <= p.outer_step < step - s]
            if not lagging:
                return
            await asyncio.sleep(0.05)

    def _check(self, tensors: Mapping[str, torch.Tensor], kinds: Sequence[str]) -> None:
        if sorted(tensors) != sorted(kinds):
            raise PairingError(f"expected tensors {sorted(kinds)}, got {sorted(tensors)}")
        for k, t in tensors.items():
            if t.dim() != 1 or t.dtype != torch.float32 or t.numel() != self.numel or t.device.type != "cpu":
                raise PairingError(f"{k} must be a 1-D float32 CPU tensor of {self.numel} values")

    async def _wait_settled(self, sess: _Session) -> None:
        while not sess.all_settled():
            remaining = sess.deadline - time.monotonic()
            if remaining <= 0:
                sess.close(f"nothing within the exchange timeout of {self.settings.exchange_timeout:.0f}s")
                return
            sess.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sess.changed.wait(), remaining)

    def _solo(self, step: int, tensors: Mapping[str, torch.Tensor], match_s: float, total_s: float) -> PairOutcome:
        return PairOutcome(
            step=step,
            round_id=b"",
            members=[copy_peer(self.me(), suspects=False)],
            contributions={self.my_id: dict(tensors)},
            lost=[],
            match_seconds=match_s,
            stats=RoundStats(seconds=total_s),
            note="no partner",
        )

    def _outcome(
        self, sess: _Session, tensors: Mapping[str, torch.Tensor], match_s: float, total_s: float
    ) -> PairOutcome:
        contributions = {self.my_id: dict(tensors)}
        for pid in sess.member_ids:
            if pid != self.my_id and sess.complete(pid):
                contributions[pid] = dict(sess.received[pid])
        lost = [pid for pid in sess.member_ids if pid not in contributions]
        for pid in contributions:  # they finished that step with us: do not wait for gossip to say so (pacing)
            if pid != self.my_id and pid in sess.peer_steps:
                self.note_step(pid, sess.peer_steps[pid] + 1)
        others = [pid[:8] for pid in sess.member_ids if pid != self.my_id]
        note = ("partner " if len(others) == 1 else "group ") + ",".join(others)
        if lost:
            reasons = sorted({sess.errors.get(p, "") for p in lost} - {""})
            note += "; lost " + ",".join(p[:8] for p in lost) + (f" ({'; '.join(reasons)})" if reasons else "")
        sess.stats.seconds = total_s
        return PairOutcome(
            step=sess.step,
            round_id=sess.round_id,
            members=list(sess.members),
            contributions=contributions,
            lost=lost,
            match_seconds=match_s,
            stats=sess.stats,
            note=note,
        )

    async def close(self) -> None:
        """Stop matching; let streams that carry our finished contributions deliver them (up to PAIR_DRAIN_S, so a
        partner in its last exchange with us does not lose our tensors), then abandon every group."""
        self._closing = True
        self._ahead_stop = True
        if self._ahead_task is not None:
            self._ahead_task.cancel()
        pending = [
            f
            for sess in self._sessions.values()
            if all(own.done() for own in sess.own.values())
            for f in sess.delivering
            if not f.done()
        ]
        if pending:
            await asyncio.wait(pending, timeout=PAIR_DRAIN_S)
        for sess in list(self._sessions.values()):
            sess.close("shutting down")
        self._sessions.clear()
        self._session = None

    # -- sessions ------------------------------------------------------------------------------------------------
    def _open(self, round_id: bytes, step: int, role: str, members: list[pb.PeerInfo]) -> _Session:
        sess = _Session(round_id, step, role, members, self.my_id)
        self._session = sess
        self._sessions[round_id] = sess
        return sess

    def _drop(self, sess: _Session, why: str) -> None:
        log.info("leaving group %s: %s", sess.round_id.hex()[:8], why)
        sess.close(why)
        self._sessions.pop(sess.round_id, None)
        if self._session is sess:
            self._session = None

    def _set_own(self, sess: _Session, encoded: Mapping[str, bytes]) -> None:
        """Hand our encoded tensors to the group's streams. They are counted as sent here, once per stream that
        carries them: a stream may still be uploading them after we have the partner's tensors and moved on."""
        streams = len(sess.members) - 1 if sess.role == "proposer" else 1
        for kind, payload in encoded.items():
            fut = sess.own[kind]
            if not fut.done():
                fut.set_result(payload)
                sess.stats.wire_bytes += len(payload) * streams
                sess.stats.raw_bytes += 4 * self.numel * streams

    def _watch(self, sess: _Session) -> None:
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
            self._sessions.pop(sess.round_id, None)
            if self._session is sess:
                self._session = None

        loop.call_later(1.0, check)

    def _retire(self, sess: _Session) -> None:
        """We have what we need. Streams may still be delivering to others (our last bytes on a slow link, relays
        in groups of three or more): let them run until the group's deadline, then forget the group."""
        loop = asyncio.get_running_loop()
        sess.received = {}  # the outcome holds the decoded tensors now; relays use the raw bytes

        def forget() -> None:
            sess.close("retired")
            self._sessions.pop(sess.round_id, None)

        delay = min(sess.deadline - time.monotonic(), self.settings.exchange_timeout)
        loop.call_later(max(delay, RETIRE_S), forget)

    async def _own(self, sess: _Session, kind: str) -> bytes:
        """Our encoded tensor of `kind` for this group, once the trainer provides it."""
        fut = sess.own[kind]
        if not fut.done():
            await asyncio.wait({fut, sess.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            raise RoundFailed("the group closed before our contribution was ready", reason="aborted")
        return fut.result()

    def _messages(
        self, sess: _Session, to: str, kind: str, payload: bytes, origin: int, relay: bool = False
    ) -> Iterator[pb.TensorMessage]:
        header = pb.TensorHeader(
            round_id=sess.round_for(to),
            shard=origin,
            numel=self.numel,
            codec=self.codec.name,
            included=sess.member_ids,
            kind=kind,
        )
        if relay:  # our own tensors were counted when handed over (_set_own)
            sess.stats.wire_bytes += len(payload)
            sess.stats.raw_bytes += 4 * self.numel
        for msg in tensor_messages(header, payload, self.identity, self.run_id, self.settings.chunk_bytes):
            yield msg
            if msg.WhichOneof("part") == "chunk":
                faults.EXCHANGE_EXIT.on_chunk()

    async def _store(self, sess: _Session, rx: ReceivedTensor, from_peer: str) -> None:
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
        if h.kind not in KINDS:
            raise StreamError("malformed", f"unknown tensor kind {h.kind!r}", rx.sender)
        got = sess.received.setdefault(origin, {})
        if h.kind in got:
            raise StreamError("duplicate", f"{h.kind} of {origin[:8]} arrived twice", rx.sender)
        payload = bytes(rx.payload)
        loop = asyncio.get_running_loop()
        got[h.kind] = await loop.run_in_executor(self.executor, self.codec.decode, payload, self.numel)
        sess.stats.received_wire_bytes += len(payload)
        if sess.role == "proposer" and len(ids) > 2:
            sess.raw.setdefault(origin, {})[h.kind] = payload
        if len(got) == len(KINDS):
            sess.settle(origin, True)

    def _limit(
        self, sess_for: Callable[[str, pb.TensorHeader], _Session]
    ) -> Callable[[str, pb.TensorHeader], Awaitable[int]]:
        """Size limit for an incoming tensor, checked against the group before anything is allocated."""

        async def limit(sender: str, header: pb.TensorHeader) -> int:
            if header.numel != self.numel:
                raise StreamError("wrong_shape", f"tensor of {header.numel} values; this run's has {self.numel}")
            if header.codec != self.codec.name:
                raise StreamError("wrong_codec", f"codec {header.codec!r}; this run uses {self.codec.name!r}")
            sess = sess_for(sender, header)
            if sender not in sess.member_ids:
                raise StreamError("not_member", f"{sender[:8]} is not in this group")
            return self.max_wire

        return limit

    # -- proposer side of a stream -------------------------------------------------------------------------------
    async def _client(self, sess: _Session, member: pb.PeerInfo) -> None:
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
                self.on_unreachable(pid)
        except Exception as exc:
            log.warning("exchange with %s failed unexpectedly: %r", pid[:8], exc)
            sess.settle(pid, False, _describe(exc))
        finally:
            sess.settle(pid, False, "stream ended")
            if call is not None:
                call.cancel()

    async def _client_requests(self, sess: _Session, member: pb.PeerInfo) -> AsyncIterator[pb.TensorMessage]:
        to = member.peer_id
        for kind in KINDS:
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
                for kind in KINDS:
                    for msg in self._messages(sess, to, kind, sess.raw[other][kind], index, relay=True):
                        yield msg

    # -- accepter side of a stream -------------------------------------------------------------------------------
    async def serve(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
        """Server side of `Rounds.Exchange`: read the proposer's tensors, send ours back on the same stream."""
        it = messages.__aiter__()
        found: list[_Session] = []

        def sess_for(sender: str, header: pb.TensorHeader) -> _Session:
            sess = self._sessions.get(header.round_id)
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
            for kind in KINDS:
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

    def _lost_proposer(self, sess: _Session, why: str) -> None:
        """The proposer's stream is gone: whatever has not arrived will not. If nothing did and we are still
        training, leave the group so that we can accept another proposal for this step."""
        for pid in sess.member_ids:
            sess.settle(pid, False, why)
        if not sess.got_any() and self._session is sess and self._at_boundary is None:
            self._drop(sess, f"the proposer went away ({why})")

    async def _read_from_proposer(
        self, sess: _Session, it: AsyncIterator[pb.TensorMessage], first: ReceivedTensor
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


async def _next_tensor(
    it: AsyncIterator[pb.TensorMessage], verifier: Verifier, limit: Callable[[str, pb.TensorHeader], Awaitable[int]]
) -> ReceivedTensor | None:
    """The next framed tensor on a stream, or None if the stream ended cleanly between tensors."""
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        return None
    return await read_tensor(prepend(first, it), verifier, limit)


def _refuse(reason: str) -> pb.MatchResponse:
    return pb.MatchResponse(accepted=False, reason=reason)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
