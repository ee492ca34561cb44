"""bench.wire's raw-TCP baseline in each connection layout, real sockets between real namespaces (needs root), and
its --cc mistakes, each one line."""

from __future__ import annotations

import pytest

from bench.slowlink import SlowLinkNet
from bench.wire import main, raw_tcp
from tests.test_slowlink import needs_netns


def test_a_congestion_control_that_is_not_a_name_is_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--peers", "2", "--cc", "bbr; reboot"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --cc: congestion must be a kernel congestion-control name" in err and "Traceback" not in err


@needs_netns
def test_a_congestion_control_the_kernel_lacks_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--peers", "2", "--rates", "100", "--codecs", "int4", "--repeats", "1", "--cc", "nosuchcc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench.wire: cannot set net.ipv4.tcp_congestion_control=nosuchcc"), err


@needs_netns
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
