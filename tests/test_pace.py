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
        candidates=list, lookup=lambda pid: None, me=lambda: me, on_unreachable=lambda pid, how: None,
        rng=random.Random(7),
    )  # fmt: skip
    mm.progress(step=3, eta_s=0.5, phase_s=1.0)
    peers = [pb.PeerInfo(peer_id="same", phase_ms=1100), pb.PeerInfo(peer_id="slow", phase_ms=3000)]
    picks = Counter(mm._pick(peers).peer_id for _ in range(2000))
    assert me.phase_ms == 1000
    assert picks["slow"] > 0  # still mixes
    assert 6 < picks["same"] / picks["slow"] < 13  # ~9x: 1 / 3^2


def test_a_failed_proposal_says_whether_the_partner_refused_or_never_answered() -> None:
    """A refused dial means the partner's process is gone; one with no connection at all may be a route broken between
    us (peerd/pairblocks.py), which membership tells from the heartbeats that follow. NoLoCo's dials said neither."""
    import asyncio

    import grpc

    from peerd.pair_exchange import PairSettings

    class Failing:
        def __init__(self, details: str) -> None:
            self.details = details

        async def match(self, peer: pb.PeerInfo, request: pb.MatchRequest, timeout: float) -> pb.MatchResponse:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details=self.details)  # type: ignore[arg-type]

    me = pb.PeerInfo(peer_id="me")
    for details, how in (("Connection refused", "refused"), ("Timeout occurred: FD Shutdown", "no_answer")):
        heard: list[tuple[str, str]] = []
        mm = Matchmaker(
            identity=Identity.generate(), run_id=b"r" * 32, settings=PairSettings(), transport=Failing(details),  # type: ignore[arg-type]
            exchange=None, candidates=list, lookup=lambda pid: None, me=lambda: me,  # type: ignore[arg-type]
            on_unreachable=lambda pid, h, heard=heard: heard.append((pid, h)), rng=random.Random(7),
        )  # fmt: skip
        assert asyncio.run(mm._propose(pb.PeerInfo(peer_id="p", address="10.0.0.2:1"), 3)) is None
        assert heard == [("p", how)], (details, heard)
