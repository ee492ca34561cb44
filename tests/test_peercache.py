"""Remembered peers (peerd/peercache.py): what a restarted peer may dial when its bootstrap peer has left.

The file round-trips, and a damaged, oversized, hand-edited or other run's file adds nothing to dial. The swarm test
restarts a peer whose bootstrap peer is gone for good: it rejoins through a remembered one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peerd import peercache
from peerd.v1 import peerd_pb2 as pb
from tests.swarm import Swarm, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

RUN = bytes(range(32))
A, B = "a" * 32, "b" * 32


def test_round_trip_pins_each_address_to_its_peer(tmp_path: Path) -> None:
    peers = [pb.PeerInfo(peer_id=A, address="10.0.0.1:7000"), pb.PeerInfo(peer_id=B, address="[::1]:7001")]
    assert peercache.save(tmp_path, RUN, peers) == ["10.0.0.1:7000", "[::1]:7001"]
    assert peercache.load(tmp_path, RUN, pinned=True) == [f"{A}@10.0.0.1:7000", f"{B}@[::1]:7001"]
    assert peercache.load(tmp_path, RUN, pinned=False) == ["10.0.0.1:7000", "[::1]:7001"]
    assert peercache.load(tmp_path, bytes(32), pinned=True) == []  # another run's peers are not ours to dial


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"run_id": RUN.hex(), "peers": "x"}),
        json.dumps({"run_id": RUN.hex(), "peers": [{"peer_id": "zz", "address": "h:1"}, 7, {"address": "0.0.0.0:1"}]}),
        json.dumps({"run_id": RUN.hex(), "peers": [{"peer_id": A, "address": "host:99999999"}]}),
    ],
    ids=["garbage", "list", "peers-not-list", "bad-entries", "bad-port"],
)
def test_a_bad_file_adds_nothing(tmp_path: Path, text: str) -> None:
    (tmp_path / peercache.FILE).write_text(text)
    assert peercache.load(tmp_path, RUN, pinned=True) == []


def test_an_oversized_file_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / peercache.FILE).write_text(" " * (peercache.MAX_BYTES + 1))
    assert peercache.load(tmp_path, RUN, pinned=True) == []
    assert "ignoring it" in caplog.text


def test_unspecified_addresses_are_not_remembered(tmp_path: Path) -> None:
    peercache.save(tmp_path, RUN, [pb.PeerInfo(peer_id=A, address="0.0.0.0:7000")])
    assert peercache.load(tmp_path, RUN, pinned=True) == []


@pytest.mark.slow
def test_a_peer_whose_bootstrap_left_rejoins_through_a_remembered_peer(tmp_path: Path) -> None:
    # Paced (0.2 s per outer step): alone, peer 1 would otherwise finish its last 36 steps in the 1.5 s peer 2 takes
    # to restart, and peer 2 would only download the final state instead of training with it.
    slow = {"PEERD_FAULT_STEP_DELAY_S": "0.04"}
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=40), env=slow)
    with swarm:
        p0, p1, p2 = swarm.peers
        cache = p2.data_dir / peercache.FILE
        swarm.wait_until(lambda: p1.address in cache.read_text() and p0.address in cache.read_text(), 60, "a cache")
        swarm.wait_until(lambda: p2.status().outer_step >= 3, 120, "step 3")
        p0.kill()  # the bootstrap peer leaves for good
        p2.kill()
        again = swarm.spawn(2, p0.address, env=slow)  # restarted with the dead bootstrap address, as its unit says
        swarm.peers[2] = again
        swarm.wait_exit(240, [p1, again])
    log = again.log()
    assert f"joined through {p1.address}" in log, again.log_tail()
    s = again.summary()
    assert s["outer_step"] == 40 and s["finished"]
    p1_id = p1.summary()["peer_id"]
    assert any(p1_id in r["included"] and len(r["included"]) == 2 for r in s["rounds"])  # it trained with p1
    assert_identical_globals([p1.data_dir, again.data_dir])


@pytest.mark.slow
def test_the_first_peer_restarted_without_bootstrap_rejoins_the_swarm(tmp_path: Path) -> None:
    """The run's first peer has no --bootstrap: restarted, it tries the peers it remembers before starting alone."""
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=40))
    with swarm:
        p0, p1, p2 = swarm.peers
        cache = p0.data_dir / peercache.FILE
        swarm.wait_until(lambda: p1.address in cache.read_text() and p2.address in cache.read_text(), 60, "a cache")
        swarm.wait_until(lambda: p0.status().outer_step >= 3, 120, "step 3")
        p0.kill()
        again = swarm.spawn(0, None)
        swarm.peers[0] = again
        swarm.wait_exit(240)
    assert "joined through" in again.log() and "starting as its first peer" not in again.log(), again.log_tail()
    assert again.summary()["solo_steps"] == 0
    assert_identical_globals([p.data_dir for p in swarm.peers])
