"""Convergence benchmark: the same token budget under each outer algorithm, on real swarms of `peerd start` processes.

    python -m bench.convergence [--algorithms ddp,diloco,noloco] [--peers 4] [--budget-tokens N] [--codec fp32]
                                [--scaling 2,4,8] [--send-ahead-mbit 20] [--repeats 1] [--first-seed 0] [--parts ...]
                                [--json]

Three parts, each made of swarms of N peers on 127.0.0.1 (one process each, ``--threads 1``), training the built-in
byte-level GPT on the default data (the Python standard library's sources, held-out tail for evaluation):

1. Convergence. Each algorithm trains for the same token budget (tokens summed over peers). ``ddp`` is the every-step
   gradient all-reduce baseline (data-parallel equivalent), ``diloco`` and ``noloco`` sync every ``--inner-steps``.
   After the run the final global weights (DiLoCo, ddp: identical on every peer) or each peer's slow weights (NoLoCo)
   are evaluated on ``--eval-batches`` held-out batches; for NoLoCo we report the mean of the peers' eval losses and
   the eval loss of the peers' averaged slow weights. Also: bytes each peer sent, wall time, compute-idle fraction,
   and the spread of the peers' weights.
2. Scaling. NoLoCo and DiLoCo with 2, 4 and 8 peers for a few outer steps: bytes sent per peer per outer step, and
   the median round time (a round: from reaching the outer step boundary to having the group's average).
3. Send-ahead. NoLoCo with ``noloco.send_ahead`` off and on, on a shaped link (``bench.slowlink``: every host's upload
   limited to ``--send-ahead-mbit``; needs root, otherwise it runs on loopback): time the trainer blocks per outer
   step, and the bytes it still has to send at the boundary.

Repeated runs (``--repeats``, different seeds) print medians. Everything else about the run (model, batch, learning
rates, H) is the same for all algorithms; see ``--set`` to change any config key.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from peerd.config import RunConfig, apply_codec_recipe
from peerd.demo import _parse_value, global_params, max_param_diff, stop_processes, to_toml

REPO = Path(__file__).resolve().parent.parent
NETWORK = {  # loopback and 2 cores shared by up to 8 peers: generous timeouts, quick gossip
    "gossip_interval": 0.3,
    "peer_timeout": 6.0,
    "rendezvous_timeout": 20.0,
    "round_timeout": 60.0,
    "match_timeout": 4.0,
}


@dataclass
class RunSpec:
    label: str
    algorithm: str
    peers: int
    inner_steps: int  # per peer
    H: int
    codec: str
    seed: int
    preset: str
    batch_size: int
    seq_len: int
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    link_mbit: float | None = None  # shape every peer's upload (bench.slowlink), or None for plain loopback

    @property
    def outer_steps(self) -> int:
        """run.outer_steps: inner steps for the every-step baseline, outer steps otherwise."""
        return self.inner_steps if self.algorithm == "ddp" else self.inner_steps // self.H

    def config(self) -> dict[str, dict[str, Any]]:
        raw: dict[str, dict[str, Any]] = {
            "run": {"name": "bench", "algorithm": self.algorithm, "outer_steps": self.outer_steps, "seed": self.seed},
            "model": {"preset": self.preset, "seq_len": self.seq_len},
            "data": {"batch_size": self.batch_size, "eval_batches": 2},
            # Every algorithm anneals the inner lr over the same budget, as a real run of this length would.
            "inner": {"steps": self.H, "warmup_steps": min(20, self.inner_steps // 4), "total_steps": self.inner_steps},
            "codec": {"name": self.codec},
            "network": dict(NETWORK),
            "checkpoint": {"every": 0},
        }
        apply_codec_recipe(raw, self.algorithm)  # sparse: peerd demo's recipe (--set overrides it)
        if hasattr(RunConfig(), "robust"):
            # The norm screen (peerd/robust.py) compares shards of one vector with each other; the shards of a
            # gradient differ in scale by layer, so it refuses honest ddp rounds. Off for every algorithm here,
            # which leaves plain means (the default aggregation) for all of them.
            raw["robust"] = {"max_norm_ratio": 0.0}
        for section, values in self.overrides.items():
            raw.setdefault(section, {}).update(values)
        RunConfig.from_dict(raw)
        return raw


@dataclass
class RunResult:
    spec: RunSpec
    seconds: float
    peers_finished: int
    tokens: int  # inner steps actually trained, summed over peers, times tokens per step
    outer_steps: int
    eval_loss: float  # final global weights; NoLoCo: mean over peers of each peer's slow weights
    eval_loss_peers: list[float]
    eval_loss_avg_weights: float  # NoLoCo: the peers' averaged slow weights (same as eval_loss otherwise)
    bytes_sent_per_peer: float  # wire bytes, mean over peers
    raw_bytes_per_peer: float
    bytes_per_peer_per_outer_step: float  # median over peers' rounds with a partner/group (ddp: x H rounds)
    mean_bytes_per_peer_per_outer_step: float  # total sent / outer steps (solo steps and resyncs pull it down)
    median_round_s: float
    idle_fraction: float
    idle_s_per_outer_step: float
    spread: float
    max_param_diff: float
    solo_steps: int
    partial_rounds: int
    failed_rounds: int

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = {k: v for k, v in asdict(self.spec).items() if k != "overrides"}
        return d


# -- running one swarm --------------------------------------------------------------------------------------------
def _peer_cmd(config: Path, data: Path, listen: str, index: int, peers: int, bootstrap: str | None) -> list[str]:
    cmd = [
        sys.executable, "-m", "peerd", "start", "--config", str(config), "--listen", listen, "--data-dir", str(data),
        "--shard", str(index), "--threads", "1", "--insecure", "--wait-peers", str(peers), "--log-level", "INFO",
    ]  # fmt: skip
    return cmd + (["--bootstrap", bootstrap] if bootstrap else [])


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited ({proc.returncode}) before serving; see {path.parent / 'log'}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear")


@contextlib.contextmanager
def _launcher(spec: RunSpec) -> Iterator[Any]:
    """Start processes on loopback, or inside a shaped SlowLinkNet (one namespace per peer)."""
    if spec.link_mbit is None:
        yield None
        return
    from bench.slowlink import SlowLinkNet

    with SlowLinkNet(spec.peers, spec.link_mbit) as net:
        yield net


def run_swarm(spec: RunSpec, workdir: Path, timeout: float, eval_batches: int) -> RunResult:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "run.toml"
    config.write_text(to_toml(spec.config()))
    env_path = {"PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with _launcher(spec) as net:
        try:
            bootstrap = None
            for i in range(spec.peers):
                data = workdir / f"peer{i}"
                data.mkdir(exist_ok=True)
                listen = "127.0.0.1:0" if net is None else f"{net.address(i)}:7000"
                cmd = _peer_cmd(config, data, listen, i, spec.peers, bootstrap)
                log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it
                kw = {"stdout": log, "stderr": subprocess.STDOUT, "env": {**os.environ, **env_path}, "cwd": REPO}
                procs.append(subprocess.Popen(cmd, **kw) if net is None else net.popen(i, cmd, **kw))
                if i == 0:
                    bootstrap = _wait_file(data / "address", procs[0], 120)
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec.label}: swarm did not finish within {timeout:.0f}s (see {workdir})")
                time.sleep(0.5)
        finally:
            stop_processes(procs)
    seconds = time.monotonic() - t0
    return _collect(spec, workdir, seconds, eval_batches)


def _collect(spec: RunSpec, workdir: Path, seconds: float, eval_batches: int) -> RunResult:
    dirs = [workdir / f"peer{i}" for i in range(spec.peers)]
    summaries = []
    for d in dirs:
        try:
            summaries.append(json.loads((d / "summary.json").read_text()))
        except (OSError, ValueError):
            tail = (d / "log").read_text(errors="replace").splitlines()[-10:] if (d / "log").exists() else []
            raise RuntimeError(f"{spec.label}: peer {d.name} left no summary:\n  " + "\n  ".join(tail)) from None
    states = [global_params(d) for d in dirs]
    if any(s is None for s in states):
        raise RuntimeError(f"{spec.label}: a peer left no checkpoint")
    params = [s["params"] for s in states]  # type: ignore[index]
    cfg = RunConfig.from_dict(spec.config())
    if spec.algorithm == "noloco":
        peer_losses = evaluate(cfg, params, eval_batches)
        eval_loss = statistics.fmean(peer_losses)
        avg = evaluate(cfg, [torch.stack(params).mean(0)], eval_batches)[0]
    else:
        peer_losses = evaluate(cfg, params[:1], eval_batches)  # identical on every peer (checked: max_param_diff)
        eval_loss = avg = peer_losses[0]
    diff, spread = max_param_diff(dirs)
    n = spec.peers
    outer = min(s["outer_step"] for s in summaries)  # ddp counts inner steps: one round each
    per_outer = spec.H if spec.algorithm == "ddp" else 1  # a DiLoCo/NoLoCo outer step spans H ddp rounds
    wire = [s["bytes_sent_wire"] for s in summaries]
    rounds = [r for s in summaries for r in s.get("rounds", [])]  # each peer's last 32 rounds
    shared = [r["wire_bytes"] for r in rounds if len(r["included"]) > 1]
    compute = sum(s["compute_seconds"] for s in summaries)
    idle = sum(s["compute_idle_seconds"] for s in summaries)
    outer_steps_done = max(outer / per_outer, 1e-9)
    return RunResult(
        spec=spec,
        seconds=round(seconds, 1),
        peers_finished=sum(bool(s["finished"]) for s in summaries),
        tokens=sum(s["inner_step"] for s in summaries) * spec.batch_size * spec.seq_len,
        outer_steps=outer,
        eval_loss=eval_loss,
        eval_loss_peers=peer_losses,
        eval_loss_avg_weights=avg,
        bytes_sent_per_peer=statistics.fmean(wire),
        raw_bytes_per_peer=statistics.fmean(s["bytes_sent_raw"] for s in summaries),
        bytes_per_peer_per_outer_step=statistics.median(shared) * per_outer if shared else 0.0,
        mean_bytes_per_peer_per_outer_step=statistics.fmean(wire) / outer_steps_done,
        median_round_s=statistics.median(r["seconds"] for r in rounds) if rounds else math.nan,
        idle_fraction=idle / (compute + idle) if compute + idle else 0.0,
        idle_s_per_outer_step=idle / n / outer_steps_done,
        spread=spread,
        max_param_diff=diff,
        solo_steps=sum(s["solo_steps"] for s in summaries),
        partial_rounds=sum(s["rounds_partial"] for s in summaries),
        failed_rounds=sum(s["rounds_failed"] for s in summaries),
    )


@torch.no_grad()
def evaluate(cfg: RunConfig, flat_params: Sequence[torch.Tensor], n_batches: int) -> list[float]:
    """Mean cross-entropy of each flat parameter vector on the same held-out batches."""
    from peerd.runmodel import build_run_model, model_seq_len
    from trainer.data import TokenData
    from trainer.flat import ParamLayout

    torch.manual_seed(0)
    model = build_run_model(cfg)
    layout = ParamLayout.of(model)
    data = TokenData.from_path(cfg.data.path or None, seq_len=model_seq_len(model, cfg), split="eval")
    batches = data.eval_batches(cfg.data.batch_size, n_batches, seed=4321)
    model.eval()
    out = []
    for flat in flat_params:
        layout.unflatten_into(flat.float(), model)
        out.append(statistics.fmean(float(model(x, y)[1]) for x, y in batches))
    return out


# -- the three parts ----------------------------------------------------------------------------------------------
def _base(args: argparse.Namespace, algorithm: str, peers: int, inner_steps: int, seed: int, label: str) -> RunSpec:
    return RunSpec(
        label=label,
        algorithm=algorithm,
        peers=peers,
        inner_steps=inner_steps,
        H=args.inner_steps,
        codec=args.codec,
        seed=seed,
        preset=args.preset,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        overrides=_overrides(args.set),
    )


def _overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = _parse_value(value)
    return out


def steps_for_budget(budget_tokens: int, peers: int, batch: int, seq: int, H: int) -> int:
    """Inner steps per peer that spend `budget_tokens` over the swarm, rounded down to whole outer steps."""
    per_step = peers * batch * seq
    steps = budget_tokens // per_step // H * H
    if steps < H:
        raise SystemExit(f"--budget-tokens {budget_tokens} is less than one outer step ({per_step * H} tokens)")
    return steps


def _median_result(results: list[RunResult]) -> dict[str, Any]:
    keys = (
        "eval_loss",
        "eval_loss_avg_weights",
        "bytes_sent_per_peer",
        "bytes_per_peer_per_outer_step",
        "median_round_s",
        "idle_fraction",
        "idle_s_per_outer_step",
        "spread",
        "seconds",
        "tokens",
    )
    return {k: statistics.median(getattr(r, k) for r in results) for k in keys}


def _run(args: argparse.Namespace, spec: RunSpec, root: Path) -> RunResult:
    print(f"  running {spec.label}: {spec.peers} peers x {spec.inner_steps} inner steps ...", flush=True)
    res = run_swarm(spec, root / spec.label, args.timeout, args.eval_batches)
    print(
        f"    done in {res.seconds:.0f}s: eval {res.eval_loss:.4f}, {res.bytes_sent_per_peer / 1e6:.2f} MB/peer, "
        f"median round {res.median_round_s * 1e3:.0f} ms, idle {res.idle_fraction:.0%}",
        flush=True,
    )
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", default="ddp,diloco,noloco", help="comma-separated: ddp, diloco, noloco, streaming")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--budget-tokens", type=int, default=1_228_800, help="tokens over the whole swarm, per algorithm")
    p.add_argument("--codec", default="fp32")
    p.add_argument("--inner-steps", type=int, default=20, help="H, inner steps per outer step")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="repeat the convergence runs with other seeds (medians)")
    p.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed .. + repeats - 1 (fresh seeds check a setting)"
    )
    p.add_argument("--scaling", default="2,4,8", help="peer counts for the scaling part ('' to skip)")
    p.add_argument("--scaling-outer-steps", type=int, default=5)
    p.add_argument("--send-ahead-mbit", type=float, default=20.0, help="upload rate for the send-ahead part (0: skip)")
    p.add_argument("--send-ahead-outer-steps", type=int, default=8)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    p.add_argument("--timeout", type=float, default=900.0, help="per swarm")
    p.add_argument("--workdir", help="keep every peer's data here (default: a temporary directory, removed)")
    p.add_argument("--parts", default="convergence,scaling,send-ahead", help="which parts to run")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = p.parse_args(argv)

    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="peerd-convergence-"))
    algorithms = [a for a in args.algorithms.split(",") if a]
    t_start = time.monotonic()
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        parts = set(args.parts.split(","))
        if "convergence" in parts:
            report["convergence"] = _convergence(args, algorithms, root)
            if "noloco" in algorithms:
                report["phi_encoding"] = _phi_encoding(args, root / f"noloco-{args.peers}p-r0")
        if "scaling" in parts and args.scaling:
            report["scaling"] = _scaling(args, [int(x) for x in args.scaling.split(",")], root)
        if "send-ahead" in parts and args.send_ahead_mbit > 0:
            report["send_ahead"] = _send_ahead(args, root)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - t_start, 1)
    print(f"\nbenchmark took {report['seconds']:.0f}s")
    if args.json:
        print(json.dumps(report, default=_json_default))
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(type(obj).__name__)


def _convergence(args: argparse.Namespace, algorithms: list[str], root: Path) -> dict[str, Any]:
    steps = steps_for_budget(args.budget_tokens, args.peers, args.batch_size, args.seq_len, args.inner_steps)
    print(
        f"1. convergence: {args.peers} peers, {args.budget_tokens} tokens each run ({steps} inner steps per peer, "
        f"H={args.inner_steps}), codec {args.codec}, model {args.preset}",
        flush=True,
    )
    runs: dict[str, list[RunResult]] = {a: [] for a in algorithms}
    for rep in range(args.first_seed, args.first_seed + args.repeats):
        for a in algorithms:
            spec = _base(args, a, args.peers, steps, rep, f"{a}-{args.peers}p-r{rep}")
            runs[a].append(_run(args, spec, root))
    out: dict[str, Any] = {}
    print(
        f"\n{'algorithm':<10} {'eval loss':>10} {'avg-weights':>12} {'MB sent/peer':>13} {'MB/peer/outer':>14} "
        f"{'round ms':>9} {'idle':>6} {'spread':>8} {'tokens':>9}"
    )
    for a, results in runs.items():
        med = _median_result(results)
        out[a] = {"median": med, "runs": [r.row() for r in results]}
        print(
            f"{a:<10} {med['eval_loss']:>10.4f} {med['eval_loss_avg_weights']:>12.4f} "
            f"{med['bytes_sent_per_peer'] / 1e6:>13.2f} {med['bytes_per_peer_per_outer_step'] / 1e6:>14.3f} "
            f"{med['median_round_s'] * 1e3:>9.1f} {med['idle_fraction']:>6.1%} {med['spread']:>8.4f} "
            f"{int(med['tokens']):>9}"
        )
    goals = {}
    losses = {a: out[a]["median"]["eval_loss"] for a in out}
    if "noloco" in losses and "diloco" in losses:
        gap = losses["noloco"] / losses["diloco"] - 1
        goals["noloco_vs_diloco"] = {"relative": gap, "goal": 0.005, "met": gap <= 0.005}
        print(f"NoLoCo vs DiLoCo eval loss: {gap:+.2%} (goal: at most +0.5%) -> {'met' if gap <= 0.005 else 'MISSED'}")
    if "noloco" in losses and "ddp" in losses:
        gap = losses["noloco"] / losses["ddp"] - 1
        goals["noloco_vs_ddp"] = {"relative": gap, "goal": 0.03, "met": abs(gap) <= 0.03}
        verdict = "met" if abs(gap) <= 0.03 else "MISSED"
        print(f"NoLoCo vs every-step all-reduce: {gap:+.2%} (goal: within 3%) -> {verdict}")
    if "diloco" in losses and "ddp" in losses:
        print(f"DiLoCo vs every-step all-reduce: {losses['diloco'] / losses['ddp'] - 1:+.2%}")
    out["goals"] = goals
    return out


def _scaling(args: argparse.Namespace, counts: list[int], root: Path) -> dict[str, Any]:
    print(
        f"\n2. scaling: {args.scaling_outer_steps} outer steps of H={args.inner_steps} with {counts} peers", flush=True
    )
    out: dict[str, Any] = {}
    for a in ("noloco", "diloco"):
        out[a] = {}
        for n in counts:
            spec = _base(args, a, n, args.scaling_outer_steps * args.inner_steps, 0, f"scale-{a}-{n}p")
            out[a][n] = _run(args, spec, root).row()
    print(f"\n{'algorithm':<10} {'peers':>5} {'KB/peer/outer step':>19} {'median round ms':>16} {'solo':>5}")
    for a, by_n in out.items():
        for n, r in by_n.items():
            print(
                f"{a:<10} {n:>5} {r['bytes_per_peer_per_outer_step'] / 1e3:>19.1f} "
                f"{r['median_round_s'] * 1e3:>16.1f} {r['solo_steps']:>5}"
            )
    return out


def _phi_encoding(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """How much quantization noise each way of sending the slow weights adds to the gamma term, which needs
    phi_j - phi_i: measured on the NoLoCo run's final slow weights, with phi_ref the seeded initial weights."""
    from peerd.codecs import make_codec
    from peerd.runmodel import build_run_model
    from trainer.flat import ParamLayout

    states = [global_params(d) for d in sorted(run_dir.glob("peer*"))]
    phis = [s["params"] for s in states if s is not None]
    if len(phis) < 2:
        return {}
    cfg = RunConfig.from_dict(json.loads(json.dumps(_base(args, "noloco", 2, args.inner_steps, 0, "x").config())))
    model = build_run_model(cfg)
    phi_ref = ParamLayout.of(model).flatten(model).float()
    pairs = list(itertools.combinations(range(len(phis)), 2))
    gaps = {(i, j): float((phis[j] - phis[i]).norm()) for i, j in pairs}
    out: dict[str, Any] = {
        "phi_norm": statistics.median(float(p.norm()) for p in phis),
        "drift_norm": statistics.median(float((p - phi_ref).norm()) for p in phis),
        "partner_gap_norm": statistics.median(gaps.values()),
    }
    print(
        f"\n   phi on the wire (NoLoCo final slow weights, medians over peer pairs): |phi| {out['phi_norm']:.2f}, "
        f"|phi - phi_ref| {out['drift_norm']:.2f}, |phi_j - phi_i| {out['partner_gap_norm']:.3f}; "
        "quantization error relative to |phi_j - phi_i|:"
    )
    for name in ("bf16", "int8", "fp8", "int4"):
        codec = make_codec(name, block_size=cfg.codec.block_size)
        raw, ref = [], []
        for i, j in pairs:
            b = phis[j]
            raw.append(float((codec.decode(codec.encode(b), b.numel()) - b).norm()) / gaps[(i, j)])
            ref.append(float((codec.decode(codec.encode(b - phi_ref), b.numel()) + phi_ref - b).norm()) / gaps[(i, j)])
        out[name] = {"phi": statistics.median(raw), "phi_minus_ref": statistics.median(ref)}
        raw_m, ref_m = out[name]["phi"], out[name]["phi_minus_ref"]
        print(f"   {name:<5} sending phi: {raw_m:8.2%}   sending phi - phi_ref: {ref_m:8.2%}")
    return out


