"""A vector-sized stand-in model for bench.scale: `params` parameters and almost no compute per inner step, so that
N daemons on one machine measure the swarm's own costs (gossip, rendezvous, rounds), not training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Vector(nn.Module):
    """One parameter vector; its 'loss' pulls it towards a target the batch picks, so every inner step has a
    gradient."""

    def __init__(self, params: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(params, generator=gen) * 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        # Every coordinate moves each step, towards a target with per-coordinate noise that the batch seeds, as a
        # real minibatch gradient's is. Without the noise every peer's update was one of 7 patterns, so a 2-peer
        # average had a few distinct values and zstd shrank it far more than a 64-peer one (BENCHMARKS.md, "Scale").
        if targets is None:
            return self.weight, None
        seed = int(idx.reshape(-1)[0])
        noise = torch.randn(self.weight.shape, generator=torch.Generator().manual_seed(seed))
        target = 0.01 * float(seed % 7) + 0.01 * noise
        return self.weight, (self.weight - target).pow(2).mean()


def make_model(config: dict[str, Any]) -> nn.Module:
    return Vector(int(config.get("d_model") or 1) * 4096, int(config.get("seed", 0)))


class Indices:
    """Random indices as 'tokens': enough for the trainer's batch contract, nothing to read from disk."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def batch(self, batch_size: int, *, shard: int, num_shards: int, generator: torch.Generator) -> Any:
        x = torch.randint(0, 1 << 20, (batch_size, self.seq_len), generator=generator)
        return x, x

    def eval_batches(self, batch_size: int, n: int, seed: int = 0) -> list[Any]:
        gen = torch.Generator().manual_seed(seed)
        return [self.batch(batch_size, shard=0, num_shards=1, generator=gen) for _ in range(n)]


def make_data(config: dict[str, Any]) -> tuple[Indices, Indices]:
    seq = int(config["seq_len"])
    return Indices(seq), Indices(seq)
