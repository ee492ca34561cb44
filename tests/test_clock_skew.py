"""A volunteer whose clock is wrong: no NTP, or a dual-boot machine whose hardware clock keeps local time.

Requests carry timestamps that peers refuse beyond 300 s off (peerd/envelope.py). Before peerd/swarmclock.py such a
peer could not join at all: `peerd start` ended with "127.0.0.1:PORT refused us: Join: timestamp is more than 300s
off" and the swarm waited for it.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from peerd.swarmclock import TIME_KEY, SwarmClock
from tests.swarm import Swarm, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

STEPS = 6


@pytest.mark.parametrize("offset_s", [900, -3600])  # a quarter of an hour ahead; an hour behind (dual boot)
def test_a_peer_whose_clock_is_off_joins_and_trains_with_the_swarm(tmp_path: Path, offset_s: int) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=STEPS, network__peer_timeout=2.0, network__linger=5.0)
    with Swarm(tmp_path, 2, cfg, wait_peers=3) as swarm:
        skewed = swarm.add_peer(env={"PEERD_FAULT_CLOCK_OFFSET_S": str(offset_s)}, wait_peers=3)
        swarm.wait_exit(90)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == STEPS and s["solo_steps"] == 0
        assert all(len(set(r["included"])) == 3 for r in s["rounds"]), [r["included"] for r in s["rounds"]]
    where = "ahead of" if offset_s > 0 else "behind"
    line = f"this machine's clock is {abs(offset_s)} s {where} the swarm's"
    assert line in skewed.log() and "timedatectl set-ntp true" in skewed.log()
    assert all("this machine's clock" not in p.log() for p in swarm.peers[:2])


def _stale(their_ms: int | str | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata() if their_ms is None else grpc.aio.Metadata((TIME_KEY, str(their_ms)))
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), trailing, "stale")


def test_the_swarms_time_is_taken_from_the_only_peer_or_from_two_that_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from peerd import faults

    monkeypatch.setattr(faults, "wall", lambda: 1_000_000.0)
    clock = SwarmClock()
    ahead_ms = 1_000_900_000  # the peer's clock reads 900 s later than ours
    assert not clock.heard(_stale(None), "a:1", lambda: 0)  # no time said: nothing to learn
    assert not clock.heard(_stale("junk"), "a:1", lambda: 0)
    assert not clock.heard(_stale(1_000_030_000), "a:1", lambda: 0)  # 30 s: no evidence our clock is wrong
    assert not clock.heard(_stale(ahead_ms), "a:1", lambda: 1) and clock.offset == 0  # the other of a pair: not enough
    assert clock.heard(_stale(ahead_ms + 2_000), "b:1", lambda: 5) and clock.offset == pytest.approx(901.0)
    assert clock.now() == pytest.approx(1_000_901.0)
    joiner = SwarmClock()  # joining through the one peer it knows
    assert joiner.heard(_stale(ahead_ms), "boot:1", lambda: 0) and joiner.offset == pytest.approx(900.0)
    other = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
    assert not joiner.heard(other, "boot:1", lambda: 0)
