"""Initial weights from a file (``--init-from``): a peerd checkpoint or a safetensors state dict.

Every peer of a run must start from the same weights, so the file's sha256 goes into the run spec
(``run.init_digest``) and a peer holding another file is refused at Join. The file comes from the user: a checkpoint
is loaded with ``weights_only=True`` after its footer digest is checked, a safetensors file through the strict
reader of :mod:`trainer.safetensors`. Names and shapes must match the model; the first mismatch is named in one line.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from trainer.checkpoint import MAGIC, CheckpointError, load_checkpoint, verify_checkpoint
from trainer.flat import ParamLayout, all_finite
from trainer.safetensors import SafetensorsError, load_safetensors, read_header


class InitError(ValueError):
    """The --init-from file cannot be read, or does not fit the model."""


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of the file's bytes: the ``run.init_digest`` every peer must share."""
    h = hashlib.sha256()
    try:
        with Path(path).open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as exc:
        raise InitError(f"--init-from {path}: cannot read it ({exc.strerror or exc})") from None
    return h.hexdigest()


def _is_checkpoint(path: Path) -> bool:
    size = path.stat().st_size
    if size < 48:
        return False
    with path.open("rb") as f:
        f.seek(size - 48)
        return f.read(8) == MAGIC


def check_init_file(path: str | os.PathLike[str]) -> str:
    """Cheap checks before joining a swarm (the footer digest of a checkpoint, the header of a safetensors file).
    Returns the kind: "checkpoint" or "safetensors"."""
    p = Path(path)
    if not p.is_file():
        raise InitError(f"--init-from {p}: no such file (give a peerd checkpoint.pt or a .safetensors file)")
    try:
        if _is_checkpoint(p):
            verify_checkpoint(p)
            return "checkpoint"
        read_header(p)
    except (CheckpointError, SafetensorsError) as exc:
        raise InitError(f"--init-from: {exc}") from None
    except OSError as exc:
        raise InitError(f"--init-from {p}: cannot read it ({exc.strerror or exc})") from None
    return "safetensors"


def read_init_state(path: str | os.PathLike[str], model: nn.Module) -> dict[str, Tensor]:
    """The named tensors the file holds. From a peerd checkpoint: its global (swarm-agreed) parameters when they fit
    the model's layout, else its local model state."""
    p = Path(path)
    kind = check_init_file(p)
    try:
        if kind == "safetensors":
            return load_safetensors(p)
        state = load_checkpoint(p)
    except (CheckpointError, SafetensorsError) as exc:
        raise InitError(f"--init-from: {exc}") from None
    assert state is not None
    weights = state.get("model")
    if not isinstance(weights, dict) or not all(isinstance(v, Tensor) for v in weights.values()):
        raise InitError(f"--init-from {p}: this checkpoint holds no model state dict")
    weights = dict(weights)
    flat = (state.get("global") or {}).get("params") if isinstance(state.get("global"), dict) else None
    layout = ParamLayout.of(model)
    if isinstance(flat, Tensor) and flat.dim() == 1 and flat.numel() == layout.numel:
        weights.update(layout.unflatten(flat.float()))
    return weights


@torch.no_grad()
def load_init(path: str | os.PathLike[str], model: nn.Module) -> int:
    """Copy the file's weights into ``model``; returns how many parameters were set.

    Every parameter must be in the file (a tied parameter under any of its names), every name in the file must be
    one of the model's parameters or persistent buffers, with the same shape, finite values and a float dtype.
    """
    weights = read_init_state(path, model)
    targets = model.state_dict(keep_vars=True)  # tied parameters appear under each of their names
    params = {id(p): name for name, p in model.named_parameters()}
    given: dict[int, tuple[str, Tensor]] = {}
    for name, t in weights.items():
        target = targets.get(name)
        if target is None:
            raise InitError(f"--init-from {path}: {name!r} is not a parameter of this model (first unexpected key)")
        if tuple(t.shape) != tuple(target.shape):
            raise InitError(
                f"--init-from {path}: {name!r} has shape {tuple(t.shape)} in the file, "
                f"{tuple(target.shape)} in the model"
            )
        if target.is_floating_point() and not t.is_floating_point():
            raise InitError(f"--init-from {path}: {name!r} is {t.dtype} in the file, the model needs floats")
        if t.is_floating_point() and not all_finite(t.float()):
            raise InitError(f"--init-from {path}: {name!r} holds NaN or Inf")
        other = given.get(id(target))
        if other is not None and not torch.equal(other[1].to(target.dtype), t.to(target.dtype)):
            raise InitError(
                f"--init-from {path}: {other[0]!r} and {name!r} are tied in the model but differ in the file"
            )
        given[id(target)] = (name, t)
    for pid, name in params.items():
        if pid not in given:
            raise InitError(f"--init-from {path}: the file has no {name!r} (first missing parameter)")
    for target in targets.values():
        if id(target) in given:
            target.copy_(given[id(target)][1].to(dtype=target.dtype, device=target.device))
    return len(params)
