"""One peer's daemon: a grpc.aio server and client on an event loop of its own thread, plus the blocking API the
training loop calls (run a round, download state, publish state).

The training loop runs on the main thread and never touches the event loop directly: it calls the `Daemon` methods
below, which schedule coroutines on the loop and wait for their result. So the trainer waits on the network only where
the algorithm needs it, and that wait is what the loop measures as compute-idle time.

The daemon owns the loop, the server and the shared state (config, identity, peer table, status), and wires the
parts that do the work: request checks (checks.py), joining and gossip (gossip.py), rounds (roundclient.py), state
downloads (statefetch.py), the servicers (service.py) and this peer's status (localstatus.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peerd import faults, peercache, reflection, tls
from peerd.addresses import hostport, split_host
from peerd.admission import Admission
from peerd.allreduce import RoundResult
from peerd.channels import CHANNEL_OPTIONS, Channels
from peerd.checks import RequestChecks
from peerd.codecs import Codec, make_codec
from peerd.config import RunConfig
from peerd.consistency import AloneTracker, Claim, best_claim, claim_of
from peerd.datadir import write_atomic
from peerd.envelope import Verifier, set_admission_prover, sign
from peerd.gossip import Gossip, JoinError
from peerd.identity import Identity
from peerd.limits import SERVER_OPTIONS, PeerLimits
from peerd.localstatus import LocalStatus, status_message
from peerd.membership import Membership
from peerd.reachability import Reachability, dialable
from peerd.relay import RelayClient, RelayServer, unrelayed
from peerd.rendezvous import RendezvousLeader
from peerd.robust import BanList, ContributionGuard
from peerd.roundclient import RoundClient
from peerd.service import MembershipService, RoundsService, StateService
from peerd.shutdown import DRAIN_S
from peerd.sponsor import SponsorDesk
from peerd.startbarrier import StartBarrier, start_together
from peerd.statesync import LINEAGE_STEPS, Lineage, StateSnapshot, part_digests
from peerd.streams import StreamError
from peerd.timings import SwarmTimings
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")
T = TypeVar("T")
REMEMBERED_JOIN_S = 5.0  # how long the first peer (no --bootstrap) tries the peers it remembers before starting


class Daemon:
    def __init__(
        self,
        cfg: RunConfig,
        identity: Identity,
        *,
        listen: str,
        bootstrap: list[str] | None = None,
        announce: str | None = None,
        data_dir: Path,
        metrics_listen: str | None = None,
        insecure: bool = False,
    ) -> None:
        """`insecure` serves and dials plaintext gRPC (tests only); otherwise TLS bound to the peer id (peerd/tls.py).
        Raises AdmissionError when this peer could not be admitted to its own run (missing secret or invitation)."""
        self.cfg = cfg
        self.identity = identity
        self.listen = listen
        self.bootstrap = list(bootstrap or [])
        # Peers of this run remembered from an earlier start (peerd/peercache.py), tried after --bootstrap: a
        # restarted peer whose bootstrap peer has left still finds the swarm.
        given = {spec.rpartition("@")[2] for spec in self.bootstrap}
        self.bootstrap_given = bool(self.bootstrap)
        self.remembered = [
            spec
            for spec in peercache.load(Path(data_dir), cfg.run_id(), pinned=not insecure)
            if spec.rpartition("@")[2] not in given
        ]
        self.bootstrap += self.remembered
        self.announce = announce
        self.data_dir = Path(data_dir)
        self.metrics_listen = metrics_listen
        self.run_id = cfg.run_id()
        self.codec: Codec = make_codec(
            cfg.codec.name,
            zstd_level=max(cfg.codec.zstd_level, 1),
            block_size=cfg.codec.block_size,
            zstd=cfg.codec.zstd_level > 0,
            density=cfg.codec.density,
            bits=cfg.codec.bits,
        )
        self.me = pb.PeerInfo(
            peer_id=identity.peer_id, public_key=identity.public_key, incarnation=time.time_ns(), heartbeat=1
        )
        net = cfg.network
        self.membership = Membership(
            self.me,
            net.peer_timeout,
            settle_s=min(3.0, 3 * net.gossip_interval),
            run_id=self.run_id,
            sign=identity.sign,
            forget_after=net.forget_after,
        )
        self.membership.lineages = self.ranked
        self.verifier = Verifier(self.run_id)
        # Security (SECURITY.md): TLS identity, admission policy, bans, contribution checks and resource limits.
        self.insecure = insecure
        self.tls = None if insecure else tls.TlsIdentity.create(identity)
        if self.tls is not None:
            self.me.tls_cert = self.tls.cert_der
        self.admission = Admission.from_config(cfg)
        self.admission.check_self(identity.public_key)
        set_admission_prover(identity.public_key, None if self.admission.open else self.admission.prove)
        sec = cfg.security
        self.bans = BanList(sec.ban_after, sec.ban_window, sec.ban_seconds)
        self.guard = ContributionGuard(cfg.robust)
        self.guard.compare_shards = cfg.run.algorithm != "ddp"
        self.limits = PeerLimits.from_config(sec)
        self.status = LocalStatus()
        self.metrics: Any = None
        self.checks = RequestChecks(
            me=self.me,
            verifier=self.verifier,
            admission=self.admission,
            bans=self.bans,
            limits=self.limits,
            membership=self.membership,
            status=self.status,
            security=sec,
            metrics=lambda: self.metrics,
        )
        self.timing = SwarmTimings(self.me)  # slow/faulty peers from their timings (peerd/timings.py)
        self.snapshot: StateSnapshot | None = None
        self.published: tuple[int, bytes, Lineage] | None = None  # (step, digest, lineage) last published
        self._adopted: tuple[bytes, Lineage] | None = None  # (digest, lineage) of the last state downloaded
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peerd-codec")
        self._metrics_server: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self.channels: Channels | None = None
        self.leader: RendezvousLeader | None = None
        self.pairing: Any = None  # set by the NoLoCo algorithm
        self.sponsor_desk: SponsorDesk | None = None  # set by DiLoCo: slow-link peers' work for our rounds
        self.alone = AloneTracker()
        self.gossip = Gossip(self)  # join, gossip and redial (peerd/gossip.py)
        self.round_client = RoundClient(self)  # rendezvous and rounds (peerd/roundclient.py)
        self.start_barrier = StartBarrier()  # --wait-peers: the first inner step together (peerd/startbarrier.py)
        self.reach = Reachability(self)  # can others dial us? (peerd/reachability.py)
        self.relay_server, self.relay_client = RelayServer(self), RelayClient(self)  # peerd/relay.py

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, join_timeout: float = 60.0) -> None:
        """Start serving, then join the swarm through a bootstrap address (if any). Blocks until both are done.
        Raises OSError when the listen address cannot be bound, JoinError when no bootstrap address let us in."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="peerd-loop", daemon=True)
        self._thread.start()
        ready.wait()
        self.call(self._start_server())
        if self.bootstrap:
            # Without --bootstrap we are the run's first peer: remembered peers get a short try, then we start.
            timeout = join_timeout if self.bootstrap_given else min(join_timeout, REMEMBERED_JOIN_S)
            try:
                self.call(self.gossip.join(timeout, verbose=True))
            except JoinError as exc:
                if self.bootstrap_given:
                    raise
                log.warning("no remembered peer of this run let us in (%s): starting as its first peer", exc)
        self.go_on()

    def go_on(self) -> None:
        """Start gossip, probes and metrics: the rest of start(), also called by the CLI after a failed join when our
        checkpoint already finished the run (nobody is left to join, and nothing is left to train)."""
        self.call(self._start_background())
        self.status.state = "training"
        # Everything alive now (torch, grpc, the model) lives as long as the daemon: keep it out of the cyclic GC's
        # scans, which otherwise walk it again and again while a round allocates thousands of small objects.
        gc.freeze()

    def _run_loop(self, ready: threading.Event) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self._stopping = asyncio.Event()
        self.channels = Channels(self.tls, self.membership.at_address)
        ready.set()
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the daemon loop from another thread and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_server(self) -> None:
        server = grpc.aio.server(
            # No SO_REUSEPORT: with it a second daemon on a busy port binds too and takes half the calls.
            options=[*CHANNEL_OPTIONS, *SERVER_OPTIONS, ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=1024,
            interceptors=[
                *faults.inbound_blockers(),
                *faults.uplink_server_interceptors(),
                self.limits.interceptor(self.count_rejected),
            ],
        )
        from peerd.v1 import peerd_pb2_grpc as rpc

        checks, membership = self.checks, self.membership
        membership_service = MembershipService(
            checks=checks,
            membership=membership,
            gossip=self.gossip,
            reach=self.reach,
            cfg=self.cfg,
            run_id=self.run_id,
            status=self.status_message,
            count_sent=self.count_sent,
        )
        rounds_service = RoundsService(
            checks=checks,
            membership=membership,
            rounds=self.round_client,
            pair=self,
            cfg=self.cfg,
            barrier=self.start_barrier,
            count_sent=self.count_sent,
            desk=lambda: self.sponsor_desk,
            executor=self.executor,
            identity=self.identity,
            published=lambda: (self.me.outer_step, bytes(self.me.state_digest)),
        )
        state_service = StateService(
            checks=checks,
            identity=self.identity,
            cfg=self.cfg,
            snapshot=lambda: self.snapshot,
            count_sent=self.count_sent,
        )
        rpc.add_MembershipServicer_to_server(membership_service, server)
        rpc.add_RoundsServicer_to_server(rounds_service, server)
        rpc.add_StateServicer_to_server(state_service, server)
        rpc.add_RelayServicer_to_server(self.relay_server, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in ("Membership", "Rounds", "State", "Relay")]
        reflection.enable(server, [*names, health.SERVICE_NAME])
        try:
            if self.tls is not None:
                port = server.add_secure_port(self.listen, self.tls.server_credentials())
            else:
                port = server.add_insecure_port(self.listen)
        except RuntimeError:  # grpc's way to say the bind failed
            port = 0
        if port == 0:
            raise OSError(f"--listen {self.listen}: cannot listen there (address already in use?); pick another port")
        await server.start()
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        host = self.listen.rsplit(":", 1)[0]
        # Listening on 0.0.0.0 without --announce: the address stays unspecified until a Join tells us how others
        # reach us (the joiner's dialed address, or the bootstrap's view of our source address).
        self.me.address = self.announce or f"{'127.0.0.1' if host == 'localhost' else host}:{port}"
        window = self.cfg.inner.window_s
        self.leader = RendezvousLeader(
            self.membership,
            self.run_id,
            self.cfg.network.rendezvous_timeout,
            lambda: self.status.outer_step,
            # a quarter window (at least 1 s): covers a slow peer's last inner step. Shorter graces (5%) made a
            # straggler miss round after round: its next window starts when it adopted the swarm's state, later
            # than everyone else's, so it was late again (see README "Slow and uneven peers", known limits)
            straggler_grace_s=min(max(1.0, 0.25 * window), self.cfg.network.rendezvous_timeout) if window else 0.0,
            flagged=self.timing.is_flagged,
            stream_rate=self.stream_rate,
        )
        self._start_metrics()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.data_dir / "address", self.me.address)
        log.info("peer %s serving run %s on %s", self.identity.peer_id[:8], self.run_id.hex()[:8], self.me.address)

    def _start_metrics(self) -> None:
        if not self.metrics_listen:
            return
        from peerd import __version__
        from peerd.metrics import MetricsServer, PeerMetrics

        self.metrics = PeerMetrics(
            algorithm=self.cfg.run.algorithm,
            codec=self.cfg.codec.name,
            run_id=self.run_id.hex()[:8],
            peer_id=self.identity.peer_id[:8],
            version=__version__,
        )
        host, port = self.metrics_listen.rsplit(":", 1)
        host = host.strip("[]")
        self._metrics_server = MetricsServer(self.metrics, host, int(port), self._sd_targets)
        bound = self._metrics_server.start()
        shown = split_host(self.me.address) if host in ("0.0.0.0", "", "::") else host
        self.me.metrics_address = hostport(shown, bound)
        write_atomic(self.data_dir / "metrics_address", self.me.metrics_address)

    def _sd_targets(self) -> list[dict]:
        """Prometheus service discovery (metrics thread): reads the loop's published snapshot, never the table."""
        run = self.run_id.hex()[:8]
        return [
            {"targets": [p.metrics_address], "labels": {"peer": p.peer_id[:8], "run": run}}
            for p in self.membership.view.alive
            if p.metrics_address
        ]

    async def _start_background(self) -> None:
        assert self._stopping is not None
        self.membership.snapshot()
        self._tasks.append(asyncio.ensure_future(self.gossip.gossip_loop(self._stopping)))
        self._tasks.append(asyncio.ensure_future(self.gossip.redial_loop(self._stopping)))
        self._tasks.append(asyncio.ensure_future(self.relay_client.run()))

    def stream_rate(self, peer_id: str) -> float:
        """The median bytes/s we measured of `peer_id`'s round streams (0: none yet): the round's part size, and
        whom a state download asks first (peerd/statefetch.py)."""
        stats = self.timing.local.peers.get(peer_id)
        return stats.median("throughput") if stats is not None else 0.0

    def wait_for_peers(self, n: int, stop: threading.Event, timeout: float = 120.0) -> bool:
        """Block until `n` peers (us included) are settled members, so the first round has one leader for all; False
        when they did not all show up (then nobody waits for them at the start barrier either)."""
        deadline = time.monotonic() + timeout

        async def settled() -> int:
            return len(self.membership.settled())

        while (have := self.call(settled())) < n and not stop.is_set():
            if time.monotonic() > deadline:
                log.warning("only %d of %d peers showed up; training anyway", have, n)
                return False
            time.sleep(0.1)
        # NoLoCo: a peer nobody can propose to yet would only ever propose itself (and reachable peers would wait at
        # their boundary for it), so a swarm started together also waits until every outbound-only member's relay is
        # known, where a relay exists at all.
        while (waiting := self.call(unrelayed(self))) and not stop.is_set():
            if time.monotonic() > deadline:
                log.warning("outbound-only peers %s have no relay yet; training anyway", [w[:8] for w in waiting])
                return True
            time.sleep(0.1)
        return True

    def start_training(self, wait_peers: int) -> None:
        """Called once, right before the first inner step: with `--wait-peers N` (N > 1) wait at the start barrier
        until N peers are ready too (peerd/startbarrier.py); either way, from now on our barrier holds nobody."""
        delay = faults.start_delay()
        if delay:
            log.warning("fault injection: starting %.1fs late", delay)
            time.sleep(delay)
        if wait_peers > 1 and self.cfg.network.start_barrier:
            self.call(start_together(self, wait_peers, self.cfg.network.rendezvous_timeout))
        else:
            self.call(self.start_barrier.mark_training())

    def stop(self, leave: bool = True, drain: float = DRAIN_S) -> None:
        """Clean shutdown: announce Leave to live peers, stop serving (streams in flight get `drain` seconds), stop
        the loop. A signal-driven stop passes a short drain so the process exits within its deadline."""
        if self.loop is None or not self.loop.is_running():
            return
        self.status.state = "stopping"
        with contextlib.suppress(Exception):
            self.call(self._shutdown(leave, drain), timeout=drain + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self, leave: bool, drain: float = DRAIN_S) -> None:
        assert self._stopping is not None and self.channels is not None
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        if leave:
            self.me.left = True
            self.me.heartbeat += 1
            req = sign(pb.LeaveRequest(self=self.membership.signed_self()), "Leave", self.identity, self.run_id)
            peers = [p for p in self.membership.alive(include_self=False) if dialable(p)]
            await asyncio.gather(
                *(self.channels.membership(p.address, p).Leave(req, timeout=min(2.0, drain)) for p in peers),
                return_exceptions=True,
            )
        if self._server is not None:
            # New calls are refused at once; streams in flight (a reply a slower member is still downloading from
            # us after our own last round) get up to DRAIN_S to finish: with a 1 s grace, a peer that finished the
            # run first cut its partners' last round on slow links and made them retry without it.
            await self._server.stop(grace=drain)
        await self.channels.close()

    # -- counters (the request checks themselves live in peerd/checks.py) ---------------------------------------
    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        self.checks.invalid_contribution(peer_id, reason)

    def count_rejected(self, reason: str) -> None:
        self.checks.count_rejected(reason)

    def count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.record_failure(reason)

    def count_sent(self, kind: str, raw: int, wire: int) -> None:
        if self.metrics is not None:
            self.metrics.record_sent(kind, raw, wire)

    # -- rounds (peerd/roundclient.py) ----------------------------------------------------------------------------
    @property
    def ranked(self) -> bool:
        """DiLoCo and Streaming keep one model per run: states are ranked and rounds grouped by lineage."""
        return self.cfg.run.algorithm in ("diloco", "streaming")

    def my_claim(self) -> Claim:
        """What we hold: (work, step, digest) of the state we published (read on the loop)."""
        return Claim(int(self.me.work), int(self.me.outer_step), bytes(self.me.state_digest), self.identity.peer_id)

    def allreduce(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> RoundResult:
        """Average `vector` (1-D fp32, any device) with the peers ready for `step`. Raises Behind when the swarm has
        moved past `step`, RoundFailed when retries ran out. Blocking; call from the training thread."""
        return self.call(self.round_client.allreduce(step, vector, fragment, want_decoded, tokens, carries))

    def allreduce_async(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> concurrent.futures.Future:
        """Start a round without waiting for it (Streaming DiLoCo, and DiLoCo with `outer.overlap`, run it under
        inner steps). The future's result is a RoundResult, or it raises Behind / RoundFailed. `vector` must not be
        modified until it is done."""
        assert self.loop is not None
        coro = self.round_client.allreduce(step, vector, fragment, want_decoded, tokens, carries)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        self.round_client.book.record_round(group, result, fragment, note=note, rendezvous_s=rendezvous_s)

    def note_alone(self, included: int, expected: int) -> None:
        self.round_client.book.note_alone(included, expected)

    # -- state ---------------------------------------------------------------------------------------------------
    def publish(self, snapshot: StateSnapshot, finished: bool = False) -> None:
        """Make `snapshot` the state we serve, and gossip its claim (work, step, digest) and whether we are done.
        Called from the training thread only, which also keeps the lineage the state is served with."""
        digest = snapshot.digest
        snapshot.lineage = self._lineage_of(snapshot, digest)
        self.published = (snapshot.step, digest, snapshot.lineage)
        parts = part_digests(snapshot.tensors, snapshot.parts) if snapshot.parts else []

        def apply() -> None:
            self.snapshot = snapshot
            self.me.outer_step = snapshot.step
            self.me.state_digest = digest
            self.me.work = snapshot.work
            self.me.finished = finished
            del self.me.part_digests[:]
            self.me.part_digests.extend(parts)

        assert self.loop is not None
        self.loop.call_soon_threadsafe(apply)
        self.status.outer_step = snapshot.step

    def adopted(self, snapshot: StateSnapshot) -> None:
        """A downloaded state became ours: it keeps the lineage its server sent when we publish it."""
        self._adopted = (snapshot.digest, snapshot.lineage or ())

    def _lineage_of(self, snapshot: StateSnapshot, digest: bytes) -> Lineage:
        """Its ancestors: an adopted state's come with it; otherwise the state we published before is the last
        ancestor (Streaming publishes several states within a step: the last one of each step counts)."""
        if snapshot.lineage is not None:
            return snapshot.lineage
        if self._adopted is not None and self._adopted[0] == digest:
            return self._adopted[1]
        if self.published is None:
            return ()
        step, prev, lineage = self.published
        if step < snapshot.step:
            return ((step, prev), *lineage)[:LINEAGE_STEPS]
        return lineage

    def canonical(self, min_step: int = -1) -> Claim | None:
        """The live peers' best state claim when it outranks ours (peerd/consistency.py), else None. Called from the
        training thread; evaluated on the loop, which owns the table."""

        async def best() -> Claim | None:
            mine = self.my_claim()
            others = [claim_of(p) for p in self.membership.alive(include_self=False) if p.outer_step >= min_step]
            top = best_claim(mine, others)
            return None if top.same_state(mine) else replace(top, seen_s=self.membership.step_age(top.step))

        return self.call(best(), timeout=10.0)

    def all_finished(self, ranked: bool = True) -> bool:
        """Nobody still needs us to serve our state: no peer the run expects is still training, and (for DiLoCo and
        Streaming, `ranked`) every live finished peer holds the state we hold. A peer that finished on another state
        (its last round failed where ours succeeded) downloads ours while it lingers, so we wait for it."""

        async def check() -> bool:
            me = self.identity.peer_id
            if any(pid != me for pid in self.membership.expected()):  # expected() leaves finished peers out
                return False
            if not ranked:
                return True
            mine = self.my_claim()
            return all(
                claim_of(info).same_state(mine) for info in self.membership.alive(include_self=False) if info.finished
            )

        return self.call(check(), timeout=10.0)

    def run_peers(self) -> tuple[int, int]:
        """(live peers, peers the run expects) other than us, for "training alone" lines and the restart check."""

        async def count() -> tuple[int, int]:
            return len(self.membership.alive(include_self=False)), len(self.membership.expected()) - 1

        return self.call(count(), timeout=10.0)

    def status_message(self, redact: bool = False) -> pb.StatusResponse:
        return status_message(self, redact)

    # -- NoLoCo hooks (peerd.noloco installs `pairing`) -----------------------------------------------------------
    async def answer_match(self, request: pb.MatchRequest, sender: str) -> pb.MatchResponse:
        if self.pairing is None:
            return pb.MatchResponse(accepted=False, reason="this peer does not run NoLoCo")
        resp = await self.pairing.answer(request, sender)
        self.count_sent("rendezvous", 0, resp.ByteSize())  # NoLoCo's rendezvous: matchmaking, both directions
        return resp

    async def serve_exchange(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
        if self.pairing is None:
            raise StreamError("unsupported", "this peer does not run NoLoCo")
        async for msg in self.pairing.serve(messages):
            yield msg
