"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): no global all-reduce; each outer step a peer averages with one
randomly chosen partner (or a small group), so a round costs the same in a swarm of 4 or 400, and nobody waits on the
slowest peer.

With phi the slow weights (as of the last outer step), theta the fast weights after H inner steps, delta = theta - phi
and m the outer momentum, peer i in group G takes

    m_i   <- alpha * m_i + beta * mean_G(delta) + gamma * (mean_G(phi) - phi_i)
    phi_i <- phi_i + m_i ;  theta_i <- phi_i

The inner optimizer's state is kept as it is. Peers' slow weights differ (that is the point); the gamma term keeps
them close, and `peerd demo` reports how close ("spread").

What goes on the wire: each member sends delta (an update: small and well spread, it quantizes like DiLoCo's
pseudo-gradient) and its slow weights as ``phi - phi_ref``, where ``phi_ref`` are the initial weights, which every
peer builds bit-identically from the run seed. The group term needs ``phi_j - phi_i``, which is tiny next to the
weights (1-2% of ``|phi|`` in our runs), and blockwise codecs err in proportion to each block's largest value; the
drift from initialisation has a smaller range than the weights, so it quantizes with less error. On the benchmark's
final slow weights (bench/convergence.py prints this) that cut the codec's error on ``phi_j - phi_i`` by 1.4-1.7x
for bf16, int8, fp8 and int4 (int8: 42% -> 25% of the gap). With 8-bit and 4-bit codecs the gamma term is thus
noisy; the noise averages out over steps (NoLoCo with int4 still matched DiLoCo with int4, at twice the spread of
fp32). Our own terms never go through the codec: only partners' contributions are decoded, and everything is
averaged in fp32. Peers need not agree bit for bit in NoLoCo, so the two partners do not have to see identical
numbers.

With ``noloco.send_ahead``, phi for the next outer step is known as soon as the last one ends, so the peer pairs
and streams its slow weights right then, overlapping the transfer with its inner steps; at the boundary only delta
is still to send.

Without send-ahead both tensors go at the boundary, and a partner's update only ever uses them in one combination:
``beta * mean(delta) + gamma * (mean(phi) - phi_i)`` is ``mean(mix) - gamma * d_i`` with
``mix_j = beta * delta_j + gamma * (phi_j - phi_ref)`` and ``d_i = phi_i - phi_ref``. So each member sends that
one tensor ("mix", trainer.outer.noloco_mix_step): half the bytes per outer step, the same update in exact
arithmetic (fp32 rounds it a little differently; a peer alone gets bit-identical results, and partners that
decode each other exactly still end bit-identical when their slow weights were). The codec then errs in
proportion to mix's blocks rather than to delta's and the offset's apart; the two are of one scale in our runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from peerd.algorithm import OuterAlgorithm, StepDone, StepTimer, Trainer
from peerd.allreduce import RoundResult
from peerd.pair_exchange import kinds_for
from peerd.v1 import peerd_pb2 as pb
from trainer.outer import noloco_mix, noloco_mix_step, noloco_step

if TYPE_CHECKING:
    from peerd.pairing import PairOutcome
    from peerd.swarm import Swarm

log = logging.getLogger("peerd")


