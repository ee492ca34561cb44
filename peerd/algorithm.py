"""The small interface every outer algorithm (DiLoCo, Streaming DiLoCo, NoLoCo) implements.

The worker owns the model, data and inner optimizer and calls `after_inner_step` once per inner step; an algorithm
decides when to talk to the swarm and how to fold what comes back into the parameters. Algorithms keep their state
(global params, outer momentum) as flat fp32 CPU tensors so it can be checkpointed and served to joiners losslessly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peerd.worker import Worker


class OuterAlgorithm(ABC):
    name: str
    # Peer-rounds behind the global state: each applied round adds its number of included peers. Part of the state
    # (digested, checkpointed, downloaded), and the weight of the split-brain rule (peerd/consistency.py).
    work: int = 0

    @abstractmethod
    def after_inner_step(self, worker: Worker, t: int) -> bool:
        """Called after inner step t (0-based, counted since the run began). Returns True when an outer step
        completed, so the worker evaluates, publishes state and checkpoints."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The global state every peer of the run shares (served to joiners, digested in gossip)."""

    @abstractmethod
    def load_state_tensors(self, worker: Worker, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a downloaded or checkpointed global state (and reset local params to it)."""

    def part_ranges(self) -> list[list[tuple[int, int]]] | None:
        """Element ranges of each part (fragment) of the flat state tensors, for per-part digests and downloads;
        None: the state is one part."""
        return None

    def before_optimizer_step(self, worker: Worker) -> None:  # noqa: B027 - optional hook
        """Called after backward and before gradient clipping and the inner optimizer step (the every-step
        all-reduce baseline averages gradients here)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release background resources (threads, in-flight exchanges)."""
