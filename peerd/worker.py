"""One peer's training loop: inner steps on the local shard, the outer algorithm in between, checkpoints, status.

Reads like nanoGPT's loop on purpose: build model, data and optimizer from the run config; resume from the checkpoint
if there is one; catch up with the swarm if it is ahead; then train until told to stop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from peerd.algorithm import OuterAlgorithm
from peerd.allreduce import RoundFailed
from peerd.config import RunConfig
from peerd.daemon import Daemon
from peerd.statesync import StateSnapshot
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.data import TokenData
from trainer.flat import ParamLayout
from trainer.inner import make_inner_optimizer
from trainer.model import GPT, ModelConfig
from trainer.plugin import build_model, load_factory

log = logging.getLogger("peerd")
CHECKPOINT = "checkpoint.pt"


def build_run_model(cfg: RunConfig) -> torch.nn.Module:
    """The built-in GPT (preset plus overrides) or the user's factory; identical weights on every peer."""
    m = cfg.model
    overrides = {k: getattr(m, k) for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(m, k)}
    if m.factory:
        return build_model(m.factory, {"preset": m.preset, "seed": cfg.run.seed, **overrides})
    mc = ModelConfig.from_dict({"preset": m.preset, **overrides})
    return GPT(mc, seed=cfg.run.seed)


def build_run_data(cfg: RunConfig, seq_len: int) -> tuple[Any, Any]:
    """The built-in reader (text directory, uint16 token file, or the stdlib sources), or the user's data factory.

    A data factory is called as `factory({"path": ..., "seq_len": ..., "seed": ...})` and returns (train, eval)
    objects with the TokenData interface: `batch(batch_size, *, shard, num_shards, generator) -> (x, y)` and
    `eval_batches(batch_size, n, seed) -> list[(x, y)]`, int64 [B, T] tensors on the CPU.
    """
    if cfg.data.factory:
        factory = load_factory(cfg.data.factory)
        train, evaluation = factory({"path": cfg.data.path, "seq_len": seq_len, "seed": cfg.run.seed})
        for obj, what in ((train, "train"), (evaluation, "eval")):
            if not callable(getattr(obj, "batch", None)) or not callable(getattr(obj, "eval_batches", None)):
                raise ValueError(f"data factory {cfg.data.factory!r}: its {what} object lacks batch/eval_batches")
        return train, evaluation
    path = cfg.data.path or None
    return (
        TokenData.from_path(path, seq_len=seq_len, split="train"),
        TokenData.from_path(path, seq_len=seq_len, split="eval"),
    )


def model_seq_len(model: torch.nn.Module, cfg: RunConfig) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "seq_len", 0) or cfg.model.seq_len or 64)


def make_algorithm(worker: Worker) -> OuterAlgorithm:
    name = worker.cfg.run.algorithm
    if name == "diloco":
        from peerd.diloco import DiLoCo

        return DiLoCo(worker)
    if name == "noloco":
        from peerd.noloco import NoLoCo

        return NoLoCo(worker)
    if name == "streaming":
        from peerd.streaming import StreamingDiLoCo

        return StreamingDiLoCo(worker)
    if name == "ddp":
        from peerd.ddp import DataParallel

        return DataParallel(worker)
    raise ValueError(f"unknown algorithm {name!r}")


