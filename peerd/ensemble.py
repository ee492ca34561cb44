"""Domain-expert ensembles (HDEE, arXiv 2502.19385): every peer trains its own expert on its own data domain.

There is no parameter exchange at all: no rounds, no pairs, no state downloads. The swarm is still a swarm: peers
join through a bootstrap address, gossip, show up in `peerd status` and export metrics, so one dashboard watches the
whole ensemble. Experts may differ in model size, data and inner steps: for this algorithm those keys are local
(peerd/config.py `RunConfig.spec`). `peerd ensemble-eval` combines the finished experts' predictive distributions.

Each expert is its own lineage. Its state is never ranked against another's (the split-brain rule is for one model),
so nothing here publishes a claim that could make a peer adopt another expert's weights.
"""

from __future__ import annotations

import torch

from peerd.algorithm import OuterAlgorithm, StepDone, Trainer


class Ensemble(OuterAlgorithm):
    name = "ensemble"
    independent = True  # the worker neither downloads other peers' states nor waits for them at the end

    def __init__(self, trainer: Trainer) -> None:
        self.H = trainer.cfg.inner.steps
        self.params = trainer.layout.flatten(trainer.model).detach().float().cpu().clone()

    def after_inner_step(self, trainer: Trainer, t: int) -> StepDone | None:
        """Every H inner steps: an outer step of this expert alone (evaluate, publish, checkpoint), by design."""
        if (t + 1) % self.H:
            return None
        self.params = trainer.layout.flatten(trainer.model).detach().float().cpu().clone()
        self.work += 1  # outer steps of this expert: its state is never compared with another expert's
        return StepDone(trainer.outer_step + 1)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"params": self.params.clone()}

    def load_state_tensors(self, trainer: Trainer, tensors: dict[str, torch.Tensor]) -> None:
        self.params = tensors["params"].float().clone()
        trainer.layout.unflatten_into(self.params, trainer.model)
