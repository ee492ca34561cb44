"""DiLoCo (Douillard et al. 2023): every H inner steps, peers average pseudo-gradients and take an outer Nesterov step.

pseudo-gradient = global params - local params. Every peer of the round receives the same averaged bytes and applies
the same deterministic outer update to the same global copy, so global params are bit-identical after a round.

Uneven peers (`inner.window_s`): instead of exactly H steps, each peer trains for a wall-clock window that starts when
its last round ended, so a slow peer takes fewer steps and nobody waits for it. Each contribution carries the tokens
behind it and the round averages pseudo-gradients weighted by them (peerd/roundclient.py). A peer whose round went on
without it keeps its work (`outer.late_work = "carry"`): it adopts the swarm's new state, re-applies its own pending
pseudo-gradient on top, and contributes it, with its tokens, in the next round.

Slow links (`outer.slow_link = "sponsor"`): a peer the swarm flags slow for its link stops joining rounds and sends
its work through a sponsor (peerd/sponsored.py); every peer also sponsors such peers, adding the work they sent to its
own contribution (peerd/sponsor.py), so no round waits for a slow link.

Overlapped rounds (`outer.overlap`): a synchronous round stops compute for its whole duration, which on a public link
is most of a peer's idle time (fp32 at 20 Mbit/s: ~6% of a 15 s window, every window). With overlap the peer starts
the round and trains the next window at once. It does not train on from its own weights: the outer step moves the
global far past them (Nesterov, lr 0.7, momentum 0.9), and steps computed there and added to the new global made
the tiny model's loss climb when most steps overlapped. It trains from an eager guess instead, the outer step taken
with its own pseudo-gradient standing in for the average (the "eager updates" of arXiv 2502.12996). When the round
lands (checked after every inner step, waited for only at the next boundary) the peer takes the real outer step on
its global copy exactly as before, so the globals stay bit-identical, and shifts its weights by (new global - guess):
local = new global + the steps trained meanwhile. Those steps go into the next round's pseudo-gradient; nothing is
discarded. A failed round undoes the guess. The run's last round stays synchronous, so a run ends with local = global.
With `inner.window_s` no round ends the windows together any more, so they keep the swarm's clock instead: the next
window starts where the last was due, and a round that lands moves the next boundary by how far from the group's
median member we joined it (peerd/timings.join_offset_s). With a fixed H an overlapped peer's boundaries come when its
own steps are done, so a peer with less CPU joins every round late (and may be flagged): windows suit overlap better.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from peerd.algorithm import OuterAlgorithm, StepDone, Trainer, feedback_for
from peerd.allreduce import RoundFailed
from peerd.rendezvous import Behind
from peerd.sponsor import combine
from peerd.sponsored import SponsoredPeer
from peerd.statesync import state_digest
from trainer.outer import NesterovOuter

log = logging.getLogger("peerd")
# Missed rounds in a row whose work a late peer carries into the next. Two, not one: a peer whose state arrived a
# round late (back from sponsorship, or after a heal at its boundary) can find the next round done too before it meets
# the swarm's clock, and with one its two-window pile was dropped (CI, tests/test_sponsor.py). The owners' norm
# screen judges a contribution per the work it claims (robust.py), so a longer honest pile is not refused for it.
CARRY_ROUNDS = 2
# A contribution covers at most this many windows of work: the carried rounds, plus the window in progress.
MAX_PENDING_WINDOWS = CARRY_ROUNDS + 1
UNUSUAL_SIZE = 3.0  # a contribution this many times our recent applied ones' RMS is logged with what sized it


@dataclass
class _Flight:
    """An overlapped round in progress: what it needs to land once its average arrives."""

    step: int
    future: concurrent.futures.Future
    sent: torch.Tensor  # the vector the round averages (with error feedback and sponsored work folded in)
    base: torch.Tensor  # our pending pseudo-gradient at the boundary: local = global - base then
    taken: list[Any]  # sponsored work riding in it (peerd/sponsor.py)
    steps: int  # inner steps behind it
    guess: torch.Tensor | None = None  # overlap: the global we guessed and trained on from (None: synchronous)


class DiLoCo(OuterAlgorithm):
    name = "diloco"

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.H = cfg.inner.steps
        self.window_s = cfg.inner.window_s
        self.carry = cfg.outer.late_work == "carry"
        self.outer = NesterovOuter(cfg.outer.lr, cfg.outer.momentum)
        self.global_params = trainer.layout.flatten(trainer.model).detach().float().cpu().clone()
        # Error feedback: what quantization dropped from our contribution this round is added to the next one.
        self.feedback = feedback_for(cfg.codec)
        self.steps_pending = 0  # inner steps behind our pending pseudo-gradient (since our last applied round)
        self.window_start = time.monotonic()
        # What the uneven-peer rules did, for status and benchmarks: work carried into a later round, work dropped.
        self.carried_steps = 0
        self.discarded_steps = 0
        self.carried_in_a_row = 0  # adoptions since our last applied round that kept our pending work
        self.windows_pending = 0  # training windows (due points) behind our pending pseudo-gradient
        # Slow links: we carry sponsored peers' work in our rounds, and send ours through a sponsor when ours is slow
        self.sponsoring = trainer.swarm.open_sponsoring(self.global_params.numel())
        self.sponsored = SponsoredPeer(self.sponsoring)
        self.carried_for_others = 0  # sponsored contributions our rounds included
        self.overlap = cfg.outer.overlap
        self.flight: _Flight | None = None  # the overlapped round in progress
        self.owed = False  # a boundary came while a round was in flight: the next inner step starts its round
        self.overlapped_steps = 0  # inner steps trained while a round ran (what overlap saved us waiting)
        self.trainer = trainer  # close() takes an unlanded guess back out before the worker checkpoints the model
        self.sent_rms = 0.0  # our last contribution's RMS (`_note_size`)
        self.applied_rms: deque[float] = deque(maxlen=8)  # those of our recent applied ones

    def _due(self, t: int) -> bool:
        if self.window_s > 0:
            return time.monotonic() - self.window_start >= self.window_s
        return (t + 1) % self.H == 0

    def _anchor(self) -> float:
        """Where an overlapped window starts: where the one before was due (windowed runs), not when its last step
        ended, so a step's overshoot does not add up window after window; never so far back that the new window is
        under three quarters long (after waiting for a round)."""
        now = time.monotonic()
        if self.window_s <= 0:
            return now
        return max(self.window_start + self.window_s, now - self.window_s / 4)

    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        self.steps_pending += 1
        if self.flight is not None:
            self.overlapped_steps += 1
            if self._due(t):  # the next boundary came before the round landed: wait for it, then start the next
                self.owed = True
            elif not self.flight.future.done():
                return None
            return self._land(trainer)
        owed, self.owed = self.owed, False
        if self.sponsored.busy:  # each phase of the sponsored cycle starts as soon as the one before it is done
            done = self.sponsored.poll(trainer, self)
            if done is not None:
                self.window_start = time.monotonic()
                return done
        if not (owed or self._due(t)):
            return None
        self.windows_pending += 1
        sponsored, done = self.sponsored.at_window_end(trainer, self)
        if sponsored:  # our link is too slow for rounds: our work travels through a sponsor (peerd/sponsored.py)
            self.window_start = time.monotonic()
            return done
        if self.windows_pending > MAX_PENDING_WINDOWS:
            # Rounds kept failing, or kept answering "behind" with nobody holding a better state: our pending work is
            # now longer than any owner accepts (its norm and its token weight both grow with it). Start over from
            # the global state, and contribute from the next window on.
            log.warning(
                "dropping %d inner steps of work: %d windows without an applied round", self.steps_pending,
                self.windows_pending - 1,
            )  # fmt: skip
            trainer.layout.unflatten_into(self.global_params, trainer.model)
            self._drop_pending()
            return None
        pending = self._pending(trainer)
        if trainer.heal():  # a better state than ours is live (we are behind, or lost a split): adopt it
            self._keep_or_drop(trainer, pending)
            self._align_window(trainer.heal_boundary, "gossip first showed its state")
            return None
        step = trainer.outer_step
        norm = float(torch.linalg.vector_norm(pending))  # one pass over the vector, for the size line and sponsoring
        self._note_size(trainer, step, norm / math.sqrt(pending.numel()) if pending.numel() else 0.0)
        pseudo = pending
        if self.feedback is not None:
            pseudo = self.feedback.compensate("params", pseudo.cpu())
        tokens = self.steps_pending * trainer.tokens_per_step
        # Slow-link peers' work that reached us: it rides in our contribution, each part at its own weight
        taken = self.sponsoring.take(step, norm)
        pseudo, tokens = combine(pseudo, tokens, taken)
        want_decoded = self.feedback is not None and self.feedback.needs_decoded
        args = {"want_decoded": want_decoded, "tokens": tokens, "carries": [w.peer_id for w in taken]}
        if self.overlap and not 0 < trainer.cfg.run.outer_steps <= step + 1:
            future = trainer.swarm.allreduce_async(step, pseudo, **args)
            # where the next window trains from: the outer step if the round's average were our own pseudo-gradient
            guess = self.outer.preview(self.global_params.to(pending.device), pending)
            self.flight = _Flight(step, future, pseudo, pending, taken, self.steps_pending, guess)
            trainer.layout.unflatten_into(guess, trainer.model)
            self.window_start = self._anchor()  # the next window trains while the round runs
            return None
        t0 = time.perf_counter()
        future = concurrent.futures.Future()
        try:
            future.set_result(trainer.swarm.allreduce(step, pseudo, **args))
        except (Behind, RoundFailed) as exc:
            future.set_exception(exc)
        self.flight = _Flight(step, future, pseudo, pending, taken, self.steps_pending)
        return self._land(trainer, t0)

    def _land(self, trainer: Trainer, t0: float | None = None) -> StepDone | None:
        """Wait for the round in flight (at once when it is done) and apply it: the outer step on the global copy,
        and our weights moved onto the new global with the progress made since the boundary kept on top. `t0`:
        when we began to wait for it (idle time)."""
        fl = self.flight
        assert fl is not None
        t0 = time.perf_counter() if t0 is None else t0
        try:
            result = fl.future.result()
        except Behind as exc:
            self.flight = None
            self._unguess(trainer, fl)
            self.sponsoring.settle(fl.taken, None)
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("step %d is already done in the swarm (now at %d): downloading state", fl.step, exc.step)
            pending = self._pending(trainer)  # all our work since the last applied round, overlapped steps too
            # The leader saw the newer state before gossip brought it here: give gossip a moment rather than train
            # another window on a state already left behind (its work would then be two windows long: dropped).
            swarm_boundary = time.monotonic() - exc.since_s  # when the round we missed formed at its leader
            if not trainer.resync(-1, wait_s=2 * trainer.cfg.network.gossip_interval):
                return None
            self._keep_or_drop(trainer, pending)
            self._align_window(swarm_boundary if exc.since_s > 0 else None, "the round we missed formed")
            return StepDone(trainer.outer_step)
        except (RoundFailed, concurrent.futures.CancelledError) as exc:
            # Keep our local progress and try again at the next outer step; never crash the peer.
            self.flight = None
            self._unguess(trainer, fl)
            self.sponsoring.settle(fl.taken, None)
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("outer step %d failed (%s); training on and retrying at the next outer step", fl.step, exc)
            if not self.overlap:
                self.window_start = time.monotonic()
            return None
        trainer.add_idle(time.perf_counter() - t0)
        self.flight = None
        step, taken = fl.step, fl.taken
        if taken:  # the peers we carried take the outer step from this average themselves (RoundAverage)
            self.sponsoring.keep_average(step, result.average, len(set(result.included)), [w.peer_id for w in taken])
        self.sponsoring.settle(taken, step)
        self.carried_for_others += len(taken)
        if 0 < trainer.cfg.run.outer_steps <= step + 1:
            self.sponsoring.close()  # our last round: work sent to us now would wait for a round we never run
        if self.feedback is not None:
            self.feedback.settle("params", fl.sent, result.sent_decoded, result.average)
        self.outer.step(self.global_params, result.average)
        if fl.guess is None:
            trainer.layout.unflatten_into(self.global_params, trainer.model)
        else:  # from the guess to the real global, with the steps trained meanwhile on top
            local = trainer.layout.flatten(trainer.model).detach().float()
            local += self.global_params.to(local.device) - fl.guess
            trainer.layout.unflatten_into(local, trainer.model)
        if self.overlap and self.window_s > 0 and not self.owed:  # landed within the next window: align its end
            shift = max(-self.window_s / 4, min(self.window_s / 4, result.join_offset_s))
            self.window_start -= shift
            log.debug(
                "joined round %d %+.2f s from the median member: next boundary moved %+.2f s", step, shift, -shift
            )
        self.work += len(set(result.included))
        self.applied_rms.append(self.sent_rms)
        self.steps_pending -= fl.steps
        self.windows_pending = 0
        self.carried_in_a_row = 0
        if not self.overlap:
            self.window_start = time.monotonic()
        return StepDone(step + 1, result)

    def _align_window(self, boundary: float | None, what: str) -> None:
        """Windowed runs, after adopting the swarm's newer state: start the next window at `boundary` (monotonic;
        None: unknown), where the swarm's started: when the round we missed formed at its leader (a "behind" answer),
        or when gossip first showed the state (a heal at our boundary). From "now" a late peer stayed as late as it
        was, plus the download, and missed round after round: in CI a peer late once at the start found the swarm
        ahead at each of its next 15 boundaries and carried or dropped every window's work, never in a round. Never
        further back than one window: then the next round is due at once."""
        if self.window_s <= 0 or boundary is None:  # monotonic time starts at boot: a real boundary can be < 0
            return
        now = time.monotonic()
        self.window_start = max(boundary, now - self.window_s)
        log.info("next window aligned with the swarm's (%s): it started %.2f s ago", what, now - self.window_start)

    def _note_size(self, trainer: Trainer, step: int, sent_rms: float) -> None:
        """Log a contribution far larger than our recent applied ones, with what sized it: the owners' norm screen
        (robust.max_norm_ratio) refuses one 10x theirs per claimed work. At 64 peers under churn honest peers'
        carries were refused so while the screen judged token-weighted norms (BENCHMARKS.md, "Scale", stops 38-41)."""
        self.sent_rms = sent_rms
        usual = statistics.median(self.applied_rms) if len(self.applied_rms) >= 3 else 0.0
        if usual > 0 and self.sent_rms > UNUSUAL_SIZE * usual:
            log.info(
                "step %d: our contribution's RMS %.3g is %.1fx our recent ones' (%d inner steps over %d windows, "
                "%d carried in a row; %s)", step, self.sent_rms, self.sent_rms / usual, self.steps_pending,
                self.windows_pending, self.carried_in_a_row, trainer.inner_note(),
            )  # fmt: skip

    def _unguess(self, trainer: Trainer, fl: _Flight) -> None:
        """The round did not land: take the guess back out of our weights, keeping the steps trained since, so our
        pending work is again global - local."""
        if fl.guess is None:
            return
        local = trainer.layout.flatten(trainer.model).detach().float()
        local -= fl.guess - (self.global_params.to(local.device) - fl.base)
        trainer.layout.unflatten_into(local, trainer.model)

    def _pending(self, trainer: Trainer) -> torch.Tensor:
        """Our pseudo-gradient so far: the global state we started from minus where inner steps took us."""
        local = trainer.layout.flatten(trainer.model).detach().float()
        return self.global_params.to(local.device, non_blocking=True) - local

    def _keep_or_drop(self, trainer: Trainer, pending: torch.Tensor) -> None:
        """The swarm moved on without us and we adopted its state. "carry": put our pending pseudo-gradient back on
        top of the new global (local = global - pending), so the next round includes it with its tokens; its
        staleness is the rounds it missed. "discard": start over from the swarm's state.

        Work is carried over CARRY_ROUNDS missed rounds in a row at most, as a pile of as many windows: a peer that
        keeps missing rounds (a joiner behind a fast swarm, a peer far slower than the window) would otherwise pile
        up a pseudo-gradient many windows long and many rounds stale. The owners' norm screen divides its token
        weight out and allows for the work it claims, but claims count for at most rendezvous.MAX_WEIGHT_RATIO x the
        group's lower median, so a long enough pile is refused (and banned after repeats)."""
        self.window_start = time.monotonic()
        short = self.carried_in_a_row < CARRY_ROUNDS and self.windows_pending <= CARRY_ROUNDS
        if self.carry and self.steps_pending and short:
            self.carried_in_a_row += 1
            local = self.global_params.to(pending.device) - pending
            trainer.layout.unflatten_into(local, trainer.model)
            self.carried_steps += self.steps_pending
            log.info("carrying %d inner steps of work into the next round", self.steps_pending)
            return
        if self.steps_pending:
            log.info("dropping %d inner steps of work: the swarm moved on without it", self.steps_pending)
        self._drop_pending()

    def _drop_pending(self) -> None:
        """Count our pending work as discarded and start a fresh window (the model already holds the state to
        train on)."""
        self.discarded_steps += self.steps_pending
        self.steps_pending = self.windows_pending = self.carried_in_a_row = 0
        self.window_start = time.monotonic()

    def sponsor_summary(self) -> dict[str, int]:
        st = self.sponsored.stats
        probes, recovered = self.sponsoring.probes()
        return {
            "sent": st.sent, "resent": st.resent, "steps": st.steps, "applied": st.applied,
            "carried": self.carried_for_others,
            "probes": probes, "recovered": recovered,
        }  # fmt: skip

    def _abandon(self) -> None:
        """Forget the round in flight (we adopted another state, or stop): its average no longer applies to ours."""
        if self.flight is not None:
            self.sponsoring.settle(self.flight.taken, None)
            self.flight = None
        self.owed = False

    def close(self) -> None:
        if self.flight is not None:  # stopping mid-round: the checkpoint keeps our weights as pending work, no guess
            self._unguess(self.trainer, self.flight)
        self._abandon()
        self.sponsored.close()
        self.sponsoring.close()

    def apply_average(self, trainer: Trainer, average: torch.Tensor, included: int, digest: bytes) -> bool:
        """A sponsored peer takes the outer step of the round that carried its work, from that round's average (its
        sponsor's RoundAverage), as the members did: the state must come out bit-identical to theirs, so it is
        checked against the digest the sponsor published for it, and left untouched (False) when it differs."""
        params = self.global_params.clone()
        old = self.outer.buffers.get(None)
        if old is not None:
            self.outer.buffers[None] = old.clone()  # the step updates the momentum in place: keep ours until checked
        self.outer.step(params, average.to(params.device))
        state = _named_state(params, self.outer.buffers[None])
        if state_digest(trainer.outer_step + 1, state, self.work + included) != digest:
            if old is None:
                del self.outer.buffers[None]
            else:
                self.outer.buffers[None] = old
            return False
        self.global_params = params
        self.work += included
        return True

    def state_tensors(self) -> dict[str, torch.Tensor]:
        momentum = self.outer.buffers.get(None)
        if momentum is None:
            momentum = torch.zeros_like(self.global_params)
        return _named_state(self.global_params.clone(), momentum.clone())

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        self._abandon()
        self.global_params = tensors["params"].float().clone()
        self.outer.buffers[None] = tensors["outer_momentum"].float().clone()
        trainer.layout.unflatten_into(self.global_params, trainer.model)


def _named_state(params: torch.Tensor, momentum: torch.Tensor) -> dict[str, torch.Tensor]:
    """DiLoCo's state tensors by name: what is served, downloaded and digested (one layout for all three)."""
    return {"params": params, "outer_momentum": momentum}
