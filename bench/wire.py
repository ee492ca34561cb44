"""The wire at the link's limit: a DiLoCo round's time on tbf-shaped links against raw TCP moving the same bytes.

    python -m bench.wire [--quick] [--params 10_000_000] [--peers 2,4] [--rates 20,100] [--codecs int8,int4,fp32]
                         [--repeats 3] [--plaintext] [--raw-pairs] [--cc host] [--trace] [--json]

Needs root (network namespaces, see bench/slowlink.py). For every (peers, rate) one SlowLinkNet is built; in it,
for every codec:

1. N real daemons (TLS on unless --plaintext), one per namespace, average a random vector of --params fp32 values
   for one warm-up round plus --repeats rounds, with a pause (--gap, 1.5 s) between rounds so TCP starts each round
   from an idle connection, as DiLoCo's rounds (minutes of compute apart) do. A round's time runs from the last
   member's call (the others wait for it in rendezvous) to the last member's return, rendezvous included.
2. Raw TCP in the same namespaces, in two layouts, alternating: every pair of peers opens one TCP connection and
   sends, in both directions at once, the bytes one peer sent that other peer during the round (the median of the
   codec's wire bytes per peer, split evenly over its n-1 partners); and every ordered pair opens one connection
   that carries those bytes one way only. Each is timed from "go" to the last byte received by anyone, --repeats
   times, fresh connections each time (a fresh connection and an idle one both start in slow start), and the
   faster layout's median is the baseline. With BBR the two are close; with cubic, one connection carrying both
   directions reached only 0.64-0.88 of the link at 2 peers and 20 Mbit/s (its data queues behind the other
   direction's in the same tbf queue, and its ACKs with it), against 0.88-0.93 one way.

The figure of merit is raw_tcp_seconds / round_seconds: the round's goodput as a fraction of what plain TCP gets
out of the same links for the same bytes. The physical limit: with one shaped uplink of R bit/s per peer (the
bridge is not the bottleneck), a reduce-scatter + all-gather of V bytes over n peers makes every peer send
2 (n-1)/n V bytes (its contribution to every other shard, then its averaged shard to every other member), so no
schedule can finish before 2 (n-1)/n V * 8 / R s; receiving is symmetric, so shaping downloads too changes
nothing. Raw TCP all-to-all is that limit as TCP (headers, start-up, n-1 flows sharing one tbf) reaches it.

The last column, CPU s, is each daemon's process CPU time per round (all threads): the peers share this machine's
cores, so it tells a cell set by CPU (peers x CPU s near cores x round s) from one set by the wire's schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.slowlink import SlowLinkError, SlowLinkNet, available, check_congestion, host_congestion
from bench.uplink_trace import UplinkTrace, render

REPO = Path(__file__).resolve().parent.parent
PORT = 47311
RAW_PORT = 47312
BENCH_NETWORK = {"gossip_interval": 0.3, "peer_timeout": 5.0, "rendezvous_timeout": 20.0, "round_timeout": 300.0}

# One raw-TCP peer: listens, connects to every higher-index peer (one connection per pair; with argv[5] == "2", to
# every other peer: two per pair, each side dialling, as peerd's rounds do), then on "go" sends argv[3] bytes on every
# connection while reading as many, and reports the time to its last byte received. With argv[5] == "0", one
# connection per direction: it sends only on those it dialled and reads only from those it accepted, so no
# connection's data queues behind the other direction's data in the same tbf queue (its ACKs still do).
_RAW_PEER = r"""
import json, socket, sys, threading, time
idx, n, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
port, pairs, addrs = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", port))
srv.listen(64)
print("ready", flush=True)
sys.stdin.readline()
conns = []
for j in range(idx + 1 if pairs == 1 else 0, n):
    if j != idx:
        conns.append(socket.create_connection((addrs[j], port), timeout=30))
for _ in range(idx if pairs == 1 else n - 1):
    c, _ = srv.accept()
    conns.append(c)
print("connected", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
done = {}
def send(c):
    view = memoryview(bytes(1 << 20))
    left = nbytes
    while left:
        k = min(left, len(view))
        c.sendall(view[:k])
        left -= k
def recv(c, key):
    buf = memoryview(bytearray(1 << 20))
    left = nbytes
    while left:
        k = c.recv_into(buf, min(left, len(buf)))
        if k == 0:
            raise SystemExit("connection closed early")
        left -= k
    done[key] = time.perf_counter() - t0
outs = conns[: n - 1] if pairs == 0 else conns
ins = conns[n - 1 :] if pairs == 0 else conns
jobs = [(send, (c,)) for c in outs] + [(recv, (c, i)) for i, c in enumerate(ins)]
threads = [threading.Thread(target=f, args=a) for f, a in jobs]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"recv_s": max(done.values()) if done else 0.0}), flush=True)
for c in conns:
    c.close()
