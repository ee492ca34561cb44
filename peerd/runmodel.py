"""The run's model and data, built from its spec: the built-in GPT or the user's factory, and the built-in token
reader or the user's data factory. Every process that needs the model (the training loop, local ranks, the ensemble
evaluation, the convergence bench) builds it here, so all build the same one, without the daemon's imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from peerd.config import RunConfig
from trainer.data import TokenData
from trainer.model import GPT, ModelConfig
from trainer.plugin import build_model, load_factory


def build_run_model(cfg: RunConfig) -> torch.nn.Module:
    """The built-in GPT (preset plus overrides) or the user's factory; identical weights on every peer."""
    m = cfg.model
    overrides = {k: getattr(m, k) for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(m, k)}
    if cfg.data.tokenizer:  # the model's vocabulary follows the tokenizer's
        from trainer.tokenize import TokenizerError, vocab_size

        try:
            overrides["vocab_size"] = vocab_size(cfg.data.tokenizer)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from None
    if m.factory:
        extra = {"config": m.config} if m.config else {}
        return build_model(m.factory, {"preset": m.preset, "seed": cfg.run.seed, **extra, **overrides})
    mc = ModelConfig.from_dict({"preset": m.preset, **overrides})
    return GPT(mc, seed=cfg.run.seed)


def build_run_data(
    cfg: RunConfig, seq_len: int, vocab_size: int = 256, cache_dir: Path | None = None
) -> tuple[Any, Any]:
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
    kw: dict[str, Any] = {"seq_len": seq_len, "vocab_size": vocab_size}
    if cfg.data.tokenizer:
        kw.update(tokenizer=cfg.data.tokenizer, cache_dir=cache_dir)
    return TokenData.from_path(path, split="train", **kw), TokenData.from_path(path, split="eval", **kw)


def model_seq_len(model: torch.nn.Module, cfg: RunConfig) -> int:
    """The model's context length: its own config's, else the spec's, else 64."""
    config = getattr(model, "config", None)
    return int(getattr(config, "seq_len", 0) or cfg.model.seq_len or 64)
