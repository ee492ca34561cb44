"""Peers behind NAT: the same 4-peer run with 0, 1 and 2 peers that cannot be dialled (issue 11).

    sudo python -m bench.nat [--steps 30] [--reps 3] [--blocked 0,1,2] [--algorithm diloco] [--json out.json]

Each run starts 4 real `peerd start` processes, each in a network namespace of its own (tests/netswarm.py on
bench/netfaults.py, 1 Gbit/s links), tiny model, `--steps` outer steps. The hosts of the outbound-only peers drop every
inbound TCP SYN (`FaultNet.block_inbound`): they can dial out, nobody can dial them, as behind a home router. They get
the lowest peer ids, so before the outbound-only rules they would have been chosen to lead every round.

Reported per configuration (medians over --reps runs): wall time from the first process start to the last exit, and
its ratio to the all-reachable swarm; partial rounds summed over all peers; whether every peer ended with the same
global parameters (DiLoCo and Streaming); bytes relayed per round (relays carry NoLoCo calls for outbound-only peers).
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from peerd.identity import Identity

ALGORITHMS: dict[str, dict[str, Any]] = {
    "diloco": {},
    "streaming": {"run__algorithm": "streaming", "codec__name": "e3m0", "streaming__fragments": 2,
                  "inner__steps": 8, "streaming__tau": 2, "streaming__late_policy": "wait"},
    "noloco": {"run__algorithm": "noloco"},
}  # fmt: skip


def write_keys(root: Path, n: int, lowest: list[int]) -> None:
    """Identity keys for peer0..peer{n-1} under `root`; the peers in `lowest` get the lowest ids."""
    keys = sorted((Identity.generate() for _ in range(n)), key=lambda ident: ident.peer_id)
    order = lowest + [i for i in range(n) if i not in lowest]
    for i, ident in zip(order, keys, strict=True):
        (root / f"peer{i}").mkdir(parents=True, exist_ok=True)
        raw = ident.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        fd = os.open(root / f"peer{i}" / "identity.key", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)


def one_run(algorithm: str, n_blocked: int, steps: int, n: int = 4) -> dict[str, Any]:
    import torch

    from bench.netfaults import FaultNet
    from peerd.demo import global_params
    from tests.netswarm import NetSwarm
    from tests.swarm import tiny_config

    blocked = list(range(1, 1 + n_blocked))  # peer 0 is the bootstrap: it must be reachable
    with tempfile.TemporaryDirectory(prefix="peerd-nat-") as tmp:
        root = Path(tmp)
        write_keys(root, n, blocked)
        cfg = tiny_config(root, run__outer_steps=steps, **ALGORITHMS[algorithm])
        with FaultNet(n, 1000.0) as net:
            for i in blocked:
                net.block_inbound(i)
            swarm = NetSwarm(root, n, cfg, net=net)
            t0 = time.monotonic()
            with swarm:
                swarm.wait_exit(900)
            wall = time.monotonic() - t0
            syns = sum(net.syns_dropped(i) for i in blocked)
        sums = [p.summary() for p in swarm.peers]
        logs = [p.log() for p in swarm.peers]
        identical = None
        if algorithm != "noloco":
            params = [global_params(p.data_dir) for p in swarm.peers]
            identical = all(a is not None for a in params) and all(
                torch.equal(a["params"], b["params"]) for a, b in itertools.combinations(params, 2)
            )
    rounds = max(len(s["rounds"]) for s in sums)
    relayed = sum(s.get("relayed_bytes", 0) for s in sums)
    return {
        "algorithm": algorithm,
        "blocked": n_blocked,
        "wall_s": wall,
        "partial_rounds": sum(s["rounds_partial"] for s in sums),
        "failed_rounds": sum(s["rounds_failed"] for s in sums),
        "solo_steps": sum(s["solo_steps"] for s in sums),
        "leader_unreachable_lines": sum(len(re.findall(r"round leader \w+ unreachable", log)) for log in logs),
        "outbound_lines": sum("taking part as an outbound-only peer" in log for log in logs),
        "identical_globals": identical,
        "finished": all(s["finished"] and s["outer_step"] == steps for s in sums),
        "relayed_bytes_per_round": relayed / max(rounds, 1),
        "syns_dropped": syns,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--blocked", default="0,1,2", help="numbers of outbound-only peers (of 4) to run")
    ap.add_argument("--algorithm", default="diloco", choices=sorted(ALGORITHMS))
    ap.add_argument("--json", help="also write every run's figures here")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.nat: needs root (network namespaces)", file=sys.stderr)
        return 2
    configs = [int(b) for b in args.blocked.split(",")]
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for b in configs:  # interleaved, so a slow spell of the machine hits every configuration alike
            r = one_run(args.algorithm, b, args.steps)
            runs.append(r)
            print(json.dumps({"rep": rep, **r}), flush=True)
    base = statistics.median(r["wall_s"] for r in runs if r["blocked"] == configs[0])
    print(f"\n{args.algorithm}, 4 peers, {args.steps} outer steps, medians of {args.reps} runs:")
    print("outbound-only  wall s  ratio  partial  failed  identical  relayed B/round  leader-unreachable lines")
    for b in configs:
        rs = [r for r in runs if r["blocked"] == b]
        wall = statistics.median(r["wall_s"] for r in rs)
        ident = {r["identical_globals"] for r in rs}
        print(
            f"{b:>13}  {wall:6.1f}  {wall / base:5.2f}  {sum(r['partial_rounds'] for r in rs):>7}  "
            f"{sum(r['failed_rounds'] for r in rs):>6}  {ident.pop() if len(ident) == 1 else ident!s:>9}  "
            f"{statistics.median(r['relayed_bytes_per_round'] for r in rs):>15.0f}  "
            f"{sum(r['leader_unreachable_lines'] for r in rs):>5}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
