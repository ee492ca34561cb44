"""DiLoCo swarms of real `peerd start` processes on 127.0.0.1: join, train, agree, survive kills, catch up, resume."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch

from peerd.demo import global_params
from tests.swarm import Swarm, ids_in_order, tiny_config

pytestmark = pytest.mark.slow


def _why_apart(dirs: list[Path]) -> str:
    """What each peer's summary and log say about its last rounds: a failure here is a fork, and these show where."""
    out = []
    for d in dirs:
        try:
            s = json.loads((d / "summary.json").read_text())
            rounds = [(r.get("step"), len(r.get("included", [])), r.get("partial")) for r in s.get("rounds", [])[-4:]]
            out.append(f"{d.name}: step {s.get('outer_step')} work {s.get('work')} rounds {rounds}")
        except (OSError, ValueError) as exc:
            out.append(f"{d.name}: no summary ({exc})")
        log = (d / "log").read_text(errors="replace").splitlines() if (d / "log").exists() else []
        out += [f"  {line}" for line in log if "WARNING" in line][-8:]
    return "\n".join(out)


def assert_identical_globals(dirs: list[Path]) -> None:
    params = [global_params(d) for d in dirs]
    assert all(p is not None for p in params)
    for a, b in itertools.combinations(params, 2):
        diff = float((a["params"] - b["params"]).abs().max())
        assert torch.equal(a["params"], b["params"]), f"globals differ by {diff}\n{_why_apart(dirs)}"
        assert torch.equal(a["outer_momentum"], b["outer_momentum"]), _why_apart(dirs)


def test_three_peers_join_train_and_agree(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=4))
    with swarm:
        ids = set()
        swarm.wait_until(lambda: all(len(p.status().alive) == 3 for p in swarm.peers), 60, "all peers to know all")
        for p in swarm.peers:
            ids.add(p.status().peer_id)
        assert len(ids) == 3
        swarm.wait_exit(180)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == 4 and s["finished"]
        assert s["rounds_partial"] == 0
        assert s["flags"] == {"slow": [], "faulty": []} and s["flagged_at_step"] == {}  # no false flags
        hist = s["history"]
        assert hist[-1]["loss"] < hist[0]["loss"], hist
        assert hist[-1]["eval_loss"] < hist[0]["eval_loss"], hist


@pytest.mark.parametrize("window_s", [0.0, 1.5], ids=["fixed-H", "windowed"])
def test_overlapped_rounds_train_on_and_still_agree(tmp_path: Path, window_s: float) -> None:
    """outer.overlap: every round runs while the next window trains. The peers still end bit-identical, every round
    includes all three, and steps were trained while rounds ran (none lost: the last round is synchronous, and the
    tokens of every round are the window's). Windowed, the windows keep the swarm's clock with no round ending them
    together (peerd/diloco.py), and still meet in every round."""
    cfg = tiny_config(tmp_path, run__outer_steps=5, outer__overlap=True, inner__window_s=window_s)
    swarm = Swarm(tmp_path, 3, cfg)
    with swarm:
        swarm.wait_exit(180)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == 5 and s["finished"] and s["rounds_partial"] == 0, _why_apart([p.data_dir])
        assert all(len(r["included"]) == 3 for r in s["rounds"]), s["rounds"]
        assert s["overlapped_steps"] > 0 and s["discarded_steps"] == 0, s
        hist = s["history"]
        assert hist[-1]["eval_loss"] < hist[0]["eval_loss"], hist


@pytest.mark.parametrize("victim", [0, 2], ids=["bootstrap", "other"])
def test_kill9_peer_and_the_rest_keep_training(tmp_path: Path, victim: int) -> None:
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=8))
    with swarm:
        swarm.wait_until(lambda: swarm.peers[victim].status().outer_step >= 2, 120, "step 2")
        st = swarm.peers[victim].status()
        victim_id = st.peer_id
        swarm.peers[victim].kill()
        # The victim may finish one more round before the kill lands. Not the survivors' step read after the kill:
        # a round now survives a member's death, so the survivors may be done before they answer
        killed_at = st.outer_step + 1
        survivors = [p for i, p in enumerate(swarm.peers) if i != victim]
        swarm.wait_exit(180, survivors)
    assert_identical_globals([p.data_dir for p in survivors])
    survivor_ids = {p.summary()["peer_id"] for p in survivors}
    for p in survivors:
        s = p.summary()
        assert s["outer_step"] == 8
        later = [r for r in s["rounds"] if r["step"] > killed_at]
        assert later, s["rounds"]
        for r in later:  # every later round averaged exactly the survivors, and says whom it expected
            assert set(r["included"]) == survivor_ids, r
            assert victim_id not in r["included"]
            assert r["partial"] == (len(r["included"]) < len(r["expected"]))


