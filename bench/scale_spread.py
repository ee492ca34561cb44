"""How far apart the peers' global weights are at the end of a bench.scale window: the consistency model, measured.

DiLoCo averages over every live peer, so peers at one step hold one model (spread 0). NoLoCo averages in small
groups that change every outer step (`noloco.group_size`), so each peer's slow weights differ from the others' and
are only pulled together; this figure says by how much, relative to how far training moved the weights, the same
measure tests/test_noloco.py bounds for 4 peers."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch


def spread(dirs: list[Path], init: torch.Tensor) -> dict[str, Any]:
    """Each peer's distance from the swarm's mean global weights, over the mean's distance from the shared initial
    weights `init` (median and max over peers), from the checkpoints in `dirs` (a peer without one yet, or whose
    vector has another size, is left out)."""
    from peerd.demo import global_params
    from trainer.checkpoint import CheckpointError

    params = []
    for d in dirs:
        try:
            g = global_params(d)
        except CheckpointError:  # not a figure to guess: the peer is left out, and spread_peers says how many counted
            continue
        if g is not None and g["params"].numel() == init.numel():
            params.append(g["params"].float().reshape(-1))
    if len(params) < 2:
        return {"spread_peers": len(params), "spread_median": None, "spread_max": None}
    mean = torch.stack(params).mean(0)
    travelled = float((mean - init).norm())
    apart = [float((p - mean).norm()) / max(travelled, 1e-12) for p in params]
    return {
        "spread_peers": len(params),
        "spread_median": round(statistics.median(apart), 4),
        "spread_max": round(max(apart), 4),
    }


def initial_weights(config: Path) -> torch.Tensor:
    """The run's initial weights, flat: every peer builds the same ones from the config."""
    from peerd.config import RunConfig
    from peerd.runmodel import build_run_model

    model = build_run_model(RunConfig.load(config))
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
