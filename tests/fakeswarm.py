"""In-memory stand-ins for the two ports an outer algorithm sees (peerd/algorithm.py `Trainer`, peerd/swarm.py
`Swarm`), to drive DiLoCo, Streaming and NoLoCo one step at a time without processes or sockets. They add to the
real-process tests, they do not replace them: the swarm here is a script of what the other peers contribute."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peerd.allreduce import RoundFailed, RoundResult, RoundStats
from peerd.config import RunConfig
from peerd.consistency import Claim
from peerd.pairing import PairOutcome
from peerd.statesync import StateSnapshot
from peerd.timings import join_offset_s
from peerd.v1 import peerd_pb2 as pb
from trainer.flat import ParamLayout

ME = "me"


def group_of(step: int, ids: Sequence[str], fragment: int = -1) -> pb.Group:
    members = [pb.PeerInfo(peer_id=i) for i in ids]
    return pb.Group(round_id=b"r%d" % step, step=step, members=members, expected=list(ids), fragment=fragment)


class FakeSponsoring:
    """Nobody is flagged and nothing is sponsored (peerd/sponsor.py has its own tests)."""

    def target(self) -> str:
        return ""

    def upload(self, sponsor: str, vector: torch.Tensor, base_step: int, tokens: int) -> concurrent.futures.Future:
        raise AssertionError("FakeSponsoring never names a sponsor")

    def take(self, step: int, own_norm: float) -> list:
        return []

    def settle(self, taken: list, included_step: int | None) -> None: ...

    def fetch_average(self, sponsor: str, step: int, numel: int, timeout: float) -> concurrent.futures.Future:
        raise AssertionError("FakeSponsoring never names a sponsor")

    def keep_average(self, step: int, average: torch.Tensor, included: int, carried: Sequence[str]) -> None:
        raise AssertionError("FakeSponsoring hands out no sponsored work to carry")

    def probes(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None: ...


@dataclass
class FakeSwarm:
    """Each round averages our vector with `others(step, fragment, vector)` (the other peers' contributions; none:
    a round of one). `fail` raises RoundFailed for the listed (step, fragment) once; `behind` answers Behind."""

    others: Callable[[int, int, torch.Tensor], list[torch.Tensor]] = lambda step, fragment, v: []
    fail: set[tuple[int, int]] = field(default_factory=set)
    behind: dict[tuple[int, int], int] = field(default_factory=dict)
    behind_since_s: float = 0.0  # with `behind`: how long ago the leader says the missed round formed (0: unknown)
    best: Claim | None = None
    state: StateSnapshot | None = None
    partners: Callable[[int, Mapping[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]] | None = None
    codec: Any = None  # a peerd codec our contribution goes through (None: lossless)
    calls: list[tuple[int, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the work each contribution claimed, round by round
    vectors: list[torch.Tensor] = field(default_factory=list)  # what we contributed, round by round
    wanted_decoded: list[bool] = field(default_factory=list)  # whether each round was asked for our decoded copy
    recorded: list[pb.Group] = field(default_factory=list)
    noted: list[tuple[int, list[str]]] = field(default_factory=list)
    skipped: list[tuple[int, list[int]]] = field(default_factory=list)  # rounds we told the leader we skip
    solo_steps: int = 0
    failures: list[str] = field(default_factory=list)
    join_lag_ms: list[int] = field(default_factory=list)  # the leader's join lags for our rounds' groups (us first)

    def allreduce(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> RoundResult:
        from peerd.rendezvous import Behind

        self.calls.append((step, fragment))
        self.tokens.append(tokens)
        self.vectors.append(vector.detach().clone())
        self.wanted_decoded.append(want_decoded)
        if (step, fragment) in self.fail:
            self.fail.discard((step, fragment))
            raise RoundFailed("injected", set(), "timeout")
        if (step, fragment) in self.behind:
            raise Behind(self.behind[(step, fragment)], self.behind_since_s)
        contributions = [vector.detach().float().cpu(), *self.others(step, fragment, vector)]
        ids = [ME] + [f"p{i}" for i in range(1, len(contributions))]
        average = torch.stack(contributions).mean(0)
        sent = self.codec.decode(self.codec.encode(contributions[0]), vector.numel()) if self.codec else None
        if self.codec is not None:  # what the others received from us, as through a real codec
            contributions[0] = sent
            average = torch.stack(contributions).mean(0)
        decoded = (sent if sent is not None else contributions[0]) if want_decoded else None
        group = group_of(step, ids, fragment)
        group.join_lag_ms.extend(self.join_lag_ms)
        result = RoundResult(average, group, ids, RoundStats(), decoded)
        result.join_offset_s = join_offset_s(group, ME)
        return result

    def allreduce_async(
        self,
        step: int,
        vector: torch.Tensor,
        fragment: int = -1,
        want_decoded: bool = False,
        tokens: int = 0,
        carries: Sequence[str] = (),
    ) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(self.allreduce(step, vector, fragment, want_decoded, tokens, carries))
        except Exception as exc:  # the future carries it, as the real one does
            fut.set_exception(exc)
        return fut

    def note_members(self, step: int, peer_ids: Sequence[str]) -> None:
        self.noted.append((step, list(peer_ids)))

    def skip_rounds(self, step: int, fragments: Sequence[int]) -> None:
        self.skipped.append((step, list(fragments)))

    def canonical(self, min_step: int = -1) -> Claim | None:
        return self.best

    def swarm_step(self) -> int:
        return self.best.step if self.best else -1

    def peer_steps(self) -> list[int]:
        return []

    def finished_step(self) -> int:
        return -1

    def fetch_state(self, min_step: int, expected: dict, timeout: float = 120.0, better: bool = False,
                    base: Any = None, parts: Any = None) -> StateSnapshot:  # fmt: skip
        if self.state is None:
            raise RoundFailed("nobody serves a state")
        return self.state

    def open_pairing(self, numel: int) -> FakePairing:
        return FakePairing(self)

    def open_sponsoring(self, numel: int) -> FakeSponsoring:
        return FakeSponsoring()

    def record_round(self, group: pb.Group, result: RoundResult, fragment: int, note: str = "",
                     rendezvous_s: float = 0.0) -> None:  # fmt: skip
        self.recorded.append(group)

    def count_solo_step(self) -> None:
        self.solo_steps += 1

    def count_failure(self, reason: str) -> None:
        self.failures.append(reason)

    def screen_partners(self, mine: Mapping, partners: Mapping) -> dict[str, str]:
        return {}

    def invalid_contribution(self, peer_id: str, reason: str) -> None:
        self.failures.append(f"{peer_id}:{reason}")


class FakePairing:
    """NoLoCo's pair port: a partner's tensors come from FakeSwarm.partners (none: no partner, a solo step)."""

    my_id = ME

    def __init__(self, swarm: FakeSwarm) -> None:
        self.swarm = swarm
        self.rounds: list[int] = []

    def run_round(self, step: int, tensors: Mapping[str, torch.Tensor]) -> PairOutcome:
        self.rounds.append(step)
        theirs = self.swarm.partners(step, tensors) if self.swarm.partners else {}
        contributions = {ME: {k: v.clone() for k, v in tensors.items()}, **theirs}
        members = [pb.PeerInfo(peer_id=i) for i in contributions]
        return PairOutcome(step, b"x" if theirs else b"", members, contributions, [], 0.0, RoundStats(), "fake")

    def start_ahead(self, step: int, phi: torch.Tensor) -> None:
        pass

    def progress(self, step: int, eta_s: float, phase_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class TinyNet(torch.nn.Module):
    """Two "blocks" (so Streaming can cut it into fragments) and a head; 18 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        self.head = torch.nn.Linear(2, 2, bias=False)


