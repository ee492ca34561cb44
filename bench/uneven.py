"""Slow and uneven peers at equal wall time: who idles, whose work is lost, what the model gains, how fast the
outlier is flagged.

    python -m bench.uneven [--quick] [--wall 60] [--repeats 1] [--family compute,link] [--json]

Four peers of real `peerd start` processes train the tiny built-in GPT for the same wall time `--wall` in every
scenario (then SIGTERM: each peer stops after its inner step and writes its checkpoint and summary). Compute family,
on loopback: one peer slowed by `PEERD_FAULT_STEP_DELAY_S` = 2x the measured inner step (about 3x slower):

- `uniform`: 4 equal peers, fixed H (the reference, and the "no false flags" check)
- `wait`: the slow peer in, fixed H: every round waits for it (today's DiLoCo)
- `drop`: the 3 fast peers only, fixed H: nobody waits, the slow peer's compute is not used (a 4th process trains
  alone in a run of its own, so the 3 get the same share of this machine's CPU as in the 4-peer scenarios)
- `window`: the slow peer in, `inner.window_s` = H x the fast step: as many steps as fit, token-weighted rounds,
  late work carried (`outer.late_work = "carry"`); `window-discard`: the same, late work dropped
- `uniform-overlap` / `window-overlap`: `uniform` and `window` with `outer.overlap` (each round runs while the next
  window trains, peerd/diloco.py); `uniform-window-overlap`: 4 equal peers, windowed and overlapped (the "no false
  flags" check for the windowed overlap, whose windows keep the swarm's clock)
- `straggle-carry` / `straggle-discard`: a straggler whose every inner step takes `--straggle-frac` (0.4) of a
  window, so it may miss rounds: the staleness cost of carrying its work against dropping it

Link family (root: network namespaces with tbf, bench/slowlink.py): one peer's link 10x slower both ways than the
others' (`--link-mbit`):

- `uniform-net`: 4 equal links (the reference); `drop-net`: the 3 fast peers only (nobody waits, the slow peer's
  compute is not used; a 4th process trains alone, as in `drop`)
- `slowlink-wait`: fixed H, `outer.slow_link = "wait"`: every round waits for the slow link (DiLoCo before sponsors)
- `slowlink`: fixed H, the default `outer.slow_link = "sponsor"`: once flagged, the slow peer sends its work through
  a sponsor (peerd/sponsor.py) and no round waits for it; `slowlink-window`: the same with `inner.window_s`
- `uniform-net-overlap` / `slowlink-overlap`: `uniform-net` and `slowlink` with `outer.overlap` (rounds hidden under
  the next window's compute; "steady" idle is not given for them: their rounds' times are not idle time);
  `uniform-net-window-overlap` / `slowlink-window-overlap`: the same with `inner.window_s` (windows on the swarm's
  clock rather than each peer's step count)

Per scenario: compute-idle fraction of the fast peers (median), tokens trained per fast and slow peer, the share of
computed inner steps discarded, eval loss of the swarm's final global state (the peer holding the most work) on
held-out batches, outer steps done, partial rounds, and the outer step at which the fast peers first saw the outlier
flagged (peerd/timings.py). Medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.convergence import NETWORK, _peer_cmd, _wait_file, evaluate
from peerd.config import RunConfig, apply_codec_recipe
from peerd.demo import global_params, stop_processes, to_toml

REPO = Path(__file__).resolve().parent.parent
PEERS = 4
SLOW = 3  # index of the slow peer (compute or link)


@dataclass
class Scenario:
    name: str
    peers: int
    slow_env: dict[str, str] | None  # the slow peer's extra environment (compute family)
    window_s: float = 0.0
    late_work: str = "carry"
    slow_link: str = "sponsor"
    # Start one more peer that trains alone in a run of its own: the dropped peer still uses its share of this
    # machine's 2 cores, so the others do not train faster than in the 4-peer scenarios (each real peer has its own)
    cpu_twin: bool = False
    link_mbit: list[float] | None = None  # per-peer link rates (link family), None: loopback
    overlap: bool = False  # outer.overlap: each round runs while the next window trains (peerd/diloco.py)


@dataclass
class Outcome:
    scenario: str
    fast_idle: float
    tokens_fast: float
    tokens_slow: float
    discarded_share: float
    eval_loss: float
    outer_steps: int
    partial_rounds: int
    flagged_at_step: float | None  # median over fast peers; None: never flagged
    false_flags: int  # peers flagged other than the slow one
    steady_idle: float | None = None  # fast peers' idle from outer step 3 on (after the flag, when there is one)


STEP_LINE = re.compile(r"^(\S+ \S+) INFO peerd: outer step (\d+) \|.*\| round ([\d.]+)s$")
STEADY_FROM = 3  # the slow peer is flagged at outer step 1-2: rounds after the third show the steady state


def steady_idle(log: str) -> float | None:
    """The share of wall time a peer spent in rounds from outer step STEADY_FROM on, from its step lines (each
    says when the step ended and how long its round took): what the rounds cost once any outlier is flagged."""
    rows = []
    for line in log.splitlines():
        m = STEP_LINE.match(line)
        if m:
            t = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            rows.append((int(m[2]), t, float(m[3])))
    start = next((t for step, t, _ in rows if step == STEADY_FROM), None)
    later = [(t, r) for step, t, r in rows if step > STEADY_FROM]
    if start is None or not later:
        return None
    return sum(r for _, r in later) / (later[-1][0] - start)


def config(args: argparse.Namespace, sc: Scenario, seed: int) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "run": {"name": "uneven", "algorithm": args.algorithm, "outer_steps": 100000, "seed": seed},
        "model": {"preset": "tiny"},
        "data": {"batch_size": args.batch_size, "eval_batches": 2},
        "inner": {"steps": args.H, "warmup_steps": 10, "window_s": sc.window_s},
        "outer": {"late_work": sc.late_work, "slow_link": sc.slow_link, "overlap": sc.overlap},
        "network": dict(NETWORK),
        "checkpoint": {"every": 1},
    }
    if args.algorithm == "streaming":
        raw["streaming"] = {"fragments": args.fragments}
    if args.codec != "fp32":
        raw["codec"] = {"name": args.codec}
    apply_codec_recipe(raw, args.algorithm)  # sparse: peerd demo's recipe
    RunConfig.from_dict(raw)
    return raw


@contextlib.contextmanager
def _net(sc: Scenario) -> Iterator[Any]:
    if sc.link_mbit is None:
        yield None
        return
    from bench.slowlink import SlowLinkNet

    with SlowLinkNet(sc.peers, sc.link_mbit, down_rate_mbit=sc.link_mbit) as net:
        yield net


def run(args: argparse.Namespace, sc: Scenario, workdir: Path, seed: int) -> list[dict[str, Any]]:
    """Start the swarm, let it train `--wall` seconds after every peer is up, stop it, return the summaries."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "run.toml"
    cfg_path.write_text(to_toml(config(args, sc, seed)))
    procs: list[subprocess.Popen] = []
    with _net(sc) as net:
        try:
            boot = None
            for i in range(sc.peers):
                data = workdir / f"peer{i}"
                data.mkdir(exist_ok=True)
                listen = "127.0.0.1:0" if net is None else f"{net.address(i)}:7000"
                cmd = _peer_cmd(cfg_path, data, listen, i, sc.peers, boot)
                if net is not None:
                    cmd += ["--announce", f"{net.address(i)}:7000"]
                env = {**os.environ, "PYTHONPATH": str(REPO), **((sc.slow_env or {}) if i == SLOW else {})}
                log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it
                kw = {"stdout": log, "stderr": subprocess.STDOUT, "env": env, "cwd": REPO}
                procs.append(subprocess.Popen(cmd, **kw) if net is None else net.popen(i, cmd, **kw))
                if i == 0:
                    boot = _wait_file(data / "address", procs[0], 120)
            for i, p in enumerate(procs):
                _wait_file(workdir / f"peer{i}" / "address", p, 120)
            if sc.cpu_twin:
                twin_cfg = config(args, sc, seed)
                twin_cfg["run"]["name"] = "uneven-twin"
                (workdir / "twin.toml").write_text(to_toml(twin_cfg))
                data = workdir / "twin"
                data.mkdir(exist_ok=True)
                cmd = _peer_cmd(workdir / "twin.toml", data, "127.0.0.1:0", SLOW, 1, None)
                log = open(data / "log", "ab")  # noqa: SIM115 - the child owns it
                env = {**os.environ, "PYTHONPATH": str(REPO)}
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))
            time.sleep(args.wall)
        finally:
            stop_processes(procs)
    out = []
    for i in range(sc.peers):
        try:
            out.append(json.loads((workdir / f"peer{i}" / "summary.json").read_text()))
        except (OSError, ValueError):
            raise RuntimeError(f"{sc.name}: peer{i} left no summary (see {workdir}/peer{i}/log)") from None
    return out


