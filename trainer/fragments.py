"""Streaming DiLoCo fragments: which parameters sync together, and at which inner steps.

A fragment is a group of transformer blocks. Parameters outside ``blocks`` are attached by where they sit in the
model: those registered before the blocks (GPT: ``tok_emb``, ``pos_emb``) join fragment 0, those registered after
(GPT: ``ln_f``, ``head``) join the last fragment. In sequential mode this keeps the input side with the first
blocks and the output side with the last ones; in strided mode it adds one small embedding/head share to two
fragments. Either way every parameter is in exactly one fragment.
"""

from __future__ import annotations

from typing import Literal

from torch import nn


class FragmentError(ValueError):
    """Impossible fragment count, mode or schedule."""


def split_fragments(
    model: nn.Module, num_fragments: int, mode: Literal["strided", "sequential"] = "strided"
) -> list[list[str]]:
    """Parameter names of each fragment, each list in ``named_parameters()`` order.

    ``strided``: block i goes to fragment i % P (each fragment spans the depth). ``sequential``: fragment p
    holds a contiguous run of blocks, sizes differing by at most one.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise FragmentError("fragmenting needs a model with a non-empty nn.ModuleList named `blocks`")
    n_layer = len(blocks)
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int):
        raise FragmentError(f"num_fragments must be an int, got {num_fragments!r}")
    if not 1 <= num_fragments <= n_layer:
        raise FragmentError(f"num_fragments must be in [1, n_layer={n_layer}], got {num_fragments}")
    if mode == "strided":
        owner = [i % num_fragments for i in range(n_layer)]
    elif mode == "sequential":
        owner = [i * num_fragments // n_layer for i in range(n_layer)]
    else:
        raise FragmentError(f"mode must be 'strided' or 'sequential', got {mode!r}")

    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    seen_blocks = False
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit():
            seen_blocks = True
            fragments[owner[int(parts[1])]].append(name)
        else:
            fragments[-1 if seen_blocks else 0].append(name)
    return fragments


def fragment_offsets(num_fragments: int, H: int) -> list[int]:
    """Sync offsets t_p = floor(p * H / P): fragments spread evenly over the H-step period.

    With P > H some fragments share an offset (they then sync at the same step).
    """
    if num_fragments < 1:
        raise FragmentError(f"num_fragments must be >= 1, got {num_fragments}")
    if H < 1:
        raise FragmentError(f"H must be >= 1, got {H}")
    return [p * H // num_fragments for p in range(num_fragments)]


def fragment_due(step: int, p: int, offsets: list[int], H: int) -> bool:
    """True when fragment ``p`` syncs after inner step ``step``: (step - t_p) mod H == 0.

    ``step`` counts inner steps done (1 after the first); step 0 is never due, since nothing has trained yet.
    """
    if H < 1:
        raise FragmentError(f"H must be >= 1, got {H}")
    if step < 0:
        raise FragmentError(f"step must be >= 0, got {step}")
    if not 0 <= p < len(offsets):
        raise FragmentError(f"fragment {p} out of range for {len(offsets)} fragments")
    return step > 0 and (step - offsets[p]) % H == 0


def due_fragments(step: int, offsets: list[int], H: int) -> list[int]:
    """Every fragment due after inner step ``step``, in fragment order."""
    return [p for p in range(len(offsets)) if fragment_due(step, p, offsets, H)]
