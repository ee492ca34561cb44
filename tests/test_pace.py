"""NoLoCo partner choice prefers peers at a similar pace (peerd/matchmaking.py), without excluding anyone."""

from __future__ import annotations

import random
from collections import Counter

from peerd.identity import Identity
from peerd.matchmaking import Matchmaker, pace_weight
from peerd.v1 import peerd_pb2 as pb


def test_pace_weight() -> None:
    assert pace_weight(1.0, 1.4) == 1.0 and pace_weight(1.0, 0.7) == 1.0
    assert abs(pace_weight(1.0, 3.0) - 1 / 9) < 1e-9 and abs(pace_weight(3.0, 1.0) - 1 / 9) < 1e-9
    assert pace_weight(1.0, 0.0) == 1.0 and pace_weight(float("inf"), 2.0) == 1.0  # unknown pace: no preference


def test_pick_prefers_a_partner_at_our_pace_and_publishes_ours() -> None:
    me = pb.PeerInfo(peer_id="me")
    mm = Matchmaker(
        identity=Identity.generate(), run_id=b"r" * 32, settings=None, transport=None, exchange=None,  # type: ignore[arg-type]
        candidates=list, lookup=lambda pid: None, me=lambda: me, on_unreachable=lambda pid: None,
        rng=random.Random(7),
    )  # fmt: skip
    mm.progress(step=3, eta_s=0.5, phase_s=1.0)
    peers = [pb.PeerInfo(peer_id="same", phase_ms=1100), pb.PeerInfo(peer_id="slow", phase_ms=3000)]
    picks = Counter(mm._pick(peers).peer_id for _ in range(2000))
    assert me.phase_ms == 1000
    assert picks["slow"] > 0  # still mixes
    assert 6 < picks["same"] / picks["slow"] < 13  # ~9x: 1 / 3^2