def outcome(args: argparse.Namespace, sc: Scenario, workdir: Path, summaries: list[dict[str, Any]]) -> Outcome:
    slow_in = sc.slow_env is not None or (sc.link_mbit is not None and len(set(sc.link_mbit)) > 1)
    fast = [s for i, s in enumerate(summaries) if not (slow_in and i == SLOW)]
    fast_logs = [
        (workdir / f"peer{i}" / "log").read_text(errors="replace")
        for i in range(len(summaries))
        if not (slow_in and i == SLOW)
    ]
    slow = summaries[SLOW] if slow_in and len(summaries) > SLOW else None

    def idle(s: dict[str, Any]) -> float:
        busy = s["compute_seconds"] + s["compute_idle_seconds"]
        return s["compute_idle_seconds"] / busy if busy else 0.0

    def tokens(s: dict[str, Any]) -> float:
        return s["inner_step"] * s.get("tokens_per_step", 0)

    best = max(range(len(summaries)), key=lambda i: (summaries[i]["work"], summaries[i]["outer_step"]))
    state = global_params(workdir / f"peer{best}")
    cfg = RunConfig.from_dict(config(args, sc, 0))
    loss = evaluate(cfg, [state["params"]], args.eval_batches)[0] if state is not None else float("nan")
    slow_id = slow["peer_id"] if slow is not None else None
    flagged = [s["flagged_at_step"].get(slow_id) for s in fast if slow_id and slow_id in s["flagged_at_step"]]
    false_flags = sum(1 for s in fast for pid in s["flagged_at_step"] if pid != slow_id)
    computed = sum(s["inner_step"] for s in summaries)
    return Outcome(
        scenario=sc.name,
        fast_idle=statistics.median(idle(s) for s in fast),
        tokens_fast=statistics.median(tokens(s) for s in fast),
        tokens_slow=tokens(slow) if slow is not None else 0.0,
        discarded_share=sum(s.get("discarded_steps", 0) for s in summaries) / computed if computed else 0.0,
        eval_loss=loss,
        outer_steps=min(s["outer_step"] for s in summaries),
        partial_rounds=sum(s["rounds_partial"] for s in summaries),
        flagged_at_step=statistics.median(flagged) if len(flagged) * 2 > len(fast) else None,
        false_flags=false_flags,
        # from the step lines' round times: with overlap a round's time is not idle time, so there is none to give
        steady_idle=statistics.median(v)
        if not sc.overlap and (v := [x for x in (steady_idle(p) for p in fast_logs) if x is not None])
        else None,
    )


