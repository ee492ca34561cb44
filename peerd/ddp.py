"""The every-step all-reduce baseline (``algorithm = "ddp"``): average gradients across the swarm after every backward
pass, the data-parallel equivalent that DiLoCo and NoLoCo are measured against at equal tokens.

Every inner step is a round of its own (rendezvous, reduce-scatter, all-gather through the run's codec), so
the trainer's outer step counts inner steps here, and ``run.outer_steps`` is the number of inner steps to train. Peers
that start from the same weights and average the same gradient bytes stay bit-identical, as in DDP. Evaluation,
state publishing and checkpoints still happen every ``inner.steps`` steps, at DiLoCo's cadence.

The inner optimizer's state is local: a peer that fell behind and downloaded the swarm's parameters continues with
its own AdamW moments, so it is close to, not bit-identical with, the others afterwards.
"""

from __future__ import annotations

import logging
import time

import torch

from peerd.algorithm import OuterAlgorithm, StepDone, Trainer
from peerd.allreduce import RoundFailed
from peerd.rendezvous import Behind

log = logging.getLogger("peerd")


class DataParallel(OuterAlgorithm):
    name = "ddp"

    def __init__(self, trainer: Trainer) -> None:
        self.H = trainer.cfg.inner.steps
        named = dict(trainer.model.named_parameters())
        self.params = [named[n] for n in trainer.layout.names]  # the layout's order, as in every flat buffer
        self.layout = trainer.layout
        self._reported = trainer.outer_step  # the last step after_inner_step reported as an outer step

    def before_optimizer_step(self, trainer: Trainer) -> StepDone | None:
        step = trainer.outer_step
        grads = self.layout.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        t0 = time.perf_counter()
        try:
            result = trainer.swarm.allreduce(step, grads)
        except Behind as exc:
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("step %d is already done in the swarm (now at %d): downloading state", step, exc.step)
            trainer.resync(exc.step)
            self._skip_update()  # keep the downloaded weights as they are
            return None
        except RoundFailed as exc:
            # All-or-nothing: nobody applied this round. Skip the update (peers stay identical) and retry the same
            # step after the next backward pass; if the swarm went on without us, that retry says Behind.
            trainer.add_idle(time.perf_counter() - t0)
            log.warning("step %d: gradient round failed (%s); skipping this update", step, exc)
            self._skip_update()
            return None
        trainer.add_idle(time.perf_counter() - t0)
        average = result.average.to(grads.device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                chunk = average[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.to(p.dtype).clone()
                else:
                    p.grad.copy_(chunk)
                offset += n
        return StepDone(step + 1, result)

    def _skip_update(self) -> None:
        for p in self.params:
            p.grad = None  # the optimizer skips parameters without gradients

    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        """Every inner step is a round (before_optimizer_step); every H of them counts as an outer step for
        evaluation, publishing and checkpoints."""
        due = trainer.outer_step != self._reported and trainer.outer_step % self.H == 0
        if not due:
            return None
        self._reported = trainer.outer_step
        return StepDone(trainer.outer_step)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.layout.flatten(self.params).cpu()}  # there is no outer optimizer state

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        flat = tensors["params"].float().cpu()
        self.layout.check(flat)
        self.layout.unflatten_into(flat, trainer.model)
