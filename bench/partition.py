"""Split-brain and churn benchmark: real peers in network namespaces, split apart, joined again, killed and restarted.

    python -m bench.partition --splits 2+2,3+2 --cuts 10,30,120 [--algorithm diloco] [--repeats 1]
    python -m bench.partition --chaos 3 [--peers 5] [--steps 40] [--kill-every 8]

Split runs: the peers train (paced inner steps, so a cut spans a known number of outer steps), the hosts are cut into
the given groups for CUT seconds, then joined again. Reported per run:
- heal_s: seconds from the heal until the first round that includes every peer, seen by every peer (after that round
  all peers hold bit-identical globals: one model); heal_steps: the most outer steps any peer took in that time;
- lost_steps: outer steps the losing side trained during the cut and then replaced by the winner's state (the
  "rounds lost" to the split), from the downloaded state's step against the loser's own;
- the largest parameter difference between peers' final checkpoints (0: one model at the end).

Chaos runs: PEERS peers, a kill -9 of a random non-bootstrap peer every KILL_EVERY seconds with a restart on its data
dir, until every peer reached STEPS outer steps; reported: forks (final max param diff > 0), solo steps that were
not reported as solo (a round of one that is not partial), kills.

Needs root (network namespaces). Goal (issue 10): one model within 2 outer steps or 10 s after the heal, whichever
is longer; chaos: 0 forks and 0 unreported solo steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from peerd.demo import max_param_diff

PACE_S = "0.05"
LINE = re.compile(r"^(\S+ \S+) INFO peerd: outer step (\d+) \| .*\| peers (\d+)/(\d+) \|")
ADOPT = re.compile(r"^(\S+ \S+) INFO peerd: downloaded state at step (\d+)")


def _ts(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _config(tmp: Path, algorithm: str, steps: int, linger: float) -> Path:
    from tests.swarm import tiny_config

    extra: dict[str, Any] = {}
    if algorithm == "streaming":
        extra = {"streaming__fragments": 2, "streaming__tau": 2}
    return tiny_config(
        tmp,
        run__algorithm=algorithm,
        run__outer_steps=steps,
        inner__steps=10,
        network__peer_timeout=2.0,
        network__rendezvous_timeout=3.0,
        network__round_timeout=10.0,
        network__redial_max=2.0,
        network__linger=linger,
        **extra,
    )


def _log_steps(log: str) -> list[tuple[float, int, int, int]]:
    """(time, outer step, included, expected) of every outer-step line of a peer's log."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out.append((_ts(m[1]), int(m[2]), int(m[3]), int(m[4])))
    return out


def _lost_steps(log: str, cut_at: float, healed: float) -> int:
    """Outer steps this peer trained after the cut that a state download after the heal replaced (0 if none)."""
    own = _log_steps(log)

    def step_at(t: float) -> int:
        before = [s for ts, s, _, _ in own if ts <= t]
        return before[-1] if before else 0

    downloads = [_ts(m[1]) for m in map(ADOPT.match, log.splitlines()) if m and _ts(m[1]) >= healed]
    return max((step_at(t) - step_at(cut_at) for t in downloads[:1]), default=0)


