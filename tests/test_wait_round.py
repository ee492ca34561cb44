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
