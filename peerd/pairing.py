"""NoLoCo pairing, as the algorithm drives it: each outer step, a peer finds a random partner and swaps tensors with
it, or steps alone when nobody comes.

There is no leader and no global barrier. `Pairing` is the one object the daemon and noloco.py hold: the trainer
reports its progress and hands over its tensors at the boundary (`run_round`, and `start_ahead` for send-ahead);
the service routes `Rounds.Match` to `answer` and `Rounds.Exchange` to `serve`. Matchmaking (who pairs with whom,
when) is in peerd/matchmaking.py; the exchange of tensors within a group in peerd/pair_exchange.py.

This module knows nothing of models: it moves named flat fp32 tensors and returns what each member contributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from peerd import faults
from peerd.allreduce import RoundStats
from peerd.codecs import Codec
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.matchmaking import Matchmaker, Transport
from peerd.membership import copy_peer
from peerd.pair_exchange import Exchange, PairingError, PairSettings, Session, kinds_for
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")


@dataclass
class PairOutcome:
    """What one outer step's exchange produced for this peer."""

    step: int
    round_id: bytes  # empty when no partner was found
    members: list[pb.PeerInfo]  # the group, proposer first; just ourselves when no partner was found
    contributions: dict[str, dict[str, torch.Tensor]]  # peer id -> kind -> tensor, for every included peer
    lost: list[str]  # members whose contribution did not arrive complete
    match_seconds: float
    stats: RoundStats
    note: str

    @property
    def expected(self) -> list[str]:
        return [m.peer_id for m in self.members]

    @property
    def included(self) -> list[str]:
        return [m.peer_id for m in self.members if m.peer_id in self.contributions]

    @property
    def solo(self) -> bool:
        return len(self.members) == 1


