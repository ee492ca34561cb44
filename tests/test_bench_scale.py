"""bench.scale's round record and failure-detection reading of the peers' logs (the bench's own arithmetic, on
written logs)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
import torch

from bench.scale import (
    FAILED,
    _count,
    _how,
    _probe_end,
    detection,
    false_losses,
    last_step,
    record_peer,
    step_lines,
    steps_bytes,
)
from bench.scale_spread import spread
from trainer.checkpoint import save_checkpoint


def _at(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def _serving(t: float, pid: str) -> str:
    return f"{_at(t)} INFO peerd: peer {pid} serving run 39d3ecc4 on 127.0.0.1:1\n"


def test_detection_counts_only_observers_whose_process_ran() -> None:
    """Observer 1 logs the victim lost 5 s after its kill; observer 2 was itself killed just before and serves
    again only after the window (it had nothing to detect with, so it is neither a detection nor silent); observer
    3 runs throughout and never says anything (silent past twice the timeout); observer 4 dies mid-window without
    a word (not counted either)."""
    t = 1_800_000_000.0
    victim, o1, o2, o3, o4 = "aaaaaaaa", "11111111", "22222222", "33333333", "44444444"
    kills = [(t + 100, o2), (t + 101, victim), (t + 120, o4)]
    logs = {
        0: _serving(t, victim) + _serving(t + 160, victim),
        1: _serving(t, o1) + f"{_at(t + 106)} WARNING peerd: peer {victim} lost: silent for 15.0s (x)\n",
        2: _serving(t, o2) + _serving(t + 170, o2) + f"{_at(t + 171)} WARNING peerd: peer {victim} lost: x\n",
        3: _serving(t, o3),
        4: _serving(t, o4),
    }
    got = detection(logs, kills, t + 300)
    assert got["detections"] == 1 and got["detect_s_median"] == 5.0
    # The victim's kill: observer 3 silent; observers 2 and 4 not counted. The kills of o2 and o4 are observed too,
    # and nobody logs them: o2's by o1 and o3 (silent), not by the victim and o4 (dead before the window ended);
    # o4's by o1 and o3 (silent), not by the victim and o2 (both dead then).
    assert got["detect_missed"] == 1 + 2 + 2
    assert got["observers_down"] == 2 + 2 + 2
    assert got["detect_late"] == 0
    assert got["detected_by"] == {"silent": 1}


def test_each_detection_is_put_down_to_what_found_it() -> None:
    """The "lost" line's cause: a refused probe, a failed gossip call or round dial, silence, or a new process."""
    line = "2026-11-27 22:09:33,994 WARNING peerd: peer 0aa207c5 lost: "
    assert _how(line + "unreachable (probe UNAVAILABLE) (network.peer_timeout 15.0s)") == "probe"
    assert _how(line + "unreachable (round dial failed) (network.peer_timeout 15.0s)") == "round"
    assert _how(line + "silent for 16.1s (network.peer_timeout 15.0s)") == "silent"
    assert _how(line + "silent for 15.1s, not probed (network.peer_timeout 15.0s)") == "silent"
    assert _probe_end(line + "silent for 15.1s, not probed (network.peer_timeout 15.0s)") == "not probed"
    assert _probe_end(line + "silent for 15.1s, probed 1x, last answered (network.peer_timeout 15.0s)") == "answered"
    assert _how("2026-11-27 22:09:33,994 WARNING peerd: peer 0aa207c5 restarted: a new process") == "restarted"


