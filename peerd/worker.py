"""One peer's training loop: inner steps on the local shard, the outer algorithm in between, checkpoints, status.

Reads like nanoGPT's loop on purpose: build model, data and optimizer from the run config; resume from the checkpoint
if there is one; catch up with the swarm if it is ahead; then train until told to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from peerd import faults
from peerd.algorithm import OuterAlgorithm, StepDone, Trainer
from peerd.allreduce import RoundFailed
from peerd.config import RunConfig
from peerd.consistency import lineage_verdict
from peerd.daemon import Daemon
from peerd.ddp import DataParallel
from peerd.diloco import DiLoCo
from peerd.ensemble import Ensemble
from peerd.layout import PART_BYTES
from peerd.localstatus import round_record
from peerd.noloco import NoLoCo
from peerd.runmodel import build_run_data, build_run_model, model_seq_len
from peerd.statesync import StateSnapshot
from peerd.streaming import StreamingDiLoCo
from peerd.swarm import DaemonSwarm
from trainer.checkpoint import CheckpointWriteError, load_checkpoint, save_checkpoint
from trainer.flat import ParamLayout
from trainer.initfrom import InitError, load_init
from trainer.inner import make_inner_optimizer, optimizer_note, rewarm, rewarm_reason
from trainer.ranks import STOP, SYNC, TRAIN, LocalRanks, RanksError, params_digest, rank_seed

log = logging.getLogger("peerd")
CHECKPOINT = "checkpoint.pt"


ALGORITHMS: dict[str, Callable[[Trainer], OuterAlgorithm]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "noloco": NoLoCo,
    "ddp": DataParallel,
    "ensemble": Ensemble,
}


def make_algorithm(trainer: Trainer) -> OuterAlgorithm:
    name = trainer.cfg.run.algorithm
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}")
    return ALGORITHMS[name](trainer)


class Worker:
    """The local trainer (algorithm.Trainer): owns model, data, inner optimizer, checkpoints and status; reaches the
    swarm only through its `swarm` port."""

    def __init__(
        self,
        cfg: RunConfig,
        daemon: Daemon,
        data_dir: Path,
        *,
        device: str | None = None,
        shard: int | None = None,
        on_outer_step: Callable[[Worker], None] | None = None,
        init_from: Path | None = None,
        ranks: LocalRanks | None = None,
    ) -> None:
        """`init_from`: a peerd checkpoint or safetensors file the weights start from (instead of the seed's init);
        its sha256 must be the spec's run.init_digest, which `peerd start --init-from` sees to. `ranks`: this peer's
        other local processes (trainer/ranks.py), when it runs several; this worker is their rank 0."""
        self.cfg = cfg
        self.ranks = ranks
        self.daemon = daemon
        self.swarm = DaemonSwarm(daemon)
        self.data_dir = Path(data_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.on_outer_step = on_outer_step
        torch.manual_seed(cfg.run.seed)
        self.model = build_run_model(cfg)
        if init_from is not None:  # before the algorithm copies the model into its global state
            try:
                n = load_init(init_from, self.model)
            except InitError as exc:
                raise ValueError(str(exc)) from None
            log.info("initial weights (%d parameters) from %s", n, init_from)
        self.model.to(self.device)
        self.layout = ParamLayout.of(self.model)
        self.seq_len = model_seq_len(self.model, cfg)
        self.tokens_per_step = cfg.data.batch_size * self.seq_len * (ranks.world if ranks else 1)
        self.domain = cfg.data.domain or cfg.data.path or "stdlib"  # ensembles: this expert's data domain
        vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 256) or 256)
        self.train_data, self.eval_data = build_run_data(cfg, self.seq_len, vocab, cache_dir=self.data_dir)
        # Any number of peers may train: `slot` (--shard, or derived from the peer id) picks data shard
        # slot % data.num_shards, and seeds the batch generator, so peers that share a data shard still draw different
        # batches. Batches depend on the run seed and the slot only: two runs with the same seeds see the same data.
        self.slot = shard if shard is not None else int(daemon.identity.peer_id[:8], 16)
        self.shard = self.slot % cfg.data.num_shards
        seed = rank_seed(cfg.run.seed, self.slot, 0)
        self.gen = torch.Generator().manual_seed(seed)
        # The schedule comes from the spec (inner.total_steps), never from run.outer_steps, which is local: peers may
        # stop at different times but must all follow one schedule. Default: constant after warmup. Trained weights
        # from --init-from warm up over inner.rewarm_steps instead (0: straight to the full lr).
        self.opt, self.sched = make_inner_optimizer(
            self.model,
            lr=cfg.inner.lr,
            weight_decay=cfg.inner.weight_decay,
            warmup_steps=cfg.rewarm_steps if init_from is not None else cfg.inner.warmup_steps,
            total_steps=cfg.inner.total_steps or None,
        )
        self.rewarms = 0  # times a downloaded state made us re-warm the inner optimizer
        # when gossip first showed the state the last heal adopted (Trainer.heal); None: unknown
        self.heal_boundary: float | None = None
        # The moments came from our checkpoint and have not trained on any state since (see adopt)
        self.moments_from_checkpoint = False
        self.inner_step = 0
        self.outer_step = 0
        self.saved_step: int | None = None  # outer step of the checkpoint on disk (None: none written or loaded)
        self.losses: list[float] = []  # inner losses since the last outer step
        self.history: list[dict[str, float]] = []
        self.algorithm = make_algorithm(self)
        self.autocast = self.device.type == "cuda"
        self.step_delay = faults.step_delay()
        self._overtaken_check = 0.0  # monotonic time of the next `overtaken` look at the swarm
        self._stranded_at: float | None = None  # monotonic time `overtaken` first found nobody live holding the end
        self.stranded = False  # the run ended without us and nobody could serve its end (`overtaken`)

    # -- bookkeeping used by algorithms ---------------------------------------------------------------------------
    def set_state(self, state: str) -> None:
        self.daemon.status.state = state

    def inner_note(self) -> str:
        return optimizer_note(self.opt)

    def add_idle(self, seconds: float) -> None:
        """Time the trainer spent blocked on communication."""
        self.daemon.status.compute_idle_seconds += seconds
        if self.daemon.metrics is not None:
            self.daemon.metrics.record_idle(seconds)

    @property
    def ranked(self) -> bool:
        """DiLoCo and Streaming hold one model per run, so states are ranked (peerd/consistency.py); NoLoCo's slow
        weights differ by design and a peer that fell behind simply takes the newest."""
        return self.daemon.ranked

    def resync(self, min_step: int, why: str = "behind", wait_s: float = 0.0) -> bool:
        """Adopt the canonical global state and continue from it (local progress since the last sync is lost). For
        ranked algorithms only a state whose claim outranks ours is adopted. If nobody can serve one, keep our own
        state and go on training: the next round or gossip will tell."""
        self.daemon.status.state = "syncing"
        t0 = time.perf_counter()
        shapes = {k: tuple(v.shape) for k, v in self.algorithm.state_tensors().items()}
        try:
            deadline = time.monotonic() + wait_s
            while self.ranked and self.swarm.canonical(min_step) is None:
                if time.monotonic() >= deadline:
                    log.info("no live peer holds a better state than ours (step %d): keeping it", self.outer_step)
                    return False
                time.sleep(0.1)
            snap = self.swarm.fetch_state(min_step, shapes, timeout=self.cfg.network.round_timeout, better=self.ranked)
        except RoundFailed as exc:
            log.warning("could not download state (%s); continuing from our own state at step %d", exc, self.outer_step)
            self.daemon.count_failure("state_download")
            return False
        finally:
            self.add_idle(time.perf_counter() - t0)
            self.daemon.status.state = "training"
        self.adopt(snap, why)
        return True

    def adopt(self, snap: StateSnapshot, why: str) -> None:
        """Take a downloaded state as ours. `why`: behind, fork or start (counted in status and metrics)."""
        # not lag but a fork when the state we held is not among the new one's ancestors (a split's losing half)
        held = self.daemon.published
        if self.ranked and why != "fork" and held and lineage_verdict(held[:2], snap.lineage or ()) is False:
            log.warning("split-brain: our state at step %d had diverged from the one adopted (step %d): the steps "
                        "since then are lost", held[0], snap.step)  # fmt: skip
            why = "fork"
        self.daemon.adopted(snap)
        if why == "fork":
            self.daemon.status.forks_healed += 1
        if self.daemon.metrics is not None:
            self.daemon.metrics.state_downloads.labels(why=why).inc()
        jump = snap.step - self.outer_step
        self.algorithm.load_state_tensors(self, snap.tensors)
        self.algorithm.work = snap.work
        self.outer_step = snap.step
        # DiLoCo replaces the weights every outer step and AdamW copes; a jump of 2+ outer steps (a late joiner), onto
        # a diverged state, or of any length from moments a checkpoint kept (a restart: the swarm trained on while we
        # were down) leaves the moments describing other weights: re-warm (inner.rewarm_steps). On bench.scale's
        # vector model, converged moments moved onto weights 0.05 away took a first step 2.4x a converged one's.
        reason = rewarm_reason(jump, why, self.moments_from_checkpoint)
        self.moments_from_checkpoint = False
        steps = self.cfg.rewarm_steps
        if steps > 0 and reason:
            rewarm(self.opt, self.sched, steps)
            self.rewarms += 1
            log.info("re-warming the inner optimizer over %d steps (fresh AdamW moments): adopted a state %s", steps,
                     reason)  # fmt: skip

    def heal(self) -> bool:
        """If a live peer's state outranks ours, adopt it: the split-brain rule, also catching up when behind.
        Returns True when our state changed."""
        if not self.ranked:
            return False
        best = self.swarm.canonical()
        if best is None:
            return False
        forked = best.step <= self.outer_step
        log.warning(
            "%s: peer %s holds step %d with %d peer-rounds of work, we hold step %d with %d: downloading state",
            "split-brain: our state lost to a diverged one" if forked else "the swarm is ahead of us",
            best.peer_id[:8],
            best.step,
            best.work,
            self.outer_step,
            self.algorithm.work,
        )
        self.heal_boundary = time.monotonic() - best.seen_s if best.seen_s > 0 else None
        if self.resync(-1, why="fork" if forked else "behind"):
            self.publish()
            return True
        return False

    def catch_up(self) -> None:
        """At start (fresh, resumed or restarted): adopt the newest canonical state any live peer announced, and say
        so when there is none, rather than train alone in silence."""
        if self.algorithm.independent:
            log.info("ensemble expert (domain %r): trains on its own by design, no parameter exchange", self.domain)
            return
        if self.ranked:
            if self.heal():
                return
        else:
            ahead = self.swarm.swarm_step()
            if ahead > self.outer_step:
                log.info("swarm is at outer step %d, we are at %d: downloading state", ahead, self.outer_step)
                if self.resync(ahead, why="start"):
                    self.publish()
                return
        live, expected = self.daemon.run_peers()
        if live == 0 and self.daemon.bootstrap:
            log.warning(
                "no live peer announced a state (%d known, none reachable now): starting from our own state at outer "
                "step %d; steps taken alone are counted as solo steps",
                expected,
                self.outer_step,
            )

    def linger(self, stop: threading.Event) -> bool:
        """After the last outer step, keep serving our state for up to network.linger seconds, until every peer the
        run expects finished with the same state, so a peer restarting at the very end can still fetch it (outbound-
        only peers, whom nobody can dial, do not linger). A better state seen meanwhile (a split healed late) is
        adopted. Returns True when that sends us back to training."""
        self.publish(finished=True)
        # Nobody can dial an outbound-only peer, so it cannot serve its state to anyone: one last split-brain check
        # (a better state is adopted), then it is done.
        if self.algorithm.independent:  # nobody needs our state, and we need nobody's
            return False
        linger = 0.0 if self.daemon.me.outbound_only else self.cfg.network.linger
        deadline = time.monotonic() + linger
        if not linger and self.heal() and self.outer_step < self.cfg.run.outer_steps:
            return True
        interval = self.cfg.network.gossip_interval
        while not stop.is_set() and time.monotonic() < deadline:
            if self.heal():
                target = self.cfg.run.outer_steps
                if self.outer_step < target:
                    log.info("adopted state at step %d: training on to step %d", self.outer_step, target)
                    return True
                self.publish(finished=True)
            elif self.daemon.all_finished(self.ranked):
                return False
            stop.wait(interval)
        return False

    def overtaken(self, target: int) -> str:
        """Did the run end without us? We are two or more outer steps short of the last one, so every round we could
        still join is over. Looks at the swarm at most once per gossip interval; "" when it did not look, or nobody
        holds or announced the end.
        - "adopted": a live peer holds the last step and we took its final state, while the finished peers linger to
          serve it, rather than train on alone and finish on a model of our own. (One step short is the normal tail
          of a round; the boundary's own check covers it.)
        - "waiting": a peer announced finishing, a live one still holds the end, and its download failed: try again,
          without training meanwhile.
        - "stranded": a peer announced finishing and no live peer has held the end for a few gossip intervals (before
          that: "waiting"). Training on alone would end the run on a second model: a peer cut off from the others'
          bulk traffic (an MTU blackhole) trained 37 solo steps to the end after the others left, and reported
          finished."""
        if target <= 0 or not self.ranked or self.outer_step > target - 2 or time.monotonic() < self._overtaken_check:
            return ""
        self._overtaken_check = time.monotonic() + self.cfg.network.gossip_interval
        held = self.swarm.swarm_step() >= target
        if held and self.heal():
            return "adopted"
        finished = self.swarm.finished_step() >= target
        if held or not finished:
            self._stranded_at = None
            return "waiting" if held and finished else ""
        # Nobody live holds the end. Right after a stall of our own (a frozen process, a suspended laptop) every peer
        # looks silent until gossip hears from them again: a peer resumed 15 ms before found the lingering holders
        # "gone" and stopped (CI). Say so only once it has held for a few gossip intervals.
        now = time.monotonic()
        self._stranded_at = now if self._stranded_at is None else self._stranded_at
        return "stranded" if now - self._stranded_at >= max(2.0, 4 * self.cfg.network.gossip_interval) else "waiting"

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.resume()
        self.publish()
        if not stop.is_set():
            self.catch_up()
        self.sync_ranks()  # resumed, downloaded or initialised from a file: every rank starts from our state
        target = self.cfg.run.outer_steps
        while not stop.is_set():
            if target > 0 and self.outer_step >= target:
                if not self.linger(stop):
                    break
                self.sync_ranks()  # a state adopted while lingering
                continue
            end = self.overtaken(target)
            if end == "adopted":
                self.sync_ranks()
                continue
            if end == "waiting":  # a holder of the end still lingers: look again after a gossip interval
                stop.wait(self.cfg.network.gossip_interval)
                continue
            if end == "stranded":  # `peerd start` says so, in one line, and exits 1
                self.stranded = True
                break
            self.train_one_inner_step()
            mark = self._fingerprint()
            done = self.algorithm.after_inner_step(self, self.inner_step - 1)
            if self.ranks is not None and self._fingerprint() != mark:  # the algorithm changed the model
                self.sync_ranks()
            if done is not None:
                self.advance(done)
                self.finish_outer_step(publish=not done.published)
        self.daemon.status.finished = target > 0 and self.outer_step >= target
        self.algorithm.close()
        self.save()
        self.stop_ranks()

    # -- the peer's other local processes (trainer/ranks.py) --------------------------------------------------------
    def _fingerprint(self) -> float | None:
        """A cheap sample of the weights: any outer step, download or merge rewrites whole tensors, so it moves."""
        if self.ranks is None:
            return None
        with torch.no_grad():
            return float(sum(p.detach().reshape(-1)[::97].double().sum() for p in self.model.parameters()))

    def sync_ranks(self) -> None:
        if self.ranks is not None:
            self.ranks.command(SYNC)
            self.ranks.sync(self.model, self.opt, self.sched)

    def stop_ranks(self) -> None:
        """Tell the other ranks to stop (each writes its weights' digest, as we do, so tests can compare them)."""
        if self.ranks is None:
            return
        with contextlib.suppress(RanksError):
            self.ranks.command(STOP)
        (self.data_dir / "rank0.digest").write_text(params_digest(self.model))

    def train_one_inner_step(self) -> None:
        t0 = time.perf_counter()
        if self.ranks is not None:
            self.ranks.command(TRAIN)
        self.model.train()
        x, y = self.train_data.batch(
            self.cfg.data.batch_size, shard=self.shard, num_shards=self.cfg.data.num_shards, generator=self.gen
        )
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.ranks is not None:  # data-parallel inside the peer: every rank takes the same step
            self.ranks.average_grads(self.model)
        done = self.algorithm.before_optimizer_step(self)
        if done is not None:  # the DDP baseline completes a step per inner step
            self.advance(done)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.opt.step()
        self.sched.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"inner loss became {value} at step {self.inner_step}")
        self.losses.append(value)
        self.inner_step += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        dt = time.perf_counter() - t0
        st = self.daemon.status
        st.compute_seconds += dt
        st.inner_step = self.inner_step
        tokens = x.numel() * (self.ranks.world if self.ranks is not None else 1)
        st.tokens_per_second = tokens / dt if dt > 0 else 0.0
        m = self.daemon.metrics
        if m is not None:
            m.tokens.inc(tokens)
            m.inner_step.set(self.inner_step)
            m.tokens_per_second.set(st.tokens_per_second)
            m.learning_rate.set(self.opt.param_groups[0]["lr"])

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = 0.0
        batches = self.eval_data.eval_batches(self.cfg.data.batch_size, self.cfg.data.eval_batches, seed=1234)
        for x, y in batches:
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
            with ctx:
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += float(loss)
        return total / max(len(batches), 1)

    def advance(self, done: StepDone) -> None:
        """Move to the outer step an algorithm completed."""
        self.outer_step = done.step
        self.daemon.status.outer_step = done.step
        self.moments_from_checkpoint = False  # they trained on the state this step started from

    def finish_outer_step(self, publish: bool = True) -> None:
        st = self.daemon.status
        train_loss = sum(self.losses) / len(self.losses) if self.losses else math.nan
        self.losses = []
        st.loss = train_loss
        st.eval_loss = self.evaluate()
        st.outer_step = self.outer_step
        record = {
            "outer_step": self.outer_step,
            "loss": train_loss,
            "eval_loss": st.eval_loss,
            "tokens_per_second": st.tokens_per_second,
        }
        self.history.append(record)
        st.history.append(record)
        m = self.daemon.metrics
        if m is not None:
            m.train_loss.set(train_loss)
            m.eval_loss.set(st.eval_loss)
            m.outer_step.set(self.outer_step)
        if publish:
            self.publish()
        if self.cfg.checkpoint.every > 0 and self.outer_step % self.cfg.checkpoint.every == 0:
            self.save()
        if self.on_outer_step is not None:
            self.on_outer_step(self)

    def publish(self, step: int | None = None, finished: bool = False) -> None:
        step = self.outer_step if step is None else step
        self.daemon.publish(
            StateSnapshot(step, self.algorithm.state_tensors(), self.algorithm.work, self.algorithm.part_ranges()),
            finished,
        )

    def write_summary(self) -> None:
        """A JSON summary of this peer's run, for `peerd demo` and benchmarks (written atomically at exit)."""
        st = self.daemon.status
        summary = {
            "peer_id": self.daemon.identity.peer_id,
            "algorithm": self.cfg.run.algorithm,
            "domain": self.domain,
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "history": self.history,
            "bytes_sent_raw": st.bytes_sent_raw,
            "bytes_sent_wire": st.bytes_sent_wire,
            "bytes_received_wire": st.bytes_received_wire,
            "compute_seconds": st.compute_seconds,
            "compute_idle_seconds": st.compute_idle_seconds,
            "rounds_partial": st.rounds_partial,
            "rounds_failed": st.rounds_failed,
            "solo_steps": st.solo_steps,
            "steps_sat_out": st.steps_sat_out,
            "work": self.algorithm.work,
            "state_downloads": st.state_downloads,
            "forks_healed": st.forks_healed,
            "rewarms": self.rewarms,
            "rejected_messages": st.rejected_messages,
            "rejected_contributions": st.rejected_contributions,
            "banned": self.daemon.bans.banned(),
            "round_seconds": [r.seconds for r in st.recent_rounds],
            "rounds": [round_record(r, PART_BYTES) for r in st.recent_rounds],
            # DiLoCo's uneven-peer accounting: inner steps whose work went into a later round, or was dropped
            "carried_steps": getattr(self.algorithm, "carried_steps", 0),
            "discarded_steps": getattr(self.algorithm, "discarded_steps", 0),
            # DiLoCo with outer.overlap: inner steps trained while a round ran (in the next round's work)
            "overlapped_steps": getattr(self.algorithm, "overlapped_steps", 0),
            # DiLoCo's slow-link accounting (peerd/sponsor.py): our uploads a sponsor's round included, and the
            # sponsored contributions our own rounds carried for others
            "sponsored": getattr(self.algorithm, "sponsor_summary", dict)(),
            "tokens_per_step": self.tokens_per_step,
            "procs_per_peer": self.ranks.world if self.ranks is not None else 1,
            # the swarm's timing verdicts (peerd/timings.py) as this peer last saw them, and when each began
            "flags": {kind: sorted(peers) for kind, peers in self.daemon.timing.flagged.items()},
            "flagged_at_step": dict(self.daemon.timing.flagged_at),
            "finished": st.finished,
            "reachability": self.daemon.reach.line(),
            "relayed_bytes": self.daemon.relay_server.relayed_bytes,
        }
        tmp = self.data_dir / "summary.json.tmp"
        try:
            tmp.write_text(json.dumps(summary, sort_keys=True))
            tmp.replace(self.data_dir / "summary.json")
        except OSError as exc:
            log.warning("summary.json not written (%s)", exc.strerror or exc)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        state = {
            "run_id": self.daemon.run_id.hex(),
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "work": self.algorithm.work,
            "global": self.algorithm.state_tensors(),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "inner_opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "history": self.history,
            # what `peerd ensemble-eval` needs to rebuild this model and name its domain (plain values only)
            "model_config": dataclasses.asdict(self.cfg.model),
            "data_config": {"domain": self.domain, "tokenizer": self.cfg.data.tokenizer},
        }
        try:
            save_checkpoint(self.data_dir / CHECKPOINT, state)
        except OSError as exc:  # disk full, read-only, I/O error: keep training, retry at the next checkpoint
            if self.daemon.metrics is not None:
                self.daemon.metrics.checkpoint_failures.inc()
            kept = "no checkpoint yet" if self.saved_step is None else f"the checkpoint of step {self.saved_step} stays"
            why = str(exc) if isinstance(exc, CheckpointWriteError) else f"cannot write {CHECKPOINT}: {exc.strerror}"
            log.warning(
                "checkpoint at outer step %d not written (%s); %s, training goes on and the next checkpoint retries; "
                "free space in %s",
                self.outer_step,
                why,
                kept,
                self.data_dir,
            )
            return
        self.saved_step = self.outer_step

    def resume(self) -> None:
        state = load_checkpoint(self.data_dir / CHECKPOINT)
        if state is None:
            return
        if state.get("run_id") != self.daemon.run_id.hex():
            raise ValueError(
                f"{self.data_dir / CHECKPOINT} belongs to run {str(state.get('run_id'))[:8]}, not this run "
                f"({self.daemon.run_id.hex()[:8]}); use another --data-dir"
            )
        self.algorithm.load_state_tensors(self, state["global"])
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["inner_opt"])
        self.sched.load_state_dict(state["sched"])
        self.outer_step = int(state["outer_step"])
        self.inner_step = int(state["inner_step"])
        self.algorithm.work = int(state.get("work", 0))
        self.history = list(state.get("history", []))
        self.saved_step = self.outer_step
        self.daemon.status.outer_step = self.outer_step
        self.moments_from_checkpoint = True
        log.info("resumed from checkpoint at outer step %d", self.outer_step)
