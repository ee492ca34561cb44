"""The swarm as one peer sees it: a peer table kept by push-pull gossip, with heartbeat-based failure detection.

There is no central server. Each peer bumps its own heartbeat counter; gossip carries every entry to every peer, and
the highest (incarnation, heartbeat) wins. A peer whose heartbeat has not advanced for `peer_timeout` seconds of local
time is considered dead; a peer that announced Leave is kept as a tombstone so stale gossip cannot revive it.

Three rules keep one model whatever the network does (ARCHITECTURE.md, "One model"):
- Entries are signed by the peer they describe, so gossip relayed through others cannot be forged or altered.
- Dead is not forgotten: a dead entry stays in the table (it is no longer gossiped) and peerd/redial.py keeps dialling
  it with backoff, so the two halves of a split find each other again with nobody's help.
- The run is judged against every peer seen live within `forget_after`, not against the shrunken live set.

The table is owned by the daemon's event loop: only coroutines and callbacks on that loop call the methods below.
Other threads read the immutable `View` published by `snapshot()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from peerd.beats import BeatChain, hash_up, hashes_to
from peerd.identity import peer_id_of, verify
from peerd.pairblocks import PairBlocks, named_by_anyone
from peerd.v1 import peerd_pb2 as pb

MAX_PEERS = 4096  # a gossip message with more entries than this is refused rather than stored
ENTRY_DOMAIN = b"peerd/peerinfo/v1"
CHAINED_DOMAIN = b"peerd/peerinfo/v2"  # an entry whose heartbeat a hash chain proves (peerd/beats.py)


def entry_bytes(info: pb.PeerInfo, run_id: bytes, anchor: bytes = b"") -> bytes:
    """What a peer signs about itself: its entry with the signature cleared, bound to the run. With a heartbeat chain
    (`beat_proof` set; peerd/beats.py) the heartbeat and its proof are left out, and the chain's `anchor` goes in."""
    body = pb.PeerInfo()
    body.CopyFrom(info)
    body.ClearField("signature")
    if not info.beat_proof:
        return ENTRY_DOMAIN + run_id + body.SerializeToString(deterministic=True)
    body.ClearField("heartbeat")
    body.ClearField("beat_proof")
    return CHAINED_DOMAIN + run_id + anchor + body.SerializeToString(deterministic=True)


def sign_entry(info: pb.PeerInfo, run_id: bytes, sign: Callable[[bytes], bytes]) -> pb.PeerInfo:
    """Sign `info` in place as its own subject, without a heartbeat chain (our own entry: `Membership.signed_self`)."""
    info.signature = sign(entry_bytes(info, run_id))
    return info


def anchor_of(info: pb.PeerInfo) -> bytes | None:
    """The chain top an entry's proof stands for (b"" for an entry without a chain; None for a proof that cannot be
    one: wrong size, or a heartbeat before its base or too far past it)."""
    if not info.beat_proof:
        return b""
    return hash_up(info.beat_proof, info.heartbeat - info.beat_base)


@dataclass
class Entry:
    info: pb.PeerInfo
    last_advance: float  # local monotonic time at which the heartbeat last advanced
    first_seen: float
    unreachable_until: float = 0.0  # set when we failed to dial it; cleared when its heartbeat advances again
    step_hint: int = -1  # outer step we know it finished (it was in our round), ahead of its gossip
    last_sent: float = 0.0  # when we last put it in a gossip message (bounded messages go round-robin)
    last_probed: float = 0.0  # when we last dialled it because its entry was about to expire
    probes: int = 0  # direct probes since its heartbeat last advanced (the "lost" line says how many, and how)
    probe_result: str = ""  # how the last one ended: "answered", a gRPC status name, or "" while it runs
    body: bytes = b""  # the signed body of `info` as checked (entry_bytes): a later heartbeat of it needs only a hash
    anchor: bytes = b""  # its heartbeat chain's top, as its proof gave it
    unreachable_why: str = ""  # what marked it unreachable last (for the "lost" line)


@dataclass(frozen=True)
class View:
    """An immutable copy of the table for threads other than the event loop (metrics, progress, status)."""

    alive: tuple[pb.PeerInfo, ...]
    known: int
    expected: tuple[str, ...]


