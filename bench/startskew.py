"""Compute idle of a short swarm with and without the start barrier (peerd/startbarrier.py), in one run.

    python -m bench.startskew [--runs 10] [--algorithm streaming] [--peers 3] [--json]

Each run is one `peerd demo --json` (every peer started with `--wait-peers N`), alternating between
`network.start_barrier = true` and `false`, so both arms see the same machine load. Without the barrier the peers
start training as soon as each sees N settled peers and has built its model, up to a second apart; the first rounds
absorb that skew as compute idle. Prints each run's `compute_idle_fraction` (the swarm's compute-idle share), and the
median and range per arm. Every run must end on one model (`max_param_diff` 0 for DiLoCo and Streaming).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def one_run(args: argparse.Namespace, barrier: bool) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "peerd", "demo", "--algorithm", args.algorithm, "--peers", str(args.peers), "--json",
        "--set", f"network.start_barrier={'true' if barrier else 'false'}", *args.demo_args,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"demo failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(lines[-1])
    return {"barrier": barrier, "idle": out["compute_idle_fraction"], "ok": out["ok"], "diff": out["max_param_diff"]}


def summarize(runs: list[dict[str, Any]], barrier: bool) -> dict[str, float]:
    idle = [r["idle"] for r in runs if r["barrier"] == barrier]
    return {"median": statistics.median(idle), "min": min(idle), "max": max(idle), "runs": len(idle)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per arm (alternating)")
    ap.add_argument("--algorithm", default="streaming")
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("demo_args", nargs="*", help="extra `peerd demo` arguments (after --)")
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.runs):
        for barrier in (i % 2 == 0, i % 2 != 0):  # alternate which arm goes first
            r = one_run(args, barrier)
            runs.append(r)
            if not args.json:
                print(f"run {i + 1} barrier={'on ' if barrier else 'off'} idle {100 * r['idle']:5.1f}%  "
                      f"max param diff {r['diff']}", flush=True)  # fmt: skip
    on, off = summarize(runs, True), summarize(runs, False)
    if args.json:
        print(json.dumps({"on": on, "off": off, "runs": runs}))
    else:
        for name, s in (("barrier on ", on), ("barrier off", off)):
            print(f"{name}: median idle {100 * s['median']:.1f}% (range {100 * s['min']:.1f}-{100 * s['max']:.1f}%, "
                  f"{s['runs']} runs)")  # fmt: skip
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
