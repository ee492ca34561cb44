"""The client side of a DiLoCo / Streaming DiLoCo round (peerd/allreduce.py is the exchange itself): find the
round's leader and join its group (peerd/rendezvous.py is the leader's side, which `lead_rendezvous` answers for),
run the reduce-scatter + all-gather with that group, retry without the peers a failed attempt blames, and hand the
outcome to peerd/roundbook.py, which records it in status, logs and metrics.

It also keeps the registry of rounds in flight, so that a member's Reduce stream that arrives before our own
rendezvous answer finds its round, and calls that depend on a peer that goes silent in gossip give up early.
Everything here runs on the daemon loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch

from peerd import faults
from peerd.allreduce import ReduceRound, RoundFailed, RoundResult
from peerd.callwatch import CallWatch, LeaderMoved, LeaderUndialable, PeerSilent, plausible_step
from peerd.channels import UNREACHABLE, dial_failure
from peerd.consistency import Claim, outranks
from peerd.envelope import sign
from peerd.group_delta import DeltaError, LeaderLists, MemberList
from peerd.layout import checked_part_bytes
from peerd.reachability import dialable
from peerd.rendezvous import Behind, group_weights, member_weight
from peerd.round_registry import HELD_WAIT_S, RoundRegistry
from peerd.roundbook import RoundBook
from peerd.roundtypes import ContributionRefused
from peerd.timings import join_offset_s
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")
DIAL_S = 5.0  # a leader we cannot connect to within this is tried no longer (peerd/pairblocks.py)

LINGER_ROUNDS = 2
"""Completed rounds that stay registered, holding the averaged shards they received, until their deadline: a member
that missed a shard whose owner died may need one of them (shard_relay.py)."""


class RoundClient:
    """Rendezvous, all-reduce rounds and their bookkeeping for one daemon (`daemon.round_client`)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.watch = CallWatch(daemon)  # gives up on calls whose peers look gone
        self.registry = RoundRegistry(daemon.cfg.network.rendezvous_timeout + 10.0)
        self.rounds = self.registry.rounds  # round id -> its ReduceRound, while in flight or lingering
        self._lingering: list[asyncio.Task] = []  # rounds' source watchers, oldest first (_watch_sources)
        self.book = RoundBook(daemon)  # each completed round's record: included vs expected, bytes, timings
        # Peers that may not lead: the flagged members of our last completed round (its group's no_shards). Every
        # member of that round got the same group, so all of them agree on the next step's leader; switching on
        # each peer's live view of the flags instead split a step between the old leader and the new one.
        self.no_lead: set[str] = set()
        self.sat_out = -1  # the DiLoCo step an owner refused our contribution at (ContributionRefused)
        # Rendezvous answers travel as changes to the member list of the member's previous group (group_delta.py)
        self.led_lists = LeaderLists()  # as a leader: the lists we answered against lately
        self.my_list = MemberList()  # as a member: our last group's list, which our requests name

    async def lead_rendezvous(self, request: pb.RendezvousRequest, info: pb.PeerInfo) -> pb.RendezvousResponse:
        assert self.d.leader is not None
        if request.fragment < 0 and self.d.status.outer_step < request.step <= self._plausible_step() + 1:
            # Only a step the swarm could be at closes earlier groups: one peer claiming step 10**9 must not make
            # every pending group resync (the median of live peers' gossiped steps cannot be moved by a minority).
            self.d.leader.on_ahead(request.step)
        named = self.registry.naming(request, info)  # a round it is in already, whose leader died before answering it
        if named is not None:
            return pb.RendezvousResponse(group=named)
        # Lead unless a lower settled id exists that the requester does not suspect: after a failed round its
        # members skip the peer they blame, and redirecting them back to it made each lead a group of its own.
        # Any lower live peer, settled or not, takes the lead: requesters pick among settled peers, and a peer that
        # only just joined (settled in one requester's view, not yet in another's) would otherwise make two leaders.
        # A peer the swarm flags slow or faulty (peerd/timings.py) hands the lead on even to a higher id; so does a
        # peer more than a step behind the round (a newcomer or a restarted peer still fetching the swarm's state:
        # leading with a stale view of the others' steps, it expected only the requester, closed groups of one and
        # split the swarm around a join, seen in CI). The requester skips it and names it to the next candidate
        # (`declined`), which must not send it back: that ping-pong made two peers lead groups of one each.
        me = self.d.identity.peer_id
        lagging = request.step > self.d.status.outer_step + 1
        excluded = (set(request.suspects) | set(request.declined[:64])) - {me}
        if lagging or self.d.me.sponsor:  # a sponsored peer joins no round (peerd/sponsor.py): it leads none either
            excluded.add(me)
        leader = self._first_leader([p for p in self.d.membership.alive() if p.peer_id not in excluded])
        if leader is not None and leader.peer_id != me and (leader.peer_id < me or me in self.no_lead or lagging):
            if leader.peer_id > me:  # handed on upwards: the round keeps that leader once we catch up
                self.d.leader.hand_on(request.step, request.fragment, leader.peer_id)
            return pb.RendezvousResponse(redirect=leader)
        handed = self._handed_to(request.step, request.fragment, excluded)
        if handed is not None:
            return pb.RendezvousResponse(redirect=handed)
        theirs = Claim(int(request.work), int(request.step), bytes(request.state_digest))
        behind = self.d.status.outer_step > request.step and outranks(self.d.my_claim(), theirs)
        lineage = bytes(request.state_digest) if self.d.ranked else b""
        resp = await self.d.leader.join(
            request.step,
            request.fragment,
            info,
            list(request.suspects),
            bytes(request.failed_round),
            behind,
            lineage,
            int(request.tokens),
            list(request.carries),
        )
        resp = self.led_lists.answer(resp, bytes(request.members_base))
        form = resp.WhichOneof("result")
        if self.d.metrics is not None and form in ("delta", "group"):
            self.d.metrics.rendezvous_answers.labels(form="delta" if form == "delta" else "whole").inc()
        return resp

    def _first_leader(self, peers: list[pb.PeerInfo]) -> pb.PeerInfo | None:
        """The lowest-id peer of `peers` (in id order) that may lead: dialable, not sponsored (it joins no round, and
        its link is the slow one), not named undialable by a live peer (peerd/pairblocks.py: that peer could not
        join), and not flagged slow or faulty in our last round (peerd/timings.py), each unless every dialable one
        is."""
        able = [p for p in peers if dialable(p) and not p.sponsor] or [p for p in peers if dialable(p)]
        named = self.d.membership.named_unreachable(able)
        able = [p for p in able if p.peer_id not in named] or able
        unflagged = [p for p in able if p.peer_id not in self.no_lead]
        return (unflagged or able or [None])[0]

    def _handed_to(self, step: int, fragment: int, excluded: set[str]) -> pb.PeerInfo | None:
        """The live peer we handed this round's lead on to (RendezvousLeader.hand_on), if any."""
        assert self.d.leader is not None
        pid = self.d.leader.handed_to(step, fragment)
        info = self.d.membership.get(pid) if pid is not None and pid not in excluded else None
        m = self.d.membership
        ok = info is not None and m.is_alive(info.peer_id) and dialable(info) and not m.cannot_dial(info.peer_id)
        return info if ok else None

    def _plausible_step(self) -> int:
        return plausible_step(self.d)

    async def _rendezvous(
        self,
        step: int,
        fragment: int,
        attempt: int,
        avoid: set[str],
        failed_round: bytes,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> pb.RendezvousResponse:
        """Find the round's leader and join its group. `avoid` (peers we blame on our own evidence) are skipped as
        leaders and named to the leader, which stops waiting for them."""
        assert self.d.leader is not None and self.d.channels is not None
        tried = set(avoid)
        gone: set[str] = set()  # leaders we could not reach: named to the next one, so it leads instead of sending
        # us back to a peer it has not noticed is dead (that made two survivors lead groups of one each)
        declined: set[str] = set()  # candidates that handed the lead on upwards: named to the next one likewise
        target: pb.PeerInfo | None = None
        # The leader may extend a group's deadline twice while it waits for a quorum (rendezvous.py); a shorter wait
        # here made members give up on a live leader, lead themselves and split the swarm.
        timeout = 3 * self.d.cfg.network.rendezvous_timeout + 10.0
        patient_until = time.monotonic() + self.d.cfg.network.rendezvous_timeout
        hops = 0
        waited = False  # for a held round's members, once
        while hops < 16:
            hops += 1
            if target is None and gone:
                # Our leader died mid-rendezvous: the round it formed with us may be streaming to us already, and
                # its members hold the group (round_registry.py). Else we formed a second group for the step.
                target = await self.registry.holder(self._held_round_member(tried), 0.0 if waited else HELD_WAIT_S)
                waited = True
            if target is None:
                # outbound-only peers never lead: nobody could dial them
                first = self._first_leader([p for p in self.d.membership.settled() if p.peer_id not in tried])
                candidates = [first] if first is not None else []
                if not candidates and self.d.me.outbound_only:
                    if await self.d.reach.wait_for_dialable(self.d.cfg.network.rendezvous_timeout):
                        continue
                    raise RoundFailed("no reachable peer to lead the round: this peer cannot be dialled either")
                target = candidates[0] if candidates else self.d.me
                if target.peer_id == self.d.identity.peer_id:
                    # The rule a leader applies to others applies to us: lead only while no lower live peer exists,
                    # settled or not, or we would wait in a group everyone else is redirected away from.
                    lower = self._first_leader([p for p in self.d.membership.alive() if p.peer_id not in tried])
                    target = lower if lower is not None and lower.peer_id < target.peer_id else target
            handed = self._handed_to(step, fragment, tried) if target.peer_id == self.d.identity.peer_id else None
            if handed is not None:  # we handed this round's lead on: join there, and say we do not lead it
                declined.add(target.peer_id)
                tried.add(target.peer_id)
                target = handed
            if target.peer_id == self.d.identity.peer_id:
                lineage = bytes(self.d.me.state_digest) if self.d.ranked else b""
                # As our own leader we act only on our own evidence (`avoid`): a member that aborts a round may name
                # any peer, and a hostile one named a different honest peer on each retry until the leader refused
                # them all and closed a group of one (a fork, seen in CI).
                return await self.d.leader.join(
                    step, fragment, self.d.me, sorted(avoid | gone), failed_round, False, lineage, tokens, list(carries)
                )
            mine = self.d.my_claim()
            req = sign(
                pb.RendezvousRequest(
                    step=step,
                    attempt=attempt,
                    suspects=sorted(avoid | gone),
                    declined=sorted(declined),
                    fragment=fragment,
                    failed_round=failed_round,
                    work=mine.work,
                    state_digest=mine.digest,
                    tokens=tokens,
                    members_base=self.my_list.digest,
                    carries=list(carries),
                ),
                "Rendezvous",
                self.d.identity,
                self.d.run_id,
            )
            if not await self._connect(target):
                # No connection at all while gossip through others shows the leader live: a route broken between
                # us (peerd/pairblocks.py). Not a suspect for the next leader: the others reach it.
                log.warning("round leader %s: no connection in %.0f s; trying the next", target.peer_id[:8], DIAL_S)
                tried.add(target.peer_id)
                self.d.membership.mark_unreachable(target.peer_id, why="rendezvous: no connection", dial="no_answer")
                target = None
                continue
            self.d.count_sent("rendezvous", 0, req.ByteSize())
            try:
                call = self.d.channels.rounds(target.address, target).Rendezvous(req, timeout=timeout)
                answer = faults.rendezvous_answer(step, call)
                resp = await self.watch.until_done(answer, [target.peer_id], leader=True, step=step, at=target.address)
            except LeaderMoved as exc:
                log.info("rendezvous with %s: asking again on a new connection (%s)", target.peer_id[:8], exc)
                target = exc.info
                continue
            except LeaderUndialable:
                # A route broken under an open connection: the call hung on it until now (a new dial meets the
                # 5 s check above).
                log.warning("round leader %s cannot be dialled from here; trying the next", target.peer_id[:8])
                tried.add(target.peer_id)
                target = None
                continue
            except PeerSilent as exc:
                log.warning("round leader %s went silent (%s); trying the next", target.peer_id[:8], exc)
                tried.add(target.peer_id)
                gone.add(target.peer_id)
                target = None
                continue
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in UNREACHABLE:
                    raise RoundFailed(f"rendezvous refused by {target.peer_id[:8]}: {exc.details()}") from exc
                log.warning("round leader %s unreachable (%s); trying the next", target.peer_id[:8], exc.code().name)
                tried.add(target.peer_id)
                gone.add(target.peer_id)
                how = dial_failure(exc)
                self.d.membership.mark_unreachable(target.peer_id, why=f"rendezvous {exc.code().name}", dial=how)
                target = None
                continue
            if resp.WhichOneof("result") == "redirect":
                nxt = resp.redirect
                if nxt.peer_id in gone:  # it has not noticed yet: ask again, naming the dead leader
                    await asyncio.sleep(0.05)
                    continue
                if nxt.peer_id in self.no_lead and time.monotonic() < patient_until:
                    # Our last round flagged that peer, so it may not lead this step. The target is still finishing
                    # that round (its rule is a step behind ours): following it sent us to a group nobody else
                    # joined, and we missed the step. Ask the target again once it has caught up.
                    hops -= 1
                    await asyncio.sleep(0.1)
                    continue
                if nxt.peer_id >= target.peer_id or nxt.peer_id in tried:
                    if nxt.peer_id > target.peer_id:
                        declined.add(target.peer_id)
                    tried.add(target.peer_id)
                    target = None
                else:
                    self.d.gossip.merge_gossip([nxt])
                    target = nxt
                continue
            if resp.WhichOneof("result") == "delta":
                try:
                    return pb.RendezvousResponse(group=self.my_list.rebuild(resp.delta, self.d.run_id))
                except DeltaError as exc:  # ask again for the whole group
                    log.warning("rendezvous: %s; asking %s for the whole group", exc, target.peer_id[:8])
                    self.my_list.forget()
                    continue
            return resp
        raise RoundFailed("rendezvous did not settle on a leader")

    async def wait_round(self, round_id: bytes, sender: str = "") -> Any:
        """Our round `round_id` for a member's stream, held while our rendezvous may hand it to us (round_registry.py);
        None: we are not in that round, and the member takes us for a lost owner."""
        return await self.registry.wait(round_id, sender)

    async def _connect(self, target: pb.PeerInfo) -> bool:
        """Wait up to DIAL_S for a connection to the leader `target`; False without one, or as soon as we learn we
        cannot dial it (peerd/pairblocks.py). A block found a moment into the wait still held the first round of a
        run for the whole 5 s, past the Streaming fragment's deadline, and the peer applied it alone (CI)."""
        assert self.d.channels is not None
        deadline = time.monotonic() + DIAL_S
        while (left := deadline - time.monotonic()) > 0:
            if self.d.membership.cannot_dial(target.peer_id):
                return False
            if await self.d.channels.ready(target.address, target, min(left, self.d.cfg.network.gossip_interval)):
                return True
        return False

    def _held_round_member(self, tried: set[str]) -> Callable[[str], pb.PeerInfo | None]:
        def usable(pid: str) -> pb.PeerInfo | None:
            info = self.d.membership.get(pid)
            m = self.d.membership
            ok = pid not in tried and info is not None and m.is_alive(pid) and dialable(info) and not m.cannot_dial(pid)
            return info if ok else None

        return usable

    def _watch_sources(self, round_id: bytes, rnd: ReduceRound, incarnations: dict[str, int]) -> asyncio.Task:
        """For the round and a while after it completed here: when a peer that sent us a whole shard looks gone (not
        live in gossip, or restarted), relay that shard to the next in line (shard_relay.py). Then unregister the
        round. At most LINGER_ROUNDS completed rounds linger, so fast swarms do not pile up held shards."""
        net = self.d.cfg.network

        async def watch() -> None:
            try:  # past the round's deadline every fallback gave up: nobody can ask
                while time.monotonic() < rnd.deadline and not rnd.failed:
                    await asyncio.sleep(net.gossip_interval)
                    for pid in {h.source for h in rnd.held.values()}:
                        if not self.d.membership.is_alive(pid) or self.watch.restarted(pid, incarnations):
                            rnd.source_gone(pid)
            finally:
                if self.rounds.get(round_id) is rnd and not rnd.failed:  # a failed one answers its abort until
                    self.rounds.pop(round_id, None)  # round_timeout (register_round)

        task = asyncio.ensure_future(watch())
        self._lingering.append(task)
        self._lingering = [t for t in self._lingering if not t.done()]
        while len(self._lingering) > LINGER_ROUNDS:
            self._lingering.pop(0).cancel()
        return task

    def _unreachable_at(self, peer_id: str, address: str, how: str) -> None:
        """A round's dial of `peer_id` at `address` failed (`how`: "refused" or "no_answer"): mark it unreachable,
        unless it announced another address since the group formed (it restarted elsewhere: this incarnation is
        alive)."""
        self.d.membership.mark_unreachable(peer_id, why="round dial failed", address=address, dial=how)

    def fail_round_with(self, round_id: bytes, peer_id: str, reason: str) -> None:
        """A member of our round `round_id` is refused here (banned, not admitted): abort the round naming it."""
        rnd = self.rounds.get(round_id)
        if isinstance(rnd, ReduceRound) and peer_id in rnd.ids:
            rnd.abort(RoundFailed(f"member {peer_id[:8]} is refused here ({reason})", {peer_id}, reason))

    async def _wait_out(self, step: int) -> None:
        """We sat `step` out: wait for the others' retry without us to finish it, then raise Behind (DiLoCo downloads
        that state and keeps our work) rather than rejoin the step with the same work, which that owner refuses
        again (each time a strike towards a ban there). Their leader waits for us up to a rendezvous timeout before
        it closes the group without us, and their round takes up to a round timeout: waiting only the first, we
        rejoined just as the group closed, three times, and were banned. The step not done by then: join it."""
        net = self.d.cfg.network
        until = time.monotonic() + net.rendezvous_timeout + net.round_timeout
        while time.monotonic() < until:
            done = max((self.d.membership.step_of(p) for p in self.d.membership.alive(include_self=False)), default=0)
            if done > step:
                raise Behind(done)
            await asyncio.sleep(net.gossip_interval / 2)
        log.info("step %d: the swarm has not finished it without us; joining it again", step)

    def register_round(self, round_id: bytes, rnd: Any) -> None:
        assert self.d.loop is not None
        self.registry.register(round_id, rnd)
        self.d.loop.call_later(self.d.cfg.network.round_timeout, self.rounds.pop, round_id, None)

    def stub_for(self, member: pb.PeerInfo) -> Any:
        assert self.d.channels is not None
        return self.d.channels.rounds(member.address, member)

    async def allreduce(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> RoundResult:
        """Average `vector` over the round's group, weighted by `tokens` (the work behind it) when every member
        claimed some: each member scales its own contribution by tokens_i / mean(tokens), so the owners' plain mean
        is the token-weighted mean and nothing on the wire changes. `carries`: sponsored peers whose work `vector`
        holds (peerd/sponsor.py), named to the leader for every member's record."""
        # Peers we blame for a failed attempt on our own evidence: not asked to lead, and named to the leader (it
        # stops waiting for them). Another member's word ("aborted") is neither: a hostile member may name any peer.
        avoid: set[str] = set()
        failed_round = b""
        t0 = time.perf_counter()
        if fragment < 0 and self.sat_out == step:
            self.sat_out = -1
            await self._wait_out(step)
        for attempt in range(6):
            t_rv = time.perf_counter()
            with self.registry.asking():  # held streams for rounds it does not hand us are answered after it
                resp = await self._rendezvous(step, fragment, attempt, avoid, failed_round, tokens, carries)
            if resp.WhichOneof("result") == "behind":
                raise Behind(resp.behind, resp.behind_ms / 1000)
            group = resp.group
            self.my_list.remember(group)
            mine = next((m for m in group.members if m.peer_id == self.d.identity.peer_id), None)
            if mine is not None and mine.incarnation != self.d.me.incarnation:
                # The leader still knew our previous process (we restarted while its round ran) and handed us that
                # round: our parts would arrive twice at its owners and abort it for everyone (seen at 64 peers).
                log.warning("step %d: the leader's round is our previous process's (this peer restarted during it); "
                            "downloading the swarm's state instead", step)  # fmt: skip
                raise Behind(step + 1)
            rendezvous_s = time.perf_counter() - t_rv
            faults.stall_loop_once()
            weight = member_weight(group, self.d.identity.peer_id)
            try:
                part_bytes = checked_part_bytes(group.part_bytes)
            except ValueError as exc:  # every member refuses the same group: the retry asks for a new one
                failed_round = bytes(group.round_id)
                if group.leader != self.d.identity.peer_id:
                    avoid.add(group.leader)
                log.warning("round for step %d (attempt %d) refused: %s; retrying", step, attempt, exc)
                continue
            incarnations = {m.peer_id: m.incarnation for m in group.members}
            rnd = ReduceRound(
                group,
                self.d.identity,
                self.d.run_id,
                faults.outsized(step, vector if weight == 1.0 else vector * weight),
                self.d.codec,
                self.d.executor,
                self.d.cfg.network.round_timeout,
                self.d.cfg.network.chunk_bytes,
                want_decoded,
                guard=self.d.guard,
                on_invalid=self.d.checks.invalid_contribution,
                part_bytes=part_bytes,
                weights=group_weights(group),
                on_unreachable=self._unreachable_at,
                seen_gone=lambda pid, inc=incarnations: self.d.membership.gone(pid, inc.get(pid, 0)),
            )
            self.register_round(group.round_id, rnd)
            watch = self._watch_sources(group.round_id, rnd, incarnations)
            # A group may hold a peer we banned (the leader has not): we still take part, so that every honest owner
            # sees that peer's data and bans it too; its streams to us are refused, which fails the round at once.
            try:
                result = await self.watch.until_done(
                    rnd.run(self.stub_for, self.d.verifier),
                    [m.peer_id for m in group.members],
                    rnd.member_lost,  # the round goes on without it (allreduce.py)
                    incarnations,
                    addresses={m.peer_id: m.address for m in group.members},
                )
                if result.lost and len(set(result.included)) < 2 <= len(rnd.ids):
                    # Every other member looked lost: owners that abort a round end our streams as dead ones do, and
                    # we fell back to reducing every shard ourselves. A round of us alone is a fork for this step
                    # while the others retry together (seen in CI): fail it and retry with them. Peers that really
                    # died leave a rendezvous of one, the honest solo step. Members that say their checks refused
                    # our data mean the owners we took for lost refused it too: we sit the step out.
                    refused_by = await rnd.refused_by()
                    if refused_by:
                        names = sorted(p[:8] for p in refused_by)
                        raise ContributionRefused(f"{names} failed their round on our contribution")
                    raise RoundFailed(f"every other member left the round ({len(result.lost)} lost)", set(), "aborted")
            except RoundFailed as exc:
                watch.cancel()
                failed_round = bytes(group.round_id)
                self.d.status.rounds_failed += 1
                if self.d.metrics is not None:
                    self.d.metrics.record_failure(exc.reason)
                    self.d.metrics.record_round("failed", peers=0, total_seconds=time.perf_counter() - t0)
                # "aborted" suspects are another member's word, and a hostile member may name an honest peer: a member
                # that skipped an honest leader on its word led a group of its own (with the hostile peer) and the
                # swarm split for the step; a leader that refused them closed a group of one. The member whose own
                # evidence it was names them to the leader itself.
                if exc.reason != "aborted":
                    avoid |= exc.suspects - {self.d.identity.peer_id}
                    self.d.timing.local.failed(exc.suspects)
                    for s in exc.suspects:
                        self.d.membership.mark_unreachable(s, why=f"failed round: {exc.reason}")
                if isinstance(exc, ContributionRefused):  # the same work would be refused again: see roundtypes.py
                    self.sat_out = step
                    self.d.status.steps_sat_out += 1
                    if self.d.metrics is not None:
                        self.d.metrics.steps_sat_out.inc()
                    log.warning("round for step %d: %s; sitting this step out, our work carries into the next round",
                                step, exc)  # fmt: skip
                    raise
                log.warning("round for step %d (attempt %d) failed: %s; retrying", step, attempt, exc)
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            result.stats.seconds = time.perf_counter() - t0
            if result.lost:
                log.warning(
                    "round for step %d survived the loss of %s mid-round (%d shard(s) from a fallback owner); "
                    "it included %d of %d members",
                    step, sorted(p[:8] for p in result.lost), result.fallbacks, len(result.included), len(rnd.ids),
                )  # fmt: skip
            if weight != 1.0 and result.sent_decoded is not None:
                result.sent_decoded.div_(weight)  # error feedback works in the unscaled units of `vector`
            # Done here: it stays registered while `watch` lingers (a lost owner's shard we hold may be asked for:
            # shard_relay.py), holding the averaged shards we received and nothing else (not `vector`).
            rnd.finished()
            in_round = set(result.included)
            result.carried = [c for c, by in zip(group.carried, group.carried_by, strict=False) if by in in_round]
            result.join_offset_s = join_offset_s(group, self.d.identity.peer_id)
            if fragment < 0:  # they all finished `step` with us: do not wait for gossip to say so
                self.d.membership.note_round(step + 1, list(result.included))  # not those that left mid-round
            self.book.record_round(group, result, fragment, rendezvous_s=rendezvous_s)
            # a member's slowest stream to us: its contribution to our shard, or its averaged shard back
            streams = dict(rnd.stream_s)
            for pid, (sec, n) in rnd.reply_stream_s.items():
                if pid not in streams or n / max(sec, 1e-6) < streams[pid][1] / max(streams[pid][0], 1e-6):
                    streams[pid] = (sec, n)
            self.book.observe_timings(group, rnd.arrival_s, streams, rnd.reply_s)
            self.no_lead = set(group.no_shards)
            return result
        raise RoundFailed(f"round for step {step} failed {attempt + 1} times")
