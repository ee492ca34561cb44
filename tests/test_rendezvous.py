"""The round leader's bookkeeping (peerd/rendezvous.py) on a real Membership, and the suspects an aborting owner relays
(peerd/allreduce.py): after a failed round every member must retry in the same group, without the peer to blame."""

from __future__ import annotations

import asyncio

from peerd.allreduce import SUSPECTS_KEY, RoundFailed, relayed_suspects, suspects_metadata
from peerd.identity import peer_id_of
from peerd.membership import Membership
from peerd.rendezvous import MAX_WEIGHT_RATIO, RendezvousLeader, capped_tokens, group_weights, member_weight
from peerd.roundtypes import REASON_KEY, refused_stream, refuses
from peerd.v1 import peerd_pb2 as pb


def _info(key: bytes) -> pb.PeerInfo:
    return pb.PeerInfo(peer_id=peer_id_of(key), public_key=key, heartbeat=1, address="h:1", outer_step=0)


def _swarm() -> tuple[Membership, list[pb.PeerInfo]]:
    peers = [_info(bytes([i]) * 32) for i in range(4)]
    leader = min(peers, key=lambda p: p.peer_id)
    m = Membership(leader, peer_timeout=60.0, settle_s=0.0)
    m.merge([p for p in peers if p is not leader])
    return m, sorted(peers, key=lambda p: p.peer_id)


def test_the_leader_keeps_out_whom_it_blames_but_a_joiner_cannot_exclude_anyone() -> None:
    async def main() -> None:
        m, (lead, a, b, bad) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 0)
        # The corrupt peer asks first (it blames nobody), then a joiner that blames an honest peer (b), then b; the
        # leader, which saw `bad`'s corrupt frame in the failed attempt, comes last.
        joins = []
        for who, blames in ((bad, []), (a, [b.peer_id]), (b, [bad.peer_id]), (lead, [bad.peer_id])):
            joins.append(asyncio.ensure_future(leader.join(0, -1, who, blames)))
            await asyncio.sleep(0)
        got = await asyncio.wait_for(asyncio.gather(*joins), 4.0)  # closes as soon as the expected peers are in
        bad_resp, a_resp, b_resp, lead_resp = got
        assert bad_resp.WhichOneof("result") == "behind"  # left out: it downloads state instead
        group = lead_resp.group
        assert [x.peer_id for x in group.members] == sorted([lead.peer_id, a.peer_id, b.peer_id])
        assert a_resp.group == group and b_resp.group == group  # b joined although a blamed it

    asyncio.run(main())


def test_two_members_blaming_a_peer_keep_it_out_even_when_the_leader_only_heard_of_it() -> None:
    """The leader saw only an abort naming `bad` (another member's word, so not its own blame): two members that
    blame `bad` on their own evidence keep it out; otherwise it rejoined every retry until it was banned."""

    async def main() -> None:
        m, (lead, a, b, bad) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 0)
        joins = []
        for who, blames in ((bad, [a.peer_id]), (a, [bad.peer_id]), (b, [bad.peer_id]), (lead, [])):
            joins.append(asyncio.ensure_future(leader.join(0, -1, who, blames)))
            await asyncio.sleep(0)
        bad_resp, a_resp, _, lead_resp = await asyncio.wait_for(asyncio.gather(*joins), 4.0)
        assert bad_resp.WhichOneof("result") == "behind"
        members = [x.peer_id for x in lead_resp.group.members]
        assert members == sorted([lead.peer_id, a.peer_id, b.peer_id])  # bad's word alone did not keep a out
        assert a_resp.group == lead_resp.group

    asyncio.run(main())


def test_a_retry_waits_for_the_members_the_corrupt_peer_names() -> None:
    """After a corrupt peer's round failed, it names every honest member. The leader still waits for them: one
    joiner's word stopped it waiting, and it closed its retry group with itself alone (seen in CI)."""

    async def main() -> None:
        m, (lead, a, b, bad) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 0)
        first = [
            asyncio.ensure_future(leader.join(0, -1, lead, [bad.peer_id])),
            asyncio.ensure_future(leader.join(0, -1, bad, [lead.peer_id, a.peer_id, b.peer_id])),
        ]
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in first)  # a and b are still expected
        rest = [asyncio.ensure_future(leader.join(0, -1, who, [bad.peer_id])) for who in (a, b)]
        lead_resp, bad_resp, a_resp, b_resp = await asyncio.wait_for(asyncio.gather(*first, *rest), 4.0)
        assert bad_resp.WhichOneof("result") == "behind"
        assert [x.peer_id for x in lead_resp.group.members] == sorted([lead.peer_id, a.peer_id, b.peer_id])
        assert a_resp.group == lead_resp.group == b_resp.group

    asyncio.run(main())


