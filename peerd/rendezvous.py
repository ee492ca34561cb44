"""DiLoCo rendezvous: the peers ready for outer step t agree on that round's group within a deadline.

The leader of a round is the settled live peer with the lowest id (see Membership.settled). It is only a
coordinator: it holds no data and any live peer can take the role, so its death costs one retry, not the run. A peer
asked to lead while it knows any lower-id live peer, settled or not, redirects to it; ids strictly decrease along
redirects, so they cannot loop, and a peer that only just joined cannot make two leaders out of peers whose settle
windows differ. The leader closes a group when every expected peer (live, at step t, not suspected) has joined, or when
the rendezvous deadline passes; members beyond that are told they are behind and must resync state.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from peerd.layout import part_bytes_for
from peerd.membership import Membership
from peerd.v1 import peerd_pb2 as pb

Key = tuple[int, int, bytes]  # (step, fragment, lineage: the state digest the members start from; b"": any)


@dataclass
class _Pending:
    key: Key
    generation: int  # the leader's count of groups for this key (a retry after a failed round is the next one)
    expected: set[str]
    joined: dict[str, pb.PeerInfo] = field(default_factory=dict)
    deadline: float = 0.0
    result: asyncio.Future | None = None
    extensions: int = 0
    refused: set[str] = field(default_factory=set)  # kept out even if they ask to join (RendezvousLeader._refused)
    tokens: dict[str, int] = field(default_factory=dict)  # each joiner's claimed tokens behind its contribution
    grace_armed: bool = False  # windowed runs: the straggler grace started (a majority joined)
    joined_at: dict[str, float] = field(default_factory=dict)  # monotonic time of each member's (first) join
    carries: dict[str, list[str]] = field(default_factory=dict)  # member -> the sponsored peers its contribution holds
    passed: set[str] = field(default_factory=set)  # fragment rounds: peers that joined a later step, not this one


class Behind(Exception):
    """The caller's step is already done in the swarm; it must download state. `step` is the newest known step."""

    def __init__(self, step: int, since_s: float = 0.0) -> None:
        super().__init__(f"behind: swarm is at step {step}")
        self.step = step
        # how long ago the round we missed formed at its leader (0: unknown): where the swarm's window clock stands
        self.since_s = since_s


