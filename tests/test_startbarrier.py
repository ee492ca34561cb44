"""The start barrier (peerd/startbarrier.py): a swarm started with --wait-peers N takes its first inner step together,
and a run under way holds nobody."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from peerd.startbarrier import StartBarrier
from tests.swarm import Swarm, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

WAITED = re.compile(r"start barrier: (\d+) peers start together \(waited ([0-9.]+)s\)")


def test_barrier_releases_when_n_arrived_and_not_before() -> None:
    async def scenario() -> None:
        b = StartBarrier()
        first = asyncio.ensure_future(b.arrive("a", 3, timeout=10))
        second = asyncio.ensure_future(b.arrive("b", 3, timeout=10))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        assert await b.arrive("c", 3, timeout=10) == ["a", "b", "c"]
        assert await first == ["a", "b", "c"] and await second == ["a", "b", "c"]

    asyncio.run(scenario())


def test_barrier_times_out_with_who_came_and_releases_when_training() -> None:
    async def scenario() -> None:
        b = StartBarrier()
        assert await b.arrive("a", 2, timeout=0.1) == ["a"]  # nobody else came: the caller starts anyway
        held = asyncio.ensure_future(b.arrive("b", 5, timeout=10))
        await asyncio.sleep(0.05)
        assert not held.done()
        await b.mark_training()  # the host started: the run is under way, nobody waits any more
        assert await asyncio.wait_for(held, 1) == ["a", "b"]
        assert await b.arrive("z", 5, timeout=10) == []

    asyncio.run(scenario())


@pytest.mark.slow
def test_peers_wait_for_a_late_starter_then_train_together(tmp_path: Path) -> None:
    """Peer 2 builds its model 3 s late (PEERD_FAULT_START_DELAY_S): the others wait for it at the barrier instead
    of training ahead and absorbing the skew in their first rounds; all end on one model."""
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=2))
    try:  # started by hand (not `with swarm`), so that peer 2 gets the injector
        swarm.peers.append(swarm.spawn(0, None, wait_peers=3))
        boot = swarm.boot_address(0)
        swarm.peers.append(swarm.spawn(1, boot, wait_peers=3))
        swarm.peers.append(swarm.spawn(2, boot, wait_peers=3, env={"PEERD_FAULT_START_DELAY_S": "3"}))
        swarm.wait_exit(180)
    finally:
        swarm.stop()
    waited = []
    for p in swarm.peers:
        found = WAITED.search(p.log())
        assert found is not None and found.group(1) == "3", p.log_tail()
        waited.append(float(found.group(2)))
    # The late peer arrives last and is let through at once; the others were held for most of its 3 s delay.
    assert waited[2] < 1.0, waited
    assert min(waited[:2]) > 1.5, waited
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        assert p.summary()["rounds_partial"] == 0


@pytest.mark.slow
def test_a_late_joiner_with_wait_peers_is_not_held_by_a_run_under_way(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=120))
    with swarm:
        swarm.wait_until(lambda: swarm.peers[0].status().outer_step >= 2, 120, "step 2")
        late = swarm.add_peer(bootstrap_index=1, wait_peers=3)
        swarm.wait_exit(300)
    assert "start barrier: the run is under way" in late.log(), late.log_tail()
    assert late.summary()["outer_step"] == 120
    assert_identical_globals([p.data_dir for p in swarm.peers])
