"""Our all-reduce rounds by id, and the streams that reach us for a round we do not know (yet).

A member may stream to us before our own rendezvous answer arrived, so an unknown round is held while a rendezvous
of ours is in flight. A group names only peers whose request reached its leader: with none in flight, an unknown
round is one we will never join (its leader died before answering us, or we gave up on it), and we say so at once.
Holding such streams until a deadline and then refusing them failed the round for every member that sent to us (41
members at 64 peers, when a leader was killed mid-rendezvous). The members streaming to us for a round we do not
know also hold its group: a peer whose leader died asks one of them for it (`RoundClient._rendezvous`), and a
member asked so hands on a round in flight that still counts the asker in (`naming`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

HELD_WAIT_S = 2.0
"""How long a peer whose round leader died mid-rendezvous waits for that leader's round to show itself (a member's
stream for a round it does not know) before it looks for another leader."""
MAX_HELD = 256  # unknown rounds held at once: more are answered at once (a flood, not a swarm)


class RoundRegistry:
    """Round id -> its ReduceRound while in flight or lingering, and the streams held for rounds not known yet."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s  # how long a stream waits for its round at most
        self.rounds: dict[bytes, Any] = {}
        self._events: dict[bytes, asyncio.Event] = {}  # streams that arrived before their round: wake them
        self._waiting: dict[bytes, int] = {}  # streams held per such round: its event goes with the last of them
        self._asking = 0  # our rendezvous calls in flight: only one of them can hand us a round we do not know yet
        self._held_by: dict[bytes, set[str]] = {}  # such a round -> members streaming to us for it (holding its group)
        self._new_holder = asyncio.Event()

    def register(self, round_id: bytes, rnd: Any) -> None:
        self.rounds[round_id] = rnd
        ev = self._events.get(round_id)
        if ev is not None:
            ev.set()

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        """Around one rendezvous call of ours. When the last one settles, held streams for rounds it did not hand us
        are answered; the waiters run at the caller's next await, so after it registered the round it got."""
        self._asking += 1
        try:
            yield
        finally:
            self._asking -= 1
            if not self._asking:
                for ev in self._events.values():
                    ev.set()

    async def wait(self, round_id: bytes, sender: str = "") -> Any:
        """The round `round_id`, waiting while a rendezvous of ours may still hand it to us; None: we are not in it."""
        rnd = self.rounds.get(round_id)
        if rnd is not None or not self._asking or len(self._events) > MAX_HELD:
            return rnd
        ev = self._events.setdefault(round_id, asyncio.Event())
        self._waiting[round_id] = self._waiting.get(round_id, 0) + 1
        if sender:
            self._held_by.setdefault(round_id, set()).add(sender)
            self._new_holder.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), self.hold_s)
        finally:
            # Only the last stream held for this round forgets it: an earlier one leaving (its own deadline came
            # first) must not orphan the others' event, which register() and asking() would then never set.
            self._waiting[round_id] -= 1
            if not self._waiting[round_id]:
                del self._waiting[round_id]
                self._events.pop(round_id, None)
                self._held_by.pop(round_id, None)
        return self.rounds.get(round_id)

    async def holder(self, usable: Callable[[str], pb.PeerInfo | None], wait_s: float) -> pb.PeerInfo | None:
        """A member streaming to us for a round we do not know that `usable` accepts (live, dialable, not tried),
        waiting up to `wait_s` for one: its stream may reach us a moment after we saw our leader die."""
        deadline = time.monotonic() + wait_s
        while True:
            self._new_holder.clear()
            for pid in sorted(set().union(*self._held_by.values())):
                info = usable(pid)
                if info is not None:
                    return info
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_holder.wait(), left)

    def naming(self, request: pb.RendezvousRequest, info: pb.PeerInfo) -> pb.Group | None:
        """A round of ours in flight for the requester's step that counts the requester in: its leader formed it with
        the requester and died before answering it. Handing on that group lets the requester join the round it is
        in, instead of forming another group for the same step (a fork) while that round's members take it for a
        lost owner. The group is the dead leader's, bound into its round id."""
        failed = bytes(request.failed_round)
        for rid, rnd in list(self.rounds.items()):
            group = getattr(rnd, "group", None)
            if group is None or rid == failed or (group.step, group.fragment) != (request.step, request.fragment):
                continue
            mine = next((m for m in group.members if m.peer_id == info.peer_id), None)
            if mine is not None and mine.incarnation == info.incarnation and rnd.open_to(info.peer_id):
                log.info("step %d: %s asked for the round it is in (its leader %s never answered it): handing it on",
                         request.step, info.peer_id[:8], group.leader[:8])  # fmt: skip
                return group
        return None
