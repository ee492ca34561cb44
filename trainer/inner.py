"""The inner (local) optimizer: AdamW with linear warmup and cosine decay, and re-warmup when the weights jump.

Re-warming (Gupta et al. 2023, "Continual Pre-Training of Large Language Models: How to (re)warm your model?"):
AdamW's moments describe the weights they were accumulated on. When those weights are replaced by very different
ones (a downloaded swarm state many outer steps ahead), stepping at the full lr with stale moments spikes the loss;
fresh moments and a short linear ramp avoid it.

Biases, normalisation gains and embeddings get no weight decay: decaying them drags useful scales and token
statistics towards zero without regularising anything that matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

# nn.RMSNorm only exists from torch 2.4 on.
NO_DECAY_MODULES: tuple[type[nn.Module], ...] = tuple(
    m
    for m in (
        nn.Embedding,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        getattr(nn, "RMSNorm", None),
    )
    if m is not None
)


@dataclass
class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine decay to ``floor`` at ``total_steps`` (flat if None).

    A re-warm from step ``rewarm_at`` caps the multiplier with a second linear ramp over ``rewarm_steps`` (the lower
    of the two ramps wins, so a re-warm during the initial warmup never slows it twice).
    A callable object rather than a lambda so ``LambdaLR.state_dict()`` saves it (as plain numbers).
    """

    warmup_steps: int
    total_steps: int | None
    floor: float = 0.1
    rewarm_at: int | None = None
    rewarm_steps: int = 0

    def __call__(self, step: int) -> float:
        warm = 1.0 if step >= self.warmup_steps else (step + 1) / self.warmup_steps
        if self.rewarm_at is not None and self.rewarm_steps > 0 and step >= self.rewarm_at:
            warm = min(warm, (step - self.rewarm_at + 1) / self.rewarm_steps)
        if self.total_steps is None or step < self.warmup_steps:
            return warm
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return warm * (self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed group (matrices) and a non-decayed one (biases, norms, embeddings)."""
    no_decay: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, NO_DECAY_MODULES) or p.dim() < 2:
                no_decay.add(id(p))
    decay_params, plain_params, seen = [], [], set()
    for p in model.parameters():  # parameters() already skips tied duplicates; `seen` guards plugins anyway
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (plain_params if id(p) in no_decay else decay_params).append(p)
    groups = []
    if decay_params:
        groups.append({"params": decay_params, "weight_decay": weight_decay})
    if plain_params:
        groups.append({"params": plain_params, "weight_decay": 0.0})
    return groups


def make_inner_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    warmup_steps: int,
    total_steps: int | None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over ``model`` plus its warmup/cosine schedule; call ``scheduler.step()`` after each step.

    The fused CUDA kernel is used when every parameter is on a GPU.
    """
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"total_steps must be positive or None, got {total_steps}")
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("model has no trainable parameters")
    fused = all(p.is_cuda for g in groups for p in g["params"])
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps))
    return optimizer, scheduler


def rewarm(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Forget AdamW's moments and ramp the lr up again over ``steps`` from the scheduler's current step.

    The lr of every group is set at once, so the very next step already runs at the ramp's first value.
    """
    if steps <= 0:
        return
    optimizer.state.clear()
    step = scheduler.last_epoch
    schedules = {id(f): f for f in scheduler.lr_lambdas}.values()
    for sched in schedules:
        if not isinstance(sched, WarmupCosine):
            raise TypeError(f"cannot re-warm a {type(sched).__name__} schedule")
        sched.rewarm_at, sched.rewarm_steps = step, int(steps)
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def rewarm_reason(jump: int, why: str, moments_from_checkpoint: bool) -> str:
    """Why adopting a state `jump` outer steps ahead of ours (for `why`: behind, fork, start, sponsored) leaves our
    AdamW moments describing other weights, or "" when they still fit: one step ahead is an ordinary round for
    moments that trained on the step before, not for moments a checkpoint kept while the swarm trained on. A
    sponsored peer keeps its own weights on top of the state it adopts: its moments fit."""
    if why == "sponsored":
        return ""
    if why == "fork":
        return "that diverged from ours"
    if jump >= 2 or (jump >= 1 and moments_from_checkpoint):
        return f"{jump} outer steps ahead of ours" + (" (our moments are from a checkpoint)" if jump < 2 else "")
    return ""


def optimizer_note(optimizer: torch.optim.Optimizer) -> str:
    """AdamW's steps since its moments were fresh and its lr now, in a few words: what sets the size of the next
    pseudo-gradient (fresh moments take sign-sized steps; a re-warm ramps the lr back up)."""
    group = optimizer.param_groups[0]
    state = optimizer.state.get(group["params"][0], {})
    steps = int(state["step"]) if "step" in state else 0
    return f"AdamW {steps} steps since fresh moments, lr {group['lr']:.3g}"
