"""One peer's daemon: a grpc.aio server and client on an event loop of its own thread, plus the blocking API the
training loop calls (run a round, download state, publish state).

The training loop runs on the main thread and never touches the event loop directly: it calls the `Daemon` methods
below, which schedule coroutines on the loop and wait for their result. So the trainer waits on the network only where
the algorithm needs it, and that wait is what the loop measures as compute-idle time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peerd import bootstrap, faults, reflection, tls
from peerd.admission import Admission, AdmissionError
from peerd.allreduce import ReduceRound, RoundFailed, RoundResult
from peerd.channels import CHANNEL_OPTIONS, UNREACHABLE, Channels
from peerd.codecs import Codec, make_codec
from peerd.config import RunConfig
from peerd.consistency import AloneTracker, Claim, best_claim, claim_of, outranks
from peerd.envelope import AuthError, Verifier, set_admission_prover, sign
from peerd.identity import Identity, peer_id_of
from peerd.limits import SERVER_OPTIONS, LimitExceeded, LogThrottle, PeerLimits
from peerd.membership import Membership
from peerd.reachability import Reachability, dialable
from peerd.redial import Redialer
from peerd.relay import RelayClient, RelayServer
from peerd.rendezvous import Behind, RendezvousLeader
from peerd.robust import STRIKE_REASONS, BanList, ContributionGuard, majority_suspects
from peerd.service import MembershipService, RoundsService, StateService, _unspecified
from peerd.shutdown import DRAIN_S
from peerd.statesync import StateSnapshot, part_digests, read_state
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")
T = TypeVar("T")
AUTH_CODES = {  # envelope refusals that are not plain authentication failures
    "wrong_run": grpc.StatusCode.FAILED_PRECONDITION,
    "not_admitted": grpc.StatusCode.PERMISSION_DENIED,
    "banned": grpc.StatusCode.PERMISSION_DENIED,
}


class PeerSilent(Exception):
    """A peer a pending call depends on went silent in gossip (a split, or it died): give up on the call now."""

    def __init__(self, peer_id: str) -> None:
        super().__init__(f"{peer_id[:8]} has been silent for twice the peer timeout")
        self.peer_id = peer_id


class JoinError(RuntimeError):
    """No bootstrap address answered, or the swarm refused us (wrong run spec, not admitted)."""


@dataclass
class LocalStatus:
    """What the training loop reports; read by Status RPCs, metrics and the demo."""

    state: str = "joining"
    inner_step: int = 0
    outer_step: int = 0
    loss: float = math.nan
    eval_loss: float = math.nan
    tokens_per_second: float = 0.0
    compute_seconds: float = 0.0
    compute_idle_seconds: float = 0.0
    bytes_sent_raw: int = 0
    bytes_sent_wire: int = 0
    bytes_received_wire: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    rejected_messages: int = 0
    rejected_contributions: int = 0
    solo_steps: int = 0
    state_downloads: int = 0
    forks_healed: int = 0
    finished: bool = False
    last_round: pb.RoundSummary | None = None
    recent_rounds: deque = field(default_factory=lambda: deque(maxlen=1024))
    history: deque = field(default_factory=lambda: deque(maxlen=64))  # dicts of OuterStepRecord fields


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
        self.announce = announce
        self.data_dir = Path(data_dir)
        self.metrics_listen = metrics_listen
        self.run_id = cfg.run_id()
        self.codec: Codec = make_codec(
            cfg.codec.name,
            zstd_level=max(cfg.codec.zstd_level, 1),
            block_size=cfg.codec.block_size,
            zstd=cfg.codec.zstd_level > 0,
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
        self._refusal_log = LogThrottle()
        self.gossip_suspects: set[str] = set()  # reported banned by a majority of live peers (robust.py)
        self.verifier.gate = self._gate
        self.membership.excluded = self._excluded
        self.status = LocalStatus()
        self.snapshot: StateSnapshot | None = None
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peerd-codec")
        self.metrics: Any = None
        self._metrics_server: Any = None
        self.rounds: dict[bytes, Any] = {}
        self._round_events: dict[bytes, asyncio.Event] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self.channels: Channels | None = None
        self.leader: RendezvousLeader | None = None
        self.pairing: Any = None  # set by the NoLoCo algorithm
        self.alone = AloneTracker()
        self.redialer = Redialer(
            lambda: [p for p in self.membership.dead() if dialable(p)],  # outbound-only peers dial us again themselves
            self._redial_peer,
            self.bootstrap,
            self._redial_bootstrap,
            lambda addr: any(p.address == tls.parse_bootstrap(addr)[1] for p in self.membership.alive()),
            net.gossip_interval,
            net.redial_max,
        )
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
            self.call(self._join(join_timeout, verbose=True))
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
            interceptors=[*faults.inbound_blockers(), self.limits.interceptor(self.count_rejected)],
        )
        from peerd.v1 import peerd_pb2_grpc as rpc

        rpc.add_MembershipServicer_to_server(MembershipService(self), server)
        rpc.add_RoundsServicer_to_server(RoundsService(self), server)
        rpc.add_StateServicer_to_server(StateService(self), server)
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
        self.leader = RendezvousLeader(
            self.membership, self.run_id, self.cfg.network.rendezvous_timeout, lambda: self.status.outer_step
        )
        self._start_metrics()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.data_dir / "address", self.me.address)
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
        self._metrics_server = MetricsServer(self.metrics, host, int(port), self._sd_targets)
        bound = self._metrics_server.start()
        shown = self.me.address.rsplit(":", 1)[0] if host in ("0.0.0.0", "", "::") else host
        self.me.metrics_address = f"{shown}:{bound}"
        _write_atomic(self.data_dir / "metrics_address", self.me.metrics_address)

    def _sd_targets(self) -> list[dict]:
        """Prometheus service discovery (metrics thread): reads the loop's published snapshot, never the table."""
        run = self.run_id.hex()[:8]
        return [
            {"targets": [p.metrics_address], "labels": {"peer": p.peer_id[:8], "run": run}}
            for p in self.membership.view.alive
            if p.metrics_address
        ]

    async def _start_background(self) -> None:
        self.membership.snapshot()
        self._tasks.append(asyncio.ensure_future(self._gossip_loop()))
        self._tasks.append(asyncio.ensure_future(self._redial_loop()))
        self._tasks.append(asyncio.ensure_future(self.relay_client.run()))

    def wait_for_peers(self, n: int, stop: threading.Event, timeout: float = 120.0) -> None:
        """Block until `n` peers (us included) are settled members, so the first round has one leader for all."""
        deadline = time.monotonic() + timeout

        async def settled() -> int:
            return len(self.membership.settled())

        while (have := self.call(settled())) < n and not stop.is_set():
            if time.monotonic() > deadline:
                log.warning("only %d of %d peers showed up; training anyway", have, n)
                return
            time.sleep(0.1)

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

    # -- membership ----------------------------------------------------------------------------------------------
    async def _join(self, timeout: float, verbose: bool = False) -> None:
        """Join through the first bootstrap address that lets us in. An address where nothing answers is retried with
        backoff until `timeout`; one that answers but is not a peerd peer, or refuses us, fails at once. `verbose`
        (at start) logs each address's first failure, so a slow join is never silent; the gossip loop's healing
        calls stay quiet."""
        assert self.channels is not None
        deadline = time.monotonic() + timeout
        last = "no bootstrap address given"
        warned: set[str] = set()
        attempt = 0
        while True:
            for spec in self.bootstrap:
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
        assert self.channels is not None
        await self.reach.before_join(addr)
        req = sign(
            pb.JoinRequest(self=self.membership.signed_self(), run_spec_json=self.cfg.spec_json(), dialed_address=addr),
            "Join",
            self.identity,
            self.run_id,
        )
        try:
            resp = await self.channels.membership(addr, peer).Join(req, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE or exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED):
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise bootstrap.NotPeerd("a gRPC server without peerd's Membership service") from exc
                if self.tls is None:  # with TLS the certificate already showed a peer is there: just retry
                    await bootstrap.classify(addr, secure=False)
                raise bootstrap.NoAnswer(f"{exc.code().name} {exc.details()}") from exc
            raise JoinError(f"{addr} refused us: {exc.details()}") from exc
        if _unspecified(self.me.address) and resp.observed_address:
            self.me.address = f"{resp.observed_address}:{self.me.address.rsplit(':', 1)[-1]}"
            self.me.heartbeat += 1
            _write_atomic(self.data_dir / "address", self.me.address)
        self.merge_gossip(resp.peers)
        log.info("joined through %s: %d peers known", addr, len(self.membership.alive()) - 1)

    async def _bootstrap_address(self, spec: str) -> tuple[str, pb.PeerInfo | None]:
        """'PEERID@host:port' or 'host:port' -> the address to dial and, with TLS, the peer found there: its
        certificate is read and checked first (pinned to PEERID, or trusted on first use) so the Join goes only to
        the peer it should. The Join dials with exactly that certificate: a stale one gossiped for the address
        (the peer restarted with a new TLS key) would fail the handshake and fill the log with gRPC's complaints."""
        assert self.channels is not None
        pinned, addr = tls.parse_bootstrap(spec)
        if self.tls is None:
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
        self.channels.pin(addr, cert)
        return addr, pb.PeerInfo(peer_id=pid, public_key=tls.bound_key(cert), tls_cert=cert, address=addr)

    async def _gossip_loop(self) -> None:
        assert self._stopping is not None
        interval = self.cfg.network.gossip_interval
        while not self._stopping.is_set():
            await asyncio.sleep(interval * random.uniform(0.7, 1.0))
            self.membership.bump()
            self._refresh_suspects()
            others = self.reach.dial_targets(self.membership.alive(include_self=False))
            self.reach.tick(others)
            targets = random.sample(others, min(3, len(others)))
            if targets:
                await asyncio.gather(*(self._gossip_one(p) for p in targets))
            view = self.membership.snapshot()
            if self.metrics is not None:
                self.metrics.known_peers.set(view.known)
                self.metrics.alive_peers.set(len(view.alive))
                self.metrics.expected_peers.set(len(view.expected))
                self.metrics.work.set(self.me.work)

    async def _redial_loop(self) -> None:
        """Dead peers and bootstrap addresses, re-dialled with backoff for the life of the run (peerd/redial.py)."""
        assert self._stopping is not None
        while not self._stopping.is_set():
            await asyncio.sleep(self.cfg.network.gossip_interval * random.uniform(0.5, 1.0))
            before = self.redialer.dials
            with contextlib.suppress(Exception):
                await self.redialer.tick()
            if self.metrics is not None and self.redialer.dials > before:
                self.metrics.redials.inc(self.redialer.dials - before)

    async def _redial_peer(self, peer: pb.PeerInfo) -> bool:
        ok = await self._gossip_one(peer, mark=False)
        if ok:
            log.info("peer %s at %s answers again: rejoined its part of the swarm", peer.peer_id[:8], peer.address)
        return ok

    async def _redial_bootstrap(self, spec: str) -> bool:
        try:
            addr, peer = await self._bootstrap_address(spec)
            await self._join_one(addr, peer, timeout=max(2.0, self.cfg.network.gossip_interval))
        except (OSError, TimeoutError, tls.TlsError, bootstrap.NoAnswer, bootstrap.NotPeerd, JoinError):
            return False
        return True

    async def _gossip_one(self, peer: pb.PeerInfo, mark: bool = True) -> bool:
        assert self.channels is not None
        req = sign(pb.GossipRequest(peers=self.membership.gossip_view()), "Gossip", self.identity, self.run_id)
        try:
            resp = await self.channels.membership(peer.address, peer).Gossip(
                req, timeout=max(2.0, self.cfg.network.gossip_interval)
            )
        except grpc.aio.AioRpcError as exc:
            if mark and exc.code() in UNREACHABLE:
                self.membership.mark_unreachable(peer.peer_id)
            self.count_sent("gossip", 0, req.ByteSize())
            return False
        self.count_sent("gossip", 0, req.ByteSize())
        self.merge_gossip(resp.peers)
        self.reach.observe(peer, resp.observed_address)
        return True

    def merge_gossip(self, peers: Any) -> list[str]:
        """Merge gossiped entries; entries not signed by the peer they describe are refused and counted."""
        before = self.membership.forged
        new = self.membership.merge(peers)
        for _ in range(self.membership.forged - before):
            self.count_rejected("forged_entry")
        if self.membership.forged > before:
            shown, _ = self._refusal_log.allow("forged_entry")
            if shown:
                log.warning("refused gossip entries not signed by the peer they describe (forged_entry)")
        return new

    def adopt_address(self, dialed: str) -> None:
        """A joiner reached us at `dialed`: if we do not know our public address yet, that is it."""
        if _unspecified(self.me.address) and dialed and not _unspecified(dialed):
            self.me.address = dialed
            self.me.heartbeat += 1
            _write_atomic(self.data_dir / "address", self.me.address)
            log.info("learned our public address from a joiner: %s", dialed)

    # -- request checks ------------------------------------------------------------------------------------------
    async def verify(self, msg: Any, method: str, context: grpc.aio.ServicerContext) -> str:
        """Check a request's envelope, admission and bans, then charge the verified sender's rate budget."""
        try:
            sender = self.verifier.verify(method, msg)
            self.limits.check_rate(f"key:{sender}")
            return sender
        except AuthError as exc:
            await self.refuse(
                context, exc.reason, AUTH_CODES.get(exc.reason, grpc.StatusCode.UNAUTHENTICATED), str(exc)
            )
        except LimitExceeded as exc:
            await self.refuse(context, exc.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {exc}")

    async def refuse(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode, msg: str) -> NoReturn:
        self.count_rejected(reason)
        shown, suppressed = self._refusal_log.allow(reason)
        if shown:
            more = f" ({suppressed} more refused for this reason were not logged)" if suppressed else ""
            log.warning("refused a request (%s): %s%s", reason, msg, more)
        await context.abort(code, msg)
        raise AssertionError("unreachable")  # context.abort raises

    async def admit(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> None:
        """Admission control for a Join whose signature and run already checked out (peerd/admission.py). A refused
        joiner gets the reason and nothing else: no peer list, no run state."""
        try:
            self._gate(request.auth)
        except AuthError as exc:
            await self.refuse(context, exc.reason, grpc.StatusCode.PERMISSION_DENIED, f"Join refused: {exc}")

    def _gate(self, auth: pb.Auth) -> None:
        """Verifier gate: may this key speak in this run at all? (bans first: they are the cheaper check)"""
        pid = peer_id_of(auth.public_key)
        if self.bans.is_banned(pid):
            raise AuthError("banned", "banned: this peer sent invalid data repeatedly")
        try:
            self.admission.check(auth)
        except AdmissionError as exc:
            raise AuthError("not_admitted", str(exc)) from None

    def _excluded(self, peer_id: str) -> bool:
        """Left out of rounds and leader choice: banned by us, or reported banned by most of the swarm."""
        return self.bans.is_banned(peer_id) or peer_id in self.gossip_suspects

    def _refresh_suspects(self) -> None:
        """Gossip our bans, and recompute whom a strict majority of live peers reports banned."""
        banned = self.bans.banned()
        if list(self.me.suspects) != banned:
            del self.me.suspects[:]
            self.me.suspects.extend(banned)
        views = {e.info.peer_id: list(e.info.suspects) for e in self.membership.entries.values()
                 if self.membership.is_alive(e.info.peer_id) or e.info.peer_id in self.gossip_suspects}  # fmt: skip
        views[self.identity.peer_id] = banned
        self.gossip_suspects = majority_suspects(views) - {self.identity.peer_id}

    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        """A round found `peer_id`'s signed data invalid (too large, undecodable): count it and maybe ban."""
        self.count_rejected(reason)
        self.suspect(peer_id, reason)

    def count_rejected(self, reason: str) -> None:
        self.status.rejected_messages += 1
        if self.metrics is not None:
            self.metrics.record_rejected(reason)

    def suspect(self, peer_id: str, reason: str) -> None:
        """`peer_id` signed and sent invalid data. Offences it cannot deny (robust.STRIKE_REASONS) count towards a
        ban; transport trouble does not."""
        log.warning("peer %s sent invalid data (%s)", peer_id[:8], reason)
        if reason not in STRIKE_REASONS or peer_id == self.identity.peer_id:
            return
        self.status.rejected_contributions += 1
        if self.bans.strike(peer_id):
            log.warning(
                "banned peer %s for %.0fs: it sent invalid data %d times; its requests are refused and its id is "
                "gossiped as suspect",
                peer_id[:8],
                self.cfg.security.ban_seconds,
                self.cfg.security.ban_after,
            )
            self.membership.mark_unreachable(peer_id)
            self._refresh_suspects()

    def count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.record_failure(reason)

    def count_sent(self, kind: str, raw: int, wire: int) -> None:
        if self.metrics is not None:
            self.metrics.record_sent(kind, raw, wire)

    def log(self, msg: str) -> None:
        log.info(msg)

    # -- rendezvous and rounds -----------------------------------------------------------------------------------
    async def lead_rendezvous(self, request: pb.RendezvousRequest, info: pb.PeerInfo) -> pb.RendezvousResponse:
        assert self.leader is not None
        if request.fragment < 0 and self.status.outer_step < request.step <= self._plausible_step() + 1:
            # Only a step the swarm could be at closes earlier groups: one peer claiming step 10**9 must not make
            # every pending group resync (the median of live peers' gossiped steps cannot be moved by a minority).
            self.leader.on_ahead(request.step)
        # Lead unless a lower settled id exists that the requester does not suspect: after a failed round its
        # members skip the peer they blame, and redirecting them back to it made each lead a group of its own.
        # Any lower live peer, settled or not, takes the lead: requesters pick among settled peers, and a peer that
        # only just joined (settled in one requester's view, not yet in another's) would otherwise make two leaders.
        excluded = set(request.suspects) - {self.identity.peer_id}
        leader = next(p for p in self.membership.alive() if p.peer_id not in excluded and dialable(p))
        if leader.peer_id < self.identity.peer_id:
            return pb.RendezvousResponse(redirect=leader)
        theirs = Claim(int(request.work), int(request.step), bytes(request.state_digest))
        behind = self.status.outer_step > request.step and outranks(self.my_claim(), theirs)
        lineage = bytes(request.state_digest) if self.ranked else b""
        return await self.leader.join(
            request.step, request.fragment, info, list(request.suspects), bytes(request.failed_round), behind, lineage
        )

    def _plausible_step(self) -> int:
        steps = sorted(p.outer_step for p in self.membership.alive())
        return steps[(len(steps) - 1) // 2] if steps else self.status.outer_step  # the lower median

    @property
    def ranked(self) -> bool:
        """DiLoCo and Streaming keep one model per run: states are ranked and rounds grouped by lineage."""
        return self.cfg.run.algorithm in ("diloco", "streaming")

    def my_claim(self) -> Claim:
        """What we hold: (work, step, digest) of the state we published (read on the loop)."""
        return Claim(int(self.me.work), int(self.me.outer_step), bytes(self.me.state_digest), self.identity.peer_id)

    async def _rendezvous(
        self, step: int, fragment: int, attempt: int, suspects: set[str], failed_round: bytes
    ) -> pb.RendezvousResponse:
        assert self.leader is not None and self.channels is not None
        tried = set(suspects)
        gone: set[str] = set()  # leaders we could not reach: named to the next one, so it leads instead of sending
        # us back to a peer it has not noticed is dead (that made two survivors lead groups of one each)
        target: pb.PeerInfo | None = None
        # The leader may extend a group's deadline twice while it waits for a quorum (rendezvous.py); a shorter wait
        # here made members give up on a live leader, lead themselves and split the swarm.
        timeout = 3 * self.cfg.network.rendezvous_timeout + 10.0
        for _ in range(16):
            if target is None:
                # outbound-only peers never lead: nobody could dial them
                candidates = [p for p in self.membership.settled() if p.peer_id not in tried and dialable(p)]
                if not candidates and self.me.outbound_only:
                    if await self.reach.wait_for_dialable(self.cfg.network.rendezvous_timeout):
                        continue
                    raise RoundFailed("no reachable peer to lead the round: this peer cannot be dialled either")
                target = candidates[0] if candidates else self.me
                if target.peer_id == self.identity.peer_id:
                    # The rule a leader applies to others applies to us: lead only while no lower live peer exists,
                    # settled or not, or we would wait in a group everyone else is redirected away from.
                    lower = [
                        p
                        for p in self.membership.alive()
                        if p.peer_id < target.peer_id and p.peer_id not in tried and dialable(p)
                    ]
                    target = lower[0] if lower else target
            if target.peer_id == self.identity.peer_id:
                lineage = bytes(self.me.state_digest) if self.ranked else b""
                return await self.leader.join(step, fragment, self.me, sorted(suspects), failed_round, False, lineage)
            mine = self.my_claim()
            req = sign(
                pb.RendezvousRequest(
                    step=step,
                    attempt=attempt,
                    suspects=sorted(suspects | gone),
                    fragment=fragment,
                    failed_round=failed_round,
                    work=mine.work,
                    state_digest=mine.digest,
                ),
                "Rendezvous",
                self.identity,
                self.run_id,
            )
            try:
                call = self.channels.rounds(target.address, target).Rendezvous(req, timeout=timeout)
                resp = await self._unless_silent(call, [target.peer_id])
            except PeerSilent as exc:
                log.warning("round leader %s went silent (%s); trying the next", target.peer_id[:8], exc)
                tried.add(target.peer_id)
                gone.add(target.peer_id)
                target = None
                continue
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in UNREACHABLE:
                    raise RoundFailed(f"rendezvous refused by {target.peer_id[:8]}: {exc.details()}") from exc
                log.warning("round leader %s unreachable (%s); trying the next", target.peer_id[:8], exc.code().name)
                tried.add(target.peer_id)
                gone.add(target.peer_id)
                self.membership.mark_unreachable(target.peer_id)
                target = None
                continue
            if resp.WhichOneof("result") == "redirect":
                nxt = resp.redirect
                if nxt.peer_id in gone:  # it has not noticed yet: ask again, naming the dead leader
                    await asyncio.sleep(0.05)
                    continue
                if nxt.peer_id >= target.peer_id or nxt.peer_id in tried:
                    tried.add(target.peer_id)
                    target = None
                else:
                    self.merge_gossip([nxt])
                    target = nxt
                continue
            return resp
        raise RoundFailed("rendezvous did not settle on a leader")

    async def wait_round(self, round_id: bytes) -> Any:
        """A member may start streaming to us before our own rendezvous answer arrived: wait for it, briefly."""
        rnd = self.rounds.get(round_id)
        if rnd is not None:
            return rnd
        if len(self._round_events) > 256:
            return None
        ev = self._round_events.setdefault(round_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), self.cfg.network.rendezvous_timeout + 10.0)
        self._round_events.pop(round_id, None)
        return self.rounds.get(round_id)

    async def _unless_silent(self, work: Any, peers: list[str], on_silent: Callable[[str], None] | None = None) -> Any:
        """Await `work` (an RPC or a round), but give up as soon as one of `peers` has been silent in gossip for
        twice the peer timeout: across a network split a call neither fails nor answers until its deadline (3x
        the rendezvous timeout, or the round timeout), and every second spent there is a second not training.
        Twice the timeout, so gossip delayed behind a bulk transfer on a slow link does not abort a healthy round.
        `on_silent` (a round's abort) lets the work end itself; without it the call is cancelled (PeerSilent)."""
        task = asyncio.ensure_future(work)
        limit = 2 * self.cfg.network.peer_timeout
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.cfg.network.gossip_interval)
                if done:
                    return task.result()
                silent = next((pid for pid in peers if self.membership.silent_for(pid) > limit), None)
                if silent is not None:
                    if on_silent is None:
                        raise PeerSilent(silent)
                    on_silent(silent)
                    peers = [p for p in peers if p != silent]
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def fail_round_with(self, round_id: bytes, peer_id: str, reason: str) -> None:
        """A member of our round `round_id` is refused here (banned, not admitted): abort the round naming it."""
        rnd = self.rounds.get(round_id)
        if isinstance(rnd, ReduceRound) and peer_id in rnd.ids:
            rnd.abort(RoundFailed(f"member {peer_id[:8]} is refused here ({reason})", {peer_id}, reason))

    def register_round(self, round_id: bytes, rnd: Any) -> None:
        assert self.loop is not None
        self.rounds[round_id] = rnd
        ev = self._round_events.get(round_id)
        if ev is not None:
            ev.set()
        self.loop.call_later(self.cfg.network.round_timeout, self.rounds.pop, round_id, None)

    def stub_for(self, member: pb.PeerInfo) -> Any:
        assert self.channels is not None
        return self.channels.rounds(member.address, member)

    def allreduce(self, step: int, vector: torch.Tensor, fragment: int = -1, want_decoded: bool = False) -> RoundResult:
        """Average `vector` (1-D fp32, any device) with the peers ready for `step`. Raises Behind when the swarm has
        moved past `step`, RoundFailed when retries ran out. Blocking; call from the training thread."""
        return self.call(self._allreduce(step, vector, fragment, want_decoded))

    def allreduce_async(self, step: int, vector: torch.Tensor, fragment: int = -1) -> concurrent.futures.Future:
        """Start a round without waiting for it (Streaming DiLoCo overlaps it with inner steps). The future's
        result is a RoundResult, or it raises Behind / RoundFailed. `vector` must not be modified until it is done."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(self._allreduce(step, vector, fragment), self.loop)

    async def _allreduce(
        self, step: int, vector: torch.Tensor, fragment: int, want_decoded: bool = False
    ) -> RoundResult:
        suspects: set[str] = set()
        failed_round = b""
        t0 = time.perf_counter()
        for attempt in range(6):
            t_rv = time.perf_counter()
            resp = await self._rendezvous(step, fragment, attempt, suspects, failed_round)
            if resp.WhichOneof("result") == "behind":
                raise Behind(resp.behind)
            group = resp.group
            rendezvous_s = time.perf_counter() - t_rv
            rnd = ReduceRound(
                group,
                self.identity,
                self.run_id,
                vector,
                self.codec,
                self.executor,
                self.cfg.network.round_timeout,
                self.cfg.network.chunk_bytes,
                want_decoded,
                guard=self.guard,
                on_invalid=self.invalid_contribution,
            )
            self.register_round(group.round_id, rnd)
            # A group may hold a peer we banned (the leader has not): we still take part, so that every honest owner
            # sees that peer's data and bans it too; its streams to us are refused, which fails the round at once.
            try:
                result = await self._unless_silent(
                    rnd.run(self.stub_for, self.verifier),
                    [m.peer_id for m in group.members],
                    lambda pid, rnd=rnd: rnd.abort(RoundFailed(f"member {pid[:8]} went silent", {pid}, "peer_lost")),
                )
            except RoundFailed as exc:
                failed_round = bytes(group.round_id)
                self.status.rounds_failed += 1
                if self.metrics is not None:
                    self.metrics.record_failure(exc.reason)
                    self.metrics.record_round("failed", peers=0, total_seconds=time.perf_counter() - t0)
                suspects |= exc.suspects - {self.identity.peer_id}
                if exc.reason != "aborted":  # "aborted" suspects are another member's word: skip them, no more
                    for s in exc.suspects:
                        self.membership.mark_unreachable(s)
                log.warning("round for step %d (attempt %d) failed: %s; retrying", step, attempt, exc)
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            result.stats.seconds = time.perf_counter() - t0
            # Done: every contribution to our shard arrived and every reply left, so nothing will look the round up
            # again; keeping it (and its tensors) for the whole round_timeout held hundreds of MB in fast swarms.
            assert self.loop is not None
            self.loop.call_later(1.0, self.rounds.pop, group.round_id, None)
            if fragment < 0:  # they all finished `step` with us: do not wait for gossip to say so
                for m in group.members:
                    self.membership.note_step(m.peer_id, step + 1)
            self.record_round(group, result, fragment, rendezvous_s=rendezvous_s)
            return result
        raise RoundFailed(f"round for step {step} failed {attempt + 1} times")

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        s = result.stats
        # DiLoCo and Streaming rounds (recorded on the loop) are judged against the run, not the shrunken live set:
        # peers seen live within network.forget_after count as expected, so a round held by one half of a split is
        # partial, and a round of one is a solo step. NoLoCo's rounds are pairs by design and judged by their group
        # (recorded from the training thread, which never reads the table); it counts its own solo steps.
        run_level = self.cfg.run.algorithm in ("diloco", "streaming")
        expected = sorted(set(group.expected) | set(self.membership.expected())) if run_level else list(group.expected)
        partial = result.partial or len(set(result.included)) < len(expected)
        solo = len(set(result.included)) <= 1
        solo_step = run_level and solo  # NoLoCo keeps its old accounting: a lost partner is a partial step
        summary = pb.RoundSummary(
            step=group.step,
            algorithm=self.cfg.run.algorithm,
            included=result.included,
            expected=expected,
            partial=partial,
            raw_bytes=s.raw_bytes,
            wire_bytes=s.wire_bytes,
            seconds=s.seconds,
            note=note,
            fragment=fragment,
        )
        self.status.last_round = summary
        self.status.recent_rounds.append(summary)
        self.status.bytes_sent_raw += s.raw_bytes
        self.status.bytes_sent_wire += s.wire_bytes
        self.status.bytes_received_wire += s.received_wire_bytes
        if run_level:  # NoLoCo says "no partner ...; stepped alone" for each such step itself
            self.note_alone(len(set(result.included)), len(expected))
        if solo_step:
            self.status.solo_steps += 1
        elif partial:
            self.status.rounds_partial += 1
            missing = sorted(set(expected) - set(result.included))
            log.warning(
                "step %d: PARTIAL round: averaged %d of %d expected peers (missing %s)",
                group.step,
                len(result.included),
                len(expected),
                [m[:8] for m in missing],
            )
        if self.metrics is not None:
            m = self.metrics
            outcome = "solo" if solo_step or (solo and not partial) else ("partial" if partial else "complete")
            m.record_round(
                outcome,
                peers=len(result.included),
                total_seconds=s.seconds,
                rendezvous_seconds=rendezvous_s,
                exchange_seconds=max(s.seconds - rendezvous_s, 0.0),
            )
            kind = "pair" if self.cfg.run.algorithm == "noloco" else "reduce"
            m.record_sent(kind, s.raw_bytes, s.wire_bytes)
            m.record_received(kind, s.received_wire_bytes * s.raw_bytes // max(s.wire_bytes, 1), s.received_wire_bytes)

    # -- state ---------------------------------------------------------------------------------------------------
    def publish(self, snapshot: StateSnapshot, finished: bool = False) -> None:
        """Make `snapshot` the state we serve, and gossip its claim (work, step, digest) and whether we are done."""
        digest = snapshot.digest
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

    def canonical(self, min_step: int = -1) -> Claim | None:
        """The live peers' best state claim when it outranks ours (peerd/consistency.py), else None. Called from the
        training thread; evaluated on the loop, which owns the table."""

        async def best() -> Claim | None:
            mine = self.my_claim()
            others = [claim_of(p) for p in self.membership.alive(include_self=False) if p.outer_step >= min_step]
            top = best_claim(mine, others)
            return None if top.same_state(mine) else top

        return self.call(best(), timeout=10.0)

    def swarm_step(self) -> int:
        """The newest outer step any live peer reports (NoLoCo catches up to it; it has no single model to rank)."""

        async def newest() -> int:
            return max((p.outer_step for p in self.membership.alive(include_self=False)), default=-1)

        return self.call(newest(), timeout=10.0)

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

    def note_alone(self, included: int, expected: int) -> None:
        line = self.alone.update(included, expected)
        if line is not None:
            (log.warning if included <= 1 else log.info)(line)
        if self.metrics is not None:
            self.metrics.alone.set(1 if self.alone.alone_since is not None else 0)

    def fetch_state(
        self,
        min_step: int,
        expected: dict[str, tuple[int, ...]],
        timeout: float = 120.0,
        better: bool = False,
        base: dict[str, torch.Tensor] | None = None,
        parts: list[list[tuple[int, int]]] | None = None,
    ) -> StateSnapshot:
        """Download the canonical global state (at least `min_step`) from a live peer that holds it. `better`: only
        a state that outranks ours (a peer asked to resync never adopts a worse state than its own). With `base` (our
        state) and `parts` (its fragments' ranges), only the fragments whose gossiped digests differ from ours are
        downloaded and patched in; the whole-state digest is checked after patching."""
        return self.call(self._fetch_state(min_step, expected, timeout, better, base, parts))

    def _differing_ranges(
        self, holder: pb.PeerInfo, base: dict[str, torch.Tensor] | None, parts: list[list[tuple[int, int]]] | None
    ) -> list[tuple[int, int]] | None:
        """The element ranges of the fragments where `holder`'s state differs from `base`; None: download it all."""
        if not base or not parts or len(holder.part_digests) != len(parts):
            return None
        mine = part_digests(base, parts)
        ranges = [r for p, theirs in enumerate(holder.part_digests) if theirs != mine[p] for r in parts[p]]
        return ranges or None

    async def _fetch_state(
        self,
        min_step: int,
        expected: dict[str, tuple[int, ...]],
        timeout: float,
        better: bool = False,
        base: dict[str, torch.Tensor] | None = None,
        parts: list[list[tuple[int, int]]] | None = None,
    ) -> StateSnapshot:
        assert self.channels is not None
        deadline = time.monotonic() + timeout
        errors: list[str] = []
        while time.monotonic() < deadline:
            mine = self.my_claim()
            live = [
                p
                for p in self.membership.alive(include_self=False)
                if p.outer_step >= min_step
                and p.state_digest
                and dialable(p)
                and (not better or outranks(claim_of(p), mine))
            ]
            if self.me.outbound_only and not await self.reach.wait_for_dialable(deadline - time.monotonic()):
                break  # nobody we could download from
            # The highest-ranked claim first (the split-brain rule), then the holders of the state most peers
            # hold: among claims of equal rank, the one more peers vouch for.
            votes: dict[bytes, int] = {}
            for p in live:
                votes[bytes(p.state_digest)] = votes.get(bytes(p.state_digest), 0) + 1
            peers = sorted(live, key=lambda p: (claim_of(p).rank, votes[bytes(p.state_digest)]), reverse=True)
            for p in peers:
                ranges = self._differing_ranges(p, base, parts)
                flat = [v for pair in ranges or () for v in pair]
                req = sign(pb.StateRequest(min_step=min_step, ranges=flat), "Download", self.identity, self.run_id)
                call = self.channels.state(p.address, p).Download(req, timeout=max(deadline - time.monotonic(), 1.0))
                try:
                    snap = await read_state(call.__aiter__(), expected, p.public_key, base, ranges)
                    if p.state_digest and snap.step == p.outer_step and snap.digest != p.state_digest:
                        raise StreamError("bad_digest", "served state does not match the digest it gossiped")
                except (grpc.aio.AioRpcError, StreamError, StopAsyncIteration) as exc:
                    errors.append(f"{p.peer_id[:8]}: {exc}")
                    if isinstance(exc, StreamError):
                        self.count_rejected(exc.reason)
                    continue
                what = f"{len(ranges)} changed slices" if ranges else "whole"
                log.info("downloaded state at step %d (work %d, %s) from %s", snap.step, snap.work, what, p.peer_id[:8])
                self.status.state_downloads += 1
                return snap
            await asyncio.sleep(0.5)
        raise RoundFailed(f"no peer served state at step >= {min_step}: {errors[-3:]}")

    # -- status --------------------------------------------------------------------------------------------------
    def status_message(self, redact: bool = False) -> pb.StatusResponse:
        """This peer's view. `redact` (a caller not admitted to a non-open run) withholds every other peer's id and
        address: the peer list, the live set and round membership."""
        s = self.status
        msg = pb.StatusResponse(
            run_id=self.run_id.hex(),
            peer_id=self.identity.peer_id,
            address=self.me.address,
            algorithm=self.cfg.run.algorithm,
            codec=self.cfg.codec.name,
            outer_step=s.outer_step,
            inner_step=s.inner_step,
            loss=s.loss,
            eval_loss=s.eval_loss,
            tokens_per_second=s.tokens_per_second,
            peers=self.membership.gossip_view(),
            alive=[p.peer_id for p in self.membership.alive()],
            last_round=s.last_round,
            bytes_sent_raw=s.bytes_sent_raw,
            bytes_sent_wire=s.bytes_sent_wire,
            bytes_received_wire=s.bytes_received_wire,
            compute_idle_seconds=s.compute_idle_seconds,
            compute_seconds=s.compute_seconds,
            rounds_partial=s.rounds_partial,
            rounds_failed=s.rounds_failed,
            rejected_messages=s.rejected_messages,
            solo_steps=s.solo_steps,
            recent_rounds=list(s.recent_rounds)[-16:],
            finished=s.finished,
            state=s.state,
            history=[pb.OuterStepRecord(**h) for h in list(s.history)[-16:]],
            banned=self.bans.banned(),
            rejected_contributions=s.rejected_contributions,
            work=self.me.work,
            state_downloads=s.state_downloads,
            forks_healed=s.forks_healed,
            alone_since=self.alone.status,
            expected=self.membership.expected(),
            reachability=self.reach.line(),
            relayed_bytes=self.relay_server.relayed_bytes,
        )
        if redact:
            msg.redacted = True
            for name in ("peers", "alive", "banned", "expected"):
                msg.ClearField(name)
            for rnd in [*([msg.last_round] if msg.HasField("last_round") else []), *msg.recent_rounds]:
                rnd.ClearField("included")
                rnd.ClearField("expected")
        return msg

    # -- NoLoCo hooks (peerd.noloco installs `pairing`) -----------------------------------------------------------
    async def answer_match(self, request: pb.MatchRequest, sender: str) -> pb.MatchResponse:
        if self.pairing is None:
            return pb.MatchResponse(accepted=False, reason="this peer does not run NoLoCo")
        return await self.pairing.answer(request, sender)

    async def serve_exchange(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
        if self.pairing is None:
            raise StreamError("unsupported", "this peer does not run NoLoCo")
        async for msg in self.pairing.serve(messages):
            yield msg


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
