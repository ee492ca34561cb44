"""Tokens per second of one peer run as 1 process or as N local processes (`--procs-per-peer`), on this machine.

    python -m bench.procs [--quick] [--procs 1,2] [--repeats 3] [--steps 60] [--preset tiny] [--json]

A single peer (no swarm, so nothing but the local ranks is measured) trains the built-in GPT for `--steps` inner
steps. Every configuration gets all the machine's cores: 1 process with all threads, N processes with cores/N
threads each. Tokens/s = inner steps x tokens per step (all ranks) / the peer's compute seconds. Medians of
`--repeats`. On a CPU the ranks share the cores, so expect about 1x; on GPUs each rank brings its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from peerd.demo import to_toml

REPO = Path(__file__).resolve().parent.parent


def one(procs: int, args: argparse.Namespace, root: Path) -> float:
    root.mkdir(parents=True)
    cfg = root / "run.toml"
    cfg.write_text(to_toml({
        "run": {"name": "bench-procs", "outer_steps": max(1, args.steps // 20)},
        "model": {"preset": args.preset, "seq_len": 128},
        "data": {"batch_size": 8},
        "inner": {"steps": 20},
        "checkpoint": {"every": 0},
    }))  # fmt: skip
    threads = max(1, (os.cpu_count() or 1) // procs)
    cmd = [sys.executable, "-m", "peerd", "start", "--config", str(cfg), "--listen", "127.0.0.1:0", "--insecure",
           "--data-dir", str(root / "data"), "--threads", str(threads), "--procs-per-peer", str(procs)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"procs={procs}: {out.stderr[-1500:]}")
    s = json.loads((root / "data" / "summary.json").read_text())
    return s["inner_step"] * s["tokens_per_step"] / s["compute_seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.procs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 steps, 1 repeat")
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 40, 1
    counts = [int(p) for p in args.procs.split(",")]
    rates: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="peerd-procs-") as tmp:
        for rep in range(args.repeats):
            for n in counts:  # interleaved, so machine noise hits every option alike
                rates[n].append(one(n, args, Path(tmp) / f"{n}-{rep}"))
    med = {n: statistics.median(v) for n, v in rates.items()}
    base = med[counts[0]]
    if args.json:
        print(json.dumps({"tokens_per_s": med, "ratio": {n: med[n] / base for n in med}, "repeats": args.repeats}))
        return 0
    print(f"{os.cpu_count()} CPU cores, preset {args.preset}, {args.steps} inner steps, medians of {args.repeats}")
    for n in counts:
        print(f"  --procs-per-peer {n}: {med[n]:>9.0f} tokens/s  ({med[n] / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
