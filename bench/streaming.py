"""Slow-link benchmark: does Streaming DiLoCo keep compute busy where blocking DiLoCo cannot?

Three peers (`peerd start` processes) each run in a network namespace of `bench.slowlink`, whose egress is
shaped with tbf to the given rate, and train the same model three ways:

* ``diloco-fp32``: DiLoCo, full fp32 pseudo-gradients, the trainer blocks on every sync;
* ``diloco-e3m0``: DiLoCo with 4-bit (E3M0) pseudo-gradients, still blocking;
* ``streaming-e3m0``: Streaming DiLoCo, 4-bit, one fragment at a time, overlapped with tau inner steps.

For each it reports: wall time per outer step (from the peers' own log timestamps); the fraction of time the
trainer was blocked on the network (compute_idle / (compute + idle), from each peer's summary.json); peak
bytes in flight per peer (the largest burst of bytes a peer's interface sent, sampled at 50 Hz inside its
namespace, and the largest single round's wire bytes from the round stats); link goodput during syncs (round
payload bytes over the time the peer's link was busy, as a fraction of the shaped rate; TCP/IP headers cap it
near 95.6 %); and the final train and eval losses (same data, seeds and steps in every variant).

Needs root for the namespaces; without it, it prints why and exits 0. Default sizes fit in ~15 minutes on a
2-core machine: ``sudo python -m bench.streaming`` (``--help`` for the knobs, ``--json`` for a JSON line).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.slowlink import SlowLinkError, SlowLinkNet, available
from peerd.config import RunConfig
from peerd.demo import to_toml

REPO = Path(__file__).resolve().parent.parent
PORT = 7000
VARIANTS: dict[str, dict[str, Any]] = {
    "diloco-fp32": {"algorithm": "diloco", "codec": "fp32"},
    "diloco-e3m0": {"algorithm": "diloco", "codec": "e3m0"},
    "streaming-e3m0": {"algorithm": "streaming", "codec": "e3m0"},
}
SAMPLE_HZ = 50.0
BUSY_FRACTION = 0.05  # an interval in which a peer sent at >= 5 % of the shaped rate counts as "link busy"
SENDING_FRACTION = 0.5  # ... and at >= 50 %, "a sync in full flow"
BURST_GAP_S = 0.5  # busy intervals closer than this belong to one burst (one round's sending)
_OUTER_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ peerd: outer step (\d+) \|")

# Runs inside a host's namespace: /proc/net/dev shows that namespace's interfaces. One "time tx_bytes" line
# per sample on stdout until killed; reading a small proc file 50 times a second costs next to nothing.
_SAMPLER = r"""
import sys, time
period = 1.0 / float(sys.argv[1])
out = sys.stdout
while True:
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                out.write(f"{time.time():.4f} {rest.split()[8]}\n")
                out.flush()
                break
    time.sleep(period)
