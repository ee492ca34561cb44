"""Reachability: can the other peers dial this one, or does it sit behind a NAT or firewall that only lets it dial out?

A joiner asks the peer it joins through to dial it back (`Membership.Probe`, signed) at the address it announces,
before it sends its Join. The prober opens a fresh connection to that address (pinned to the joiner's TLS certificate)
and calls `Membership.ProbeEcho` with a nonce the joiner chose; the joiner answers only for a nonce it has in
flight, with its Ed25519 signature over it, so the prober knows it reached the joiner and not someone else.
The verdict is one line at start, in `peerd status`, in the `peerd_reachable` metric, and in the `outbound_only`
flag of our gossiped PeerInfo: no peer ever dials an outbound-only peer (`dialable`). Old entries and peers not yet
checked have the flag false, which keeps the old behaviour (everyone is dialled).

Probes are rate-limited per sender key and per source host, run a few at a time, and dial only the host the request
came from: a peer cannot be used to make connections to third parties. A new check runs when a gossip partner sees
our source address change, and while we have no verdict (the first peer of a swarm has nobody to ask at start).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc

from peerd import tls
from peerd.addresses import host_block, hostport, remote_ip, split_address, split_host
from peerd.datadir import write_atomic
from peerd.envelope import sign
from peerd.identity import verify
from peerd.limits import TokenBucket
from peerd.netchange import SourceWatch, is_local
from peerd.pairblocks import CHECK_S
from peerd.pathcheck import fresh_channel, full_size_path
from peerd.swarmclock import CLOCK
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")

PROBE_DIAL_S = 1.5  # a dial-back whose SYN is dropped fails at this deadline (one lost SYN is retried at 1 s, and
# a TLS dial-back over a 200 ms path takes well under a second); a false "unreachable" costs only a later re-check
ECHO_TAG = b"peerd-probe-echo\x00"
NONCE_BYTES = 16
RECHECK_S = 30.0  # at most one new check per this many seconds
RECHECK_OUTBOUND_S = 300.0  # outbound-only peers ask again at most this far apart (a lost SYN, a port forwarded since)
# After an outbound-only verdict the first re-check comes RECHECK_S later, and the wait doubles with each verdict that
# agrees, up to RECHECK_OUTBOUND_S: a dial-back can time out on a starved machine as a NAT's dropped SYNs do (seen with
# 64 daemons on 2 cores: one peer judged outbound-only at start owned no shard for the whole run), so a false verdict
# clears in 30 s, while a real NAT costs a few more probes over its first 8 minutes.
RETRY_S = 2.0  # a probe call that got no answer (the helper was starting, starved or gone) gives no verdict: ask again,
# another peer where there is one, this long after, doubling with each such failure up to RECHECK_S. Waiting RECHECK_S
# left a blocked joiner whose pre-join probe failed counted as dialable, and so dialled by everyone, for 30 s.
MAX_CONCURRENT_PROBES = 4
ROUTE_CHECK_S = 10.0  # a hung call re-checks the route to its peer at most this often (check_route)
ROUTE_CONNECT_S = CHECK_S  # a new connection with no answer in this long is evidence of a broken route
YIELD_FRACTION, YIELD_MAX_S = 0.25, 2.0  # NoLoCo: how long reachable peers leave outbound-only ones the first move
UNKNOWN, REACHABLE, OUTBOUND_ONLY = "unknown", "reachable", "outbound_only"


def dialable(peer: pb.PeerInfo) -> bool:
    """May we open a connection to `peer`? Everyone except peers that found they cannot be dialled."""
    return not peer.outbound_only


def echo_bytes(run_id: bytes, nonce: bytes) -> bytes:
    return ECHO_TAG + run_id + nonce


def same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


class ProbeLimiter:
    """Dial-backs cost a connection each: a few per sender key and per source host, and a few at a time."""

    def __init__(self, per_key: tuple[float, float] = (1 / 10, 3), per_host: tuple[float, float] = (1 / 3, 20)) -> None:
        self.per_key, self.per_host = per_key, per_host
        self._buckets: dict[str, TokenBucket] = {}
        self.running = 0

    def allow(self, key: str, host: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.running >= MAX_CONCURRENT_PROBES:
            return False
        if len(self._buckets) > 4096:
            self._buckets.clear()  # bounded memory; forgetting budgets only makes us more lenient for a moment
        kb = self._buckets.setdefault(f"key:{key}", TokenBucket(*self.per_key, now))
        with contextlib.suppress(ValueError):  # an IPv6 host is budgeted by its /64 (peerd/limits.py)
            host = host_block(ipaddress.ip_address(host))
        hb = self._buckets.setdefault(f"host:{host}", TokenBucket(*self.per_host, now))
        return kb.take(now) and hb.take(now)


class Reachability:
    """This peer's own verdict (joiner side) and the dial-backs it does for others (prober side)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.state = UNKNOWN
        self.address = ""  # the address the verdict is about
        self.pending: dict[bytes, float] = {}  # nonces of our probes in flight -> expiry
        self.seen: dict[str, str] = {}  # our source host as each gossip partner last saw it
        self.limiter = ProbeLimiter()
        self._next_check = 0.0  # no new check starts before this monotonic time (RECHECK_S; RETRY_S after a failure)
        self._failed_calls = 0  # probe calls in a row that got no answer
        self._failed_address = ""  # the helper the last of those went to: ask another next time
        self._verdict_at = 0.0  # monotonic time of the last verdict (the outbound-only re-check counts from it)
        self._outbound_verdicts = 0  # outbound-only verdicts in a row (the re-check backoff)
        self._task: asyncio.Task | None = None
        self._alone_warned = False
        self._route_next: dict[str, float] = {}  # peer -> no route check before this monotonic time
        self._route_tasks: set[asyncio.Task] = set()
        self._confirming: set[str] = set()  # peers whose confirming connection is in flight (confirm_route)
        self.source = SourceWatch()  # the address we send from (peerd/netchange.py)
        self.readdressed = 0  # times we took a new address from a dial-back after ours went away

    # -- our own verdict -----------------------------------------------------------------------------------------
    def line(self) -> str:
        """The one line users see at start and in `peerd status`."""
        if self.state == REACHABLE:
            return f"reachable at {self.address}"
        if self.state == OUTBOUND_ONLY:
            port = self.address.rpartition(":")[2] or "?"
            return (
                "not reachable from outside: taking part as an outbound-only peer; to serve others, "
                f"forward port {port} to this machine or pass --announce"
            )
        return "reachability not checked yet (no peer has dialled us back)"

    async def before_join(self, address: str) -> None:
        """Called with the bootstrap address just before our Join: ask that peer to dial us back first, so our
        entry carries the verdict from the moment anyone hears of us. (Joining first as provisionally outbound-only
        and flipping the flag a moment later made peers disagree on who may lead the next round.)"""
        if self.state == UNKNOWN:
            await self.check(address)

    async def check(self, address: str, peer: pb.PeerInfo | None = None, readdress: bool = False) -> None:
        """Ask the peer at `address` to dial us back; set our flag from its answer. `readdress`: our address seems
        to have changed, and we learned it rather than being told it (--announce): ask to be dialled wherever the
        peer sees us now, and take that address when the dial-back answers either way."""
        d = self.d
        assert d.channels is not None
        self._next_check = time.monotonic() + RECHECK_S
        nonce = os.urandom(NONCE_BYTES)
        self.pending[nonce] = time.monotonic() + PROBE_DIAL_S + 10.0
        readdress = readdress and not d.announce
        ask = f"0.0.0.0:{d.me.address.rpartition(':')[2]}" if readdress else d.me.address  # the prober fills the host
        req = sign(pb.ProbeRequest(address=ask, nonce=nonce, tls_cert=d.me.tls_cert), "Probe", d.identity, d.run_id)
        try:
            resp = await d.channels.membership(address, peer).Probe(req, timeout=PROBE_DIAL_S + 5.0)
        except grpc.aio.AioRpcError as exc:
            if CLOCK.heard(exc, address, d.membership.others_alive):  # stale: our clock is wrong
                self.pending.pop(nonce, None)
                return await self.check(address, peer, readdress)
            self._failed_calls += 1
            self._failed_address = address
            retry = min(RECHECK_S, RETRY_S * 2 ** min(self._failed_calls - 1, 16))
            self._next_check = time.monotonic() + retry
            log.info("reachability probe through %s failed: %s %s (asking again in %.0fs)", address, exc.code().name,
                     exc.details(), retry)  # fmt: skip
            return
        finally:
            self.pending.pop(nonce, None)
        self._failed_calls, self._failed_address = 0, ""
        if readdress and resp.result in ("reachable", "unreachable") and resp.address:
            self._adopt(resp.address, peer.peer_id if peer is not None else "")
        if resp.result == "reachable":
            self._set(REACHABLE, resp.address or d.me.address)
        elif resp.result == "unreachable":
            self._set(OUTBOUND_ONLY, resp.address or d.me.address)
        else:
            log.info("reachability not checked by %s: %s", address, resp.result[:200])

    def _adopt(self, address: str, prober: str) -> None:
        """Announce `address`, where the peer `prober` just dialled us back (or tried to), in place of one that went
        away: if it is an address of this machine, or another peer sees us there too. One peer's word alone would let
        a lying peer point everyone at an address where we are not."""
        d = self.d
        host = split_host(address)
        if address == d.me.address or not host:
            return
        if not is_local(host) and not any(h == host for pid, h in self.seen.items() if pid != prober):
            log.info("peer %s dialled us back at %s, where no other peer sees us yet: keeping %s for now",
                     prober[:8], address, d.me.address)  # fmt: skip
            return
        log.warning("our address is now %s (was %s): announcing it, so peers dial us there", address, d.me.address)
        d.me.address = address
        d.me.heartbeat += 1  # so gossip carries it at once
        self.readdressed += 1
        try:
            write_atomic(d.data_dir / "address", address)
        except OSError as exc:
            log.debug("cannot write the address file: %s", exc)

    def watch_source(self, peers: list[pb.PeerInfo]) -> None:
        """Once per gossip tick: has the address this machine sends from gone away (peerd/netchange.py)? Then every
        connection we hold is dead without having failed: renew them all, and (unless --announce) ask a peer where
        it sees us now. Looks at two fixed peers and one random one, so a destination recurs tick after tick."""
        d = self.d
        if not peers or d.channels is None:
            return
        ordered = sorted(peers, key=lambda p: p.peer_id)
        sample = ordered[:2] + random.sample(ordered[2:], min(1, len(ordered[2:])))
        gone = self.source.sample(p.address for p in sample)
        if gone is None:
            return
        renewed = d.channels.renew()
        log.warning("this machine's address %s is gone (it sends from %s now): %d connections renewed%s", gone[0],
                    gone[1], renewed, "" if d.announce else "; asking a peer where it sees us")  # fmt: skip
        if d.metrics is not None:
            d.metrics.source_changes.inc()
        targets = [p for p in peers if dialable(p) and not d.membership.cannot_dial(p.peer_id)]
        if targets:
            self._spawn(random.choice(targets), readdress=True)

    def outbound_recheck_s(self) -> float:
        """How long after the last check an outbound-only peer asks again: RECHECK_S after its first such verdict,
        doubling with each that agrees, up to RECHECK_OUTBOUND_S."""
        return min(RECHECK_OUTBOUND_S, RECHECK_S * 2 ** min(max(self._outbound_verdicts - 1, 0), 16))

    def _set(self, state: str, address: str) -> None:
        d = self.d
        changed = state != self.state
        self._verdict_at = time.monotonic()
        self._outbound_verdicts = self._outbound_verdicts + 1 if state == OUTBOUND_ONLY else 0
        self.state, self.address = state, address
        flag = state == OUTBOUND_ONLY
        if state == OUTBOUND_ONLY:
            log.warning(self.line())
        elif changed:
            log.info(self.line())
        d.me.relays = state == REACHABLE and d.cfg.network.relay  # offer to relay only once others reached us
        if d.me.outbound_only != flag:
            d.me.outbound_only = flag
            d.me.heartbeat += 1  # so gossip carries the new flag
        if d.metrics is not None:
            d.metrics.reachable.set(0 if state == OUTBOUND_ONLY else 1)

    def observe(self, peer: pb.PeerInfo, observed: str) -> None:
        """A gossip partner reports the host our request came from: a change means our address may have changed."""
        if not observed:
            return
        before = self.seen.get(peer.peer_id)
        if len(self.seen) < 4096:
            self.seen[peer.peer_id] = observed
        if before is not None and before != observed:
            log.info("peer %s now sees us at %s (was %s): checking reachability again", peer.peer_id[:8], observed,
                     before)  # fmt: skip
            # It saw us where we announce, and now elsewhere: our address changed (not a second network of ours)
            self._spawn(peer, readdress=before == split_host(self.d.me.address))

    def tick(self, alive: Iterable[pb.PeerInfo]) -> None:
        """Once per gossip interval: without a verdict, or while outbound-only once `outbound_recheck_s` passed, ask
        a random reachable peer to dial us back."""
        if self.state == REACHABLE:
            return
        if self.state == OUTBOUND_ONLY and time.monotonic() - self._verdict_at < self.outbound_recheck_s():
            return
        peers = [p for p in alive if dialable(p)]
        others = [p for p in peers if p.address != self._failed_address]  # rather not the helper that did not answer
        if peers:
            self._spawn(random.choice(others or peers))

    def _spawn(self, peer: pb.PeerInfo, readdress: bool = False) -> None:
        """Start a check unless one runs or (except to re-address: our address went away) one ran lately."""
        if self._task is not None and not self._task.done():
            return
        if time.monotonic() < self._next_check and not (readdress and not self.d.announce):
            return
        self._next_check = time.monotonic() + RECHECK_S
        self._task = asyncio.ensure_future(self.check(peer.address, peer, readdress))

    def dial_targets(self, peers: Iterable[pb.PeerInfo]) -> list[pb.PeerInfo]:
        """The peers we may dial among `peers`; says once, in one line, when we are outbound-only and nobody is."""
        peers = list(peers)
        out = [p for p in peers if dialable(p) and not self.d.membership.cannot_dial(p.peer_id)]
        if self.d.me.outbound_only and peers and not out:
            if not self._alone_warned:
                log.warning(
                    "no reachable peer in the swarm: every live peer is outbound-only, so nobody can connect to "
                    "anybody and this peer trains alone until a reachable peer joins"
                )
            self._alone_warned = True
        elif out:
            self._alone_warned = False
        return out

    def check_route(self, peer: pb.PeerInfo) -> None:
        """A call to `peer` hung on an open connection while others still hear it: open a new TCP connection to it
        (at most once per ROUTE_CHECK_S per peer). One that gets no answer within ROUTE_CONNECT_S is evidence that
        the route between us broke under the old one (peerd/pairblocks.py); gRPC's keepalive would take 50 s to say
        so, and a busy link still completes a handshake. A starved peer's kernel answers for it."""
        now = time.monotonic()
        m = self.d.membership
        if now < self._route_next.get(peer.peer_id, 0.0) or m.silent_for(peer.peer_id) >= m.peer_timeout:
            return
        self._route_next[peer.peer_id] = now + ROUTE_CHECK_S
        self._spawn_route(peer)

    def confirm_route(self, peer: pb.PeerInfo) -> None:
        """A suspect of a broken route (peerd/pairblocks.py: a failed dial, then its heartbeat through others): check
        with a fresh TCP connection before it counts as a block. Unlike check_route, not rate-limited: the suspect's
        own evidence came first, and one check runs per suspicion."""
        if peer.peer_id in self._confirming:
            return
        self._confirming.add(peer.peer_id)
        self._spawn_route(peer).add_done_callback(lambda _t, pid=peer.peer_id: self._confirming.discard(pid))

    def _spawn_route(self, peer: pb.PeerInfo) -> asyncio.Task:
        """Run `_route(peer)` in the background, holding the task until it ends."""
        task = asyncio.ensure_future(self._route(peer))
        self._route_tasks.add(task)
        task.add_done_callback(self._route_tasks.discard)
        return task

    async def _route(self, peer: pb.PeerInfo) -> None:
        m = self.d.membership
        try:
            host, port = split_address(peer.address)
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), ROUTE_CONNECT_S)
        except ValueError:
            return  # not an address to dial
        except (ConnectionRefusedError, ConnectionResetError):
            m.blocks.reached(peer.peer_id)  # its host answered: the route works (the process may be gone)
            return
        except (OSError, asyncio.TimeoutError):
            now_at = m.get(peer.peer_id)
            if now_at is not None and now_at.address != peer.address:
                return  # it announces another address now (its old one went away): nothing to say about the old
            log.info(
                "a new connection to %s got no answer in %.0f s: a broken route?", peer.peer_id[:8], ROUTE_CONNECT_S
            )
            m.no_answer(peer.peer_id, fresh=True, address=peer.address)
            return
        writer.close()
        # A handshake: the route works for small packets, whatever a gRPC call met. Full-size ones may still vanish.
        if await full_size_path(host, port, ROUTE_CONNECT_S, secure=self.d.tls is not None) is False:
            log.info("full-size packets to %s get no answer while small ones do: a path MTU blackhole?",
                     peer.peer_id[:8])  # fmt: skip
            m.no_answer(peer.peer_id, fresh=True, address=peer.address)
            return
        m.blocks.reached(peer.peer_id)

    def yield_to_outbound(self, match_timeout: float) -> float:
        """NoLoCo: seconds a reachable peer waits at its boundary for a proposal before proposing itself, while
        outbound-only peers without a relay are live (they can only propose, so they would find every reachable
        peer taken)."""
        if self.d.me.outbound_only:
            return 0.0
        if not any(p.outbound_only and not p.relay for p in self.d.membership.alive(include_self=False)):
            return 0.0
        return min(YIELD_FRACTION * match_timeout, YIELD_MAX_S)

    async def wait_for_dialable(self, timeout: float) -> bool:
        """Wait up to `timeout` for a live peer we can dial (an outbound-only peer alone with others like it has
        nobody to lead its rounds or serve its state): True as soon as there is one."""
        deadline = time.monotonic() + timeout
        while not self.dial_targets(self.d.membership.alive(include_self=False)):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.2)
        return True

    # -- dialling others back ------------------------------------------------------------------------------------
    def echo(self, request: pb.ProbeEchoRequest) -> bytes | None:
        """Our signature for a ProbeEcho of one of our probes in flight; None for any other nonce."""
        now = time.monotonic()
        for n, expiry in list(self.pending.items()):
            if expiry < now:
                del self.pending[n]
        if request.run_id != self.d.run_id or bytes(request.nonce) not in self.pending:
            return None
        return self.d.identity.sign(echo_bytes(self.d.run_id, bytes(request.nonce)))

    async def serve_probe(self, request: pb.ProbeRequest, sender: str, peer: str) -> pb.ProbeResponse:
        """Dial the (verified) sender back at the address it gave. Refusals are answers, not errors: the caller
        then simply has no verdict."""
        src = remote_ip(peer)
        observed = str(src) if src is not None else ""
        if len(request.nonce) != NONCE_BYTES:
            return pb.ProbeResponse(result=f"refused: the nonce must be {NONCE_BYTES} bytes", observed_address=observed)
        try:
            host, port = split_address(request.address)
        except ValueError as exc:
            return pb.ProbeResponse(result=f"refused: {exc}", observed_address=observed)
        if host in ("", "0.0.0.0", "::"):
            host = observed
        address = hostport(host, port)
        if not observed or not same_host(host, observed):
            why = f"refused: {host} is not the host this request came from ({observed or 'unknown'})"
            return pb.ProbeResponse(result=why, address=address, observed_address=observed)
        if not self.limiter.allow(sender, observed):
            self.d.checks.count_rejected("rate_limited")
            return pb.ProbeResponse(result="refused: rate limited", address=address, observed_address=observed)
        self.limiter.running += 1
        try:
            ok, why = await self._dial_back(address, bytes(request.auth.public_key), bytes(request.tls_cert),
                                            bytes(request.nonce))  # fmt: skip
        finally:
            self.limiter.running -= 1
        log.info("dial-back probe of %s at %s: %s", sender[:8], address, "reachable" if ok else f"unreachable ({why})")
        return pb.ProbeResponse(result="reachable" if ok else "unreachable", address=address, observed_address=observed)

    async def _dial_back(self, address: str, public_key: bytes, cert: bytes, nonce: bytes) -> tuple[bool, str]:
        pid = ""
        if self.d.tls is not None:
            try:
                pid = tls.verify_cert(cert, public_key)
            except (tls.TlsError, ValueError) as exc:
                return False, f"certificate refused: {exc}"
        channel = fresh_channel(address, cert if self.d.tls is not None else b"", pid)
        try:
            req = pb.ProbeEchoRequest(run_id=self.d.run_id, nonce=nonce)
            resp = await rpc.MembershipStub(channel).ProbeEcho(req, timeout=PROBE_DIAL_S)
        except grpc.aio.AioRpcError as exc:
            return False, exc.code().name
        finally:
            await channel.close()
        if not verify(public_key, bytes(resp.signature), echo_bytes(self.d.run_id, nonce)):
            return False, "the peer there is not the one that asked"
        return True, ""
