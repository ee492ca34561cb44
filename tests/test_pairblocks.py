"""PairBlocks (peerd/pairblocks.py) and its use by Membership: a failed dial followed by the same process's heartbeat
through others, confirmed by a fresh connection without answer and one more heartbeat, is a block; holds double; a
recheck that fails renews the hold without a "lost" verdict; a restart or an answered dial ends it. The swarm-level
behaviour is tests/test_nontransitive.py (network namespaces)."""

from __future__ import annotations

from collections.abc import Callable

from peerd.membership import Membership
from peerd.pairblocks import HOLD_MAX_S, HOLD_S, MEMORY_S, PairBlocks, named_by_anyone
from peerd.v1 import peerd_pb2 as pb

B = "b" * 64


def _block(blocks: PairBlocks, peer: str, now: float) -> None:
    """Evidence, two beats through others, a confirming connection without answer, one more beat: a block at `now`."""
    blocks.dial_failed(peer, now - 0.3, heartbeat=1)
    blocks.advanced(peer, now - 0.2, 2.0, heartbeat=3)
    blocks.check_failed(peer, now - 0.1, heartbeat=3)
    blocks.advanced(peer, now, 2.0, heartbeat=4)
    assert blocks.blocked(peer, now)


def test_a_failed_dial_a_heartbeat_through_others_and_a_failed_check_are_a_block() -> None:
    blocks = PairBlocks()
    assert not blocks.dial_failed(B, 100.0, heartbeat=7)  # an ordinary failure first: the caller marks it unreachable
    blocks.advanced(B, 100.5, peer_timeout=2.0, heartbeat=8)  # maybe in flight before the failure: not yet
    assert not blocks.blocked(B, 100.5) and blocks.drain_checks() == []
    blocks.advanced(B, 101.0, peer_timeout=2.0, heartbeat=9)  # a suspect: a fresh connection is asked for
    assert not blocks.blocked(B, 101.0) and blocks.drain_checks() == [B] and blocks.drain_checks() == []
    assert not blocks.dial_failed(B, 101.2, heartbeat=9)  # a gRPC failure meanwhile is not the check
    blocks.advanced(B, 101.4, peer_timeout=2.0, heartbeat=10)
    assert not blocks.blocked(B, 101.4)
    assert not blocks.check_failed(B, 101.5, heartbeat=10)  # the check got no answer either
    blocks.advanced(B, 101.6, peer_timeout=2.0, heartbeat=10)  # no newer beat yet
    assert not blocks.blocked(B, 101.6)
    blocks.advanced(B, 102.0, peer_timeout=2.0, heartbeat=11)  # live after it: live, but not to us
    assert blocks.blocked(B, 102.0) and blocks.blocked(B, 102.0 + HOLD_S - 0.1)
    assert not blocks.blocked(B, 102.0 + HOLD_S)
    assert blocks.drain_news() == [(B, HOLD_S)] and blocks.drain_news() == []
    assert blocks.named([B, "c" * 64], 103.0) == [B[:16]]


def test_a_check_that_connects_or_is_refused_clears_the_suspect() -> None:
    """64 peers on 2 cores: gRPC dials of a starved peer timed out while its heartbeats came through others, and it
    was blocked; its kernel still answers a handshake. A dead process's host refuses one: no block either."""
    blocks = PairBlocks()
    blocks.dial_failed(B, 0.0, heartbeat=1)
    blocks.advanced(B, 0.5, 2.0, heartbeat=3)
    assert blocks.drain_checks() == [B]
    blocks.reached(B)  # the handshake was answered (or refused)
    blocks.advanced(B, 1.0, 2.0, heartbeat=9)
    assert not blocks.blocked(B, 1.0) and blocks.drain_checks() == []


def test_a_suspect_that_falls_silent_after_the_check_is_no_block() -> None:
    """A killed peer's last heartbeats may reach us through others after our dial failed; then they stop."""
    blocks = PairBlocks()
    blocks.dial_failed(B, 0.0, heartbeat=1)
    blocks.advanced(B, 0.5, 2.0, heartbeat=3)
    blocks.check_failed(B, 5.5, heartbeat=3)
    blocks.advanced(B, 5.6, 2.0, heartbeat=3)  # the same beat again: nothing newer
    blocks.advanced(B, 8.0, 2.0, heartbeat=4)  # a beat long after the check: too late to say anything
    assert not blocks.blocked(B, 8.0)


def test_a_fresh_connection_without_answer_needs_no_second_one() -> None:
    """A route check (a call hung on an open connection, then a new connection got no answer) is the fresh dial
    itself: two beats through others after it make a block, as fast as before the confirmation (about 8 s)."""
    blocks = PairBlocks()
    assert not blocks.check_failed(B, 0.0, heartbeat=5)  # not a suspect: evidence, a fresh connection's
    blocks.advanced(B, 0.5, 2.0, heartbeat=7)
    assert blocks.blocked(B, 0.5) and blocks.drain_checks() == []