def test_one_open_group_per_step_whatever_the_attempt_counters() -> None:
    """Members at different attempt numbers still meet in one group; only naming the failed group opens the next,
    and a late peer that was not in a closed group is told it is behind instead of opening a group of its own."""

    async def main() -> None:
        m, (lead, a, b, late) = _swarm()
        m.mark_unreachable(late.peer_id)  # not expected: the first group closes once lead, a and b are in
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 0)
        first = await asyncio.wait_for(asyncio.gather(*(leader.join(0, -1, who, []) for who in (lead, a, b))), 4.0)
        group = first[0].group
        assert all(r.group == group for r in first) and group.attempt == 0
        # the round failed for everyone: a names it first, b comes back without naming it (an old client, or a
        # member whose attempt counter says something else): both land in the same next group
        retry = [asyncio.ensure_future(leader.join(0, -1, a, [], group.round_id))]
        await asyncio.sleep(0)
        retry += [asyncio.ensure_future(leader.join(0, -1, who, [])) for who in (b, lead)]
        got = await asyncio.wait_for(asyncio.gather(*retry), 4.0)
        second = got[0].group
        assert second.attempt == 1 and second.round_id != group.round_id
        assert all(r.group == second for r in got)
        # a peer that was in neither group arrives after the step closed: behind, never a group of one
        resp = await asyncio.wait_for(leader.join(0, -1, late, []), 1.0)
        assert resp.WhichOneof("result") == "behind"
        # a member asking again for the closed step gets its group back rather than a new one
        again = await asyncio.wait_for(leader.join(0, -1, a, []), 1.0)
        assert again.group == second

    asyncio.run(main())


def test_lineages_never_share_or_block_a_group() -> None:
    """After a split heals, the losing half's closed group for a step must not turn the winners away as "behind",
    and peers holding different states never average together (it would not make them agree)."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=0.5, my_step=lambda: 0)
        old, new = b"A" * 32, b"B" * 32
        for p in (a, b):  # gossip says a and b hold lineage A at step 0; lead and c hold B
            m.entries[p.peer_id].info.state_digest = old
        for p in (c,):
            m.entries[p.peer_id].info.state_digest = new
        m.me.state_digest = new
        first = await asyncio.wait_for(asyncio.gather(*(leader.join(0, -1, p, [], lineage=old) for p in (a, b))), 4)
        assert {x.peer_id for x in first[0].group.members} == {a.peer_id, b.peer_id}
        second = await asyncio.wait_for(asyncio.gather(*(leader.join(0, -1, p, [], lineage=new) for p in (lead, c))), 4)
        assert all(r.WhichOneof("result") == "group" for r in second)
        assert {x.peer_id for x in second[0].group.members} == {lead.peer_id, c.peer_id}

    asyncio.run(main())


def test_a_fragment_round_a_majority_closed_from_another_state_leaves_the_minority_behind_at_once() -> None:
    """Streaming after a heal: a peer that downloaded a state just before the swarm's next merge joins a fragment
    round with the older lineage, alone. Once the majority's group for that round closes (from the newer state), the
    minority's group closes empty and its member resyncs at once, where it used to wait out the deadline and two
    extensions. An even split (2 and 2) is left as it was: neither half's state is the majority's."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        for p in (a, b, c):  # every peer in cycle 3 (or 5, below)
            m.entries[p.peer_id].info.outer_step = 3
        step = [3]
        leader = RendezvousLeader(m, b"run", timeout_s=1.0, my_step=lambda: step[0])
        old, new = b"A" * 32, b"B" * 32
        t0 = asyncio.get_running_loop().time()
        alone = asyncio.ensure_future(leader.join(3, 1, c, [], lineage=old))
        await asyncio.sleep(0.05)
        got = await asyncio.wait_for(
            asyncio.gather(*(leader.join(3, 1, p, [], lineage=new) for p in (lead, a, b))), 4
        )  # fmt: skip
        assert {x.peer_id for x in got[0].group.members} == {lead.peer_id, a.peer_id, b.peer_id}
        left = await asyncio.wait_for(alone, 0.5)  # at once, not after 3 deadlines
        assert left.WhichOneof("result") == "behind" and left.behind == 4
        assert asyncio.get_running_loop().time() - t0 < 0.5
        late = await asyncio.wait_for(leader.join(3, 1, c, [], lineage=old), 0.5)  # asking again: behind at once
        assert late.WhichOneof("result") == "behind"
        for p in (a, b, c):
            m.entries[p.peer_id].info.outer_step = 5
        step[0] = 5
        t1 = asyncio.get_running_loop().time()
        # 2 and 2: both halves keep their own rounds (the split-brain rule, not the head count, picks the state)
        halves = await asyncio.wait_for(
            asyncio.gather(*(leader.join(5, 0, p, [], lineage=old if p in (a, c) else new) for p in (lead, a, b, c))),
            4,
        )
        assert all(r.WhichOneof("result") == "group" and len(r.group.members) == 2 for r in halves)
        assert asyncio.get_running_loop().time() - t1 < 0.5  # neither half waited for the other's members

    asyncio.run(main())


