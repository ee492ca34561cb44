"""The parts of Streaming DiLoCo's fragment synchronisation (peerd/streaming.py is the algorithm that drives them):
the schedule of fragment rounds, the global copy of each fragment with its outer optimizer, and the records and
counters of rounds in flight, written to streaming.json for tests and benchmarks.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from peerd.statesync import tensor_bytes
from trainer.flat import ParamLayout
from trainer.fragments import due_fragments, fragment_offsets
from trainer.outer import NesterovOuter, pseudo_gradient, streaming_merge

MAX_SYNC_RECORDS = 4096  # per-sync records kept for streaming.json (bounded memory on long runs)


class StreamingError(ValueError):
    """A bad Streaming DiLoCo setting, fault-injection value or state tensor."""


@dataclass(frozen=True)
class Schedule:
    """When each fragment syncs, which round step that is, and when its result is merged."""

    H: int
    tau: int
    offsets: tuple[int, ...]

    @classmethod
    def make(cls, num_fragments: int, H: int, tau: int) -> Schedule:
        if isinstance(tau, bool) or not isinstance(tau, int) or not 1 <= tau < H:
            raise StreamingError(f"tau must be an int in [1, H={H}), got {tau!r}")
        return cls(H, tau, tuple(fragment_offsets(num_fragments, H)))

    def due(self, s: int) -> list[int]:
        """Fragments whose exchange starts after inner step s (s = steps completed; never at s = 0)."""
        return due_fragments(s, list(self.offsets), self.H)

    def round_step(self, s: int, p: int) -> int:
        """The rendezvous step of fragment p's sync at s: k for its sync in cycle k (never negative)."""
        return (s - self.offsets[p]) // self.H

    def merge_at(self, s: int) -> int:
        return s + self.tau

    def is_boundary(self, s: int) -> bool:
        return s > 0 and s % self.H == 0

    def boundary_wait_free(self) -> bool:
        """True when every fragment's merge point falls before the next cycle boundary (tau <= H - t_last)."""
        return max(self.offsets) + self.tau <= self.H


def fragment_digest(t: Tensor) -> str:
    """Short content hash of a CPU fp32 fragment, logged per sync so peers' copies can be compared."""
    return hashlib.blake2b(tensor_bytes(t.detach().to("cpu", torch.float32)), digest_size=16).hexdigest()


class FragmentState:
    """The shared half of Streaming DiLoCo on flat CPU fp32 buffers: the global copy and per-fragment outer
    momentum.

    Model-free on purpose: these are the numbers that must be bit-identical on every peer, so keeping them
    apart from the training loop makes that easy to check.
    """

    def __init__(
        self, layout: ParamLayout, fragments: list[list[str]], global_params: Tensor, outer: NesterovOuter
    ) -> None:
        names = [n for frag in fragments for n in frag]
        if sorted(names) != sorted(layout.names):
            raise StreamingError("fragments must cover every parameter of the layout exactly once")
        layout.check(global_params)
        self.layout = layout
        self.fragments = fragments
        self.global_params = global_params
        self.outer = outer
        self.sizes = [layout.fragment_numel(f) for f in fragments]

    def global_fragment(self, p: int) -> Tensor:
        """A copy of fragment p of the global parameters (flat, in the fragment's name order)."""
        return self.layout.gather(self.global_params, self.fragments[p])

    def pseudo_gradient(self, p: int, local_p: Tensor) -> Tensor:
        """global_p - local_p on local_p's device: what this peer contributes to fragment p's round."""
        return pseudo_gradient(self.global_fragment(p).to(local_p.device), local_p)

    def apply_average(self, p: int, average: Tensor) -> Tensor:
        """Outer Nesterov step for fragment p with the round's averaged pseudo-gradient; returns global_p."""
        if average.dim() != 1 or average.numel() != self.sizes[p]:
            got = average.numel()
            raise StreamingError(f"fragment {p} needs {self.sizes[p]} values, the round returned {got}")
        g = self.global_fragment(p)
        self.outer.step(g, average.to("cpu", torch.float32), key=p)
        self.layout.scatter_(self.global_params, self.fragments[p], g)
        return g

    def momentum_flat(self) -> Tensor:
        """Every fragment's momentum at its parameters' positions in layout order (zeros where none yet)."""
        flat = torch.zeros(self.layout.numel, dtype=torch.float32)
        for p, names in enumerate(self.fragments):
            buf = self.outer.buffers.get(p)
            if buf is not None:
                self.layout.scatter_(flat, names, buf.to("cpu"))
        return flat

    def load(self, params: Tensor, momentum: Tensor) -> None:
        """Adopt a downloaded or checkpointed state (validated: shapes from our own layout, finite values)."""
        for name, t in (("params", params), ("outer_momentum", momentum)):
            try:
                self.layout.check(t)
            except ValueError as exc:
                raise StreamingError(f"state tensor {name!r}: {exc}") from exc
        self.global_params = params.detach().to("cpu", torch.float32).clone()
        gather = self.layout.gather
        self.outer.buffers = {p: gather(momentum, names) for p, names in enumerate(self.fragments)}


