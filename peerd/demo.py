"""`peerd demo`: a real local swarm. Starts N `peerd start` processes on 127.0.0.1 that find each other through the
first one's address, trains the built-in model for a few outer steps, prints progress, and summarises the result.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from peerd.config import RunConfig, apply_codec_recipe
from trainer.checkpoint import load_checkpoint

DEMO_NETWORK = {
    "gossip_interval": 0.5,
    "peer_timeout": 5.0,
    "rendezvous_timeout": 15.0,
    "round_timeout": 60.0,
    "match_timeout": 5.0,
}


def demo_config(args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """The run spec the demo peers share: tiny model, short timeouts, the chosen algorithm and codec. `tag` makes the
    demo a run of its own (its own run id): two demos on one host, whose peers take ports the other's finished peers
    freed, must never meet (a re-dialled bootstrap address would join the other)."""
    raw: dict[str, Any] = {
        "run": {
            "name": f"peerd-demo-{tag}",
            "algorithm": args.algorithm,
            "outer_steps": args.outer_steps,
        },
        "model": {"preset": args.preset},
        "inner": {"steps": args.inner_steps, "warmup_steps": min(20, args.inner_steps)},
        "codec": {"name": args.codec},
        "network": dict(DEMO_NETWORK),
    }
    apply_codec_recipe(raw, args.algorithm)  # sparse: error feedback (the config refuses it without) and its recipe
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
        "--data-dir", str(data), "--shard", str(index), "--threads", "1",
        "--wait-peers", str(wait_peers), *(extra or []),
    ]  # fmt: skip
    if bootstrap:
        cmd += ["--bootstrap", bootstrap]
    log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM every peer still running (they checkpoint and leave), then SIGKILL any that outlive the grace."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()


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


def demo_tag(workdir: str | None) -> str:
    """The demo's run tag: a --workdir names the same run each time (a rerun there resumes its checkpoints), and any
    other demo is a run of its own."""
    if workdir:
        return hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:8]
    return secrets.token_hex(4)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo swarm. A temporary work dir is removed at the end unless --keep (or --workdir) is given."""
    if args.peers < 1:
        from peerd.errors import UserError

        raise UserError(f"--peers {args.peers}: need at least 1 peer")
    raw = demo_config(args, demo_tag(args.workdir))
    init_from = getattr(args, "init_from", None)
    if init_from and not Path(init_from).is_file():
        from peerd.errors import UserError

        raise UserError(f"--init-from {init_from}: no such file (give a peerd checkpoint.pt or a .safetensors file)")
    keep = bool(args.workdir or getattr(args, "keep", False))
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        return _run(args, raw, workdir, keep)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(args: argparse.Namespace, raw: dict[str, Any], workdir: Path, keep: bool) -> int:
    config = workdir / "run.toml"
    config.write_text(to_toml(raw))
    where = f"data in {workdir}" + ("" if keep else " (removed at the end; --keep keeps it)")
    print(
        f"peerd demo: {args.peers} peers, {args.algorithm}, codec {args.codec}, {args.outer_steps} outer steps "
        f"of {args.inner_steps} inner steps; {where}",
        flush=True,
    )
    procs: list[subprocess.Popen] = []
    t_start = time.monotonic()
    init_from = getattr(args, "init_from", None)
    extra = ["--init-from", str(Path(init_from).resolve())] if init_from else []
    procs_per_peer = getattr(args, "procs_per_peer", 1) or 1
    if procs_per_peer > 1:  # every peer runs as that many local ranks (gloo on CPU)
        extra += ["--procs-per-peer", str(procs_per_peer)]
    try:
        procs.append(start_peer(workdir, 0, config, None, args.peers, extra))
        first = _wait_file(workdir / "peer0" / "address", procs[0], 120)
        print(f"peer 0 serving on {first}; starting {args.peers - 1} more that bootstrap from it", flush=True)
        for i in range(1, args.peers):
            procs.append(start_peer(workdir, i, config, first, args.peers, extra))
        addresses = [first] + [
            _wait_file(workdir / f"peer{i}" / "address", procs[i], 120) for i in range(1, args.peers)
        ]
        _follow(procs, addresses, args, [workdir / f"peer{i}" for i in range(args.peers)])
    finally:
        stop_processes(procs)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    dirs = [workdir / f"peer{i}" for i in range(args.peers)]
    summaries = [_read_json(d / "summary.json") for d in dirs]
    if failed or any(s is None for s in summaries):
        for i in failed:
            tail = (dirs[i] / "log").read_text(errors="replace").splitlines()[-15:]
            print(f"peer {i} failed (exit {procs[i].returncode}):\n  " + "\n  ".join(tail), file=sys.stderr)
        if args.json:
            print(json.dumps({"peers": args.peers, "algorithm": args.algorithm, "ok": False, "failed_peers": failed}))
        return 1
    diff, spread = max_param_diff(dirs)

    def mean_at(index: int, key: str) -> float | None:
        vals = [s["history"][index][key] for s in summaries if s["history"]]
        return sum(vals) / len(vals) if vals else None

    total_compute = sum(s["compute_seconds"] for s in summaries)
    total_idle = sum(s["compute_idle_seconds"] for s in summaries)
    result = {
        "peers": args.peers,
        "algorithm": args.algorithm,
        "codec": args.codec,
        "outer_steps": min(s["outer_step"] for s in summaries),
        "loss_first": mean_at(0, "loss"),
        "loss_last": mean_at(-1, "loss"),
        "eval_loss_first": mean_at(0, "eval_loss"),
        "eval_loss_last": mean_at(-1, "eval_loss"),
        "bytes_sent_total": sum(s["bytes_sent_raw"] for s in summaries),
        "wire_bytes_total": sum(s["bytes_sent_wire"] for s in summaries),
        "max_param_diff": diff,
        "spread": spread,
        "partial_rounds": sum(s["rounds_partial"] for s in summaries),
        "failed_rounds": sum(s["rounds_failed"] for s in summaries),
        "solo_steps": sum(s["solo_steps"] for s in summaries),
        "steps_sat_out": sum(s["steps_sat_out"] for s in summaries),
        "compute_idle_fraction": total_idle / (total_compute + total_idle) if total_compute + total_idle else 0.0,
        "seconds": round(time.monotonic() - t_start, 1),
        "workdir": str(workdir) if keep else None,
        "ok": True,
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


class _Printer:
    """Prints one line per outer step, in order, from whichever source has it first: live Status polls while the
    peers run, their summary.json files once they have exited."""

    def __init__(self, n: int, total: int) -> None:
        from peerd.progress import Progress

        self.n = n
        self.shown = 0
        self.progress = Progress(stream=sys.stdout, total_steps=total)
        self.steps: dict[int, dict[int, dict]] = {}  # step -> peer -> record
        self.rounds: dict[int, dict] = {}  # step -> round summary (any peer)
        self.sent: dict[int, int] = {}
        self.wire: dict[int, int] = {}
        # peer -> (outer step, fragment) -> (raw, wire) bytes that peer sent in that round: a step's line sums the
        # rounds up to it, where the live counters may already hold the next round's bytes (polls are 0.3 s apart)
        self.round_bytes: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}

    def add(self, peer: int, records: list[dict], rounds: list[dict], sent: int, wire: int) -> None:
        for r in records:
            self.steps.setdefault(int(r["outer_step"]), {})[peer] = r
        for r in rounds:
            self.rounds.setdefault(int(r["step"]) + 1, r)
            key = (int(r["step"]) + 1, int(r.get("fragment", -1)))
            self.round_bytes.setdefault(peer, {})[key] = (int(r.get("raw_bytes", 0)), int(r.get("wire_bytes", 0)))
        self.sent[peer], self.wire[peer] = sent, wire

    def sent_by(self, step: int) -> tuple[int, int]:
        """(raw, wire) bytes every peer sent in the rounds up to outer step `step`; the live counters where no peer
        reported its rounds' bytes."""
        raw = wire = 0
        for rounds in self.round_bytes.values():
            for (s, _), (r, w) in rounds.items():
                if s <= step:
                    raw, wire = raw + r, wire + w
        if not raw and not wire:
            return sum(self.sent.values()), sum(self.wire.values())
        return raw, wire

    def flush(self, final: bool = False) -> None:
        while self.shown + 1 in self.steps and (final or len(self.steps[self.shown + 1]) == self.n):
            self.shown += 1
            recs = list(self.steps[self.shown].values())
            loss = sum(r["loss"] for r in recs) / len(recs)
            tps = sum(r.get("tokens_per_second", 0.0) for r in recs)
            rnd = self.rounds.get(self.shown)
            peers = f"{len(rnd['included'])}/{len(rnd['expected'])}" if rnd else "-"
            secs = f"{rnd['seconds']:.2f}s" if rnd else "-"
            raw, wire = self.sent_by(self.shown)
            self.progress.log(
                f"outer step {self.shown:>3} | loss {loss:.4f} | {tps:7.0f} tok/s | peers in round {peers} | "
                f"sent {raw / 1e6:.2f} MB (wire {wire / 1e6:.2f} MB) | round {secs}"
            )


