"""Uplink traces for the wire bench: how busy each shaped uplink was, moment by moment, during a round.

A round slower than raw TCP over the same links either idles an uplink (nothing to send: a dependency, a stall in
the sender) or sends more than it needs to. The round's totals cannot tell which; a trace of each uplink's counter
can. Samples come from the host interface's transmit counter (after the tbf, so what actually left at the shaped
rate), read every `interval` seconds on a thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from types import TracebackType

from bench.slowlink import SlowLinkError, SlowLinkNet


class UplinkTrace:
    """Sample every host's transmitted bytes while the context is open (wall clock, like the bench's timings)."""

    def __init__(self, net: SlowLinkNet, n: int, interval: float = 0.02) -> None:
        self.net, self.n, self.interval = net, n, interval
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="uplink-trace", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), [self.net.tx_bytes(i) for i in range(self.n)]))
            except SlowLinkError:  # the net is being torn down
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> UplinkTrace:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, i: int, start: float, end: float, rate_mbit: float) -> float:
        """Host i's bytes sent in [start, end] over what its shaped rate allows in that time (1.0: never idle)."""
        pts = [(t, b[i]) for t, b in self.samples if start <= t <= end]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return float("nan")
        return (pts[-1][1] - pts[0][1]) / ((pts[-1][0] - pts[0][0]) * rate_mbit * 1e6 / 8)

    def bins(self, i: int, start: float, end: float, rate_mbit: float, width: float = 0.5) -> list[float]:
        """`busy` over consecutive `width`-second windows from `start` to `end`."""
        edges = [start + k * width for k in range(int((end - start) / width) + 1)] + [end]
        return [self.busy(i, a, b, rate_mbit) for a, b in itertools.pairwise(edges) if b - a > width / 4]


def render(values: list[float]) -> str:
    """Busy shares as one character each: ' ' idle, '.' < 35%, ':' < 70%, '+' < 90%, '#' 90% or more."""
    marks = [(0.05, " "), (0.35, "."), (0.7, ":"), (0.9, "+")]
    return "".join("?" if v != v else next((m for limit, m in marks if v < limit), "#") for v in values)
