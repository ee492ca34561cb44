"""Heartbeat hash chains (peerd/beats.py): an advance costs the receiver a hash, and still cannot be forged."""

from __future__ import annotations

import pytest

from peerd import beats, membership
from peerd.identity import Identity
from peerd.membership import Membership, copy_peer
from peerd.v1 import peerd_pb2 as pb

RUN = b"r" * 32


def _table(ident: Identity, hb: int = 1, **kw) -> Membership:
    info = pb.PeerInfo(peer_id=ident.peer_id, public_key=ident.public_key, heartbeat=hb, address="h:1", **kw)
    return Membership(info, peer_timeout=5.0, settle_s=0.0, run_id=RUN, sign=ident.sign)


def test_a_chain_value_hashes_to_the_anchor_in_as_many_steps_as_heartbeats_past_the_base() -> None:
    chain = beats.BeatChain(base=10, length=8)
    assert chain.covers(10) and chain.covers(18) and not chain.covers(9) and not chain.covers(19)
    assert chain.proof(10) == chain.anchor
    for hb in range(10, 19):
        assert beats.hashes_to(chain.proof(hb), hb - 10, chain.anchor)
        assert not beats.hashes_to(chain.proof(hb), hb - 10 + 1, chain.anchor)
    assert beats.hashes_to(chain.proof(15), 2, chain.proof(13))  # from a value already checked: two hashes
    assert not beats.hashes_to(chain.proof(15), -1, chain.anchor)
    assert not beats.hashes_to(b"short", 0, b"short")
    assert not beats.hashes_to(chain.anchor, beats.MAX_STEPS + 1, chain.anchor)


def test_heartbeats_within_a_chain_are_merged_without_a_signature_check(monkeypatch: pytest.MonkeyPatch) -> None:
    me, a = Identity.generate(), Identity.generate()
    table, a_table = _table(me), _table(a)
    checks = []
    real = membership.verify
    monkeypatch.setattr(membership, "verify", lambda *args: checks.append(1) or real(*args))
    signs = []
    a_table._sign = lambda data, s=a.sign: signs.append(1) or s(data)
    for t in range(20):
        a_table.bump()
        table.merge([copy_peer(a_table.signed_self())], now=float(t))
        assert table.get(a.peer_id).heartbeat == a_table.me.heartbeat
    assert len(checks) == 1 and len(signs) == 1  # 20 advances: one signature made, one checked
    assert table.forged == 0 and table.is_alive(a.peer_id, now=19.0)
    # anything else in the entry changes: a new signature, checked in full
    a_table.me.outer_step = 7
    a_table.bump()
    table.merge([copy_peer(a_table.signed_self())], now=20.0)
    assert len(checks) == 2 and table.get(a.peer_id).outer_step == 7


def test_a_chain_that_runs_out_is_replaced_and_the_receiver_follows() -> None:
    me, a = Identity.generate(), Identity.generate()
    table, a_table = _table(me), _table(a)
    anchors = set()  # one base per chain
    for t in range(2 * beats.CHAIN_LEN + 5):
        a_table.bump()
        entry = copy_peer(a_table.signed_self())
        anchors.add(entry.beat_base)
        if t % 7 == 0:  # the receiver hears only some heartbeats, as with bounded gossip
            table.merge([entry], now=float(t))
            assert table.get(a.peer_id).heartbeat == entry.heartbeat
    assert len(anchors) == 3 and table.forged == 0


def test_nobody_but_the_subject_can_advance_its_heartbeat() -> None:
    me, a = Identity.generate(), Identity.generate()
    table, a_table = _table(me), _table(a)
    a_table.bump()
    entry = copy_peer(a_table.signed_self())
    table.merge([entry], now=0.0)
    # a relay keeps a dead peer's entry "alive": a higher heartbeat with the proof it has, or with a made-up one
    for proof in (entry.beat_proof, beats.beat_hash(entry.beat_proof), b"\x00" * beats.VALUE_BYTES, b""):
        forged = copy_peer(entry)
        forged.heartbeat += 1
        forged.beat_proof = proof
        assert table.merge([forged], now=10.0) == []
    assert table.forged == 4 and table.get(a.peer_id).heartbeat == entry.heartbeat
    assert not table.is_alive(a.peer_id, now=10.0)  # silence still convicts it
    # the same forgeries reach a peer that never saw the entry: the full check refuses them too
    fresh = _table(Identity.generate())
    forged = copy_peer(entry)
    forged.heartbeat += 1
    assert fresh.merge([forged], now=0.0) == [] and fresh.forged == 1
    # moving the base along with the heartbeat breaks the signature; a claim past MAX_STEPS is refused unhashed
    forged.beat_base += 1
    assert fresh.merge([forged], now=0.0) == [] and fresh.forged == 2
    forged = copy_peer(entry)
    forged.heartbeat = forged.beat_base + beats.MAX_STEPS + 1
    assert fresh.merge([forged], now=0.0) == [] and fresh.forged == 3
    # a relayed entry whose other fields changed under the old signature: refused though its proof is genuine
    a_table.bump()
    genuine = copy_peer(a_table.signed_self())
    genuine.outer_step = 10**6
    assert table.merge([genuine], now=1.0) == [] and table.forged == 5


def test_an_entry_without_a_chain_is_still_checked_as_before() -> None:
    me, a = Identity.generate(), Identity.generate()
    table = _table(me)
    info = pb.PeerInfo(peer_id=a.peer_id, public_key=a.public_key, heartbeat=3, address="h:2")
    membership.sign_entry(info, RUN, a.sign)
    assert table.merge([copy_peer(info)], now=0.0) == [a.peer_id]
    info.heartbeat = 4  # under the signature: changing it breaks it
    assert table.merge([copy_peer(info)], now=1.0) == [] and table.forged == 1


def test_the_chain_costs_an_entry_about_23_bytes_on_the_wire() -> None:
    a = Identity.generate()
    table = _table(a, hb=1000)
    chained = copy_peer(table.signed_self())
    plain = pb.PeerInfo(peer_id=a.peer_id, public_key=a.public_key, heartbeat=1000, address="h:1")
    membership.sign_entry(plain, RUN, a.sign)
    assert len(chained.beat_proof) == beats.VALUE_BYTES
    assert chained.ByteSize() - plain.ByteSize() <= 24  # proof 19 + base 4 (tags included): the anchor is not sent