def _send_ahead(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from bench.slowlink import available

    ok, why = available()
    mbit = args.send_ahead_mbit if ok else None
    where = f"every upload shaped to {mbit:g} Mbit/s" if mbit else f"loopback (no shaped link: {why})"
    print(
        f"\n3. send-ahead: NoLoCo, {args.peers} peers, {args.send_ahead_outer_steps} outer steps, {where}", flush=True
    )
    out: dict[str, Any] = {"link_mbit": mbit}
    for ahead in (False, True):
        spec = _base(args, "noloco", args.peers, args.send_ahead_outer_steps * args.inner_steps, 0, "")
        spec.label = f"send-ahead-{'on' if ahead else 'off'}"
        spec.overrides.setdefault("noloco", {})["send_ahead"] = ahead
        spec.link_mbit = mbit
        out["on" if ahead else "off"] = _run(args, spec, root).row()
    off, on = out["off"], out["on"]
    saved = off["idle_s_per_outer_step"] - on["idle_s_per_outer_step"]
    print(
        f"blocked per outer step: {off['idle_s_per_outer_step'] * 1e3:.0f} ms without send-ahead, "
        f"{on['idle_s_per_outer_step'] * 1e3:.0f} ms with it (saves {saved * 1e3:.0f} ms, "
        f"{saved / off['idle_s_per_outer_step'] if off['idle_s_per_outer_step'] else 0:.0%}); "
        f"median round {off['median_round_s'] * 1e3:.0f} -> {on['median_round_s'] * 1e3:.0f} ms",
        flush=True,
    )
    out["saved_s_per_outer_step"] = saved
    return out


if __name__ == "__main__":
    sys.exit(main())
