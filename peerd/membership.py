"""The swarm as one peer sees it: a peer table kept by push-pull gossip, with heartbeat-based failure detection.

There is no central server. Each peer bumps its own heartbeat counter; gossip carries every entry to every peer, and
the highest (incarnation, heartbeat) wins. A peer whose heartbeat has not advanced for `peer_timeout` seconds of local
time is considered dead; a peer that announced Leave is kept as a tombstone so stale gossip cannot revive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from peerd.identity import peer_id_of
from peerd.v1 import peerd_pb2 as pb

MAX_PEERS = 4096  # a gossip message with more entries than this is refused rather than stored


@dataclass
class Entry:
    info: pb.PeerInfo
    last_advance: float  # local monotonic time at which the heartbeat last advanced
    first_seen: float
    unreachable_until: float = 0.0  # set when we failed to dial it; cleared when its heartbeat advances again


class Membership:
    def __init__(self, self_info: pb.PeerInfo, peer_timeout: float, settle_s: float = 3.0) -> None:
        self.me = self_info
        self.peer_timeout = peer_timeout
        self.settle_s = settle_s
        self.entries: dict[str, Entry] = {}
        # Peers we refuse to count as live although their heartbeat advances: banned by us, or reported banned by a
        # majority of the swarm (peerd/robust.py). Set by the daemon.
        self.excluded: Callable[[str], bool] = lambda peer_id: False

    @property
    def self_id(self) -> str:
        return self.me.peer_id

    def bump(self) -> None:
        """Advance our own heartbeat; called once per gossip interval."""
        self.me.heartbeat += 1

    def merge(self, infos: Iterable[pb.PeerInfo], now: float | None = None) -> list[str]:
        """Fold gossiped entries into the table; returns ids of peers we had never seen."""
        now = time.monotonic() if now is None else now
        new: list[str] = []
        for info in infos:
            pid = info.peer_id
            if pid == self.me.peer_id or len(info.public_key) != 32 or peer_id_of(info.public_key) != pid:
                continue  # never let gossip overwrite our own entry, and ignore entries whose id is not their key's
            cur = self.entries.get(pid)
            if cur is None:
                if len(self.entries) >= MAX_PEERS:
                    continue
                self.entries[pid] = Entry(_copy(info), now, now)
                new.append(pid)
            elif (info.incarnation, info.heartbeat) > (cur.info.incarnation, cur.info.heartbeat):
                cur.info = _copy(info)
                cur.last_advance = now
                cur.unreachable_until = 0.0
        return new

    def mark_unreachable(self, peer_id: str, now: float | None = None) -> None:
        """We could not dial this peer: treat it as dead until its heartbeat advances again."""
        now = time.monotonic() if now is None else now
        entry = self.entries.get(peer_id)
        if entry is not None:
            entry.unreachable_until = now + self.peer_timeout

    def mark_left(self, info: pb.PeerInfo, now: float | None = None) -> None:
        """A signed Leave: keep the peer as a tombstone (with its final heartbeat) so gossip spreads the leave and
        stale entries cannot revive it."""
        now = time.monotonic() if now is None else now
        entry = self.entries.get(info.peer_id)
        if entry is not None and info.public_key == entry.info.public_key:
            entry.info.left = True
            if (info.incarnation, info.heartbeat) > (entry.info.incarnation, entry.info.heartbeat):
                entry.info.incarnation, entry.info.heartbeat = info.incarnation, info.heartbeat
            entry.last_advance = now

    def is_alive(self, peer_id: str, now: float | None = None) -> bool:
        if peer_id == self.me.peer_id:
            return True
        now = time.monotonic() if now is None else now
        e = self.entries.get(peer_id)
        return (
            e is not None
            and not e.info.left
            and now - e.last_advance < self.peer_timeout
            and now >= e.unreachable_until
            and not self.excluded(peer_id)
        )

    def alive(self, now: float | None = None, include_self: bool = True) -> list[pb.PeerInfo]:
        """Live peers, sorted by peer id (ourselves included unless asked not to)."""
        now = time.monotonic() if now is None else now
        out = [e.info for pid, e in self.entries.items() if self.is_alive(pid, now)]
        if include_self:
            out.append(self.me)
        return sorted(out, key=lambda p: p.peer_id)

    def settled(self, now: float | None = None) -> list[pb.PeerInfo]:
        """Live peers known for at least `settle_s`: round leaders are picked among these, so a peer that only just
        joined (and that some peers may not know yet) cannot split a round into two groups."""
        now = time.monotonic() if now is None else now
        out = [
            e.info for pid, e in self.entries.items() if self.is_alive(pid, now) and now - e.first_seen >= self.settle_s
        ]
        out.append(self.me)
        return sorted(out, key=lambda p: p.peer_id)

    def at_address(self, address: str) -> pb.PeerInfo | None:
        """The live peer gossip says listens at `address` (the freshest one if several claim it)."""
        found = [e for e in self.entries.values() if e.info.address == address and not e.info.left]
        return max(found, key=lambda e: e.last_advance).info if found else None

    def get(self, peer_id: str) -> pb.PeerInfo | None:
        if peer_id == self.me.peer_id:
            return self.me
        e = self.entries.get(peer_id)
        return e.info if e else None

    def gossip_view(self, now: float | None = None) -> list[pb.PeerInfo]:
        """What we tell others: ourselves, live peers, and recent tombstones (so leaves spread)."""
        now = time.monotonic() if now is None else now
        out = [self.me]
        for e in self.entries.values():
            age = now - e.last_advance
            if age < self.peer_timeout or (e.info.left and age < 3 * self.peer_timeout):
                out.append(e.info)
        return out

    def prune(self, now: float | None = None) -> list[str]:
        """Forget peers silent for 3x the timeout; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [pid for pid, e in self.entries.items() if now - e.last_advance > 3 * self.peer_timeout]
        for pid in gone:
            del self.entries[pid]
        return gone


def _copy(info: pb.PeerInfo) -> pb.PeerInfo:
    out = pb.PeerInfo()
    out.CopyFrom(info)
    return out