def _follow(procs: list[subprocess.Popen], addresses: list[str], args: argparse.Namespace, dirs: list[Path]) -> None:
    """Poll every peer's Status until all have exited, printing a line per completed outer step."""
    from google.protobuf.json_format import MessageToDict

    from peerd.status import fetch_status

    printer = _Printer(len(procs), args.outer_steps)
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo did not finish within {args.timeout:.0f}s")
        for i, addr in enumerate(addresses):
            if procs[i].poll() is not None:
                continue
            with contextlib.suppress(Exception):  # a peer busy or shutting down: poll again
                st = fetch_status(addr, timeout=2)
                printer.add(
                    i,
                    [MessageToDict(h, preserving_proto_field_name=True) for h in st.history],
                    [
                        MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                        for r in st.recent_rounds
                    ],
                    st.bytes_sent_raw,
                    st.bytes_sent_wire,
                )
                printer.progress.update(
                    step=st.outer_step, loss=st.loss, peers=len(st.alive), sent=sum(printer.wire.values())
                )
        printer.flush()
        time.sleep(0.3)
    for i, d in enumerate(dirs):
        s = _read_json(d / "summary.json")
        if s is not None:
            printer.add(i, s["history"], s["rounds"], s["bytes_sent_raw"], s["bytes_sent_wire"])
    printer.flush(final=True)
    printer.progress.close()