"""


def worker(args: argparse.Namespace) -> None:
    """One daemon in its namespace: join, wait for the others, run the rounds, write timings to --out."""
    from peerd.allocator import tune_allocator

    tune_allocator()
    import threading

    import torch

    torch.set_num_threads(1)
    from peerd.config import RunConfig, apply_codec_recipe
    from peerd.daemon import Daemon
    from peerd.identity import Identity
    from peerd.layout import PART_BYTES
    from peerd.statesync import StateSnapshot

    raw = {"codec": {"name": args.codec}, "network": dict(BENCH_NETWORK)}
    apply_codec_recipe(raw, "diloco")  # sparse: the config refuses it without error feedback
    cfg = RunConfig.from_dict(raw)
    data = Path(args.out).parent / f"peer{args.index}"
    daemon = Daemon(
        cfg, Identity.generate(), listen=args.listen, bootstrap=args.bootstrap, data_dir=data, insecure=args.plaintext
    )
    daemon.start()
    daemon.wait_for_peers(args.n, threading.Event())
    vector = torch.randn(args.params, generator=torch.Generator().manual_seed(args.index))
    rows = []
    for step in range(args.rounds):
        time.sleep(args.gap)
        start, cpu = time.time(), time.process_time()  # wall: the peers share this machine's clock
        result = daemon.allreduce(step, vector)
        rows.append(
            {
                "start": start,
                "end": time.time(),
                "cpu": time.process_time() - cpu,  # every thread of this daemon, gossip included
                "reduce": result.stats.seconds,
                "sent": result.stats.wire_bytes,
                "received": result.stats.received_wire_bytes,
                "peers": len(result.included),
                "part_bytes": daemon.status.last_round.part_bytes or PART_BYTES,  # the leader's pick (revision 5)
            }
        )
        daemon.publish(StateSnapshot(step + 1, {}))
    Path(args.out).write_text(json.dumps(rows))
    time.sleep(2.0)  # the others may still read their last parts from us
    daemon.stop()


def run_rounds(net: SlowLinkNet, n: int, codec: str, args: argparse.Namespace, workdir: Path) -> list[list[dict]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bench.wire", "--worker", "--params", str(args.params), "--codec", codec,
           "--n", str(n), "--rounds", str(args.repeats + 1), "--gap", str(args.gap)]  # fmt: skip
    cmd += ["--plaintext"] if args.plaintext else []
    procs = []
    for i in range(n):
        argv = [*cmd, "--index", str(i), "--listen", f"{net.address(i)}:{PORT}", "--out", str(workdir / f"r{i}.json")]
        if i > 0:
            argv += ["--bootstrap", f"{net.address(0)}:{PORT}"]
        log = open(workdir / f"log{i}", "ab")  # noqa: SIM115 - closed below
        procs.append((net.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log))
        if i == 0:
            time.sleep(1.0)  # the bootstrap peer listens before the others dial it
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0) for p, _ in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    bad = [i for i, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = (workdir / f"log{bad[0]}").read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"peer {bad[0]} ({codec}, {n} peers) failed:\n" + "\n".join(tail))
    return [json.loads((workdir / f"r{i}.json").read_text()) for i in range(n)]


def raw_tcp(net: SlowLinkNet, n: int, nbytes: int, pairs: int = 1) -> float:
    """Seconds for every pair to move `nbytes` each way over one fresh TCP connection, all pairs at once. With
    `pairs=2`, over two (each side dials the other, and each connection carries half the bytes both ways); with
    `pairs=0`, over one per direction (each carries `nbytes` one way)."""
    py = [sys.executable, "-I", "-S", "-c", _RAW_PEER]
    addrs = [net.address(i) for i in range(n)]
    each = nbytes // max(pairs, 1)
    procs = [
        net.popen(i, [*py, str(i), str(n), str(each), str(RAW_PORT), str(pairs), *addrs],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(n)
    ]  # fmt: skip
    try:
        for step in ("ready", "connected"):
            for p in procs:
                line = p.stdout.readline().strip()  # type: ignore[union-attr]
                if line != step:
                    raise SlowLinkError(f"raw TCP peer said {line!r}, expected {step!r}")
            for p in procs:
                p.stdin.write("\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
        times = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["recv_s"] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(times)


def _cc_arg(value: str) -> str:
    """--cc: "host" or a congestion-control name; argparse turns the ValueError into one usage line."""
    try:
        return value if value == "host" else check_congestion(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _drops(net: SlowLinkNet, n: int) -> int:
    return sum(net.qdisc_stats(i)["drops"] for i in range(n))


def measure(n: int, rate: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with SlowLinkNet(n, rate, congestion=None if args.cc == "host" else args.cc) as net:
        for codec in args.codecs.split(","):
            trace = UplinkTrace(net, n) if args.trace else contextlib.nullcontext()
            with trace:
                row = _measure_codec(net, n, rate, codec, args)
            if isinstance(trace, UplinkTrace):
                _print_trace(trace, row, n, rate)
            row.pop("_windows"), row.pop("_raw_windows")
            rows.append(row)
    return rows


def _measure_codec(net: SlowLinkNet, n: int, rate: float, codec: str, args: argparse.Namespace) -> dict[str, Any]:
    d0 = _drops(net, n)
    with tempfile.TemporaryDirectory(prefix="peerd-bench-wire-") as tmp:
        results = run_rounds(net, n, codec, args, Path(tmp))
    d1 = _drops(net, n)
    rounds = range(1, args.repeats + 1)  # round 0 is the warm-up
    # from the last member's start (the others wait for it in rendezvous) to the last member's end
    wall = statistics.median(max(r[k]["end"] for r in results) - max(r[k]["start"] for r in results) for k in rounds)
    reduce = statistics.median(max(r[k]["reduce"] for r in results) for k in rounds)
    sent = int(statistics.median(r[k]["sent"] for r in results for k in rounds))
    per_pair = sent // (n - 1)
    kinds = (1, 0, *((2,) if args.raw_pairs else ()))  # 0: one connection per direction
    runs, raw_windows = [], []
    for _ in range(args.repeats):
        runs.append([raw_tcp(net, n, per_pair, p) for p in kinds[:1]])
        raw_windows.append((time.time() - runs[-1][0], time.time()))  # ~ from "go" to the peers' exit
        runs[-1] += [raw_tcp(net, n, per_pair, p) for p in kinds[1:]]
    raw_pair, raw_oneway = (statistics.median(r[k] for r in runs) for k in (0, 1))
    raw = min(raw_pair, raw_oneway)  # the faster layout: what plain TCP gets out of these links
    d2 = _drops(net, n)
    limit = sent * 8 / (rate * 1e6)  # this peer's uplink busy the whole time
    row = {
        "peers": n, "rate_mbit": rate, "codec": codec, "params": args.params, "sent_mb_per_peer": sent / 1e6,
        "round_s": wall, "reduce_s": reduce, "raw_tcp_s": raw, "link_limit_s": limit,
        "round_vs_raw": raw / wall, "reduce_vs_raw": raw / reduce, "round_vs_rate": limit / wall,
        "raw_vs_rate": limit / raw, "tbf_drops_per_round": (d1 - d0) / (args.repeats + 1),
        "tbf_drops_per_raw_run": (d2 - d1) / (args.repeats * len(kinds)),
    }  # fmt: skip
    row["part_kib"] = statistics.median(r[k].get("part_bytes", 0) for r in results for k in rounds) / 1024
    row["cpu_s_per_peer"] = statistics.median(r[k]["cpu"] for r in results for k in rounds)
    row["raw_tcp_pair_s"], row["raw_tcp_oneway_s"] = raw_pair, raw_oneway
    if args.raw_pairs:  # raw TCP over two connections per pair, alternating with the other layouts
        row["raw_tcp_2conn_s"] = statistics.median(r[2] for r in runs)
    # for --trace: every measured round's [start, end] and every one-connection raw run's
    row["_windows"] = [(max(r[k]["start"] for r in results), max(r[k]["end"] for r in results)) for k in rounds]
    row["_raw_windows"] = raw_windows
    print(
        f"{n:>5} {rate:>6g} {codec:>6} {sent / 1e6:>9.2f} {wall:>8.2f} {reduce:>8.2f} {raw:>7.2f} "
        f"{row['round_vs_raw']:>9.3f} {row['reduce_vs_raw']:>10.3f} {row['round_vs_rate']:>9.3f} "
        f"{row['raw_vs_rate']:>8.3f} {row['tbf_drops_per_round']:>7.0f} {row['tbf_drops_per_raw_run']:>7.0f} "
        f"{row['part_kib']:>5.0f} {row['cpu_s_per_peer']:>6.2f}",
        flush=True,
    )
    if args.raw_pairs:
        print(
            f"      raw TCP over two connections per pair: {row['raw_tcp_2conn_s']:.2f} s "
            f"(one connection per pair / two: {raw_pair / row['raw_tcp_2conn_s']:.3f})",
            flush=True,
        )
    print(
        f"      raw TCP: one connection per pair {raw_pair:.2f} s (round/raw {raw_pair / wall:.3f}), one per direction "
        f"{raw_oneway:.2f} s ({raw_oneway / wall:.3f})",
        flush=True,
    )
    return row


def _print_trace(trace: UplinkTrace, row: dict[str, Any], n: int, rate: float) -> None:
    """Each uplink's busy share per 0.5 s of every measured round and raw run (bench/uplink_trace.py; per 1/25 of
    the window, at least 40 ms, where a round is shorter than 12.5 s), and the median share over the whole round:
    where a round loses to raw TCP, this shows whether its uplinks idled, and when."""
    for what, windows in (("round", row["_windows"]), ("raw", row["_raw_windows"])):
        shares = []
        for k, (a, b) in enumerate(windows):
            for i in range(n):
                shares.append(trace.busy(i, a, b, rate))
                width = min(0.5, max(0.04, (b - a) / 25))
                print(f"      {what} {k + 1} peer {i}: |{render(trace.bins(i, a, b, rate, width))}|", flush=True)
        row[f"{what}_uplink_busy"] = statistics.median(shares)
        print(f"      {what}: uplinks busy {row[f'{what}_uplink_busy']:.1%} of the time (median)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 peers, 4M params, int8 and int4 only")
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--peers", default="2,4")
    ap.add_argument("--rates", default="20,100", help="Mbit/s per peer uplink, comma-separated")
    ap.add_argument("--codecs", default="int8,int4,fp32")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds (after one warm-up) and raw TCP runs")
    ap.add_argument("--gap", type=float, default=1.5, help="idle seconds before each round")
    ap.add_argument("--plaintext", action="store_true", help="no TLS (peerd start uses TLS)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one swarm may take")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--cc", default="host", type=_cc_arg, help="TCP congestion control in every namespace, for peerd and raw TCP "
        "alike (cubic, bbr, reno; host, the default: this machine's own; in a container only those in "
        "net.ipv4.tcp_allowed_congestion_control)"
    )  # fmt: skip
    ap.add_argument(
        "--trace", action="store_true", help="print each uplink's busy share, 0.5 s at a time (1/25 of shorter rounds)"
    )
    ap.add_argument(
        "--raw-pairs", action="store_true", help="also time raw TCP over two connections per pair (six flows per "
        "uplink at 4 peers, as peerd's rounds use), to see whether the connection count costs goodput (drops/t is "
        "then per raw run of every layout)"
    )  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--codec", default="int8", help=argparse.SUPPRESS)
    ap.add_argument("--listen", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.peers, args.params, args.codecs = "2", 4_000_000, "int8,int4"
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    ok, reason = available()
    if not ok:
        print(f"bench.wire needs network namespaces: {reason}", file=sys.stderr)
        return 2
    links = "plaintext" if args.plaintext else "TLS"
    cc = f"{host_congestion() or 'default'} (the host's)" if args.cc == "host" else args.cc
    print(
        f"DiLoCo round of {args.params / 1e6:g}M fp32 values on tbf-shaped uplinks, {links}, TCP {cc}, medians of "
        f"{args.repeats}; raw TCP = the faster of one connection per pair (both ways at once) and one per direction, "
        "moving the same bytes"
    )
    print(f"{'peers':>5} {'Mbit/s':>6} {'codec':>6} {'MB/peer':>9} {'round s':>8} {'reduce s':>8} {'raw s':>7} "
          f"{'round/raw':>9} {'reduce/raw':>10} {'round/lim':>9} {'raw/lim':>8} {'drops/r':>7} "
          f"{'drops/t':>7} {'part':>5} {'CPU s':>6}")  # fmt: skip
    rows = []
    try:
        for n in (int(x) for x in args.peers.split(",")):
            for rate in (float(x) for x in args.rates.split(",")):
                rows += measure(n, rate, args)
    except SlowLinkError as exc:  # a net that cannot be built as asked (an unknown --cc, a missing tool): one line
        print(f"bench.wire: {exc}", file=sys.stderr)
        return 2
    print("round/raw: raw-TCP seconds over round seconds (goodput as a fraction of raw TCP's); lim: the uplink's")
    print("time for the bytes at the shaped rate (TCP/IP headers alone cap raw/lim at ~0.956); drops: tbf drops on all")
    print("uplinks per round (r) and per raw-TCP run (t); part: the rounds' part size in KiB (the leader's pick);")
    print("CPU s: CPU seconds per round of one daemon process (median over peers and rounds). The peers share this")
    print("machine's cores: a round whose peers x CPU s nears cores x round s is CPU-bound, not wire-bound")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
