"""The start barrier: a swarm started together (`--wait-peers N`) takes its first inner step together.

Why: peers start at different moments (process start, join, waiting for peers to settle, building the model), up to
a second apart even on one machine. The first rounds absorb that skew: the peer that started first waits in them, and
that wait is compute idle (in a 3-peer Streaming demo it was most of the run's idle). torchrun solves the same problem
with its rendezvous; here the lowest settled dialable peer holds each caller of `Rounds.Start` until N peers arrived.

A barrier never holds anyone back from a run under way: a caller that sees a peer past outer step 0 in gossip does
not wait, and a host that is training already answers at once (a late joiner with `--wait-peers`, or a host started
without it). Past the deadline the caller starts anyway and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import grpc

from peerd.envelope import sign
from peerd.reachability import dialable
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")
MAX_PEERS = 4096  # a caller's N is capped: it only decides how long the caller itself is held


class StartBarrier:
    """The host's side: who arrived, and when to let them go. Lives on the daemon's event loop, so it needs no lock:
    an asyncio.Condition waited on under asyncio.wait_for could lose its lock when the timeout's cancellation raced
    the re-acquire (Python 3.11: "Lock is not acquired"), and with it the host's own start (a 64-peer run hung)."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.training = False  # our own worker is past its barrier (or had none): nobody is held any more
        self._changed: asyncio.Event | None = None

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def arrive(self, peer_id: str, n: int, timeout: float) -> list[str]:
        """Hold `peer_id` until `n` peers arrived or we train (then the run is under way: empty), at most `timeout`
        seconds; returns who arrived."""
        if self.training:
            return []
        if peer_id not in self.arrived:
            self.arrived.append(peer_id)
            self._notify()
        n = min(max(n, 1), MAX_PEERS)
        deadline = time.monotonic() + timeout
        while not (self.training or len(self.arrived) >= n):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return list(self.arrived)

    async def mark_training(self) -> None:
        """Our worker starts training: release whoever still waits, and answer later callers at once."""
        self.training = True
        self._notify()


async def start_together(d: Daemon, n: int, timeout: float) -> bool:
    """Wait at the swarm's start barrier (hosted by the lowest settled dialable peer, maybe us) until `n` peers
    reached it; True when they did. Any failure is one warning line: training starts anyway."""
    t0 = time.monotonic()
    me = d.identity.peer_id
    settled = d.membership.settled()
    ahead = [p for p in settled if p.peer_id != me and (p.outer_step > 0 or p.finished)]
    if ahead:  # gossip already shows the run under way: its peers are not coming to any barrier
        await d.start_barrier.mark_training()
        log.info("start barrier: the run is under way (%s is at outer step %d), starting now", ahead[0].peer_id[:8],
                 ahead[0].outer_step)  # fmt: skip
        return False
    hosts = [p for p in settled if dialable(p)]
    host = min(hosts, key=lambda p: p.peer_id) if hosts else d.me
    try:
        if host.peer_id == me:
            started = await d.start_barrier.arrive(me, n, timeout)
        else:
            req = sign(pb.StartRequest(peers=n), "Start", d.identity, d.run_id)
            resp = await d.channels.rounds(host.address, host).Start(req, timeout=timeout)
            started = list(resp.started)
    except grpc.aio.AioRpcError as exc:
        log.warning("start barrier at %s failed (%s): starting now", host.peer_id[:8], exc.code().name)
        return False
    finally:
        await d.start_barrier.mark_training()
    waited = time.monotonic() - t0
    if not started:
        log.info("start barrier: the run is under way at %s, starting now", host.peer_id[:8])
        return False
    if len(started) < n:
        log.warning("start barrier: only %d of %d peers arrived in %.0fs; starting anyway", len(started), n, waited)
        return False
    log.info("start barrier: %d peers start together (waited %.2fs)", len(started), waited)
    return True
