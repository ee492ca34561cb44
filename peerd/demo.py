"""`peerd demo`: a real local swarm. Starts N `peerd start` processes on 127.0.0.1 that find each other through the
first one's address, trains the built-in model for a few outer steps, prints progress, and summarises the result.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from peerd.config import RunConfig
from trainer.checkpoint import load_checkpoint

DEMO_NETWORK = {
    "gossip_interval": 0.5,
    "peer_timeout": 5.0,
    "rendezvous_timeout": 15.0,
    "round_timeout": 60.0,
    "match_timeout": 5.0,
}


def demo_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run spec the demo peers share: tiny model, short timeouts, the chosen algorithm and codec."""
    raw: dict[str, Any] = {
        "run": {"name": "peerd-demo", "algorithm": args.algorithm, "outer_steps": args.outer_steps},
        "model": {"preset": args.preset},
        "inner": {"steps": args.inner_steps, "warmup_steps": min(20, args.inner_steps)},
        "codec": {"name": args.codec},
        "network": dict(DEMO_NETWORK),
    }
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = _parse_value(value)
    RunConfig.from_dict(raw)  # validate before starting anything
    return raw


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text in ("true", "false"):
        return text == "true"
    return text


def to_toml(raw: dict[str, Any]) -> str:
    lines = []
    for section, values in raw.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited with code {proc.returncode} before serving; see {path.parent / 'log'}")
        time.sleep(0.1)
    raise TimeoutError(f"{path} did not appear within {timeout:.0f}s")


def start_peer(
    workdir: Path, index: int, config: Path, bootstrap: str | None, wait_peers: int, extra: list[str] | None = None
) -> subprocess.Popen:
    data = workdir / f"peer{index}"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "peerd", "start", "--config", str(config), "--listen", "127.0.0.1:0",
        "--data-dir", str(data), "--shard", str(index), "--threads", "1", "--insecure",
        "--wait-peers", str(wait_peers), *(extra or []),
    ]  # fmt: skip
    if bootstrap:
        cmd += ["--bootstrap", bootstrap]
    log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def global_params(data_dir: Path) -> dict[str, torch.Tensor] | None:
    state = load_checkpoint(data_dir / "checkpoint.pt")
    return None if state is None else state["global"]


def max_param_diff(dirs: list[Path]) -> tuple[float, float]:
    """Largest absolute difference between any two peers' global params, and the largest pairwise L2 distance
    divided by the params' norm (NoLoCo's spread)."""
    params = [g["params"] for g in (global_params(d) for d in dirs) if g is not None]
    diff, spread = 0.0, 0.0
    for a, b in itertools.combinations(params, 2):
        diff = max(diff, float((a - b).abs().max()))
        spread = max(spread, float((a - b).norm() / ((a.norm() + b.norm()) / 2)))
    return diff, spread


