"""The swarm's wall clock: the time this peer signs and checks request timestamps by (peerd/envelope.py).

Every request carries a timestamp that peers refuse when it is more than MAX_CLOCK_SKEW_S (300 s) off their clock,
which bounds how long a captured request could be replayed. A volunteer whose clock is wrong (no NTP, or a dual-boot
machine whose hardware clock keeps local time: off by whole hours) was refused by everyone, and `peerd start` ended
with "refused us: Join: timestamp is more than 300s off". A peer that refuses a request as stale now says its own time
in the reply's trailing metadata (TIME_KEY), and the refused peer takes the swarm's time from it: from the peer it
joins through while it knows no live peer, else only when two peers agree (one peer with a wrong clock must not drag
the others to its time). It then signs and checks by the swarm's time, and says once what is wrong and how to fix it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import grpc

from peerd import faults

log = logging.getLogger("peerd")

TIME_KEY = "peerd-time-ms"  # trailing metadata of a request refused as stale: the refusing peer's time, in ms
MIN_SKEW_S = 60.0  # a sample closer than this to our time is no evidence our clock is wrong (a slow, old request)
AGREE_S = 60.0  # two samples this close are the same clock
SAMPLE_TTL_S = 600.0
MAX_SOURCES = 64


class SwarmClock:
    """This process's correction to its own wall clock (one daemon per process)."""

    def __init__(self) -> None:
        self.offset = 0.0  # seconds added to this machine's clock to get the swarm's
        self._samples: dict[str, tuple[float, float]] = {}  # source -> (their time - ours, monotonic when heard)

    def now(self) -> float:
        return faults.wall() + self.offset

    def refusal_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a stale refusal carries: our time, by the clock we sign with."""
        return ((TIME_KEY, str(int(self.now() * 1000))),)

    def heard(self, exc: BaseException, source: str, known_peers: Callable[[], int]) -> bool:
        """A call of ours to `source` failed with `exc`: if it was refused as stale with the peer's time, learn from
        it. `known_peers()`: the live peers we know besides ourselves (none: we are joining through `source`, so trust
        it alone; in a running pair, each trusting the other alone would swap their clocks back and forth).
        True when our offset changed: the caller may retry at once."""
        their_ms = _their_time(exc)
        if their_ms is None:
            return False
        sample = their_ms / 1000.0 - faults.wall()
        now = time.monotonic()
        self._samples = {s: v for s, v in self._samples.items() if now - v[1] < SAMPLE_TTL_S}
        if abs(sample - self.offset) < MIN_SKEW_S:
            return False
        if len(self._samples) < MAX_SOURCES or source in self._samples:
            self._samples[source] = (sample, now)
        agreeing = [v[0] for v in self._samples.values() if abs(v[0] - sample) < AGREE_S]
        if len(agreeing) < 2 and known_peers() > 0:
            return False
        self.offset = statistics.median(agreeing)
        ahead = -self.offset
        log.warning(
            "this machine's clock is %.0f s %s the swarm's (%s): signing requests by the swarm's time; set the clock "
            "right (turn on NTP, e.g. `timedatectl set-ntp true`; on a dual-boot machine keep the hardware clock in "
            "UTC)",
            abs(ahead),
            "ahead of" if ahead > 0 else "behind",
            f"{len(agreeing)} peers agree" if len(agreeing) > 1 else f"the peer at {source} says so",
        )
        return True


def _their_time(exc: BaseException) -> int | None:
    """The refusing peer's time from a stale refusal's trailing metadata; None for any other failure."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == TIME_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return ms if 0 < ms < 1 << 50 else None
    return None


CLOCK = SwarmClock()
