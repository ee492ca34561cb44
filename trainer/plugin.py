"""User-supplied models: resolve a ``"package.module:factory"`` spec to a model factory.

Contract for a factory:

* It is called as ``factory(config)`` with the run's model config dict (plain JSON-like values: the same dict on
  every peer, so it must build the same architecture from it).
* It returns an ``nn.Module`` whose ``forward(idx, targets=None)`` takes int64 token ids ``[B, T]`` and returns
  ``(logits [B, T, vocab], loss)``, the loss being the mean cross-entropy (a scalar tensor) when ``targets`` is
  given and None otherwise.
* Its initial parameters must be a pure function of ``config`` (seed included), because all peers start from the
  same parameters; draw from a local ``torch.Generator``, not the global RNG (see :mod:`trainer.model`).
* Streaming DiLoCo additionally needs an ``nn.ModuleList`` named ``blocks`` (see :mod:`trainer.fragments`).

The built-in model is ``"trainer.model:build_gpt"``. Importing a spec runs its code, so specs come only from the
local operator's configuration, never from the network.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from torch import nn

DEFAULT_FACTORY = "trainer.model:build_gpt"
_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class PluginError(ValueError):
    """A model factory spec is malformed, cannot be resolved, or built something unusable."""


def load_factory(spec: str) -> Callable[[dict[str, Any]], nn.Module]:
    """Import ``package.module`` and return its (possibly dotted) attribute ``factory``, which must be callable."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise PluginError(f"model factory spec must look like 'package.module:factory', got {spec!r}")
    module_name, attr_path = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import module {module_name!r} for model factory {spec!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise PluginError(f"{spec!r} resolves to a {type(obj).__name__}, which is not callable")
    return obj


def build_model(spec: str, config: dict[str, Any]) -> nn.Module:
    """Resolve ``spec`` and call it with ``config``, checking that the result is an ``nn.Module``."""
    model = load_factory(spec)(config)
    if not isinstance(model, nn.Module):
        raise PluginError(f"factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return model
