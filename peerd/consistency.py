"""One model per run: which global state is canonical when peers disagree, and how a peer's rounds are judged.

A DiLoCo or Streaming state carries `work`: the number of peer-rounds behind it (every applied round adds the number
of peers whose contributions it averaged). Every peer gossips a signed claim (work, outer step, state digest) about
the state it holds. The canonical state is the claim with the highest rank

    rank = (work, outer step, digest)

so after a split the half whose state more peers' work went into wins, ties going to the higher step and then to the
larger digest (an arbitrary but shared order). Every peer evaluates the same rule on the same gossip, and a peer whose
own claim is outranked downloads the winner's state. The rule also covers plain lag: a peer that missed rounds holds
an ancestor of the swarm's state, which has less work, so it downloads the newer one, exactly as `behind` did before.
A peer that trains alone adds 1 per step and cannot outrank a swarm that adds N.

Limitation (SECURITY.md): a hostile admitted peer can claim more work than it has. Signed gossip confines the lie to
its own claim, and the state it then serves still passes every download check (shapes, NaN/Inf, signed digest).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from peerd.v1 import peerd_pb2 as pb


@dataclass(frozen=True, order=True)
class Claim:
    """A peer's statement about the global state it holds, ordered by rank."""

    work: int
    step: int
    digest: bytes
    peer_id: str = ""
    # How long ago gossip first showed any peer at this claim's step (0: unknown); not part of the rank. A peer that
    # adopts the state starts its next window there, where the swarm's started (peerd/diloco.py).
    seen_s: float = field(default=0.0, compare=False)

    @property
    def rank(self) -> tuple[int, int, bytes]:
        return (self.work, self.step, self.digest)

    def same_state(self, other: Claim) -> bool:
        return self.rank == other.rank


def claim_of(info: pb.PeerInfo, step: int | None = None) -> Claim:
    return Claim(int(info.work), int(info.outer_step if step is None else step), bytes(info.state_digest), info.peer_id)


def lineage_verdict(ours: tuple[int, bytes], lineage: Iterable[tuple[int, bytes]]) -> bool | None:
    """Was the state we held (step, digest) an ancestor of a state with this lineage (its ancestors' (step, digest),
    peerd/statesync.py)? True: we were only behind. False: ours had diverged from it, as a split's losing half or a
    peer that trained alone has. None: its lineage does not reach back to our step, so it cannot tell."""
    step, digest = ours
    for s, d in lineage:
        if s == step:
            return d == digest
    return None


def best_claim(mine: Claim, others: Iterable[Claim]) -> Claim:
    """The canonical claim among ours and the others' (claims with no digest yet are ignored)."""
    best = mine
    for c in others:
        if c.digest and c.rank > best.rank:
            best = c
    return best


def outranks(claim: Claim, mine: Claim) -> bool:
    return claim.rank > mine.rank


@dataclass
class AloneTracker:
    """Says, once per change, when this peer starts and stops taking outer steps with nobody else."""

    alone_since: float | None = None
    alone_wall: str = ""
    last_seen: int = 0

    def update(self, included: int, expected: int) -> str | None:
        """Record one round; returns the log line to print when the state changed, else None."""
        if included <= 1 and self.alone_since is None:
            self.alone_since = time.monotonic()
            self.alone_wall = time.strftime("%H:%M:%S")
            self.last_seen = expected
            return (
                f"training alone: no reachable peers since {self.alone_wall} (last seen: {expected} peers); "
                "every step now is a solo step, counted as such"
            )
        if included > 1 and self.alone_since is not None:
            took = time.monotonic() - self.alone_since
            self.alone_since = None
            return f"no longer alone: {included} peers in this round after {took:.0f}s alone"
        return None

    @property
    def status(self) -> str:
        return f"{self.alone_wall} (last seen: {self.last_seen} peers)" if self.alone_since is not None else ""

    def run_shrank_to_us(self, included: int) -> bool:
        """A round of one while we have been alone since a round that expected others: our table may have forgotten
        them since (a split longer than network.forget_after, or peers that finished the run while we caught up),
        but the run did not shrink to one, so such a round is partial however few peers the table still holds."""
        return included <= 1 and self.alone_since is not None and self.last_seen > 1
