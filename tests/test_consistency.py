"""The pieces of "one model per run" that need no network: signed membership entries, the dead-peer list and the
run's expected set (peerd/membership.py), the split-brain rule (peerd/consistency.py) and re-dial backoff
(peerd/redial.py). The real-process scenarios are in tests/test_partition.py."""

from __future__ import annotations

import asyncio

from peerd.consistency import AloneTracker, Claim, best_claim
from peerd.identity import Identity
from peerd.membership import Membership
from peerd.redial import Redialer
from peerd.v1 import peerd_pb2 as pb

RUN = b"r" * 32


def _peer(ident: Identity, hb: int = 1, **kw) -> Membership:
    """A peer's own table, so its signed_self() is a correctly signed entry."""
    info = pb.PeerInfo(peer_id=ident.peer_id, public_key=ident.public_key, heartbeat=hb, address="h:1", **kw)
    return Membership(info, peer_timeout=5.0, settle_s=0.0, run_id=RUN, sign=ident.sign, forget_after=60.0)


def test_entries_must_be_signed_by_the_peer_they_describe() -> None:
    me, a, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    table = _peer(me)
    a_table = _peer(a, outer_step=3)
    entry = pb.PeerInfo()
    entry.CopyFrom(a_table.signed_self())
    assert table.merge([entry], now=0.0) == [a.peer_id]
    # mallory relays a's entry with a far step and a newer heartbeat: the signature no longer matches
    forged = pb.PeerInfo()
    forged.CopyFrom(entry)
    forged.outer_step, forged.heartbeat = 10**6, 99
    assert table.merge([forged], now=1.0) == [] and table.forged == 1
    assert table.get(a.peer_id).outer_step == 3
    # signed by mallory's key instead of a's: refused too
    forged.signature = mallory.sign(b"anything")
    table.merge([forged], now=1.0)
    assert table.forged == 2 and table.get(a.peer_id).outer_step == 3
    # a's own newer entry goes through, and re-signing follows every change of our own entry
    a_table.me.outer_step, a_table.me.heartbeat = 4, 2
    table.merge([a_table.signed_self()], now=2.0)
    assert table.get(a.peer_id).outer_step == 4 and table.forged == 2


def test_dead_peers_stay_on_the_list_and_stay_expected() -> None:
    me, a, b = Identity.generate(), Identity.generate(), Identity.generate()
    table = _peer(me)
    table.merge([_peer(a).signed_self(), _peer(b).signed_self()], now=0.0)
    assert [p.peer_id for p in table.dead(now=1.0)] == []
    # both fall silent; b comes back at t=20 (after a 20 s split): a is dead but never forgotten
    newer = _peer(b, hb=5)
    table.merge([newer.signed_self()], now=20.0)
    assert [p.peer_id for p in table.dead(now=21.0)] == [a.peer_id]
    assert a.peer_id not in {p.peer_id for p in table.gossip_view(now=21.0)}  # dead entries are not gossiped
    assert a.peer_id in table.expected(now=21.0)  # ... but the run still expects it: rounds without it are partial
    assert a.peer_id not in table.expected(now=61.0)  # forget_after passed
    assert table.get(a.peer_id) is not None  # and it is still re-dialled
    table.note_step(b.peer_id, 7)
    assert table.step_of(table.get(b.peer_id)) == 7


def test_the_claim_with_more_work_wins_then_the_step_then_the_digest() -> None:
    mine = Claim(work=20, step=10, digest=b"\x01", peer_id="me")
    half = Claim(work=30, step=8, digest=b"\x02", peer_id="x")  # fewer steps, but more peers' work went into it
    solo = Claim(work=12, step=14, digest=b"\x03", peer_id="y")  # a peer alone, ahead in steps
    assert best_claim(mine, [solo]) == mine
    assert best_claim(mine, [solo, half]) == half
    tie = Claim(work=20, step=10, digest=b"\x09", peer_id="z")
    assert best_claim(mine, [tie]) == tie and best_claim(tie, [mine]) == tie  # everyone picks the same one
    assert best_claim(mine, [Claim(99, 99, b"", "no digest yet")]) == mine


def test_alone_is_said_once_per_change() -> None:
    t = AloneTracker()
    first = t.update(1, 4)
    assert first is not None and first.startswith("training alone: no reachable peers since") and "4 peers" in first
    assert t.update(1, 4) is None and t.status
    assert (t.update(3, 4) or "").startswith("no longer alone")
    assert t.status == ""