class RendezvousLeader:
    """Leader-side bookkeeping: at most one open group per (step, fragment, lineage).

    Members' attempt counters are not part of the key: a retry after a failed round opens the next group only when a
    member names the group it failed in (`failed_round`), and every other request for the step joins the open group.
    So honest peers cannot form two groups for one step here, whatever their attempt counters say.

    The lineage is the digest of the state the members start the round from (DiLoCo and Streaming). A round only
    merges peers that hold the same global state: averaged pseudo-gradients applied to different globals leave them
    different. So after a split heals, each half's groups stay apart (and neither blocks the other with a closed
    group of its own lineage) until the losing half adopts the winner's state and, with it, the winner's lineage.
    """

    def __init__(
        self,
        membership: Membership,
        run_id: bytes,
        timeout_s: float,
        my_step: Callable[[], int],
        straggler_grace_s: float = 0.0,
        flagged: Callable[[str], bool] = lambda peer_id: False,
        stream_rate: Callable[[str], float] = lambda peer_id: 0.0,
    ) -> None:
        self.membership = membership
        # Windowed runs (inner.window_s): once a majority joined, close within this many seconds rather than wait
        # for the slowest peer; a straggler is told `behind` and carries its work into the next round.
        self.straggler_grace_s = straggler_grace_s
        self.flagged = flagged  # flagged slow/faulty by the swarm (peerd/timings.py): no shards for them
        self.stream_rate = stream_rate  # bytes/s we measured of a member's round streams (0: unknown): part size
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.my_step = my_step
        self.pending: dict[Key, _Pending] = {}
        self.closed: dict[Key, pb.Group] = {}
        self.blamers: dict[Key, dict[str, set[str]]] = {}  # suspect -> the joiners that named it, across generations
        self.newest_step = -1  # the highest step anyone asked us about: a sign that we ourselves are behind
        self.skipping: set[tuple[int, int]] = set()  # (step, fragment) rounds our own peer will not join
        self.handed: dict[tuple[int, int], str] = {}  # (step, fragment) -> the peer we handed its lead on to
        self.formed_at: dict[Key, float] = {}  # closed groups: monotonic time their first member joined

    async def join(
        self,
        step: int,
        fragment: int,
        info: pb.PeerInfo,
        suspects: list[str],
        failed_round: bytes = b"",
        behind_me: bool = False,
        lineage: bytes = b"",
        tokens: int = 0,
        carries: list[str] | None = None,
    ) -> pb.RendezvousResponse:
        """Register `info` for the round and wait until its group closes. `behind_me`: the caller's state ranks
        below ours and our step is ahead of its step, so its round is already done (peerd/consistency.py).
        `tokens`: the work behind the caller's contribution, its weight in the average. `carries`: the sponsored
        peers whose work rides in it (peerd/sponsor.py), named in the group so every member's record shows them."""
        self.newest_step = max(self.newest_step, step)
        if info.peer_id == self.membership.self_id and fragment < 0:
            # We moved on to `step` (a round, or a downloaded state): groups still open for earlier steps wait for a
            # state nobody holds any more; their members resync rather than wait out the deadlines.
            self.on_ahead(step)
        key = (step, fragment, lineage)
        pend = self.pending.get(key)
        if pend is None:
            done = self.closed.get(key)
            if done is not None and not done.members and fragment < 0 and not behind_me and not self._past(step):
                # Closed empty (we or gossip had gone past `step` then, as on_ahead and _close judged) and nobody is
                # past it now: no round ran, so that group proves nothing. After a split healed, a leader that had
                # led its side to a later step and then adopted the other side's state kept its empty group for that
                # state's step, and told every peer "behind" there for good: 5 peers at one state, none training.
                del self.closed[key]
                attempt, done = done.attempt + 1, None
            else:
                attempt = 0 if done is None else done.attempt + 1
            if done is not None and failed_round != done.round_id:
                if any(m.peer_id == info.peer_id and m.incarnation == info.incarnation for m in done.members):
                    return pb.RendezvousResponse(group=done)  # a member asking again; a restarted one is behind
                return pb.RendezvousResponse(behind=step + 1, behind_ms=self._formed_ms_ago(key))
            if fragment < 0 and behind_me:
                return pb.RendezvousResponse(behind=self.my_step())
            if fragment >= 0 and self._majority_elsewhere(key):
                return pb.RendezvousResponse(behind=step + 1)
            pend = self._open(key, attempt)
        # Who is kept out of the group even if it asks to join: a peer the leader blames (from its own failed
        # attempts at this step), or one that two members blame on their own evidence. A corrupt sender otherwise
        # rejoined every retry until it was banned. One joiner's word neither keeps a peer out nor stops us waiting
        # for it: the corrupt peer of a failed round, naming both honest members, made the leader close its retry
        # group with itself alone (seen in CI); a peer that is really gone drops out at the deadline instead.
        blamers = self.blamers.setdefault(key, {})
        for pid in set(suspects[:64]) - {info.peer_id}:  # a bounded word: a group is never that large
            blamers.setdefault(pid, set()).add(info.peer_id)
        refused = self._refused(key)
        if refused - pend.refused:
            pend.refused |= refused
            for pid in pend.refused:
                pend.joined.pop(pid, None)
        pend.expected -= pend.refused
        live = {p.peer_id for p in self.membership.alive() if not p.sponsor}  # ours is the evidence that counts: a
        # dead peer drops out, and so does one that turned sponsored (its work comes through its sponsor)
        pend.expected = {p for p in pend.expected if p in live or p in pend.joined}
        if info.peer_id not in pend.refused:
            pend.expected.add(info.peer_id)
            pend.joined[info.peer_id] = info
            pend.tokens[info.peer_id] = max(int(tokens), 0)
            pend.carries[info.peer_id] = sorted(set(carries[:8]) - {info.peer_id}) if carries else []
            pend.joined_at.setdefault(info.peer_id, time.monotonic())
        if fragment >= 0:
            self._not_coming(key, pend, info.peer_id)
            self._moved_past(step, info.peer_id)
        if pend.expected <= set(pend.joined):
            self._close(key)
        elif self.straggler_grace_s > 0 and not pend.grace_armed and 2 * len(pend.joined) > len(pend.expected):
            pend.grace_armed = True
            asyncio.get_running_loop().call_later(self.straggler_grace_s, self._close_if_open, key, pend)
        assert pend.result is not None
        group = await asyncio.shield(pend.result)
        if not any(m.peer_id == info.peer_id for m in group.members):
            return pb.RendezvousResponse(behind=step + 1, behind_ms=self._formed_ms_ago(key))
        return pb.RendezvousResponse(group=group)

    def _formed_ms_ago(self, key: Key) -> int:
        """How long ago the closed group of `key` formed (its first member joined), for a caller told `behind`: a
        late peer that started its next window at "now" after resyncing missed the swarm's next round too (its pile
        then two windows long, dropped), where one that starts it at the swarm's boundary meets it."""
        formed = self.formed_at.get(key)
        return 0 if formed is None else min(int(1000 * (time.monotonic() - formed)), 2**32 - 1)

    def skip(self, step: int, fragments: list[int]) -> None:
        """Our own peer will not join these fragment rounds of `step` (Streaming: it adopted a state at the boundary
        where they start, after the swarm had started them). As their leader it must not expect itself: a joiner with
        the lowest id that downloaded the state a moment before the swarm's boundary made the others wait out a
        deadline (8 s) for it, and 24 s when they fell into two groups (seen in CI)."""
        me = self.membership.self_id
        self.skipping = {(t, f) for t, f in self.skipping if t >= step - 2}  # bounded: only recent steps matter
        for fragment in fragments:
            self.skipping.add((step, fragment))
            for key, pend in list(self.pending.items()):
                if key[:2] == (step, fragment) and me not in pend.joined:
                    pend.expected.discard(me)
                    if pend.joined and pend.expected <= set(pend.joined):
                        self._close(key)

    def hand_on(self, step: int, fragment: int, peer_id: str) -> None:
        """We passed the lead of this round up to `peer_id` (we lagged the round's step, or may not lead): it keeps
        that leader even once we catch up. A joiner that handed a fragment round on while its state download was in
        flight led the same round a moment later, when the next member asked it, and split the swarm between two
        groups: one member waited out both extensions alone (24 s, seen in CI)."""
        self.handed = {k: v for k, v in self.handed.items() if k[0] >= step - 2}  # bounded: recent steps only
        self.handed.setdefault((step, fragment), peer_id)

    def handed_to(self, step: int, fragment: int) -> str | None:
        return self.handed.get((step, fragment))

    def _refused(self, key: Key) -> set[str]:
        """Peers kept out of the key's groups: blamed by the leader itself or by two members."""
        me = self.membership.self_id
        return {p for p, by in self.blamers.get(key, {}).items() if me in by or len(by) >= 2}

    def _open(self, key: Key, generation: int) -> _Pending:
        step = key[0]
        loop = asyncio.get_running_loop()
        m = self.membership

        lineage = key[2]

        def at(p: pb.PeerInfo) -> int:  # our own step is known live; others' from gossip and shared rounds
            return self.my_step() if p.peer_id == m.self_id else m.step_of(p)

        def other_lineage(p: pb.PeerInfo) -> bool:  # at this step, holding another state: it will not come
            return bool(lineage) and p.outer_step == step and bool(p.state_digest) and p.state_digest != lineage

        expected = {
            p.peer_id
            for p in m.alive()
            # peers at step-1 may have finished that round a moment ago without gossip saying so yet
            if at(p) in (step - 1, step) and not p.left and not p.finished and not other_lineage(p) and not p.sponsor
        }
        if key[:2] in self.skipping:
            expected.discard(m.self_id)
        pend = _Pending(
            key,
            generation,
            expected,
            deadline=time.monotonic() + self.timeout_s,
            result=loop.create_future(),
            refused=self._refused(key),
        )
        self.pending[key] = pend
        loop.call_later(self.timeout_s, self._on_deadline, key, pend)
        if key[1] < 0:
            loop.call_later(self._watch_s(), self._watch, key, pend)
        return pend

    def _watch_s(self) -> float:
        return min(1.0, self.timeout_s / 4)

    def _watch(self, key: Key, pend: _Pending) -> None:
        """While a group waits, check whether the swarm went past its step (the test `_close` applies): a leader
        that had just joined saw the others' steps seconds stale, expected them, and waited out its deadline while
        they trained on without it; closed empty, its members download the swarm's state at once."""
        if self.pending.get(key) is not pend:
            return
        if self._swarm_went_on(key[0], len(pend.joined)):
            pend.joined.clear()
            self._close(key)
            return
        sponsored = self.membership.sponsored()
        if pend.expected & sponsored:  # it turned sponsored while we waited for it: its sponsor brings its work
            pend.expected -= sponsored - set(pend.joined)
            if pend.joined and pend.expected <= set(pend.joined):
                self._close(key)
                return
        asyncio.get_running_loop().call_later(self._watch_s(), self._watch, key, pend)

    def _past(self, step: int) -> bool:
        """Are we, or is any live peer by gossip, past `step` now?"""
        m = self.membership
        return self.my_step() > step or any(m.step_of(p) > step for p in m.alive() if p.peer_id != m.self_id)

    def _swarm_went_on(self, step: int, joined: int) -> bool:
        """At least as many live peers are past `step` as joined its group here: the swarm went on under another
        leader (its view of who may lead differed from ours, e.g. about a peer on a slow link, or ours was stale)."""
        m = self.membership
        ahead = sum(1 for p in m.alive() if p.peer_id != m.self_id and m.step_of(p) > step)
        return ahead > 0 and ahead >= joined

    def _not_coming(self, key: Key, pend: _Pending, joiner: str) -> None:
        """Fragment rounds: a peer that joined this round from another state (lineage) here will not come to ours,
        and the joiner will not come to theirs. Neither group waits for the other's members: the majority waited a
        whole deadline, every fragment round, for a peer that had just downloaded a state and joined alone."""
        elsewhere: set[str] = set()
        for other, group in self.closed.items():
            if other[:2] == key[:2] and other != key:
                elsewhere.update(p.peer_id for p in group.members)
        for other, sibling in list(self.pending.items()):
            if other[:2] != key[:2] or other == key:
                continue
            elsewhere.update(sibling.joined)
            if joiner not in sibling.joined:
                sibling.expected.discard(joiner)
                if len(sibling.joined) >= 2 and sibling.expected <= set(sibling.joined):
                    self._close(other)  # all its own are in; one alone waits for its deadline (or a majority)
        pend.expected -= elsewhere - set(pend.joined)

    def _moved_past(self, step: int, joiner: str) -> None:
        """Fragment rounds: a peer joining a round of `step` joined (or gave up) every round of an earlier step, as
        each peer's fragments sync in schedule order, so open groups of earlier steps stop waiting for it. One that a
        majority of the live peers passed this way is a minority's round the swarm left behind: it closes empty and
        its members resync. A peer that downloaded the state just as the swarm moved on led such a group alone (it had
        the lowest id) and waited out a deadline and both extensions, 24 s, while the others' rounds waited for it
        (seen in CI). Members waiting in a group for a slow peer are untouched: they joined it."""
        alive = len(self.membership.alive())
        for key, pend in list(self.pending.items()):
            if key[0] >= step or key[1] < 0 or joiner in pend.joined or pend.result is None or pend.result.done():
                continue
            pend.passed.add(joiner)
            pend.expected.discard(joiner)
            if 2 * len(pend.passed) > alive:
                pend.joined.clear()
                self._close(key)
            elif len(pend.joined) >= 2 and pend.expected <= set(pend.joined):
                self._close(key)

    def _holds_majority(self, group: pb.Group) -> bool:
        return 2 * len(group.members) > len(self.membership.alive())

    def _majority_elsewhere(self, key: Key) -> bool:
        """A group closed for this fragment round from another state (lineage) holds a majority of the live peers:
        the state of `key` is a minority's, which that round leaves behind. Fragment rounds only: there peers past
        the step may still join (the last fragment syncs at the boundary), so `_swarm_went_on` cannot tell."""
        return any(
            other[:2] == key[:2] and other != key and self._holds_majority(group)
            for other, group in self.closed.items()
        )

    def _leave_minorities_behind(self, key: Key, group: pb.Group) -> None:
        """A majority's fragment round just closed: groups still open for the same round from other states close
        empty, so their members resync at once (from the state they are now behind) instead of waiting out the
        deadline and its extensions for peers that are in this round. A peer that downloaded a state just before the
        swarm's next merge joined with the older lineage alone and waited 9 s (three 3 s deadlines) per fragment
        round, twice in a row, after a heal (tests/test_partition.py, streaming)."""
        if key[1] < 0 or not self._holds_majority(group):
            return
        for other, pend in list(self.pending.items()):
            if other[:2] == key[:2] and other != key and len(pend.joined) < len(group.members):
                pend.joined.clear()
                self._close(other)

    def on_ahead(self, step: int) -> None:
        """Someone asked about a later step: pending groups for earlier steps cannot be the swarm's round; close them
        empty so their members resync instead of applying a round the rest of the swarm never saw."""
        self.newest_step = max(self.newest_step, step)
        for key, pend in list(self.pending.items()):
            if key[0] < step and pend.result is not None and not pend.result.done():
                pend.joined.clear()
                self._close(key)

    def _on_deadline(self, key: Key, pend: _Pending) -> None:
        """Close at the deadline, unless fewer than a majority of the live expected peers joined: then wait up to
        two more deadlines, so a minority that was quicker (e.g. after a failed round) cannot move the swarm's
        state ahead on its own and make the majority download it."""
        if self.pending.get(key) is not pend:
            return
        m = self.membership
        step = key[0]
        # Still expected: live, and not known to be past this step (after a heal, peers that downloaded a newer
        # state will never come; waiting for a majority that includes them only delays the members who did).
        lineage = key[2]
        waiting = {
            p.peer_id
            for p in m.alive()
            if ((self.my_step() if p.peer_id == m.self_id else m.step_of(p)) <= step or key[1] >= 0)
            and not (lineage and p.outer_step == step and p.state_digest and p.state_digest != lineage)
            and not p.sponsor  # its work comes through its sponsor, whenever its link gets it there
            and not (p.peer_id == m.self_id and key[:2] in self.skipping)
        }
        pend.expected = {p for p in pend.expected if p in waiting} | set(pend.joined)
        if 2 * len(pend.joined) <= len(pend.expected) and pend.extensions < 2:
            pend.extensions += 1
            asyncio.get_running_loop().call_later(self.timeout_s, self._on_deadline, key, pend)
            return
        self._close(key)

    def _close_if_open(self, key: Key, pend: _Pending) -> None:
        if self.pending.get(key) is pend:
            self._close(key)

    def _close(self, key: Key) -> None:
        pend = self.pending.pop(key, None)
        if pend is None or pend.result is None or pend.result.done():
            return
        step, fragment, _ = key
        if fragment < 0 and self._swarm_went_on(step, len(pend.joined)):
            # Closing with the few that came made them train alone on a fork; empty, they download the swarm's
            # state instead.
            pend.joined.clear()
        members = [round_entry(p) for p in sorted(pend.joined.values(), key=lambda p: p.peer_id)]
        group = pb.Group(
            step=step,
            attempt=pend.generation,
            fragment=fragment,
            members=members,
            expected=sorted(pend.expected),
            leader=self.membership.self_id,
            tokens=capped_tokens([pend.tokens.get(p.peer_id, 0) for p in members]),
        )
        ids = {p.peer_id for p in members}
        for p in members:
            for carried in pend.carries.get(p.peer_id, []):
                if carried not in ids and carried not in group.carried:
                    group.carried.append(carried)
                    group.carried_by.append(p.peer_id)
        # No shards for members the swarm flags (they would slow every shard they own) nor for members a live peer
        # cannot dial (peerd/pairblocks.py: that peer's contribution could not reach them), while someone still can.
        unreached = self.membership.named_unreachable(members)
        owners = [p for p in members if not p.outbound_only and p.peer_id not in unreached]
        if owners:
            group.no_shards.extend(p.peer_id for p in members if not p.outbound_only and p.peer_id in unreached)
        else:
            owners = [p for p in members if not p.outbound_only]
        flagged = [p.peer_id for p in owners if self.flagged(p.peer_id)]
        if len(flagged) < len(owners):  # someone must still own shards
            group.no_shards.extend(flagged)
        group.part_bytes = part_bytes_for(self.stream_rate(p.peer_id) for p in members)
        first = min(pend.joined_at.values(), default=0.0)
        group.join_lag_ms.extend(int(1000 * (pend.joined_at.get(p.peer_id, first) - first)) for p in members)
        group.round_id = round_id(self.run_id, group)
        self.closed[key] = group
        if pend.joined_at:
            self.formed_at[key] = first
        if len(self.closed) > 256:  # keep a bounded history
            for old in sorted(self.closed)[:64]:
                del self.closed[old]
                self.blamers.pop(old, None)
                self.formed_at.pop(old, None)
        pend.result.set_result(group)
        self._leave_minorities_behind(key, group)