def measure_step(args: argparse.Namespace, root: Path) -> float:
    """The tiny model's inner step time with 4 peers sharing this machine (from a short uniform run)."""
    probe = argparse.Namespace(**{**vars(args), "wall": 8.0})
    sums = run(probe, Scenario("probe", PEERS, None), root / "probe", 0)
    return statistics.median(s["compute_seconds"] / max(s["inner_step"], 1) for s in sums)


def scenarios(args: argparse.Namespace, step_s: float) -> list[Scenario]:
    slow_env = {"PEERD_FAULT_STEP_DELAY_S": f"{2 * step_s:.4f}"}
    window = args.H * step_s
    out: list[Scenario] = []
    if "compute" in args.family:
        out += [
            Scenario("uniform", PEERS, None),
            Scenario("wait", PEERS, slow_env),
            Scenario("drop", PEERS - 1, None, cpu_twin=True),
            Scenario("window", PEERS, slow_env, window_s=window),
            Scenario("uniform-overlap", PEERS, None, overlap=True),
            Scenario("window-overlap", PEERS, slow_env, window_s=window, overlap=True),
            Scenario("uniform-window-overlap", PEERS, None, window_s=window, overlap=True),
        ]
        if not args.quick:
            out.append(Scenario("window-discard", PEERS, slow_env, window_s=window, late_work="discard"))
            # A straggler: each of its inner steps takes `--straggle-frac` of a window, so it often finishes past the
            # leader's grace and finds the round gone: what carrying its work costs (staleness) against dropping it.
            straggler = {"PEERD_FAULT_STEP_DELAY_S": f"{args.straggle_frac * window:.3f}"}
            out.append(Scenario("straggle-carry", PEERS, straggler, window_s=window))
            out.append(Scenario("straggle-discard", PEERS, straggler, window_s=window, late_work="discard"))
    if "link" in args.family:
        fast, slow = args.link_mbit, args.link_mbit / 10
        rates = [fast] * (PEERS - 1) + [slow]
        out += [
            Scenario("uniform-net", PEERS, None, link_mbit=[fast] * PEERS),
            Scenario("drop-net", PEERS - 1, None, link_mbit=[fast] * (PEERS - 1), cpu_twin=True),
            Scenario("slowlink-wait", PEERS, None, slow_link="wait", link_mbit=rates),
            Scenario("slowlink", PEERS, None, link_mbit=rates),
            Scenario("slowlink-window", PEERS, None, window_s=window, link_mbit=rates),
            Scenario("uniform-net-overlap", PEERS, None, link_mbit=[fast] * PEERS, overlap=True),
            Scenario("slowlink-overlap", PEERS, None, link_mbit=rates, overlap=True),
            Scenario("uniform-net-window-overlap", PEERS, None, window, link_mbit=[fast] * PEERS, overlap=True),
            Scenario("slowlink-window-overlap", PEERS, None, window, link_mbit=rates, overlap=True),
        ]
    if args.only:
        out = [sc for sc in out if sc.name in args.only]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.uneven", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 s per scenario, compute family, one repeat")
    ap.add_argument("--wall", type=float, default=60.0, help="seconds of training per scenario (equal wall time)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--family", default="compute,link", help="compute, link or both")
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer step (fixed-H scenarios)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--link-mbit", type=float, default=20.0, help="the fast links' rate; the slow one gets a tenth")
    ap.add_argument("--algorithm", default="diloco", choices=["diloco", "streaming"], help="for every scenario")
    ap.add_argument("--codec", default="fp32", help="codec.name for every scenario (sparse: with its recipe)")
    ap.add_argument("--fragments", type=int, default=2, help="streaming.fragments with --algorithm streaming")
    ap.add_argument("--straggle-frac", type=float, default=0.4, help="the straggler's inner step / the window")
    ap.add_argument("--only", type=lambda v: set(v.split(",")), default=set(), help="run only these scenarios")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    args = ap.parse_args(argv)
    if args.quick:
        args.wall, args.repeats, args.family = 30.0, 1, "compute"
    args.family = {f.strip() for f in args.family.split(",") if f.strip()}
    if "link" in args.family:
        from bench.slowlink import available

        ok, why = available()
        if not ok:
            print(f"link family skipped: {why}", file=sys.stderr)
            args.family.discard("link")
    root = Path(tempfile.mkdtemp(prefix="peerd-uneven-"))
    step_s = measure_step(args, root)
    print(f"inner step with {PEERS} peers on this machine: {step_s * 1e3:.1f} ms; slow peer +{2 * step_s * 1e3:.1f} "
          f"ms per step; window {args.H * step_s:.2f} s; {args.wall:.0f} s per scenario", flush=True)  # fmt: skip
    results: dict[str, list[Outcome]] = {}
    for rep in range(args.repeats):
        for sc in scenarios(args, step_s):
            work = root / f"{sc.name}-{rep}"
            res = outcome(args, sc, work, run(args, sc, work, seed=rep))
            results.setdefault(sc.name, []).append(res)
            steady = "-" if res.steady_idle is None else f"{res.steady_idle:.1%}"
            print(f"  {sc.name:<16} eval {res.eval_loss:.4f}  idle(fast) {res.fast_idle:.1%} (steady {steady})  steps "
                  f"{res.outer_steps}  discarded {res.discarded_share:.1%}  flagged@{res.flagged_at_step}",
                  flush=True)  # fmt: skip
    rows = []
    for name, outs in results.items():
        row = {"scenario": name}
        for key in asdict(outs[0]):
            if key == "scenario":
                continue
            vals = [getattr(o, key) for o in outs]
            nums = [v for v in vals if v is not None]
            row[key] = statistics.median(nums) if nums else None
        rows.append(row)
    if args.json:
        print(json.dumps({"step_s": step_s, "wall_s": args.wall, "repeats": args.repeats, "rows": rows}, indent=2))
    else:
        print(f"\n{'scenario':<26} {'eval loss':>9} {'idle fast':>9} {'steady':>7} {'tok fast':>9} {'tok slow':>9} "
              f"{'discard':>7} {'steps':>5} {'partial':>7} {'flag@':>5} {'false':>5}")  # fmt: skip
        for r in rows:
            flag = "-" if r["flagged_at_step"] is None else f"{r['flagged_at_step']:.0f}"
            steady = "-" if r["steady_idle"] is None else f"{r['steady_idle']:.1%}"
            print(f"{r['scenario']:<26} {r['eval_loss']:>9.4f} {r['fast_idle']:>9.1%} {steady:>7} "
                  f"{r['tokens_fast']:>9.0f} "
                  f"{r['tokens_slow']:>9.0f} {r['discarded_share']:>7.1%} {r['outer_steps']:>5.0f} "
                  f"{r['partial_rounds']:>7.0f} {flag:>5} {r['false_flags']:>5.0f}")  # fmt: skip
        by = {r["scenario"]: r for r in rows}
        if {"wait", "drop", "window"} <= set(by):
            best = min(by["wait"]["eval_loss"], by["drop"]["eval_loss"])
            print(f"\ngoals: fast peers idle <= 5% in 'window': {by['window']['fast_idle']:.1%}; discarded 0%: "
                  f"{by['window']['discarded_share']:.1%}; eval loss <= best of wait/drop ({best:.4f}): "
                  f"{by['window']['eval_loss']:.4f}; flagged within 3 outer steps in 'wait': "
                  f"{by['wait']['flagged_at_step']}; false flags in 'uniform': "
                  f"{by['uniform']['false_flags']:.0f}")  # fmt: skip
        if {"uniform-net", "drop-net", "slowlink-wait", "slowlink"} <= set(by):
            best = min(by["slowlink-wait"]["eval_loss"], by["drop-net"]["eval_loss"])
            print(f"\nlink goals: fast peers idle <= 5% in 'slowlink': {by['slowlink']['fast_idle']:.1%}, from step "
                  f"{STEADY_FROM} on {by['slowlink']['steady_idle']:.1%} (uniform-net "
                  f"{by['uniform-net']['fast_idle']:.1%}, slowlink-wait {by['slowlink-wait']['fast_idle']:.1%}); "
                  f"discarded 0%: {by['slowlink']['discarded_share']:.1%}; eval loss <= best of wait/drop "
                  f"({best:.4f}): {by['slowlink']['eval_loss']:.4f}")  # fmt: skip
        for fam, (uni, slow, wait, drop) in {
            "compute": ("uniform-window-overlap", "window-overlap", "wait", "drop"),
            "link": ("uniform-net-window-overlap", "slowlink-window-overlap", "slowlink-wait", "drop-net"),
        }.items():
            if {uni, slow, wait, drop} <= set(by):
                best = min(by[wait]["eval_loss"], by[drop]["eval_loss"])
                print(f"\n{fam} goals, windowed overlap: fast peers idle <= 5%: {by[slow]['fast_idle']:.1%}; discarded "
                      f"0%: {by[slow]['discarded_share']:.1%}; eval loss <= best of wait/drop ({best:.4f}): "
                      f"{by[slow]['eval_loss']:.4f}; flagged within 3 outer steps: {by[slow]['flagged_at_step']}; "
                      f"false flags in '{uni}': {by[uni]['false_flags']:.0f}")  # fmt: skip
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
