"""Uneven peers with real processes: a 3x slower peer in a windowed DiLoCo run (inner.window_s) takes fewer steps,
is never waited for, loses no work, and its contribution counts by its tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.netswarm import NetSwarm
from tests.swarm import Swarm, ids_in_order, tiny_config
from tests.test_slowlink import needs_netns
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = pytest.mark.slow

SLOW = {"PEERD_FAULT_STEP_DELAY_S": "0.08"}  # the tiny model's own step is ~20-40 ms here: 3x or more slower


def run_with_a_slow_last_peer(tmp_path: Path, n: int, cfg: Path, env: dict[str, str]) -> Swarm:
    """n peers started by hand, the last with the slow-compute injector `env`; returns the finished swarm."""
    swarm = Swarm(tmp_path, n, cfg)
    try:
        swarm.peers.append(swarm.spawn(0, None, wait_peers=n))
        boot = swarm.boot_address(0)
        for i in range(1, n):
            swarm.peers.append(swarm.spawn(i, boot, wait_peers=n, env=env if i == n - 1 else None))
        for p in swarm.peers:
            p.wait_file("address")
        swarm.wait_exit(180)
    finally:
        swarm.stop()
    return swarm


def test_windowed_rounds_weigh_a_slow_peer_by_its_tokens(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=4, inner__window_s=1.5, inner__steps=1000)
    swarm = run_with_a_slow_last_peer(tmp_path, 3, cfg, SLOW)
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
    # Past the first window: a process's first steps include torch's warm-up, which under two test workers on 2
    # cores once left a fast peer 1,664 tokens in window 0 against the other's 6,656 (CI run 78), and the slow
    # peer's 1,280 is then not under 0.7 of the fast minimum. Its later windows held 15,232 to 18,944.
    steady = [r for r in full if r["step"] > 0]
    assert len(steady) >= 2, summaries[0]["rounds"]
    for r in steady:
        tokens = dict(zip(r["included"], r["tokens"], strict=True))
        fast = [t for pid, t in tokens.items() if pid != slow_id]
        # the slow peer's work counts less, in proportion, and is never dropped
        assert 0 < tokens[slow_id] < 0.7 * min(fast), r


def test_a_slow_peer_is_flagged_from_its_timings_and_stops_leading_and_owning(tmp_path: Path) -> None:
    """C4-style detection with fixed H: the 3x+ slower peer joins every rendezvous late; the others flag it within
    3 outer steps, it is told why in one line, and from then on it neither leads nor owns a shard (it still
    contributes: every round includes it)."""
    # outer.slow_link = "wait": the flagged peer stays in rounds (test_sponsor.py has the default, sponsoring)
    cfg = tiny_config(tmp_path, run__outer_steps=6, inner__steps=10, outer__slow_link="wait")
    ids_in_order(tmp_path, 4)  # the slow peer0 has the lowest id: it leads until it is flagged
    swarm = Swarm(tmp_path, 4, cfg)
    try:
        swarm.peers.append(swarm.spawn(0, None, wait_peers=4, env={"PEERD_FAULT_STEP_DELAY_S": "0.15"}))
        boot = swarm.boot_address(0)
        swarm.peers += [swarm.spawn(i, boot, wait_peers=4) for i in (1, 2, 3)]
        for p in swarm.peers:
            p.wait_file("address")
        swarm.wait_exit(240)
    finally:
        swarm.stop()
    assert_identical_globals([p.data_dir for p in swarm.peers])
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[0]["peer_id"]
    for s in summaries[1:]:
        assert s["flags"]["slow"] == [slow_id], s["flags"]
        assert s["flagged_at_step"][slow_id] <= 3, s["flagged_at_step"]
        assert s["rounds"][0]["leader"] == slow_id  # before the verdict, the lowest id led
        late = [r for r in s["rounds"] if r["step"] > s["flagged_at_step"][slow_id]]
        assert late, s["rounds"]
        for r in late:
            assert slow_id in r["included"] and len(r["included"]) == 4, r  # it still contributes
            assert r["leader"] != slow_id and r["no_shards"] == [slow_id], r
    assert "this peer flagged slow by most of the swarm" in swarm.peers[0].log()


@needs_netns
def test_a_peer_on_a_10x_slower_link_is_flagged_and_owns_no_shard(tmp_path: Path) -> None:
    """Peers in network namespaces, one of them on a tbf-shaped link 10x slower both ways: its contributions reach
    the shard owners late round after round, the others flag it slow within 3 outer steps and it stops owning a
    shard (which took every other peer's bytes over its slow link), while it still contributes to every round."""
    # outer.slow_link = "wait": the flagged peer stays in rounds (test_sponsor.py has the default, sponsoring)
    cfg = tiny_config(tmp_path, run__outer_steps=6, inner__steps=10, outer__slow_link="wait")
    # The slow peer has the lowest id, so it leads until it is flagged: the handover to the next leader is part of
    # the test (with a random id it was, one run in eight; a fast peer then missed a step, sent to the old leader by
    # a peer still finishing the round that flagged it)
    ids_in_order(tmp_path, 4, descending=True)
    with NetSwarm(tmp_path, 4, cfg, rate_mbit=[20.0, 20.0, 20.0, 2.0]) as swarm:
        swarm.wait_exit(240)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[3]["peer_id"]
    for s in summaries[:3]:
        assert s["flags"]["slow"] == [slow_id], s["flags"]
        assert s["flagged_at_step"][slow_id] <= 3, s["flagged_at_step"]
        # From the step after the flag settles it contributes to every round and owns no shard. The one step in
        # between is allowed to differ: shard ownership is the leader's call on its own view of the verdicts (which
        # gossip brings it up to a step after ours), and the round right after the slow peer last owned a shard can
        # close before its late contribution arrives (then its work is carried into the next round; checked below).
        flagged = s["flagged_at_step"][slow_id]
        late = [r for r in s["rounds"] if r["step"] > flagged + 1]
        assert late, _rows(s, slow_id)
        assert all(slow_id in r["included"] and r["no_shards"] == [slow_id] for r in late), _rows(s, slow_id)
    assert summaries[3]["discarded_steps"] == 0, summaries[3]
    assert "this peer flagged slow by most of the swarm" in swarm.peers[3].log()


def start_with_a_slow_uplink(swarm: Swarm) -> None:
    """Start 4 peers of `swarm` on loopback together, the last one's upload paced to 2 Mbit/s
    (PEERD_FAULT_UPLINK_MBIT), and wait until each is serving."""
    swarm.peers.append(swarm.spawn(0, None, wait_peers=4))
    boot = swarm.boot_address(0)
    swarm.peers += [swarm.spawn(i, boot, wait_peers=4) for i in (1, 2)]
    swarm.peers.append(swarm.spawn(3, boot, wait_peers=4, env={"PEERD_FAULT_UPLINK_MBIT": "2"}))
    for p in swarm.peers:
        p.wait_file("address")


def run_with_a_slow_uplink(tmp_path: Path, cfg: Path, timeout: float) -> Swarm:
    """4 peers on loopback, the last one's upload paced to 2 Mbit/s (PEERD_FAULT_UPLINK_MBIT), run to the end."""
    swarm = Swarm(tmp_path, 4, cfg)
    try:
        start_with_a_slow_uplink(swarm)
        swarm.wait_exit(timeout)
    finally:
        swarm.stop()
    return swarm


def _rows(summary: dict, slow_id: str) -> str:
    """A summary's rounds in one line each, the slow peer as SLOW, for an assertion message that fits a CI log."""
    name = lambda pid: "SLOW" if pid == slow_id else pid[:6]  # noqa: E731
    return "\n".join(
        [
            f"step {r['step']} leader {name(r['leader'])} included {[name(p) for p in r['included']]} "
            f"expected {[name(p) for p in r['expected']]} no_shards {[name(p) for p in r['no_shards']]} "
            f"partial {r['partial']} note {r['note']!r}"
            for r in summary["rounds"]
        ]
        + [f"flagged_at_step {summary['flagged_at_step']}"]
    )


def test_windowed_streaming_runs_its_schedule_on_the_clock(tmp_path: Path) -> None:
    """Streaming DiLoCo with inner.window_s: the fragment schedule ticks on the wall clock, so the slow peer's
    fragments sync with everyone else's although it takes far fewer inner steps, weighted by its tokens."""
    cfg = tiny_config(
        tmp_path, run__algorithm="streaming", run__outer_steps=3, inner__steps=8, inner__window_s=1.6,
        streaming__fragments=2, streaming__tau=2,
    )  # fmt: skip
    swarm = run_with_a_slow_last_peer(tmp_path, 3, cfg, SLOW)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[2]["peer_id"]
    assert summaries[2]["inner_step"] < 0.7 * min(s["inner_step"] for s in summaries[:2]), summaries
    weighted = [r for r in summaries[0]["rounds"] if len(r["included"]) == 3 and r["tokens"]]
    assert len(weighted) >= 3, summaries[0]["rounds"]
    # Summed over the rounds: one round alone may invert it. Under a CPU burner a fast peer, slow to start, did one
    # step (128 tokens) before the first sync while the slow peer had 1024: claims follow the work actually done.
    total: dict[str, int] = {}
    for r in weighted:
        tokens = dict(zip(r["included"], r["tokens"], strict=True))
        assert tokens[slow_id] > 0, r
        for pid, t in tokens.items():
            total[pid] = total.get(pid, 0) + t
    assert total[slow_id] < 0.7 * min(t for pid, t in total.items() if pid != slow_id), total


def test_uplink_injector_slows_a_peer_that_the_swarm_then_flags(tmp_path: Path) -> None:
    """PEERD_FAULT_UPLINK_MBIT (no root needed): one peer's upload paced to a few Mbit/s on loopback makes every
    round wait for its bytes; the others flag it slow, and it stops owning a shard."""
    # outer.slow_link = "wait": the flagged peer stays in rounds (test_sponsor.py has the default, sponsoring).
    # 30 inner steps: with 10, outer steps came every ~0.3 s, faster than verdicts travel by gossip on a loaded CI
    # machine, and one peer saw the flag a step late (step 4); real outer steps take minutes.
    cfg = tiny_config(tmp_path, run__outer_steps=6, inner__steps=30, outer__slow_link="wait")
    swarm = run_with_a_slow_uplink(tmp_path, cfg, 240)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[3]["peer_id"]
    assert "upload shaped to 2 Mbit/s" in swarm.peers[3].log()
    for s in summaries[:3]:
        assert slow_id in s["flagged_at_step"] and s["flagged_at_step"][slow_id] <= 3, s["flagged_at_step"]
        late = [r for r in s["rounds"] if r["step"] > s["flagged_at_step"][slow_id]]
        assert late and all(r["no_shards"] == [slow_id] for r in late), s["rounds"]


def test_a_slow_owner_judges_a_fast_peers_work_by_its_pseudo_gradient_not_its_weight(tmp_path: Path) -> None:
    """Two windowed peers, one 5x+ slower: each scales its vector by its token weight, so the fast peer's weighted
    contribution is its larger pseudo-gradient times a larger weight, tens of times the slow owner's own. The
    owner's norm screen divides each weight out (the claim is bounded by rendezvous.MAX_WEIGHT_RATIO): every
    round completes with both, where screening the weighted norms refused the fast peer's honest work."""
    cfg = tiny_config(tmp_path, run__outer_steps=4, inner__window_s=1.5, inner__steps=1000)
    swarm = run_with_a_slow_last_peer(tmp_path, 2, cfg, {"PEERD_FAULT_STEP_DELAY_S": "0.2"})
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        assert "refused contributions" not in p.log(), p.log_tail()
    summaries = [p.summary() for p in swarm.peers]
    slow_id = summaries[1]["peer_id"]
    for s in summaries:
        assert s["outer_step"] == 4 and s["finished"], s
        both = [r for r in s["rounds"] if len(r["included"]) == 2]
        assert len(both) == 4, s["rounds"]
        for r in both:
            tokens = dict(zip(r["included"], r["tokens"], strict=True))
            assert 0 < 3 * tokens[slow_id] < max(tokens.values()), r