def _workdir(keep: str | None) -> Any:
    """A temporary directory, or `keep` (kept afterwards, with every peer's log) when given."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return contextlib.nullcontext(tempfile.mkdtemp(prefix="run-", dir=keep))
    return tempfile.TemporaryDirectory(prefix="peerd-bench-partition-")


def split_run(groups: list[list[int]], cut_s: float, algorithm: str, keep: str | None = None) -> dict[str, Any]:
    from tests.netswarm import NetSwarm

    n = sum(len(g) for g in groups)
    os.environ["PEERD_FAULT_STEP_DELAY_S"] = PACE_S
    with _workdir(keep) as tmp_s:
        tmp = Path(tmp_s)
        # A finite run that, at full pace, ends ~25 s after the heal (slower machines: later), so the final
        # checkpoints of all peers must agree bit for bit.
        target = 3 + int((cut_s + 25.0) / (float(PACE_S) * 10))
        with NetSwarm(tmp, n, _config(tmp, algorithm, target, 60.0)) as swarm:
            swarm.wait_until(lambda: all(swarm.status(i).outer_step >= 3 for i in range(n)), 180, "step 3")
            swarm.net.partition(groups)
            cut_at = time.time()
            time.sleep(cut_s)
            swarm.net.heal()
            healed = time.time()
            # run on until every peer logged a round with everyone after the heal (or give up after 120 s)
            deadline = time.monotonic() + 120

            def complete_after(i: int) -> tuple[float, int] | None:
                steps = _log_steps(swarm.peers[i].log())
                first_after = next((s for t, s, _, _ in steps if t >= healed), None)
                for t, s, inc, exp in steps:
                    if t >= healed and inc == n and exp == n:
                        return t - healed, s - (first_after or s)
                return None

            seen: list[tuple[float, int] | None] = [None] * n
            while time.monotonic() < deadline and not all(seen):
                time.sleep(1.0)
                seen = [complete_after(i) for i in range(n)]
            swarm.wait_exit(600)
            logs = [p.log() for p in swarm.peers]
        diff, _ = max_param_diff([p.data_dir for p in swarm.peers])
    lost = max((_lost_steps(log, cut_at, healed) for log in logs), default=0)
    ok = [s for s in seen if s is not None]
    return {
        "split": "+".join(str(len(g)) for g in groups),
        "cut_s": cut_s,
        "algorithm": algorithm,
        "heal_s": max(t for t, _ in ok) if len(ok) == n else None,
        "heal_steps": max(k for _, k in ok) if len(ok) == n else None,
        "lost_steps": max(lost, 0),
        "outer_steps": target,
        "final_max_param_diff": diff,
    }


def noloco_run(groups: list[list[int]], cut_s: float, after_s: float = 30.0) -> dict[str, Any]:
    """NoLoCo has no single model: measure `spread` (largest pairwise L2 distance between peers' slow weights over
    their norm, from the checkpoints written every outer step) before the cut, at the heal, and after it."""
    from tests.netswarm import NetSwarm

    n = sum(len(g) for g in groups)
    os.environ["PEERD_FAULT_STEP_DELAY_S"] = PACE_S
    with tempfile.TemporaryDirectory(prefix="peerd-bench-partition-") as tmp_s:
        tmp = Path(tmp_s)
        with NetSwarm(tmp, n, _config(tmp, "noloco", 0, 5.0)) as swarm:
            dirs = [p.data_dir for p in swarm.peers]

            def spread() -> float:
                return max_param_diff(dirs)[1]

            swarm.wait_until(lambda: all(swarm.status(i).outer_step >= 5 for i in range(n)), 180, "step 5")
            before = spread()
            swarm.net.partition(groups)
            time.sleep(cut_s)
            at_heal = spread()
            swarm.net.heal()
            curve = []
            for k in range(int(after_s // 5)):
                time.sleep(5.0)
                curve.append((5 * (k + 1), round(spread(), 4)))
            for p in swarm.peers:
                p.terminate()
    return {
        "split": "+".join(str(len(g)) for g in groups),
        "cut_s": cut_s,
        "algorithm": "noloco",
        "spread_before": round(before, 4),
        "spread_at_heal": round(at_heal, 4),
        "spread_after_heal": curve,
    }


def chaos_run(peers: int, steps: int, kill_every: float, seed: int) -> dict[str, Any]:
    """kill -9 a random non-bootstrap peer every `kill_every` s and restart it on its data dir (bootstrapping from
    any peer still running), while the swarm trains; the run ends when every peer reached `steps`."""
    from tests.netswarm import NetSwarm

    os.environ["PEERD_FAULT_STEP_DELAY_S"] = PACE_S
    rng = random.Random(seed)
    kills = 0
    with tempfile.TemporaryDirectory(prefix="peerd-bench-chaos-") as tmp_s:
        tmp = Path(tmp_s)
        with NetSwarm(tmp, peers, _config(tmp, "diloco", steps, 30.0)) as swarm:
            swarm.wait_until(lambda: swarm.status(0).outer_step >= 1, 180, "step 1")
            t0 = time.monotonic()
            while time.monotonic() - t0 < 600:
                time.sleep(kill_every)
                running = [p.index for p in swarm.peers if p.proc.poll() is None]
                # restart only while the swarm still trains: a peer restarted after everyone finished and left has
                # nobody to join (it then says so and exits), which tests the bench, not peerd
                if len(running) < peers or swarm.status(running[0]).outer_step >= steps - 3:
                    break
                victim = rng.choice([i for i in running if i != 0])
                others = [i for i in running if i != victim]
                swarm.restart(victim, bootstrap=swarm.address(others[0]))
                kills += 1
            codes = [p.wait(300) for p in swarm.peers]
        dirs = [p.data_dir for p in swarm.peers]
        diff, _ = max_param_diff(dirs)
        summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    unreported = sum(1 for s in summaries for r in s["rounds"] if len(set(r["included"])) == 1 and not r["partial"])
    return {
        "peers": peers,
        "steps": steps,
        "kills": kills,
        "exit_codes": codes,
        "fork": diff > 0,
        "max_param_diff": diff,
        "finished": all(s["finished"] and s["outer_step"] == steps for s in summaries),
        "solo_steps_reported": sum(s["solo_steps"] for s in summaries),
        "unreported_solo_steps": unreported,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", default="2+2,3+2")
    ap.add_argument("--cuts", default="10,30,120")
    ap.add_argument("--algorithm", default="diloco", choices=["diloco", "streaming", "noloco"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--chaos", type=int, default=0, help="run this many chaos repetitions instead of splits")
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-every", type=float, default=8.0)
    ap.add_argument("--workdir", help="keep each run's peer logs and checkpoints under this directory")
    args = ap.parse_args()
    rows = []
    if args.chaos:
        for rep in range(args.chaos):
            row = chaos_run(args.peers, args.steps, args.kill_every, seed=rep)
            print(json.dumps(row), flush=True)
            rows.append(row)
        print(json.dumps({"chaos_runs": len(rows), "forks": sum(r["fork"] for r in rows),
                          "unreported_solo_steps": sum(r["unreported_solo_steps"] for r in rows)}))  # fmt: skip
        return
    for split in args.splits.split(","):
        sizes = [int(x) for x in split.split("+")]
        groups, start = [], 0
        for k in sizes:
            groups.append(list(range(start, start + k)))
            start += k
        for cut in (float(c) for c in args.cuts.split(",")):
            if args.algorithm == "noloco":
                for _ in range(args.repeats):
                    print(json.dumps(noloco_run(groups, cut)), flush=True)
                continue
            runs = [split_run(groups, cut, args.algorithm, args.workdir) for _ in range(args.repeats)]
            for r in runs:
                print(json.dumps(r), flush=True)
            heal = [r["heal_s"] for r in runs if r["heal_s"] is not None]
            print(json.dumps({"split": split, "cut_s": cut, "median_heal_s": statistics.median(heal) if heal else None,
                              "healed": f"{len(heal)}/{len(runs)}"}), flush=True)  # fmt: skip
            rows.extend(runs)


if __name__ == "__main__":
    main()
