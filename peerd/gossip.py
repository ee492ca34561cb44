"""Joining the swarm and keeping the peer table fresh: the Join through a bootstrap address (pinned or trusted on
first use), the push-pull gossip loop, the merge of gossiped entries (forged ones refused and counted), and the redial
loop that re-dials dead peers and bootstrap addresses for the life of the run (peerd/redial.py).

Everything here runs on the daemon loop, which alone touches the membership table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Literal

import grpc

from peerd import bootstrap, faults, peercache, tls
from peerd.addresses import hostport
from peerd.bootstrap import unspecified
from peerd.channels import UNREACHABLE, connection_failed, dial_failure, turned_away
from peerd.datadir import write_atomic
from peerd.envelope import sign
from peerd.reachability import dialable
from peerd.redial import Redialer
from peerd.swarmclock import CLOCK
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")
STALL_S = 0.1  # a loop wait this much later than due counts as our own stall (`Gossip._forgive_stall`)
PROBE_AT = 0.6  # a peer silent this share of peer_timeout is probed directly (Membership.expiring)
Mark = Literal["down", "refused", "never"]  # which failed gossip call marks its peer unreachable (`_gossip_one`)


class JoinError(RuntimeError):
    """No bootstrap address answered, or the swarm refused us (wrong run spec, not admitted)."""


class Gossip:
    """Join, gossip and redial for one daemon (`daemon.gossip`)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self._alive_ids: set[str] = set()  # live peers at the last gossip tick (for the "lost" line)
        self._said_lost: set[str] = set()  # peers we logged lost and not yet live again
        self._remembered: tuple[tuple[str, str], ...] = ()  # what peercache holds now
        self._inflight: dict[str, asyncio.Task] = {}  # peer id -> our gossip call to it still running
        self._long: set[str] = set()  # peers whose running call waits past the usual deadline (`deadline`)
        self.stalled_s = 0.0  # seconds our loop stalled, not counted towards peers' silence (`_forgive_stall`)
        self._wrong_addresses: set[tuple[str, str]] = set()  # (peer, address) where another process answered
        net = daemon.cfg.network
        self.redialer = Redialer(
            lambda: [
                p for p in daemon.membership.dead() if dialable(p)
            ],  # outbound-only peers dial us again themselves
            self._redial_peer,
            daemon.bootstrap,
            self._redial_bootstrap,
            lambda addr: any(p.address == tls.parse_bootstrap(addr)[1] for p in daemon.membership.alive()),
            net.gossip_interval,
            net.redial_max,
        )

    async def join(self, timeout: float, verbose: bool = False) -> None:
        """Join through the first bootstrap address that lets us in. An address where nothing answers is retried with
        backoff until `timeout`; one that answers but is not a peerd peer, or refuses us, fails at once. `verbose`
        (at start) logs each address's first failure, so a slow join is never silent; the gossip loop's healing
        calls stay quiet."""
        assert self.d.channels is not None
        deadline = time.monotonic() + timeout
        last = "no bootstrap address given"
        warned: set[str] = set()
        attempt = 0
        while True:
            for spec in self.d.bootstrap:
                try:
                    addr, peer = await self._bootstrap_address(spec)
                    await self._join_one(addr, peer)
                    return
                except bootstrap.NotPeerd as exc:
                    raise JoinError(
                        f"bootstrap {spec} answered but is not a peerd peer: {exc}; check the host and port"
                    ) from exc
                except bootstrap.NoAnswer as exc:
                    last = f"{spec}: {exc}"
                    if verbose and spec not in warned:
                        warned.add(spec)
                        left = max(deadline - time.monotonic(), 0.0)
                        log.warning("bootstrap %s: %s; retrying for up to %.0fs", spec, exc, left)
                except (JoinError, tls.TlsError) as exc:
                    if spec not in self.d.remembered:
                        raise
                    # A remembered address now holds another peer, or another run: not ours to join through.
                    last = f"{spec}: {exc}"
                    if verbose and spec not in warned:
                        warned.add(spec)
                        log.info("remembered peer %s: %s; trying the others", spec, exc)
            pause = bootstrap.backoff_s(attempt)
            attempt += 1
            if time.monotonic() + pause > deadline:
                break
            await asyncio.sleep(pause)
        raise JoinError(
            f"no bootstrap peer answered within {timeout:.0f}s ({last}); check that the peer runs and the address "
            "is reachable, or wait longer with --join-timeout"
        )

    async def _join_one(self, addr: str, peer: pb.PeerInfo | None, timeout: float = 5.0) -> None:
        """One Join call to a bootstrap address; NoAnswer when it cannot be reached, JoinError when refused. Before
        the first Join the peer there dials us back, so our entry carries the reachability verdict from the start."""
        assert self.d.channels is not None
        await self.d.reach.before_join(addr)
        req = sign(
            pb.JoinRequest(
                self=self.d.membership.signed_self(), run_spec_json=self.d.cfg.spec_json(), dialed_address=addr
            ),
            "Join",
            self.d.identity,
            self.d.run_id,
        )
        try:
            try:
                resp = await self.d.channels.membership(addr, peer).Join(req, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if not CLOCK.heard(exc, addr, self.d.membership.others_alive):
                    raise
                req = sign(req, "Join", self.d.identity, self.d.run_id)  # refused as stale: again, by the swarm's time
                resp = await self.d.channels.membership(addr, peer).Join(req, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE or exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED):
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise bootstrap.NotPeerd("a gRPC server without peerd's Membership service") from exc
                if self.d.tls is None:  # with TLS the certificate already showed a peer is there: just retry
                    await bootstrap.classify(addr, secure=False)
                raise bootstrap.NoAnswer(f"{exc.code().name} {exc.details()}") from exc
            raise JoinError(f"{addr} refused us: {exc.details()}") from exc
        if unspecified(self.d.me.address) and resp.observed_address:
            self.d.me.address = hostport(resp.observed_address, self.d.me.address.rsplit(":", 1)[-1])
            self.d.me.heartbeat += 1
            write_atomic(self.d.data_dir / "address", self.d.me.address)
        self.merge_gossip(resp.peers)
        log.info("joined through %s: %d peers known", addr, len(self.d.membership.alive()) - 1)

    async def _bootstrap_address(self, spec: str) -> tuple[str, pb.PeerInfo | None]:
        """'PEERID@host:port' or 'host:port' -> the address to dial and, with TLS, the peer found there: its
        certificate is read and checked first (pinned to PEERID, or trusted on first use) so the Join goes only to
        the peer it should. The Join dials with exactly that certificate: a stale one gossiped for the address
        (the peer restarted with a new TLS key) would fail the handshake and fill the log with gRPC's complaints."""
        assert self.d.channels is not None
        pinned, addr = tls.parse_bootstrap(spec)
        if self.d.tls is None:
            if pinned is not None:
                log.warning("--insecure: cannot check that %s is peer %s", addr, pinned[:8])
            return addr, None
        cert = await bootstrap.fetch_cert(addr, timeout=5.0)
        pid = tls.verify_cert(cert)
        if pinned is not None and pid != pinned:
            raise JoinError(f"bootstrap {addr} is peer {pid}, not the expected {pinned}: refusing to join through it")
        if pinned is None:
            log.info(
                "bootstrap %s is peer %s (trusted on first use; pin it with --bootstrap %s@%s)", addr, pid, pid, addr
            )
        self.d.channels.pin(addr, cert)
        return addr, pb.PeerInfo(peer_id=pid, public_key=tls.bound_key(cert), tls_cert=cert, address=addr)

    async def gossip_loop(self, stopping: asyncio.Event) -> None:
        interval = self.d.cfg.network.gossip_interval
        try:
            while not stopping.is_set():
                try:
                    await self._gossip_ticks(stopping, interval)
                except Exception as exc:  # a bug in one tick must not end gossip: silent peers all look dead
                    log.error("gossip tick failed (a bug; gossip goes on): %s: %s", type(exc).__name__, exc)
                    log.debug("gossip tick failure", exc_info=True)
                    await asyncio.sleep(interval)
        finally:
            for task in list(self._inflight.values()):
                task.cancel()

    async def _gossip_ticks(self, stopping: asyncio.Event, interval: float) -> None:
        waited = 0.0  # how long the last tick waited for its calls' answers: part of this tick's interval
        while not stopping.is_set():
            # One tick per interval, whether or not the last one's calls answered at once: the wait for answers comes
            # out of the nap. Adding it on top stretched ticks to up to 2 intervals at 64 peers on 2 cores, where
            # answers are slow: 4.5 gossip messages a second per peer against 6.6 at 8 peers (-20% bytes), and
            # heartbeats that advance half as often.
            nap = max(0.0, interval * random.uniform(0.7, 1.0) - waited)
            t0 = time.monotonic()
            await asyncio.sleep(nap)
            self._forgive_stall(time.monotonic() - t0 - nap)
            self.d.membership.bump()
            self.d.checks.refresh_suspects()
            self.refresh_timing()
            self._publish_blocks()
            self.d.reach.watch_source(self._recent_peers())  # has our own address gone away?
            others = self.d.reach.dial_targets(self.d.membership.alive(include_self=False))
            self.d.reach.tick(others)
            free = [p for p in others if p.peer_id not in self._inflight]
            # three calls a tick, fewer while earlier ones still run (at least one): starved loops at 64 peers do
            # not pile up calls, and a call ends by its deadline, so at most about 3 + 2 s / interval run at once.
            # Calls to peers about to expire, which wait longer, are not counted: a tick's ordinary gossip (how
            # everyone else's heartbeats spread) does not stop while a few stale peers take their time to answer.
            busy = sum(1 for pid in self._inflight if pid not in self._long)
            targets = random.sample(free, min(max(1, 3 - busy), len(free)))
            # entries about to expire, not already among the targets: asked directly (bounded gossip, membership.py)
            chosen = {p.peer_id for p in targets} | set(self._inflight)
            probes = self.d.membership.expiring(
                at=PROBE_AT,
                can=lambda p, skip=chosen: (
                    p.peer_id not in skip and dialable(p) and not self.d.membership.cannot_dial(p.peer_id)
                ),
            )
            if faults.GOSSIP_LATE_S:  # the injector's peer calls nobody: its heartbeat travels only in its answers
                targets, probes = [], []
            calls = [self._start(p, "down") for p in targets] + [self._start(p, "refused") for p in probes]
            if calls:
                # Quick answers are merged before the bookkeeping below; a call to a peer behind a cut link runs on
                # (up to its 2 s deadline) without holding the next tick. Waiting for every call made one
                # unreachable target stretch each tick to 2 s, and a partition's own side then lost each other
                # (heartbeats 2.2 s apart against a 2 s peer_timeout in tests/test_partition.py).
                t0 = time.monotonic()
                await asyncio.wait(calls, timeout=interval)
                waited = time.monotonic() - t0
                self._forgive_stall(waited - interval)
                waited = min(waited, interval)
            else:
                waited = 0.0
            view = self.d.membership.snapshot()
            self._note_lost(view.alive)
            self._remember(view.alive)
            if self.d.metrics is not None:
                self.d.metrics.known_peers.set(view.known)
                self.d.metrics.alive_peers.set(len(view.alive))
                self.d.metrics.expected_peers.set(len(view.expected))
                self.d.metrics.work.set(self.d.me.work)
                self.d.metrics.clock_offset.set(CLOCK.offset)

    def _recent_peers(self) -> list[pb.PeerInfo]:
        """Peers the run expects (live, or live lately): those lost a moment ago because our address went away
        still tell us so."""
        m, me = self.d.membership, self.d.identity.peer_id
        return [p for p in map(m.get, m.expected()) if p is not None and p.peer_id != me]

    def _publish_blocks(self) -> None:
        """Say once when a live peer turns out undialable from here (peerd/pairblocks.py), and name the live peers we
        cannot dial in our entry, so that nobody makes them lead or own shards."""
        m = self.d.membership
        for pid, hold in m.blocks.drain_news():
            log.warning(
                "peer %s is live to the others but this peer cannot dial it: it leads no round and owns no shard "
                "while that lasts (next try in %.0f s)",
                pid[:8],
                hold,
            )
        for pid in m.blocks.drain_checks():  # suspects: a fresh connection confirms or clears each
            info = m.get(pid)
            if info is not None and dialable(info):
                self.d.reach.confirm_route(info)
        if m.publish_unreachable() and self.d.metrics is not None:
            self.d.metrics.undialable_peers.set(len(self.d.me.unreachable))

    def _forgive_stall(self, late: float) -> None:
        """A wait of this loop ended `late` seconds after it was due: our loop stalled, so nobody's silence grows by
        that time (Membership.forgive). Lateness under STALL_S is ordinary scheduling noise."""
        if late > STALL_S:
            self.d.membership.forgive(late)
            self.stalled_s += late
            if self.d.metrics is not None:
                self.d.metrics.loop_stall.inc(late)

    def _start(self, peer: pb.PeerInfo, mark: Mark) -> asyncio.Task:
        """One gossip call as its own task, at most one in flight per peer (a slow one is not asked again meanwhile)."""
        task = asyncio.ensure_future(self._gossip_one(peer, mark))
        self._inflight[peer.peer_id] = task
        if self.deadline(peer.peer_id) > self.usual_deadline:
            self._long.add(peer.peer_id)
        task.add_done_callback(lambda t, pid=peer.peer_id: self._finished(pid, t))
        return task

    def _finished(self, peer_id: str, task: asyncio.Task) -> None:
        if self._inflight.get(peer_id) is task:
            del self._inflight[peer_id]
            self._long.discard(peer_id)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.warning("gossip with %s failed unexpectedly: %s: %s", peer_id[:8], type(exc).__name__, exc)

    def _remember(self, alive: tuple[pb.PeerInfo, ...]) -> None:
        """Keep the live dialable peers in the data dir when they change (peerd/peercache.py). An empty view does not
        overwrite the file: the peers seen last are still the best guess for a later restart."""
        me = self.d.identity.peer_id
        peers = sorted((p for p in alive if p.peer_id != me and dialable(p) and not p.left), key=lambda p: p.peer_id)
        key = tuple((p.peer_id, p.address) for p in peers)
        if not key or key == self._remembered:
            return
        self._remembered = key
        try:
            peercache.save(self.d.data_dir, self.d.run_id, peers)
        except OSError as exc:  # a full disk must not stop gossip; the next change tries again
            log.debug("cannot write %s: %s", peercache.FILE, exc)

    def _note_lost(self, alive: tuple[pb.PeerInfo, ...]) -> None:
        """Say once when a live peer drops out of the table (silent for peer_timeout, or a failed dial), or when a new
        incarnation replaces one we still thought live: operators and bench.scale read failure detection from these
        lines."""
        now_ids = {p.peer_id for p in alive}
        m = self.d.membership
        for pid, _old, _new in m.drain_restarts():
            if pid not in self._said_lost:  # we never said the old process was lost (it may have died and come back
                # between two of our ticks, unseen): this is how we learn it died
                log.warning("peer %s restarted: a new process took its id, and the one we knew is gone", pid[:8])
        for pid in now_ids - self._alive_ids:
            if pid in self._said_lost:  # its heartbeat advanced again (a new process, or the old one was not dead)
                self._said_lost.discard(pid)
                log.info("peer %s is live again", pid[:8])
        for pid in self._alive_ids - now_ids:
            info = m.get(pid)
            if info is None or info.left or info.finished or m.excluded(pid):
                continue  # a leave, a finished run or a ban says so itself
            silent = m.silent_for(pid)
            cause = m.unreachable_why(pid)
            why = (
                f"silent for {silent:.1f}s, {m.probe_note(pid)}"
                if silent >= m.peer_timeout
                else "unreachable" + (f" ({cause})" if cause else "")
            )
            log.warning("peer %s lost: %s (network.peer_timeout %.1fs)", pid[:8], why, m.peer_timeout)
            self._said_lost.add(pid)
        self._alive_ids = now_ids

    def refresh_timing(self) -> None:
        """Publish our slow/faulty verdicts and recompute the swarm's (peerd/timings.py); say what changed."""
        for line in self.d.timing.refresh(
            self.d.membership.alive(include_self=False),
            self.d.status.outer_step,
            known=set(self.d.membership.entries),
        ):
            if line.startswith("this peer"):
                why = self.d.round_client.book.self_evidence
                line += (
                    f"; {why}"
                    if why
                    else "; your link is the bottleneck: the other peers get your contributions late, round after "
                    "round; use a faster uplink or a smaller codec (codec.name = 'int4' or 'sparse')"
                )
            log.warning(line)
        if self.d.metrics is not None:
            self.d.metrics.record_flags(self.d.timing)

    async def redial_loop(self, stopping: asyncio.Event) -> None:
        """Dead peers and bootstrap addresses, re-dialled with backoff for the life of the run (peerd/redial.py)."""
        while not stopping.is_set():
            await asyncio.sleep(self.d.cfg.network.gossip_interval * random.uniform(0.5, 1.0))
            before = self.redialer.dials
            with contextlib.suppress(Exception):
                await self.redialer.tick()
            if self.d.metrics is not None and self.redialer.dials > before:
                self.d.metrics.redials.inc(self.redialer.dials - before)

    async def _redial_peer(self, peer: pb.PeerInfo) -> bool:
        ok = await self._gossip_one(peer, mark="never")
        if ok:
            log.info("peer %s at %s answers again: rejoined its part of the swarm", peer.peer_id[:8], peer.address)
        return ok

    async def _redial_bootstrap(self, spec: str) -> bool:
        try:
            addr, peer = await self._bootstrap_address(spec)
            await self._join_one(addr, peer, timeout=max(2.0, self.d.cfg.network.gossip_interval))
        except (OSError, TimeoutError, tls.TlsError, bootstrap.NoAnswer, bootstrap.NotPeerd, JoinError):
            return False
        return True

    async def _gossip_one(self, peer: pb.PeerInfo, mark: Mark = "down") -> bool:
        """One gossip exchange. `mark` says which failure marks the peer unreachable: "down" (a tick's target) any
        sign that it is down; "refused" (a probe of an entry about to expire) only a refused connection, which no
        live process gives, so a probe that finds a killed peer says so at once instead of waiting out the rest of
        its silence (at 64 peers on 2 cores a starved observer's forgiven silence ran 30-47 s); "never" (a re-dial
        of a peer already counted dead) nothing."""
        assert self.d.channels is not None
        view = self.d.membership.gossip_view(limit=self.d.cfg.network.gossip_entries)
        req = sign(pb.GossipRequest(peers=view, to=peer.peer_id), "Gossip", self.d.identity, self.d.run_id)
        timeout = self.deadline(peer.peer_id)
        if mark != "refused":
            return await self._gossip_call(peer, mark, req, timeout) == "answered"
        self.d.membership.probe_started(peer.peer_id)
        result = "cancelled"  # unless the call ends: the "lost" line never says "running" for a probe that is gone
        try:
            result = await self._gossip_call(peer, mark, req, timeout)
            return result == "answered"
        finally:
            self.d.membership.probe_ended(peer.peer_id, result)

    @property
    def usual_deadline(self) -> float:
        return max(2.0, self.d.cfg.network.gossip_interval)

    def deadline(self, peer_id: str) -> float:
        """How long a gossip call to `peer_id` may take. Usually 2 s (or one interval). A peer that will have been
        silent here for PROBE_AT x peer_timeout by the time the call ends is about to be counted lost, and its answer
        is the one thing that can still clear it: the call then waits for as long as the verdict allows, up to one
        gossip interval before the silence reaches peer_timeout, so the answer is merged before the tick that would
        convict. At 64 daemons on 2 cores, 735 of 779 false silence verdicts in one run (AO) came after a probe that
        overran its 2 s deadline, while the peers answered again a median 2 s after being counted lost: a starved
        loop answers late, not never. Waiting costs the caller nothing but an open call, and a dead peer is found as
        before (a refused dial at once; a frozen host's silence reaching peer_timeout, which no running call holds
        back)."""
        usual = self.usual_deadline
        m = self.d.membership
        silent = m.silent_for(peer_id)
        if silent + usual < PROBE_AT * m.peer_timeout:  # it would end before the peer is stale
            return usual
        return max(usual, m.peer_timeout - silent - self.d.cfg.network.gossip_interval)

    async def _gossip_call(self, peer: pb.PeerInfo, mark: Mark, req: pb.GossipRequest, timeout: float) -> str:
        """The call itself: "answered", or the gRPC status name it failed with."""
        t0 = time.monotonic()
        try:
            resp = await self.d.channels.membership(peer.address, peer).Gossip(req, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            CLOCK.heard(exc, peer.address, self.d.membership.others_alive)  # refused as stale: our clock?
            # A gossip call that overran its deadline on a connected channel met a busy peer or a busy link (a
            # round's bytes queued ahead of it), not a dead one: marking it dead made leaders close groups without it
            # and split the step. Marked: a refused connection, and a channel that is not connected with the peer
            # silent for as long as the call waited (dropped SYNs). A frozen host keeps its sockets open: its
            # silence reaching peer_timeout finds it. Marking a connected peer silent for half the timeout as well
            # was wrong 4,220 times and right 26 times at 64 peers (a heartbeat is routinely seconds old there).
            refused = connection_failed(exc)
            if mark == "down":
                silent = self.d.membership.silent_for(peer.peer_id)
                down = refused or (not self.d.channels.connected(peer.address, peer) and silent >= timeout)
            else:
                down = mark == "refused" and refused
            if exc.code() in UNREACHABLE and down:
                kind = "probe" if mark == "refused" else "gossip"  # the log says which call found it
                how = dial_failure(exc)
                self.d.membership.mark_unreachable(peer.peer_id, why=f"{kind} {exc.code().name}", dial=how)
            elif exc.code() in UNREACHABLE and mark == "down" and not self.d.channels.connected(peer.address, peer):
                # No connection to a peer others still hear: if its heartbeat keeps coming through them, the route
                # between us is broken (peerd/pairblocks.py). A refusal is not that: its host answered.
                if not turned_away(exc):
                    log.info("gossip to %s got no connection while others hear it: a broken route?", peer.peer_id[:8])
                    self.d.membership.no_answer(peer.peer_id, address=peer.address)
            elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and mark == "down":
                # A call that hung on an open connection: a busy link, or a route that broke under it. Only a new
                # connection tells them apart (Reachability.check_route).
                self.d.reach.check_route(peer)
            elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # Another process answers at the address (another peer of the run, or another run): the peer we
                # meant is gone from there, whatever `mark` allows. No answer of its own, so nothing is merged.
                self._wrong_peer(peer, exc)
            self.d.count_sent("gossip", 0, req.ByteSize())
            return exc.code().name
        self.d.count_sent("gossip", 0, req.ByteSize())
        self.d.timing.local.rtt(peer.peer_id, time.monotonic() - t0)
        self.d.membership.blocks.reached(peer.peer_id)  # before the merge, whose heartbeat would confirm a block
        self.merge_gossip(resp.peers)
        self.d.reach.observe(peer, resp.observed_address)
        return "answered"

    def _wrong_peer(self, peer: pb.PeerInfo, exc: grpc.aio.AioRpcError) -> None:
        """`peer`'s address now serves another process: count `peer` unreachable (a re-dial stays a failure), and say
        so once per address it announced."""
        self.d.membership.mark_unreachable(
            peer.peer_id, why="another process answers at its address", address=peer.address
        )
        key = (peer.peer_id, peer.address)
        if key not in self._wrong_addresses:
            self._wrong_addresses.add(key)
            log.info("peer %s's address %s now answers as another process (%s): not counting that as %s answering",
                     peer.peer_id[:8], peer.address, exc.details(), peer.peer_id[:8])  # fmt: skip

    def merge_gossip(self, peers: Any) -> list[str]:
        """Merge gossiped entries; entries not signed by the peer they describe are refused and counted."""
        before = self.d.membership.forged
        new = self.d.membership.merge(peers)
        for _ in range(self.d.membership.forged - before):
            self.d.checks.count_rejected("forged_entry")
        if self.d.membership.forged > before:
            shown, _ = self.d.checks.refusal_log.allow("forged_entry")
            if shown:
                log.warning("refused gossip entries not signed by the peer they describe (forged_entry)")
        return new

    def adopt_address(self, dialed: str) -> None:
        """A joiner reached us at `dialed`: if we do not know our public address yet, that is it."""
        if unspecified(self.d.me.address) and dialed and not unspecified(dialed):
            self.d.me.address = dialed
            self.d.me.heartbeat += 1
            write_atomic(self.d.data_dir / "address", self.d.me.address)
            log.info("learned our public address from a joiner: %s", dialed)
