"""Ranks 1..N-1 of a multi-process peer (trainer/ranks.py): they train on their own batches and obey rank 0.

A follower has no daemon, no network code and no outer algorithm: it builds the same model, data and inner optimizer
as rank 0's worker (peerd/worker.py), then loops on rank 0's commands: train one inner step (gradients averaged over
the ranks), take rank 0's state (`sync`), or stop. Rank 0 starts followers itself (`peerd start --procs-per-peer N`)
or torchrun starts every rank (`torchrun --nproc-per-node N -m peerd start ...`; RANK > 0 lands here).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from peerd.config import RunConfig
from peerd.identity import Identity
from peerd.runmodel import build_run_data, build_run_model, model_seq_len
from trainer.inner import make_inner_optimizer
from trainer.ranks import STOP, SYNC, TRAIN, LocalRanks, params_digest, rank_seed

log = logging.getLogger("peerd")


def peer_slot(data_dir: Path, shard: int | None, timeout_s: float = 60.0) -> int:
    """The peer's data slot: --shard, or derived from the peer id (rank 0 creates the key; torchrun starts us at
    the same time, so wait for it)."""
    if shard is not None:
        return shard
    deadline = time.monotonic() + timeout_s
    while not (data_dir / "identity.key").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(Identity.load_or_create(data_dir).peer_id[:8], 16)


def follow(cfg: RunConfig, data_dir: Path, ranks: LocalRanks, shard: int | None) -> int:
    """Train as rank `ranks.rank` until rank 0 says stop; returns the exit code."""
    torch.manual_seed(cfg.run.seed)
    model = build_run_model(cfg).to(ranks.device)
    seq_len = model_seq_len(model, cfg)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 256) or 256)
    cache = data_dir / f"rank{ranks.rank}"
    cache.mkdir(parents=True, exist_ok=True)
    train_data, _ = build_run_data(cfg, seq_len, vocab, cache_dir=cache)
    slot = peer_slot(data_dir, shard)
    gen = torch.Generator().manual_seed(rank_seed(cfg.run.seed, slot, ranks.rank))
    opt, sched = make_inner_optimizer(
        model,
        lr=cfg.inner.lr,
        weight_decay=cfg.inner.weight_decay,
        warmup_steps=cfg.inner.warmup_steps,
        total_steps=cfg.inner.total_steps or None,
    )
    autocast = ranks.device.type == "cuda"
    steps = 0
    while True:
        cmd = ranks.command()
        if cmd == TRAIN:
            model.train()
            x, y = train_data.batch(
                cfg.data.batch_size, shard=slot % cfg.data.num_shards, num_shards=cfg.data.num_shards, generator=gen
            )
            x, y = x.to(ranks.device), y.to(ranks.device)
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            ranks.average_grads(model)
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            opt.step()
            sched.step()
            steps += 1
        elif cmd == SYNC:
            ranks.sync(model, opt, sched)
        elif cmd == STOP:
            (data_dir / f"rank{ranks.rank}.digest").write_text(params_digest(model))
            log.info("rank %d: stopped after %d inner steps", ranks.rank, steps)
            return 0
        else:
            log.error("rank %d: unknown command %d from rank 0", ranks.rank, cmd)
            return 1
