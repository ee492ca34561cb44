"""Unit tests of relaying a lost owner's shard (peerd/shard_relay.py), in memory: the owner's signed averaged parts go
through `relay_stream` and back through `read_relay` as a fallback would read them, and a shard owner adopts them.
The real-process behaviour (an owner dies while sending its shard) is tests/test_round_survives.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from peerd.codecs import make_codec
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.roundtypes import RoundStats, part_messages, sum_of_squares
from peerd.shard_owner import RoundContext, ShardOwner
from peerd.shard_relay import HeldShard, pull_reply, pull_request, pull_until_reduced, read_relay, relay_stream
from peerd.streams import StreamError, read_tensor
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_to_wire, kind_to_wire

RUN = b"r" * 32
ROUND = b"round-1".ljust(32, b"\0")
PARTS = [(0, 4), (4, 8)]
CODEC = make_codec("fp32")


async def _stream(msgs: Iterable[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
    for m in msgs:
        yield m


def _owner_parts(owner: Identity, values: torch.Tensor, round_id: bytes = ROUND, kind: str = "gather") -> list:
    """The owner's signed averaged parts of shard 1, as a member's stream carried them."""
    msgs: list[pb.TensorMessage] = []
    chain = b""
    for k, (lo, hi) in enumerate(PARTS):
        header = pb.TensorHeader(
            round_id=round_id, shard=1, part=k, numel=hi - lo, codec=codec_to_wire("fp32"), kind=kind_to_wire(kind),
            included_mask=bytes([0b111]),
        )  # fmt: skip
        part, chain = part_messages(header, CODEC.encode(values[lo:hi]), owner, RUN, 1 << 20, chain)
        msgs += part
    return msgs


async def _held(owner: Identity, values: torch.Tensor, **kw) -> HeldShard:
    """What a member keeps: the parts read off its stream (signatures checked)."""
    stream = _stream(_owner_parts(owner, values, **kw))
    got = []
    chain = b""
    for lo, hi in PARTS:
        rx = await read_tensor(stream, Verifier(RUN), CODEC.max_encoded_size(hi - lo), chain=chain)
        chain = rx.digest
        got.append(rx)
    return HeldShard(got[0].sender, got)


async def _relay_and_read(held: HeldShard, relayer: Identity, sources: list[str]) -> HeldShard:
    stream = _stream(relay_stream(held, ROUND, 1, relayer, RUN, 5))  # 5-byte chunks: cut otherwise than signed
    fallback = Verifier(RUN)  # the fallback's own replay guard: it never saw the owner's headers to the member
    return await read_relay(stream, fallback, relayer.peer_id, round_id=ROUND, shard=1, parts=PARTS, codec=CODEC,
                            n=3, sources=sources)  # fmt: skip


def test_a_relayed_shard_arrives_as_its_owner_signed_it() -> None:
    owner, relayer = Identity.generate(), Identity.generate()
    values = torch.arange(8, dtype=torch.float32)

    async def main() -> None:
        held = await _held(owner, values)
        got = await _relay_and_read(held, relayer, [owner.peer_id])
        assert got.source == owner.peer_id
        assert [bytes(rx.payload) for rx in got.parts] == [bytes(rx.payload) for rx in held.parts]
        assert [mask for _, mask in got.frames()] == [bytes([0b111])] * 2

    asyncio.run(main())


def test_a_relay_is_refused_unless_the_owner_signed_it_for_this_shard_of_this_round() -> None:
    owner, relayer, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    values = torch.ones(8)

    async def main() -> None:
        # signed by a peer that is not in line for the shard (the relayer forging an average, say)
        with pytest.raises(StreamError, match="not signed by shard 1's owner"):
            await _relay_and_read(await _held(stranger, values), relayer, [owner.peer_id])
        # another round's average of the same shard
        with pytest.raises(StreamError, match="does not match"):
            await _relay_and_read(await _held(owner, values, round_id=b"old".ljust(32, b"\0")), relayer,
                                  [owner.peer_id])  # fmt: skip
        # a contribution, not an average
        with pytest.raises(StreamError, match="not an averaged part"):
            await _relay_and_read(await _held(owner, values, kind="reduce"), relayer, [owner.peer_id])
        # a payload altered on the way: the owner's digest no longer matches
        held = await _held(owner, values)
        held.parts[1].payload[0] ^= 1
        with pytest.raises(StreamError, match="signed digest"):
            await _relay_and_read(held, relayer, [owner.peer_id])

    asyncio.run(main())


def _fallback(n: int = 3, waits_for: set[int] | None = None) -> tuple[ShardOwner, torch.Tensor]:
    ident = Identity.generate()
    ids = [ident.peer_id] + [f"{i:064x}" for i in range(1, n)]
    result = torch.zeros(8)

    def place(bounds: tuple[int, int]) -> torch.Tensor:
        return result[bounds[0] : bounds[1]]

    ctx = RoundContext(
        pb.Group(round_id=ROUND), ids, 0, ident, RUN, CODEC, ThreadPoolExecutor(1), 1 << 20, None, None, place,
        lambda _: None, RoundStats(), time.monotonic() + 30, None,
    )  # fmt: skip
    return ShardOwner(ctx, 1, PARTS, {0, 2} if waits_for is None else waits_for), result


def test_a_fallback_serves_the_adopted_average_not_its_own() -> None:
    owner = Identity.generate()
    theirs = torch.arange(8, dtype=torch.float32) / 3

    async def main() -> None:
        fallback, result = _fallback()
        fallback.accept(0, 0, torch.full((4,), 7.0), 4 * 49.0)  # our own contribution arrived first
        held = await _held(owner, theirs)
        assert await fallback.adopt(held.frames(), owner.peer_id)
        await asyncio.wait_for(asyncio.shield(fallback.reduced), 5)
        assert torch.equal(result, theirs)  # the lost owner's average, bit for bit
        assert [fallback.frames[k].result()[1] for k in range(2)] == [bytes([0b111])] * 2
        assert fallback.reply_sumsq == [sum_of_squares(theirs[:4]), sum_of_squares(theirs[4:])]
        fallback.accept(2, 0, torch.zeros(4), 0.0)  # late contributions change nothing
        fallback.accept(2, 1, torch.zeros(4), 0.0)
        await asyncio.sleep(0.1)
        assert torch.equal(result, theirs)

    asyncio.run(main())


def test_a_fallback_that_began_averaging_does_not_adopt() -> None:
    """It only can once every member it waits for contributed a part, so none of them holds the lost one's shard."""
    owner = Identity.generate()

    async def main() -> None:
        fallback, result = _fallback()
        for i in (0, 2):
            fallback.accept(i, 0, torch.full((4,), float(i)), 4.0 * i * i)
        await asyncio.sleep(0.1)
        assert not await fallback.adopt((await _held(owner, torch.ones(8))).frames(), owner.peer_id)
        assert torch.equal(result[:4], torch.full((4,), 1.0))

    asyncio.run(main())