@pytest.mark.parametrize("joiner_id", ["highest", "lowest"])
def test_late_joiner_catches_up_and_takes_part(tmp_path: Path, joiner_id: str) -> None:
    """With the lowest id the joiner is the next round leader, but only once it holds the swarm's state: leading
    while it still downloaded, it once made the two running peers split (one trained alone for 40 steps)."""
    ids_in_order(tmp_path, 3, descending=joiner_id == "lowest")
    # Paced steps (~0.4 s each): unpaced, the two peers ran all 60 steps in ~9 s, so on a loaded CI machine the joiner
    # (still importing torch) arrived after the last round and downloaded the final state without taking part.
    paced = {"PEERD_FAULT_STEP_DELAY_S": "0.08"}
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=60), env=paced)
    with swarm:
        swarm.wait_until(lambda: swarm.peers[0].status().outer_step >= 3, 120, "step 3")
        late = swarm.add_peer(bootstrap_index=1)
        swarm.wait_exit(300)
    for p in swarm.peers:
        assert p.summary()["solo_steps"] == 0, p.log()[-3000:]
    assert "downloaded state at step" in late.log()
    s = late.summary()
    assert s["outer_step"] == 60
    assert s["history"][0]["outer_step"] > 3  # it started from the swarm's state, not from step 0
    late_id = s["peer_id"]
    joined = [r for r in swarm.peers[0].summary()["rounds"] if late_id in r["included"]]
    assert joined, "the late joiner never took part in a round"
    assert_identical_globals([p.data_dir for p in swarm.peers])


def test_restart_resumes_from_checkpoint(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, 1, tiny_config(tmp_path, run__outer_steps=2))
    with swarm:
        swarm.wait_exit(120)
    assert swarm.peers[0].summary()["outer_step"] == 2
    again = Swarm(tmp_path, 1, tiny_config(tmp_path, "run2.toml", run__outer_steps=4))
    with again:
        again.wait_exit(120)
    peer = again.peers[0]
    assert "resumed from checkpoint at outer step 2" in peer.log()
    hist = peer.summary()["history"]
    assert [h["outer_step"] for h in hist] == [1, 2, 3, 4]


def test_restart_after_the_run_ended_reports_the_finished_checkpoint(tmp_path: Path) -> None:
    """Everyone finished and left; a peer restarted on its data dir finds nobody to join and nothing to train."""
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=3))
    with swarm:
        swarm.wait_exit(120)
        before = swarm.peers[1].summary()
        again = swarm.spawn(1, swarm.peers[0].address, extra=["--join-timeout", "1.5"])
        assert again.wait(60) == 0, again.log_tail()
    assert "already holds the run's last outer step (3)" in again.log()
    after = again.summary()
    assert after["outer_step"] == 3 and after["finished"]
    assert after["history"] == before["history"]  # nothing trained again
    # The first peer (no --bootstrap) tries the peers it remembers (peerd/peercache.py) for a few seconds, then
    # starts as the first peer: here on a finished checkpoint, so it has nothing to train either.
    first = swarm.spawn(0, None)
    assert first.wait(60) == 0, first.log_tail()
    assert "no remembered peer of this run let us in" in first.log()
    assert first.summary()["outer_step"] == 3
    assert_identical_globals([p.data_dir for p in swarm.peers])


def test_restart_of_an_unfinished_peer_with_nobody_to_join_fails_clearly(tmp_path: Path) -> None:
    """The same restart with the run unfinished in its checkpoint: training alone would fork the run, so it stops."""
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=3))
    with swarm:
        swarm.wait_exit(120)
    longer = tiny_config(tmp_path, "run2.toml", run__outer_steps=5)
    again = swarm.spawn(1, swarm.peers[0].address, config=longer, extra=["--join-timeout", "1.5"])
    assert again.wait(60) == 1
    assert "no bootstrap peer answered" in again.log()


def test_a_state_download_that_stalls_moves_on_to_the_next_holder(tmp_path: Path) -> None:
    """A holder whose link goes silent mid-download sends no reset: the joiner waited on it for the whole download's
    deadline (network.round_timeout, 60 s here) though the other holder of the same state was up. Each holder stalls
    the first download it serves (PEERD_FAULT_STATE_STALL_N=1), so whichever the joiner asks first stalls, then the
    other; after each stall limit (statefetch.stall_limit: 10 s here) it moves on, and the third ask is served."""
    from peerd.statefetch import stall_limit

    stall = {"PEERD_FAULT_STATE_STALL_S": "300", "PEERD_FAULT_STATE_STALL_N": "1", "PEERD_FAULT_STEP_DELAY_S": "0.08"}
    cfg = tiny_config(tmp_path, run__outer_steps=0, network__round_timeout=60.0, network__peer_timeout=3.0)
    limit = stall_limit(3.0)
    swarm = Swarm(tmp_path, 2, cfg, env=stall)
    with swarm:
        swarm.wait_until(lambda: swarm.peers[0].status().outer_step >= 3, 120, "step 3")
        late = swarm.add_peer(env={"PEERD_FAULT_STEP_DELAY_S": "0.08"})
        swarm.wait_until(lambda: "downloading state" in late.log(), 60, "the joiner's download")
        asked = time.monotonic()
        swarm.wait_until(lambda: "downloaded state at step" in late.log(), 2 * limit + 25, "the download, served")
        took = time.monotonic() - asked
    assert late.log().count("stalled for 10s: trying the next holder") == 2, late.log()[-3000:]
    assert sum("stalling a state download" in p.log() for p in swarm.peers[:2]) == 2
    assert took < 2 * limit + 25, took  # not the 60 s deadline of the first ask
