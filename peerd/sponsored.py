"""The sponsored peer's side of DiLoCo: train on while our work travels to a sponsor, then catch up without losing any.

A peer the swarm flagged slow for its link (peerd/sponsor.py says why) no longer joins rounds. At each window's end
it does what its link allows, and never waits for it:

1. nothing in flight: snapshot its pseudo-gradient (global - local) and upload it to its sponsor, in the background;
2. the upload is in flight: train on;
3. the sponsor answered that its round for step S included the work: if we hold state S, ask the sponsor for that
   round's average (Rounds.RoundAverage); otherwise download the state of step S + 1 or newer. Either in the
   background, training on;
4. the average arrived: take the outer step as the members did, and check the state against the digest the sponsor
   published for S + 1 (a mismatch, or no average: download the state instead). Or the state arrived: adopt it.
   Then put the work done since the snapshot back on top (local = new global - work since), so no inner step is
   lost; then back to 1, once the delay the sponsor's answers taught us has passed.

Why the average: it is the model's size once, where a state download is params and outer momentum, twice that. On a
slow link the download is most of the cycle, and the work trained meanwhile is trained on the state before.

The delay: work trained before we adopt the newest state is one round stale when it is applied. The sponsor tells
how long it held each upload before its round took it (`held_ms`), and the next snapshot is taken that much later,
less SLACK_S, so uploads reach the sponsor just before its round and as much of each contribution as the link allows
was trained on the newest state.

Staleness is the price: the work joins the global some rounds after the state it started from (the uploads and the
download take that long on the slow link). An upload the sponsor could not place ("stale": based too far back;
"closing"; a sponsor that died) is not lost either: the peer downloads the newest state, keeps all its pending work on
top, and contributes it afresh.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from peerd.algorithm import StepDone, Trainer
from peerd.swarm import SponsorPort
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

SLACK_S = 1.5  # how early our upload should reach the sponsor before its round takes what it holds
# The longest work that goes back into rounds whole: 4 windows' norm stays well under robust.max_norm_ratio (10) x a
# one-window contribution's, the bound the owners refuse beyond (a sponsor clips at a quarter of it, sponsor.py).
REJOIN_WINDOWS = 4


@dataclass
class SponsoredStats:
    """What sponsoring did, for summary.json and status."""

    sent: int = 0  # uploads the sponsor's round included
    resent: int = 0  # uploads that had to go again (sponsor lost, stale, refused)
    steps: int = 0  # inner steps behind the included uploads
    applied: int = 0  # outer steps we took from our sponsor's round average (the rest: state downloads)


class SponsoredPeer:
    """The state machine above. `global_params` and the model belong to the DiLoCo algorithm that drives it."""

    def __init__(self, port: SponsorPort) -> None:
        self.port = port
        self.upload: concurrent.futures.Future | None = None
        self.fetch: concurrent.futures.Future | None = None
        self.fetching_average = False  # `fetch` is our sponsor's round average, not the whole state
        self.sent_from: torch.Tensor | None = None  # our local weights when we took the uploaded snapshot
        self.sent_steps = 0  # inner steps behind the upload in flight
        self.sent_windows = 0  # training windows behind it
        self.sent_base = 0  # the outer step it was based on: the round it aims for
        self.upload_at: float | None = None  # when the next snapshot is due (monotonic; None: none scheduled)
        self.delay_s = 0.0  # how long after adopting a state we wait before the next snapshot (see _retime)
        self.sponsor = ""
        self.stats = SponsoredStats()
        self._fetcher: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        """Work in flight, a state on its way or a snapshot scheduled: the sponsored cycle must finish before any
        round of our own."""
        return (
            self.upload is not None
            or self.fetch is not None
            or self.sent_from is not None
            or self.upload_at is not None
        )

    def poll(self, trainer: Trainer, algo: DiLoCoLike) -> StepDone | None:
        """After any inner step: move the cycle on when its network part finished (an answered upload starts the
        download; a downloaded state is adopted and the next snapshot is scheduled; a due snapshot is uploaded),
        without waiting for the window's end."""
        if self.fetch is not None and self.fetch.done():
            done = self._adopt(trainer, algo)
            if done is not None and self.sent_from is None:
                self.upload_at = time.monotonic() + self.delay_s
            return done
        if self.upload is not None and self.upload.done():
            self._answered(trainer, algo)
        if self.upload_at is not None and time.monotonic() >= self.upload_at:
            self.upload_at = None
            self._start_upload(trainer, algo, at_window_end=False)  # False: back in rounds at the next window's end
        return None

    def at_window_end(self, trainer: Trainer, algo: DiLoCoLike) -> tuple[bool, StepDone | None]:
        """One look at the cycle at the end of a training window; never blocks on the network. Returns whether we
        are sponsored (False: DiLoCo joins the round itself) and the outer step an adopted state took us to."""
        if self.fetch is not None:
            return True, (self._adopt(trainer, algo) if self.fetch.done() else None)
        if self.upload is not None:
            if self.upload.done():
                self._answered(trainer, algo)
            return True, None
        if self.sent_from is not None:  # an answered upload whose state download failed: ask again
            self._start_fetch(trainer, algo, trainer.outer_step + 1)
            return True, None
        if self.upload_at is not None:  # our next snapshot is timed to reach the sponsor just before its round
            return True, None
        return self._start_upload(trainer, algo, at_window_end=True), None

    def _start_upload(self, trainer: Trainer, algo: DiLoCoLike, at_window_end: bool) -> bool:
        """Snapshot our pending work and send it to our sponsor; False when we need none (any more)."""
        sponsor = self.port.target()
        if not sponsor:
            if self.sponsor:
                self.sponsor = ""
                self._rejoin(trainer, algo, at_window_end)
            return False  # not flagged (any more), or nobody can carry us: DiLoCo joins rounds again
        self.sponsor = sponsor
        local = trainer.layout.flatten(trainer.model).detach().float()
        pseudo = algo.global_params.to(local.device) - local
        windows = max(algo.windows_pending, 1)
        # One window's weight: a contribution k windows long already moves the weights k times as far (sponsor.py)
        tokens = algo.steps_pending * trainer.tokens_per_step // windows
        self.sent_from = local.clone()
        self.sent_steps = algo.steps_pending
        self.sent_windows = windows
        self.sent_base = trainer.outer_step
        algo.steps_pending = algo.windows_pending = 0
        self.upload = self.port.upload(sponsor, pseudo.cpu(), trainer.outer_step, max(tokens, 1))
        return True

    def _rejoin(self, trainer: Trainer, algo: DiLoCoLike, at_window_end: bool) -> None:
        """Back in rounds: the work since our last snapshot goes into the next round, counted as one window
        (mid-window, the next window's end counts this one). Work that spans more than REJOIN_WINDOWS windows is
        scaled to that length first, as a sponsor clips what it carries, and the rest counted discarded: the owners
        refuse a contribution over robust.max_norm_ratio x theirs, which fails the round for everyone. Seen at 64
        peers: work piled up over 16 failed uploads to a dead sponsor, and hundreds of 1 ms steps trained while one
        upload waited a 60 s round, each went into a round as one window, 16x and 110x the owners' norm."""
        windows = algo.windows_pending  # window ends since the snapshot, and those of work failed uploads gave back
        algo.windows_pending = 1 if at_window_end else 0
        algo.carried_in_a_row = 0  # a round that finds us behind carries this work, not drops it
        if windows <= REJOIN_WINDOWS or not algo.steps_pending:
            return
        keep = REJOIN_WINDOWS / windows
        local = trainer.layout.flatten(trainer.model).detach().float()
        base = algo.global_params.to(local.device)
        trainer.layout.unflatten_into(base - (base - local) * keep, trainer.model)
        dropped = algo.steps_pending - int(algo.steps_pending * keep)
        algo.steps_pending -= dropped
        algo.discarded_steps += dropped
        log.warning("back in the swarm's rounds with %d windows of work: scaled to %d windows' worth (%d inner steps "
                    "counted discarded), as the owners' norm bound would refuse it whole", windows, REJOIN_WINDOWS,
                    dropped)  # fmt: skip

    def _answered(self, trainer: Trainer, algo: DiLoCoLike) -> None:
        assert self.upload is not None
        try:
            resp = self.upload.result()
        except Exception as exc:  # refused, unreachable, cancelled at shutdown: never crash the trainer over it
            why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else (str(exc) or type(exc).__name__)
            resp = None
            log.warning("sponsor %s did not take our work (%s): downloading the swarm's state, keeping the work",
                        self.sponsor[:8], why)  # fmt: skip
        self.upload = None
        if resp is not None and resp.included_step >= 0:
            self._retime(resp, trainer.cfg.network.round_timeout)
            self.stats.sent += 1
            self.stats.steps += self.sent_steps
            log.info("our work (%d inner steps) is in the swarm's round for step %d, via sponsor %s",
                     self.sent_steps, resp.included_step, self.sponsor[:8])  # fmt: skip
            if resp.included_step == trainer.outer_step:  # we hold the state that round started from
                self.fetching_average = True
                numel = algo.global_params.numel()
                timeout = trainer.cfg.network.round_timeout
                self.fetch = self.port.fetch_average(self.sponsor, resp.included_step, numel, timeout)
            else:
                self._start_fetch(trainer, algo, resp.included_step + 1)
            return
        if resp is not None:
            log.warning("sponsor %s gave our work back (%s): downloading the swarm's state, keeping the work",
                        self.sponsor[:8], resp.reason)  # fmt: skip
        # Not included: every step since the snapshot's base is still ours to contribute.
        self.stats.resent += 1
        self.sent_from = algo.global_params.clone()
        algo.steps_pending += self.sent_steps
        algo.windows_pending += self.sent_windows  # its windows count: per-window weight, and the cap in _rejoin
        self.sent_steps = self.sent_windows = 0
        self._start_fetch(trainer, algo, trainer.outer_step)

    def _retime(self, resp: pb.SponsorResponse, cap_s: float) -> None:
        """Move our next snapshot later by the time this upload waited at the sponsor, less SLACK_S: the later the
        snapshot, the more of its work was trained on the newest state (fresh) rather than the one before (stale).
        An upload that missed the round it aimed for (its base step's) waited a whole round: back off by half."""
        held = resp.held_ms / 1000.0
        if resp.included_step <= self.sent_base:
            self.delay_s = min(max(0.0, self.delay_s + held - SLACK_S), cap_s)
        else:
            self.delay_s = max(0.0, self.delay_s / 2 - SLACK_S)

    def _start_fetch(self, trainer: Trainer, algo: DiLoCoLike, min_step: int) -> None:
        if self._fetcher is None:
            self._fetcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peerd-sponsored")
        shapes = {k: tuple(v.shape) for k, v in algo.state_tensors().items()}
        timeout = trainer.cfg.network.round_timeout
        self.fetch = self._fetcher.submit(trainer.swarm.fetch_state, min_step, shapes, timeout, False)

    def _adopt(self, trainer: Trainer, algo: DiLoCoLike) -> StepDone | None:
        assert self.fetch is not None and self.sent_from is not None
        if self.fetching_average:
            return self._apply_average(trainer, algo)
        try:
            snap = self.fetch.result()
        except Exception as exc:  # nobody serves it yet, or a download that failed its checks: try again
            log.warning("could not download the swarm's state (%s); trying again next window", exc)
            self.fetch = None
            return None
        self.fetch = None
        if snap.step < trainer.outer_step:
            return None  # an older state than ours (a peer lagging behind served it): keep ours, ask again
        since = self._work_since(trainer)  # before adopting: that overwrites our weights
        trainer.adopt(snap, "sponsored")
        self._put_back(trainer, algo, since)
        return StepDone(trainer.outer_step)

    def _apply_average(self, trainer: Trainer, algo: DiLoCoLike) -> StepDone | None:
        """Take the outer step of the round that carried our work from its average, as the members did; anything
        wrong (no average, or a state that is not the one the sponsor published) falls back to the state download."""
        assert self.fetch is not None and self.sent_from is not None
        fut, self.fetch, self.fetching_average = self.fetch, None, False
        step = trainer.outer_step
        try:
            snap, digest = fut.result()
            applied = algo.apply_average(trainer, snap.tensors["average"], snap.work, digest)
            why = "" if applied else "the state it gave differs from the one the sponsor published"
        except Exception as exc:  # refused, gone, a malformed stream: the state download still gets us there
            why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else (str(exc) or type(exc).__name__)
        if why:
            log.warning("could not take step %d from sponsor %s's round average (%s): downloading the state",
                        step, self.sponsor[:8], why)  # fmt: skip
            self._start_fetch(trainer, algo, step + 1)
            return None
        self._put_back(trainer, algo, self._work_since(trainer))
        self.stats.applied += 1
        log.info("took step %d from sponsor %s's round average (half the bytes of a state download)",
                 step + 1, self.sponsor[:8])  # fmt: skip
        return StepDone(step + 1)

    def _work_since(self, trainer: Trainer) -> torch.Tensor:
        """The work we did while our upload travelled, as a pseudo-gradient: the snapshot's weights minus ours now."""
        assert self.sent_from is not None
        local = trainer.layout.flatten(trainer.model).detach().float()
        return self.sent_from.to(local.device) - local

    def _put_back(self, trainer: Trainer, algo: DiLoCoLike, since: torch.Tensor) -> None:
        """The new global state with that work on top (local = global - since): no inner step is lost."""
        trainer.layout.unflatten_into(algo.global_params.to(since.device) - since, trainer.model)
        self.sent_from = None

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)


class DiLoCoLike(Protocol):
    """What SponsoredPeer reads and resets of the DiLoCo algorithm (peerd/diloco.py)."""

    global_params: torch.Tensor
    steps_pending: int
    windows_pending: int
    carried_in_a_row: int
    discarded_steps: int

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def apply_average(self, trainer: Trainer, average: torch.Tensor, included: int, digest: bytes) -> bool: ...
