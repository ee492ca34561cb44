"""Outbound-only peers behind a real block (issue 11): peers in network namespaces, inbound SYNs to some hosts
dropped by `FaultNet.block_inbound`, so they can dial out but nobody can dial them.

Needs root for network namespaces; skipped with the reason otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.nat import write_keys
from bench.netfaults import FaultNet
from tests.netswarm import NetSwarm
from tests.swarm import tiny_config
from tests.test_nat import LEADER_UNREACHABLE, OUTBOUND_LINE, assert_identical_globals
from tests.test_slowlink import needs_netns

pytestmark = pytest.mark.slow

CONFIGS: dict[str, dict[str, Any]] = {
    "diloco": {"run__outer_steps": 4},
    "streaming": {"run__algorithm": "streaming", "codec__name": "e3m0", "streaming__fragments": 2,
                  "run__outer_steps": 3, "inner__steps": 8, "streaming__tau": 2, "streaming__late_policy": "wait"},
    "noloco": {"run__algorithm": "noloco", "run__outer_steps": 6},
}  # fmt: skip


def run_blocked(tmp_path: Path, algorithm: str, blocked: list[int], n: int = 4) -> NetSwarm:
    """A swarm of `n` peers in namespaces whose hosts in `blocked` cannot be dialled; those get the lowest ids, so
    without the outbound-only rules they would lead every round. Returns the finished swarm."""
    write_keys(tmp_path, n, blocked)
    with FaultNet(n, 1000.0) as net:
        for i in blocked:
            net.block_inbound(i)
        swarm = NetSwarm(tmp_path, n, tiny_config(tmp_path, **CONFIGS[algorithm]), net=net)
        with swarm:
            swarm.wait_exit(240)
        for i in blocked:
            assert net.syns_dropped(i) > 0  # the dial-back probe met the block
    return swarm


@needs_netns
@pytest.mark.parametrize("blocked", [[1], [1, 2]], ids=["1of4", "2of4"])
@pytest.mark.parametrize("algorithm", ["diloco", "streaming", "noloco"])
def test_outbound_only_peers_in_namespaces(tmp_path: Path, algorithm: str, blocked: list[int]) -> None:
    swarm = run_blocked(tmp_path, algorithm, blocked)
    ids = {p.summary()["peer_id"] for p in swarm.peers}
    for p in swarm.peers:
        log, s = p.log(), p.summary()
        assert (OUTBOUND_LINE in log) == (p.index in blocked), p.log_tail()
        if p.index not in blocked:
            assert f"reachable at {swarm.address(p.index)}" in log, p.log_tail()
        assert LEADER_UNREACHABLE not in log
        assert s["finished"] and s["rounds_partial"] == 0, s
        if algorithm != "noloco":
            assert all(set(r["included"]) == ids for r in s["rounds"]), s["rounds"]
        else:
            paired = [r for r in s["rounds"] if r["note"].startswith("partner ")]
            assert len(paired) >= len(s["rounds"]) // 2, s["rounds"]  # reachable peers leave them the first move
    if algorithm != "noloco":
        assert_identical_globals([p.data_dir for p in swarm.peers])
