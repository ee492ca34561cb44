"""Unit tests of one shard owner's drop rule (peerd/shard_owner.py), in memory: contributions go straight into
`accept`, no stream. The real-process behaviour (a member dies mid-round) is tests/test_round_survives.py."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from peerd.codecs import make_codec
from peerd.identity import Identity
from peerd.roundtypes import RoundStats, sum_of_squares
from peerd.shard_owner import RoundContext, ShardOwner
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

PARTS = [(0, 4), (4, 8)]


def _owner(n: int, weights: list[float] | None = None) -> tuple[ShardOwner, torch.Tensor, list[str]]:
    ident = Identity.generate()
    ids = [ident.peer_id] + [f"{i:064x}" for i in range(1, n)]
    result = torch.zeros(8)
    left: list[str] = []

    def place(bounds: tuple[int, int]) -> torch.Tensor:
        return result[bounds[0] : bounds[1]]

    ctx = RoundContext(
        pb.Group(round_id=b"r" * 32), ids, 0, ident, b"run", make_codec("fp32"), ThreadPoolExecutor(1), 1 << 20,
        None, None, place, left.append, RoundStats(), time.monotonic() + 30, weights,
    )  # fmt: skip
    return ShardOwner(ctx, 0, PARTS, set(range(n))), result, left


def _give(owner: ShardOwner, index: int, part: int, values: torch.Tensor) -> None:
    owner.accept(index, part, values.clone(), sum_of_squares(values))


def _mask(owner: ShardOwner, k: int) -> bytes:
    return owner.frames[k].result()[1]


def test_a_dropped_contributor_counts_where_it_arrived_and_nowhere_else() -> None:
    async def main() -> None:
        owner, result, _ = _owner(3)
        x = [torch.full((8,), float(10**i)) for i in range(3)]  # 1, 10, 100: each sum says who is in it
        _give(owner, 2, 0, x[2][:4])  # member 2 sends its first part, then dies
        for i in (0, 1):
            _give(owner, i, 0, x[i][:4])
        _give(owner, 0, 1, x[0][4:])
        _give(owner, 1, 1, x[1][4:])
        await asyncio.sleep(0.2)
        assert not owner.frames[1].done()  # still waiting for member 2's second part
        owner.drop(2)
        await asyncio.wait_for(asyncio.shield(owner.reduced), 5)
        assert _mask(owner, 0) == bytes([0b111]) and _mask(owner, 1) == bytes([0b011])
        assert torch.equal(result[:4], torch.full((4,), 111 / 3))
        assert torch.equal(result[4:], torch.full((4,), 11 / 2))
        _give(owner, 2, 1, x[2][4:])  # a late part of a dropped member changes nothing, and is no error

    asyncio.run(main())


def test_a_contributor_that_delivered_everything_is_not_dropped() -> None:
    async def main() -> None:
        owner, result, _ = _owner(3)
        for k, (lo, hi) in enumerate(PARTS):
            _give(owner, 1, k, torch.ones(hi - lo))
        owner.drop(1)  # it left after its last part: its contribution counts in full
        owner.drop(0)  # the owner never drops itself
        for k, (lo, hi) in enumerate(PARTS):
            _give(owner, 0, k, torch.zeros(hi - lo))
        assert not owner.reduced.done()  # member 2 is still awaited
        owner.drop(2)
        await asyncio.wait_for(asyncio.shield(owner.reduced), 5)
        assert _mask(owner, 0) == _mask(owner, 1) == bytes([0b011])
        assert torch.equal(result, torch.full((8,), 0.5))

    asyncio.run(main())


def test_a_weighted_subset_keeps_the_token_weighted_mean() -> None:
    async def main() -> None:
        # members scaled their vectors by w = tokens / mean(tokens): tokens 1, 2, 3 give w = 0.5, 1, 1.5
        w = [0.5, 1.0, 1.5]
        owner, result, _ = _owner(3, w)
        raw = [torch.full((8,), v) for v in (2.0, 4.0, 8.0)]
        for k, (lo, hi) in enumerate(PARTS):
            for i in (0, 1):
                _give(owner, i, k, raw[i][lo:hi] * w[i])
        owner.drop(2)  # never sent anything
        await asyncio.wait_for(asyncio.shield(owner.reduced), 5)
        expected = (1 * 2.0 + 2 * 4.0) / 3  # the token-weighted mean of the two that remain
        assert torch.allclose(result, torch.full((8,), expected)), result

    asyncio.run(main())


def test_a_shard_taken_over_waits_only_for_its_contributors() -> None:
    async def main() -> None:
        owner, result, _ = _owner(4)
        owner = ShardOwner(owner.ctx, 1, PARTS, {0, 2})  # owner 1 died, member 3 was seen lost
        for k, (lo, hi) in enumerate(PARTS):
            _give(owner, 0, k, torch.full((hi - lo,), 1.0))
            _give(owner, 1, k, torch.full((hi - lo,), 50.0))  # the dead owner's own: ignored
            _give(owner, 2, k, torch.full((hi - lo,), 3.0))
        await asyncio.wait_for(asyncio.shield(owner.reduced), 5)
        assert _mask(owner, 0) == _mask(owner, 1) == bytes([0b0101])
        assert torch.equal(result, torch.full((8,), 2.0))

    asyncio.run(main())


def test_the_silent_minority_is_left_out_but_a_silent_majority_is_waited_for() -> None:
    """drop_silent (fired at half the round's time): members of which nothing arrived are left out when most others'
    came; when most are silent the trouble is more likely the owner's, and it keeps waiting."""

    async def main() -> None:
        owner, result, _ = _owner(4)
        for i in (0, 1, 2):
            for k, (lo, hi) in enumerate(PARTS):
                _give(owner, i, k, torch.full((hi - lo,), float(i)))
        assert not owner.reduced.done()
        assert owner.drop_silent() == [owner.ctx.ids[3]]
        await asyncio.wait_for(asyncio.shield(owner.reduced), 5)
        assert _mask(owner, 0) == _mask(owner, 1) == bytes([0b0111])
        assert torch.equal(result, torch.full((8,), 1.0))

        owner, _, _ = _owner(4)
        for k, (lo, hi) in enumerate(PARTS):
            _give(owner, 0, k, torch.zeros(hi - lo))
        _give(owner, 1, 0, torch.zeros(4))  # one of three others began: two silent of three is no minority
        assert owner.drop_silent() == [] and not owner.reduced.done()

    asyncio.run(main())


def test_a_fallback_owner_never_leaves_out_the_silent() -> None:
    """A fallback waits for every member it has not seen lost: those that went to the shard's owner never come, and
    waiting for them keeps the two from completing one shard twice (allreduce.py)."""

    async def main() -> None:
        owner, _, _ = _owner(4)
        owner.ctx.deadline = time.monotonic() + 0.2  # half of it: the silent minority's timer, for our own shard
        own = ShardOwner(owner.ctx, 0, PARTS, set(range(4)))
        fallback = ShardOwner(owner.ctx, 1, PARTS, set(range(4)), leave_out_silent=False)
        for o in (own, fallback):
            for i in (0, 1, 2):  # member 3 stays silent: a minority
                for k, (lo, hi) in enumerate(PARTS):
                    _give(o, i, k, torch.zeros(hi - lo))
        await asyncio.sleep(0.4)
        assert own.reduced.done() and own.dropped == {3}
        assert not fallback.reduced.done() and not fallback.dropped

    asyncio.run(main())


def test_a_stream_whose_reader_failed_earlier_fails_at_once() -> None:
    """The reader of a member's stream refused a corrupt part while the owner was still sending that member earlier
    averaged parts: the next wait must raise the reader's error now, not wait for a part that will never be
    averaged until the round's deadline (60 s rounds in CI)."""

    async def main() -> None:
        owner, _, _ = _owner(2)
        reader = asyncio.get_running_loop().create_future()
        reader.set_exception(StreamError("malformed", "contribution part 2 does not decode"))
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(owner._until(owner.frames[0], reader), 10)
        except StreamError as exc:
            assert exc.reason == "malformed"
        else:
            raise AssertionError("no error")
        assert time.monotonic() - t0 < 1.0

    asyncio.run(main())


def test_sum_of_squares_in_rows_matches_float64() -> None:
    """The screening's squares (float32 rows added in float64) agree with an exact float64 sum to float32 row
    precision, across the row boundary and for a tail shorter than a row, and are the same for the same bytes."""
    for n in (0, 1, 1023, 1024, 1025, 5 * 1024 + 7, 300_001):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.0
        exact = float(x.double().square().sum())
        got = sum_of_squares(x)
        assert abs(got - exact) <= 1e-6 * exact, (n, got, exact)
        assert sum_of_squares(x.clone()) == got