def test_a_fragment_round_the_swarm_moved_past_closes_empty_but_one_waiting_for_a_slow_peer_does_not() -> None:
    """Streaming: a peer that downloaded the state just as the swarm moved on joins a fragment round of the step the
    others just finished, and leads it alone (the lowest id). Once a majority joins rounds of the next step, that
    group closes empty and its member resyncs at once; it used to wait out the deadline and both extensions (24 s in
    CI) while the others' rounds waited for it. A group whose members wait there for a slow peer stays open: they
    joined it, and the slow peer still comes."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        step = [5]
        for p in (a, b, c):  # gossip: the others are in cycle 5 (their state, not the rounds they joined)
            m.entries[p.peer_id].info.outer_step = 5
        leader = RendezvousLeader(m, b"run", timeout_s=1.0, my_step=lambda: step[0])
        t0 = asyncio.get_running_loop().time()
        alone = asyncio.ensure_future(leader.join(5, 1, lead, []))
        await asyncio.sleep(0.05)
        ahead = [asyncio.ensure_future(leader.join(6, 0, p, [])) for p in (a, b, c)]
        left = await asyncio.wait_for(alone, 0.5)
        assert left.WhichOneof("result") == "behind" and left.behind == 6
        assert asyncio.get_running_loop().time() - t0 < 0.5
        got = await asyncio.wait_for(asyncio.gather(*ahead), 4)  # the next round goes on without it (deadline)
        assert {x.peer_id for x in got[0].group.members} == {a.peer_id, b.peer_id, c.peer_id}

        step[0] = 7
        for p in (a, b, c):
            m.entries[p.peer_id].info.outer_step = 7
        waiting = [asyncio.ensure_future(leader.join(7, 1, p, [])) for p in (lead, a, b)]  # c is slow
        await asyncio.sleep(0.05)
        nxt = [asyncio.ensure_future(leader.join(8, 0, p, [])) for p in (lead, a, b)]  # they train on meanwhile
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        slow = await asyncio.wait_for(leader.join(7, 1, c, []), 0.5)  # the slow peer comes: all four average
        assert len(slow.group.members) == 4
        assert all(len(r.group.members) == 4 for r in await asyncio.gather(*waiting))
        c_next = asyncio.ensure_future(leader.join(8, 0, c, []))
        assert all(r.WhichOneof("result") == "group" for r in await asyncio.wait_for(asyncio.gather(*nxt, c_next), 4))

    asyncio.run(main())


def test_a_leader_does_not_wait_for_its_own_peer_in_rounds_that_peer_skips() -> None:
    """Streaming: a joiner that downloaded the state at boundary 6 skips the fragment rounds due there, which the swarm
    started before it held that state. With the lowest id it leads them, and it used to expect itself (it is live,
    at step 6): the others waited out the deadline for it (8 s, and 24 s in CI when they fell into two groups).
    Told which rounds its peer skips, the leader closes them as soon as the others are in, whether it hears of the
    skip before the group opens or while it waits."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        for p in (a, b, c):
            m.entries[p.peer_id].info.outer_step = 6
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 6)
        t0 = asyncio.get_running_loop().time()
        leader.skip(6, [0])
        got = await asyncio.wait_for(asyncio.gather(*(leader.join(6, 0, p, []) for p in (a, b, c))), 2.0)
        assert {x.peer_id for x in got[0].group.members} == {a.peer_id, b.peer_id, c.peer_id}
        assert lead.peer_id not in got[0].group.expected  # honest accounting: nobody expected us there

        early = [asyncio.ensure_future(leader.join(6, 1, p, [])) for p in (a, b, c)]  # all in before we skip
        await asyncio.sleep(0.1)
        assert not any(f.done() for f in early)  # the leader still counts itself expected
        leader.skip(6, [1])
        got = await asyncio.wait_for(asyncio.gather(*early), 1.0)
        assert len(got[0].group.members) == 3
        assert asyncio.get_running_loop().time() - t0 < 2.0

        # A round we do not skip still waits for us (until the deadline)
        later = asyncio.ensure_future(asyncio.gather(*(leader.join(7, 0, p, []) for p in (a, b, c))))
        await asyncio.sleep(0.3)
        assert not later.done()
        later.cancel()

    asyncio.run(main())


