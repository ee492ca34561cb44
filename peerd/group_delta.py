"""Rendezvous answers as changes to a member list the member already holds.

The leader answers every member of a group with that group (rendezvous.py). Sent whole, that is n member entries to
each of n members: n^2 entries per round, all sent by one peer (558 KB per round at 64 peers, more than that peer's
share of the round itself). Consecutive groups mostly hold the same members, so a member names the member list of
the last group it received, by digest, and the leader sends only what changed: the entries that are new, and the
indices of the old ones that are gone. Under churn that is one or two entries per round; a restarted peer's entry
changes (its incarnation), so it counts as one gone and one new.

The member rebuilds the whole group and checks it against the round id, which binds the ordered member ids
(rendezvous.round_id). A leader that does not hold the named list (another leader closed that group), or a change
as large as the list, answers with the whole group; a member that cannot rebuild an answer forgets its list and
asks again for the whole group.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from peerd.rendezvous import round_id
from peerd.v1 import peerd_pb2 as pb

DIGEST_BYTES = 16
KEEP_LISTS = 16  # member lists a leader keeps to answer against: the groups of its last few rounds and fragments
MAX_ADDED = 1 << 16  # new entries one answer may carry (a group is far smaller)


class DeltaError(ValueError):
    """A delta answer that does not rebuild a group here."""


def _body(member: pb.PeerInfo) -> bytes:
    return member.SerializeToString(deterministic=True)


def members_digest(members: Sequence[pb.PeerInfo]) -> bytes:
    """Names a member list, entries and order: two lists with one digest hold the same bytes."""
    h = hashlib.sha256(b"peerd-members")
    for m in members:
        body = _body(m)
        h.update(len(body).to_bytes(4, "big") + body)
    return h.digest()[:DIGEST_BYTES]


def make_delta(group: pb.Group, base: Sequence[pb.PeerInfo], digest: bytes) -> pb.GroupDelta | None:
    """`group` as changes from `base` (named `digest`), or None when the whole group is as short or the member can
    not rebuild it exactly (members not in peer-id order, or a member the leader did not expect)."""
    ids = [m.peer_id for m in group.members]
    if ids != sorted(set(ids)) or not set(ids) <= set(group.expected) or list(group.expected) != sorted(group.expected):
        return None
    wanted = {_body(m) for m in group.members}
    kept: set[bytes] = set()
    dropped = []
    for i, m in enumerate(base):
        body = _body(m)
        if body in wanted and body not in kept:
            kept.add(body)
        else:
            dropped.append(i)
    added = [m for m in group.members if _body(m) not in kept]
    if 2 * len(added) >= len(group.members):
        return None
    compact = pb.Group()
    compact.CopyFrom(group)
    del compact.members[:]
    compact.members.extend(added)
    del compact.expected[:]
    compact.expected.extend(sorted(set(group.expected) - set(ids)))
    return pb.GroupDelta(group=compact, base=digest, dropped=dropped)


class LeaderLists:
    """A leader's side: the member lists of the groups it answered lately, by digest, and each answer it built."""

    def __init__(self, keep: int = KEEP_LISTS) -> None:
        self.keep = keep
        self._lists: OrderedDict[bytes, list[pb.PeerInfo]] = OrderedDict()
        self._deltas: OrderedDict[tuple[bytes, bytes], pb.GroupDelta | None] = OrderedDict()

    def answer(self, resp: pb.RendezvousResponse, base: bytes) -> pb.RendezvousResponse:
        """`resp` as the leader sends it to a member that holds the list named `base` (b"": none)."""
        if resp.WhichOneof("result") != "group" or not resp.group.members:
            return resp
        group = resp.group
        key = (bytes(group.round_id), bytes(base))
        if key not in self._deltas:
            self._remember(group.members)
            known = self._lists.get(key[1]) if key[1] else None
            self._deltas[key] = None if known is None else make_delta(group, known, key[1])
            while len(self._deltas) > 4 * self.keep:
                self._deltas.popitem(last=False)
        delta = self._deltas[key]
        return resp if delta is None else pb.RendezvousResponse(delta=delta)

    def _remember(self, members: Sequence[pb.PeerInfo]) -> None:
        digest = members_digest(members)
        self._lists[digest] = list(members)
        self._lists.move_to_end(digest)
        while len(self._lists) > self.keep:
            self._lists.popitem(last=False)


class MemberList:
    """A member's side: the member list of the last group it received, which its next request names."""

    def __init__(self) -> None:
        self.members: list[pb.PeerInfo] = []
        self.digest = b""

    def remember(self, group: pb.Group) -> None:
        if group.members:
            self.members = list(group.members)
            self.digest = members_digest(self.members)

    def forget(self) -> None:
        self.members, self.digest = [], b""

    def rebuild(self, delta: pb.GroupDelta, run_id: bytes) -> pb.Group:
        """The whole group a delta answer stands for; DeltaError if it does not rebuild the leader's group."""
        if not self.digest or bytes(delta.base) != self.digest:
            raise DeltaError("the leader's answer names a member list this peer does not hold")
        n = len(self.members)
        if len(delta.dropped) > n or len(delta.group.members) > MAX_ADDED:  # sizes before anything is built
            raise DeltaError("the leader's answer is larger than any change to this peer's list")
        dropped = set(delta.dropped)
        if len(dropped) != len(delta.dropped) or any(i >= n for i in dropped):
            raise DeltaError("the leader's answer drops members this peer's list does not have")
        members = [m for i, m in enumerate(self.members) if i not in dropped] + list(delta.group.members)
        members.sort(key=lambda m: m.peer_id)
        ids = [m.peer_id for m in members]
        if len(set(ids)) != len(ids):
            raise DeltaError("the leader's answer lists a member twice")
        group = pb.Group()
        group.CopyFrom(delta.group)
        del group.members[:]
        group.members.extend(members)
        del group.expected[:]
        group.expected.extend(sorted(set(ids) | set(delta.group.expected)))
        if round_id(run_id, group) != bytes(group.round_id):
            raise DeltaError("the leader's answer does not rebuild its group (the round id differs)")
        return group