def test_false_losses_count_live_peers_counted_out_and_when_they_were_heard_from_again() -> None:
    """A "lost" line in the window for a peer not killed in the 60 s before counts, put down to what said so, with the
    seconds until the same observer heard from the peer again; a killed peer's loss and lines outside the window
    do not count."""
    t = 1_800_000_000.0
    live, dead, other = "aaaaaaaa", "bbbbbbbb", "cccccccc"
    kills = [(t + 50, dead)]
    logs = {
        1: f"{_at(t + 10)} WARNING peerd: peer {live} lost: silent for 15.2s, probed 2x, last DEADLINE_EXCEEDED "
        "(network.peer_timeout 15.0s)\n"
        f"{_at(t + 13)} INFO peerd: peer {live} is live again\n"
        f"{_at(t + 55)} WARNING peerd: peer {dead} lost: unreachable (probe UNAVAILABLE) (x)\n"
        f"{_at(t + 500)} WARNING peerd: peer {live} lost: silent for 16.0s (x)\n",  # after the window
        2: f"{_at(t + 20)} WARNING peerd: peer {other} lost: unreachable (gossip UNAVAILABLE) (x)\n",  # never back
    }
    got = false_losses(logs, kills, t, t + 300)
    assert got["false_losses"] == 2
    assert got["false_by"] == {"silent": 1, "gossip": 1}
    assert got["false_silent_probes"] == {"DEADLINE_EXCEEDED": 1}
    assert got["false_back_s_median"] == 3.0 and got["false_back_s_p90"] == 3.0


def _step(t: float, step: int, peers: str = "peers 5/6 | sent 1 MB") -> str:
    return f"{_at(t)} INFO peerd: outer step {step} | loss 0.1 | eval 0.1 | 9 tok/s | {peers} | round 1.0s\n"


def test_the_round_record_skips_a_bootstrap_peer_the_swarm_sponsored() -> None:
    """Run AP: the swarm flagged the bootstrap peer slow and it sent its work through a sponsor for the window's last
    5 minutes, so its log stopped counting rounds at step 2 while the swarm went on. The record moves to the
    lowest-numbered peer never killed and never sponsored (peer 1 was killed), which saw all four rounds and the
    failed attempt at step 3; a peer sponsored only before the window counts again."""
    t = 1_800_000_000.0
    sponsored = f"{_at(t + 30)} WARNING peerd: this peer's link is too slow for the swarm's rounds: sending our work\n"
    failed = f"{_at(t + 25)} WARNING peerd: round for step 3 (attempt 1) failed: x\n"
    logs = {
        0: _step(t + 10, 1) + _step(t + 20, 2) + sponsored + _step(t + 40, 4, "peers via sponsor 22222222 | sent"),
        1: _step(t + 10, 1) + _step(t + 20, 2) + _step(t + 30, 3) + _step(t + 40, 4),
        2: _step(t + 10, 1) + _step(t + 20, 2) + failed + _step(t + 30, 3) + _step(t + 40, 4),
        3: _step(t + 20, 2),
    }
    assert len(step_lines(logs[0], t, t + 50)) == 2  # "peers via sponsor" is not a round it was a member of
    assert record_peer(logs, {1}, t, t + 50) == 2
    assert [s[1] for s in step_lines(logs[2], t, t + 50)] == [1, 2, 3, 4]
    assert _count(FAILED, logs[2], t, t + 50) == 1
    assert record_peer(logs, set(), t, t + 50) == 1
    assert record_peer(logs, {1}, t + 35, t + 50) == 2  # still sponsored: its steps say so
    assert record_peer(logs, {1, 2, 3}, t + 45, t + 50) == 0  # sponsored before the window only
    assert record_peer(logs, {1, 2, 3}, t, t + 50) is None


def test_until_step_reads_the_highest_step_a_peer_completed_as_a_member() -> None:
    """--until-step closes the window on the bootstrap peer's highest logged step; a step it sent through a sponsor
    ("peers via sponsor") is not one it completed as a member, and a log with no step yet reads -1."""
    t = 1_800_000_000.0
    assert last_step(_serving(t, "aaaaaaaa")) == -1
    assert last_step(_step(t + 1, 3) + _step(t + 2, 12) + _step(t + 3, 4)) == 12
    assert last_step(_step(t + 1, 3) + _step(t + 2, 5, "peers via sponsor 22222222 | sent")) == 3


