"""NoLoCo matchmaking: each outer step, a peer finds a random partner (or a small group) to exchange tensors with.

There is no leader and no global barrier. A peer that reaches the end of its inner steps (or, with send-ahead, the
start of them) *proposes* to a live peer drawn at random among those whose outer step is within ``max_staleness``
of its own, peers at a similar pace (their gossiped inner phase time) more likely than others (``Rounds.Match``);
the target *accepts* when it is free and due at about the same time. Rules that keep groups disjoint:

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

A group that forms here becomes a session of peerd/pair_exchange.py, which swaps the tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc

from peerd.channels import connection_failed, dial_failure
from peerd.envelope import sign
from peerd.identity import Identity
from peerd.membership import copy_peer
from peerd.pair_exchange import Exchange, ExchangeCall, ExchangeTransport, PairSettings, Session
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

HOLD_S = 1.0  # longest we hold a proposal from a higher id while our own proposal is outstanding
MATCH_RPC_S = 2 * HOLD_S + 1.0  # a Match call may be held once, plus a round trip
CONFIRM_GRACE_S = 5.0  # an accepter waits match_timeout + this for the proposer to open the exchange
BACKOFF_S = (0.01, 0.05)  # random pause after a refusal; lets proposals we hold be answered in between
PACE_SLACK = 3  # peers more than max_staleness + this many steps behind are catching up (downloading state)
CONSTRAINED_WEIGHT = 4.0  # how much likelier a partner that cannot dial some live peer is (fewer partners; _pick)


class Transport(ExchangeTransport, Protocol):
    """How a Pairing reaches other peers: gRPC in the daemon, direct calls in unit tests."""

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse: ...


class GrpcTransport:
    """The daemon's transport: `Rounds.Match` and `Rounds.Exchange` over its pooled channels."""

    def __init__(self, channels: Callable[[], Any]) -> None:
        self._channels = channels

    async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse:
        return await self._channels().rounds(peer.address, peer).Match(request, timeout=timeout)

    def exchange(self, peer: pb.PeerInfo, requests: AsyncIterator[pb.TensorMessage], timeout: float) -> ExchangeCall:
        return self._channels().rounds(peer.address, peer).Exchange(requests, timeout=timeout)