def test_a_round_of_one_stays_partial_after_the_table_forgot_the_others() -> None:
    """Seen in CI (a 2+2 split, streaming): a peer alone for longer than forget_after recorded a round of one that
    expected only itself, shown as complete. The run did not shrink to one: once alone after rounds that expected
    others, every round of one is partial."""
    t = AloneTracker()
    assert not t.run_shrank_to_us(1)  # a run of one peer: its rounds of one are whole
    t.update(1, 1)
    assert not t.run_shrank_to_us(1)
    t = AloneTracker()
    t.update(1, 4)  # alone, last seen with 4 expected
    assert t.run_shrank_to_us(1)
    assert not t.run_shrank_to_us(2)
    t.update(2, 4)  # back with company
    assert not t.run_shrank_to_us(1)


def test_redial_backs_off_and_heals() -> None:
    dead = [pb.PeerInfo(peer_id="d" * 32, address="10.9.9.9:1")]
    calls: list[str] = []
    answers = {"peer": False, "boot": False}

    async def dial_peer(p: pb.PeerInfo) -> bool:
        calls.append("peer")
        return answers["peer"]

    async def dial_boot(addr: str) -> bool:
        calls.append("boot")
        return answers["boot"]

    r = Redialer(lambda: dead, dial_peer, ["b:1"], dial_boot, lambda a: False, base_s=0.01, max_s=0.05)

    async def main() -> None:
        await r.tick()
        assert calls == ["peer", "boot"]
        await r.tick()  # backing off: nothing is due yet
        assert calls == ["peer", "boot"]
        for _ in range(20):
            await asyncio.sleep(0.02)
            await r.tick()
        assert 4 <= calls.count("peer") <= 21  # bounded backoff: still dialled, never more than once a tick
        answers["peer"] = True
        await asyncio.sleep(0.06)
        await r.tick()
        assert r.healed >= 1

    asyncio.run(main())


def test_a_partial_state_download_patches_only_the_changed_fragments() -> None:
    import pytest
    import torch

    from peerd.statesync import StateSnapshot, check_ranges, part_digests, read_state, state_messages
    from peerd.streams import StreamError

    ident = Identity.generate()
    parts = [[(0, 3), (6, 2)], [(3, 3)]]  # two fragments, one of them split in two slices
    theirs = {"params": torch.arange(8.0), "outer_momentum": torch.arange(8.0) / 10}
    snap = StateSnapshot(5, theirs, work=9, parts=parts)
    mine = {k: v.clone() for k, v in theirs.items()}
    mine["params"][1] = 100.0  # only fragment 0 differs
    mine["outer_momentum"][7] = -1.0
    pairs = zip(part_digests(mine, parts), part_digests(theirs, parts), strict=True)
    changed = [p for p, (a, b) in enumerate(pairs) if a != b]
    assert changed == [0]
    ranges = parts[0]

    async def fetch(base: dict) -> StateSnapshot:
        async def stream():
            for m in state_messages(snap, ident, 4, ranges):
                yield m

        return await read_state(stream(), {"params": (8,), "outer_momentum": (8,)}, ident.public_key, base, ranges)

    got = asyncio.run(fetch(mine))
    assert got.digest == snap.digest and got.work == 9
    assert torch.equal(got.tensors["params"], theirs["params"])
    # our copy also differs outside the slices we asked for: the patched state cannot match the whole-state digest
    bad = {k: v.clone() for k, v in mine.items()}
    bad["params"][4] = 7.5
    with pytest.raises(StreamError) as info:
        asyncio.run(fetch(bad))
    assert info.value.reason == "bad_digest"
    with pytest.raises(StreamError):
        check_ranges([0, 9], 8)  # past the end: refused before anything is read
    with pytest.raises(StreamError):
        check_ranges([0], 8)


def test_a_state_download_asks_the_best_claim_first_then_the_fastest_uplink() -> None:
    """peerd/statefetch.py holder_order: rank decides (the split-brain rule), and among holders of the same state the
    uplink we measured in rounds, so a holder on a slow link is asked after the fast one, and one never measured
    last."""
    from peerd.statefetch import holder_order

    def holder(pid: str, work: int, digest: bytes) -> pb.PeerInfo:
        return pb.PeerInfo(peer_id=pid, work=work, outer_step=5, state_digest=digest)

    slow, fast, unmeasured = holder("slow", 20, b"a"), holder("fast", 20, b"a"), holder("new", 20, b"a")
    better = holder("better", 21, b"b")
    rates = {"slow": 250e3, "fast": 50e6}
    order = holder_order([slow, unmeasured, fast, better], lambda pid: rates.get(pid, 0.0))
    assert [p.peer_id for p in order] == ["better", "fast", "slow", "new"]