def test_a_heartbeat_long_after_the_failure_is_no_block() -> None:
    blocks = PairBlocks()
    blocks.dial_failed(B, 100.0)
    blocks.advanced(B, 103.0, peer_timeout=2.0)  # it was dead for a while and came back: not evidence of a block
    assert not blocks.blocked(B, 103.0) and blocks.drain_checks() == []


def test_a_failed_recheck_renews_the_hold_doubled_and_an_answer_ends_it() -> None:
    blocks = PairBlocks()
    _block(blocks, B, 1.0)
    end = 1.0 + HOLD_S
    assert blocks.dial_failed(B, end - 1)  # inside the hold: accounted for, no new hold
    assert blocks.dial_failed(B, end + 1)  # the recheck failed: a longer hold at once
    assert blocks.blocked(B, end + 1 + 2 * HOLD_S - 0.1) and not blocks.blocked(B, end + 1 + 2 * HOLD_S)
    for _ in range(10):
        blocks.dial_failed(B, 10_000.0)
        blocks.advanced(B, 10_000.5, 2.0)
        blocks.reached("other")
    assert blocks.drain_news()[-1][1] <= HOLD_MAX_S
    blocks.reached(B)
    assert not blocks.blocked(B, 10_001.0)
    assert not blocks.dial_failed(B, 10_001.0)  # an ordinary failure again


def test_a_block_long_over_is_forgotten() -> None:
    blocks = PairBlocks()
    _block(blocks, B, 1.0)
    assert not blocks.dial_failed(B, 1.0 + HOLD_S + MEMORY_S + 1)


def test_named_by_anyone_reads_prefixes_from_every_voter() -> None:
    a, b, c = pb.PeerInfo(peer_id="a" * 64), pb.PeerInfo(peer_id=B), pb.PeerInfo(peer_id="c" * 64)
    voter = pb.PeerInfo(peer_id="d" * 64, unreachable=[B[:16]])
    assert named_by_anyone([a, b, c], [a, voter]) == {B}
    assert named_by_anyone([a, b, c], [a, c]) == set()


def test_membership_keeps_a_blocked_peer_live_and_names_it() -> None:
    from peerd.identity import Identity

    ident = Identity.generate()
    b = ident.peer_id
    me = pb.PeerInfo(peer_id="0" * 64, address="10.0.0.1:1")
    m = Membership(me, peer_timeout=2.0)  # unsigned table: merge checks only that ids match keys

    def beat(n: int, now: float, incarnation: int = 1) -> None:
        info = pb.PeerInfo(peer_id=b, public_key=ident.public_key, address="10.0.0.2:1", heartbeat=n)
        info.incarnation = incarnation
        m.merge([info], now=now)

    beat(1, 0.0)
    m.mark_unreachable(b, now=0.5, why="gossip UNAVAILABLE", dial="no_answer")
    assert not m.is_alive(b, now=0.6)  # one failed dial: unreachable, as before
    beat(2, 0.65)  # one beat may have been on its way when the dial failed: no block yet
    assert not m.cannot_dial(b, now=0.66)
    beat(3, 0.7)  # others carried a newer one: a suspect, whose route a fresh connection checks
    assert m.blocks.drain_checks() == [b] and not m.cannot_dial(b, now=0.7)
    m.no_answer(b, now=0.75, fresh=True)  # no answer
    beat(4, 0.78)  # live after that: live, but not to us
    assert m.is_alive(b, now=0.8) and m.cannot_dial(b, now=0.8)
    m.mark_unreachable(b, now=1.0, why="rendezvous: no connection", dial="no_answer")
    assert m.is_alive(b, now=1.1)  # a dial that the block explains does not make it dead
    assert m.publish_unreachable(now=1.2) and list(m.me.unreachable) == [b[:16]]
    assert not m.publish_unreachable(now=1.3)
    assert m.named_unreachable([pb.PeerInfo(peer_id=b)], now=1.3) == {b}
    m.mark_unreachable(b, now=1.4, why="banned")
    assert not m.is_alive(b, now=1.5)  # other evidence still does
    beat(1, 1.6, incarnation=2)  # a restart: the process we could not dial is gone
    assert m.is_alive(b, now=1.7) and not m.cannot_dial(b, now=1.7)


