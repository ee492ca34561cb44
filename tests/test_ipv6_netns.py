"""An IPv6-only swarm: peers in network namespaces whose only addresses are IPv6 (fd77::/64), started without
--announce, so each learns the address others see it at, and one of them behind an inbound-SYN block (NAT's shape;
IPv6 volunteers are behind stateful firewalls as often as IPv4 ones are behind NAT).

Every IPv4 test runs the same code with dotted addresses; here any place that writes `host:port` without brackets,
reads an address as IPv4 or listens on 0.0.0.0 only breaks the run. Needs root for network namespaces; skipped
with the reason otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.nat import write_keys
from bench.netfaults import FaultNet
from tests.netswarm import NetSwarm
from tests.swarm import tiny_config
from tests.test_nat import LEADER_UNREACHABLE, OUTBOUND_LINE, assert_identical_globals
from tests.test_nat_netns import CONFIGS
from tests.test_partition import PACE, _check_honest, _config, _logged_step, _wait_step
from tests.test_slowlink import needs_netns

pytestmark = pytest.mark.slow

SUBNET = "fd77::/64"


@needs_netns
@pytest.mark.parametrize("algorithm", ["diloco", "noloco"])
def test_an_ipv6_only_swarm_learns_its_addresses_and_trains_as_one(tmp_path: Path, algorithm: str) -> None:
    n, blocked = 4, 1
    write_keys(tmp_path, n, [blocked])  # the blocked peer gets the lowest id: it would lead every round otherwise
    with FaultNet(n, 1000.0, subnet=SUBNET) as net:
        net.block_inbound(blocked)
        swarm = NetSwarm(tmp_path, n, tiny_config(tmp_path, **CONFIGS[algorithm]), net=net, announce=False)
        with swarm:
            swarm.wait_exit(240)
        assert net.syns_dropped(blocked) > 0  # the dial-back probe met the block
    ids = {p.summary()["peer_id"] for p in swarm.peers}
    for p in swarm.peers:
        log, s = p.log(), p.summary()
        assert swarm.address(p.index).startswith("[fd77::"), swarm.address(p.index)
        assert (OUTBOUND_LINE in log) == (p.index == blocked), p.log_tail()
        if p.index != blocked:
            assert f"reachable at {swarm.address(p.index)}" in log, p.log_tail()
        assert (p.data_dir / "address").read_text().strip() == swarm.address(p.index)
        assert LEADER_UNREACHABLE not in log, p.log_tail()
        assert s["finished"] and s["rounds_partial"] == 0, s
        if algorithm == "diloco":
            assert all(set(r["included"]) == ids for r in s["rounds"]), s["rounds"]
        else:
            paired = [r for r in s["rounds"] if r["note"].startswith("partner ")]
            assert len(paired) >= len(s["rounds"]) // 2, s["rounds"]
    if algorithm == "diloco":
        assert_identical_globals([p.data_dir for p in swarm.peers])


@needs_netns
def test_an_ipv6_peer_cut_off_comes_back_into_one_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer whose IPv6 link goes down mid-run trains alone, then rejoins the same model when the link returns:
    the re-dials, the dial-back check and the catch-up download all take bracketed addresses."""
    monkeypatch.setenv(*PACE)
    with NetSwarm(tmp_path, 3, _config(tmp_path, "diloco", steps=70), subnet=SUBNET) as swarm:
        _wait_step(swarm, 3, 120)
        seen = swarm.status(0, via=1)  # `peerd status [fd77::1]:7000`, from another host
        assert seen.address == swarm.address(0) and {p.address for p in seen.peers} >= {swarm.address(1)}, seen
        swarm.net.cut(2)
        cut_at = _logged_step(swarm.peers[0])
        swarm.wait_until(lambda: _logged_step(swarm.peers[0]) >= cut_at + 8, 120, "8 steps of the other two")
        swarm.net.restore(2)
        swarm.wait_exit(240)
    summaries = [p.summary() for p in swarm.peers]
    assert all(s["finished"] for s in summaries), summaries
    _check_honest(summaries)
    # the fault landed: the other two had rounds without it (it may take no solo step of its own under load: CI)
    assert summaries[0]["rounds_partial"] > 0 and summaries[1]["rounds_partial"] > 0, summaries[:2]
    everyone = {s["peer_id"] for s in summaries}
    assert set(summaries[0]["rounds"][-1]["included"]) == everyone, summaries[0]["rounds"][-1]
    assert_identical_globals([p.data_dir for p in swarm.peers])
