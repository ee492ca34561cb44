"""A peer that wakes to find the run finished without it, and cannot get the run's final state, stops and says so
(exit 1) instead of training alone to the last step and reporting a finished model of its own. Seen with an MTU
blackhole in network namespaces: a peer cut off from the others' bulk traffic trained 37 solo steps to the end after
the others left, and the run ended on two models. Here the peer is frozen (SIGSTOP) while the other finishes, and the
finished peer stalls every state download it serves (a fault injector), so the end cannot reach it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.swarm import Swarm, tiny_config
from tests.test_partition import _logged_step

STEPS = 12


@pytest.mark.slow
def test_a_peer_that_cannot_get_the_runs_end_stops_rather_than_finishing_alone(tmp_path: Path) -> None:
    env = {"PEERD_FAULT_STEP_DELAY_S": "0.05", "PEERD_FAULT_STATE_STALL_S": "300", "PEERD_FAULT_STATE_STALL_N": "100"}
    cfg = tiny_config(
        tmp_path, run__outer_steps=STEPS, network__linger=6.0, network__peer_timeout=2.0, network__round_timeout=10.0
    )
    swarm = Swarm(tmp_path, 2, cfg, env=env)
    with swarm:
        first, late = swarm.peers
        swarm.wait_until(lambda: _logged_step(first) >= 2, 120, "step 2")
        os.kill(late.proc.pid, signal.SIGSTOP)
        try:
            swarm.wait_until(lambda: _logged_step(first) >= STEPS, 180, "the run's end")
        finally:
            os.kill(late.proc.pid, signal.SIGCONT)
        code = late.wait(120)
        swarm.wait_exit(60, [first])
    log = late.log()
    assert code == 1, late.log_tail()
    assert f"the run finished at outer step {STEPS} without this peer" in log, late.log_tail()
    s = late.summary()
    assert not s["finished"] and s["outer_step"] <= STEPS - 2, (s["finished"], s["outer_step"])
    assert first.summary()["finished"]


def test_stranded_only_once_nobody_has_held_the_end_for_a_few_gossip_intervals() -> None:
    """Right after a stall of its own (SIGSTOP, a suspended laptop) a peer sees every other as silent until gossip
    hears them again: a peer resumed 15 ms before declared itself stranded while the holders of the end lingered
    (CI, tests/test_streaming.py's left-behind test). Worker.overtaken waits a few gossip intervals first."""
    from types import SimpleNamespace
    from typing import Any

    from peerd.worker import Worker

    holders = [-1]  # the newest step a live peer holds
    w: Any = SimpleNamespace(
        ranked=True, outer_step=5, _overtaken_check=0.0, _stranded_at=None, heal=lambda: False,
        cfg=SimpleNamespace(network=SimpleNamespace(gossip_interval=1.0)),
        swarm=SimpleNamespace(swarm_step=lambda: holders[0], finished_step=lambda: 12),
    )  # fmt: skip

    def look(later_s: float = 0.0) -> str:
        w._overtaken_check = 0.0  # due now
        if w._stranded_at is not None:
            w._stranded_at -= later_s  # as if `later_s` passed since it first found nobody holding the end
        return Worker.overtaken(w, 12)

    assert look() == "waiting"  # nobody live holds it, just now: gossip may not have caught up after a stall
    holders[0] = 12  # the lingering holders are heard again
    assert look(1.0) == "waiting" and w._stranded_at is None  # held; the download failed: try again
    holders[0] = -1
    assert look() == "waiting" and look(3.5) == "waiting"
    assert look(0.5) == "stranded"  # 4 gossip intervals with nobody live holding the end
    w.outer_step = 11
    assert look() == ""  # one step short is the boundary's own business
