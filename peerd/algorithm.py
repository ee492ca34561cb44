"""The small interface every outer algorithm (DiLoCo, Streaming DiLoCo, NoLoCo, the DDP baseline) implements, and
the two narrow things it is given: the local trainer (`Trainer`, peerd/worker.py) and the swarm (`Swarm`,
peerd/swarm.py).

The worker owns the model, data and inner optimizer and calls `after_inner_step` once per inner step; an algorithm
decides when to talk to the swarm and how to fold what comes back into the parameters, and returns the outer step it
completed (`StepDone`) rather than writing the worker's counters. Algorithms keep their state (global params, outer
momentum) as flat fp32 CPU tensors so it can be checkpointed and served to joiners losslessly.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from peerd.codecs import ErrorFeedback

if TYPE_CHECKING:
    from peerd.config import CodecSection, RunConfig
    from peerd.statesync import StateSnapshot
    from peerd.swarm import Swarm
    from trainer.flat import ParamLayout


@dataclass(frozen=True)
class StepDone:
    """An outer step an algorithm completed: the worker moves to `step`, evaluates, publishes and checkpoints.
    `published`: the algorithm already published the state of `step` (Streaming does at its cycle boundary), so the
    worker does not hash and announce it twice."""

    step: int
    result: Any = None  # the round behind it (allreduce.RoundResult), None after a state download
    published: bool = False


class StepTimer:
    """Moving average of one inner step's wall time, from the gaps between an algorithm's `after_inner_step` calls
    (NoLoCo's readiness estimate, Streaming's auto tau). The gap that also holds the outer step's evaluation and
    checkpoint is left out (`counted=False`), and so is the one after `restart` (a round or download in between)."""

    def __init__(self) -> None:
        self.seconds = math.nan
        self._last: float | None = None

    def tick(self, counted: bool = True) -> None:
        now = time.perf_counter()
        if self._last is not None and counted:
            dt = now - self._last
            self.seconds = dt if math.isnan(self.seconds) else 0.8 * self.seconds + 0.2 * dt
        self._last = now

    def restart(self) -> None:
        self._last = None


class Trainer(Protocol):
    """What an algorithm may use of the local trainer (peerd/worker.py)."""

    cfg: RunConfig
    model: torch.nn.Module
    layout: ParamLayout
    data_dir: Path
    swarm: Swarm
    tokens_per_step: int  # tokens one inner step trains on (the weight of a contribution is counted in these)
    heal_boundary: float | None  # see heal()

    @property
    def outer_step(self) -> int: ...

    def add_idle(self, seconds: float) -> None:
        """Time the trainer spent blocked on communication."""

    def inner_note(self) -> str:
        """The inner optimizer's state in a few words, for a log line about an unusual contribution."""

    def heal(self) -> bool:
        """Adopt a live peer's state if it outranks ours (the split-brain rule); True when ours changed. Sets
        `heal_boundary`: when gossip first showed the adopted state's step (monotonic; None: unknown)."""

    def resync(self, min_step: int, why: str = "behind", wait_s: float = 0.0) -> bool:
        """Download the canonical state (at least `min_step`) and continue from it; True when adopted. `wait_s`:
        how long to wait for gossip to show a better state, when we know one exists (a leader said "behind")."""

    def adopt(self, snap: StateSnapshot, why: str) -> None:
        """Take a downloaded state as ours (counted in status and metrics as `why`)."""

    def publish(self, step: int | None = None, finished: bool = False) -> None:
        """Serve and announce our state as of `step` (default: the current outer step)."""

    def set_state(self, state: str) -> None:
        """What status shows this peer doing: "training", "syncing"."""


class OuterAlgorithm(ABC):
    name: str
    # Peer-rounds behind the global state: each applied round adds its number of included peers. Part of the state
    # (digested, checkpointed, downloaded), and the weight of the split-brain rule (peerd/consistency.py).
    work: int = 0
    # True for algorithms whose peers train models of their own by design (ensembles): the worker then never adopts
    # another peer's state, at start, in a heal or while lingering.
    independent: bool = False

    @abstractmethod
    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        """Called after inner step t (0-based, counted since the run began). Returns the outer step it completed,
        if any, so the worker evaluates, publishes state and checkpoints."""

    @abstractmethod
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The global state every peer of the run shares (served to joiners, digested in gossip)."""

    @abstractmethod
    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        """Adopt a downloaded or checkpointed global state (and reset local params to it)."""

    def part_ranges(self) -> list[list[tuple[int, int]]] | None:
        """Element ranges of each part (fragment) of the flat state tensors, for per-part digests and downloads;
        None: the state is one part."""
        return None

    def before_optimizer_step(self, trainer: Trainer) -> StepDone | None:
        """Called after backward and before gradient clipping and the inner optimizer step (the every-step
        all-reduce baseline averages gradients here, and completes its step)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release background resources (threads, in-flight exchanges)."""


def feedback_for(codec: CodecSection) -> ErrorFeedback | None:
    """The error feedback the run's codec section asks for (codec.error_feedback, .feedback_decay, .feedback_against),
    or None without it. DiLoCo and Streaming DiLoCo keep one per peer; NoLoCo and ddp have none."""
    if not codec.error_feedback:
        return None
    return ErrorFeedback(decay=codec.feedback_decay, against=codec.feedback_against)