def test_a_peer_that_handed_a_rounds_lead_on_keeps_sending_that_round_there_once_it_catches_up() -> None:
    """A joiner with the lowest id, its state download in flight, is asked to lead fragment round (6, 1): more than a
    step behind it, it hands the lead on to the next lowest peer. A moment later its download lands and the next
    member asks it: it used to lead that round itself, so the swarm split between two groups and the first member
    waited out both extensions alone (24 s, seen in CI). It sends the round where it sent the first member."""
    from types import SimpleNamespace

    from peerd.roundclient import RoundClient

    async def main() -> None:
        m, (me, a, b, c) = _swarm()
        for p in (a, b, c):
            m.entries[p.peer_id].info.outer_step = 6
        status = SimpleNamespace(outer_step=0)  # still downloading
        net = SimpleNamespace(rendezvous_timeout=5.0, round_timeout=60.0)
        daemon = SimpleNamespace(
            cfg=SimpleNamespace(network=net),
            loop=asyncio.get_running_loop(),
            identity=SimpleNamespace(peer_id=me.peer_id),
            me=me,
            membership=m,
            status=status,
            metrics=None,
            ranked=True,
        )
        daemon.leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: status.outer_step)
        rc = RoundClient(daemon)  # type: ignore[arg-type]
        first = await rc.lead_rendezvous(pb.RendezvousRequest(step=6, fragment=1), c)
        assert first.WhichOneof("result") == "redirect" and first.redirect.peer_id == a.peer_id
        status.outer_step = 6  # the download landed
        second = await asyncio.wait_for(rc.lead_rendezvous(pb.RendezvousRequest(step=6, fragment=1), b), 1.0)
        assert second.WhichOneof("result") == "redirect" and second.redirect.peer_id == a.peer_id
        # The peer it handed the round to is told to lead it (not sent back to us)
        own = await asyncio.wait_for(rc.lead_rendezvous(pb.RendezvousRequest(step=6, fragment=1), a), 1.0)
        assert own.WhichOneof("result") == "redirect" and own.redirect.peer_id == a.peer_id
        # Another round, which we never handed on, we lead as the lowest id
        mine = asyncio.ensure_future(rc.lead_rendezvous(pb.RendezvousRequest(step=6, fragment=0), b))
        await asyncio.sleep(0.2)
        assert not mine.done() and (6, 0, b"") in daemon.leader.pending
        mine.cancel()

    asyncio.run(main())


def test_relayed_suspects_are_limited_to_the_rounds_other_members() -> None:
    exc = RoundFailed("bad contribution", {"x" * 32, "y" * 32})
    md = suspects_metadata(exc)
    assert md and md[0][0] == SUSPECTS_KEY
    assert relayed_suspects(md, {"x" * 32}) == {"x" * 32}  # y is not in this round: a lying owner gains nothing
    assert relayed_suspects((("other", "x" * 32),), {"x" * 32}) == set()
    assert relayed_suspects(None, {"x" * 32}) == set()
    assert suspects_metadata(RoundFailed("timeout")) == ()


