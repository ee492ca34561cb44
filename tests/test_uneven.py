"""Uneven peers with real processes: a 3x slower peer in a windowed DiLoCo run (inner.window_s) takes fewer steps,
is never waited for, loses no work, and its contribution counts by its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.swarm import Swarm, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = pytest.mark.slow

SLOW = {"PEERD_FAULT_STEP_DELAY_S": "0.08"}  # the tiny model's own step is ~20-40 ms here: 3x or more slower


def test_windowed_rounds_weigh_a_slow_peer_by_its_tokens(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=4, inner__window_s=1.5, inner__steps=1000)
    swarm = Swarm(tmp_path, 3, cfg)
    try:  # started by hand: one peer gets the slow-compute injector
        swarm.peers.append(swarm.spawn(0, None, wait_peers=3))
        boot = swarm.boot_address(0)
        swarm.peers.append(swarm.spawn(1, boot, wait_peers=3))
        swarm.peers.append(swarm.spawn(2, boot, wait_peers=3, env=SLOW))
        for p in swarm.peers:
            p.wait_file("address")
        swarm.wait_exit(180)
    finally:
        swarm.stop()
    dirs = [p.data_dir for p in swarm.peers]
    assert_identical_globals(dirs)
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[2]["peer_id"]
    for s in summaries:
        assert s["outer_step"] == 4 and s["finished"]
        assert s["discarded_steps"] == 0, s
    assert summaries[2]["inner_step"] < 0.7 * min(s["inner_step"] for s in summaries[:2]), summaries
    full = [r for r in summaries[0]["rounds"] if len(r["included"]) == 3]
    assert len(full) >= 3, summaries[0]["rounds"]
    for r in full:
        tokens = dict(zip(r["included"], r["tokens"], strict=True))
        fast = [t for pid, t in tokens.items() if pid != slow_id]
        # the slow peer's work counts less, in proportion, and is never dropped
        assert 0 < tokens[slow_id] < 0.7 * min(fast), r
