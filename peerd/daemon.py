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
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from peerd import faults, tls
from peerd.admission import Admission, AdmissionError
from peerd.allreduce import ReduceRound, RoundFailed, RoundResult
from peerd.channels import CHANNEL_OPTIONS, Channels
from peerd.codecs import Codec, make_codec
from peerd.config import RunConfig
from peerd.envelope import AuthError, Verifier, set_admission_prover, sign
from peerd.identity import Identity, peer_id_of
from peerd.limits import SERVER_OPTIONS, LimitExceeded, LogThrottle, PeerLimits
from peerd.membership import Membership
from peerd.reachability import Reachability, dialable
from peerd.relay import RelayClient, RelayServer
from peerd.rendezvous import Behind, RendezvousLeader
from peerd.robust import STRIKE_REASONS, BanList, ContributionGuard, majority_suspects
from peerd.service import MembershipService, RoundsService, StateService, _unspecified
from peerd.statesync import StateSnapshot, read_state
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")
DRAIN_S = 10.0  # at shutdown, how long streams in flight may take to finish (a 17 MB reply at 20 Mbit/s: ~7 s)
T = TypeVar("T")
UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
AUTH_CODES = {  # envelope refusals that are not plain authentication failures
    "wrong_run": grpc.StatusCode.FAILED_PRECONDITION,
    "not_admitted": grpc.StatusCode.PERMISSION_DENIED,
    "banned": grpc.StatusCode.PERMISSION_DENIED,
}


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
        self.membership = Membership(self.me, net.peer_timeout, settle_s=min(3.0, 3 * net.gossip_interval))
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
        self.reach = Reachability(self)  # can others dial us? (peerd/reachability.py)
        self.relay_server, self.relay_client = RelayServer(self), RelayClient(self)  # peerd/relay.py

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, join_timeout: float = 60.0) -> None:
        """Start serving, then join the swarm through a bootstrap address (if any). Blocks until both are done."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="peerd-loop", daemon=True)
        self._thread.start()
        ready.wait()
        self.call(self._start_server())
        if self.bootstrap:
            self.call(self._join(join_timeout))
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
            options=CHANNEL_OPTIONS + SERVER_OPTIONS,
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
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        if self.tls is not None:
            port = server.add_secure_port(self.listen, self.tls.server_credentials())
        else:
            port = server.add_insecure_port(self.listen)
        if port == 0:
            raise OSError(f"cannot listen on {self.listen}")
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
        run = self.run_id.hex()[:8]
        return [
            {"targets": [p.metrics_address], "labels": {"peer": p.peer_id[:8], "run": run}}
            for p in self.membership.alive()
            if p.metrics_address
        ]

    async def _start_background(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._gossip_loop()))
        self._tasks.append(asyncio.ensure_future(self.relay_client.run()))

    def wait_for_peers(self, n: int, stop: threading.Event, timeout: float = 120.0) -> None:
        """Block until `n` peers (us included) are settled members, so the first round has one leader for all."""
        deadline = time.monotonic() + timeout
        while len(self.membership.settled()) < n and not stop.is_set():
            if time.monotonic() > deadline:
                log.warning("only %d of %d peers showed up; training anyway", len(self.membership.settled()), n)
                return
            time.sleep(0.1)

    def stop(self, leave: bool = True) -> None:
        """Clean shutdown: announce Leave to live peers, stop serving, stop the loop."""
        if self.loop is None or not self.loop.is_running():
            return
        self.status.state = "stopping"
        with contextlib.suppress(Exception):
            self.call(self._shutdown(leave), timeout=DRAIN_S + 15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._metrics_server is not None:
            self._metrics_server.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self, leave: bool) -> None:
        assert self._stopping is not None and self.channels is not None
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        if leave:
            self.me.left = True
            self.me.heartbeat += 1
            req = sign(pb.LeaveRequest(self=self.me), "Leave", self.identity, self.run_id)
            peers = [p for p in self.membership.alive(include_self=False) if dialable(p)]
            await asyncio.gather(
                *(self.channels.membership(p.address, p).Leave(req, timeout=2) for p in peers), return_exceptions=True
            )
        if self._server is not None:
            # New calls are refused at once; streams in flight (a reply a slower member is still downloading from
            # us after our own last round) get up to DRAIN_S to finish: with a 1 s grace, a peer that finished the
            # run first cut its partners' last round on slow links and made them retry without it.
            await self._server.stop(grace=DRAIN_S)
        await self.channels.close()

    # -- membership ----------------------------------------------------------------------------------------------
    async def _join(self, timeout: float) -> None:
        """Join through the first bootstrap address that answers; retry until `timeout`."""
        assert self.channels is not None
        deadline = time.monotonic() + timeout
        last = "no bootstrap address given"
        while time.monotonic() < deadline:
            for spec in self.bootstrap:
                try:
                    addr = await self._bootstrap_address(spec)
                except (OSError, TimeoutError, tls.TlsError) as exc:
                    last = f"{spec}: {exc}"
                    continue
                await self.reach.before_join(addr)
                req = sign(
                    pb.JoinRequest(self=self.me, run_spec_json=self.cfg.spec_json(), dialed_address=addr),
                    "Join",
                    self.identity,
                    self.run_id,
                )
                try:
                    resp = await self.channels.membership(addr).Join(req, timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in UNREACHABLE:
                        last = f"{addr}: {exc.code().name} {exc.details()}"
                        continue
                    raise JoinError(f"{addr} refused us: {exc.details()}") from exc
                if _unspecified(self.me.address) and resp.observed_address:
                    self.me.address = f"{resp.observed_address}:{self.me.address.rsplit(':', 1)[-1]}"
                    self.me.heartbeat += 1
                    _write_atomic(self.data_dir / "address", self.me.address)
                self.membership.merge(resp.peers)
                log.info("joined through %s: %d peers known", addr, len(self.membership.alive()) - 1)
                return
            await asyncio.sleep(0.5)
        raise JoinError(f"could not reach any bootstrap address within {timeout:.0f}s ({last})")

    async def _bootstrap_address(self, spec: str) -> str:
        """'PEERID@host:port' or 'host:port' -> the address to dial; with TLS, read and check the certificate there
        first (pinned to PEERID, or trusted on first use) so the Join goes only to the peer it should."""
        assert self.channels is not None
        pinned, addr = tls.parse_bootstrap(spec)
        if self.tls is None:
            if pinned is not None:
                log.warning("--insecure: cannot check that %s is peer %s", addr, pinned[:8])
            return addr
        cert = await tls.fetch_cert(addr, timeout=5.0)
        pid = tls.verify_cert(cert)
        if pinned is not None and pid != pinned:
            raise JoinError(f"bootstrap {addr} is peer {pid}, not the expected {pinned}: refusing to join through it")
        if pinned is None:
            log.info(
                "bootstrap %s is peer %s (trusted on first use; pin it with --bootstrap %s@%s)", addr, pid, pid, addr
            )
        self.channels.pin(addr, cert)
        return addr

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
            elif self.bootstrap:
                with contextlib.suppress(JoinError, grpc.aio.AioRpcError):
                    await self._join(interval)  # alone: try to heal through the bootstrap address
            self.membership.prune()
            if self.metrics is not None:
                self.metrics.known_peers.set(len(self.membership.entries) + 1)
                self.metrics.alive_peers.set(len(self.membership.alive()))

    async def _gossip_one(self, peer: pb.PeerInfo) -> None:
        assert self.channels is not None
        req = sign(pb.GossipRequest(peers=self.membership.gossip_view()), "Gossip", self.identity, self.run_id)
        try:
            resp = await self.channels.membership(peer.address, peer).Gossip(
                req, timeout=max(2.0, self.cfg.network.gossip_interval)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE:
                self.membership.mark_unreachable(peer.peer_id)
            self.count_sent("gossip", 0, req.ByteSize())
            return
        self.count_sent("gossip", 0, req.ByteSize())
        self.membership.merge(resp.peers)
        self.reach.observe(peer, resp.observed_address)

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
        excluded = set(request.suspects) - {self.identity.peer_id}
        leader = next(p for p in self.membership.settled() if p.peer_id not in excluded and dialable(p))
        if leader.peer_id < self.identity.peer_id:
            return pb.RendezvousResponse(redirect=leader)
        return await self.leader.join(request.step, request.fragment, request.attempt, info, list(request.suspects))

    def _plausible_step(self) -> int:
        steps = sorted(p.outer_step for p in self.membership.alive())
        return steps[(len(steps) - 1) // 2] if steps else self.status.outer_step  # the lower median

    async def _rendezvous(self, step: int, fragment: int, attempt: int, suspects: set[str]) -> pb.RendezvousResponse:
        assert self.leader is not None and self.channels is not None
        tried = set(suspects)
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
                return await self.leader.join(step, fragment, attempt, self.me, sorted(suspects))
            req = sign(
                pb.RendezvousRequest(step=step, attempt=attempt, suspects=sorted(suspects), fragment=fragment),
                "Rendezvous",
                self.identity,
                self.run_id,
            )
            try:
                resp = await self.channels.rounds(target.address, target).Rendezvous(req, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in UNREACHABLE:
                    raise RoundFailed(f"rendezvous refused by {target.peer_id[:8]}: {exc.details()}") from exc
                log.warning("round leader %s unreachable (%s); trying the next", target.peer_id[:8], exc.code().name)
                tried.add(target.peer_id)
                self.membership.mark_unreachable(target.peer_id)
                target = None
                continue
            if resp.WhichOneof("result") == "redirect":
                nxt = resp.redirect
                if nxt.peer_id >= target.peer_id or nxt.peer_id in tried:
                    tried.add(target.peer_id)
                    target = None
                else:
                    self.membership.merge([nxt])
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
        t0 = time.perf_counter()
        for attempt in range(6):
            t_rv = time.perf_counter()
            resp = await self._rendezvous(step, fragment, attempt, suspects)
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
                result = await rnd.run(self.stub_for, self.verifier)
            except RoundFailed as exc:
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
            for m in group.members:  # they all finished `step` with us: do not wait for gossip to say so
                info = self.membership.get(m.peer_id)
                if info is not None and fragment < 0 and info.outer_step <= step and info is not self.me:
                    # its digest for step + 1 is not known yet: a stale one would count as a different state
                    info.outer_step, info.state_digest = step + 1, b""
            self.record_round(group, result, fragment, rendezvous_s=rendezvous_s)
            return result
        raise RoundFailed(f"round for step {step} failed {attempt + 1} times")

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        s = result.stats
        summary = pb.RoundSummary(
            step=group.step,
            algorithm=self.cfg.run.algorithm,
            included=result.included,
            expected=list(group.expected),
            partial=result.partial,
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
        if result.partial:
            self.status.rounds_partial += 1
            missing = sorted(set(group.expected) - set(result.included))
            log.warning(
                "step %d: PARTIAL round: averaged %d of %d expected peers (missing %s)",
                group.step,
                len(result.included),
                len(group.expected),
                [m[:8] for m in missing],
            )
        if self.metrics is not None:
            m = self.metrics
            outcome = "partial" if result.partial else ("solo" if len(result.included) == 1 else "complete")
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
    def publish(self, snapshot: StateSnapshot) -> None:
        """Make `snapshot` the state we serve, and gossip its step and digest."""
        digest = snapshot.digest

        def apply() -> None:
            self.snapshot = snapshot
            self.me.outer_step = snapshot.step
            self.me.state_digest = digest

        assert self.loop is not None
        self.loop.call_soon_threadsafe(apply)
        self.status.outer_step = snapshot.step

    def state_agrees(self, step: int) -> bool:
        """False when the live peers at `step` mostly gossip a different state digest than ours (a forked round:
        e.g. two leaders during a membership change). The digest most peers report is canonical, ties broken by the
        lowest peer id holding it, so every peer reaches the same verdict from the same gossip."""
        mine = bytes(self.me.state_digest)
        if self.me.outer_step != step or not mine:
            return True
        holders: dict[bytes, list[str]] = {mine: [self.identity.peer_id]}
        for p in self.membership.alive(include_self=False):
            if p.outer_step == step and p.state_digest:
                holders.setdefault(bytes(p.state_digest), []).append(p.peer_id)
        canonical = min(holders, key=lambda d: (-len(holders[d]), min(holders[d])))
        return canonical == mine

    def swarm_step(self) -> int:
        """The newest outer step any live peer reports."""
        return max((p.outer_step for p in self.membership.alive(include_self=False)), default=-1)

    def fetch_state(self, min_step: int, expected: dict[str, tuple[int, ...]], timeout: float = 120.0) -> StateSnapshot:
        """Download the global state (at least `min_step`) from the live peer with the newest one."""
        return self.call(self._fetch_state(min_step, expected, timeout))

    async def _fetch_state(self, min_step: int, expected: dict[str, tuple[int, ...]], timeout: float) -> StateSnapshot:
        assert self.channels is not None
        deadline = time.monotonic() + timeout
        errors: list[str] = []
        while time.monotonic() < deadline:
            live = [p for p in self.membership.alive(include_self=False) if p.outer_step >= min_step and dialable(p)]
            if self.me.outbound_only and not await self.reach.wait_for_dialable(deadline - time.monotonic()):
                break  # nobody we could download from
            # Prefer the (step, digest) the most peers agree on, then the newest: one hostile peer gossiping a far
            # step cannot make joiners download its state while honest peers agree on theirs.
            votes: dict[tuple[int, bytes], int] = {}
            for p in live:
                votes[(p.outer_step, p.state_digest)] = votes.get((p.outer_step, p.state_digest), 0) + 1
            peers = sorted(live, key=lambda p: (-votes[(p.outer_step, p.state_digest)], -p.outer_step))
            for p in peers:
                req = sign(pb.StateRequest(min_step=min_step), "Download", self.identity, self.run_id)
                call = self.channels.state(p.address, p).Download(req, timeout=max(deadline - time.monotonic(), 1.0))
                try:
                    snap = await read_state(call.__aiter__(), expected, p.public_key)
                    if p.state_digest and snap.step == p.outer_step and snap.digest != p.state_digest:
                        raise StreamError("bad_digest", "served state does not match the digest it gossiped")
                except (grpc.aio.AioRpcError, StreamError, StopAsyncIteration) as exc:
                    errors.append(f"{p.peer_id[:8]}: {exc}")
                    if isinstance(exc, StreamError):
                        self.count_rejected(exc.reason)
                    continue
                log.info("downloaded state at step %d from %s", snap.step, p.peer_id[:8])
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
            reachability=self.reach.line(),
            relayed_bytes=self.relay_server.relayed_bytes,
        )
        if redact:
            msg.redacted = True
            for name in ("peers", "alive", "banned"):
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