def test_only_an_owners_refusal_of_our_data_makes_us_sit_the_step_out() -> None:
    """An owner that timed out waiting for us names us too (so the others retry without us), but our data was never
    refused: we retry. Run AV had a member log "refused our contribution" and sit out on such a timeout."""
    me, other = "m" * 32, "o" * 32
    allowed = {me, other}
    rejected = suspects_metadata(RoundFailed("refused contributions from [m]", {me}, "rejected"))
    timed_out = suspects_metadata(RoundFailed("round timed out waiting for [m, o]", {me, other}, "timeout"))
    assert refuses(rejected, me, allowed)
    assert not refuses(timed_out, me, allowed)
    assert relayed_suspects(timed_out, allowed) == {me, other}  # still named, for the others' retry
    assert not refuses(rejected, other, allowed)  # someone else's data
    assert not refuses(rejected[:1], me, allowed)  # no reason given: not a refusal
    assert not refuses((*rejected, (REASON_KEY, "timeout")), me, allowed)  # contradictory reasons
    malformed = suspects_metadata(RoundFailed("bad contribution from m: part 2 does not decode", {me}, "malformed"))
    assert refuses(malformed, me, allowed)  # its checks refused our data too
    relayed = suspects_metadata(RoundFailed("o aborted the round", {me}))  # another owner's word: we retry
    assert not refuses(relayed, me, allowed)


def test_a_refused_contribution_stream_is_ours_not_a_lost_owner() -> None:
    """An owner that ends our contribution stream with INVALID_ARGUMENT tags why: data it refused sits us out; a
    stream that stalled or broke off does not, and an untagged refusal (a request that did not parse) stays a
    failed exchange."""
    assert refused_stream(((REASON_KEY, "malformed"),)) and refused_stream(((REASON_KEY, "nan"),))
    assert not refused_stream(((REASON_KEY, "timeout"),)) and not refused_stream(((REASON_KEY, "truncated"),))
    assert not refused_stream(()) and not refused_stream(None)


def test_a_leader_the_swarm_went_past_closes_empty_rather_than_train_alone() -> None:
    """Peers that disagreed about who leads (a slow-link peer looked dead to one of them) finished the step under
    another leader: the left-out leader must send its few joiners to download that state, not average alone."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        for p in (a, b, c):  # gossip says the others finished step 0
            m.entries[p.peer_id].info.outer_step = 1
        leader = RendezvousLeader(m, b"run", timeout_s=0.3, my_step=lambda: 0)
        resp = await asyncio.wait_for(leader.join(0, -1, lead, []), 2.0)
        assert resp.WhichOneof("result") == "behind"
        for p in (b, c):  # with only one of them ahead, the two that came do average together
            m.entries[p.peer_id].info.outer_step = 0
        got = await asyncio.wait_for(asyncio.gather(leader.join(1, -1, lead, []), leader.join(1, -1, b, [])), 2.0)
        assert all(r.WhichOneof("result") == "group" for r in got)

    asyncio.run(main())


def test_a_late_joiner_hears_how_long_ago_the_round_it_missed_formed() -> None:
    """The straggler grace closed the group without `c`; `c` asks later and is told `behind`, with how long ago the
    group's first member joined, so it can start its next window at the swarm's boundary (peerd/diloco.py)."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=5.0, my_step=lambda: 0, straggler_grace_s=0.2)
        got = await asyncio.wait_for(asyncio.gather(*(leader.join(0, -1, p, []) for p in (lead, a, b))), 2.0)
        assert all(r.WhichOneof("result") == "group" for r in got)
        await asyncio.sleep(0.5)
        late = await asyncio.wait_for(leader.join(0, -1, c, []), 2.0)
        assert late.WhichOneof("result") == "behind" and late.behind == 1
        assert 650 <= late.behind_ms <= 1500, late.behind_ms  # the grace (0.2 s) and our 0.5 s, and no more

    asyncio.run(main())


