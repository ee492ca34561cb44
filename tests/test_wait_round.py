"""An owner asked for a round it does not know: wait while its own rendezvous may still hand it that round, and say
"not in that round" at once when none can (RoundClient.wait_round). A unit test of that one seam, with the daemon
reduced to the settings it reads; tests/test_refusals.py checks the answer a real daemon gives on the wire."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from peerd.rendezvous import Behind
from peerd.roundclient import RoundClient
from peerd.v1 import peerd_pb2 as pb


def _client() -> RoundClient:
    net = SimpleNamespace(rendezvous_timeout=30.0, round_timeout=60.0)
    return RoundClient(SimpleNamespace(cfg=SimpleNamespace(network=net), loop=asyncio.get_running_loop()))


def test_an_unknown_round_waits_only_while_a_rendezvous_of_ours_is_in_flight() -> None:
    async def main() -> None:
        rc = _client()
        # No rendezvous of ours in flight: no leader can name us in a group, so we are not in that round.
        assert await asyncio.wait_for(rc.wait_round(b"a" * 32), 1.0) is None

        answer = asyncio.Event()

        async def rendezvous(*args: object) -> pb.RendezvousResponse:
            await answer.wait()
            return pb.RendezvousResponse(behind=5)

        rc._rendezvous = rendezvous  # type: ignore[method-assign]
        asking = asyncio.ensure_future(rc.allreduce(4, torch.zeros(4), -1))
        await asyncio.sleep(0)
        ours, other = asyncio.ensure_future(rc.wait_round(b"b" * 32)), asyncio.ensure_future(rc.wait_round(b"c" * 32))
        await asyncio.sleep(0.3)
        assert not ours.done() and not other.done()  # our leader may yet hand us either round
        rc.register_round(b"b" * 32, "the round")  # a member's stream came before our own answer
        assert await asyncio.wait_for(ours, 1.0) == "the round"
        assert not other.done()
        answer.set()  # our rendezvous settled without that round: its streams are answered now, not at a deadline
        with pytest.raises(Behind):
            await asking
        assert await asyncio.wait_for(other, 1.0) is None
        assert await asyncio.wait_for(rc.wait_round(b"b" * 32), 1.0) == "the round"

    asyncio.run(main())


def test_a_stream_that_stops_waiting_leaves_the_others_for_the_same_round_waiting_on_it() -> None:
    """Two members stream to us for the same unknown round. The first one's wait ends first (its deadline comes, or
    its stream breaks): the second must still be woken as soon as the round registers, not at its own deadline, and
    nothing is left behind (a leaked entry per broken stream would, after MAX_HELD of them, stop all holding)."""
    from peerd.round_registry import RoundRegistry

    async def main() -> None:
        registry = RoundRegistry(hold_s=2.0)
        with registry.asking():
            first = asyncio.ensure_future(registry.wait(b"r" * 32, "m1"))
            await asyncio.sleep(1.0)
            second = asyncio.ensure_future(registry.wait(b"r" * 32, "m2"))
            await asyncio.sleep(1.2)  # the first one's deadline has passed; the second has 0.8 s left
            assert first.done() and await first is None and not second.done()
            registry.register(b"r" * 32, "the round")
            assert await asyncio.wait_for(second, 0.5) == "the round"
            broken = asyncio.ensure_future(registry.wait(b"s" * 32, "m3"))
            await asyncio.sleep(0.05)
            broken.cancel()
            with pytest.raises(asyncio.CancelledError):
                await broken
        assert not registry._events and not registry._held_by

    asyncio.run(main())
