"""bench/uplink_trace.py's arithmetic on hand-made samples (sampling needs namespaces: bench.wire --trace)."""

from __future__ import annotations

import math

from bench.uplink_trace import UplinkTrace, render

RATE_MBIT = 8.0  # 1 MB/s


def _trace(samples: list[tuple[float, list[int]]]) -> UplinkTrace:
    trace = UplinkTrace(None, 2)  # type: ignore[arg-type]  # never started: no net is read
    trace.samples = samples
    return trace


def test_busy_share_is_bytes_sent_over_what_the_rate_allows() -> None:
    # host 0 sends 1 MB/s for 2 s, then nothing for 2 s; host 1 half the rate throughout
    samples = [(t / 10, [min(t, 20) * 100_000, t * 50_000]) for t in range(41)]
    trace = _trace(samples)
    assert math.isclose(trace.busy(0, 0.0, 2.0, RATE_MBIT), 1.0)
    assert math.isclose(trace.busy(0, 0.0, 4.0, RATE_MBIT), 0.5)
    assert math.isclose(trace.busy(1, 0.0, 4.0, RATE_MBIT), 0.5)
    assert trace.bins(0, 0.0, 4.0, RATE_MBIT, width=1.0) == [1.0, 1.0, 0.0, 0.0]
    assert render(trace.bins(0, 0.0, 4.0, RATE_MBIT, width=1.0)) == "##  "
    assert math.isnan(trace.busy(0, 10.0, 11.0, RATE_MBIT))  # no samples there: unknown, not idle
    assert render([float("nan"), 0.2, 0.5, 0.8]) == "?.:+"