def merge_fragment(local_p: Tensor, new_global_p: Tensor, alpha: float) -> None:
    """local_p <- alpha * local_p + (1 - alpha) * new_global_p, in place, on local_p's device."""
    streaming_merge(local_p, new_global_p.to(local_p.device), alpha)


@dataclass
class SyncRecord:
    """One fragment round as this peer saw it (written to streaming.json for tests and benchmarks)."""

    fragment: int
    step: int
    s: int  # inner step (swarm timeline) at which it started
    t_start: float  # wall clock (time.time())
    t_end: float = 0.0  # when the round's future finished
    outcome: str = "pending"  # applied | behind | failed | dropped
    digest: str = ""  # fragment_digest of global_p after the update
    included: int = 0
    wire_bytes: int = 0
    received_wire_bytes: int = 0
    seconds: float = 0.0
    merge: str = ""  # on_time | late | none


@dataclass
class StreamingStats:
    syncs_started: int = 0
    rounds_applied: int = 0
    rounds_behind: int = 0  # left out of a round that others completed: triggers a resync
    rounds_failed: int = 0
    rounds_dropped: int = 0  # still in flight when we replaced our state or shut down
    merges_on_time: int = 0
    merges_skipped: int = 0  # not done at s_start + tau (late_policy "skip"); done when the round landed
    merge_waits: int = 0  # late_policy "wait": times the trainer blocked at a merge point
    boundary_waits: int = 0  # times the trainer blocked at a cycle boundary for an unfinished exchange
    tau: int = 0  # tau = "auto": the latest value chosen (0: fixed tau)
    merges_postponed: int = 0  # tau = "auto": inner steps a merge moved on because its round had not landed
    wait_seconds: float = 0.0
    digest_mismatches: int = 0
    resyncs: int = 0
    syncs: deque = field(default_factory=lambda: deque(maxlen=MAX_SYNC_RECORDS))

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "syncs"}
        out["syncs"] = [asdict(r) for r in self.syncs]
        return out


class Exchange:
    """One fragment's round in flight and what is left to do with it."""

    def __init__(self, record: SyncRecord, merge_at: int, future: Future, ready_at: float) -> None:
        self.record = record
        self.merge_at = merge_at
        self.future = future
        self.ready_at = ready_at  # monotonic time before which it does not count as landed (fault injection)
        self.resolved = False  # the global update is applied (or the round is known not to apply)
        self.merge_pending = True  # the local merge is still to do
        self.late = False
        self.sent: Tensor | None = None  # the (error-compensated) contribution, for error feedback
        future.add_done_callback(self._finished)

    @property
    def fragment(self) -> int:
        return self.record.fragment

    def _finished(self, _fut: concurrent.futures.Future) -> None:
        self.record.t_end = time.time()  # runs on the daemon loop thread: a float store only

    def landed(self) -> bool:
        return self.future.done() and time.monotonic() >= self.ready_at

    def wait(self) -> None:
        concurrent.futures.wait([self.future])
        delay = self.ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