def _table() -> tuple[Membership, str, Callable[[int, float], None]]:
    """An unsigned table (merge checks only that ids match keys) and a way to bring it peer b's heartbeat `n`."""
    from peerd.identity import Identity

    ident = Identity.generate()
    b = ident.peer_id
    m = Membership(pb.PeerInfo(peer_id="0" * 64, address="10.0.0.1:1"), peer_timeout=2.0)

    def beat(n: int, now: float) -> None:
        m.merge([pb.PeerInfo(peer_id=b, public_key=ident.public_key, address="10.0.0.2:1", heartbeat=n)], now=now)

    return m, b, beat


def test_a_refused_dial_is_no_evidence_of_a_block_and_ends_one() -> None:
    """A killed peer's port refuses; its restarted process then gossips through others. That is a restart, not a
    route broken between us (the chaos test's restarted peer was once taken for one, and led no round for 30 s)."""
    m, b, beat = _table()
    beat(1, 0.0)
    m.mark_unreachable(b, now=0.5, why="round dial failed", dial="refused")
    beat(3, 0.7)
    assert m.is_alive(b, now=0.8) and not m.cannot_dial(b, now=0.8)
    m.mark_unreachable(b, now=1.0, why="gossip UNAVAILABLE", dial="no_answer")
    beat(5, 1.1)
    m.no_answer(b, now=1.15, fresh=True)
    beat(6, 1.2)
    assert m.cannot_dial(b, now=1.3)
    m.mark_unreachable(b, now=1.4, why="gossip UNAVAILABLE", dial="refused")  # its host answers: the route works
    assert not m.cannot_dial(b, now=1.5) and not m.is_alive(b, now=1.5)


def test_turned_away_tells_a_turned_away_dial_from_one_without_answer() -> None:
    import grpc

    from peerd.channels import turned_away

    def err(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, None, None, details=details)  # type: ignore[arg-type]

    last = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.77.0.1:7000: "
    assert turned_away(err(grpc.StatusCode.UNAVAILABLE, last + "Failed to connect to remote host: Connection refused"))
    assert turned_away(err(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer"))
    assert not turned_away(err(grpc.StatusCode.UNAVAILABLE, last + "Timeout occurred: FD Shutdown"))
    assert not turned_away(err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert turned_away(ConnectionRefusedError()) and not turned_away(TimeoutError())


def test_status_shows_who_cannot_dial_whom() -> None:
    from peerd.status import format_status

    a, b = "a" * 64, "b" * 64
    st = pb.StatusResponse(
        peer_id=a,
        peers=[
            pb.PeerInfo(peer_id=a, address="10.0.0.1:7000", unreachable=[b[:16]]),
            pb.PeerInfo(peer_id=b, address="10.0.0.2:7000"),
        ],
        alive=[a, b],
    )
    lines = format_status(st).splitlines()
    assert any(line.strip().startswith(b[:16]) and "UNDIALABLE from aaaaaaaa" in line for line in lines), lines
    assert not any(line.strip().startswith(a[:16]) and "UNDIALABLE" in line for line in lines)


def test_no_answer_from_a_peer_silent_to_us_too_is_no_evidence() -> None:
    """Across a split the other side is silent to us and our dials get no answer; its heartbeats come back at the
    heal. That is no block: only a peer others still carry to us while we cannot reach it is one."""
    m, b, beat = _table()
    beat(1, 0.0)
    m.no_answer(b, now=5.0)  # silent for 5 s: a route check during the split
    m.mark_unreachable(b, now=5.5, why="gossip DEADLINE_EXCEEDED", dial="no_answer")
    beat(9, 6.0)  # the heal
    assert m.is_alive(b, now=6.1) and not m.cannot_dial(b, now=6.1)
    m.no_answer(b, now=6.5)  # heard a moment ago: evidence now
    beat(11, 7.0)
    m.no_answer(b, now=7.05, fresh=True)
    beat(12, 7.1)
    assert m.cannot_dial(b, now=7.1)


def test_a_round_owner_without_answer_is_no_refusal() -> None:
    """A round's exchange with an owner across a broken route fails UNAVAILABLE, as a refused one does: the round
    moves the shard on (OwnerLost) either way, but only a refusal ends a pair block. Taking both for refusals ended the
    block at every round, and a streaming run's blocked pair sat out all 79 rounds (CI)."""
    import grpc

    from peerd.channels import dial_failure
    from peerd.roundtypes import OwnerLost

    def lost(details: str) -> OwnerLost:
        try:
            try:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details=details)  # type: ignore[arg-type]
            except grpc.aio.AioRpcError as exc:
                raise OwnerLost("exchange failed", {"x"}, "peer_lost") from exc
        except OwnerLost as owner_lost:
            return owner_lost

    no_answer = "failed to connect to all addresses; Timeout occurred: FD Shutdown"
    assert dial_failure(lost(no_answer).__cause__) == "no_answer"
    assert dial_failure(lost("Connection refused").__cause__) == "refused"
    assert dial_failure(None) == "no_answer"
