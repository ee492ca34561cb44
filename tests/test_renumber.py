"""A peer whose address changes mid-run: a new DHCP lease, an ISP's forced reconnect, a laptop that moves.

Volunteers on home lines get a new address every day or so. A peer that learned its address from the others (no
--announce) must notice that the address it sent from is gone, reconnect at once, learn the new one and be dialled
there, without a restart; the run stays one model. Before peerd/netchange.py the peer's connections hung for 20 s,
it trained alone (35 solo steps of 40, 9 rounds with all four), came back announcing its old address, and was then
blocked by every other peer as undialable. Needs root for the namespaces (CI runs as root); skips otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_partition import PACE, _check_honest, _config, _wait_step, needs_netns
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = [pytest.mark.root, pytest.mark.slow]

STEPS = 40
NEW_ADDRESS = "10.77.0.200"
# Rounds that may lack the peer that moved: the one that formed as its address went away (the members dial the old
# one), and a few while gossip carries the new address. Measured: 37-40 of 40 with everyone, no solo step.
EARLY = 4
NOLOCO_SOLO = 3  # measured: 1 (a proposal to the old address waits out its 3 s deadline)


@needs_netns
@pytest.mark.parametrize("algorithm", ["diloco", "streaming", "noloco"])
def test_a_peer_whose_address_changes_is_dialled_at_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    from bench.netfaults import FaultNet
    from tests.netswarm import NetSwarm

    monkeypatch.setenv(*PACE)
    cfg = _config(tmp_path, algorithm, steps=STEPS, linger=8.0)
    with FaultNet(4, 1000.0) as net, NetSwarm(tmp_path, 4, cfg, net=net, announce=False) as swarm:
        _wait_step(swarm, 5, 120)
        net.renumber(3, NEW_ADDRESS)
        swarm.wait_exit(240)
    summaries = [p.summary() for p in swarm.peers]
    assert all(s["finished"] and s["outer_step"] == STEPS for s in summaries), summaries
    moved = swarm.peers[3]
    assert f"our address is now {NEW_ADDRESS}:" in moved.log()
    assert (moved.data_dir / "address").read_text().strip().startswith(f"{NEW_ADDRESS}:")
    solo = [s["solo_steps"] for s in summaries]
    if algorithm == "noloco":  # pairs, no global model: the mover may miss a partner while the others learn where it is
        assert max(solo) <= NOLOCO_SOLO, solo
        return
    _check_honest(summaries)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    ids = {s["peer_id"] for s in summaries}
    for s in summaries:
        full = [r for r in s["rounds"] if set(r["included"]) == ids]
        assert s["solo_steps"] == 0 and len(full) >= STEPS - EARLY, (s["peer_id"][:8], s["solo_steps"], len(full))
