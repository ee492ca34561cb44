"""DiLoCo rendezvous: the peers ready for outer step t agree on that round's group within a deadline.

The leader of a round is the settled live peer with the lowest id (see Membership.settled). It is only a
coordinator: it holds no data and any live peer can take the role, so its death costs one retry, not the run. A peer
asked to lead while it knows a lower-id settled peer redirects to it; ids strictly decrease along redirects, so they
cannot loop. The leader closes a group when every expected peer (live, at step t, not suspected) has joined, or when
the rendezvous deadline passes; members beyond that are told they are behind and must resync state.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from peerd.membership import Membership
from peerd.v1 import peerd_pb2 as pb


@dataclass
class _Pending:
    key: tuple[int, int, int]  # (step, fragment, attempt)
    expected: set[str]
    joined: dict[str, pb.PeerInfo] = field(default_factory=dict)
    deadline: float = 0.0
    result: asyncio.Future | None = None
    extensions: int = 0
    refused: set[str] = field(default_factory=set)  # peers the leader itself blames for this step's failed attempts


class Behind(Exception):
    """The caller's step is already done in the swarm; it must download state. `step` is the newest known step."""

    def __init__(self, step: int) -> None:
        super().__init__(f"behind: swarm is at step {step}")
        self.step = step


class RendezvousLeader:
    """Leader-side bookkeeping: pending groups per (step, fragment, attempt)."""

    def __init__(
        self,
        membership: Membership,
        run_id: bytes,
        timeout_s: float,
        my_step: Callable[[], int],
    ) -> None:
        self.membership = membership
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.my_step = my_step
        self.pending: dict[tuple[int, int, int], _Pending] = {}
        self.closed: dict[tuple[int, int, int], pb.Group] = {}
        self.newest_step = -1  # the highest step anyone asked us about: a sign that we ourselves are behind

    def leader_for(self) -> pb.PeerInfo:
        return self.membership.settled()[0]

    async def join(
        self, step: int, fragment: int, attempt: int, info: pb.PeerInfo, suspects: list[str]
    ) -> pb.RendezvousResponse:
        """Register `info` for the round and wait until its group closes."""
        self.newest_step = max(self.newest_step, step)
        key = (step, fragment, attempt)
        done = self.closed.get(key)
        if done is not None:
            if any(m.peer_id == info.peer_id for m in done.members):
                return pb.RendezvousResponse(group=done)
            return pb.RendezvousResponse(behind=step + 1)
        if fragment < 0 and step < self.my_step():
            return pb.RendezvousResponse(behind=self.my_step())
        pend = self.pending.get(key)
        if pend is None:
            loop = asyncio.get_running_loop()
            expected = {
                p.peer_id
                for p in self.membership.alive()
                # peers at step-1 may have finished that round a moment ago without gossip saying so yet
                if p.outer_step in (step - 1, step) and not p.left and p.peer_id not in suspects
            }
            pend = _Pending(key, expected, deadline=time.monotonic() + self.timeout_s, result=loop.create_future())
            self.pending[key] = pend
            loop.call_later(self.timeout_s, self._on_deadline, key)
        if info.peer_id == self.membership.self_id:
            # The leader's own blame (from its failed attempts at this step) keeps those peers out of the group even
            # if they ask to join: a corrupt sender otherwise rejoined every retry until it was banned. A joiner's
            # blame only stops us waiting for the peer it names, so a hostile joiner cannot exclude anyone.
            pend.refused |= set(suspects) - {info.peer_id}
            for pid in pend.refused:
                pend.joined.pop(pid, None)
        pend.expected -= set(suspects)
        if info.peer_id not in pend.refused:
            pend.expected.add(info.peer_id)
            pend.joined[info.peer_id] = info
        if pend.expected <= set(pend.joined):
            self._close(key)
        assert pend.result is not None
        group = await asyncio.shield(pend.result)
        if not any(m.peer_id == info.peer_id for m in group.members):
            return pb.RendezvousResponse(behind=step + 1)
        return pb.RendezvousResponse(group=group)

    def on_ahead(self, step: int) -> None:
        """Someone asked about a later step: pending groups for earlier steps cannot be the swarm's round; close them
        empty so their members resync instead of applying a round the rest of the swarm never saw."""
        self.newest_step = max(self.newest_step, step)
        for key, pend in list(self.pending.items()):
            if key[0] < step and pend.result is not None and not pend.result.done():
                pend.joined.clear()
                self._close(key)

    def _on_deadline(self, key: tuple[int, int, int]) -> None:
        """Close at the deadline, unless fewer than a majority of the live expected peers joined: then wait up to
        two more deadlines, so a minority that was quicker (e.g. after a failed round) cannot move the swarm's
        state ahead on its own and make the majority download it."""
        pend = self.pending.get(key)
        if pend is None:
            return
        alive = {p.peer_id for p in self.membership.alive()}
        pend.expected = {p for p in pend.expected if p in alive} | set(pend.joined)
        if 2 * len(pend.joined) <= len(pend.expected) and pend.extensions < 2:
            pend.extensions += 1
            asyncio.get_running_loop().call_later(self.timeout_s, self._on_deadline, key)
            return
        self._close(key)

    def _close(self, key: tuple[int, int, int]) -> None:
        pend = self.pending.pop(key, None)
        if pend is None or pend.result is None or pend.result.done():
            return
        members = sorted(pend.joined.values(), key=lambda p: p.peer_id)
        step, fragment, attempt = key
        group = pb.Group(
            step=step,
            attempt=attempt,
            fragment=fragment,
            members=members,
            expected=sorted(pend.expected),
            leader=self.membership.self_id,
        )
        group.round_id = round_id(self.run_id, group)
        self.closed[key] = group
        if len(self.closed) > 256:  # keep a bounded history
            for old in sorted(self.closed)[:64]:
                del self.closed[old]
        pend.result.set_result(group)


def round_id(run_id: bytes, group: pb.Group) -> bytes:
    """A round's id binds run, step, fragment, attempt and the ordered member list."""
    h = hashlib.sha256(run_id)
    h.update(f"{group.step}/{group.fragment}/{group.attempt}/{group.leader}".encode())
    for m in group.members:
        h.update(m.peer_id.encode())
    return h.digest()
