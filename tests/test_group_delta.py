"""Rendezvous answers as changes to the member's previous member list (peerd/group_delta.py): in-memory checks of
the narrow interface. The swarm tests (tests/test_prometheus_swarm.py and every round test) run it between real
daemons."""

from __future__ import annotations

import os

import pytest

from peerd.group_delta import DeltaError, LeaderLists, MemberList, members_digest
from peerd.rendezvous import round_id
from peerd.v1 import peerd_pb2 as pb

RUN = b"r" * 32


def _member(i: int, incarnation: int = 1) -> pb.PeerInfo:
    return pb.PeerInfo(
        peer_id=f"{i:064x}", public_key=bytes(32), address=f"10.0.{i // 250}.{i % 250}:7000", incarnation=incarnation
    )


def _group(members: list[pb.PeerInfo], step: int, missing: tuple[str, ...] = ()) -> pb.Group:
    members = sorted(members, key=lambda m: m.peer_id)
    group = pb.Group(step=step, members=members, leader=members[0].peer_id, part_bytes=1 << 18)
    group.expected.extend(sorted({m.peer_id for m in members} | set(missing)))
    group.tokens.extend(100 + i for i in range(len(members)))
    group.round_id = round_id(RUN, group)
    return group


def _through(leader: LeaderLists, member: MemberList, group: pb.Group) -> tuple[pb.Group, int]:
    """What `member` makes of the leader's answer for `group`, and the answer's size on the wire."""
    resp = leader.answer(pb.RendezvousResponse(group=group), member.digest)
    got = resp.group if resp.WhichOneof("result") == "group" else member.rebuild(resp.delta, RUN)
    member.remember(got)
    return got, resp.ByteSize()


def test_consecutive_groups_rebuild_exactly_from_a_fraction_of_the_bytes() -> None:
    leader, member = LeaderLists(), MemberList()
    peers = [_member(i) for i in range(64)]
    first, whole = _through(leader, member, _group(peers, 1))
    assert first == _group(peers, 1)
    # churn: one peer gone, one restarted (a new incarnation), one new, and one the leader waited for in vain
    peers = [p for p in peers if p.peer_id != _member(5).peer_id]
    peers[10] = _member(11, incarnation=2)
    peers.append(_member(99))
    want = _group(peers, 2, missing=(_member(5).peer_id,))
    got, size = _through(leader, member, want)
    assert got == want
    assert size < whole / 5, (size, whole)


def test_a_leader_without_the_named_list_sends_the_whole_group() -> None:
    member = MemberList()
    member.remember(_group([_member(i) for i in range(8)], 1))
    group = _group([_member(i) for i in range(1, 9)], 2)  # another leader closed the member's previous group
    resp = LeaderLists().answer(pb.RendezvousResponse(group=group), member.digest)
    assert resp.WhichOneof("result") == "group"


def test_a_delta_that_does_not_rebuild_the_group_is_refused() -> None:
    leader, member = LeaderLists(), MemberList()
    _through(leader, member, _group([_member(i) for i in range(8)], 1))
    resp = leader.answer(pb.RendezvousResponse(group=_group([_member(i) for i in range(1, 9)], 2)), member.digest)
    assert resp.WhichOneof("result") == "delta"
    for tamper in (
        lambda d: d.dropped.append(3),  # drops one more than the leader did: the round id no longer matches
        lambda d: d.dropped.append(1000),  # past the list's end
        lambda d: d.group.members.append(_member(2)),  # a member twice
        lambda d: setattr(d, "base", os.urandom(16)),  # a list this member does not hold
    ):
        bad = pb.GroupDelta()
        bad.CopyFrom(resp.delta)
        tamper(bad)
        with pytest.raises(DeltaError):
            member.rebuild(bad, RUN)
    assert member.rebuild(resp.delta, RUN).members[-1].peer_id == _member(8).peer_id


def test_the_digest_names_entries_and_order() -> None:
    a = [_member(1), _member(2)]
    assert members_digest(a) != members_digest(a[::-1])
    assert members_digest(a) != members_digest([_member(1), _member(2, incarnation=2)])
