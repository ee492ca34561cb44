"""The PEERD_FAULT_UPLINK_MBIT injector's token bucket (peerd/faults.py `Uplink`): it must share its rate between
messages in flight as a real uplink shares it between TCP flows, or a slow peer's first-served owner sees it prompt
and the swarm's timing judge (peerd/timings.py) is tested against a link no one has."""

from __future__ import annotations

import asyncio
import time

from peerd.faults import Uplink

MBIT = 8.0  # 1e6 bytes/s: 100 KB take 0.1 s


async def _finish_times(sizes: list[int]) -> list[float]:
    uplink = Uplink(MBIT)
    start = time.monotonic()

    async def send(n: int) -> float:
        await uplink.take(n)
        return time.monotonic() - start

    return list(await asyncio.gather(*(send(n) for n in sizes)))


def test_one_message_takes_its_bytes_over_the_rate() -> None:
    (t,) = asyncio.run(_finish_times([100_000]))
    assert 0.095 <= t < 0.3, t


def test_messages_in_flight_share_the_rate_and_finish_together() -> None:
    """Three 100 KB parts to three owners: each arrives at about 0.3 s, as three flows on one link would. Paced as
    whole messages in turn, the first arrived at 0.1 s and the second at 0.2 s."""
    times = asyncio.run(_finish_times([100_000] * 3))
    assert min(times) >= 0.25, times
    assert max(times) < 0.6, times


def test_a_small_message_is_not_queued_behind_a_large_one() -> None:
    """A 16 KB message beside a 1 MB one leaves after about two quanta, not after the megabyte."""
    times = asyncio.run(_finish_times([1_000_000, 16_000]))
    assert times[1] < 0.2, times
    assert times[0] >= 0.95, times
