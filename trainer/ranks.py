"""Several processes as one peer: data-parallel ranks inside a peer over torch.distributed (NCCL on GPUs, gloo on CPU).

A volunteer with N GPUs runs one peer, not N: rank 0 runs the daemon and the outer algorithm and talks to the swarm;
ranks 1..N-1 only train. Every inner step each rank computes gradients on its own batches and the gradients are
averaged across ranks (so the peer trains with N x the batch), then every rank takes the same AdamW step. Whatever
else changes the model (an outer step, a state download, a merge, a re-warm, a checkpoint resume) happens on rank 0,
which then sends its parameters, AdamW moments and lr schedule position to the others (`sync`), so all ranks hold
bit-identical weights. Rank 0 drives the followers with one small command per step (train / sync / stop).

Nothing here touches the network beyond the local process group; nothing is pickled (tensors only).
"""

from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.inner import WarmupCosine

STOP, TRAIN, SYNC = 0, 1, 2
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RanksError(RuntimeError):
    """The local process group could not be formed, or a rank went away."""


@dataclass
class LocalRanks:
    rank: int
    world: int
    device: torch.device

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float = 120.0) -> LocalRanks | None:
        """Join the local group described by torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
        None when WORLD_SIZE is unset or 1 (a single-process peer)."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return None
        missing = [v for v in ENV_VARS if not os.environ.get(v)]
        if missing:
            raise RanksError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: start ranks with torchrun or "
                             f"peerd start --procs-per-peer N")  # fmt: skip
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            raise RanksError(f"cannot form the local process group ({backend}): {exc}") from exc
        return cls(dist.get_rank(), dist.get_world_size(), device)

    # -- control ------------------------------------------------------------------------------------------------
    def command(self, cmd: int = -1) -> int:
        """Rank 0 sends `cmd`; every rank returns it."""
        t = torch.tensor([cmd], dtype=torch.int64, device=self.device)
        self._collective(dist.broadcast, t, 0)
        return int(t.item())

    def _collective(self, fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except Exception as exc:
            raise RanksError(f"a local rank of this peer went away ({exc.__class__.__name__}); stopping") from exc

    # -- every inner step ---------------------------------------------------------------------------------------
    def average_grads(self, model: nn.Module) -> None:
        """Average the gradients over the ranks (one flat all-reduce; a missing grad counts as zeros)."""
        params = list(model.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._collective(dist.all_reduce, flat)
        flat.div_(self.world)
        pos = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[pos : pos + n].view_as(p))
            pos += n

    # -- after rank 0 changed the model -------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, model: nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> None:
        """Rank 0's parameters, AdamW moments and lr schedule position, copied to every rank."""
        params = list(model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params]).contiguous()
        self._collective(dist.broadcast, flat, 0)
        pos = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[pos : pos + n].view_as(p))
            pos += n
        has = torch.tensor(
            [1.0 if "exp_avg" in opt.state.get(p, {}) else 0.0 for p in params], dtype=torch.float64, device=self.device
        )
        self._collective(dist.broadcast, has, 0)
        for p, flag in zip(params, has.tolist(), strict=True):
            if not flag:
                opt.state.pop(p, None)
                continue
            st = opt.state.get(p)
            if st is None or "exp_avg" not in st:
                st = opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
            for key in ("exp_avg", "exp_avg_sq"):
                self._collective(dist.broadcast, st[key], 0)
            step = torch.as_tensor(st["step"], dtype=torch.float64, device=self.device).reshape(1).clone()
            self._collective(dist.broadcast, step, 0)
            st["step"] = torch.tensor(float(step.item()), dtype=torch.float32)
        self._sync_schedule(opt, sched)

    def _sync_schedule(self, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LambdaLR) -> None:
        fns = [f for f in sched.lr_lambdas if isinstance(f, WarmupCosine)]
        f0 = fns[0] if fns else None
        vals = torch.tensor(
            [
                float(sched.last_epoch),
                float(-1 if f0 is None or f0.rewarm_at is None else f0.rewarm_at),
                float(0 if f0 is None else f0.rewarm_steps),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        self._collective(dist.broadcast, vals, 0)
        last, at, steps = (int(v) for v in vals.tolist())
        sched.last_epoch = last
        for f in fns:
            f.rewarm_at, f.rewarm_steps = (None if at < 0 else at), steps
        for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(last)
        sched._last_lr = [g["lr"] for g in opt.param_groups]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_seed(run_seed: int, slot: int, rank: int) -> int:
    """Batch generator seed of one rank: the peer's slot and the rank, so ranks never draw the same batches."""
    tag = f"{run_seed}/{slot}" if rank == 0 else f"{run_seed}/{slot}/rank{rank}"
    return int(hashlib.sha256(tag.encode()).hexdigest()[:8], 16)


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in order: equal digests mean bit-identical ranks."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().float().cpu().contiguous().untyped_storage()))
    return h.hexdigest()