def run_demo(args: argparse.Namespace) -> int:
    raw = demo_config(args)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(to_toml(raw))
    print(
        f"peerd demo: {args.peers} peers, {args.algorithm}, codec {args.codec}, {args.outer_steps} outer steps "
        f"of {args.inner_steps} inner steps; data in {workdir}",
        flush=True,
    )
    procs: list[subprocess.Popen] = []
    t_start = time.monotonic()
    try:
        procs.append(start_peer(workdir, 0, config, None, args.peers))
        first = _wait_file(workdir / "peer0" / "address", procs[0], 120)
        print(f"peer 0 serving on {first}; starting {args.peers - 1} more that bootstrap from it", flush=True)
        for i in range(1, args.peers):
            procs.append(start_peer(workdir, i, config, first, args.peers))
        addresses = [first] + [
            _wait_file(workdir / f"peer{i}" / "address", procs[i], 120) for i in range(1, args.peers)
        ]
        _follow(procs, addresses, args)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    dirs = [workdir / f"peer{i}" for i in range(args.peers)]
    summaries = [_read_json(d / "summary.json") for d in dirs]
    if failed or any(s is None for s in summaries):
        for i in failed:
            tail = (dirs[i] / "log").read_text(errors="replace").splitlines()[-15:]
            print(f"peer {i} failed (exit {procs[i].returncode}):\n  " + "\n  ".join(tail), file=sys.stderr)
        return 1
    diff, spread = max_param_diff(dirs)
    hist = summaries[0]["history"]
    total_compute = sum(s["compute_seconds"] for s in summaries)
    total_idle = sum(s["compute_idle_seconds"] for s in summaries)
    result = {
        "peers": args.peers,
        "algorithm": args.algorithm,
        "codec": args.codec,
        "outer_steps": min(s["outer_step"] for s in summaries),
        "loss_first": hist[0]["loss"] if hist else None,
        "loss_last": hist[-1]["loss"] if hist else None,
        "eval_loss_first": hist[0]["eval_loss"] if hist else None,
        "eval_loss_last": hist[-1]["eval_loss"] if hist else None,
        "bytes_sent_total": sum(s["bytes_sent_raw"] for s in summaries),
        "wire_bytes_total": sum(s["bytes_sent_wire"] for s in summaries),
        "max_param_diff": diff,
        "spread": spread,
        "partial_rounds": sum(s["rounds_partial"] for s in summaries),
        "failed_rounds": sum(s["rounds_failed"] for s in summaries),
        "solo_steps": sum(s["solo_steps"] for s in summaries),
        "compute_idle_fraction": total_idle / (total_compute + total_idle) if total_compute + total_idle else 0.0,
        "seconds": round(time.monotonic() - t_start, 1),
        "workdir": str(workdir),
    }
    print(
        f"done in {result['seconds']}s: loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}, "
        f"eval {result['eval_loss_first']:.4f} -> {result['eval_loss_last']:.4f}; "
        f"{result['bytes_sent_total'] / 1e6:.2f} MB sent ({result['wire_bytes_total'] / 1e6:.2f} MB on the wire); "
        f"max param diff between peers {diff:.3g}; {result['partial_rounds']} partial rounds",
        flush=True,
    )
    if args.json:
        print(
            json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()})
        )
    return 0


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _follow(procs: list[subprocess.Popen], addresses: list[str], args: argparse.Namespace) -> None:
    """Poll every peer's Status until all have exited; print a line per completed outer step."""
    from peerd.progress import Progress
    from peerd.status import fetch_status

    progress = Progress(stream=sys.stdout, total_steps=args.outer_steps)
    shown = 0
    deadline = time.monotonic() + args.timeout
    last: dict[int, Any] = {}
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo did not finish within {args.timeout:.0f}s")
        for i, addr in enumerate(addresses):
            if procs[i].poll() is None:
                with contextlib.suppress(Exception):  # a peer busy or shutting down: poll again
                    last[i] = fetch_status(addr, timeout=2)
        steps = [st.outer_step for st in last.values()]
        done = min(steps) if len(steps) == len(procs) else 0
        while shown < done:
            shown += 1
            st = last[0]
            r = st.last_round
            peers = f"{len(r.included)}/{len(r.expected)}" if r.included else "-"
            sent = sum(s.bytes_sent_raw for s in last.values()) / 1e6
            wire = sum(s.bytes_sent_wire for s in last.values()) / 1e6
            progress.log(
                f"outer step {shown:>3} | loss {st.loss:.4f} | {sum(s.tokens_per_second for s in last.values()):7.0f}"
                f" tok/s | peers in round {peers} | sent {sent:.2f} MB (wire {wire:.2f} MB) | round {r.seconds:.2f}s"
            )
        if last:
            st = last[0]
            progress.update(
                step=st.outer_step,
                loss=st.loss,
                peers=len(st.alive),
                bytes=sum(s.bytes_sent_wire for s in last.values()),
            )
        time.sleep(0.3)
    progress.close()