def round_entry(info: pb.PeerInfo) -> pb.PeerInfo:
    """What a round needs of a member: who it is, how to dial it (address, certificate, relay) and which process it is.
    The leader answers every member with every entry (n^2 per round): the full gossip entry (its signature, digests,
    verdicts) was 259 bytes of the leader's 1.06 MB per round at 64 peers, more than half a round's own bytes."""
    return pb.PeerInfo(
        peer_id=info.peer_id, public_key=info.public_key, address=info.address, incarnation=info.incarnation,
        tls_cert=info.tls_cert, outbound_only=info.outbound_only, relay=info.relay, relays=info.relays,
    )  # fmt: skip


def round_id(run_id: bytes, group: pb.Group) -> bytes:
    """A round's id binds run, step, fragment, the leader's generation, the leader, the ordered member list, and the
    weights, shard owners, part size and sponsored peers the leader picked."""
    h = hashlib.sha256(run_id)
    h.update(f"{group.step}/{group.fragment}/{group.attempt}/{group.leader}".encode())
    for m in group.members:
        h.update(m.peer_id.encode())
    if group.tokens:
        h.update(b"tokens:" + ",".join(str(t) for t in group.tokens).encode())
    if group.no_shards:
        h.update(b"no_shards:" + ",".join(group.no_shards).encode())
    if group.part_bytes:
        h.update(b"part_bytes:%d" % group.part_bytes)
    if group.carried:
        pairs = zip(group.carried, group.carried_by, strict=False)  # unequal lengths change the id: count them in
        h.update(f"carried:{len(group.carried)}/{len(group.carried_by)}:".encode())
        h.update(",".join(f"{c}<{b}" for c, b in pairs).encode())
    return h.digest()