def test_a_state_download_prefers_a_far_faster_holder_one_round_behind_the_best() -> None:
    """A slow-uplink peer owns no shard, finishes each round first and alone holds the newest claim for a moment: a
    peer catching up after a split downloaded from it (3 s a state) 6 times in a row and never caught up (the chaos
    test). A holder one round behind with a 4x faster uplink goes first; two steps behind, or not far faster, or
    against a best holder never measured, rank still decides."""
    from peerd.statefetch import holder_order

    def holder(pid: str, step: int, work: int) -> pb.PeerInfo:
        return pb.PeerInfo(peer_id=pid, work=work, outer_step=step, state_digest=pid.encode())

    slow = holder("slow", 84, 201)
    rates = {"slow": 0.6e6, "fast": 6e6, "far": 60e6, "near": 1.2e6}
    order = [p.peer_id for p in holder_order([slow, holder("fast", 83, 198)], lambda pid: rates.get(pid, 0.0), 5)]
    assert order == ["fast", "slow"]
    two_behind = holder("far", 82, 195)
    assert holder_order([slow, two_behind], lambda pid: rates.get(pid, 0.0), 5)[0].peer_id == "slow"
    assert holder_order([slow, holder("near", 83, 198)], lambda pid: rates.get(pid, 0.0), 5)[0].peer_id == "slow"
    new_top = holder("new", 84, 201)
    assert holder_order([new_top, holder("fast", 83, 198)], lambda pid: rates.get(pid, 0.0), 5)[0].peer_id == "new"
    other_fork = holder("fast", 84, 150)  # far less work: another lineage, whatever its link
    assert holder_order([slow, other_fork], lambda pid: rates.get(pid, 0.0), 5)[0].peer_id == "slow"


def test_a_state_names_its_ancestors_so_a_downloader_tells_lag_from_a_fork() -> None:
    """A split's losing half is often behind the winner too, so "behind" used to be its verdict and the fork went
    uncounted (a 5-peer namespace run: the 2-peer side adopted a state 35 steps ahead with forks_healed 0). A state
    now carries its ancestors' (step, digest), and the downloader checks whether the state it held is among them."""
    import pytest
    import torch

    from peerd.consistency import lineage_verdict
    from peerd.statesync import LINEAGE_STEPS, StateSnapshot, read_state, state_messages
    from peerd.streams import StreamError

    ident = Identity.generate()
    lineage = tuple((s, bytes([s]) * 32) for s in range(9, 2, -1))  # steps 9..3, most recent first
    snap = StateSnapshot(10, {"params": torch.arange(4.0)}, work=20, lineage=lineage)

    def fetch(header_lineage: list[pb.StepDigest] | None = None) -> StateSnapshot:
        async def stream():
            for m in state_messages(snap, ident, 64):
                if header_lineage is not None and m.WhichOneof("part") == "header":
                    del m.header.lineage[:]
                    m.header.lineage.extend(header_lineage)
                yield m

        return asyncio.run(read_state(stream(), {"params": (4,)}, ident.public_key))

    got = fetch()
    assert got.lineage == lineage and got.digest == snap.digest
    assert lineage_verdict((7, bytes([7]) * 32), got.lineage) is True  # an ancestor: we were behind
    assert lineage_verdict((7, b"x" * 32), got.lineage) is False  # our step 7 was another state: we had forked
    assert lineage_verdict((1, bytes([1]) * 32), got.lineage) is None  # older than it reaches: cannot tell
    assert lineage_verdict((10, b"y" * 32), ()) is None
    too_long = [pb.StepDigest(step=s % 10, digest=b"d" * 32) for s in range(LINEAGE_STEPS + 1)]
    for bad in (too_long, [pb.StepDigest(step=3, digest=b"short")], [pb.StepDigest(step=10, digest=b"d" * 32)]):
        with pytest.raises(StreamError) as info:
            fetch(bad)
        assert info.value.reason == "malformed"