def test_steps_bytes_counts_the_same_rounds_at_every_size() -> None:
    """--from-step: a row's bytes cover exactly the rounds that reached steps lo..hi (a summary carries the step it
    averaged, one less), whole-model rounds only, and only peers that completed all of them; the median over peers."""
    full = [(1, -1, 900, 4000, 1, 3, 0), (2, -1, 100, 4000, 4, 0, 0), (3, -1, 200, 4000, 4, 0, 0)]
    full += [(4, -1, 300, 4000, 4, 0, 0), (5, -1, 9, 9, 1, 3, 0)]  # the rounds to steps 2 and 6: not counted
    other = [(2, -1, 300, 4000, 4, 0, 0), (3, -1, 400, 4000, 3, 1, 0), (4, -1, 500, 4000, 4, 0, 0)]
    other.append((3, 0, 7, 7, 1, 3, 0))  # a fragment round
    gap = [(2, -1, 1, 4000, 2, 0, 0), (4, -1, 1, 4000, 2, 0, 0)]  # sat out (or was restarted at) step 3: left out
    row = steps_bytes([full, other, gap, []], 3, 5)
    assert row["steps_counted"] == [3, 5] and row["steps_peers"] == 2
    assert row["steps_round_B_per_peer"] == 300  # the median of 200 (100, 200, 300) and 400 (300, 400, 500)
    assert row["steps_round_raw_B_per_peer"] == 4000
    assert row["steps_owners_min"] == 3  # a member flagged in one of those rounds owned no shard there
    assert steps_bytes([gap], 3, 5)["steps_round_B_per_peer"] is None
    # that member was flagged; the 3 flagged members of rounds outside steps 3..5 (or of a fragment round) do not count
    assert row["steps_no_shard_flagged_max"] == 1 and row["steps_no_shard_outbound_max"] == 0


def test_steps_bytes_says_why_members_owned_no_shard() -> None:
    """A member judged outbound-only (a dial-back that timed out on the starved machine) owned no shard in the
    runs of stops 59 and 60, and a row could only say that one did: it now says which kind, flagged or not
    dialable."""
    peer_a = [(2, -1, 10, 40, 64, 0, 0), (3, -1, 10, 40, 63, 0, 1), (4, -1, 10, 40, 62, 1, 1)]
    peer_b = [(2, -1, 12, 40, 64, 0, 0), (3, -1, 12, 40, 64, 0, 0), (4, -1, 12, 40, 63, 0, 1)]
    row = steps_bytes([peer_a, peer_b], 3, 5)
    assert row["steps_peers"] == 2 and row["steps_owners_min"] == 62
    assert row["steps_no_shard_flagged_max"] == 1 and row["steps_no_shard_outbound_max"] == 1


def test_spread_is_each_peers_distance_from_the_mean_over_the_distance_travelled(tmp_path: Path) -> None:
    """Three peers' checkpoints around a mean 2 away from the initial weights, at 0, 0.5 and 0.5 from it (two
    components cancel); a fourth peer without a checkpoint and a fifth with another vector size are left out."""
    init = torch.zeros(4)
    vectors = [[2.0, 0.0, 0.0, 0.0], [2.0, 0.5, 0.0, 0.0], [2.0, -0.5, 0.0, 0.0], None, [1.0] * 5]
    dirs = []
    for i, v in enumerate(vectors):
        d = tmp_path / f"p{i}"
        d.mkdir()
        if v is not None:
            save_checkpoint(d / "checkpoint.pt", {"global": {"params": torch.tensor(v)}})
        dirs.append(d)
    got = spread(dirs, init)
    assert got["spread_peers"] == 3
    assert got["spread_max"] == pytest.approx(0.25)  # 0.5 over the mean's 2 travelled
    assert got["spread_median"] == pytest.approx(0.25)
    assert spread(dirs[:1], init)["spread_median"] is None  # one peer: nothing to compare