class Membership:
    def __init__(
        self,
        self_info: pb.PeerInfo,
        peer_timeout: float,
        settle_s: float = 3.0,
        *,
        run_id: bytes = b"",
        sign: Callable[[bytes], bytes] | None = None,
        forget_after: float = 300.0,
    ) -> None:
        self.me = self_info
        self.peer_timeout = peer_timeout
        self.settle_s = settle_s
        self.run_id = run_id
        self.forget_after = forget_after
        # Does a new state digest mean another lineage? Only where states are ranked (DiLoCo, Streaming: set by the
        # daemon). Under ddp and NoLoCo the digest changes with every publish of one model (step hints below).
        self.lineages = True
        self._sign = sign
        self._signed_body = b""
        self._chain: BeatChain | None = None  # proves our heartbeats between signatures (peerd/beats.py)
        self.entries: dict[str, Entry] = {}
        self.forged = 0  # entries refused because their signature does not check out
        # (peer id, old incarnation, new incarnation) for each restart gossip revealed since the last drain: the old
        # process is gone, though the id may never have left the live set in between (gossip.py says so)
        self.restarts: list[tuple[str, int, int]] = []
        # Peers we refuse to count as live although their heartbeat advances: banned by us, or reported banned by a
        # majority of the swarm (peerd/robust.py). Set by the daemon.
        self.excluded: Callable[[str], bool] = lambda peer_id: False
        self.view = View((), 0, ())
        self.step_seen: dict[int, float] = {}  # outer step -> when gossip first showed a peer at it (the last 16)
        self.blocks = PairBlocks()  # live peers we cannot dial though others hear them (peerd/pairblocks.py)

    @property
    def self_id(self) -> str:
        return self.me.peer_id

    def bump(self) -> None:
        """Advance our own heartbeat; called once per gossip interval."""
        self.me.heartbeat += 1

    def signed_self(self) -> pb.PeerInfo:
        """Our own entry with the proof of its heartbeat, re-signed if anything else in it changed since the last
        signature, or the heartbeat ran past its chain."""
        if self._sign is not None:
            if self._chain is None or not self._chain.covers(self.me.heartbeat):
                self._chain = BeatChain(self.me.heartbeat)
                self.me.beat_base = self._chain.base
            self.me.beat_proof = self._chain.proof(self.me.heartbeat)
            body = entry_bytes(self.me, self.run_id, self._chain.anchor)
            if body != self._signed_body or not self.me.signature:
                self.me.signature = self._sign(body)
                self._signed_body = body
        return self.me

    def merge(self, infos: Iterable[pb.PeerInfo], now: float | None = None) -> list[str]:
        """Fold gossiped entries into the table; returns ids of peers we had never seen. An entry that would change
        the table must carry its subject's signature; forged ones are counted in `forged` and dropped."""
        now = time.monotonic() if now is None else now
        new: list[str] = []
        for info in infos:
            pid = info.peer_id
            if pid == self.me.peer_id or len(info.public_key) != 32 or peer_id_of(info.public_key) != pid:
                continue  # never let gossip overwrite our own entry, and ignore entries whose id is not their key's
            cur = self.entries.get(pid)
            if cur is not None and (info.incarnation, info.heartbeat) <= (cur.info.incarnation, cur.info.heartbeat):
                continue
            if cur is None and len(self.entries) >= MAX_PEERS and not self._evict_one():
                continue
            checked = self._authentic(info, cur)
            if checked is None:
                self.forged += 1
                continue
            if cur is None:
                self.entries[pid] = Entry(copy_peer(info), now, now, body=checked[0], anchor=checked[1])
                new.append(pid)
            else:
                cur.body, cur.anchor = checked
                if info.incarnation > cur.info.incarnation and len(self.restarts) < MAX_PEERS:
                    self.restarts.append((pid, cur.info.incarnation, info.incarnation))
                if now - cur.last_advance >= self.peer_timeout:
                    cur.first_seen = now  # back from the dead: it must settle again before it may lead
                if info.incarnation != cur.info.incarnation or info.address != cur.info.address:
                    self.blocks.reached(pid)  # another process, or another address: what we failed to dial is gone
                else:
                    self.blocks.advanced(pid, now, self.peer_timeout, int(info.heartbeat))
                other_state = self.lineages and info.state_digest != cur.info.state_digest
                if cur.step_hint > info.outer_step and (other_state or info.incarnation > cur.info.incarnation):
                    # It now holds another state below the step it finished with us: it adopted another lineage (the
                    # losing side of a split downloads the winner's) or restarted from a checkpoint. A kept hint said
                    # it was past steps it would never reach again: after a heal, the leader of the swarm's step kept
                    # its empty group closed for good on that word, and 5 peers at one state stopped training.
                    # Not under ddp: there a peer's gossip lags its rounds by up to a publish interval by design,
                    # and a cleared hint at each publish made the leader drop it from the next round (CI: the other
                    # peer then trained 13 steps alone while it downloaded).
                    cur.step_hint = -1
                cur.info = copy_peer(info)
                cur.last_advance = now
                cur.unreachable_until = 0.0
                cur.probes, cur.probe_result = 0, ""
            self._note_step(int(info.outer_step), now)
        return new

    def _authentic(self, info: pb.PeerInfo, cur: Entry | None) -> tuple[bytes, bytes] | None:
        """(signed body, chain anchor) of `info` if its subject vouches for it, else None. A newer heartbeat of the
        body we already checked costs a hash or two (its proof hashes to the one we hold); anything else, a signature
        check."""
        if self._sign is None:
            return b"", b""
        if cur is not None and info.beat_proof and cur.info.beat_proof and info.signature == cur.info.signature:
            body = entry_bytes(info, self.run_id, cur.anchor)
            if body == cur.body:
                ok = hashes_to(info.beat_proof, info.heartbeat - cur.info.heartbeat, cur.info.beat_proof)
                return (body, cur.anchor) if ok else None
        anchor = anchor_of(info)
        if anchor is None:
            return None
        body = entry_bytes(info, self.run_id, anchor)
        return (body, anchor) if verify(info.public_key, info.signature, body) else None

    def _note_step(self, step: int, now: float) -> None:
        if step > 0 and step not in self.step_seen:
            self.step_seen[step] = now
            if len(self.step_seen) > 16:
                del self.step_seen[min(self.step_seen)]

    def step_age(self, step: int, now: float | None = None) -> float:
        """Seconds since gossip first showed a peer at outer step `step` (0: not seen, or too long ago): about when
        the swarm finished the round before it, so where its current window started."""
        seen = self.step_seen.get(step)
        return 0.0 if seen is None else (time.monotonic() if now is None else now) - seen

    def drain_restarts(self) -> list[tuple[str, int, int]]:
        """The restarts seen since the last call (bounded by MAX_PEERS between drains)."""
        out, self.restarts = self.restarts, []
        return out

    def _evict_one(self) -> bool:
        """Make room by dropping the longest-dead entry (the table is full of live peers otherwise)."""
        dead = [(e.last_advance, pid) for pid, e in self.entries.items() if not self.is_alive(pid)]
        if not dead:
            return False
        del self.entries[min(dead)[1]]
        return True

    def mark_unreachable(
        self, peer_id: str, now: float | None = None, why: str = "", address: str = "", *, dial: str = ""
    ) -> None:
        """We could not dial this peer: treat it as dead until its heartbeat advances again. `why` says what failed
        (the "lost" line carries it). With `address` (the one we dialled), only while the peer still announces it: a
        peer that announced another address since restarted elsewhere, and that process is alive. `dial` says how a
        connection of ours failed (peerd/pairblocks.py): "refused" (refused or reset: the route works, the process is
        gone) ends any block; "no_answer" (no connection at all) is what a route broken between us and a live peer
        gives, so a block in force explains it and the peer stays live, and otherwise it counts as evidence of one.
        "" is not a dial (a ban, a blame)."""
        now = time.monotonic() if now is None else now
        entry = self.entries.get(peer_id)
        if entry is None or (address and entry.info.address != address):
            return
        if dial == "refused":
            self.blocks.reached(peer_id)
        elif (
            dial == "no_answer"
            and self._heard(peer_id, now)
            and self.blocks.dial_failed(peer_id, now, int(entry.info.heartbeat))
        ):
            return
        entry.unreachable_until = now + self.peer_timeout
        entry.unreachable_why = why

    def no_answer(self, peer_id: str, now: float | None = None, *, fresh: bool = False, address: str = "") -> None:
        """A dial of ours got no answer from a peer we still count live: evidence of a block (peerd/pairblocks.py)
        if its heartbeat keeps coming through others; nothing else changes. `fresh`: the dial was a new TCP
        connection (Reachability._route), which also confirms a suspect. `address`: the one dialled; none of this
        counts once the peer announces another (its old one went away: peerd/netchange.py)."""
        now = time.monotonic() if now is None else now
        entry = self.entries.get(peer_id)
        if entry is None or not self._heard(peer_id, now) or (address and entry.info.address != address):
            return
        if fresh:
            self.blocks.check_failed(peer_id, now, int(entry.info.heartbeat))
        else:
            self.blocks.dial_failed(peer_id, now, int(entry.info.heartbeat))

    def _heard(self, peer_id: str, now: float) -> bool:
        """Others still carry `peer_id`'s heartbeat to us: only then is a dial of ours without an answer evidence of
        a route broken between us. A peer silent to us too is behind a split or dead, and a block taken from a
        failure then started at the heal (the chaos test, in CI: the split's other side led no round for 30 s)."""
        return self.silent_for(peer_id, now) < self.peer_timeout

    def cannot_dial(self, peer_id: str, now: float | None = None) -> bool:
        """A live peer we cannot reach ourselves (peerd/pairblocks.py): others carry what it says; do not dial it."""
        return self.blocks.blocked(peer_id, time.monotonic() if now is None else now)

    def publish_unreachable(self, now: float | None = None) -> bool:
        """Name the live peers we cannot dial in our own entry; True when that changed it."""
        now = time.monotonic() if now is None else now
        named = self.blocks.named((pid for pid in self.entries if self.is_alive(pid, now)), now)
        if list(self.me.unreachable) == named:
            return False
        del self.me.unreachable[:]
        self.me.unreachable.extend(named)
        return True

    def named_unreachable(self, members: Iterable[pb.PeerInfo], now: float | None = None) -> set[str]:
        """The ids of `members` some live peer (ourselves included) cannot dial: they may not lead or own shards."""
        return named_by_anyone(members, self.alive(now))

    def unreachable_why(self, peer_id: str) -> str:
        entry = self.entries.get(peer_id)
        return entry.unreachable_why if entry is not None else ""

    def mark_left(self, info: pb.PeerInfo, now: float | None = None) -> None:
        """A signed Leave: keep the peer's own signed leaving entry as a tombstone so gossip spreads the leave and
        stale entries cannot revive it."""
        now = time.monotonic() if now is None else now
        entry = self.entries.get(info.peer_id)
        if entry is None or not info.left or info.public_key != entry.info.public_key:
            return
        if (info.incarnation, info.heartbeat) <= (entry.info.incarnation, entry.info.heartbeat):
            return
        checked = self._authentic(info, entry)
        if checked is None:
            self.forged += 1
            return
        entry.info, (entry.body, entry.anchor) = copy_peer(info), checked
        entry.last_advance = now

    def note_step(self, peer_id: str, step: int) -> None:
        """`peer_id` finished `step` with us (it was in our round): its gossip will say so later."""
        entry = self.entries.get(peer_id)
        if entry is not None:
            entry.step_hint = max(entry.step_hint, step)

    def note_round(self, step: int, peer_ids: list[str]) -> None:
        """Every member of a round we completed finished `step` with us (DiLoCo, Streaming and NoLoCo rounds alike)."""
        for pid in peer_ids:
            self.note_step(pid, step)

    def step_of(self, info: pb.PeerInfo) -> int:
        """The newest outer step we know `info`'s peer finished: its gossip, or a round we shared."""
        entry = self.entries.get(info.peer_id)
        hint = entry.step_hint if entry is not None else -1
        return max(info.outer_step, hint)

    def silent_for(self, peer_id: str, now: float | None = None) -> float:
        """Seconds since `peer_id`'s heartbeat last advanced here (0 for ourselves, and for a peer we have not heard
        of yet: a newcomer in a round is no evidence of silence)."""
        e = self.entries.get(peer_id)
        if peer_id == self.me.peer_id or e is None:
            return 0.0
        return (time.monotonic() if now is None else now) - e.last_advance

    def forgive(self, seconds: float, now: float | None = None) -> None:
        """Our own event loop stalled for `seconds` (starved of CPU, or busy): we heard nothing then through no fault
        of the peers, so that time does not count towards anyone's silence (Cassandra's gossiper likewise skips
        convictions after a local pause). At 64 daemons on 2 cores, 73% of "lost: silent" lines came three or more
        at once at one observer, just past the timeout: false losses that each cost rounds a takeover or a relay.
        Never moves an entry past now; a failed dial (`unreachable_until`) is evidence of its own and stays."""
        if seconds <= 0:
            return
        now = time.monotonic() if now is None else now
        for e in self.entries.values():
            e.last_advance = min(now, e.last_advance + seconds)

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

    def restarted_since(self, peer_id: str, incarnation: int) -> bool:
        """Whether a newer process than `incarnation` announced itself for `peer_id`: that process is gone, though the
        peer's heartbeat keeps advancing, so silence would never show it."""
        info = self.get(peer_id)
        return info is not None and info.incarnation > incarnation

    def gone(self, peer_id: str, incarnation: int, now: float | None = None) -> bool:
        """Whether our own view has the process `incarnation` of `peer_id` gone: the peer is not live here (silent
        past the timeout, a dial of ours failed, it left), or a newer incarnation announced itself. A peer we have not
        heard of yet is no evidence (a newcomer in a round)."""
        if peer_id not in self.entries or peer_id == self.me.peer_id:
            return False
        return self.restarted_since(peer_id, incarnation) or not self.is_alive(peer_id, now)

    def alive(self, now: float | None = None, include_self: bool = True) -> list[pb.PeerInfo]:
        """Live peers, sorted by peer id (ourselves included unless asked not to)."""
        now = time.monotonic() if now is None else now
        out = [e.info for pid, e in self.entries.items() if self.is_alive(pid, now)]
        if include_self:
            out.append(self.me)
        return sorted(out, key=lambda p: p.peer_id)

    def others_alive(self, now: float | None = None) -> int:
        """How many live peers we know besides ourselves (the clock's test for whether one peer may be trusted)."""
        now = time.monotonic() if now is None else now
        return sum(1 for pid in self.entries if pid != self.me.peer_id and self.is_alive(pid, now))

    def settled(self, now: float | None = None) -> list[pb.PeerInfo]:
        """Live peers known for at least `settle_s`: round leaders are picked among these, so a peer that only just
        joined (and that some peers may not know yet) cannot split a round into two groups."""
        now = time.monotonic() if now is None else now
        out = [
            e.info for pid, e in self.entries.items() if self.is_alive(pid, now) and now - e.first_seen >= self.settle_s
        ]
        out.append(self.me)
        return sorted(out, key=lambda p: p.peer_id)

    def dead(self, now: float | None = None) -> list[pb.PeerInfo]:
        """Peers that went silent without leaving: peerd/redial.py keeps dialling them."""
        now = time.monotonic() if now is None else now
        return [
            e.info
            for pid, e in self.entries.items()
            if not e.info.left and not self.excluded(pid) and not self.is_alive(pid, now)
        ]

    def expected(self, now: float | None = None) -> list[str]:
        """Whom the run expects in a round: ourselves, live peers, and peers seen live within `forget_after` that
        neither left nor finished. A round without some of them is partial, however few peers are live now."""
        now = time.monotonic() if now is None else now
        out = [self.me.peer_id]
        for pid, e in self.entries.items():
            if e.info.left or e.info.finished or self.excluded(pid):
                continue
            if self.is_alive(pid, now) or now - e.last_advance < self.forget_after:
                out.append(pid)
        return sorted(out)

    def sponsored(self) -> set[str]:
        """Peers whose work comes through a sponsor (peerd/sponsor.py): not expected in rounds themselves."""
        out = {pid for pid, e in self.entries.items() if e.info.sponsor and not e.info.left}
        return out | {self.me.peer_id} if self.me.sponsor else out

    def at_address(self, address: str) -> pb.PeerInfo | None:
        """The live peer gossip says listens at `address` (the freshest one if several claim it)."""
        found = [e for e in self.entries.values() if e.info.address == address and not e.info.left]
        return max(found, key=lambda e: e.last_advance).info if found else None

    def get(self, peer_id: str) -> pb.PeerInfo | None:
        if peer_id == self.me.peer_id:
            return self.me
        e = self.entries.get(peer_id)
        return e.info if e else None

    def gossip_view(self, now: float | None = None, limit: int = 0) -> list[pb.PeerInfo]:
        """What we tell others: ourselves (freshly signed), live peers, and recent tombstones (so leaves spread).
        Dead entries are kept but not gossiped: each peer re-dials the dead itself.

        `limit` > 0 bounds the live entries per message, so a peer's gossip bytes stay flat as the swarm grows: the
        ones we sent least recently go first (round-robin over the table). An entry that still misses a peer for a
        while is saved by that peer's direct probe (`expiring`), not by larger messages."""
        now = time.monotonic() if now is None else now
        live: list[Entry] = []
        tombs: list[pb.PeerInfo] = []
        for e in self.entries.values():
            age = now - e.last_advance
            if e.info.left and age < 3 * self.peer_timeout:
                tombs.append(e.info)
            elif age < self.peer_timeout and not e.info.left:
                live.append(e)
        if limit > 0 and len(live) > limit:
            live = sorted(live, key=lambda e: e.last_sent)[:limit]
        for e in live:
            e.last_sent = now
        return [self.signed_self(), *(e.info for e in live), *tombs]

    def expiring(
        self, now: float | None = None, at: float = 0.6, most: int = 4, can: Callable[[pb.PeerInfo], bool] | None = None
    ) -> list[pb.PeerInfo]:
        """Live peers whose heartbeat has not advanced here for `at` x peer_timeout and that we have not probed
        since: dial them directly before they expire (`can` says whom the caller can dial now). With bounded gossip
        some entry always reaches some peer late; one direct call then costs less than a false death (a peer dropped
        from rounds and re-dialled). The caller reports each probe's start and end (`probe_started`, `probe_ended`)
        for the "lost" line.

        Tried and reverted (stop 45): repeating an unanswered probe every 0.15 T and holding the verdict while one
        ran. At 64 peers on 2 cores 1,194 of 1,497 false silence verdicts followed a probe that overran its 2 s
        deadline, and the run counted 1,512 false losses against 760-795 before: a peer starved that long answers
        no probe in time, and the extra calls starve the swarm further."""
        now = time.monotonic() if now is None else now
        out: list[pb.PeerInfo] = []
        for pid, e in sorted(self.entries.items(), key=lambda kv: kv[1].last_advance):
            if len(out) >= most:
                break
            stale = at * self.peer_timeout <= now - e.last_advance and e.last_probed <= e.last_advance
            if stale and self.is_alive(pid, now) and (can is None or can(e.info)):
                e.last_probed = now
                out.append(e.info)
        return out

    def probe_started(self, peer_id: str) -> None:
        e = self.entries.get(peer_id)
        if e is not None:
            e.probes += 1
            e.probe_result = ""

    def probe_ended(self, peer_id: str, result: str) -> None:
        """`result`: "answered", or the gRPC status the call ended with."""
        e = self.entries.get(peer_id)
        if e is not None:
            e.probe_result = result

    def probe_note(self, peer_id: str) -> str:
        """For the "lost" line: the direct probes since the peer's heartbeat last advanced here, and the last one's
        end, so a false loss shows whether it was never probed, or probed and not answered in time."""
        e = self.entries.get(peer_id)
        if e is None or e.probes == 0:
            return "not probed"
        return f"probed {e.probes}x, last {e.probe_result or 'running'}"

    def snapshot(self, now: float | None = None) -> View:
        """Publish an immutable view for other threads (called on the loop after every gossip tick)."""
        self.view = View(tuple(copy_peer(p) for p in self.alive(now)), len(self.entries) + 1, tuple(self.expected(now)))
        return self.view


def copy_peer(info: pb.PeerInfo, *, suspects: bool = True) -> pb.PeerInfo:
    """A copy of a peer entry that later edits of the table cannot reach. `suspects=False` leaves out the peer's ban
    list, which a NoLoCo group's member list has no use for."""
    out = pb.PeerInfo()
    out.CopyFrom(info)
    if not suspects:
        out.ClearField("suspects")
    return out