MAX_WEIGHT_RATIO = 4  # a member's claimed tokens count for at most this many times the group's median claim


def capped_tokens(claims: list[int]) -> list[int]:
    """The leader's weights for a group: claims are the members' word, so none may count for more than
    MAX_WEIGHT_RATIO x the lower median (a liar cannot outweigh the honest majority by more than that, and norm
    screening still judges what it sends). Any member without a claim (0) makes the round unweighted: []."""
    if not claims or min(claims) <= 0:
        return []
    ordered = sorted(claims)
    cap = MAX_WEIGHT_RATIO * ordered[(len(ordered) - 1) // 2]
    return [min(c, cap) for c in claims]


def group_weights(group: pb.Group) -> list[float] | None:
    """Every member's weight, in member order: the factor it scales its contribution by, so that the owners' plain
    mean over n members is the token-weighted mean, w_i = tokens_i / mean(tokens). None when the group is unweighted
    or all claims are equal (every weight 1.0). An owner needs them whenever any member scaled its vector, whatever
    its own weight is: with claims [32, 64, 96] the middle member's own weight is exactly 1.0, yet its shard's subset
    means and its norm screen need the others'."""
    tokens = list(group.tokens)
    if len(tokens) != len(group.members) or len(set(tokens)) <= 1:
        return None
    total = sum(tokens)
    return [t * len(tokens) / total for t in tokens]


def member_weight(group: pb.Group, peer_id: str) -> float:
    """The factor this member scales its own contribution by (group_weights); 1.0 when unweighted or not a member."""
    weights = group_weights(group)
    index = next((i for i, m in enumerate(group.members) if m.peer_id == peer_id), None)
    return 1.0 if weights is None or index is None else weights[index]


def included_tokens(group: pb.Group, included: list[str]) -> list[int]:
    """Each included peer's weight in the round (its capped token claim), in `included` order; [] if unweighted."""
    if len(group.tokens) != len(group.members):
        return []
    by_peer = {m.peer_id: t for m, t in zip(group.members, group.tokens, strict=True)}
    return [by_peer.get(pid, 0) for pid in included]
