"""Codecs in real swarms: 4-bit and sparse rounds leave identical global params, and a peer that sends corrupt frames is
refused and counted while the others keep training."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.config import sparse_recipe
from tests.swarm import Swarm, ids_in_order, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = pytest.mark.slow


def recipe(algorithm: str) -> dict[str, object]:
    return {f"{section}__{key}": v for section, keys in sparse_recipe(algorithm).items() for key, v in keys.items()}


@pytest.mark.parametrize(
    ("codec", "algorithm", "fewer", "extra"),
    [
        ("e3m0", "diloco", 5, {}),  # 4-bit frames: well under a fifth of the fp32 bytes, headers and scales included
        # sparse frames: far under a twentieth, headers, scales and indices included (the tiny model's shards are a
        # few blocks each, so fixed per-frame costs weigh more than on a real model)
        ("sparse", "diloco", 20, {}),
        # the sparse recipe (peerd demo --codec sparse): decaying feedback against the applied average, plain outer SGD
        ("sparse", "diloco", 20, recipe("diloco")),
        ("sparse", "streaming", 20, recipe("streaming")),
    ],
    ids=["e3m0-diloco", "sparse-diloco", "sparse-diloco-recipe", "sparse-streaming-recipe"],
)
def test_three_peers_with_a_lossy_codec_and_error_feedback_agree(
    tmp_path: Path, codec: str, algorithm: str, fewer: int, extra: dict[str, object]
) -> None:
    keys = {"run__outer_steps": 4, "run__algorithm": algorithm, "codec__name": codec, "codec__error_feedback": True}
    cfg = tiny_config(tmp_path, **{**keys, **extra})
    with Swarm(tmp_path, 3, cfg) as swarm:
        swarm.wait_exit(180)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        s = p.summary()
        assert s["rounds_partial"] == 0 and s["outer_step"] == 4
        assert s["history"][-1]["loss"] < s["history"][0]["loss"]
        assert s["bytes_sent_wire"] * fewer < s["bytes_sent_raw"], s


def test_corrupt_frames_are_refused_and_the_round_goes_on_without_the_sender(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=4)
    # The corrupt peer gets the highest id, so it never leads a round: a hostile leader that only some honest peers
    # blame yet can still split them between leaders for a step (SECURITY.md, limitations); that is not this test.
    ids_in_order(tmp_path, 4)
    # Every peer waits for all 4: under load the corrupt peer's start (torch's import) once took longer than the
    # honest peers' 4 outer steps, and it never took part (0 rejected messages)
    swarm = Swarm(tmp_path, 3, cfg, wait_peers=4)
    with swarm:
        bad = swarm.spawn(3, swarm.peers[0].address, wait_peers=4, env={"PEERD_FAULT_CORRUPT_PAYLOADS": "1"})
        swarm.peers.append(bad)
        honest = swarm.peers[:3]
        swarm.wait_exit(240, honest)
        rejected = sum(p.summary()["rejected_messages"] for p in honest)
    assert rejected >= 1
    assert_identical_globals([p.data_dir for p in honest])
    bad_id = bad.wait_file("address") and None
    for p in honest:
        rounds = p.summary()["rounds"]
        assert rounds and all(len(r["included"]) <= 3 for r in rounds[-2:])
        # after a failed round every honest member retries in one group without the corrupt peer: never alone
        # (they once each blamed a different peer for the break, led groups of one and forked the swarm)
        assert all(len(r["included"]) >= 2 for r in rounds), rounds
    del bad_id
