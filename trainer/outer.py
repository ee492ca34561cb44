"""Outer updates on flat fp32 buffers: DiLoCo's Nesterov step, NoLoCo's step, Streaming DiLoCo's merge.

Every peer of a round applies these to the same inputs and must end with bit-identical results, possibly on
different hardware (CPU and GPU, with or without FMA). So each function is a fixed sequence of elementwise fp32
ops, each rounded once: scalar multiplies and plain adds/subtracts, never ``add(..., alpha=x)`` (which ATen may
fuse into one FMA on some backends and not others) and no reductions. Scalars are rounded to fp32 by ATen the
same way on every backend.

Sign conventions:

* DiLoCo's pseudo-gradient is ``global - local`` (averaged over peers), so it points *uphill* like a gradient
  and the outer step subtracts it.
* NoLoCo's delta is ``local - slow`` (``theta - phi``), the opposite sign: it points in the direction local
  training moved, and the outer step adds the momentum built from it.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from trainer.flat import all_finite


class OuterError(ValueError):
    """Bad tensors or hyperparameters for an outer update."""


def _check_flat(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.float32:
        raise OuterError(f"{name} must be a 1-D float32 tensor")


def _check_same(ref: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        _check_flat(name, t)
        if t.numel() != ref.numel() or t.device != ref.device:
            raise OuterError(f"{name} has {t.numel()} values on {t.device}; expected {ref.numel()} on {ref.device}")


def _check_finite(**tensors: Tensor) -> None:
    for name, t in tensors.items():
        if not all_finite(t):
            raise OuterError(f"{name} holds NaN or Inf")


def pseudo_gradient(global_params: Tensor, local_params: Tensor) -> Tensor:
    """DiLoCo's outer gradient ``global - local`` (one exactly rounded subtraction)."""
    _check_flat("global_params", global_params)
    _check_same(global_params, local_params=local_params)
    return global_params - local_params


class NesterovOuter:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, one momentum buffer per key.

    ``step(global, g)`` does ``v = mu * v + g; global -= lr * (g + mu * v)``, which is what
    ``torch.optim.SGD(lr, momentum=mu, nesterov=True)`` does. Streaming DiLoCo runs one such optimizer per
    fragment: pass ``key=fragment_id`` and the slice of the global buffer that fragment covers.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if not 0.0 < float(lr) < float("inf"):
            raise OuterError(f"outer lr must be positive and finite, got {lr!r}")
        if not 0.0 <= float(momentum) < 1.0:
            raise OuterError(f"outer momentum must be in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buffers: dict[Hashable, Tensor] = {}
        self._scratch: Tensor | None = None  # reused for the update: allocating 40 MB per step costs more

    def _scratch_for(self, like: Tensor) -> Tensor:
        s = self._scratch
        if s is None or s.device != like.device or s.numel() < like.numel():
            s = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
            self._scratch = s
        return s[: like.numel()]

    def step(self, global_params: Tensor, pseudo_grad: Tensor, key: Hashable = None) -> None:
        """Update ``global_params`` (1-D fp32, possibly a view into a bigger buffer) in place."""
        _check_flat("global_params", global_params)
        _check_same(global_params, pseudo_grad=pseudo_grad)
        _check_finite(pseudo_grad=pseudo_grad)
        v = self._momentum(global_params, key)
        self._apply(global_params, v, pseudo_grad)
        self.buffers[key] = v

    def preview(self, global_params: Tensor, pseudo_grad: Tensor, key: Hashable = None) -> Tensor:
        """What :meth:`step` would make of ``global_params``, leaving it and the momentum untouched (DiLoCo's eager
        guess of the next global state while a round runs). No finiteness check: the round that follows refuses a
        non-finite contribution, and the guess is then taken back."""
        _check_flat("global_params", global_params)
        _check_same(global_params, pseudo_grad=pseudo_grad)
        params = global_params.clone()
        self._apply(params, self._momentum(global_params, key).clone(), pseudo_grad)
        return params

    def _momentum(self, global_params: Tensor, key: Hashable) -> Tensor:
        """The momentum buffer for ``key`` on ``global_params``' device (zeros before the first step)."""
        v = self.buffers.get(key)
        if v is None:
            return torch.zeros_like(global_params)
        if v.numel() != global_params.numel():
            raise OuterError(f"momentum for key {key!r} has {v.numel()} values, params have {global_params.numel()}")
        return v.to(global_params.device)

    def _apply(self, params: Tensor, v: Tensor, pseudo_grad: Tensor) -> None:
        """``v = mu * v + g; params -= lr * (g + mu * v)``, both in place."""
        mu = self.momentum
        v.mul_(mu).add_(pseudo_grad)  # v = mu * v + g
        update = torch.mul(v, mu, out=self._scratch_for(v))  # mu * v
        update.add_(pseudo_grad)  # g + mu * v
        update.mul_(self.lr)
        params.sub_(update)

    def state_dict(self) -> dict:
        """Hyperparameters and momentum buffers (shared tensors: clone or save before the next step)."""
        return {"lr": self.lr, "momentum": self.momentum, "buffers": dict(self.buffers)}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; buffers are validated (1-D fp32, finite) before use."""
        try:
            lr, momentum, buffers = float(state["lr"]), float(state["momentum"]), state["buffers"]
        except (KeyError, TypeError, ValueError) as exc:
            raise OuterError(f"malformed outer optimizer state: {exc}") from exc
        if not isinstance(buffers, dict):
            raise OuterError("outer optimizer state 'buffers' must be a dict")
        for key, buf in buffers.items():
            _check_flat(f"momentum[{key!r}]", buf)
            _check_finite(**{f"momentum[{key!r}]": buf})
        checked = NesterovOuter(lr, momentum)  # reuse the constructor's hyperparameter checks
        self.lr, self.momentum = checked.lr, checked.momentum
        self.buffers = {key: buf.clone() for key, buf in buffers.items()}


def noloco_step(
    phi: Tensor,
    m: Tensor,
    delta_mean: Tensor,
    phi_mean: Tensor,
    *,
    alpha: float = 0.5,
    beta: float = 0.7,
    gamma: float = 0.7,
) -> None:
    """NoLoCo outer step (Kolehmainen et al. 2025), in place on ``m`` and ``phi``.

    ``m <- alpha * m + beta * delta_mean + gamma * (phi_mean - phi)`` then ``phi <- phi + m``.
    ``phi`` are this peer's slow weights, ``m`` its outer momentum, ``delta_mean`` the mean over the group (this
    peer and its partner(s)) of ``theta - phi`` (local minus slow: note the sign, opposite to DiLoCo's
    pseudo-gradient), ``phi_mean`` the group's mean slow weights. The gamma term pulls peers' slow weights
    together without any all-reduce. Afterwards the caller resets its local weights to ``phi``.
    """
    _check_flat("phi", phi)
    _check_same(phi, m=m, delta_mean=delta_mean, phi_mean=phi_mean)
    _check_finite(delta_mean=delta_mean, phi_mean=phi_mean)
    tmp = delta_mean * float(beta)
    m.mul_(float(alpha))
    m.add_(tmp)  # alpha * m + beta * delta_mean
    torch.sub(phi_mean, phi, out=tmp)
    tmp.mul_(float(gamma))
    m.add_(tmp)  # ... + gamma * (phi_mean - phi)
    phi.add_(m)


def noloco_mix(delta: Tensor, offset: Tensor, *, beta: float = 0.7, gamma: float = 0.7) -> Tensor:
    """The one tensor a NoLoCo member sends without send-ahead: ``beta * delta + gamma * offset``, where ``offset``
    is ``phi - phi_ref``. It is all a partner's update needs of (delta, phi), see :func:`noloco_mix_step`."""
    _check_flat("delta", delta)
    _check_same(delta, offset=offset)
    mix = delta * float(beta)
    mix.add_(offset * float(gamma))
    return mix