class Matchmaker:
    """One peer's side of `Rounds.Match`: proposes to random peers, accepts or refuses their proposals, and paces
    itself against slower peers. The groups it forms are opened in `exchange`. Every coroutine runs on the daemon's
    event loop; the trainer's readiness (`progress`, the boundary and send-ahead fields) is written by the pairing."""

    def __init__(
        self,
        *,
        identity: Identity,
        run_id: bytes,
        settings: PairSettings,
        transport: Transport,
        exchange: Exchange,
        candidates: Callable[[], Sequence[pb.PeerInfo]],
        lookup: Callable[[str], pb.PeerInfo | None],
        me: Callable[[], pb.PeerInfo],
        on_unreachable: Callable[[str, str], None],
        rng: random.Random,
    ) -> None:
        self.identity = identity
        self.my_id = identity.peer_id
        self.run_id = run_id
        self.settings = settings
        self.transport = transport
        self.exchange = exchange
        self.candidates = candidates
        self.lookup = lookup
        self.me = me
        self.on_unreachable = on_unreachable  # (peer, how the dial failed) we could not connect: leave it out a while
        self.rng = rng
        self._proposing: str | None = None  # target of our outstanding proposal
        self._proposal_done: asyncio.Event | None = None
        # what the trainer told us (plain attribute writes from its thread; see progress())
        self.avail_step: int | None = None
        self._eta: tuple[float, float] = (math.inf, 0.0)  # (seconds to our boundary, when that was measured)
        self.phase_s = math.inf
        self.at_boundary: dict[str, bytes] | None = None  # our encoded tensors while we are at the boundary
        self.ahead: tuple[int, bytes, float] | None = None  # send-ahead: (step, encoded phi, phase start)
        self.closing = False

    # -- what the trainer tells us -------------------------------------------------------------------------------
    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        """Called from the training thread after each inner step: we are working towards outer step `step`, due in
        about `eta_s` seconds; a whole inner phase takes about `phase_s`. Plain attribute writes, read on the loop."""
        self._eta = (eta_s, time.monotonic())
        self.phase_s = phase_s
        self.avail_step = step

    def eta_now(self) -> float:
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
        assert self.avail_step is not None
        step = self.avail_step
        h = hashlib.sha256(self.run_id)
        h.update(f"noloco/{sender}/{self.my_id}/{request.step}/{step}/".encode())
        h.update(request.auth.nonce)
        members = [copy_peer(proposer, suspects=False), copy_peer(self.me(), suspects=False)]
        sess = self.exchange.open(h.digest(), step, "accepter", members)
        sess.stream_round[sender] = sess.round_id
        sess.peer_steps[sender] = request.step
        if self.at_boundary is not None:
            self.exchange.set_own(sess, self.at_boundary)
        elif self.ahead is not None and self.ahead[0] == step:
            self.exchange.set_own(sess, {"phi": self.ahead[1]})
        if self.at_boundary is not None:
            eta = 0.0
        elif self.settings.send_ahead:
            eta = self.phase_s if math.isfinite(self.phase_s) else self.settings.exchange_timeout
        else:
            eta = self.eta_now()
        sess.deadline = time.monotonic() + eta + self.settings.exchange_timeout
        self.exchange.watch(sess)
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.match_timeout + CONFIRM_GRACE_S, self._expire_unconfirmed, sess)
        log.debug("accepted %s's proposal for step %d (ours %d)", sender[:8], request.step, step)
        return pb.MatchResponse(accepted=True, round_id=sess.round_id, members=members, step=step)

    def _why_not(self, their_step: int) -> str:
        """Why we cannot accept a proposal for `their_step` right now ('' if we can)."""
        if self.closing:
            return "shutting down"
        if self.exchange.session is not None:
            return "busy: already in a group"
        step = self.avail_step
        if step is None:
            return "not ready"
        if abs(their_step - step) > self.settings.max_staleness:
            return f"stale: our outer step is {step}, more than {self.settings.max_staleness} from {their_step}"
        if self.settings.send_ahead:
            ahead = self.ahead
            if ahead is None or ahead[0] != step or self.at_boundary is not None:
                return "not in our matching window"
            if time.monotonic() - ahead[2] > self.settings.match_timeout:
                return "our matching window has closed"
            return ""
        if self.at_boundary is None and self.eta_now() > self.settings.horizon:
            return f"not ready for another {self.eta_now():.1f}s"
        return ""

    def _expire_unconfirmed(self, sess: Session) -> None:
        if not sess.confirmed and not sess.closed.done():
            sess.close("the proposer never opened the exchange")
            if self.exchange.session is sess:
                self.exchange.session = None

    # -- proposing -----------------------------------------------------------------------------------------------
    def _eligible(self, step: int, exclude: set[str]) -> list[pb.PeerInfo]:
        s = self.settings.max_staleness
        return [
            p
            for p in self.candidates()
            if p.peer_id != self.my_id and p.peer_id not in exclude and not p.left and abs(p.outer_step - step) <= s
        ]

    def _pick(self, cands: list[pb.PeerInfo]) -> pb.PeerInfo:
        """A random partner, preferring peers at a similar pace (their gossiped `phase_ms` against ours): a peer
        1.5x slower or faster than us or less is as likely as any, one r times off is 1/r^2 as likely. Nobody is
        ever excluded, so the slow and the fast still mix (NoLoCo needs random pairs to keep weights close); they
        just rarely make each other wait. Peers that have not measured their pace yet count as similar. A peer that
        cannot dial some live peer (its gossiped `unreachable`, peerd/pairblocks.py) has fewer partners than the
        rest, so it is CONSTRAINED_WEIGHT times as likely: with two such peers in four, proposals between the other
        two left both of them alone for 27% of their steps."""
        mine = self.phase_s
        if math.isfinite(mine) and mine > 0:
            self.me().phase_ms = min(int(mine * 1000), 2**32 - 1)  # published with our next signed entry
        weights = [pace_weight(mine, p.phase_ms / 1000.0) * (CONSTRAINED_WEIGHT if p.unreachable else 1) for p in cands]
        return self.rng.choices(cands, weights=weights)[0]

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
                self.on_unreachable(target.peer_id, dial_failure(exc))
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

    async def find_group(
        self, step: int, deadline: float, eta: float, stop: Callable[[], bool] = lambda: False
    ) -> Session | None:
        """Propose to random eligible peers until a group forms, `deadline` passes or `stop()`. Returns our group,
        which may also be one we accepted in between our own proposals. `eta`: seconds until our own boundary.
        Never cancel this mid-proposal: the target may have accepted already, and would wait for us in vain."""
        sess: Session | None = None
        busy: set[str] = set()
        try:
            while True:
                if self.exchange.session is not None and self.exchange.session is not sess:
                    return self.exchange.session  # we accepted someone between two of our proposals
                if sess is not None and len(sess.members) >= self.settings.group_size:
                    return sess
                if time.monotonic() >= deadline or self.closing or stop():
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
                target = self._pick(cands)
                resp = await self._propose(target, step)
                if self._valid_accept(resp, target, step):
                    assert resp is not None
                    if sess is None:
                        sess = self.exchange.open(
                            resp.round_id, step, "proposer", [copy_peer(self.me(), suspects=False)]
                        )
                        sess.deadline = time.monotonic() + eta + self.settings.exchange_timeout
                        self.exchange.watch(sess)
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
            if sess is not None:
                self.exchange.start_streams(sess)

    async def pace(self, step: int, deadline: float, *, until_matched: bool) -> None:
        """Bounded staleness: do not start matching for `step` while a live peer is still more than max_staleness
        steps behind (up to `deadline`). Without this, peers that happen to run faster pull ahead together,
        then can only pair among themselves, and the swarm splits into groups whose weights drift apart. We are at
        our boundary meanwhile, so a slower peer's proposal is accepted at once (`until_matched`: stop waiting
        then). Peers far behind are ignored: they will download state rather than catch up step by step."""
        s = self.settings.max_staleness
        while (
            time.monotonic() < deadline
            and not self.closing
            and not (until_matched and self.exchange.session is not None)
        ):
            lagging = [p for p in self.candidates() if step - s - PACE_SLACK <= p.outer_step < step - s]
            if not lagging:
                return
            await asyncio.sleep(0.05)


def pace_weight(mine_s: float, theirs_s: float) -> float:
    """How likely a partner is drawn, by how far its inner phase time is from ours (1.0 within 1.5x)."""
    if not (math.isfinite(mine_s) and mine_s > 0 and theirs_s > 0):
        return 1.0
    ratio = max(mine_s, theirs_s) / min(mine_s, theirs_s)
    return 1.0 if ratio <= 1.5 else 1.0 / (ratio * ratio)


def _refuse(reason: str) -> pb.MatchResponse:
    return pb.MatchResponse(accepted=False, reason=reason)
