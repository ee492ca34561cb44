"""Request checks: every inbound request's envelope, admission, ban and rate check, the refusal a bad one gets (a
status, a count by reason, a throttled log line), and the strikes and bans a peer earns by sending invalid data.

One home for these, so a servicer, the relay and the reachability probe all refuse the same way and count into the
same place; the daemon owns one `RequestChecks` (`daemon.checks`) and wires its gate into the verifier and its
exclusion rule into the membership table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from peerd.admission import Admission, AdmissionError
from peerd.envelope import AuthError, Verifier
from peerd.identity import peer_id_of
from peerd.limits import LimitExceeded, LogThrottle, PeerLimits
from peerd.membership import Membership
from peerd.robust import STRIKE_REASONS, BanList, majority_suspects
from peerd.swarmclock import CLOCK
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.config import SecuritySection
    from peerd.localstatus import LocalStatus

log = logging.getLogger("peerd")
AUTH_CODES = {  # envelope refusals that are not plain authentication failures
    "wrong_run": grpc.StatusCode.FAILED_PRECONDITION,
    "not_admitted": grpc.StatusCode.PERMISSION_DENIED,
    "banned": grpc.StatusCode.PERMISSION_DENIED,
}


class RequestChecks:
    """verify / refuse / admit inbound requests; count rejections; strike, ban and gossip suspects."""

    def __init__(
        self,
        *,
        me: pb.PeerInfo,
        verifier: Verifier,
        admission: Admission,
        bans: BanList,
        limits: PeerLimits,
        membership: Membership,
        status: LocalStatus,
        security: SecuritySection,
        metrics: Callable[[], Any],
    ) -> None:
        """`metrics` returns the daemon's PeerMetrics, or None: they start after the checks are built."""
        self.me = me
        self.verifier = verifier
        self.admission = admission
        self.bans = bans
        self.limits = limits
        self.membership = membership
        self.status = status
        self.security = security
        self._metrics = metrics
        self.refusal_log = LogThrottle()
        self.gossip_suspects: set[str] = set()  # reported banned by a majority of live peers (robust.py)
        verifier.gate = self._gate
        membership.excluded = self._excluded

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

    async def refuse(
        self,
        context: grpc.aio.ServicerContext,
        reason: str,
        code: grpc.StatusCode,
        msg: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> NoReturn:
        self.count_rejected(reason)
        shown, suppressed = self.refusal_log.allow(reason)
        if shown:
            more = f" ({suppressed} more refused for this reason were not logged)" if suppressed else ""
            log.warning("refused a request (%s): %s%s", reason, msg, more)
        if reason == "stale":  # our time, so a peer whose clock is wrong can take the swarm's (swarmclock.py)
            metadata = (*metadata, *CLOCK.refusal_metadata())
        await context.abort(code, msg, metadata)
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

    def refresh_suspects(self) -> None:
        """Gossip our bans, and recompute whom a strict majority of live peers reports banned."""
        banned = self.bans.banned()
        if list(self.me.suspects) != banned:
            del self.me.suspects[:]
            self.me.suspects.extend(banned)
        views = {e.info.peer_id: list(e.info.suspects) for e in self.membership.entries.values()
                 if self.membership.is_alive(e.info.peer_id) or e.info.peer_id in self.gossip_suspects}  # fmt: skip
        views[self.me.peer_id] = banned
        self.gossip_suspects = majority_suspects(views) - {self.me.peer_id}

    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        """A round found `peer_id`'s signed data invalid (too large, undecodable): count it and maybe ban."""
        self.count_rejected(reason)
        self.suspect(peer_id, reason)

    def count_rejected(self, reason: str) -> None:
        self.status.rejected_messages += 1
        metrics = self._metrics()
        if metrics is not None:
            metrics.record_rejected(reason)

    def suspect(self, peer_id: str, reason: str) -> None:
        """`peer_id` signed and sent invalid data. Offences it cannot deny (robust.STRIKE_REASONS) count towards a
        ban; transport trouble does not."""
        log.warning("peer %s sent invalid data (%s)", peer_id[:8], reason)
        if reason not in STRIKE_REASONS or peer_id == self.me.peer_id:
            return
        self.status.rejected_contributions += 1
        if self.bans.strike(peer_id):
            log.warning(
                "banned peer %s for %.0fs: it sent invalid data %d times; its requests are refused and its id is "
                "gossiped as suspect",
                peer_id[:8],
                self.security.ban_seconds,
                self.security.ban_after,
            )
            self.membership.mark_unreachable(peer_id, why="banned")
            self.refresh_suspects()