def noloco_mix_step(
    phi: Tensor,
    m: Tensor,
    own_delta: Tensor,
    own_offset: Tensor,
    mixes: list[Tensor],
    *,
    alpha: float = 0.5,
    beta: float = 0.7,
    gamma: float = 0.7,
) -> Tensor:
    """:func:`noloco_step` from every member's :func:`noloco_mix` tensor instead of their (delta, phi), in place;
    returns the group term added to ``alpha * m``.

    ``mixes`` holds the group's mix tensors, ours included, in an order every member uses (peer id). With ``n``
    members, ``d_j = phi_j - phi_ref`` and ``mix_j = beta * delta_j + gamma * d_j``::

        beta * mean(delta) + gamma * (mean(phi) - phi_i)  =  sum_j mix_j / n - gamma * d_i

    equal in exact arithmetic; fp32 rounds the two differently (by a few ulps of the offsets). As with the
    two-tensor update, members whose slow weights are equal and who decode the same values (a lossless codec) end
    bit-identical: only ``- gamma * d_i`` is their own. Alone (``mixes`` is just ours) the step is noloco_step's
    to the bit: ``beta * delta_i``.
    """
    _check_flat("phi", phi)
    _check_same(phi, m=m, own_delta=own_delta, own_offset=own_offset)
    if not mixes:
        raise OuterError("mixes must hold at least our own mix tensor")
    for j, mix in enumerate(mixes):
        _check_same(phi, **{f"mixes[{j}]": mix})
    _check_finite(own_delta=own_delta, own_offset=own_offset)
    _check_finite(**{f"mixes[{j}]": mix for j, mix in enumerate(mixes)})
    if len(mixes) == 1:
        term = own_delta * float(beta)  # alone: the gamma term is exactly zero, as in noloco_step
    else:
        term = mixes[0].clone()
        for mix in mixes[1:]:
            term.add_(mix)
        term.div_(float(len(mixes)))
        term.sub_(own_offset * float(gamma))
    m.mul_(float(alpha))
    m.add_(term)
    phi.add_(m)
    return term


def streaming_merge(local: Tensor, new_global: Tensor, alpha: float = 0.5) -> None:
    """Streaming DiLoCo merge, in place: ``local <- alpha * local + (1 - alpha) * new_global``.

    ``alpha = 0`` replaces the local fragment by the new global one (an exact copy); ``alpha = 1`` keeps it.
    """
    _check_flat("local", local)
    _check_same(local, new_global=new_global)
    _check_finite(new_global=new_global)
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise OuterError(f"merge alpha must be in [0, 1], got {alpha!r}")
    if alpha == 0.0:
        local.copy_(new_global)
    elif alpha < 1.0:
        local.mul_(alpha)
        local.add_(new_global * (1.0 - alpha))