class Worker:
    def __init__(
        self,
        cfg: RunConfig,
        daemon: Daemon,
        data_dir: Path,
        *,
        device: str | None = None,
        shard: int | None = None,
        on_outer_step: Callable[[Worker], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.daemon = daemon
        self.data_dir = Path(data_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.on_outer_step = on_outer_step
        torch.manual_seed(cfg.run.seed)
        self.model = build_run_model(cfg).to(self.device)
        self.layout = ParamLayout.of(self.model)
        self.seq_len = model_seq_len(self.model, cfg)
        self.train_data, self.eval_data = build_run_data(cfg, self.seq_len)
        pid = daemon.identity.peer_id
        self.shard = shard if shard is not None else int(pid[:8], 16) % cfg.data.num_shards
        # Batches depend on the run seed and the shard only, so two runs with the same seeds see the same data.
        seed = int(hashlib.sha256(f"{cfg.run.seed}/{self.shard}".encode()).hexdigest()[:8], 16)
        self.gen = torch.Generator().manual_seed(seed)
        # The schedule comes from the spec (inner.total_steps), never from run.outer_steps, which is local: peers may
        # stop at different times but must all follow one schedule. Default: constant after warmup.
        self.opt, self.sched = make_inner_optimizer(
            self.model,
            lr=cfg.inner.lr,
            weight_decay=cfg.inner.weight_decay,
            warmup_steps=cfg.inner.warmup_steps,
            total_steps=cfg.inner.total_steps or None,
        )
        self.inner_step = 0
        self.outer_step = 0
        self.last_result: Any = None
        self.losses: list[float] = []  # inner losses since the last outer step
        self.history: list[dict[str, float]] = []
        self.algorithm = make_algorithm(self)
        self.autocast = self.device.type == "cuda"

    # -- bookkeeping used by algorithms ---------------------------------------------------------------------------
    def add_idle(self, seconds: float) -> None:
        """Time the trainer spent blocked on communication."""
        self.daemon.status.compute_idle_seconds += seconds
        if self.daemon.metrics is not None:
            self.daemon.metrics.record_idle(seconds)

    def resync(self, min_step: int) -> bool:
        """Download the swarm's global state and continue from it (our local progress since the last sync is lost).
        If no live peer can serve it, keep our own state and go on training: the next round or gossip will tell."""
        self.daemon.status.state = "syncing"
        t0 = time.perf_counter()
        shapes = {k: tuple(v.shape) for k, v in self.algorithm.state_tensors().items()}
        try:
            snap = self.daemon.fetch_state(min_step, shapes, timeout=self.cfg.network.round_timeout)
        except RoundFailed as exc:
            log.warning("could not download state (%s); continuing from our own state at step %d", exc, self.outer_step)
            self.daemon.count_failure("state_download")
            return False
        finally:
            self.add_idle(time.perf_counter() - t0)
            self.daemon.status.state = "training"
        self.algorithm.load_state_tensors(self, snap.tensors)
        self.outer_step = snap.step
        return True

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.resume()
        self.publish()
        ahead = self.daemon.swarm_step()
        if ahead > self.outer_step and not stop.is_set():
            log.info("swarm is at outer step %d, we are at %d: downloading state", ahead, self.outer_step)
            self.resync(ahead)
            self.publish()
        target = self.cfg.run.outer_steps
        while not stop.is_set() and (target == 0 or self.outer_step < target):
            self.train_one_inner_step()
            if self.algorithm.after_inner_step(self, self.inner_step - 1):
                self.finish_outer_step()
        self.daemon.status.finished = target > 0 and self.outer_step >= target
        self.algorithm.close()
        self.save()

    def train_one_inner_step(self) -> None:
        t0 = time.perf_counter()
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
        self.algorithm.before_optimizer_step(self)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.opt.step()
        self.sched.step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"inner loss became {value} at step {self.inner_step}")
        self.losses.append(value)
        self.inner_step += 1
        dt = time.perf_counter() - t0
        st = self.daemon.status
        st.compute_seconds += dt
        st.inner_step = self.inner_step
        tokens = x.numel()
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

    def finish_outer_step(self) -> None:
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
        self.publish()
        if self.cfg.checkpoint.every > 0 and self.outer_step % self.cfg.checkpoint.every == 0:
            self.save()
        if self.on_outer_step is not None:
            self.on_outer_step(self)

    def publish(self) -> None:
        self.daemon.publish(StateSnapshot(self.outer_step, self.algorithm.state_tensors()))

    def write_summary(self) -> None:
        """A JSON summary of this peer's run, for `peerd demo` and benchmarks (written atomically at exit)."""
        st = self.daemon.status
        summary = {
            "peer_id": self.daemon.identity.peer_id,
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
            "rejected_messages": st.rejected_messages,
            "rejected_contributions": st.rejected_contributions,
            "banned": self.daemon.bans.banned(),
            "round_seconds": [r.seconds for r in st.recent_rounds],
            "rounds": [
                {
                    "step": r.step,
                    "fragment": r.fragment,
                    "included": list(r.included),
                    "expected": list(r.expected),
                    "partial": r.partial,
                    "seconds": r.seconds,
                    "wire_bytes": r.wire_bytes,
                    "note": r.note,
                }
                for r in st.recent_rounds
            ],
            "finished": st.finished,
            "reachability": self.daemon.reach.line(),
            "relayed_bytes": self.daemon.relay_server.relayed_bytes,
        }
        tmp = self.data_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, sort_keys=True))
        tmp.replace(self.data_dir / "summary.json")

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        state = {
            "run_id": self.daemon.run_id.hex(),
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "global": self.algorithm.state_tensors(),
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "inner_opt": self.opt.state_dict(),
            "sched": self.sched.state_dict(),
            "history": self.history,
        }
        save_checkpoint(self.data_dir / CHECKPOINT, state)

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
        self.history = list(state.get("history", []))
        self.daemon.status.outer_step = self.outer_step
        log.info("resumed from checkpoint at outer step %d", self.outer_step)