class Pairing:
    """One peer's NoLoCo endpoint: a matchmaker and an exchange over the same groups. Every coroutine runs on the
    daemon's event loop; only `progress` is called from the training thread."""

    def __init__(
        self,
        *,
        identity: Identity,
        run_id: bytes,
        verifier: Verifier,
        codec: Codec,
        executor: Executor | None,
        numel: int,
        settings: PairSettings,
        transport: Transport,
        candidates: Callable[[], Sequence[pb.PeerInfo]],
        lookup: Callable[[str], pb.PeerInfo | None],
        me: Callable[[], pb.PeerInfo],
        on_rejected: Callable[[str], None] | None = None,
        on_unreachable: Callable[[str, str], None] | None = None,
        note_step: Callable[[str, int], None] | None = None,
        yield_s: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if numel < 1:
            raise PairingError("numel must be positive")
        self.identity = identity
        self.my_id = identity.peer_id
        self.run_id = run_id
        self.verifier = verifier
        self.codec = codec
        self.executor = executor
        self.numel = numel
        self.settings = settings
        self.kinds = kinds_for(settings.send_ahead)  # what run_round takes and each member sends
        self.me = me
        # (peer, "refused" or "no_answer"): we could not connect; leave it out a while (peerd/pairblocks.py)
        on_unreachable = on_unreachable or (lambda peer_id, how: None)
        # A partner finished a step with us: noted beside its gossiped entry (which its own signature covers, so it
        # is never edited), ahead of its gossip.
        self.note_step = note_step or (lambda peer_id, step: None)
        # How long to wait at our boundary for a proposal before proposing ourselves: outbound-only peers can only
        # propose (nobody dials them), so reachable peers leave them the first move (peerd/reachability.py).
        self.yield_s = yield_s or (lambda: 0.0)
        self.exchange = Exchange(
            identity=identity,
            run_id=run_id,
            verifier=verifier,
            codec=codec,
            executor=executor,
            numel=numel,
            settings=settings,
            transport=transport,
            on_rejected=on_rejected or (lambda reason: None),
            on_unreachable=on_unreachable,
            still_training=lambda: self.match.at_boundary is None,
        )
        self.match = Matchmaker(
            identity=identity,
            run_id=run_id,
            settings=settings,
            transport=transport,
            exchange=self.exchange,
            candidates=candidates,
            lookup=lookup,
            me=me,
            on_unreachable=on_unreachable,
            rng=rng or random.Random(int.from_bytes(os.urandom(8), "little")),
        )
        self._ahead_task: asyncio.Task | None = None
        self._ahead_stop = False  # the send-ahead window closed: propose no more (one in flight may still land)
        self._last_round = -1  # the newest step run_round was called for

    @property
    def _session(self) -> Session | None:
        """The group we are in now, if any (tests look at it)."""
        return self.exchange.session

    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        """Called from the training thread after each inner step: see Matchmaker.progress."""
        self.match.progress(step, eta_s, phase_s)

    async def answer(self, request: pb.MatchRequest, sender: str) -> pb.MatchResponse:
        """Answer a verified `Rounds.Match` from `sender`."""
        return await self.match.answer(request, sender)

    def serve(self, messages: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
        """Server side of `Rounds.Exchange`."""
        return self.exchange.serve(messages)

    # -- the trainer's entry points ------------------------------------------------------------------------------
    async def start_ahead(self, step: int, phi: torch.Tensor) -> None:
        """Send-ahead: at the start of the inner phase for outer step `step`, encode our slow weights and look for
        a partner in the background; the slow weights stream to it while we train."""
        if not self.settings.send_ahead:
            raise PairingError("start_ahead needs noloco.send_ahead = true")
        self._check({"phi": phi}, ("phi",))
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self.executor, self.codec.encode, phi)
        if step <= self._last_round or self.match.closing:
            return  # the boundary came first (encoding waited behind other work): too late to go ahead
        if self._ahead_task is not None and not self._ahead_task.done():
            self._ahead_stop = True
            await self._ahead_task
        self._ahead_stop = False
        self.match.ahead = (step, encoded, time.monotonic())
        self.match.avail_step = step
        eta = self.match.phase_s if math.isfinite(self.match.phase_s) else self.settings.exchange_timeout
        self._ahead_task = asyncio.ensure_future(self._match_ahead(step, encoded, eta))

    async def _match_ahead(self, step: int, encoded_phi: bytes, eta: float) -> None:
        deadline = time.monotonic() + self.settings.match_timeout
        sess = await self.match.find_group(step, deadline, eta, stop=lambda: self._ahead_stop)
        if sess is not None and sess.step == step:
            self.exchange.set_own(sess, {"phi": encoded_phi})

    async def run_round(self, step: int, tensors: Mapping[str, torch.Tensor]) -> PairOutcome:
        """At the end of the inner steps for outer step `step`: exchange `tensors` (`self.kinds`: {"phi", "pair"}
        with send-ahead, else {"mix"}; flat fp32 CPU) with a group, or step alone if none forms by `match_timeout`.
        Network trouble never raises: a partner that fails shows up in the outcome's `lost`."""
        self._check(tensors, self.kinds)
        t0 = time.monotonic()
        self._last_round = max(self._last_round, step)
        loop = asyncio.get_running_loop()
        if self._ahead_task is not None and not self._ahead_task.done():
            self._ahead_stop = True  # the matching window is over; a proposal in flight may still form our group
            with contextlib.suppress(asyncio.CancelledError):
                await self._ahead_task
        encoded = {k: await loop.run_in_executor(self.executor, self._encode, tensors[k]) for k in self.kinds}
        self.match.avail_step = step
        self.match.at_boundary = encoded
        sess: Session | None = None
        try:
            if not self.settings.send_ahead:
                await self.match.pace(step, time.monotonic() + self.settings.match_timeout, until_matched=True)
            match_deadline = time.monotonic() + self.settings.match_timeout
            match_s = 0.0
            outcome: PairOutcome | None = None
            while outcome is None:
                sess = self.exchange.session
                if sess is not None and sess.step != step:
                    self.exchange.drop(sess, f"group was for step {sess.step}, we are at {step}")
                    sess = None
                if sess is not None and sess.all_settled() and not sess.got_any() and not self.settings.send_ahead:
                    self.exchange.drop(sess, "the proposer went away before sending anything")
                    sess = None
                if sess is None and not self.settings.send_ahead:
                    t_match = time.monotonic()
                    wait_until = min(t_match + self.yield_s(), match_deadline)
                    while self.exchange.session is None and time.monotonic() < wait_until and not self.match.closing:
                        await asyncio.sleep(0.02)
                    sess = await self.match.find_group(step, match_deadline, 0.0)
                    match_s += time.monotonic() - t_match
                if sess is None:
                    outcome = self._solo(step, tensors, match_s, time.monotonic() - t0)
                    break
                self.exchange.set_own(sess, encoded)
                sess.deadline = min(sess.deadline, time.monotonic() + self.settings.exchange_timeout)
                await self.exchange.wait_settled(sess)
                unconfirmed = not sess.confirmed and not sess.got_any()
                if unconfirmed and not self.settings.send_ahead and time.monotonic() < match_deadline:
                    self.exchange.drop(sess, "the proposer never opened the exchange")
                    continue  # look again while the matching deadline allows
                outcome = self._outcome(sess, tensors, match_s, time.monotonic() - t0)
            if self.settings.send_ahead:  # with send-ahead, pace before the next inner phase starts
                await self.match.pace(step + 1, time.monotonic() + self.settings.match_timeout, until_matched=False)
            return outcome
        finally:
            self.match.at_boundary = None
            self.match.avail_step = None
            self.match.ahead = None
            if sess is not None:
                self.exchange.retire(sess)
            if self.exchange.session is sess:
                self.exchange.session = None

    def _encode(self, t: torch.Tensor) -> bytes:
        bad = faults.poisoned(t)  # a test-only injector: `t` itself unless enabled
        return self.codec.encode(t) if bad is t else faults.forge_frame(self.codec, bad.contiguous())

    def _check(self, tensors: Mapping[str, torch.Tensor], kinds: Sequence[str]) -> None:
        if sorted(tensors) != sorted(kinds):
            raise PairingError(f"expected tensors {sorted(kinds)}, got {sorted(tensors)}")
        for k, t in tensors.items():
            if t.dim() != 1 or t.dtype != torch.float32 or t.numel() != self.numel or t.device.type != "cpu":
                raise PairingError(f"{k} must be a 1-D float32 CPU tensor of {self.numel} values")

    def _solo(self, step: int, tensors: Mapping[str, torch.Tensor], match_s: float, total_s: float) -> PairOutcome:
        return PairOutcome(
            step=step,
            round_id=b"",
            members=[copy_peer(self.me(), suspects=False)],
            contributions={self.my_id: dict(tensors)},
            lost=[],
            match_seconds=match_s,
            stats=RoundStats(seconds=total_s),
            note="no partner",
        )

    def _outcome(
        self, sess: Session, tensors: Mapping[str, torch.Tensor], match_s: float, total_s: float
    ) -> PairOutcome:
        contributions = {self.my_id: dict(tensors)}
        for pid in sess.member_ids:
            if pid != self.my_id and sess.complete(pid):
                contributions[pid] = dict(sess.received[pid])
        lost = [pid for pid in sess.member_ids if pid not in contributions]
        for pid in contributions:  # they finished that step with us: do not wait for gossip to say so (pacing)
            if pid != self.my_id and pid in sess.peer_steps:
                self.note_step(pid, sess.peer_steps[pid] + 1)
        others = [pid[:8] for pid in sess.member_ids if pid != self.my_id]
        note = ("partner " if len(others) == 1 else "group ") + ",".join(others)
        if lost:
            reasons = sorted({sess.errors.get(p, "") for p in lost} - {""})
            note += "; lost " + ",".join(p[:8] for p in lost) + (f" ({'; '.join(reasons)})" if reasons else "")
        sess.stats.seconds = total_s
        return PairOutcome(
            step=sess.step,
            round_id=sess.round_id,
            members=list(sess.members),
            contributions=contributions,
            lost=lost,
            match_seconds=match_s,
            stats=sess.stats,
            note=note,
        )

    async def close(self) -> None:
        """Stop matching; let streams that carry our finished contributions deliver them (up to PAIR_DRAIN_S, so a
        partner in its last exchange with us does not lose our tensors), then abandon every group."""
        self.match.closing = True
        self._ahead_stop = True
        if self._ahead_task is not None:
            self._ahead_task.cancel()
        await self.exchange.close()
