"""Slow and faulty peers found from their timings (in the spirit of C4, arXiv 2406.04594), not from failed dials alone.

Every peer keeps, per other peer, what it measured itself: gossip round-trip time, the throughput of the streams that
peer sent to us, how late its contribution arrived in a round (the leader's rendezvous lag, the owners' stream
completion), and how much work it brought (tokens, for windowed runs). Peers are compared *within one round* (same
step, same conditions), so a busy machine or a slow model moves everyone and flags no one: a member is an outlier in
a round when its lag is more than `lag_ratio` (2) times the round's median and above an absolute floor that loopback
noise never reaches, or its throughput or tokens are less than the median over `ratio` (3). Rounds of fewer than three
members have no median and judge nobody.

A verdict needs `confirm` outlier rounds in a row and is lifted after `recover` normal rounds in a row, so one
hiccup flags no one and a peer that recovers is trusted again. `faulty` is a peer blamed for `confirm` failed rounds
in a row (timeouts, aborted streams) that it did not recover from with a success.

Each peer gossips its own verdicts in its signed entry (`slow`, `faulty`); the swarm treats a peer as flagged when a
strict majority of the other live peers report it (robust.majority_suspects), so one hostile peer cannot flag an honest
one. A flagged peer still contributes to rounds; it only stops leading rounds and owning shards until its timings
recover (peerd/roundclient.py, peerd/rendezvous.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from peerd.robust import majority_suspects
from peerd.v1 import peerd_pb2 as pb

SLOW, FAULTY = "slow", "faulty"
ID_CHARS = 16  # a gossiped verdict names a peer by the first 16 hex digits of its id (64 bits): 18 bytes, not 34
RATIO = 3.0  # an outlier brings this many times less work (or stream throughput) than the round's median
LAG_RATIO = 2.0  # ...or is this many times later than the median: all of a round's streams share the owners' links,
# so a peer on a 10x slower link arrives only ~2.5-3x later than the others (measured in netns, tests/test_uneven.py)
LAG_FLOOR_S = 0.5  # lags below this are never outliers: a loaded loopback machine jitters by tens of ms
CONFIRM = 2  # outlier rounds in a row before a verdict (the goal: flagged within 3 outer steps)
RECOVER = 3  # normal rounds in a row before a verdict is lifted
RTT_WINDOW = 8


@dataclass
class PeerStats:
    """What this peer measured of one other peer."""

    rtt: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))
    throughput: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))  # bytes/s of its streams to us
    lag: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_WINDOW))  # seconds behind the round's first
    outliers: int = 0  # outlier rounds in a row
    normal: int = 0  # normal rounds in a row
    failures: int = 0  # failed rounds in a row it was blamed for
    slow: bool = False
    faulty: bool = False
    why: str = ""
    kind: str = ""  # which measure flagged it: a round without that measure neither confirms nor lifts the verdict

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0


class PeerTimings:
    """Per-peer timing statistics and this peer's own slow/faulty verdicts (owned by the daemon loop)."""

    def __init__(
        self,
        self_id: str,
        ratio: float = RATIO,
        lag_ratio: float = LAG_RATIO,
        confirm: int = CONFIRM,
        recover: int = RECOVER,
    ) -> None:
        self.self_id = self_id
        self.ratio = ratio
        self.lag_ratio = lag_ratio
        self.confirm = confirm
        self.recover = recover
        self.peers: dict[str, PeerStats] = {}
        self._held_up: set[str] = set()  # peers whose contributions reached us late in the last round
        self.flag_events = 0  # verdicts given (a peer turning slow or faulty), for metrics

    def stats(self, peer_id: str) -> PeerStats:
        return self.peers.setdefault(peer_id, PeerStats())

    # -- samples ----------------------------------------------------------------------------------------------------
    def rtt(self, peer_id: str, seconds: float) -> None:
        """A control-plane round trip (a Gossip call) to `peer_id`."""
        if peer_id != self.self_id and seconds >= 0:
            self.stats(peer_id).rtt.append(seconds)

    def round(
        self,
        lag_s: Mapping[str, float] | None = None,
        throughput: Mapping[str, float] | None = None,
        tokens: Mapping[str, int] | None = None,
        stream_s: Mapping[str, float] | None = None,
        delivery_s: Mapping[str, float] | None = None,
        reply_s: Mapping[str, float] | None = None,
    ) -> list[str]:
        """One completed round's per-member measures (any subset): how late each member joined (`lag_s`), how late
        its contribution reached our shard (`delivery_s`) and its averaged shard reached us (`reply_s`), the
        throughput of its stream to us (and how long that stream took: throughput outliers count only for streams
        longer than LAG_FLOOR_S), the tokens behind it. Judges each member against the round's median.
        Returns the peers newly flagged slow."""
        judged: dict[str, tuple[str, str]] = {}  # pid -> (kind of measure, why)
        delivered = self._outliers(delivery_s or {}, high=True, floor=LAG_FLOOR_S, what="delivered")
        # Knock-on lateness is not slowness: a contribution that reached its owner late holds that owner's averaged
        # shard back (a late reply this round) and so everyone's start of the next round (late joins). While a late
        # sender is judged, the peers that waited on it are not judged on those two measures.
        excused = {"late": set(self._held_up), "replied": set(delivered)}
        self._held_up = set(delivered)
        for pid, why in self._outliers(lag_s or {}, high=True, floor=LAG_FLOOR_S, what="late").items():
            if not excused["late"] - {pid}:
                judged[pid] = ("late", why)
        for pid, why in delivered.items():
            judged.setdefault(pid, ("delivered", why))
        for pid, why in self._outliers(reply_s or {}, high=True, floor=LAG_FLOOR_S, what="replied").items():
            if not excused["replied"] - {pid}:
                judged.setdefault(pid, ("replied", why))
        for pid, why in self._outliers(throughput or {}, high=False, floor=0.0, what="throughput").items():
            # a slow stream matters (and is told apart from scheduling jitter) only when it took a while
            if (stream_s or {}).get(pid, LAG_FLOOR_S + 1) > LAG_FLOOR_S:
                judged.setdefault(pid, ("throughput", why))
        for pid, why in self._outliers({k: float(v) for k, v in (tokens or {}).items()}, False, 0.0, "tokens").items():
            judged.setdefault(pid, ("tokens", why))
        measured = {  # a measure excused this round is no evidence either way
            "late": set(lag_s or {}) if not excused["late"] else set(),
            "delivered": set(delivery_s or {}),
            "replied": set(reply_s or {}) if not excused["replied"] else set(),
            "throughput": set(throughput or {}),
            "tokens": set(tokens or {}),
        }
        members = set(lag_s or {}) | set(delivery_s or {}) | set(reply_s or {}) | set(throughput or {})
        members |= set(tokens or {})
        for pid, value in (lag_s or {}).items():
            self.stats(pid).lag.append(value)
        for pid, value in (throughput or {}).items():
            self.stats(pid).throughput.append(value)
        if len(members) < 3:
            return []
        flagged = []
        for pid in members - {self.self_id}:
            st = self.stats(pid)
            if pid in judged:
                st.outliers, st.normal = st.outliers + 1, 0
                if not st.slow and st.outliers >= self.confirm:
                    st.kind, st.why = judged[pid]
                    st.slow = True
                    self.flag_events += 1
                    flagged.append(pid)
            elif st.slow and pid not in measured.get(st.kind, set()):
                continue  # no evidence either way this round (a flagged owner sends no shard we could time)
            else:
                st.outliers, st.normal = 0, st.normal + 1
                if st.slow and st.normal >= self.recover:
                    st.slow, st.why, st.kind = False, "", ""
        return flagged

    def _outliers(self, values: Mapping[str, float], high: bool, floor: float, what: str) -> dict[str, str]:
        if len(values) < 3:
            return {}
        med = statistics.median(values.values())
        out = {}
        for pid, v in values.items():
            if high and v > floor and v > self.lag_ratio * med:
                out[pid] = f"{what} {v:.2f} vs median {med:.2f}"
            elif not high and med > 0 and v * self.ratio < med:
                out[pid] = f"{what} {v:.3g} vs median {med:.3g}"
        return out

    def failed(self, blamed: set[str]) -> list[str]:
        """A round failed naming `blamed`. Returns the peers newly flagged faulty."""
        flagged = []
        for pid in blamed - {self.self_id}:
            st = self.stats(pid)
            st.failures += 1
            if not st.faulty and st.failures >= self.confirm:
                st.faulty, st.why = True, f"blamed for {st.failures} failed rounds in a row"
                self.flag_events += 1
                flagged.append(pid)
        return flagged

    def succeeded(self, members: list[str]) -> None:
        """A round with these members completed: their failure streaks end, and faulty verdicts heal over time."""
        for pid in members:
            st = self.peers.get(pid)
            if st is None:
                continue
            st.failures = 0
            if st.faulty:
                st.normal += 1
                if st.normal >= self.recover:
                    st.faulty, st.why = False, ""

    # -- verdicts ---------------------------------------------------------------------------------------------------
    def verdicts(self, kind: str) -> list[str]:
        """The peers this peer itself judges `kind` (sorted; gossiped in its own entry)."""
        return sorted(pid for pid, st in self.peers.items() if getattr(st, kind))

    def forget(self, known: set[str]) -> None:
        """Drop peers gone from the membership table, so their stats and verdicts do not linger."""
        for pid in list(self.peers):
            if pid not in known:
                del self.peers[pid]