def test_the_leader_does_not_wait_for_a_sponsored_peer_and_names_whose_work_rides_along() -> None:
    """peerd/sponsor.py: a peer whose gossip names a sponsor is not expected in rounds (its work comes through the
    sponsor), also when it turns sponsored while a group already waits for it; the group names the carried peer and
    its carrier, bound into the round id."""
    from peerd.rendezvous import round_id

    async def main() -> None:
        m, (lead, a, b, slow) = _swarm()
        leader = RendezvousLeader(m, b"run", timeout_s=30.0, my_step=lambda: 0)
        joins = [asyncio.ensure_future(leader.join(0, -1, who, [])) for who in (lead, a)]
        await asyncio.sleep(0.2)
        assert not any(j.done() for j in joins)  # b and the slow peer are still expected
        turned = pb.PeerInfo()
        turned.CopyFrom(slow)
        turned.heartbeat, turned.sponsor = 2, a.peer_id
        m.merge([turned])  # it turns sponsored while the group waits
        joins.append(asyncio.ensure_future(leader.join(0, -1, b, [], carries=[slow.peer_id, b.peer_id])))
        got = await asyncio.wait_for(asyncio.gather(*joins), 5.0)  # closes without waiting out the 30 s deadline
        group = got[0].group
        assert slow.peer_id not in [x.peer_id for x in group.members]
        assert list(group.carried) == [slow.peer_id] and list(group.carried_by) == [b.peer_id]  # not itself
        assert group.round_id == round_id(b"run", group)
        group.carried_by[0] = a.peer_id
        assert round_id(b"run", group) != bytes(got[0].group.round_id)

    asyncio.run(main())


def test_every_owner_gets_the_groups_weights_even_when_its_own_is_one() -> None:
    """Claims [32, 64, 96]: the middle member scales by exactly 1.0, but the group is weighted. Its shard must
    still re-weight a subset's mean and judge norms by weight; before, it was handed no weights at all."""
    group = pb.Group(members=[pb.PeerInfo(peer_id=p) for p in ("a", "b", "c")], tokens=[32, 64, 96])
    assert member_weight(group, "b") == 1.0
    assert group_weights(group) == [0.5, 1.0, 1.5]
    even = pb.Group(members=group.members, tokens=[64, 64, 64])
    assert group_weights(even) is None and group_weights(pb.Group(members=group.members)) is None
    assert capped_tokens([1, 10, 1000]) == [1, 10, MAX_WEIGHT_RATIO * 10] and capped_tokens([5, 0]) == []


def test_an_empty_group_left_from_a_split_does_not_keep_the_healed_swarm_behind_for_good() -> None:
    """A leader that led its side of a split to step 2 closed the other side's pending step-1 group empty (on_ahead).
    After the heal it adopted the other side's state at step 1, and every peer, itself included, asked for step 1 in
    that state: the empty closed group answered "behind" (step 2) to each of them, forever, though nobody was past
    step 1 (a 5-peer namespace run sat at one state for 3 minutes). With nobody past the step, it is reopened."""

    async def main() -> None:
        m, (lead, a, b, c) = _swarm()
        mine = [2]
        leader = RendezvousLeader(m, b"run", timeout_s=0.3, my_step=lambda: mine[0])
        other, ours = b"L" * 32, b"M" * 32
        for p in (a, b, c):
            m.entries[p.peer_id].info.outer_step = 1
        asking = asyncio.ensure_future(leader.join(1, -1, a, [], lineage=other))  # the other side's round
        await asyncio.sleep(0.05)
        own = asyncio.ensure_future(leader.join(2, -1, lead, [], lineage=ours))  # we moved on: it closes empty
        assert (await asyncio.wait_for(asking, 2.0)).WhichOneof("result") == "behind"
        await asyncio.wait_for(own, 2.0)
        mine[0] = 1  # healed: we adopted their state at step 1, and so did everyone
        got = await asyncio.wait_for(
            asyncio.gather(*(leader.join(1, -1, p, [], lineage=other) for p in (lead, a, b, c))), 3.0
        )
        assert all(r.WhichOneof("result") == "group" for r in got), got
        assert len(got[0].group.members) == 4 and got[0].group.attempt == 1
        # while a peer is really past the step, the empty group still sends a late asker on at once
        m.entries[b.peer_id].info.outer_step = 3
        leader.closed[(2, -1, other)] = pb.Group(step=2)
        late = await asyncio.wait_for(leader.join(2, -1, c, [], lineage=other), 2.0)
        assert late.WhichOneof("result") == "behind"

    asyncio.run(main())
