"""The test harness itself (tests/swarm.py): a swarm that fails to start must not leave daemons running. Orphans
share the machine's two cores with every later test and benchmark (a 64-peer bench.scale whose peer 1 did not listen
within the wait left 63 daemons training on until killed by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.swarm import Peer, Swarm, tiny_config


class _SecondPeerDies(Swarm):
    def spawn(self, index: int, bootstrap: str | None, **kw: object) -> Peer:
        if index == 0:
            return super().spawn(index, bootstrap, **kw)  # type: ignore[arg-type]
        data = self.tmp_path / f"peer{index}"
        data.mkdir(parents=True, exist_ok=True)
        return Peer(index, data, subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))


def test_a_swarm_whose_peer_never_comes_up_stops_the_peers_it_started(tmp_path: Path) -> None:
    swarm = _SecondPeerDies(tmp_path, 2, tiny_config(tmp_path))
    with pytest.raises(RuntimeError, match="peer 1 exited"), swarm:
        pass
    first = swarm.peers[0].proc
    assert first.poll() is not None, "peer 0 still runs after the swarm failed to start"
