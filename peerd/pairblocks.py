"""Reachability that is not transitive: live peers this peer cannot dial, though the rest of the swarm hears them.

A broken route between two networks, a firewall rule or two NATs leave peers A and B each reachable by everyone but
not by each other. Without this record, A took B for dead at each failed dial and for live again at B's next
heartbeat (gossiped through the others), so B kept leading rounds and owning shards that A could not reach, and the
rounds stalled or went partial for as long as the route stayed broken.

A dial of ours that fails, followed within `peer_timeout` by a heartbeat of the same process that others carried to
us, makes the peer a suspect. A fresh TCP connection then confirms it (Reachability.confirm_route), unless the failed
dial was one already: a kernel answers a handshake for a process too starved to answer gRPC, and a host whose process
died refuses, so either clears the suspect. One with no answer, followed by one more heartbeat through others, is a
*block*: the peer is live, only not to us. (Without the confirmation, 64 peers on 2 cores blocked 2-3 live but
starved peers per 3 minutes, on gRPC dials that timed out.)

A blocked peer stays live in our table, we stop dialling it for a hold (30 s, doubling on each repeat up to 300 s)
and name it in our own signed entry (`PeerInfo.unreachable`). Every peer then leaves out of leading rounds and
owning shards any member that a live peer names (peerd/roundclient.py, peerd/rendezvous.py): members that own no
shard stream only to owners, so no round needs the broken pair's link.
After the hold the next dial is a recheck; it fails into a longer hold, or succeeds and ends the block.
"""

from __future__ import annotations

from collections.abc import Iterable

from peerd.v1 import peerd_pb2 as pb

HOLD_S = 30.0  # the first block of a peer lasts this long before a dial rechecks it
HOLD_MAX_S = 300.0  # holds double on each repeat up to this
MEMORY_S = 600.0  # a dial that fails this soon after a block ended renews it at once, without a "lost" verdict first
MAX_NAMED = 8  # peers named in our entry at most (every gossip message carries it)
# A fresh TCP connection gets this long to be answered (Reachability: route checks and confirmations). A kernel
# answers a handshake within a round trip even for a starved process, and a lost SYN is resent after 1 s; at 5 s a
# NoLoCo pair that could not reach each other took 9 solo steps in 40 rather than 3-4 while the check ran.
CHECK_S = 2.0
ID_CHARS = 16  # named by the first 16 hex digits of their ids, as timing verdicts are (peerd/timings.py)


