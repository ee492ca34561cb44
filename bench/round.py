"""Time one DiLoCo round (rendezvous + reduce-scatter + all-gather) between N real daemon processes on loopback.

    python -m bench.round [--params 10_000_000] [--peers 2,3,4] [--rounds 7] [--codec fp32] [--tls] [--malloc both]

Each peer is a separate OS process running a real `Daemon` (gRPC on 127.0.0.1) that averages a random vector of
--params fp32 values; no training, so the figure is the round itself. Prints the median seconds per round and the
effective rate: model bytes (4 x params) averaged per second, each peer's wire throughput (sent + received), and
the CPU seconds each peer's process spent per round (all its threads; steadier than wall time on a shared host).
hivemind's averager needs 0.3-0.5 s for 10M fp32 parameters between 2 peers on this kind of 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_NETWORK = {"gossip_interval": 0.3, "peer_timeout": 5.0, "rendezvous_timeout": 20.0, "round_timeout": 120.0}


def worker(args: argparse.Namespace) -> None:
    """One peer: join, wait for the others, run --rounds rounds, write timings to --out."""
    if args.malloc_tune:
        from peerd.allocator import tune_allocator

        tune_allocator()  # as `peerd start` does, before torch and grpc start threads
    import torch

    torch.set_num_threads(1)
    from peerd.config import RunConfig, apply_codec_recipe
    from peerd.daemon import Daemon
    from peerd.identity import Identity
    from peerd.statesync import StateSnapshot

    codec = {"name": args.codec, "zstd_level": args.zstd_level}
    raw = {"codec": codec, "network": dict(BENCH_NETWORK)}
    apply_codec_recipe(raw, "diloco")  # sparse: the config refuses it without error feedback
    cfg = RunConfig.from_dict(raw)
    data = Path(args.out).parent / f"peer{args.index}"
    daemon = Daemon(
        cfg, Identity.generate(), listen="127.0.0.1:0", bootstrap=args.bootstrap, data_dir=data, insecure=not args.tls
    )
    daemon.start()
    import threading

    daemon.wait_for_peers(args.n, threading.Event())
    gen = torch.Generator().manual_seed(args.index)
    vector = torch.randn(args.params, generator=gen)
    times, stats, cpu = [], [], []
    for step in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        result = daemon.allreduce(step, vector)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # every thread of the process: steadier than wall time on a busy host
        stats.append((result.stats.wire_bytes, result.stats.received_wire_bytes, len(result.included)))
        daemon.publish(StateSnapshot(step + 1, {}))
    Path(args.out).write_text(json.dumps({"times": times, "stats": stats, "cpu": cpu}))
    time.sleep(1.0)  # let the others fetch their last shards from us before we leave
    daemon.stop()


def run_swarm(
    n: int,
    params: int,
    rounds: int,
    codec: str,
    zstd_level: int,
    workdir: Path,
    use_tls: bool = False,
    malloc_tune: bool = True,
) -> list[dict]:
    cmd = [sys.executable, "-m", "bench.round", "--worker", "--params", str(params), "--rounds", str(rounds),
           "--codec", codec, "--n", str(n), "--zstd-level", str(zstd_level)]  # fmt: skip
    cmd += ["--tls"] if use_tls else []
    cmd += ["--malloc-tune"] if malloc_tune else []
    procs = [subprocess.Popen([*cmd, "--index", "0", "--out", str(workdir / "r0.json")])]
    addr_file = workdir / "peer0" / "address"
    deadline = time.monotonic() + 60
    while not addr_file.exists():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError("first bench peer did not start")
        time.sleep(0.05)
    boot = addr_file.read_text().strip()
    for i in range(1, n):
        procs.append(
            subprocess.Popen([*cmd, "--index", str(i), "--out", str(workdir / f"r{i}.json"), "--bootstrap", boot])
        )
    for p in procs:
        if p.wait(600) != 0:
            raise RuntimeError(f"bench peer exited with {p.returncode}")
    return [json.loads((workdir / f"r{i}.json").read_text()) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--peers", default="2,3,4")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per swarm; the first is a warm-up and not counted")
    ap.add_argument("--codec", default="fp32")
    ap.add_argument("--zstd-level", type=int, default=0, help="0: no compression (the plain fp32 baseline)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tls", action="store_true", help="TLS links, as `peerd start` uses by default (else plaintext)")
    ap.add_argument(
        "--malloc", choices=["both", "on", "off"], default="both", help="peers' glibc malloc tuning: compare, or one"
    )
    ap.add_argument("--malloc-tune", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    variants = {"both": [True, False], "on": [True], "off": [False]}[args.malloc]
    print(
        f"DiLoCo round, {args.params / 1e6:.1f}M params, codec {args.codec}, {'TLS' if args.tls else 'plaintext'}, "
        f"loopback, median of {args.rounds - 1} rounds after one warm-up; malloc: tuned as `peerd start` does "
        "(peerd/allocator.py) or glibc's defaults"
    )
    print(
        f"{'peers':>5} {'malloc':>7} {'s/round':>9} {'model GB/s':>11} {'peer wire GB/s':>15} {'sent MB/peer':>13} "
        f"{'CPU s/round/peer':>17}"
    )
    for n in [int(x) for x in args.peers.split(",")]:
        for tuned in variants:
            with tempfile.TemporaryDirectory(prefix="peerd-bench-round-") as tmp:
                results = run_swarm(
                    n, args.params, args.rounds, args.codec, args.zstd_level, Path(tmp), args.tls, tuned
                )
            per_round = [max(r["times"][k] for r in results) for k in range(1, args.rounds)]
            med = statistics.median(per_round)
            wire = statistics.median(
                r["stats"][k][0] + r["stats"][k][1] for r in results for k in range(1, args.rounds)
            )
            sent = statistics.median(r["stats"][k][0] for r in results for k in range(1, args.rounds))
            # CPU seconds a peer's process spent per round (all its threads, round start to return), median
            cpu = statistics.median(r["cpu"][k] for r in results for k in range(1, args.rounds))
            row = {
                "peers": n,
                "malloc_tuned": tuned,
                "seconds_per_round": med,
                "model_gb_per_s": 4 * args.params / med / 1e9,
                "peer_wire_gb_per_s": wire / med / 1e9,
                "sent_mb_per_peer": sent / 1e6,
                "cpu_seconds_per_round_per_peer": cpu,
            }
            rows.append(row)
            print(
                f"{n:>5} {'tuned' if tuned else 'default':>7} {med:>9.3f} {row['model_gb_per_s']:>11.3f} "
                f"{row['peer_wire_gb_per_s']:>15.3f} {row['sent_mb_per_peer']:>13.1f} {cpu:>17.3f}",
                flush=True,
            )
        if len(variants) == 2:
            on, off = rows[-2]["seconds_per_round"], rows[-1]["seconds_per_round"]
            print(f"{n:>5} tuned/default time ratio {on / off:.2f}")
    if args.json:
        print(json.dumps({"params": args.params, "codec": args.codec, "tls": args.tls, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
