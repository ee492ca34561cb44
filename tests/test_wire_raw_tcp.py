"""bench.wire's raw-TCP baseline in each connection layout: real sockets between real namespaces (needs root)."""

from __future__ import annotations

import pytest

from bench.slowlink import SlowLinkNet, available
from bench.wire import raw_tcp

_OK, _REASON = available()

pytestmark = [pytest.mark.root, pytest.mark.skipif(not _OK, reason=f"slow-link net unavailable: {_REASON}")]


@pytest.mark.parametrize("pairs", [1, 2, 0])
def test_every_layout_moves_the_bytes_each_way_at_the_link_rate(pairs: int) -> None:
    """The baseline is only a limit if it really moves `nbytes` from every peer to every other: each uplink must
    carry them, and no faster than the shaped rate allows."""
    nbytes, rate = 1_000_000, 40.0
    with SlowLinkNet(3, rate) as net:
        before = [net.tx_bytes(i) for i in range(3)]
        seconds = raw_tcp(net, 3, nbytes, pairs)
        sent = [net.tx_bytes(i) - b for i, b in zip(range(3), before, strict=True)]
    assert all(s >= 2 * nbytes for s in sent), sent  # to each of the two others, whatever the layout
    assert all(s < 2 * nbytes * 1.1 for s in sent), sent  # and not twice (headers and ACKs are a few %)
    assert seconds >= 2 * nbytes * 8 / (rate * 1e6) * 0.95, seconds  # no layout beats the shaped uplink
