"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): sync one fragment of the model at a time, on
a staggered schedule, while inner training goes on.

Why: plain DiLoCo sends the whole model at once and the trainer waits for it. Cutting the model into P
fragments (groups of transformer blocks, `trainer.fragments`) divides the bytes in flight at any moment by P,
and letting each fragment's exchange overlap `tau` inner steps hides its latency, so on a slow link compute
barely idles. Outer gradients should go out in 4 bits: set ``codec.name = "e3m0"`` in the run config (the
paper's choice; the daemon accumulates the average in fp32). Any codec works; fp32 just sends 8x more.

Schedule. ``s`` counts inner steps completed in the swarm's timeline. Fragment p syncs when
(s - t_p) % H == 0, offsets t_p = p*H//P; that round is numbered ``step = (s - t_p) // H`` and
the outer step is ``s // H`` (full cycles), so the rendezvous leader expects the peers whose gossiped outer
step is step-1 or step. One outer step (evaluate, publish, checkpoint) happens per cycle, at s % H == 0.

tau. ``streaming.tau = "auto"`` (the default) sets the merge delay from measured times: 1.25x the average round
over the average inner step, capped at H - t_last so merges never cross a cycle boundary. It is local: the merge
touches only this peer's own parameters (see `_retune`).

Update. When fragment p's averaged pseudo-gradient lands, ``global_p <- NesterovOuter(key=p).step(global_p,
avg)`` (separate momentum per fragment), and at s_start + tau ``local_p <- alpha * local_p + (1 - alpha) *
global_p`` (`trainer.outer.streaming_merge`).

Keeping every peer's global copy bit-identical:

* The *global* update of a round is applied as soon as its result is seen, whatever the late policy: it is
  the same bytes on every peer, and a fragment's rounds are applied in order because its next sync never
  starts before the previous one is resolved.
* At each cycle boundary every exchange started before it is resolved (waiting if needed, counted as idle)
  before the state is published or checkpointed, so a snapshot never depends on network timing and a joiner
  that downloads it is consistent. With tau <= H - t_{P-1} (about H/P) and exchanges that finish within tau
  steps this never waits.
* ``late_policy = "wait"``: at s_start + tau the trainer blocks until the round lands (measured with
  `Trainer.add_idle`). ``"skip"``: it does not block; the *local merge* is deferred and done at the first
  inner step after the round lands (counted in ``merges_skipped``). Deferred rather than dropped, so that on
  a persistently slow link local fragments are still pulled towards the global ones.
* A peer left out of a round (`Behind`), one that resumed or downloaded state (it cannot take part in the
  rounds the swarm started at that boundary), or one whose state is outranked by a live peer's at a cycle
  boundary (the swarm is ahead, or a diverged half holds more work: peerd/consistency.py), downloads the
  canonical state at its next cycle boundary. A failed round (`RoundFailed`) is all-or-nothing, so it changes
  nobody's global copy; the digest check catches the rare case where it changed some.

Fault injection for tests: ``PEERD_FAULT_EXCHANGE_DELAY_S=2.0`` makes every fragment exchange count as landed
no earlier than 2 s after it started (the round itself runs normally): a slow link without a slow link.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from peerd import faults
from peerd.algorithm import OuterAlgorithm, StepDone, StepTimer, Trainer, feedback_for
from peerd.allreduce import RoundFailed
from peerd.fragment_sync import (
    Exchange,
    FragmentState,
    Schedule,
    StreamingError,
    StreamingStats,
    SyncRecord,
    fragment_digest,
    merge_fragment,
)
from peerd.rendezvous import Behind
from trainer.fragments import fragment_offsets, split_fragments
from trainer.outer import NesterovOuter, OuterError

if TYPE_CHECKING:
    from peerd.swarm import Swarm

log = logging.getLogger("peerd")

STATS_FILE = "streaming.json"
_CLOSE_WAIT_S = 60.0


