"""What security costs, on loopback between real daemon processes.

    python -m bench.security tls [--params 10_000_000] [--peers 3] [--rounds 7] [--repeats 3]
    python -m bench.security reject [--seconds 20] [--flooders 2] [--kind forged|unsigned|garbage] [--limits]
    python -m bench.security digest [--params 10_000_000] [--peers 3]

``tls``: one DiLoCo round of --params fp32 values among --peers daemons (bench/round.py), plaintext against TLS;
both sign every request and stream (that is not optional), so the difference is what TLS adds.

``reject``: two honest daemons average a 1M-parameter vector in a loop while flooder processes send invalid
requests to one of them as fast as they can; reports the rejected requests per second the target handled and the
honest round time with and without the flood. Per-connection rate limits are raised out of the way unless --limits
(then most of the flood is refused by the cheap limiter, before any signature check).

``digest``: the signing work of one round per peer: SHA-256 over every payload byte sent and received (stream
trailers) plus the Ed25519 signatures and checks of headers and trailers, measured in this process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_NETWORK = {"gossip_interval": 0.3, "peer_timeout": 5.0, "rendezvous_timeout": 20.0, "round_timeout": 60.0}


# -- tls --------------------------------------------------------------------------------------------------------------
def bench_tls(args: argparse.Namespace) -> dict:
    """Alternate plaintext and TLS swarms --repeats times (other load on the machine then hits both alike)."""
    from bench.round import run_swarm

    rounds: dict[str, list[float]] = {"plaintext": [], "tls": []}
    for _ in range(args.repeats):
        for use_tls in (False, True):
            with tempfile.TemporaryDirectory(prefix="peerd-bench-sec-") as tmp:
                results = run_swarm(args.peers, args.params, args.rounds, "fp32", 0, Path(tmp), use_tls)
            rounds["tls" if use_tls else "plaintext"] += [
                max(r["times"][k] for r in results) for k in range(1, args.rounds)
            ]
    out: dict = {"rounds": rounds}
    for mode, times in rounds.items():
        out[mode] = statistics.median(times)
        out[f"{mode}_best"] = min(times)
    out["overhead_percent"] = 100 * (out["tls"] / out["plaintext"] - 1)
    out["overhead_percent_best"] = 100 * (out["tls_best"] / out["plaintext_best"] - 1)
    print(
        f"{args.params / 1e6:.0f}M params, {args.peers} peers, {len(rounds['tls'])} rounds each: median plaintext "
        f"{out['plaintext']:.3f} s, TLS {out['tls']:.3f} s ({out['overhead_percent']:+.1f}%); best plaintext "
        f"{out['plaintext_best']:.3f} s, TLS {out['tls_best']:.3f} s ({out['overhead_percent_best']:+.1f}%)"
    )
    return out


# -- digest -----------------------------------------------------------------------------------------------------------
def bench_digest(args: argparse.Namespace) -> dict:
    import hashlib

    from peerd.envelope import Verifier, sign
    from peerd.identity import Identity
    from peerd.streams import HEADER_METHOD, verify_header
    from peerd.v1 import peerd_pb2 as pb

    n = args.peers
    shard = 4 * args.params // n
    moved = 2 * 2 * (n - 1) * shard  # sent and received, reduce and gather, per peer
    blob = os.urandom(shard)
    t0 = time.perf_counter()
    for _ in range(4 * (n - 1)):
        hashlib.sha256(blob).digest()
    sha_s = time.perf_counter() - t0
    ident, verifier = Identity.generate(), Verifier(b"r" * 32)
    t0 = time.perf_counter()
    for _ in range(4 * (n - 1)):
        header = sign(pb.TensorHeader(round_id=b"x" * 32, numel=shard // 4), HEADER_METHOD, ident, b"r" * 32)
        verify_header(verifier, header)
        ident.sign(b"d" * 32)
    sig_s = time.perf_counter() - t0
    out = {"bytes_digested": moved, "sha256_seconds": sha_s, "signature_seconds": sig_s}
    print(
        f"per peer per round ({args.params / 1e6:.0f}M params, {n} peers): SHA-256 over {moved / 1e6:.0f} MB "
        f"{sha_s * 1e3:.1f} ms, Ed25519 signatures and checks {sig_s * 1e3:.2f} ms"
    )
    return out


# -- reject -----------------------------------------------------------------------------------------------------------
def honest(index: int, workdir: str, seconds: float, limits: bool, bootstrap: str | None, q: object) -> None:
    """One honest daemon: average a 1M vector in a loop, timing each round."""
    import torch

    torch.set_num_threads(1)
    from peerd.config import RunConfig
    from peerd.daemon import Daemon
    from peerd.identity import Identity
    from peerd.statesync import StateSnapshot

    security = {} if limits else {"rate_limit": 1e9, "rate_burst": 1e9}
    cfg = RunConfig.from_dict({"network": dict(BENCH_NETWORK), "security": security})
    data = Path(workdir) / f"honest{index}"
    daemon = Daemon(cfg, Identity.generate(), listen="127.0.0.1:0", bootstrap=[bootstrap] if bootstrap else [],
                    data_dir=data)  # fmt: skip
    daemon.start()
    daemon.wait_for_peers(2, threading.Event())
    vector = torch.randn(1_000_000)
    times: list[tuple[float, float]] = []
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        daemon.allreduce(step, vector)
        times.append((time.monotonic(), time.perf_counter() - t0))
        step += 1
        daemon.publish(StateSnapshot(step, {}))
    (data / "times.json").write_text(json.dumps(times))
    time.sleep(1.0)
    daemon.stop()


def flooder(address: str, run_id: bytes, kind: str, seconds: float, conns: int, counts: object) -> None:
    """Send invalid requests as fast as possible over `conns` connections, 32 in flight on each; put the number
    sent on `counts`. The bodies are made once: the server refuses them before its replay check."""
    import asyncio

    import grpc

    from peerd import tls
    from peerd.channels import CHANNEL_OPTIONS
    from peerd.envelope import sign
    from peerd.identity import Identity
    from peerd.v1 import peerd_pb2 as pb

    cert = tls.fetch_cert_sync(address)
    opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
    me = Identity.generate()
    bodies = []
    for _ in range(64):
        msg = sign(pb.GossipRequest(), "Gossip", me, run_id)
        if kind == "forged":
            msg.auth.signature = bytes(64)
        elif kind == "unsigned":
            msg.ClearField("auth")
        bodies.append(os.urandom(64) if kind == "garbage" else msg.SerializeToString())

    async def run() -> int:
        deadline = time.monotonic() + seconds
        sent = 0

        async def caller(gossip: grpc.aio.UnaryUnaryMultiCallable, i: int) -> None:
            nonlocal sent
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):
                    await gossip(bodies[i % len(bodies)], timeout=5)
                sent += 1
                i += 1

        channels = [grpc.aio.secure_channel(address, tls.channel_credentials(cert), options=opts) for _ in range(conns)]
        calls = [ch.unary_unary("/peerd.v1.Membership/Gossip") for ch in channels]
        await asyncio.gather(*(caller(calls[k % conns], k) for k in range(32 * conns)))
        for ch in channels:
            await ch.close()
        return sent

    counts.put(asyncio.run(run()))  # type: ignore[attr-defined]


def bench_reject(args: argparse.Namespace) -> dict:
    from peerd.config import RunConfig
    from peerd.status import fetch_status

    ctx = multiprocessing.get_context("spawn")
    run_id = RunConfig.from_dict({"network": dict(BENCH_NETWORK)}).run_id()
    with tempfile.TemporaryDirectory(prefix="peerd-bench-reject-") as tmp:
        total = args.warmup + args.seconds + args.warmup
        first = ctx.Process(target=honest, args=(0, tmp, total, args.limits, None, None))
        first.start()
        addr_file = Path(tmp) / "honest0" / "address"
        while not addr_file.exists():
            time.sleep(0.05)
        target = addr_file.read_text().strip()
        second = ctx.Process(target=honest, args=(1, tmp, total, args.limits, target, None))
        second.start()
        time.sleep(args.warmup)
        before = fetch_status(target).rejected_messages
        counts = ctx.Queue()
        t_flood = time.monotonic()
        floods = [ctx.Process(target=flooder, args=(target, run_id, args.kind, args.seconds, args.conns, counts))
                  for _ in range(args.flooders)]  # fmt: skip
        for f in floods:
            f.start()
        for f in floods:
            f.join()
        t_end = time.monotonic()
        after = fetch_status(target).rejected_messages
        sent = sum(counts.get() for _ in floods)
        first.join()
        second.join()
        times = json.loads((Path(tmp) / "honest0" / "times.json").read_text())
    during = [s for t, s in times if t_flood <= t <= t_end]
    quiet = [s for t, s in times if t < t_flood or t > t_end + 1.0]
    out = {
        "kind": args.kind,
        "limits": args.limits,
        "sent_per_s": sent / args.seconds,
        "rejected_per_s": (after - before) / args.seconds,
        "round_s_quiet": statistics.median(quiet) if quiet else None,
        "round_s_flood": statistics.median(during) if during else None,
        "rounds_during_flood": len(during),
    }
    print(
        f"flood ({args.kind}, {args.flooders} processes x {args.conns} connections, limits "
        f"{'on' if args.limits else 'raised'}): sent {out['sent_per_s']:.0f}/s, target rejected "
        f"{out['rejected_per_s']:.0f}/s; honest 1M-param round {out['round_s_quiet']:.3f} s quiet, "
        f"{out['round_s_flood']:.3f} s under flood ({len(during)} rounds completed during it)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("tls")
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3, help="swarms per mode, alternating plaintext and TLS")
    p = sub.add_parser("digest")
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--peers", type=int, default=3)
    p = sub.add_parser("reject")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--flooders", type=int, default=2)
    p.add_argument("--conns", type=int, default=4, help="connections per flooder process")
    p.add_argument("--kind", default="forged", choices=["forged", "unsigned", "garbage"])
    p.add_argument("--limits", action="store_true", help="keep the default per-connection rate limits")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {"tls": bench_tls, "digest": bench_digest, "reject": bench_reject}[args.what](args)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