class PairBlocks:
    """Which live peers this peer cannot dial, from its own failed dials and the heartbeats that followed them."""

    def __init__(self) -> None:
        # peer -> (when our dial failed, its heartbeat then, whether that dial was a fresh TCP connection)
        self._failed_at: dict[str, tuple[float, int, bool]] = {}
        self._suspect: dict[str, float] = {}  # peer -> when its heartbeat moved on after the failure (a check asked)
        self._confirmed: dict[str, tuple[float, int]] = {}  # peer -> (when the check got no answer, its heartbeat)
        self.checks: list[str] = []  # suspects whose route a fresh connection should check (drain_checks)
        self._until: dict[str, float] = {}  # peer -> end of its current (or last) hold
        self._count: dict[str, int] = {}  # peer -> holds in a row
        self.news: list[tuple[str, float]] = []  # (peer, hold) of blocks that started, for one log line each

    def dial_failed(self, peer_id: str, now: float, heartbeat: int = 0, fresh: bool = False) -> bool:
        """Our dial of `peer_id` (whose heartbeat we knew as `heartbeat`) got no answer. True when a block accounts
        for it (the peer stays live): one in force, or one that ended recently (the recheck failed: a longer hold
        starts). False: an ordinary failed dial, kept as evidence. `fresh`: the dial was a new TCP connection (a
        route check), which needs no confirming one."""
        until = self._until.get(peer_id)
        if until is not None and now < until:
            return True
        if until is not None and now - until < MEMORY_S:
            self._start(peer_id, now)
            return True
        if peer_id not in self._suspect and peer_id not in self._confirmed:  # a check is what counts now
            self._failed_at[peer_id] = (now, heartbeat, fresh)
        return False

    def check_failed(self, peer_id: str, now: float, heartbeat: int = 0) -> bool:
        """A fresh TCP connection to `peer_id` got no answer. For a suspect, that confirms the failure: one more
        heartbeat through others makes it a block. Otherwise it is a failed dial like any other."""
        if self._suspect.pop(peer_id, None) is not None:
            self._confirmed[peer_id] = (now, heartbeat)
            return False
        return self.dial_failed(peer_id, now, heartbeat, fresh=True)

    def advanced(self, peer_id: str, now: float, peer_timeout: float, heartbeat: int = 1 << 62) -> None:
        """The same process's heartbeat advanced to `heartbeat` (others carried it). After a dial of ours that
        failed within `peer_timeout` before now, with the heartbeat two or more beats past the one we knew then, the
        peer is a suspect whose route gets a fresh check (blocked at once if that dial was a fresh connection). After
        a check that got no answer, any newer beat makes it a block. Two beats: one may have been on its way to us
        when a split or a cut began."""
        confirmed = self._confirmed.get(peer_id)
        if confirmed is not None:
            if now - confirmed[0] >= peer_timeout:
                del self._confirmed[peer_id]  # it went silent after the check: dead, or behind a split
            elif heartbeat > confirmed[1]:
                self._start(peer_id, now)
            return
        asked = self._suspect.get(peer_id)
        if asked is not None:
            if now - asked >= peer_timeout + CHECK_S:
                del self._suspect[peer_id]  # the check never came back
            return
        failed = self._failed_at.get(peer_id)
        if failed is None:
            return
        if now - failed[0] >= peer_timeout:
            del self._failed_at[peer_id]  # too old to say anything about now
        elif heartbeat >= failed[1] + 2 and failed[2]:
            self._start(peer_id, now)  # the failed dial was a fresh connection already
        elif heartbeat >= failed[1] + 2:
            del self._failed_at[peer_id]
            self._suspect[peer_id] = now
            self.checks.append(peer_id)

    def _start(self, peer_id: str, now: float) -> None:
        count = self._count.get(peer_id, 0) + 1
        hold = min(HOLD_MAX_S, HOLD_S * 2 ** (count - 1))
        self._count[peer_id] = count
        self._until[peer_id] = now + hold
        self._failed_at.pop(peer_id, None)
        self._confirmed.pop(peer_id, None)
        self.news.append((peer_id, hold))

    def reached(self, peer_id: str) -> None:
        """A dial of ours answered (or its host refused it: the route works), or the peer is another process now (a
        restart, a new address): no block, and no suspicion."""
        self._failed_at.pop(peer_id, None)
        self._suspect.pop(peer_id, None)
        self._confirmed.pop(peer_id, None)
        self._until.pop(peer_id, None)
        self._count.pop(peer_id, None)

    def blocked(self, peer_id: str, now: float) -> bool:
        """We cannot dial `peer_id` now (a hold in force): do not try, and do not count it dead for that."""
        return now < self._until.get(peer_id, 0.0)

    def named(self, alive_ids: Iterable[str], now: float) -> list[str]:
        """What our entry's `unreachable` says: the live peers under a hold, by id prefix, at most MAX_NAMED."""
        return sorted(pid[:ID_CHARS] for pid in alive_ids if self.blocked(pid, now))[:MAX_NAMED]

    def drain_news(self) -> list[tuple[str, float]]:
        out, self.news = self.news, []
        return out

    def drain_checks(self) -> list[str]:
        out, self.checks = self.checks, []
        return out


def named_by_anyone(members: Iterable[pb.PeerInfo], voters: Iterable[pb.PeerInfo]) -> set[str]:
    """The ids of `members` that any of `voters` (live entries, ours included) names in its `unreachable`: they may
    neither lead rounds nor own shards, since some peer could not reach them there."""
    named = {x for v in voters for x in v.unreachable}
    return {m.peer_id for m in members if m.peer_id[:ID_CHARS] in named}