class StreamingDiLoCo(OuterAlgorithm):
    name = "streaming"

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        sc = cfg.streaming
        if sc.late_policy not in ("wait", "skip"):
            raise StreamingError(f"streaming.late_policy must be 'wait' or 'skip', got {sc.late_policy!r}")
        self.H = cfg.inner.steps
        self.alpha = float(sc.alpha)
        self.late_policy = sc.late_policy
        self.target = cfg.run.outer_steps
        fragments = split_fragments(trainer.model, sc.fragments, sc.mode)  # type: ignore[arg-type]
        # tau = "auto": start at the cap (nothing measured yet: hide as much as the schedule allows), then follow the
        # measured round and inner step times (_retune)
        self.auto_tau = sc.tau == "auto"
        offsets = fragment_offsets(len(fragments), self.H)
        self.tau_max = max(1, min(self.H - 1, self.H - max(offsets)))  # merges never cross a cycle boundary
        tau = self.tau_max if self.auto_tau else int(sc.tau)
        self.schedule = Schedule.make(len(fragments), self.H, tau)
        self.step_timer = StepTimer()  # one inner step, and (below) one fragment round from start to landed
        self._round_s = math.nan
        flat = trainer.layout.flatten(trainer.model).detach().to("cpu", torch.float32).clone()
        outer = NesterovOuter(cfg.outer.lr, cfg.outer.momentum)
        self.state = FragmentState(trainer.layout, fragments, flat, outer)
        self.params: dict[str, nn.Parameter] = dict(trainer.model.named_parameters())
        self.fault_delay = faults.exchange_delay_s()
        self.resync_timeout = cfg.network.rendezvous_timeout + 10.0
        self.stats = StreamingStats()
        self.stats_path = Path(trainer.data_dir) / STATS_FILE
        self.last_result: Any = None  # the newest round applied, reported with the cycle's outer step
        # Error feedback per fragment (codec.error_feedback; the sparse codec needs it): what the codec dropped from a
        # fragment's contribution is added to that fragment's next one.
        self.feedback = feedback_for(cfg.codec)
        self.pending: dict[int, Exchange] = {}
        self.s = 0  # inner steps completed, in the swarm's timeline (virtual ticks with inner.window_s)
        # inner.window_s: the schedule runs on a wall clock, H ticks per window, so a slow peer's fragments sync when
        # everyone else's do (it takes fewer inner steps between them) and rounds weigh each fragment's
        # contribution by the tokens behind it. 0: one tick per inner step, as in the paper.
        self.tick_s = cfg.inner.window_s / self.H if cfg.inner.window_s > 0 else 0.0
        self._anchor = (time.monotonic(), 0)  # (when, s): where the wall clock of the current cycle started
        self.steps_since: dict[int, int] = {}  # fragment -> our inner steps since its last sync started
        self.needs_resync = False
        self._reloaded = False  # state replaced from outside (checkpoint resume, joiner download)
        if self.fault_delay:
            log.warning("fault injection: exchanges land >= %.2fs after they start", self.fault_delay)
        if not self.auto_tau and not self.schedule.boundary_wait_free():
            log.warning(
                "streaming.tau=%d > H - t_last=%d: late fragments' exchanges resolve at the cycle boundary",
                sc.tau,
                self.H - max(self.schedule.offsets),
            )

    # -- local fragments (the model's own parameters) --------------------------------------------------------
    def _local(self, p: int) -> Tensor:
        return torch.cat([self.params[n].detach().reshape(-1).float() for n in self.state.fragments[p]])

    @torch.no_grad()
    def _write_local(self, p: int, flat: Tensor) -> None:
        pos = 0
        for n in self.state.fragments[p]:
            param = self.params[n]
            k = param.numel()
            param.copy_(flat[pos : pos + k].view(param.shape))
            pos += k

    # -- the hook the worker calls ---------------------------------------------------------------------------
    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        if self._reloaded:
            self._reposition(trainer)
        for p in range(len(self.state.fragments)):
            self.steps_since[p] = self.steps_since.get(p, 0) + 1
        if not self.tick_s:
            return self._tick(trainer)
        # Windowed: catch the schedule up with the wall clock, one tick at a time, stopping at a cycle boundary.
        when, s0 = self._anchor
        target = s0 + int((time.monotonic() - when) / self.tick_s)
        boundary = (self.s // self.H + 1) * self.H
        done = None
        while self.s < min(target, boundary) and done is None:
            done = self._tick(trainer)
        if done is None:
            for ex in list(self.pending.values()):  # between ticks: still apply results that landed
                if not ex.resolved and ex.landed():
                    self._resolve(ex)
        return done

    def _tick(self, trainer: Trainer) -> StepDone | None:
        """One step of the schedule: apply landed rounds, merge what is due, finish a cycle, start due syncs."""
        self.s += 1
        s = self.s
        self.step_timer.tick(counted=(s - 1) % self.H != 0)  # the step after a boundary also timed evaluation
        for ex in list(self.pending.values()):  # results that already landed: apply their global update now
            if not ex.resolved and ex.landed():
                self._resolve(ex)
            if ex.resolved and ex.merge_pending and ex.late:
                self._merge(ex)
        for ex in [e for e in self.pending.values() if e.merge_pending and e.merge_at == s]:
            if not ex.resolved and self.auto_tau and not self.schedule.is_boundary(s):
                # "auto": a round slower than measured moves its own merge point on, step by step, instead of
                # blocking; the cycle boundary still waits for it (_finish_cycle)
                ex.merge_at = s + 1
                self.stats.merges_postponed += 1
                continue
            if not ex.resolved:
                if self.late_policy == "wait":
                    self._block(trainer, ex, "merge")
                else:
                    ex.late = True
                    self.stats.merges_skipped += 1
            if ex.resolved and ex.merge_pending:
                self._merge(ex)
        boundary = self.schedule.is_boundary(s)
        if boundary:
            self._finish_cycle(trainer, s)
        self._forget_done()
        step = self.s // self.H  # the cycle we are in (a state download at the boundary may have moved it)
        final = boundary and self.target > 0 and step >= self.target
        if not final:  # the last cycle starts no exchange: nobody would apply it
            self._start_due(trainer, self.s)
        if boundary:
            self._anchor = (time.monotonic(), self.s)  # the next cycle's clock starts after the boundary's waits
        return StepDone(step, self.last_result, published=True) if boundary else None

    def _finish_cycle(self, trainer: Trainer, s: int) -> None:
        """Quiesce before the worker publishes and checkpoints: resolve every exchange started before s."""
        for ex in list(self.pending.values()):
            if not ex.resolved:
                self._block(trainer, ex, "boundary")
            if ex.merge_pending and (ex.late or ex.merge_at <= s):
                self._merge(ex)
        step = s // self.H
        missed = self.needs_resync  # left out of rounds (behind, or state reloaded): the swarm's state will differ
        # Publish the quiesced state first, so the split-brain rule compares the claim of the state we now hold
        # (peerd/consistency.py): a swarm ahead of us, or a diverged half with more work, makes us download.
        trainer.publish(step)
        best = trainer.swarm.canonical()
        if best is not None:
            log.warning(
                "peer %s holds outer step %d with %d peer-rounds of work, we hold step %d with %d: downloading state",
                best.peer_id[:8],
                best.step,
                best.work,
                step,
                self.work,
            )
            self.needs_resync = True
        fork = best is not None and best.step <= step
        if fork:
            self.stats.digest_mismatches += 1
        if self.needs_resync:
            self._resync(trainer, fork=fork, wait=missed and best is None)
        log.info(
            "streaming cycle %d: %d syncs, %d applied, merges %d on time/%d skipped, %.2fs idle, %d resyncs",
            self.s // self.H,
            self.stats.syncs_started,
            self.stats.rounds_applied,
            self.stats.merges_on_time,
            self.stats.merges_skipped,
            self.stats.wait_seconds,
            self.stats.resyncs,
        )

    def _start_due(self, trainer: Trainer, s: int) -> None:
        for p in self.schedule.due(s):
            if p in self.pending:  # the boundary rule prevents this: never overlap a fragment with itself
                raise RuntimeError(f"fragment {p} is still in flight when its next sync is due")
            pseudo = self.state.pseudo_gradient(p, self._local(p))
            if self.feedback is not None:
                pseudo = self.feedback.compensate(f"fragment{p}", pseudo.cpu())
            step = self.schedule.round_step(s, p)
            record = SyncRecord(fragment=p, step=step, s=s, t_start=time.time())
            tokens = self.steps_since.get(p, 0) * trainer.tokens_per_step
            self.steps_since[p] = 0
            future = trainer.swarm.allreduce_async(
                step,
                pseudo,
                fragment=p,
                want_decoded=self.feedback is not None and self.feedback.needs_decoded,
                tokens=tokens,
            )
            future.add_done_callback(lambda f, step=step: self._note_members(trainer.swarm, step, f))

            ready_at = time.monotonic() + self.fault_delay
            self.pending[p] = Exchange(record, self.schedule.merge_at(s), future, ready_at)
            self.pending[p].sent = pseudo
            self.stats.syncs_started += 1
            self.stats.syncs.append(record)

    @staticmethod
    def _note_members(swarm: Swarm, step: int, future: concurrent.futures.Future) -> None:
        """Everyone in fragment round `step` has reached outer step `step`: note it at once instead of waiting for
        gossip, so the next fragment's leader expects them (when cycles are shorter than the gossip interval, stale
        gossip would leave them out). DiLoCo's rounds do the same."""
        if future.cancelled() or future.exception() is not None:
            return
        swarm.note_members(step, list(future.result().included))

    def _block(self, trainer: Trainer, ex: Exchange, why: str) -> None:
        """Wait for an exchange the schedule cannot go on without; the wait is compute-idle time."""
        t0 = time.perf_counter()
        ex.wait()
        waited = time.perf_counter() - t0
        trainer.add_idle(waited)
        self.stats.wait_seconds += waited
        if why == "merge":
            self.stats.merge_waits += 1
        else:
            self.stats.boundary_waits += 1
        self._resolve(ex)

    def _resolve(self, ex: Exchange) -> None:
        """Apply a finished round's global update (identical on every peer of the round), or note why not."""
        ex.resolved = True
        rec = ex.record
        p = ex.fragment
        try:
            result = ex.future.result(timeout=0)
        except Behind as exc:
            rec.outcome, ex.merge_pending = "behind", False
            self.stats.rounds_behind += 1
            self.needs_resync = True
            log.warning("left out of fragment %d round %d (swarm at %d): resync", p, rec.step, exc.step)
            return
        except Exception as exc:  # RoundFailed or anything else: the round did not complete for us
            rec.outcome, ex.merge_pending = "failed", False
            self.stats.rounds_failed += 1
            log.warning("fragment %d round %d failed: %s; its global copy is unchanged", p, rec.step, exc)
            return
        try:
            new_global = self.state.apply_average(p, result.average)
        except (OuterError, StreamingError) as exc:  # same bytes everywhere: every peer refuses it alike
            rec.outcome, ex.merge_pending = "failed", False
            self.stats.rounds_failed += 1
            log.warning("fragment %d round %d returned an unusable average: %s", p, rec.step, exc)
            return
        st = result.stats
        if self.feedback is not None and ex.sent is not None:
            self.feedback.settle(f"fragment{p}", ex.sent, result.sent_decoded, result.average)
        self._retune(rec)
        self.work += len(set(result.included))
        rec.outcome = "applied"
        rec.digest = fragment_digest(new_global)
        rec.included = len(result.included)
        rec.wire_bytes, rec.received_wire_bytes = st.wire_bytes, st.received_wire_bytes
        rec.seconds = st.seconds
        self.stats.rounds_applied += 1
        self.last_result = result

    # -- tau = "auto" -----------------------------------------------------------------------------------------
    def _retune(self, rec: SyncRecord) -> None:
        """tau = "auto": the merge point moves to where a round of the measured length has landed (x1.25 for
        jitter), capped so merges never cross a cycle boundary. tau only decides when the *local* merge happens;
        the global update is applied when the round lands, whatever tau is, so peers may differ in tau and still
        hold bit-identical global copies. A round longer than the cap still waits (at the boundary)."""
        if not self.auto_tau or rec.t_end <= rec.t_start:
            return
        took = rec.t_end - rec.t_start
        self._round_s = took if math.isnan(self._round_s) else 0.7 * self._round_s + 0.3 * took
        step_s = self.tick_s or self.step_timer.seconds  # tau counts schedule ticks
        if not (step_s > 0 and math.isfinite(self._round_s)):
            return
        tau = min(max(math.ceil(1.25 * self._round_s / step_s), 1), self.tau_max)
        if tau != self.schedule.tau:
            log.info(
                "streaming: tau %d -> %d inner steps (rounds take %.0f ms, an inner step %.0f ms)",
                self.schedule.tau,
                tau,
                1000 * self._round_s,
                1000 * step_s,
            )
            self.schedule = dataclasses.replace(self.schedule, tau=tau)
            self.stats.tau = tau

    def _merge(self, ex: Exchange) -> None:
        """local_p <- alpha*local_p + (1-alpha)*global_p, where global_p already holds this round's update."""
        p = ex.fragment
        local = self._local(p)
        merge_fragment(local, self.state.global_fragment(p), self.alpha)
        self._write_local(p, local)
        ex.merge_pending = False
        ex.record.merge = "late" if ex.late else "on_time"
        if not ex.late:
            self.stats.merges_on_time += 1

    def _forget_done(self) -> None:
        for p in [p for p, ex in self.pending.items() if ex.resolved and not ex.merge_pending]:
            del self.pending[p]

    # -- staying consistent with the swarm -------------------------------------------------------------------
    def _resync(self, trainer: Trainer, fork: bool = False, wait: bool = False) -> None:
        """Download the swarm's state (published at a cycle boundary, so quiescent) and go on from there.

        Like `Trainer.resync`, but with a deadline of about one rendezvous: the peers whose state outranks ours
        publish it at their own boundary, so if nobody serves it by then they have left or moved on, and we
        train on and try again at the next boundary instead of blocking for minutes. `wait`: we know we missed
        rounds, so the swarm's state at this boundary will outrank ours once its peers publish it: wait for it.
        """
        if not wait and trainer.swarm.canonical() is None:
            log.info("no live peer holds a better state than ours: going on with our own")
            self.needs_resync = False
            return
        numel = trainer.layout.numel
        trainer.set_state("syncing")
        t0 = time.perf_counter()
        try:
            snap = trainer.swarm.fetch_state(
                -1,
                {"params": (numel,), "outer_momentum": (numel,)},
                timeout=self.resync_timeout,
                better=True,
                base=self.state_tensors(),
                parts=self.part_ranges(),
            )
            trainer.adopt(snap, "fork" if fork else "behind")
        except (RoundFailed, ValueError) as exc:
            # Nobody served the better state: the swarm is not ahead of us after all (a whole swarm restarted from
            # checkpoints, say). The digest check flags us again if we really differ.
            log.warning("could not download the swarm's state (%s); going on with our own", exc)
            self.needs_resync = False
            return
        finally:
            trainer.add_idle(time.perf_counter() - t0)
            trainer.set_state("training")
        self._reloaded = False
        self.needs_resync = False
        self.s = snap.step * self.H
        self._anchor = (time.monotonic(), self.s)
        self.stats.resyncs += 1
        # Publish before the rounds due at this boundary start: they are grouped by the digest we publish (the
        # lineage), and the old one would put us in a group of our own.
        trainer.publish()

    def _reposition(self, trainer: Trainer) -> None:
        """The state was replaced at cycle boundary k (checkpoint resume, joiner download): go on from there.

        The swarm started the rounds due at that boundary when it published the state, so we cannot take
        part in them any more: our copy of those fragments will miss their update. Rather than join late
        (and, if we are the lowest peer id, lead a group nobody else joins), we leave them out and download
        the state again at the next boundary, where the swarm expects us because we now gossip step k.
        """
        self._reloaded = False
        self.s = trainer.outer_step * self.H
        self._anchor = (time.monotonic(), self.s)
        due = self.schedule.due(self.s) if self.s > 0 else []
        if due:
            self.needs_resync = True
            for p in due:  # if we lead them (the lowest id), the others must not wait for us
                trainer.swarm.skip_rounds(self.schedule.round_step(self.s, p), [p])

    # -- OuterAlgorithm state --------------------------------------------------------------------------------
    def part_ranges(self) -> list[list[tuple[int, int]]]:
        return [self.state.layout.slice(names) for names in self.state.fragments]

    def state_tensors(self) -> dict[str, Tensor]:
        return {"params": self.state.global_params.clone(), "outer_momentum": self.state.momentum_flat()}

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, Tensor]) -> None:
        missing = {"params", "outer_momentum"} - set(tensors)
        if missing:
            raise StreamingError(f"state is missing {sorted(missing)}")
        self.state.load(tensors["params"], tensors["outer_momentum"])
        for ex in self.pending.values():  # rounds of the state we drop: their results no longer apply
            if not ex.resolved:
                self._drop(ex)
        self.pending.clear()
        trainer.layout.unflatten_into(self.state.global_params, trainer.model)
        self._reloaded = True

    def close(self) -> None:
        """Apply what is still in flight (bounded wait), so the final checkpoint's global copy holds every
        round this peer took part in; local merges are not done any more (training has stopped)."""
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for ex in self.pending.values():
            if ex.resolved:
                continue
            done, _ = concurrent.futures.wait([ex.future], timeout=max(deadline - time.monotonic(), 0.0))
            if done:
                self._resolve(ex)
            else:
                self._drop(ex)
        self.pending.clear()
        self.write_stats()

    def _drop(self, ex: Exchange) -> None:
        """A round we stopped waiting for (state replaced, or shutting down): counted, so that every round this
        peer started is accounted for as applied, behind, failed or dropped."""
        ex.record.outcome = "dropped"
        self.stats.rounds_dropped += 1

    def write_stats(self) -> None:
        """streaming.json next to summary.json: counters plus one record per fragment round (atomic write)."""
        try:
            tmp = self.stats_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.stats.to_json(), sort_keys=True))
            tmp.replace(self.stats_path)
        except OSError as exc:
            log.warning("could not write %s: %s", self.stats_path, exc)
