"""Unit tests of the takeover rule (`ReduceRound.owner_for`), in memory: a member whose exchange with a shard's owner
failed asks the next owner in line to reduce that shard. The asked peer takes it over only when its own evidence has
every owner between the lost one and itself gone; otherwise views differ and it refuses. Its own evidence is the
round's (its own exchanges) and, since the 64-peer churn runs, its gossip view (`seen_gone`) and a probe of its own
(a PULL to the owner in between: refused or restarted is gone). The real-process behaviour is
tests/test_round_survives.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from peerd.allreduce import ReduceRound, RoundFailed
from peerd.codecs import make_codec
from peerd.identity import Identity
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import kind_to_wire


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


class _Call:
    """A Reduce call whose peer is dead (refused: UNAVAILABLE), restarted (NOT_FOUND) or alive (an empty answer)."""

    def __init__(self, code: grpc.StatusCode | None) -> None:
        self.code = code

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> pb.TensorMessage:
        if self.code is None:
            raise StopAsyncIteration
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "probe")

    def cancel(self) -> None:
        pass


def _stubs(codes: dict[str, grpc.StatusCode | None], dialled: list[str]) -> object:
    class Stub:
        def __init__(self, member: pb.PeerInfo) -> None:
            self.pid = member.peer_id

        def Reduce(self, msgs: object, timeout: float) -> _Call:
            dialled.append(self.pid)
            assert next(iter(msgs)).header.kind == kind_to_wire("pull")  # type: ignore[call-overload]
            return _Call(codes.get(self.pid))

    return Stub


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND])
def test_a_probe_that_finds_the_owner_between_gone_lets_the_takeover_happen(code: grpc.StatusCode) -> None:
    """Our views hold member 1 alive, but its process refuses the dial (dead) or is a new one (restarted): our own
    evidence, within a second rather than after 15-30 s of gossip silence."""

    async def main() -> None:
        rnd, ids = _round()
        dialled: list[str] = []
        rnd._stub_for = _stubs({ids[1]: code}, dialled)
        owner = await asyncio.wait_for(rnd.wait_owner(0, ids[3]), 5)
        assert owner is rnd.owned[0] and dialled == [ids[1]]  # only the owner in between, once

    asyncio.run(main())


def test_an_owner_between_that_answers_the_probe_is_alive_and_the_takeover_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("peerd.takeover.FALLBACK_GRACE_S", 0.5)

    async def main() -> None:
        rnd, ids = _round()
        dialled: list[str] = []
        rnd._stub_for = _stubs({ids[1]: None}, dialled)
        with pytest.raises(RoundFailed, match="not next in line for shard 0"):
            await asyncio.wait_for(rnd.wait_owner(0, ids[3]), 5)
        assert dialled == [ids[1]] and 0 not in rnd.owned  # probed once, not on every retry of the check
        with pytest.raises(RoundFailed, match=rf"probed: {ids[1][:8]} answered in \d+\.\d s"):
            rnd.owner_for(0, ids[3])  # the refusal says what the probe found

    asyncio.run(main())


def test_a_finished_round_lets_go_of_its_result_and_decodes_late_parts_into_scratch() -> None:
    """A completed round lingers to relay what it holds, but its result is the caller's: a shard relayed to it later
    must not land there, and holding it would keep the result's buffer from going back to the pool
    (peerd/codecs/hostmem.py) while the round lingers."""

    async def main() -> None:
        rnd, _ = _round()
        rnd._prepare()
        result = rnd.average
        assert result is not None
        result.fill_(1.0)
        rnd.finished()
        assert rnd.average is None
        rnd.ctx.result((0, 16)).fill_(9.0)  # where a late relayed or taken-over part would be decoded
        assert bool((result == 1.0).all())

    asyncio.run(main())
