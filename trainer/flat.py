"""Flat fp32 views of a model's parameters, for exchange and for checking received sizes.

The network layer moves one 1-D fp32 buffer (or a fragment of it); the layout says which byte range is which
parameter, so a peer can check a payload against shapes it already knows before allocating anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


class LayoutError(ValueError):
    """A tensor, name or flat buffer does not match the layout."""


def all_finite(t: Tensor) -> bool:
    """True if ``t`` holds no NaN or Inf.

    One ``aminmax`` pass (NaN propagates to both outputs, Inf shows in one) instead of ``isfinite(t).all()``,
    which allocates a mask: about 30x faster on a 10M-value CPU buffer.
    """
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


@dataclass(frozen=True)
class ParamLayout:
    """Ordered (name, shape) entries and their offsets in one flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.shapes):
            raise LayoutError("names and shapes differ in length")
        if len(set(self.names)) != len(self.names):
            raise LayoutError("duplicate parameter names")
        offsets, total = [], 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            if not isinstance(name, str) or not name:
                raise LayoutError(f"parameter names must be non-empty strings, got {name!r}")
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
                raise LayoutError(f"bad shape {shape!r} for {name}")
            offsets.append(total)
            total += math.prod(shape)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(self.names)})

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        """Layout of ``model.named_parameters()`` (registration order; tied weights appear once)."""
        named = list(model.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @classmethod
    def from_shapes(cls, entries: Iterable[tuple[str, Sequence[int]]], *, max_numel: int | None = None) -> ParamLayout:
        """Layout from (name, shape) pairs, e.g. a run spec received over the network.

        ``max_numel`` bounds the total size, so a hostile spec cannot make the caller allocate without limit.
        """
        pairs = [(name, tuple(shape)) for name, shape in entries]
        layout = cls(tuple(n for n, _ in pairs), tuple(s for _, s in pairs))
        if max_numel is not None and layout.numel > max_numel:
            raise LayoutError(f"layout needs {layout.numel} values, more than the limit of {max_numel}")
        return layout

    def entries(self) -> list[tuple[str, tuple[int, ...]]]:
        return list(zip(self.names, self.shapes, strict=True))

    def _position(self, name: str) -> int:
        try:
            return self._index[name]  # type: ignore[attr-defined]
        except KeyError:
            raise LayoutError(f"unknown parameter {name!r}") from None

    def slice(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """(offset, numel) of each named parameter in the flat buffer, in the order given."""
        out = []
        for name in names:
            i = self._position(name)
            out.append((self.offsets[i], math.prod(self.shapes[i])))
        return out

    def _tensors(self, source: nn.Module | Mapping[str, Tensor] | Sequence[Tensor]) -> list[Tensor]:
        if isinstance(source, nn.Module):
            params = dict(source.named_parameters())
            tensors = [params.get(n) for n in self.names]
        elif isinstance(source, Mapping):
            tensors = [source.get(n) for n in self.names]
        else:
            tensors = list(source)
            if len(tensors) != len(self.names):
                raise LayoutError(f"expected {len(self.names)} tensors, got {len(tensors)}")
        for name, shape, t in zip(self.names, self.shapes, tensors, strict=True):
            if t is None:
                raise LayoutError(f"missing parameter {name!r}")
            if tuple(t.shape) != shape:
                raise LayoutError(f"{name}: shape {tuple(t.shape)} != layout shape {shape}")
        return tensors  # type: ignore[return-value]

    def flatten(self, source: nn.Module | Mapping[str, Tensor] | Sequence[Tensor]) -> Tensor:
        """One new 1-D fp32 tensor with every parameter in layout order, on the parameters' device."""
        tensors = self._tensors(source)
        if not tensors:
            return torch.empty(0, dtype=torch.float32)
        return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])

    def check(self, flat: Tensor, *, finite: bool = True) -> None:
        """Raise LayoutError unless ``flat`` is a 1-D fp32 tensor of ``numel`` (finite) values."""
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise LayoutError(f"expected a 1-D float32 tensor, got {flat.dtype} of shape {tuple(flat.shape)}")
        if flat.numel() != self.numel:
            raise LayoutError(f"flat buffer has {flat.numel()} values, layout needs {self.numel}")
        if finite and not all_finite(flat):
            raise LayoutError("flat buffer holds NaN or Inf")

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat`` shaped like each parameter (no copy)."""
        self.check(flat, finite=False)
        return {
            name: flat[off : off + math.prod(shape)].view(shape)
            for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True)
        }

    @torch.no_grad()
    def unflatten_into(self, flat: Tensor, model: nn.Module) -> None:
        """Copy ``flat`` into the model's parameters (casting to their dtype and device)."""
        self.check(flat, finite=False)
        params = self._tensors(model)
        for p, (off, n) in zip(params, self.slice(self.names), strict=True):
            p.copy_(flat[off : off + n].view(p.shape))

    def gather(self, flat: Tensor, names: Iterable[str]) -> Tensor:
        """A new 1-D tensor with the named parameters' values from ``flat`` (a fragment's buffer)."""
        self.check(flat, finite=False)
        parts = [flat[off : off + n] for off, n in self.slice(names)]
        return torch.cat(parts) if parts else flat.new_empty(0)

    @torch.no_grad()
    def scatter_(self, flat: Tensor, names: Iterable[str], values: Tensor) -> None:
        """Write a fragment buffer (as made by :meth:`gather` with the same names) back into ``flat``."""
        self.check(flat, finite=False)
        spans = self.slice(names)
        if values.dim() != 1 or values.numel() != sum(n for _, n in spans):
            raise LayoutError(f"fragment buffer has {values.numel()} values, names need {sum(n for _, n in spans)}")
        pos = 0
        for off, n in spans:
            flat[off : off + n].copy_(values[pos : pos + n])
            pos += n

    def fragment_numel(self, names: Iterable[str]) -> int:
        return sum(n for _, n in self.slice(names))
