"""Starting a multi-process peer: `peerd start --procs-per-peer N` spawns ranks 1..N-1 itself; under torchrun every
rank runs `peerd start` and ranks > 0 become followers (peerd/follower.py). Rank 0 runs the daemon."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from peerd.errors import UserError
from trainer.ranks import LocalRanks, RanksError

log = logging.getLogger("peerd")


def env_rank() -> tuple[int, int]:
    """(rank, world) from torchrun-style env vars; (0, 1) when unset."""
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise UserError("RANK and WORLD_SIZE must be integers (set by torchrun or peerd itself)") from None


def rank_device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device:
        return torch.device(args.device)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank) or rank)
        return torch.device(f"cuda:{local}")
    return torch.device("cpu")


def spawn_followers(args: argparse.Namespace, argv: list[str]) -> list[subprocess.Popen]:
    """Rank 0 of `--procs-per-peer N` without torchrun: give ourselves a local group and start ranks 1..N-1 as
    copies of this command (same config, data dir and shard) with RANK set."""
    n = args.procs_per_peer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), RANK="0", LOCAL_RANK="0")
    procs = []
    for rank in range(1, n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "peerd", *argv], env=env))
    return procs


def stop_followers(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace_s)
        if p.poll() is None:
            p.kill()


def join_ranks(args: argparse.Namespace, rank: int) -> LocalRanks | None:
    """This process's place in the peer's local group (None: a single-process peer)."""
    device = rank_device(args, rank)
    if device.type == "cpu" and args.threads <= 0:
        _, world = env_rank()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(world, 1)))
    try:
        return LocalRanks.from_env(device, timeout_s=3600.0)
    except RanksError as exc:
        raise UserError(str(exc), code=1) from None


def run_follower(args: argparse.Namespace) -> int:
    """RANK > 0: train as a follower of this peer's rank 0 (no daemon, no ports, no lock on the data dir)."""
    from peerd.config import RunConfig
    from peerd.follower import follow

    rank, _ = env_rank()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank}: %(message)s")
    cfg = RunConfig.load(args.config)
    ranks = join_ranks(args, rank)
    assert ranks is not None
    try:
        return follow(cfg, Path(args.data_dir), ranks, args.shard)
    except RanksError as exc:
        log.error("%s", exc)
        return 1
    finally:
        ranks.close()