def group_means(
    contributions: Mapping[str, Mapping[str, torch.Tensor]], own_id: str, phi: torch.Tensor, phi_ref: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's mean delta and mean slow weights, in fp32, summed in peer-id order.

    `contributions` maps each included peer to {"pair": delta, "phi": phi - phi_ref}; ours is exact, partners' are
    decoded. Our own slow weights enter as `phi` itself, so a peer alone gets exactly (delta, phi) back and its
    gamma term is exactly zero.
    """
    if own_id not in contributions:
        raise ValueError("our own contribution is missing from the group")
    delta_sum = torch.zeros_like(phi)
    phi_sum = torch.zeros_like(phi)
    for pid in sorted(contributions):
        c = contributions[pid]
        delta_sum += c["pair"]
        phi_sum += phi if pid == own_id else phi_ref + c["phi"]
    n = float(len(contributions))
    return delta_sum / n, phi_sum / n


def noloco_update(
    phi: torch.Tensor,
    momentum: torch.Tensor,
    phi_ref: torch.Tensor,
    contributions: Mapping[str, Mapping[str, torch.Tensor]],
    own_id: str,
    *,
    alpha: float,
    beta: float,
    gamma: float,
) -> torch.Tensor:
    """One NoLoCo outer step from an exchange's contributions, in place on `phi` and `momentum`; returns the
    group's mean delta."""
    delta_mean, phi_mean = group_means(contributions, own_id, phi, phi_ref)
    noloco_step(phi, momentum, delta_mean, phi_mean, alpha=alpha, beta=beta, gamma=gamma)
    return delta_mean


class NoLoCo(OuterAlgorithm):
    name = "noloco"

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.H = cfg.inner.steps
        self.alpha = cfg.noloco.alpha
        self.beta = cfg.noloco.beta
        self.gamma = cfg.noloco.gamma
        self.max_staleness = cfg.noloco.max_staleness
        self.send_ahead = cfg.noloco.send_ahead
        self.phi = trainer.layout.flatten(trainer.model).detach().float().cpu().clone()
        self.phi_ref = self.phi.clone()  # the seeded initial weights: the same on every peer
        self.momentum = torch.zeros_like(self.phi)
        self.swarm: Swarm = trainer.swarm
        self.pairing = trainer.swarm.open_pairing(self.phi.numel())
        self.step_timer = StepTimer()
        self._ahead_step: int | None = None

    # -- the outer step ------------------------------------------------------------------------------------------
    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        self.step_timer.tick(counted=t % self.H != 0)  # the first step of a phase also timed evaluation
        step_s = self.step_timer.seconds
        done = (t + 1) % self.H
        if done:
            eta = (self.H - done) * step_s if math.isfinite(step_s) else math.inf
            self.pairing.progress(trainer.outer_step, eta, self.H * step_s)
            if self.send_ahead and self._ahead_step != trainer.outer_step:
                self._start_ahead(trainer.outer_step)  # first phase, or after a resync/resume
            return None
        step = trainer.outer_step
        if self._must_resync(step):
            trainer.resync(self.swarm.swarm_step())
            self.step_timer.restart()
            return StepDone(trainer.outer_step)
        theta = trainer.layout.flatten(trainer.model).detach().float().cpu()
        own = {"phi": self.phi - self.phi_ref, "pair": theta - self.phi}
        if not self.send_ahead:  # one tensor on the wire (see the module docstring)
            own["mix"] = noloco_mix(own["pair"], own["phi"], beta=self.beta, gamma=self.gamma)
        t0 = time.perf_counter()
        outcome = self.pairing.run_round(step, {k: own[k] for k in kinds_for(self.send_ahead)})
        trainer.add_idle(time.perf_counter() - t0)
        outcome.contributions[self.pairing.my_id] = own  # ours in full: the update and the screen use delta and phi
        delta_mean = self.apply(outcome)
        trainer.layout.unflatten_into(self.phi, trainer.model)
        result = self._record(outcome, delta_mean)
        last = trainer.cfg.run.outer_steps
        if self.send_ahead and not (last and step + 1 >= last):  # no partner to promise a step we will not take
            self._start_ahead(step + 1)
        self.step_timer.restart()
        return StepDone(step + 1, result)

    def apply(self, outcome: PairOutcome) -> torch.Tensor:
        """Fold one exchange into the slow weights and momentum (in place); returns the group's mean delta (without
        send-ahead: the whole group term, beta * mean delta + gamma * pull, which is all we learn). Partners
        whose tensors are out of bounds are left out first (as lost, with the reason in the note) and counted
        towards their ban: one huge delta would otherwise wreck our slow weights."""
        me = self.pairing.my_id
        partners = {pid: c for pid, c in outcome.contributions.items() if pid != me}
        if partners:
            for pid, why in self.swarm.screen_partners(outcome.contributions[me], partners).items():
                log.warning("outer step %d: refused %s's tensors: %s", outcome.step, pid[:8], why)
                del outcome.contributions[pid]
                outcome.lost.append(pid)
                outcome.note += f"; refused {pid[:8]} (too large)"
                self.swarm.invalid_contribution(pid, "too_large")
        if "mix" in outcome.contributions[me]:
            mine = outcome.contributions[me]
            mixes = [c["mix"] for _, c in sorted(outcome.contributions.items())]  # ours too, in peer-id order
            return noloco_mix_step(
                self.phi,
                self.momentum,
                mine["pair"],
                mine["phi"],
                mixes,
                alpha=self.alpha,
                beta=self.beta,
                gamma=self.gamma,
            )
        return noloco_update(
            self.phi,
            self.momentum,
            self.phi_ref,
            outcome.contributions,
            self.pairing.my_id,
            alpha=self.alpha,
            beta=self.beta,
            gamma=self.gamma,
        )

    def _must_resync(self, step: int) -> bool:
        """True when every live peer is more than max_staleness steps ahead: nobody can pair with us any more."""
        steps = self.swarm.peer_steps()
        if not steps or max(steps) <= step or any(abs(s - step) <= self.max_staleness for s in steps):
            return False
        log.warning(
            "every live peer is more than %d outer steps ahead of %d: downloading state", self.max_staleness, step
        )
        return True

    def _start_ahead(self, step: int) -> None:
        self._ahead_step = step
        phi = self.phi - self.phi_ref  # a fresh tensor: the stream reads it while we train
        self.pairing.start_ahead(step, phi)

    def _record(self, outcome: PairOutcome, delta_mean: torch.Tensor) -> RoundResult:
        """Status, logs and metrics for one outer step; `included`/`note` name the partner(s)."""
        group = pb.Group(
            round_id=outcome.round_id,
            step=outcome.step,
            members=outcome.members,
            expected=outcome.expected,
            fragment=-1,
            leader=outcome.members[0].peer_id,
        )
        result = RoundResult(delta_mean, group, outcome.included, outcome.stats)
        self.swarm.record_round(group, result, -1, note=outcome.note, rendezvous_s=outcome.match_seconds)
        if outcome.solo:
            self.swarm.count_solo_step()
            log.info("outer step %d: no partner within %.1fs; stepped alone", outcome.step, outcome.match_seconds)
        elif outcome.lost:
            log.warning("outer step %d: %s; stepped without the lost contribution", outcome.step, outcome.note)
            self.swarm.count_failure("peer_lost")
        else:
            log.info("outer step %d: averaged with %s", outcome.step, outcome.note)
        return result

    # -- state ---------------------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.phi.clone(), "outer_momentum": self.momentum.clone()}

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        self.phi = tensors["params"].float().clone()
        self.momentum = tensors["outer_momentum"].float().clone()
        trainer.layout.unflatten_into(self.phi, trainer.model)
        self._ahead_step = None

    def close(self) -> None:
        self.pairing.close()
