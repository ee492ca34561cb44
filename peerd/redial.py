"""Dead is not forgotten: keep dialling peers that went silent, and every bootstrap address, for the life of the run.

After a network split each half sees the other as dead. Gossip only talks to live peers, so without this loop the
halves would never meet again (and a peer whose bootstrap died could never find the swarm). Each dead entry and each
bootstrap address has its own jittered exponential backoff, from one gossip interval up to `network.redial_max`, so
a long-dead peer costs one failed dial every few seconds and a healed link is noticed within that bound.

A successful dial is an ordinary push-pull Gossip: the answer carries the other side's signed entries, whose advanced
heartbeats make them live again, and our view reaches them the same way.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from peerd.v1 import peerd_pb2 as pb

MAX_DIALS_PER_TICK = 8  # bounded work per tick, however many peers are dead


@dataclass
class _Backoff:
    delay: float
    next_at: float = 0.0


class Redialer:
    """Schedules re-dials; the daemon supplies how to dial a known peer and how to re-join through an address."""

    def __init__(
        self,
        dead: Callable[[], list[pb.PeerInfo]],
        dial_peer: Callable[[pb.PeerInfo], Awaitable[bool]],
        bootstrap: list[str],
        dial_bootstrap: Callable[[str], Awaitable[bool]],
        known_address: Callable[[str], bool],
        base_s: float,
        max_s: float,
    ) -> None:
        self.dead = dead
        self.dial_peer = dial_peer
        self.bootstrap = list(bootstrap)
        self.dial_bootstrap = dial_bootstrap
        self.known_address = known_address
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self._backoff: dict[str, _Backoff] = {}
        self.dials = 0
        self.healed = 0

    def _due(self, key: str, now: float) -> bool:
        b = self._backoff.get(key)
        return b is None or now >= b.next_at

    def _after(self, key: str, ok: bool, now: float) -> None:
        if ok:
            self._backoff.pop(key, None)
            self.healed += 1
            return
        b = self._backoff.setdefault(key, _Backoff(self.base_s / 2))
        b.delay = min(b.delay * 2, self.max_s)
        b.next_at = now + b.delay * random.uniform(0.5, 1.0)

    async def tick(self) -> None:
        """Dial what is due: dead peers first, then bootstrap addresses no live peer answers for."""
        now = time.monotonic()
        dead = {p.peer_id: p for p in self.dead()}
        for key in [k for k in self._backoff if not k.startswith("addr:") and k not in dead]:
            del self._backoff[key]  # alive again (or forgotten): start from the base delay next time
        due: list[tuple[str, Awaitable[bool]]] = []
        for pid, info in dead.items():
            if len(due) < MAX_DIALS_PER_TICK and self._due(pid, now) and info.address:
                due.append((pid, self.dial_peer(info)))
        for addr in self.bootstrap:
            key = f"addr:{addr}"
            if len(due) < MAX_DIALS_PER_TICK and not self.known_address(addr) and self._due(key, now):
                due.append((key, self.dial_bootstrap(addr)))
        if not due:
            return
        self.dials += len(due)
        results = await asyncio.gather(*(c for _, c in due), return_exceptions=True)
        now = time.monotonic()
        for (key, _), ok in zip(due, results, strict=True):
            self._after(key, ok is True, now)
