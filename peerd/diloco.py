"""DiLoCo (Douillard et al. 2023): every H inner steps, peers average pseudo-gradients and take an outer Nesterov step.

pseudo-gradient = global params - local params. Every peer of the round receives the same averaged bytes and applies
the same deterministic outer update to the same global copy, so global params are bit-identical after a round.
"""

from __future__ import annotations

import logging
import time

import torch

from peerd.algorithm import OuterAlgorithm, StepDone, Trainer
from peerd.allreduce import RoundFailed
from peerd.codecs import ErrorFeedback
from peerd.rendezvous import Behind
from trainer.outer import NesterovOuter

log = logging.getLogger("peerd")


class DiLoCo(OuterAlgorithm):
    name = "diloco"

    def __init__(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.H = cfg.inner.steps
        self.outer = NesterovOuter(cfg.outer.lr, cfg.outer.momentum)
        self.global_params = trainer.layout.flatten(trainer.model).detach().float().cpu().clone()
        # Error feedback: what quantization dropped from our contribution this round is added to the next one.
        self.feedback = ErrorFeedback() if cfg.codec.error_feedback else None

    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        if (t + 1) % self.H:
            return None
        if trainer.heal():  # a better state than ours is live (we are behind, or lost a split): adopt it
            return None
        step = trainer.outer_step
        local = trainer.layout.flatten(trainer.model).detach().float()
        pseudo = self.global_params.to(local.device, non_blocking=True) - local
        if self.feedback is not None:
            pseudo = self.feedback.compensate("params", pseudo.cpu())
        t0 = time.perf_counter()
        try:
            result = trainer.swarm.allreduce(step, pseudo, want_decoded=self.feedback is not None)
        except Behind as exc:
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("step %d is already done in the swarm (now at %d): downloading state", step, exc.step)
            return StepDone(trainer.outer_step) if trainer.resync(-1) else None
        except RoundFailed as exc:
            # Keep our local progress and try again after the next H inner steps; never crash the peer.
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("outer step %d failed (%s); training on and retrying at the next outer step", step, exc)
            return None
        trainer.add_idle(time.perf_counter() - t0)
        if self.feedback is not None and result.sent_decoded is not None:
            self.feedback.update("params", pseudo, result.sent_decoded)
        self.outer.step(self.global_params, result.average)
        trainer.layout.unflatten_into(self.global_params, trainer.model)
        self.work += len(set(result.included))
        return StepDone(step + 1, result)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        momentum = self.outer.buffers.get(None)
        if momentum is None:
            momentum = torch.zeros_like(self.global_params)
        return {"params": self.global_params.clone(), "outer_momentum": momentum.clone()}

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        self.global_params = tensors["params"].float().clone()
        self.outer.buffers[None] = tensors["outer_momentum"].float().clone()
        trainer.layout.unflatten_into(self.global_params, trainer.model)
