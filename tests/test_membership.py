"""Membership in a real swarm: gossip spreads peers, a clean leave is announced, a dead peer is dropped; the standard
health and reflection services are on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from peerd.membership import Membership
from peerd.v1 import peerd_pb2 as pb
from tests.swarm import Swarm, tiny_config


def _info(key: bytes, hb: int, **kw) -> pb.PeerInfo:
    from peerd.identity import peer_id_of

    return pb.PeerInfo(peer_id=peer_id_of(key), public_key=key, heartbeat=hb, address="h:1", **kw)


def test_merge_keeps_the_freshest_entry_and_detects_silence() -> None:
    me = _info(b"m" * 32, 1)
    m = Membership(me, peer_timeout=5.0, settle_s=0.0)
    a = b"a" * 32
    assert m.merge([_info(a, 3)], now=0.0) == [_info(a, 3).peer_id]
    m.merge([_info(a, 2, outer_step=9)], now=1.0)  # older heartbeat: ignored
    assert m.get(_info(a, 1).peer_id).outer_step == 0
    m.merge([_info(a, 4, outer_step=1)], now=2.0)
    assert m.get(_info(a, 1).peer_id).outer_step == 1
    assert len(m.alive(now=6.9)) == 2 and len(m.alive(now=7.1)) == 1  # silent for peer_timeout: dead
    assert m.others_alive(now=6.9) == 1 and m.others_alive(now=7.1) == 0  # ourselves never counted
    m.mark_unreachable(_info(a, 1).peer_id, now=2.5, address="h:2")  # it announces h:1: a dial elsewhere says nothing
    assert len(m.alive(now=3.0)) == 2
    m.mark_unreachable(_info(a, 1).peer_id, now=2.5, address="h:1")
    assert len(m.alive(now=3.0)) == 1
    # entries whose id is not derived from their key, and entries about ourselves, are ignored
    forged = _info(b"f" * 32, 1)
    forged.peer_id = "0" * 32
    assert m.merge([forged, _info(b"m" * 32, 99)], now=3.0) == []


def test_the_table_remembers_when_gossip_first_showed_each_outer_step() -> None:
    """Where the swarm's window clock stands: a peer that adopts the state of step k starts its next window when k
    first showed (peerd/diloco.py), not when its own download ended."""
    m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
    a, b = b"a" * 32, b"b" * 32
    m.merge([_info(a, 1, outer_step=3)], now=10.0)
    m.merge([_info(b, 1, outer_step=3), _info(a, 2, outer_step=4)], now=12.0)  # b reaches 3 later: still 10.0
    assert m.step_age(3, now=15.0) == 5.0 and m.step_age(4, now=15.0) == 3.0 and m.step_age(5, now=15.0) == 0.0
    for hb, step in enumerate(range(5, 40), start=3):  # a bounded record: the last 16 steps
        m.merge([_info(a, hb, outer_step=step)], now=20.0)
    assert len(m.step_seen) == 16 and m.step_age(3, now=21.0) == 0.0 and m.step_age(39, now=21.0) == 1.0


def test_our_own_stall_does_not_count_towards_anyone_s_silence() -> None:
    """A starved observer hears nobody while its loop is stalled: that time is forgiven, never past now."""
    m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
    a = _info(b"a" * 32, 3)
    m.merge([a], now=0.0)
    assert not m.is_alive(a.peer_id, now=6.0)
    m.forgive(3.0, now=6.0)  # we were stalled for 3 of those 6 s
    assert m.is_alive(a.peer_id, now=6.0) and m.silent_for(a.peer_id, now=6.0) == pytest.approx(3.0)
    m.forgive(60.0, now=6.0)
    assert m.silent_for(a.peer_id, now=6.0) == 0.0  # never heard "in the future"
    m.mark_unreachable(a.peer_id, now=6.0)
    m.forgive(1.0, now=6.5)
    assert not m.is_alive(a.peer_id, now=6.5)  # a failed dial is evidence of its own


def _bare_gossip(m: Membership, *, dial: bool):  # -> peerd.gossip.Gossip
    """A Gossip whose tick loop runs on `m` alone, with a 0.2 s interval: no channels, metrics or timing. With
    `dial` every live peer is a dial target (the caller replaces `_gossip_one`); without, nobody is dialled."""
    from types import SimpleNamespace

    from peerd.gossip import Gossip

    g = Gossip.__new__(Gossip)
    g.d = SimpleNamespace(
        membership=m, metrics=None, cfg=SimpleNamespace(network=SimpleNamespace(gossip_interval=0.2)),
        checks=SimpleNamespace(refresh_suspects=lambda: None),
        reach=SimpleNamespace(dial_targets=(lambda peers: peers) if dial else (lambda peers: []), tick=lambda p: None,
                              watch_source=lambda p: None),
    )  # fmt: skip
    g._inflight, g._long, g.stalled_s = {}, set(), 0.0
    g.refresh_timing = g._note_lost = g._remember = lambda *a: None  # type: ignore[method-assign]
    g._recent_peers = lambda: []  # type: ignore[method-assign]
    return g


def test_the_gossip_loop_forgives_the_time_its_own_loop_stalled() -> None:
    """The gossip loop measures how late its own waits end (an event loop blocked 1 s here, as a daemon among 64
    on 2 cores is): a peer last heard just before the stall is still alive after it, past its 0.8 s timeout."""
    import asyncio

    from peerd.gossip import Gossip

    async def main() -> tuple[Gossip, Membership, str]:
        m = Membership(_info(b"m" * 32, 1), peer_timeout=0.8, settle_s=0.0)
        a = _info(b"a" * 32, 3, outbound_only=True)  # nobody dials it: only its silence counts
        g = _bare_gossip(m, dial=False)
        stop = asyncio.Event()
        ticks = asyncio.ensure_future(g._gossip_ticks(stop, 0.2))
        await asyncio.sleep(0.3)
        m.merge([a])
        time.sleep(1.0)  # the loop stalls
        await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(ticks, 2)
        return g, m, a.peer_id

    g, m, pid = asyncio.run(main())
    assert g.stalled_s >= 0.8 and m.is_alive(pid)


def test_slow_answers_do_not_stretch_the_gossip_tick() -> None:
    """The gossip loop ticks once per interval (bumping our heartbeat each time) even when every call takes longer
    than the interval: the wait for answers comes out of the next nap. Added on top, it stretched ticks to up to two
    intervals among 64 starved daemons, and heartbeats advanced half as often."""
    import asyncio

    async def main() -> int:
        me = _info(b"m" * 32, 1)
        m = Membership(me, peer_timeout=30.0, settle_s=0.0)
        m.merge([_info(bytes([i + 1]) * 32, 1) for i in range(6)])
        g = _bare_gossip(m, dial=True)

        async def slow(peer: pb.PeerInfo, mark: str = "down") -> bool:
            await asyncio.sleep(0.5)  # every answer takes 2.5 intervals
            return True

        g._gossip_one = slow  # type: ignore[method-assign]
        stop = asyncio.Event()
        ticks = asyncio.ensure_future(g._gossip_ticks(stop, 0.2))
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.wait_for(ticks, 2)
        return me.heartbeat - 1

    bumps = asyncio.run(main())
    assert bumps >= 12, bumps  # 3 s at 0.2 s: about 15 ticks; waits added on top gave about 8


def test_a_probe_marks_a_refused_peer_at_once_and_a_frozen_one_never() -> None:
    """A probe of an entry about to expire (`Membership.expiring`) that meets a refused connection (a killed
    process's port: nothing listens) marks the peer unreachable then, instead of leaving it to the rest of its
    silence, which a starved observer forgives for tens of seconds. A probe that only times out (a listener that
    never answers: a frozen or starved peer) marks nothing; a re-dial of the dead marks nothing either. A tick's own
    target (mark "down") is marked on a refused connection, and not for a call that overran its deadline on a
    connected channel, even with the peer silent for more than half the timeout: that rule was wrong 4,220 times
    and right 26 times at 64 peers (a busy peer's heartbeat is routinely seconds old there); its silence reaching
    the timeout finds a frozen peer."""
    import asyncio
    import socket
    import time
    from types import SimpleNamespace

    from peerd.gossip import Gossip
    from peerd.identity import Identity
    from peerd.v1 import peerd_pb2_grpc as rpc

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_at = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there now: a dial is refused
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # the kernel accepts, nobody answers: the call runs to its deadline
    frozen_at = f"127.0.0.1:{frozen.getsockname()[1]}"

    async def main() -> dict[str, bool]:
        me = Identity.generate()
        m = Membership(_info(me.public_key, 1), peer_timeout=10.0, settle_s=0.0)
        peers = {
            (what, mark): _info(bytes([i]) * 32, 5)
            for i, (what, mark) in enumerate(
                [(w, k) for w in ("refused", "frozen") for k in ("refused", "never", "down")], start=1
            )
        }
        for (what, _), info in peers.items():
            info.address = refused_at if what == "refused" else frozen_at
        m.merge([info for key, info in peers.items() if key != ("frozen", "down")])
        m.merge([peers[("frozen", "down")]], now=time.monotonic() - 6.0)  # silent for 0.6x the timeout
        channels = {}

        def stub(address: str, peer: pb.PeerInfo | None = None) -> rpc.MembershipStub:
            channels.setdefault(address, grpc.aio.insecure_channel(address))
            return rpc.MembershipStub(channels[address])

        g = Gossip.__new__(Gossip)
        g._long = set()
        # a 1 s interval: the frozen/down call, to a peer silent 0.6x the timeout, waits until one interval before
        # the silence reaches it (Gossip.deadline: 3 s), and its peer is still alive when the test asks just after
        g.d = SimpleNamespace(
            membership=m, identity=me, run_id=b"r" * 16, count_sent=lambda *a: None,
            cfg=SimpleNamespace(network=SimpleNamespace(gossip_interval=1.0, gossip_entries=8)),
            channels=SimpleNamespace(membership=stub, connected=lambda address, peer=None: True),
            reach=SimpleNamespace(check_route=lambda peer: routes.append(peer.peer_id)),
        )  # fmt: skip
        routes: list[str] = []
        oks = await asyncio.gather(*(g._gossip_one(info, mark) for (_, mark), info in peers.items()))
        assert not any(oks)
        # a tick's call that hung on an open connection asks whether a new one gets an answer (peerd/pairblocks.py)
        assert routes == [peers[("frozen", "down")].peer_id]
        for c in channels.values():
            await c.close()
        refused = peers[("refused", "refused")].peer_id
        assert m.unreachable_why(refused) == "probe UNAVAILABLE"  # the "lost" line says a probe found it
        return {f"{what}/{mark}": m.is_alive(info.peer_id) for (what, mark), info in peers.items()}

    try:
        alive = asyncio.run(main())
    finally:
        frozen.close()
    assert alive == {
        "refused/refused": False, "refused/never": True, "refused/down": False,
        "frozen/refused": True, "frozen/never": True, "frozen/down": True,
    }  # fmt: skip
    # (dropped SYNs, a channel that never connects, mark a tick's target: tests/test_nat_netns.py, test_partition.py)


def test_a_new_incarnation_is_recorded_as_a_restart_once() -> None:
    """A peer restarted on its key keeps its id live; the new incarnation is the only sign its old process died."""
    m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
    a = b"a" * 32
    pid = _info(a, 1).peer_id
    m.merge([_info(a, 7, incarnation=10)], now=0.0)
    assert m.drain_restarts() == []  # a first sighting is not a restart
    m.merge([_info(a, 1, incarnation=11)], now=1.0)  # a lower heartbeat, but a newer process
    m.merge([_info(a, 2, incarnation=11)], now=2.0)  # the same process advancing
    assert m.drain_restarts() == [(pid, 10, 11)]
    assert m.drain_restarts() == []
    assert m.get(pid).incarnation == 11 and len(m.alive(now=2.0)) == 2
    m.merge([_info(a, 1, incarnation=12)], now=20.0)  # after a silence too: gossip.py decides what to say
    assert m.drain_restarts() == [(pid, 11, 12)]


def test_gone_is_our_own_evidence_that_a_rounds_process_of_a_peer_is_gone() -> None:
    """What a peer asked to take over a shard relies on (`ReduceRound.owner_for`): silence past the timeout, a failed
    dial of ours, or a newer incarnation. A peer we never heard of is no evidence."""
    m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
    a, b = _info(b"a" * 32, 1).peer_id, _info(b"b" * 32, 1).peer_id
    m.merge([_info(b"a" * 32, 1, incarnation=3), _info(b"b" * 32, 1, incarnation=3)], now=0.0)
    assert not m.gone(a, 3, now=1.0) and not m.gone("c" * 64, 1, now=1.0) and not m.gone(m.self_id, 0, now=1.0)
    assert m.gone(a, 2, now=1.0)  # the round had its previous process
    assert m.gone(a, 3, now=5.5)  # silent past the timeout
    m.mark_unreachable(b, now=1.0, address="h:1")
    assert m.gone(b, 3, now=1.5)  # our dial failed


@pytest.mark.slow
def test_bounded_gossip_goes_round_robin_and_expiring_entries_are_probed_once() -> None:
    """With gossip_entries = 8 a message carries 8 peers besides ourselves whatever the table size, the least recently
    sent first, so three messages cover a 20-peer table; an entry near expiry is handed out for a direct probe once
    per heartbeat (membership.py, bounded gossip)."""
    me = _info(b"m" * 32, 1)
    m = Membership(me, peer_timeout=10.0, settle_s=0.0)
    others = [_info(bytes([i + 1]) * 32, 1) for i in range(20)]
    m.merge(others, now=0.0)
    seen: set[str] = set()
    for t in (1.0, 2.0, 3.0):
        view = m.gossip_view(now=t, limit=8)
        assert len(view) == 9 and view[0].peer_id == me.peer_id
        seen |= {p.peer_id for p in view[1:]}
    assert seen == {p.peer_id for p in others}
    assert len(m.gossip_view(now=3.0)) == 21  # unbounded (Join, local status): the whole live table
    assert m.expiring(now=5.0) == []  # heard from 5 s ago: not yet
    first = m.expiring(now=7.0, most=4)
    assert len(first) == 4
    second = m.expiring(now=7.1, most=100)
    assert len(second) == 16 and not {p.peer_id for p in first} & {p.peer_id for p in second}
    assert m.expiring(now=7.2) == []  # each probed once until its heartbeat advances
    m.merge([_info(bytes([1]) * 32, 2)], now=7.5)
    assert m.expiring(now=14.0, most=100)[0].peer_id == others[0].peer_id  # advanced, then stale again: probed again
    assert len(m.alive(now=10.5)) == 2  # the probes did not keep anyone alive: only a fresh heartbeat does


def test_a_probe_is_asked_once_per_heartbeat_and_the_lost_line_says_how_it_went() -> None:
    """An entry near expiry is probed once until its heartbeat advances (an unanswered probe is not repeated: that
    was tried and starved 64 peers on 2 cores further), only when the caller can dial it now (`can`); `probe_note`
    tells the "lost" line whether the peer was probed and how the probe ended."""
    me = _info(b"m" * 32, 1)
    m = Membership(me, peer_timeout=10.0, settle_s=0.0)
    peer = _info(b"p" * 32, 1)
    m.merge([peer], now=0.0)
    pid = peer.peer_id
    assert m.probe_note(pid) == "not probed"
    assert m.expiring(now=6.0, can=lambda p: False) == []  # the caller cannot dial it now: not marked as probed
    assert [p.peer_id for p in m.expiring(now=6.0)] == [pid]
    m.probe_started(pid)
    assert m.probe_note(pid) == "probed 1x, last running"
    m.probe_ended(pid, "DEADLINE_EXCEEDED")
    assert m.expiring(now=9.0) == []  # unanswered, but asked once per heartbeat
    assert not m.is_alive(pid, now=10.1) and m.probe_note(pid) == "probed 1x, last DEADLINE_EXCEEDED"
    m.merge([_info(b"p" * 32, 2)], now=11.0)  # its heartbeat advanced: a clean slate
    assert m.is_alive(pid, now=11.0) and m.probe_note(pid) == "not probed"
    assert [p.peer_id for p in m.expiring(now=17.5)] == [pid]


def test_gossip_leave_and_failure_detection(tmp_path: Path) -> None:
    with Swarm(tmp_path, 4, tiny_config(tmp_path, run__outer_steps=0)) as swarm:
        p = swarm.peers
        # peer 3 only ever talked to peer 0 (its bootstrap), yet every peer learns of every other
        swarm.wait_until(lambda: all(len(x.status().alive) == 4 for x in p), 60, "full views")
        ids = {x.index: x.status().peer_id for x in p}

        with grpc.insecure_channel(p[1].address) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            names = {
                s.name
                for r in stub.ServerReflectionInfo(iter([req]), timeout=5)
                for s in r.list_services_response.service
            }
        assert {"peerd.v1.Membership", "peerd.v1.Rounds", "peerd.v1.State", "grpc.health.v1.Health"} <= names

        assert p[3].terminate() == 0  # SIGTERM: clean shutdown announces the leave
        t0 = time.monotonic()
        swarm.wait_until(lambda: all(ids[3] not in x.status().alive for x in p[:3]), 10, "leave to spread")
        left = {e.peer_id: e.left for e in p[0].status().peers}
        assert left.get(ids[3]) is True
        assert time.monotonic() - t0 < 3.0  # well before the 3 s failure timeout would have dropped it

        p[2].kill()  # kill -9: no leave; dropped by failure detection
        swarm.wait_until(lambda: all(ids[2] not in x.status().alive for x in p[:2]), 15, "failure detection")
        st = p[1].status()
        assert sorted(st.alive) == sorted([ids[0], ids[1]])


def test_a_peer_killed_and_restarted_at_once_is_detected_by_every_other(tmp_path: Path) -> None:
    """kill -9 and an immediate restart on the same data dir (same id, new process): its new gossip can reach a peer
    before the old process's silence or a refused dial does, so each survivor logs it lost or restarted, within
    2 x peer_timeout (bench.scale reads detection from the same two lines), and ends with the new process live."""
    with Swarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=0)) as swarm:
        p = swarm.peers
        swarm.wait_until(lambda: all(len(x.status().alive) == 3 for x in p), 60, "full views")
        time.sleep(1.0)  # a few gossip ticks: each observer's loop has counted the old process live (the lines say
        # when a live peer goes; one that died before an observer's first tick with it is dropped without a line)
        pid = p[2].status().peer_id
        p[2].kill()
        t0 = time.monotonic()
        swarm.peers[2] = swarm.spawn(2, swarm.boot_address(0))

        def detected(x) -> bool:
            return f"peer {pid[:8]} lost: " in x.log() or f"peer {pid[:8]} restarted: " in x.log()

        swarm.wait_until(lambda: all(detected(x) for x in p[:2]), 2 * 3.0 + 2.0, "the kill detected")
        assert time.monotonic() - t0 <= 2 * 3.0 + 1.0  # tiny_config's peer_timeout is 3 s (+1 s of polling)
        swarm.wait_until(lambda: all(pid in x.status().alive for x in p[:2]), 30, "the new process live")


def test_a_dead_peer_s_port_taken_by_another_process_does_not_bring_it_back(tmp_path: Path) -> None:
    """kill -9 a peer, then start an unrelated peer of the same run (a swarm of its own: no bootstrap) on the port it
    freed: an address reused on the internet, or, on loopback, another test's peer (a CI run merged two tests' swarms
    that way, and each then counted the other's peers as expected members). The survivor's re-dials reach a process
    that is not the peer they mean: it refuses them (GossipRequest.to) before merging anything, so the survivor never
    counts the dead peer as answering again, and never learns the other swarm."""
    cfg = tiny_config(tmp_path, run__outer_steps=0, network__redial_max=1.0)
    with Swarm(tmp_path, 2, cfg) as swarm:
        a, b = swarm.peers
        swarm.wait_until(lambda: len(a.status().alive) == 2, 60, "a full view")
        b_id, addr = b.status().peer_id, b.address
        b.kill()
        swarm.wait_until(lambda: b_id not in a.status().alive, 15, "the kill detected")
        c = swarm.spawn(2, None, extra=["--listen", addr])
        swarm.peers.append(c)
        assert c.address == addr
        c_id = c.status().peer_id
        redialled = ("now answers as another process", f"peer {b_id[:8]} at {addr} answers again")
        swarm.wait_until(lambda: any(line in a.log() for line in redialled), 30, "a re-dial of the old address")
        time.sleep(2.0)  # a few more re-dials and gossip ticks
        st = a.status()
        assert b_id not in st.alive and c_id not in {e.peer_id for e in st.peers}, a.log_tail()
        assert redialled[1] not in a.log(), a.log_tail()
        assert a.status().peer_id not in {e.peer_id for e in c.status().peers}, c.log_tail()


@pytest.mark.slow
def test_bounded_gossip_keeps_every_peer_alive_and_finds_a_silent_one_within_twice_the_timeout(
    tmp_path: Path,
) -> None:
    """Seven peers gossip two entries per message (network.gossip_entries = 2, so no message carries the whole
    table): every peer still sees every other for the whole run, with no false "lost" line, and a peer frozen with
    SIGSTOP (its connections stay open and silent, as a host that dropped off the internet) is logged lost by every
    other within 2 x peer_timeout, then rejoins once it thaws."""
    cfg = tiny_config(tmp_path, run__outer_steps=0, network__gossip_entries=2, inner__steps=20)
    with Swarm(tmp_path, 7, cfg) as swarm:
        p = swarm.peers
        swarm.wait_until(lambda: all(len(x.status().alive) == 7 for x in p), 60, "full views")
        time.sleep(6.0)  # two peer timeouts of bounded gossip
        assert all(len(x.status().alive) == 7 for x in p)
        assert not any(" lost: " in x.log() for x in p), [x.log_tail() for x in p if " lost: " in x.log()]
        frozen = p[6]
        frozen_id = frozen.status().peer_id
        frozen.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            swarm.wait_until(
                lambda: all(f"peer {frozen_id[:8]} lost: " in x.log() for x in p[:6]), 12, "the frozen peer lost"
            )
            took = time.monotonic() - t0
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
        assert took <= 2 * 3.0, took  # tiny_config's peer_timeout is 3 s
        swarm.wait_until(lambda: all(len(x.status().alive) == 7 for x in p), 30, "the thawed peer back")


def test_a_peer_that_answers_late_is_waited_for_not_counted_lost(tmp_path: Path) -> None:
    """A starved peer, as the others see it at 64 daemons on 2 cores (PEERD_FAULT_GOSSIP_LATE_S): it answers each
    Gossip call 2.5 s after it arrives and calls nobody, so its heartbeat reaches peer 0 only in those late answers.
    A 2 s deadline on every call left it silent until peer_timeout and counted it lost; a call to a peer about to go
    stale now waits for as long as the verdict allows (`Gossip.deadline`), and the answer clears it every time."""
    cfg = tiny_config(tmp_path, run__outer_steps=0, inner__steps=20, network__peer_timeout=8.0)
    with Swarm(tmp_path, 1, cfg) as swarm:
        late = swarm.add_peer(env={"PEERD_FAULT_GOSSIP_LATE_S": "2.5"})
        first = swarm.peers[0]
        late_id = late.status().peer_id
        swarm.wait_until(lambda: len(first.status().alive) == 2, 30, "the late peer joined")
        time.sleep(20.0)  # two and a half peer timeouts
        assert f"peer {late_id[:8]} lost: " not in first.log(), first.log_tail()
        assert late_id in first.status().alive
        assert len(late.status().alive) == 2  # the other way round its calls carry peer 0's heartbeat in time


def test_a_call_to_a_peer_about_to_go_stale_waits_longer_and_is_not_counted_against_a_tick() -> None:
    """`Gossip.deadline`: 2 s while the call would end before the peer is stale (0.6 x peer_timeout), then until one
    interval before the silence reaches the timeout. Such a call is held apart from a tick's three while it runs
    (`_long`), and only calls the tick started are: a re-dial of a dead peer (`_gossip_one` alone) leaves no trace
    that would let later ticks start more than three ordinary calls."""
    import asyncio

    async def main() -> None:
        m = Membership(_info(b"m" * 32, 1), peer_timeout=10.0, settle_s=0.0)
        g = _bare_gossip(m, dial=True)  # interval 0.2 s
        now = time.monotonic()
        fresh, stale, older = (_info(bytes([k]) * 32, 3) for k in (1, 2, 3))
        m.merge([fresh])
        m.merge([stale], now=now - 5.0)
        m.merge([older], now=now - 7.0)
        assert g.deadline(fresh.peer_id) == 2.0  # 0 + 2 < 6
        assert abs(g.deadline(stale.peer_id) - (10.0 - 5.0 - 0.2)) < 0.05  # 5 + 2 >= 6: until 9.8 s of silence
        assert abs(g.deadline(older.peer_id) - 2.8) < 0.05

        async def answered_late(peer: pb.PeerInfo, mark: str = "down") -> bool:
            await asyncio.sleep(0.05)
            return False

        g._gossip_one = answered_late  # type: ignore[method-assign]
        g._start(stale, "refused")
        g._start(fresh, "down")
        assert g._long == {stale.peer_id}
        await g._gossip_one(older, "never")  # a re-dial: not the tick's
        await asyncio.gather(*g._inflight.values())
        assert not g._inflight and not g._long

    asyncio.run(main())


def test_a_peer_that_adopted_another_state_is_no_longer_taken_as_past_the_step_it_left() -> None:
    """The losing side of a split finished steps 26 and 27 with us, then downloaded the winner's state at step 25.
    Its gossip now says 25 with another digest: it is not past 25 any more (CI: a leader that kept the hint never
    reopened the swarm's round at 25, and every peer was told "behind" for 3 minutes). A lagging entry from before
    the round (the same digest) leaves the hint alone."""
    m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
    a = b"a" * 32
    pid = _info(a, 1).peer_id
    m.merge([_info(a, 1, outer_step=25, state_digest=b"x" * 32)], now=0.0)
    m.note_round(27, [pid])
    m.merge([_info(a, 2, outer_step=25, state_digest=b"x" * 32)], now=0.5)  # a heartbeat from before the round
    assert m.step_of(m.get(pid)) == 27
    m.merge([_info(a, 3, outer_step=25, state_digest=b"y" * 32)], now=1.0)  # the winner's state
    assert m.step_of(m.get(pid)) == 25
    m.note_round(26, [pid])  # a round shared again afterwards counts again
    assert m.step_of(m.get(pid)) == 26


def test_under_ddp_a_new_digest_does_not_unsay_the_steps_a_peer_finished_with_us() -> None:
    """ddp (and NoLoCo) publish one model every few steps, so a peer's gossip lags the rounds it shares with us, and
    each publish brings a new digest. That is no other lineage: the hint stays. Cleared, it made the ddp leader leave
    the peer out of its next round (CI: the other peer trained 13 steps alone while it downloaded)."""
    a = b"a" * 32
    pid = _info(a, 1).peer_id
    for lineages, after in ((False, 3), (True, 0)):
        m = Membership(_info(b"m" * 32, 1), peer_timeout=5.0, settle_s=0.0)
        m.lineages = lineages
        m.merge([_info(a, 1, outer_step=0)], now=0.0)  # before its first publish
        m.note_round(3, [pid])
        m.merge([_info(a, 2, outer_step=0, state_digest=b"x" * 32)], now=0.5)  # its first publish, late
        assert m.step_of(m.get(pid)) == after