class FakeTrainer:
    """A Trainer without data or optimizer: `inner_step()` moves every parameter by a known amount, so what an
    algorithm sends and applies can be checked by hand."""

    def __init__(self, cfg: RunConfig, swarm: FakeSwarm, data_dir: Path) -> None:
        self.cfg = cfg
        self.swarm = swarm
        self.data_dir = data_dir
        torch.manual_seed(0)
        self.model = TinyNet()
        self.layout = ParamLayout.of(self.model)
        self.outer_step = 0
        self.t = 0
        self.idle = 0.0
        self.published: list[int] = []
        self.adopted: list[tuple[int, str]] = []
        self.states: list[str] = []
        self.algorithm: Any = None
        self.tokens_per_step = 100
        self.heal_boundary: float | None = None

    def inner_step(self, delta: float = 0.01) -> Any:
        """One "inner step" (every parameter += delta), then the algorithm's hook; applies what it returns."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(delta)
        done = self.algorithm.after_inner_step(self, self.t)
        self.t += 1
        if done is not None:
            self.outer_step = done.step
        return done

    def add_idle(self, seconds: float) -> None:
        self.idle += seconds

    def inner_note(self) -> str:
        return "no optimizer (a fake trainer)"

    def heal(self) -> bool:
        best = self.swarm.canonical()
        if best is None:
            return False
        self.heal_boundary = time.monotonic() - best.seen_s if best.seen_s > 0 else None
        return self.resync(-1)

    def resync(self, min_step: int, why: str = "behind", wait_s: float = 0.0) -> bool:
        try:
            snap = self.swarm.fetch_state(min_step, {})
        except RoundFailed:
            return False
        self.adopt(snap, why)
        return True

    def adopt(self, snap: StateSnapshot, why: str) -> None:
        self.algorithm.load_state_tensors(self, snap.tensors)
        self.algorithm.work = snap.work
        self.outer_step = snap.step
        self.adopted.append((snap.step, why))

    def publish(self, step: int | None = None, finished: bool = False) -> None:
        self.published.append(self.outer_step if step is None else step)

    def set_state(self, state: str) -> None:
        self.states.append(state)
