"""Error feedback: carry each fragment's quantization error into its next round, so errors do not accumulate.

With a lossy codec C, sending ``C(x_t)`` every round loses ``x_t - C(x_t)`` for good. Error feedback sends
``C(x_t + e_t)`` and keeps ``e_{t+1} = x_t + e_t - C(x_t + e_t)``, so the sum of what was sent tracks the sum
of the inputs to within one round's error (the residual stays bounded instead of the drift growing).

Two variants, for sparse codecs that drop most of every update (SparseLoCo, arXiv 2508.15706):

- ``decay`` < 1 compensates with ``decay * e_t``: the residual becomes a decaying accumulator of past updates, which
  stands in for outer momentum (run the outer optimizer without it), and old dropped mass fades instead of coming
  back stale many rounds later.
- ``against = "average"`` keeps ``x_t + e_t - a_t``, where ``a_t`` is the average the swarm applied, instead of what
  our own contribution decoded to. The mean of the members' residuals is then exactly what the whole round dropped,
  including what a shard owner's re-encoding of the average dropped on the way back, which classic error feedback
  loses for good.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peerd.codecs.base import Codec

FEEDBACK_AGAINST = ("contribution", "average")


class ErrorFeedback:
    """Residuals keyed by fragment name. Not thread-safe: use one instance per trainer/round driver."""

    def __init__(self, decay: float = 1.0, against: str = "contribution") -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay!r}")
        if against not in FEEDBACK_AGAINST:
            raise ValueError(f"error feedback is kept against one of {FEEDBACK_AGAINST}, not {against!r}")
        self.decay = float(decay)
        self.against = against
        self._residual: dict[str, Tensor] = {}

    @property
    def needs_decoded(self) -> bool:
        """Whether a round must hand back what our contribution decoded to. Kept against the average, it need not:
        decoding every part of our own contribution again would cost a round CPU and a vector-sized buffer for a
        copy that ``settle`` never reads."""
        return self.against == "contribution"

    def __len__(self) -> int:
        return len(self._residual)

    def __contains__(self, key: object) -> bool:
        return key in self._residual

    def compensate(self, key: str, x: Tensor) -> Tensor:
        """``x + decay * residual[key]`` as a new tensor; ``x`` itself when there is no residual yet (it is zero)."""
        residual = self._residual.get(key)
        if residual is None:
            return x
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"error-feedback residual for {key!r} is {residual.dtype}{tuple(residual.shape)}, "
                f"input is {x.dtype}{tuple(x.shape)}; call reset() when a fragment changes shape"
            )
        residual = residual.to(x.device, non_blocking=True)
        return x + (residual if self.decay == 1.0 else self.decay * residual)

    def update(self, key: str, compensated: Tensor, decoded: Tensor) -> None:
        """Keep ``compensated - decoded`` (what the codec dropped) for the next ``compensate`` of ``key``."""
        if compensated.shape != decoded.shape:
            shapes = f"{tuple(compensated.shape)} vs {tuple(decoded.shape)}"
            raise ValueError(f"compensated and decoded tensors differ in shape: {shapes}")
        residual = compensated - decoded.to(compensated.device)
        if not bool(torch.isfinite(residual).all()):
            raise ValueError(f"error-feedback residual for {key!r} is not finite")
        self._residual[key] = residual

    def settle(self, key: str, compensated: Tensor, sent_decoded: Tensor | None, average: Tensor) -> None:
        """After a round: keep what was not delivered, measured against our decoded contribution or against the
        applied average (``against``). Without a decoded contribution (a lossless round) the residual is zero."""
        if self.against == "average":
            self.update(key, compensated, average)
        elif sent_decoded is not None:
            self.update(key, compensated, sent_decoded)

    def encode(self, codec: Codec, key: str, x: Tensor) -> bytes:
        """Compensate, encode, decode locally and update: the frame to send for fragment ``key``."""
        compensated = self.compensate(key, x)
        frame = codec.encode(compensated)
        decoded = codec.decode(frame, compensated.numel(), device=compensated.device)
        self.update(key, compensated, decoded)
        return frame

    def reset(self, key: str | None = None) -> None:
        """Forget one fragment's residual, or all of them."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def state_dict(self) -> dict[str, Tensor]:
        """CPU copies of the residuals, for checkpoints (plain tensors: loadable with weights_only=True)."""
        return {key: r.detach().to("cpu", copy=True) for key, r in self._residual.items()}

    def load_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Replace all residuals; validates types and values first so a bad checkpoint changes nothing."""
        if not isinstance(sd, dict):
            raise ValueError(f"error-feedback state must be a dict, got {type(sd).__name__}")
        loaded: dict[str, Tensor] = {}
        for key, value in sd.items():
            if not isinstance(key, str):
                raise ValueError(f"error-feedback key must be str, got {type(key).__name__}")
            if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.dim() != 1:
                raise ValueError(f"error-feedback residual {key!r} must be a 1-D float32 tensor")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"error-feedback residual {key!r} is not finite")
            loaded[key] = value.detach().clone()
        self._residual = loaded
