"""Unit tests of the takeover rule (`ReduceRound.owner_for`), in memory: a member whose exchange with a shard's owner
failed asks the next owner in line to reduce that shard. The asked peer takes it over only when its own evidence has
every owner between the lost one and itself gone; otherwise views differ and it refuses. Its own evidence is the
round's (its own exchanges) and, since the 64-peer churn runs, its gossip view (`seen_gone`). The real-process
behaviour is tests/test_round_survives.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from peerd.allreduce import ReduceRound, RoundFailed
from peerd.codecs import make_codec
from peerd.identity import Identity
from peerd.v1 import peerd_pb2 as pb


def _round() -> tuple[ReduceRound, list[str]]:
    """We are member 2 of 4, every member an owner: shard 0's line is members 0, 1, 2 (us), 3."""
    me = Identity.generate()
    ids = [f"{i:064x}" for i in range(3)]
    ids.insert(2, me.peer_id)
    group = pb.Group(round_id=b"r" * 32, leader=ids[0], members=[pb.PeerInfo(peer_id=p, incarnation=1) for p in ids])
    rnd = ReduceRound(group, me, b"run", torch.zeros(64), make_codec("fp32"), ThreadPoolExecutor(1), 10.0, 1 << 20)
    return rnd, ids


def test_a_peer_refuses_a_takeover_while_an_owner_before_it_looks_alive() -> None:
    async def main() -> None:
        rnd, ids = _round()
        with pytest.raises(RoundFailed, match="not next in line for shard 0"):
            rnd.owner_for(0, ids[3])  # the round's view alone: member 1 is not lost in it
        rnd.seen_gone = {"someone else"}.__contains__
        with pytest.raises(RoundFailed, match="not next in line for shard 0"):
            rnd.owner_for(0, ids[3])  # our gossip view has member 1 live: views differ, refuse
        assert 0 not in rnd.owned

    asyncio.run(main())


def test_gossip_evidence_of_the_owner_between_lets_the_takeover_happen() -> None:
    async def main() -> None:
        rnd, ids = _round()
        rnd.seen_gone = {ids[1]}.__contains__  # our gossip view has member 1 gone (a failed dial, silence, restart)
        owner = rnd.owner_for(0, ids[3])
        assert owner is rnd.owned[0] and owner.shard == 0
        # the shard's owner (the asker's word) is left out; everyone else is waited for, as any fallback does
        assert owner.waiting_for == {1, 2, 3}

    asyncio.run(main())
