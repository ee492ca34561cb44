"""A user's own model and data, plugged in by import path (used by tests/test_plugin.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class BigramLM(nn.Module):
    """The smallest language model: next-byte logits from the current byte."""

    def __init__(self, vocab: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=gen) * 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.table[idx]
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def make_model(config: dict[str, Any]) -> nn.Module:
    return BigramLM(256, int(config.get("seed", 0)))


class RepeatingText:
    """A toy corpus: the same sentence over and over, so a bigram model learns it fast."""

    def __init__(self, seq_len: int) -> None:
        text = b"the quick brown fox jumps over the lazy dog. " * 200
        self.tokens = torch.tensor(list(text), dtype=torch.int64)
        self.seq_len = seq_len

    def _window(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]

    def batch(self, batch_size: int, *, shard: int, num_shards: int, generator: torch.Generator):
        hi = len(self.tokens) - self.seq_len - 1
        return self._window(torch.randint(0, hi, (batch_size,), generator=generator))

    def eval_batches(self, batch_size: int, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        return [self.batch(batch_size, shard=0, num_shards=1, generator=gen) for _ in range(n)]


def make_data(config: dict[str, Any]):
    seq = int(config["seq_len"])
    return RepeatingText(seq), RepeatingText(seq)
