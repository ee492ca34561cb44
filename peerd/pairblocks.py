"""Reachability that is not transitive: live peers this peer cannot dial, though the rest of the swarm hears them.

A broken route between two networks, a firewall rule or two NATs leave peers A and B each reachable by everyone but
not by each other. Without this record, A took B for dead at each failed dial and for live again at B's next
heartbeat (gossiped through the others), so B kept leading rounds and owning shards that A could not reach, and the
rounds stalled or went partial for as long as the route stayed broken.

A dial of ours that fails, followed within `peer_timeout` by a heartbeat of the same process that others carried to
us, is a *block*: the peer is live, only not to us. It stays live in our table, we stop dialling it for a hold (30 s,
doubling on each repeat up to 300 s) and name it in our own signed entry (`PeerInfo.unreachable`). Every peer then
leaves out of leading rounds and owning shards any member that a live peer names (peerd/roundclient.py,
peerd/rendezvous.py): members that own no shard stream only to owners, so no round needs the broken pair's link.
After the hold the next dial is a recheck; it fails into a longer hold, or succeeds and ends the block.
"""

from __future__ import annotations

from collections.abc import Iterable

from peerd.v1 import peerd_pb2 as pb

HOLD_S = 30.0  # the first block of a peer lasts this long before a dial rechecks it
HOLD_MAX_S = 300.0  # holds double on each repeat up to this
MEMORY_S = 600.0  # a dial that fails this soon after a block ended renews it at once, without a "lost" verdict first
MAX_NAMED = 8  # peers named in our entry at most (every gossip message carries it)
ID_CHARS = 16  # named by the first 16 hex digits of their ids, as timing verdicts are (peerd/timings.py)


class PairBlocks:
    """Which live peers this peer cannot dial, from its own failed dials and the heartbeats that followed them."""

    def __init__(self) -> None:
        self._failed_at: dict[str, tuple[float, int]] = {}  # peer -> (when our dial failed, its heartbeat then)
        self._until: dict[str, float] = {}  # peer -> end of its current (or last) hold
        self._count: dict[str, int] = {}  # peer -> holds in a row
        self.news: list[tuple[str, float]] = []  # (peer, hold) of blocks that started, for one log line each

    def dial_failed(self, peer_id: str, now: float, heartbeat: int = 0) -> bool:
        """Our dial of `peer_id` (whose heartbeat we knew as `heartbeat`) got no answer. True when a block accounts
        for it (the peer stays live): one in force, or one that ended recently (the recheck failed: a longer hold
        starts). False: an ordinary failed dial, kept as evidence."""
        until = self._until.get(peer_id)
        if until is not None and now < until:
            return True
        if until is not None and now - until < MEMORY_S:
            self._start(peer_id, now)
            return True
        self._failed_at[peer_id] = (now, heartbeat)
        return False

    def advanced(self, peer_id: str, now: float, peer_timeout: float, heartbeat: int = 1 << 62) -> None:
        """The same process's heartbeat advanced to `heartbeat` (others carried it): a dial of ours that failed
        within `peer_timeout` before now, with the heartbeat two or more beats past the one we knew then, means it
        is live but not to us. Two beats: one may have been on its way to us when a split or a cut began."""
        failed = self._failed_at.get(peer_id)
        if failed is None:
            return
        if now - failed[0] >= peer_timeout:
            del self._failed_at[peer_id]  # too old to say anything about now
        elif heartbeat >= failed[1] + 2:
            self._start(peer_id, now)

    def _start(self, peer_id: str, now: float) -> None:
        count = self._count.get(peer_id, 0) + 1
        hold = min(HOLD_MAX_S, HOLD_S * 2 ** (count - 1))
        self._count[peer_id] = count
        self._until[peer_id] = now + hold
        self._failed_at.pop(peer_id, None)
        self.news.append((peer_id, hold))

    def reached(self, peer_id: str) -> None:
        """A dial of ours answered, or the peer is another process now (a restart, a new address): no block."""
        self._failed_at.pop(peer_id, None)
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


def named_by_anyone(members: Iterable[pb.PeerInfo], voters: Iterable[pb.PeerInfo]) -> set[str]:
    """The ids of `members` that any of `voters` (live entries, ours included) names in its `unreachable`: they may
    neither lead rounds nor own shards, since some peer could not reach them there."""
    named = {x for v in voters for x in v.unreachable}
    return {m.peer_id for m in members if m.peer_id[:ID_CHARS] in named}
