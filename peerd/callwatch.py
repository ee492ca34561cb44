"""Giving up on a pending rendezvous or round as soon as the peers it waits on look gone.

Across a split, a broken route or an address that went away, a call neither fails nor answers until its deadline
(3x the rendezvous timeout, or the round timeout), and every second spent there is a second not training. The round
client (peerd/roundclient.py) awaits its calls through `CallWatch.until_done`, which checks gossip's view of the
peers once per gossip interval and ends the wait by the exception that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from peerd.rendezvous import Behind
from peerd.roundtypes import RoundFailed
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")


class PeerSilent(Exception):
    """A peer a pending call depends on went silent in gossip (a split, or it died): give up on the call now."""

    def __init__(self, peer_id: str) -> None:
        super().__init__(f"{peer_id[:8]} has been silent for twice the peer timeout")
        self.peer_id = peer_id


class LeaderUndialable(Exception):
    """The leader a rendezvous waits on turned out undialable from here, though live to others (peerd/pairblocks.py):
    try the next one, without naming it a suspect (the others reach it)."""


class LeaderMoved(Exception):
    """The leader a rendezvous waits on announced a new address, or ours went away (peerd/netchange.py): the call
    can only hang on its dead connection, so ask again on a new one, where the leader is now."""

    def __init__(self, info: pb.PeerInfo, why: str) -> None:
        super().__init__(f"{why}; it is at {info.address}")
        self.info = info


def plausible_step(d: Daemon) -> int:
    """The lower median of the live peers' outer steps (ours when alone): where the swarm is, robust to one liar."""
    steps = sorted(p.outer_step for p in d.membership.alive())
    return steps[(len(steps) - 1) // 2] if steps else d.status.outer_step


class CallWatch:
    """Watches the peers a call depends on (`RoundClient.watch`)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    async def until_done(
        self,
        work: Any,
        peers: list[str],
        on_silent: Callable[[str], None] | None = None,
        incarnations: dict[str, int] | None = None,
        leader: bool = False,
        step: int = -1,
        at: str = "",
        addresses: dict[str, str] | None = None,
    ) -> Any:
        """Await `work` (an RPC or a round), but give up as soon as one of `peers` has been silent in gossip for
        twice the peer timeout: across a network split a call neither fails nor answers until its deadline (3x
        the rendezvous timeout, or the round timeout), and every second spent there is a second not training.
        Twice the timeout, so gossip delayed behind a bulk transfer on a slow link does not abort a healthy round.
        `on_silent` (a round's abort) lets the work end itself; without it the call is cancelled (PeerSilent).
        With `incarnations` (each peer's when the work began), a peer that restarted since counts as gone too.
        `leader`: the work is a rendezvous with `peers[0]` for `step`, given up (LeaderUndialable) once we cannot dial
        it, and (Behind) once the swarm is two steps past `step`: every round we could join there is over. A leader
        whose answers vanish on the way (a path MTU blackhole) held a peer 18 s while the others trained on; its
        silence counts as a dial without an answer (peerd/pairblocks.py). `at`: the address the rendezvous dialled,
        given up (LeaderMoved) once the leader announces another, or our connections were renewed. With `addresses`
        (where the round dials each member), a member that announces another address counts as gone, and a round
        whose connections were renewed is over (RoundFailed): their streams ride dead connections until the round's
        deadline (peerd/netchange.py)."""
        task = asyncio.ensure_future(work)
        limit = 2 * self.d.cfg.network.peer_timeout
        renewed = self.d.channels.renewed if self.d.channels is not None else 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.d.cfg.network.gossip_interval)
                if done:
                    return task.result()
                if leader:
                    self._leader_checks(peers[0], step, at, renewed)
                elif addresses is not None and self.d.channels is not None and self.d.channels.renewed != renewed:
                    raise RoundFailed("our address went away: this round's connections are dead", set(), "aborted")
                elif self._moved(self.d.identity.peer_id, addresses):  # the group formed before we re-addressed
                    raise RoundFailed("the round's members dial us at our old address", set(), "aborted")
                silent = next(
                    (
                        p
                        for p in peers
                        if self.d.membership.silent_for(p) > limit
                        or self.restarted(p, incarnations)
                        or self._moved(p, addresses)
                    ),
                    None,
                )
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

    def _leader_checks(self, leader: str, step: int, at: str, renewed: int) -> None:
        """until_done's reasons to give up a rendezvous with `leader` before it answers (see there)."""
        if self.d.membership.cannot_dial(leader):
            raise LeaderUndialable(leader)
        now_at = self.d.membership.get(leader) if at else None
        if now_at is not None and now_at.address and now_at.address != at:
            raise LeaderMoved(now_at, "it announces a new address")
        if now_at is not None and self.d.channels is not None and self.d.channels.renewed != renewed:
            raise LeaderMoved(now_at, "our address went away")
        swarm = plausible_step(self.d) if step >= 0 else -1  # sorts the live peers: once per look
        if step >= 0 and swarm >= step + 2:
            log.warning("round leader %s has not answered while the swarm moved on to step %d; catching up",
                        leader[:8], swarm)  # fmt: skip
            self.d.membership.no_answer(leader, address=at)
            raise Behind(swarm)

    def _moved(self, peer_id: str, addresses: dict[str, str] | None) -> bool:
        """`peer_id` announces another address than the one the work dials (its own went away): the connections the
        work rides to it are dead."""
        if not addresses or peer_id not in addresses:
            return False
        info = self.d.membership.get(peer_id)
        return info is not None and bool(info.address) and info.address != addresses[peer_id]

    def restarted(self, peer_id: str, incarnations: dict[str, int] | None) -> bool:
        """Whether `peer_id` restarted since the group formed (`incarnations`: each member's then)."""
        return (
            bool(incarnations)
            and peer_id in incarnations
            and self.d.membership.restarted_since(peer_id, incarnations[peer_id])
        )
