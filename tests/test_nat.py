"""Peers behind a NAT or firewall (issue 11): the dial-back probe, outbound-only peers in every algorithm, relays.

Swarm tests run real `peerd start` processes on 127.0.0.1; an outbound-only peer is simulated by the
PEERD_FAULT_NO_INBOUND injector (peerd/faults.py), which refuses and logs every inbound call, so a test also sees
that nobody dialled it. Namespace tests with real dropped SYNs are in tests/test_nat_netns.py.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.nat import write_keys
from peerd.config import RunConfig
from peerd.demo import global_params
from peerd.identity import Identity, verify
from peerd.membership import Membership
from peerd.reachability import (
    OUTBOUND_ONLY,
    REACHABLE,
    ProbeLimiter,
    Reachability,
    dialable,
    echo_bytes,
    same_host,
)
from peerd.v1 import peerd_pb2 as pb
from tests.swarm import Swarm, tiny_config

NO_INBOUND = {"PEERD_FAULT_NO_INBOUND": "1"}
OUTBOUND_LINE = "not reachable from outside: taking part as an outbound-only peer"
LEADER_UNREACHABLE = "round leader"  # "round leader X unreachable (CODE); trying the next"


# -- units ----------------------------------------------------------------------------------------------------------
def test_old_entries_and_unchecked_peers_are_dialable() -> None:
    assert dialable(pb.PeerInfo(peer_id="a"))
    assert not dialable(pb.PeerInfo(peer_id="a", outbound_only=True))
    # an entry serialized by a peer that predates the field parses with the flag off
    assert not pb.PeerInfo.FromString(pb.PeerInfo(peer_id="a", address="h:1").SerializeToString()).outbound_only


def test_same_host_compares_addresses_not_spellings() -> None:
    assert same_host("::ffff:1.2.3.4", "::ffff:1.2.3.4") and not same_host("1.2.3.4", "1.2.3.5")


def test_probe_limiter_per_key_per_host_and_concurrency() -> None:
    lim = ProbeLimiter(per_key=(0.0, 2), per_host=(0.0, 3))
    assert lim.allow("k1", "h", 0) and lim.allow("k1", "h", 0)
    assert not lim.allow("k1", "h", 0)  # the key's budget is spent
    assert lim.allow("k2", "h", 0)
    assert not lim.allow("k3", "h", 0)  # the host's budget is spent, whatever the key
    assert lim.allow("k3", "other", 0)
    lim.running = 4
    assert not lim.allow("k4", "h2", 0)


class _FakeDaemon:
    def __init__(self) -> None:
        self.identity = Identity.generate()
        self.run_id = b"r" * 32
        self.me = pb.PeerInfo(peer_id=self.identity.peer_id, address="0.0.0.0:7000", heartbeat=5)
        self.membership = Membership(self.me, peer_timeout=5.0, settle_s=0.0)
        self.metrics = None
        self.cfg = RunConfig()
        self.announce: str | None = None


def test_echo_answers_only_our_nonces_and_flag_flips_bump_heartbeat() -> None:
    d: Any = _FakeDaemon()
    r = Reachability(d)
    assert r.echo(pb.ProbeEchoRequest(run_id=d.run_id, nonce=b"n" * 16)) is None
    r.pending[b"n" * 16] = float("inf")
    assert r.echo(pb.ProbeEchoRequest(run_id=b"x" * 32, nonce=b"n" * 16)) is None  # another run
    sig = r.echo(pb.ProbeEchoRequest(run_id=d.run_id, nonce=b"n" * 16))
    assert sig is not None and verify(d.identity.public_key, sig, echo_bytes(d.run_id, b"n" * 16))
    r._set(OUTBOUND_ONLY, "1.2.3.4:7000")
    assert d.me.outbound_only and d.me.heartbeat == 6
    assert r.line().startswith(OUTBOUND_LINE) and "forward port 7000" in r.line() and "--announce" in r.line()
    r._set(REACHABLE, "1.2.3.4:7000")
    assert not d.me.outbound_only and d.me.heartbeat == 7 and r.line() == "reachable at 1.2.3.4:7000"
    assert d.me.relays  # a reachable peer offers to relay ([network] relay defaults to true)


def test_a_changed_observed_address_triggers_a_new_check() -> None:
    import asyncio

    d: Any = _FakeDaemon()
    r = Reachability(d)
    asked: list[tuple[str, bool]] = []

    async def check(address: str, peer: Any = None, readdress: bool = False) -> None:
        asked.append((address, readdress))

    r.check = check  # type: ignore[method-assign]
    peer = pb.PeerInfo(peer_id="p" * 32, address="10.0.0.9:7000")

    async def scenario() -> None:
        r.observe(peer, "198.51.100.1")
        r.observe(peer, "198.51.100.1")
        await asyncio.sleep(0)
        assert asked == []  # first sighting, then the same: nothing to check
        r.observe(peer, "198.51.100.2")
        await asyncio.sleep(0)
        assert asked == [("10.0.0.9:7000", False)]  # it never saw us where we announce: a second network of ours?
        r.observe(peer, "198.51.100.3")  # within RECHECK_S of the last check: rate-limited
        await asyncio.sleep(0)
        assert len(asked) == 1
        d.me.address = "198.51.100.3:7000"  # it saw us where we announce, and now elsewhere: our address changed
        r.observe(peer, "198.51.100.4")
        await asyncio.sleep(0)
        assert asked[1:] == [("10.0.0.9:7000", True)]  # not rate-limited: every dial of us fails meanwhile
        d.announce, d.me.address = "198.51.100.4:7000", "198.51.100.4:7000"  # --announce: the user's to keep right
        r.observe(peer, "198.51.100.5")
        await asyncio.sleep(0)
        assert len(asked) == 2

    asyncio.run(scenario())


def test_an_outbound_only_verdict_is_checked_again_after_30_s_then_at_doubling_intervals() -> None:
    """A dial-back times out on a starved machine as it does behind a NAT: with 64 daemons on 2 cores one peer was
    judged outbound-only at start and, re-checked only every 300 s, owned no shard for the whole run. The first
    re-check now comes after RECHECK_S; each verdict that agrees doubles the wait, up to RECHECK_OUTBOUND_S."""
    import time

    from peerd.reachability import RECHECK_OUTBOUND_S, RECHECK_S

    r = Reachability(_FakeDaemon())  # type: ignore[arg-type]
    spawned: list[str] = []
    r._spawn = lambda peer: spawned.append(peer.peer_id)  # type: ignore[method-assign]
    helper = pb.PeerInfo(peer_id="h" * 32, address="10.0.0.2:7000")
    waits = []
    for _ in range(6):
        r._set(OUTBOUND_ONLY, "1.2.3.4:7000")
        waits.append(r.outbound_recheck_s())
    assert waits == [RECHECK_S, 2 * RECHECK_S, 4 * RECHECK_S, 8 * RECHECK_S, RECHECK_OUTBOUND_S, RECHECK_OUTBOUND_S]
    r._outbound_verdicts = 5000  # days behind a NAT: the wait stays capped (2 ** 5000 * 30.0 would overflow)
    assert r.outbound_recheck_s() == RECHECK_OUTBOUND_S
    r._set(REACHABLE, "1.2.3.4:7000")
    r._set(OUTBOUND_ONLY, "1.2.3.4:7000")  # a new run of verdicts starts over
    assert r.outbound_recheck_s() == RECHECK_S
    r._verdict_at = time.monotonic() - RECHECK_S + 1.0
    r.tick([helper])
    assert spawned == []  # not yet
    r._verdict_at = time.monotonic() - RECHECK_S - 1.0
    r.tick([helper])
    assert spawned == [helper.peer_id]  # 300 s before this change


def test_a_probe_call_without_an_answer_is_retried_within_seconds_through_another_peer() -> None:
    """A probe call that fails (the helper was starting, starved or gone) says nothing about us. In a namespace run
    under load, a blocked joiner's pre-join probe met a bootstrap not yet listening, and the first peer's probe went
    to a starved helper: both stayed without a verdict for RECHECK_S (30 s), and the blocked one was dialled by
    everyone meanwhile. Now the next check may start RETRY_S later, doubling per failure, and goes to another peer."""
    import asyncio

    import grpc

    from peerd.reachability import RECHECK_S, RETRY_S

    class _Stub:
        async def Probe(self, req: Any, timeout: float) -> Any:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())

    class _Channels:
        def membership(self, address: str, peer: Any = None) -> _Stub:
            return _Stub()

    d: Any = _FakeDaemon()
    d.channels = _Channels()
    r = Reachability(d)
    starved = pb.PeerInfo(peer_id="s" * 32, address="10.0.0.2:7000")
    other = pb.PeerInfo(peer_id="o" * 32, address="10.0.0.3:7000")

    async def scenario() -> list[float]:
        waits = []
        for _ in range(6):
            await r.check(starved.address, starved)
            waits.append(r._next_check - time.monotonic())
        return waits

    waits = asyncio.run(scenario())
    assert r.state == "unknown" and not r.pending
    expected = [RETRY_S * 2**i for i in range(5)] + [RECHECK_S]
    assert all(abs(w - e) < 0.5 for w, e in zip(waits, [min(e, RECHECK_S) for e in expected], strict=True)), waits
    spawned: list[str] = []
    r._spawn = lambda peer: spawned.append(peer.address)  # type: ignore[method-assign]
    for _ in range(20):
        r.tick([starved, other])
    assert set(spawned) == {other.address}  # not the helper that did not answer
    r.tick([starved])
    assert spawned[-1] == starved.address  # unless it is the only one


def test_relay_counts_bytes_and_refuses_over_the_per_peer_limit() -> None:
    from peerd.limits import LimitExceeded
    from peerd.relay import BURST_BYTES, RelayServer, _Attached

    srv = RelayServer(_FakeDaemon())  # type: ignore[arg-type]
    att = _Attached("a" * 32, rate_bytes=0.0)  # no refill: only the burst
    srv._count(att, BURST_BYTES - 10)
    with pytest.raises(LimitExceeded):
        srv._count(att, 11)
    assert srv.relayed_bytes == BURST_BYTES - 10
    other = _Attached("b" * 32, rate_bytes=0.0)  # the limit is per attached peer
    srv._count(other, 11)


def test_status_shows_reachability_and_outbound_only_peers() -> None:
    from peerd.status import format_status

    st = pb.StatusResponse(
        peer_id="a" * 32,
        reachability="not reachable from outside: taking part as an outbound-only peer; ...",
        relayed_bytes=3_000_000,
        peers=[pb.PeerInfo(peer_id="b" * 32, address="10.0.0.2:7000", outbound_only=True)],
        alive=["b" * 32],
    )
    text = format_status(st)
    assert "reach      not reachable from outside" in text and "relayed 3.00 MB" in text
    assert "alive, outbound-only" in text


# -- swarms on loopback ---------------------------------------------------------------------------------------------
def run_swarm(tmp_path: Path, n: int, blocked: list[int], **cfg: Any) -> Swarm:
    write_keys(tmp_path, n, blocked)
    swarm = Swarm(tmp_path, n, tiny_config(tmp_path, **cfg))
    wait = n
    first = swarm.spawn(0, None, wait_peers=wait)
    swarm.peers.append(first)
    for i in range(1, n):
        env = NO_INBOUND if i in blocked else None
        swarm.peers.append(swarm.spawn(i, first.address, wait_peers=wait, env=env))
    return swarm


def assert_nobody_dialled(swarm: Swarm, blocked: list[int]) -> None:
    for i in blocked:
        log = swarm.peers[i].log()
        assert OUTBOUND_LINE in log, swarm.peers[i].log_tail()
        refused = [line for line in log.splitlines() if "fault: refused inbound call" in line]
        assert len(refused) == 1 and "ProbeEcho" in refused[0], refused
    for i, p in enumerate(swarm.peers):
        if i not in blocked:
            assert "reachable at 127.0.0.1:" in p.log(), p.log_tail()
        assert LEADER_UNREACHABLE not in p.log()


def assert_identical_globals(dirs: list[Path]) -> None:
    params = [global_params(d) for d in dirs]
    assert all(p is not None for p in params)
    for a, b in itertools.combinations(params, 2):
        assert torch.equal(a["params"], b["params"]), float((a["params"] - b["params"]).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("blocked", [[1], [1, 2]], ids=["1of4", "2of4"])
def test_diloco_with_outbound_only_peers(tmp_path: Path, blocked: list[int]) -> None:
    steps = 5
    swarm = run_swarm(tmp_path, 4, blocked, run__outer_steps=steps)
    try:
        swarm.wait_exit(240)
    finally:
        swarm.stop()
    assert_nobody_dialled(swarm, blocked)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    ids = {p.summary()["peer_id"] for p in swarm.peers}
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == steps and s["rounds_partial"] == 0, s
        assert all(set(r["included"]) == ids for r in s["rounds"]), s["rounds"]


@pytest.mark.slow
def test_streaming_with_two_of_four_outbound_only(tmp_path: Path) -> None:
    from tests.test_streaming import STREAMING, assert_same_digest_after_every_sync, stats_of

    cfg = dict(run__outer_steps=3, inner__steps=8, streaming__tau=2, streaming__late_policy="wait", **STREAMING)
    swarm = run_swarm(tmp_path, 4, [1, 2], **cfg)
    try:
        swarm.wait_exit(240)
    finally:
        swarm.stop()
    assert_nobody_dialled(swarm, [1, 2])
    dirs = [p.data_dir for p in swarm.peers]
    assert_identical_globals(dirs)
    assert assert_same_digest_after_every_sync(dirs) == 5
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == 3 and s["rounds_partial"] == 0, s
        assert all(r["included"] == 4 for r in stats_of(p.data_dir)["syncs"])


@pytest.mark.slow
def test_noloco_outbound_only_peer_pairs_and_is_never_dialled(tmp_path: Path) -> None:
    swarm = run_swarm(tmp_path, 4, [1], run__algorithm="noloco", run__outer_steps=8)
    try:
        swarm.wait_exit(240)
    finally:
        swarm.stop()
    assert_nobody_dialled(swarm, [1])
    blocked_id = swarm.peers[1].summary()["peer_id"]
    s = swarm.peers[1].summary()
    assert s["outer_step"] == 8 and s["rounds_partial"] == 0, s
    paired = [r for r in s["rounds"] if r["note"].startswith("partner ")]
    assert len(paired) >= 2, s["rounds"]  # it exchanges, over streams it opened
    for p in swarm.peers:  # proposals to it went through its relay (test below), never to its address
        assert p.summary()["rounds_partial"] == 0
    assert any(blocked_id in r["included"] for p in swarm.peers if p.index != 1 for r in p.summary()["rounds"])


@pytest.mark.slow
def test_noloco_relay_lets_outbound_only_peers_pair_with_anyone(tmp_path: Path) -> None:
    swarm = run_swarm(tmp_path, 4, [1, 2], run__algorithm="noloco", run__outer_steps=10)
    try:
        swarm.wait_exit(240)
    finally:
        swarm.stop()
    assert_nobody_dialled(swarm, [1, 2])
    sums = [p.summary() for p in swarm.peers]
    blocked = {sums[1]["peer_id"], sums[2]["peer_id"]}
    for s in sums:
        assert s["outer_step"] == 10 and s["rounds_partial"] == 0, s
    assert sum(s["relayed_bytes"] for s in sums) > 0
    relays = [swarm.peers[i].log() for i in (0, 3)]
    assert any("relaying for outbound-only peer" in log for log in relays)
    # paired through the relay: a reachable peer, or the other outbound-only peer, named an outbound-only one
    # as its partner although nobody can dial it
    proposed_to = [r for s in sums for r in s["rounds"] if len(r["included"]) == 2 and r["included"][1] in blocked]
    assert proposed_to, [s["rounds"] for s in sums]
    # --wait-peers waited for the relays: each outbound-only peer was attached before its first outer step (its
    # first may be step 3: a peer slow to start downloads the state of those that went ahead)
    for i in (1, 2):
        log = swarm.peers[i].log()
        first = re.search(r"outer step \d+ \|", log)
        assert "attached to relay" in log and first, swarm.peers[i].log_tail()
        assert log.index("attached to relay") < first.start(), swarm.peers[i].log_tail()
    assert not any("have no relay yet" in p.log() for p in swarm.peers)


@pytest.mark.slow
def test_swarm_left_with_no_reachable_peer_says_so_and_does_not_train_together(tmp_path: Path) -> None:
    swarm = run_swarm(tmp_path, 3, [1, 2], run__outer_steps=400)
    try:
        swarm.wait_until(lambda: swarm.peers[0].status().outer_step >= 2, 120, "outer step 2")
        swarm.peers[0].terminate()
        line = "no reachable peer in the swarm"
        swarm.wait_until(lambda: all(line in swarm.peers[i].log() for i in (1, 2)), 60, "the no-reachable-peer line")
        time.sleep(3.0)
    finally:
        swarm.stop()
    reachable_id = swarm.peers[0].summary()["peer_id"]
    for i in (1, 2):
        log = swarm.peers[i].log()
        assert log.count(line) == 1, log  # one line, not one per step
        assert log.count("no reachable peer to lead the round") <= 2, log  # one per rendezvous timeout at most
        assert OUTBOUND_LINE in log
        assert all(reachable_id in r["included"] for r in swarm.peers[i].summary()["rounds"])  # none without it


@pytest.mark.slow
def test_a_peer_judged_outbound_only_while_starved_is_dialled_again_half_a_minute_later(tmp_path: Path) -> None:
    """PEERD_FAULT_ECHO_LATE=1: peer 2 answers its first dial-back after the prober's deadline, as a starved daemon
    does, and is judged outbound-only at its join. Its re-check 30 s later finds it reachable, and the others' view
    follows (before, that took 300 s: the rest of a bench run)."""
    swarm = Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=500))
    try:
        swarm.peers.append(swarm.spawn(0, None, wait_peers=3))
        swarm.peers.append(swarm.spawn(1, swarm.peers[0].address, wait_peers=3))
        swarm.peers.append(swarm.spawn(2, swarm.peers[0].address, wait_peers=3, env={"PEERD_FAULT_ECHO_LATE": "1"}))
        late = swarm.peers[2]
        swarm.wait_until(lambda: OUTBOUND_LINE in late.log(), 60, "peer 2 judged outbound-only")
        judged = time.monotonic()
        swarm.wait_until(lambda: "reachable at 127.0.0.1:" in late.log(), 75, "peer 2 re-checked and reachable")
        flipped = time.monotonic() - judged
        late_id = late.status().peer_id

        def seen_dialable() -> bool:
            peers = {p.peer_id: p for p in swarm.peers[0].status().peers}
            return late_id in peers and not peers[late_id].outbound_only

        swarm.wait_until(seen_dialable, 30, "peer 0 to see peer 2 as dialable")
    finally:
        swarm.stop()
    assert "answering a dial-back probe 2 s late" in late.log()
    assert 20 < flipped < 60, flipped  # RECHECK_S (30 s) after the verdict, give or take a gossip interval


@pytest.mark.slow
def test_a_joiner_whose_probe_got_no_answer_has_its_verdict_seconds_later(tmp_path: Path) -> None:
    """PEERD_FAULT_PROBE_DROP=1 on peer 0: the pre-join probe of peer 1, which joins through it, fails as one to a
    starting or starved bootstrap peer does. Peer 1 asks again a couple of seconds later (it waited 30 s before)."""
    swarm = Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=500))
    try:
        swarm.peers.append(swarm.spawn(0, None, wait_peers=2, env={"PEERD_FAULT_PROBE_DROP": "1"}))
        swarm.peers.append(swarm.spawn(1, swarm.peers[0].address, wait_peers=2))
        joiner = swarm.peers[1]
        swarm.wait_until(lambda: "reachability probe through" in joiner.log(), 60, "peer 1's probe to fail")
        failed = time.monotonic()
        swarm.wait_until(lambda: "reachable at 127.0.0.1:" in joiner.log(), 40, "peer 1's verdict")
        took = time.monotonic() - failed
    finally:
        swarm.stop()
    assert "fault injection: dropping a dial-back probe request" in swarm.peers[0].log()
    assert "UNAVAILABLE" in joiner.log() and "asking again in 2s" in joiner.log(), joiner.log_tail()
    assert took < 15, took  # RETRY_S (2 s) and a gossip interval, not RECHECK_S (30 s)


def test_a_new_address_is_taken_only_where_this_machine_is_or_a_second_peer_sees_it(tmp_path: Path) -> None:
    """Re-addressing (peerd/netchange.py): one peer's word alone would let a liar point everyone at an address where
    we are not."""
    d: Any = _FakeDaemon()
    d.data_dir, d.me.address = tmp_path, "198.51.100.3:7000"
    r = Reachability(d)
    prober, other = "p" * 32, "q" * 32
    r.seen = {prober: "198.51.100.9", other: "198.51.100.3"}
    r._adopt("198.51.100.9:7000", prober)
    assert d.me.address == "198.51.100.3:7000" and r.readdressed == 0  # only the prober sees us there
    r.seen[other] = "198.51.100.9"
    r._adopt("198.51.100.9:7000", prober)
    assert d.me.address == "198.51.100.9:7000" and d.me.heartbeat == 6
    assert (tmp_path / "address").read_text().strip() == "198.51.100.9:7000"
    r._adopt("127.0.0.1:7000", prober)  # an address of this machine: no second opinion needed
    assert d.me.address == "127.0.0.1:7000" and r.readdressed == 2