def test_a_pull_answer_arrives_as_its_owner_signed_it_and_nothing_held_is_an_empty_answer() -> None:
    owner = Identity.generate()
    values = torch.arange(8, dtype=torch.float32)

    async def main() -> None:
        held = await _held(owner, values)
        ask = list(pull_request(ROUND, 1, Identity.generate(), RUN, 5))
        assert ask[0].header.kind == kind_to_wire("pull") and ask[0].header.numel == 0
        got = await read_relay(_stream(pull_reply(held, 5)), Verifier(RUN), "", round_id=ROUND, shard=1, parts=PARTS,
                               codec=CODEC, n=3, sources=[owner.peer_id], own_first=False)  # fmt: skip
        assert got.source == owner.peer_id
        assert [bytes(rx.payload) for rx in got.parts] == [bytes(rx.payload) for rx in held.parts]
        assert list(pull_reply(None, 5)) == []

    asyncio.run(main())


def test_a_fallback_pulls_from_the_members_it_waits_for_until_one_holds_the_shard() -> None:
    owner = Identity.generate()
    theirs = torch.arange(8, dtype=torch.float32) / 3

    async def main() -> None:
        fallback, result = _fallback(6, set(range(6)))  # waits for all 6 members (itself included)
        held = await _held(owner, theirs)
        waiting = sorted(fallback.missing())
        asked: list[str] = []

        async def ask(pid: str) -> HeldShard | None:
            asked.append(pid)
            return held if len(asked) > 7 else None  # nobody holds it the first time round

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("peerd.shard_relay.PULL_EVERY_S", 0.01)
            source = await pull_until_reduced(fallback, ask, time.monotonic() + 5, 0.0)
            assert source == owner.peer_id and torch.equal(result, theirs)
            assert asked == waiting + waiting[:3]  # each in turn, then again from the start; one copy adopted
            assert await pull_until_reduced(fallback, ask, time.monotonic() + 5, 0.0) is None  # reduced: no asking
        assert len(asked) == 9

    asyncio.run(main())