class SwarmTimings:
    """Our own verdicts (published in our entry) and the swarm's: peers a strict majority of the others flag."""

    def __init__(self, me: pb.PeerInfo) -> None:
        self.me = me
        self.local = PeerTimings(me.peer_id)
        self.flagged: dict[str, set[str]] = {SLOW: set(), FAULTY: set()}
        self.votes: dict[str, int] = {}  # peer -> how many live peers flag it (either kind), for status
        self.flagged_at: dict[str, int] = {}  # peer -> our outer step when the swarm first flagged it (benchmarks)

    def is_flagged(self, peer_id: str) -> bool:
        return peer_id in self.flagged[SLOW] or peer_id in self.flagged[FAULTY]

    def refresh(self, alive: list[pb.PeerInfo], step: int = 0, known: set[str] | None = None) -> list[str]:
        """Publish our verdicts in our entry and recompute the swarm's from the live entries. Returns one line per
        change worth logging (a peer flagged or cleared, and ourselves flagged). Stats are dropped only for peers
        gone from the table (`known`): a slow link delays gossip too, and forgetting a peer each time it looked
        silent for a moment reset its verdict again and again."""
        if known is not None:
            self.local.forget(known)
        for kind in (SLOW, FAULTY):
            mine = [pid[:ID_CHARS] for pid in self.local.verdicts(kind)]
            field_ = getattr(self.me, kind)
            if list(field_) != mine:
                del field_[:]
                field_.extend(mine)
        # verdicts name peers by prefix (ID_CHARS): back to whole ids for the peers we know
        full = {pid[:ID_CHARS]: pid for pid in (known or ())}
        full.update((p.peer_id[:ID_CHARS], p.peer_id) for p in (*alive, self.me))
        lines = []
        votes: dict[str, int] = {}
        for kind in (SLOW, FAULTY):
            views = {p.peer_id: [full.get(x, x) for x in getattr(p, kind)] for p in alive}
            views[self.me.peer_id] = [full.get(x, x) for x in getattr(self.me, kind)]
            kind_votes: dict[str, int] = {}
            for voter, view in views.items():
                for pid in set(view):
                    votes[pid] = votes.get(pid, 0) + 1
                    if pid != voter:
                        kind_votes[pid] = kind_votes.get(pid, 0) + 1
            # A new flag needs two voters besides its subject, not a majority of one. When the other peers left at
            # the end of a CI run, the slow-link peer (to which everyone looks slow: their data reaches it through
            # its own link) was the only voter left, and its word flagged a fast peer slow. A flag the swarm already
            # holds stays while a strict majority keeps it, however few peers are left.
            now = {pid for pid in majority_suspects(views) if pid in self.flagged[kind] or kind_votes.get(pid, 0) >= 2}
            for pid in sorted(now - self.flagged[kind]):
                self.flagged_at.setdefault(pid, step)
                who = "this peer" if pid == self.me.peer_id else f"peer {pid[:8]}"
                lines.append(f"{who} flagged {kind} by most of the swarm: no round leading or shard ownership for it")
            for pid in sorted(self.flagged[kind] - now):
                lines.append(f"peer {pid[:8]} no longer flagged {kind}: its timings recovered")
            self.flagged[kind] = now
        self.votes = votes
        return lines

    def flag_of(self, peer_id: str) -> str:
        """'slow', 'faulty' or '' for status lines."""
        return FAULTY if peer_id in self.flagged[FAULTY] else SLOW if peer_id in self.flagged[SLOW] else ""

    def may_be_sponsored(self, peer_id: str) -> bool:
        """Flagged slow and not faulty: only such a peer sends its work through a sponsor. A peer blamed for failed
        rounds keeps its contributions in plain view of the owners' screens, where bad data gets it banned."""
        return self.flag_of(peer_id) == SLOW


def join_offset_s(group: pb.Group, peer_id: str) -> float:
    """How much later than the group's median member `peer_id` joined its rendezvous (negative: earlier), from the
    leader's `join_lag_ms`. Overlapped windowed DiLoCo moves its next boundary by this much (peerd/diloco.py), so
    peers whose windows started apart, or drifted apart, meet the next round together."""
    ids = [m.peer_id for m in group.members]
    lags = list(group.join_lag_ms)
    if peer_id not in ids or len(lags) != len(ids):
        return 0.0
    return (lags[ids.index(peer_id)] - statistics.median(lags)) / 1000.0