"""


class BenchError(RuntimeError):
    """A run did not complete (a peer failed or timed out)."""


def run_config(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """The run spec the peers of one variant share (same model, data, seeds and steps in every variant)."""
    v = VARIANTS[variant]
    raw: dict[str, Any] = {
        "run": {"name": "bench-streaming", "algorithm": v["algorithm"], "outer_steps": args.outer_steps},
        "model": {"preset": args.preset, "seq_len": args.seq_len},
        "data": {"batch_size": args.batch_size, "eval_batches": 4},
        "inner": {"steps": args.inner_steps, "warmup_steps": min(10, args.inner_steps), "lr": 1e-3},
        "streaming": {"fragments": args.fragments, "tau": args.tau, "alpha": 0.5, "late_policy": "wait"},
        "codec": {"name": v["codec"]},
        "network": {
            "gossip_interval": 0.5,
            "peer_timeout": 15.0,
            "rendezvous_timeout": 60.0,
            "round_timeout": 300.0,
        },
        "checkpoint": {"every": 0},  # only the final one: multi-100 MB writes would blur the timings
    }
    RunConfig.from_dict(raw)  # refuse a bad combination before building any namespace
    return raw


def _parse_samples(path: Path) -> list[tuple[float, int]]:
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out.append((float(parts[0]), int(parts[1])))
    return out


def busy_stats(samples: list[tuple[float, int]], rate_mbit: float) -> dict[str, float]:
    """What a peer's interface sent, from its (time, tx bytes) samples.

    ``busy_*``: intervals in which it sent at >= 5 % of the shaped rate (any sending at all, ramp-ups and
    gossip included); ``sending_*``: intervals at >= 50 % (a sync in full flow); ``peak_burst_bytes``: the
    most bytes sent in one burst of busy intervals less than 0.5 s apart (one round's sending).
    """
    rate_bps = rate_mbit * 1e6 / 8
    out = dict.fromkeys(("busy_seconds", "busy_bytes", "sending_seconds", "sending_bytes"), 0.0)
    bursts: list[float] = []
    last_busy_end = -math.inf
    for (t0, b0), (t1, b1) in itertools.pairwise(samples):
        dt, db = t1 - t0, b1 - b0
        if dt <= 0 or db < BUSY_FRACTION * rate_bps * dt:
            continue
        out["busy_seconds"] += dt
        out["busy_bytes"] += db
        if db >= SENDING_FRACTION * rate_bps * dt:
            out["sending_seconds"] += dt
            out["sending_bytes"] += db
        if t0 - last_busy_end > BURST_GAP_S or not bursts:
            bursts.append(0.0)
        bursts[-1] += db
        last_busy_end = t1
    out["peak_burst_bytes"] = max(bursts, default=0.0)
    out["tx_bytes"] = float(samples[-1][1] - samples[0][1]) if len(samples) > 1 else 0.0
    return out


def outer_step_times(log_text: str) -> list[tuple[int, float]]:
    out = []
    for line in log_text.splitlines():
        m = _OUTER_LINE.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((int(m.group(2)), t))
    return out


def seconds_per_outer_step(log_text: str) -> float:
    """Steady-state wall time per outer step: first logged outer step to the last (start-up excluded)."""
    steps = outer_step_times(log_text)
    if len(steps) < 2 or steps[-1][0] == steps[0][0]:
        return math.nan
    return (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])


def _mean(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def run_variant(args: argparse.Namespace, rate: float, variant: str, workdir: Path) -> dict[str, Any]:
    """Start the peers in a fresh slow-link net, wait for them to finish, and measure."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(to_toml(run_config(args, variant)))
    n = args.peers
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("PEERD_FAULT_EXCHANGE_DELAY_S", None)
    t_start = time.monotonic()
    with SlowLinkNet(n, rate) as net:
        samplers, procs, logs = [], [], []
        try:
            for i in range(n):
                out = open(workdir / f"tx{i}.txt", "w")  # noqa: SIM115 - the sampler owns it until killed
                logs.append(out)
                sampler = [sys.executable, "-I", "-S", "-c", _SAMPLER, str(SAMPLE_HZ)]
                samplers.append(net.popen(i, sampler, stdout=out))
            boot = f"{net.address(0)}:{PORT}"
            for i in range(n):
                data = workdir / f"peer{i}"
                data.mkdir(exist_ok=True)
                argv = [
                    sys.executable, "-m", "peerd", "start", "--config", str(config),
                    "--listen", f"{net.address(i)}:{PORT}", "--data-dir", str(data), "--shard", str(i),
                    "--threads", "1", "--insecure", "--wait-peers", str(n),
                ]  # fmt: skip
                if i > 0:
                    argv += ["--bootstrap", boot]
                log = open(data / "log", "ab")  # noqa: SIM115 - the peer owns it for its lifetime
                logs.append(log)
                procs.append(net.popen(i, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # one failed: the others would wait for it until their timeouts
                if time.monotonic() > deadline:
                    what = f"{variant} at {rate:g} Mbit/s"
                    raise BenchError(f"{what} did not finish within {args.timeout:.0f}s")
                time.sleep(0.5)
        finally:
            for s in samplers:
                s.kill()
                s.wait()
            for fh in logs:
                fh.close()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (workdir / f"peer{failed[0]}" / "log").read_text(errors="replace").splitlines()[-15:]
        raise BenchError(f"{variant} at {rate:g} Mbit/s: peer {failed[0]} failed:\n" + "\n".join(tail))
    return analyse(workdir, n, rate, variant, time.monotonic() - t_start)


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def analyse(workdir: Path, n: int, rate: float, variant: str, seconds: float) -> dict[str, Any]:
    """Per-peer figures, averaged over peers (peaks: the largest peer's; idle: also min and max)."""
    rate_bps = rate * 1e6 / 8
    peers = []
    for i in range(n):
        data = workdir / f"peer{i}"
        summary = json.loads((data / "summary.json").read_text())
        busy = busy_stats(_parse_samples(workdir / f"tx{i}.txt"), rate)
        wire = summary["bytes_sent_wire"]  # round payload bytes this peer sent (successful rounds)
        rounds = len(summary["round_seconds"])
        largest_round = _ratio(wire, rounds)  # DiLoCo rounds all move the same number of values
        stream_file = data / "streaming.json"
        stream_lost = 0
        if stream_file.exists():
            stream = json.loads(stream_file.read_text())
            largest_round = max((r["wire_bytes"] for r in stream["syncs"]), default=0)
            stream_lost = stream["rounds_failed"] + stream["rounds_behind"]
        total = summary["compute_seconds"] + summary["compute_idle_seconds"]
        hist = summary["history"]
        # payload share of what the interface sent (the rest: TCP/IP and HTTP/2 headers, acks, gossip), times
        # how fast the interface sent while a sync was in full flow
        payload_share = min(_ratio(wire, busy["tx_bytes"]), 1.0)
        sending_rate = _ratio(busy["sending_bytes"], busy["sending_seconds"])
        peers.append(
            {
                "seconds_per_outer_step": seconds_per_outer_step((data / "log").read_text(errors="replace")),
                "idle_fraction": _ratio(summary["compute_idle_seconds"], total),
                "compute_seconds": summary["compute_seconds"],
                "peak_burst_bytes": busy["peak_burst_bytes"],
                "largest_round_wire_bytes": largest_round,
                "goodput_fraction": payload_share * sending_rate / rate_bps,
                "goodput_fraction_any_sending": _ratio(wire, busy["busy_seconds"]) / rate_bps,
                "link_fraction_while_sending": sending_rate / rate_bps,
                "payload_share_of_tx": payload_share,
                "wire_bytes_sent": wire,
                "failed_attempts": summary["rounds_failed"],  # round attempts the daemon had to retry
                "partial_rounds": summary["rounds_partial"],
                "rounds_lost": stream_lost,  # streaming rounds never applied (failed or left out)
                "loss": hist[-1]["loss"] if hist else math.nan,
                "eval_loss": hist[-1]["eval_loss"] if hist else math.nan,
                "outer_steps": summary["outer_step"],
            }
        )
    out: dict[str, Any] = {"variant": variant, "rate_mbit": rate, "run_seconds": round(seconds, 1)}
    for k in peers[0]:
        out[k] = _mean([p[k] for p in peers])
    out["peak_burst_bytes"] = max(p["peak_burst_bytes"] for p in peers)
    out["largest_round_wire_bytes"] = max(p["largest_round_wire_bytes"] for p in peers)
    out["idle_fraction_min"] = min(p["idle_fraction"] for p in peers)
    out["idle_fraction_max"] = max(p["idle_fraction"] for p in peers)
    out["compute_seconds_spread"] = _ratio(
        max(p["compute_seconds"] for p in peers), min(p["compute_seconds"] for p in peers)
    )
    out["workdir"] = str(workdir)
    return out


def print_table(results: list[dict[str, Any]]) -> None:
    """s/outer: wall seconds per outer step; compute: seconds of inner steps per outer step (it varies with
    whatever else the machine runs, so compare idle fractions across runs rather than wall times)."""
    print(
        f"{'Mbit/s':>6} {'variant':<15} {'s/outer':>8} {'compute':>8} {'idle':>6} {'(min-max)':>13} "
        f"{'peak MB':>8} {'round MB':>8} {'goodput':>8} {'(any)':>6} {'loss':>7} {'eval':>7} {'retried':>7} "
        f"{'partial':>7}"
    )
    for r in results:
        span = f"{r['idle_fraction_min']:.1%}-{r['idle_fraction_max']:.1%}"
        print(
            f"{r['rate_mbit']:>6g} {r['variant']:<15} {r['seconds_per_outer_step']:>8.2f} "
            f"{r['compute_seconds'] / max(r['outer_steps'], 1):>8.2f} "
            f"{r['idle_fraction']:>6.1%} {span:>13} {r['peak_burst_bytes'] / 1e6:>8.2f} "
            f"{r['largest_round_wire_bytes'] / 1e6:>8.2f} {r['goodput_fraction']:>8.1%} "
            f"{r['goodput_fraction_any_sending']:>6.1%} {r['loss']:>7.4f} {r['eval_loss']:>7.4f} "
            f"{r['failed_attempts']:>7.1f} {r['partial_rounds']:>7.1f}"
        )


def check_goals(results: list[dict[str, Any]]) -> list[str]:
    """The team's targets, each with the measured figure and PASS/MISS (reported honestly, never asserted)."""
    lines = []
    by = {(r["rate_mbit"], r["variant"]): r for r in results}
    for rate in sorted({r["rate_mbit"] for r in results}, reverse=True):
        fp32, e3m0, stream = (by.get((rate, v)) for v in VARIANTS)
        if stream is not None:
            idle = stream["idle_fraction"]
            span = f"peers {stream['idle_fraction_min']:.1%}-{stream['idle_fraction_max']:.1%}"
            verdict = _ok(idle <= 0.05)
            lines.append(f"{rate:g} Mbit/s: streaming idle {idle:.1%} ({span}; goal <= 5%): {verdict}")
        if fp32 is not None:
            idle = fp32["idle_fraction"]
            verdict = _ok(idle >= 0.5)
            lines.append(f"{rate:g} Mbit/s: blocking fp32 DiLoCo idle {idle:.1%} (goal >= 50%): {verdict}")
        for ref in (fp32, e3m0):
            if stream is not None and ref is not None:
                rel = stream["eval_loss"] / ref["eval_loss"] - 1.0
                caveat = ""
                if ref["failed_attempts"] or ref["partial_rounds"]:
                    caveat = " [reference run had retried/partial rounds: not a clean comparison]"
                lines.append(
                    f"{rate:g} Mbit/s: streaming eval loss {stream['eval_loss']:.4f} vs {ref['variant']} "
                    f"{ref['eval_loss']:.4f} ({rel:+.2%}; goal within 1%): {_ok(abs(rel) <= 0.01)}{caveat}"
                )
        for r in (fp32, e3m0, stream):
            if r is not None:
                g = r["goodput_fraction"]
                name = r["variant"]
                verdict = _ok(g >= 0.85)
                lines.append(f"{rate:g} Mbit/s: {name} goodput during syncs {g:.1%} (goal >= 85%): {verdict}")
    return lines


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _ok(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 20.0], help="egress Mbit/s per peer")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--preset", default="small", help="model preset (small: ~11M params, 44 MB in fp32)")
    p.add_argument("--seq-len", type=int, default=32, help="short sequences keep inner steps cheap on CPU")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--outer-steps", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=30, help="H")
    p.add_argument("--fragments", type=int, default=3, help="Streaming DiLoCo fragments P")
    p.add_argument("--tau", type=int, default=10, help="inner steps a fragment's exchange overlaps")
    p.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    p.add_argument("--workdir", help="keep the peers' data and logs here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="end with one JSON line holding every figure")
    p.add_argument("--analyse", metavar="DIR", help="only re-analyse the runs a previous --workdir DIR holds")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.analyse:
        return report(analyse_existing(args, Path(args.analyse)), args.json)
    ok, reason = available()
    if not ok:
        print(f"bench.streaming: slow-link net unavailable ({reason}); nothing measured", file=sys.stderr)
        return 0
    for v in args.variants:
        run_config(args, v)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="peerd-bench-streaming-"))
    print(
        f"bench.streaming: {args.peers} peers, preset {args.preset} (seq {args.seq_len}, batch "
        f"{args.batch_size}), {args.outer_steps} outer x {args.inner_steps} inner steps, streaming "
        f"P={args.fragments} tau={args.tau}; data in {workdir}",
        flush=True,
    )
    results = []
    try:
        for rate in args.rates:
            for variant in args.variants:
                t0 = time.monotonic()
                res = run_variant(args, rate, variant, workdir / f"{rate:g}mbit-{variant}")
                results.append(res)
                print(
                    f"  {variant} at {rate:g} Mbit/s: {time.monotonic() - t0:.0f}s, idle "
                    f"{res['idle_fraction']:.1%}, {res['seconds_per_outer_step']:.2f} s/outer step, "
                    f"eval {res['eval_loss']:.4f}, retried/lost rounds per peer "
                    f"{res['failed_attempts']:.1f}/{res['rounds_lost']:.1f}",
                    flush=True,
                )
    except (BenchError, SlowLinkError) as exc:
        print(f"bench.streaming: {exc}", file=sys.stderr)
        return 1
    return report(results, args.json)


def analyse_existing(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    results = []
    for rate in args.rates:
        for variant in args.variants:
            run = workdir / f"{rate:g}mbit-{variant}"
            if (run / "peer0" / "summary.json").exists():
                results.append(analyse(run, args.peers, rate, variant, math.nan))
    return results


def report(results: list[dict[str, Any]], as_json: bool) -> int:
    print()
    print_table(results)
    print()
    for line in check_goals(results):
        print(line)
    if as_json:
        clean = [{k: _json_safe(v) for k, v in r.items()} for r in results]
        print(json.dumps({"results": clean}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
