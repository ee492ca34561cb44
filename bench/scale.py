"""Scale benchmark: N real daemons on this machine, with a vector-sized model and no real training, so what is measured
is the swarm's own cost as N grows (issue 15).

    python -m bench.scale --peers 8,16,32,64 [--seconds 60] [--churn 10] [--params 1048576] [--inner-steps 1]
                          [--until-step N [--from-step M]] [--codec NAME] [--algorithm noloco [--group-size G]]
                          [--json]

Per swarm size, over a measurement window that starts once every peer is up:
- rounds: outer steps the swarm completed, the median round time (between consecutive steps at one peer), and the
  share of those rounds that included every peer the run expected (a kill makes the rounds around it partial);
- failed: round attempts that failed and were retried (RoundFailed), and outer steps given up on, at the record peer
  (the lowest-numbered peer never killed and never sponsored in the window: the bootstrap peer unless the swarm
  flagged it slow), and the share of attempts that completed: rounds / (rounds + failed); survived: rounds that
  lost a member mid-round and completed without it (allreduce.py); and failed attempts summed over every peer's log
  (a member whose own attempt failed downloads the swarm's state instead);
- gossip B/s and msg/s per peer: membership traffic each peer sends (requests and answers), from its metrics;
- outcomes: every round outcome (complete, partial, failed, solo) the peers alive at both ends of the window counted
  in it, and the share that averaged (complete or partial). With --algorithm noloco (bounded groups of
  --group-size, no leader) this is the completion figure: each peer counts its own group's exchange, and an outer
  step that found no partner is "solo";
- spread: each peer's distance from the swarm's mean global weights over the mean's distance from the initial ones
  (median and max over peers, from their checkpoints at the window's end): 0 for DiLoCo peers at one step, a few
  percent for NoLoCo (bench/scale_spread.py);
- round B/peer: reduce-scatter and all-gather payload bytes (NoLoCo: the group exchange's) each peer sends per
  completed round, on the wire (after the codec and zstd) and before the codec (4 bytes per value: what the round
  design sends, whatever the data);
- rendezvous B/round: rendezvous bytes (NoLoCo: matchmaking) each peer sends per completed round, the median peer's
  and the most any peer sent (DiLoCo's leader: it answers every member);
- detect s: with --churn K, one kill -9 every K seconds of a random non-bootstrap peer that has joined the swarm (not
  one still starting after its own last kill), restarted at once on its data dir; the seconds from each kill until
  each other peer logs the peer as lost, or logs that a new process took its id (median, 90th percentile and max over
  every observer that logged either), against `network.peer_timeout`; and per kill, the seconds until half of the
  observers had (median and worst kill). Observers that counted the peer live and said nothing for twice the timeout
  are counted as silent. Only observers whose own process ran from the kill until they spoke count: with one kill per
  10 s and restarts that take minutes at 64 peers, a tenth or more of the peers are dead or restarting at any time.
  With --keep, kills.json lists the kills.

With --until-step N the window also closes once the bootstrap peer has logged outer step N, so that every size's
round bytes cover the same outer steps: a 2-peer swarm runs hundreds of rounds in a 45 s window and a 64-peer one a
few, and the early steps' payloads are the larger (BENCHMARKS.md, "Scale"). The window still opens once every peer
completed a round, which is a later step at 64 peers than at 2. --from-step M (with --until-step N) adds the figure
that covers exactly steps M to N at every size: each peer's own round summaries (its Status: the wire and raw bytes it
sent in each round, by step), asked for once every peer logged step N, and the median over the peers that completed
a round at each of those steps.

Each daemon is a separate process with its own gRPC server; they share this machine's cores, so the absolute round
times are CPU-bound at large N. Ratios between sizes are what the bench is for; see ARCHITECTURE.md ("Scale") for
the paper model they check.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import statistics
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

LINE = re.compile(r"^(\S+ \S+) INFO peerd: outer step (\d+) \| .*\| peers (\d+)/(\d+) \|", re.M)
# an observer has detected a kill once it logs the peer lost, or logs that a new process took the peer's id (the
# restarted peer's gossip can reach it before the old process's silence or a failed dial does)
LOST = re.compile(r"^(\S+ \S+) WARNING peerd: peer (\w{8}) (lost|restarted): ")
SERVING = re.compile(r"^(\S+ \S+) INFO peerd: peer (\w{8}) serving run ", re.M)  # a process of a peer is up
JOINED = re.compile(r"INFO peerd: peer \w{8} joined run ")
BACK = re.compile(r"^(\S+ \S+) INFO peerd: peer (\w{8}) (?:is live again|at \S+ answers again|joined from)")
# a failed round attempt, or an outer step given up on (its rendezvous failed: the step is retried next window)
FAILED = re.compile(r"^(\S+ \S+) WARNING peerd: (?:round for step \d+ \(attempt \d+\)|outer step \d+) failed")
# a peer that sends its work through a sponsor (the swarm flagged it slow), or one of its steps while it does
SPONSORED = re.compile(
    r"^(\S+ \S+) (?:WARNING peerd: this peer's link is too slow|INFO peerd: outer step \d+ \|.*\| peers via sponsor )"
)
SURVIVED = re.compile(r"^(\S+ \S+) WARNING peerd: round for step \d+ survived the loss of")
OUTCOMES = ("complete", "partial", "failed", "solo")  # peerd_rounds_total{outcome}
PEER_TIMEOUT = 15.0  # 64 daemons share 2 cores here: a starved event loop must not read as a dead peer


def _ts(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _config(
    tmp: Path,
    params: int,
    gossip_entries: int,
    inner_steps: int = 1,
    codec: str = "fp32",
    algorithm: str = "diloco",
    group_size: int = 2,
) -> Path:
    from tests.swarm import tiny_config

    return tiny_config(
        tmp,
        run__outer_steps=0,
        run__algorithm=algorithm,
        noloco__group_size=group_size,
        model__factory="bench.scale_model:make_model",
        model__d_model=max(params // 4096, 1),
        data__factory="bench.scale_model:make_data",
        data__batch_size=1,
        data__eval_batches=1,
        inner__steps=inner_steps,
        inner__warmup_steps=1,
        # A restarted peer re-warms its fresh AdamW moments over the product default (inner.warmup_steps = 20), not
        # over this bench's 1-step warmup: a full-lr first step is 10x the converged vector model's and trips the
        # owners' norm bound (robust.max_norm_ratio), which aborts the round for everyone (seen at 64 peers).
        inner__rewarm_steps=20,
        network__gossip_interval=1.0,
        network__gossip_entries=gossip_entries,
        network__peer_timeout=PEER_TIMEOUT,
        network__rendezvous_timeout=20.0,
        # the product default (120 s): a 64-peer round takes 40-70 s here (64 daemons on 2 cores), and 60 s timed out
        # the slow ones, whose members then dropped their work for a smaller group's state
        network__round_timeout=120.0,
        network__linger=2.0,
        codec__name=codec,
    )


def _scrape(url: str) -> dict[str, float]:
    """The sent-bytes and sent-message counters of one peer's /metrics, by (name, kind)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        text = urllib.request.urlopen(f"http://{url}/metrics", timeout=3).read().decode()
        for line in text.splitlines():
            m = re.match(r"^(peerd_sent_(?:bytes|messages)_total|peerd_rounds_total)\{(.*)\} (\S+)$", line)
            kind = re.search(r'(?:kind|outcome)="(\w+)"', m[2]) if m else None
            if m and kind:
                # wire bytes by default; the raw form (4 bytes per value before the codec and zstd) gets its own key
                key = f"{m[1]}:{kind[1]}" + (":raw" if 'form="raw"' in m[2] else "")
                out[key] = out.get(key, 0.0) + float(m[3])
    return out


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def run_size(
    n: int,
    seconds: float,
    churn: float,
    params: int,
    gossip_entries: int,
    seed: int,
    keep: bool = False,
    inner_steps: int = 1,
    until_step: int = 0,
    from_step: int = 0,
    codec: str = "fp32",
    algorithm: str = "diloco",
    group_size: int = 2,
) -> dict[str, Any]:
    from bench.scale_spread import initial_weights, spread
    from tests.swarm import Swarm

    rng = random.Random(seed)
    # 64 daemons share this machine's memory: fewer malloc arenas per process (gRPC runs many threads)
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    kept = tempfile.mkdtemp(prefix=f"peerd-scale{n}-") if keep else None  # the peers' logs, for a post-mortem
    with contextlib.nullcontext(kept) if kept else tempfile.TemporaryDirectory(prefix=f"peerd-scale{n}-") as tmpdir:
        tmp = Path(tmpdir)
        cfg = _config(tmp, params, gossip_entries, inner_steps, codec, algorithm, group_size)
        swarm = Swarm(tmp, n, cfg, metrics=True, wait_peers=True)  # --wait-peers N: all start together
        with swarm:
            swarm.wait_until(lambda: all(p.proc.poll() is None for p in swarm.peers), 30, "peers up")
            for p in swarm.peers:
                p.wait_file("metrics_address", 300)
            # warm-up: every peer must have completed a round before the window opens
            swarm.wait_until(lambda: all(LINE.search(p.log()) for p in swarm.peers), 600, "first rounds")
            urls = {p.index: p.metrics_address for p in swarm.peers}
            before = {i: _scrape(u) for i, u in urls.items()}
            t0 = time.time()
            kills: list[tuple[float, str]] = []
            started = dict.fromkeys(range(n), 1)  # processes started per peer (its log holds every one's lines)
            while time.time() - t0 < seconds:
                if until_step and last_step(swarm.peers[0].log()) >= until_step:
                    break
                time.sleep(min(churn or (0.2 if until_step else seconds), max(0.0, seconds - (time.time() - t0))))
                # the victim is a member of the swarm: not a process still starting after its own last kill (at 64
                # peers restarts took 2-4 minutes here, and 28 of 154 kills in one run hit such a process, which the
                # swarm had not seen yet and which then took longer still to start)
                up = [p for p in swarm.peers[1:] if len(JOINED.findall(p.log())) >= started[p.index]] if churn else []
                if up and time.time() - t0 < seconds - 1:
                    victim = up[rng.randrange(len(up))]
                    started[victim.index] += 1
                    pid = _peer_id(victim.log())
                    victim.kill()
                    kills.append((time.time(), pid))
                    urls.pop(victim.index, None)
                    before.pop(victim.index, None)
                    swarm.peers[victim.index] = swarm.spawn(victim.index, swarm.boot_address(0))
            t1 = time.time()
            after = {i: _scrape(u) for i, u in urls.items()}
            logs = {p.index: p.log() for p in swarm.peers}
            summaries = _round_summaries(swarm, until_step) if from_step and until_step else []
            apart = spread([p.data_dir for p in swarm.peers], initial_weights(cfg))
        killed = {i for i, k in started.items() if k > 1}
        row = _report(n, t0, t1, before, after, logs, kills, killed, "pair" if algorithm == "noloco" else "reduce")
        row.update(algorithm=algorithm, group_size=group_size if algorithm == "noloco" else None, **apart)
        if from_step and until_step:
            row.update(steps_bytes(summaries, from_step, until_step))
        if kept:
            row["kept"] = kept
            Path(kept, "kills.json").write_text(json.dumps(kills))  # (time, peer id): for a post-mortem
        return row


def _round_summaries(swarm: Any, until_step: int) -> list[list[tuple[int, ...]]]:
    """Each peer's recent rounds as (step, fragment, wire bytes and raw bytes it sent, members that owned a shard: the
    members less those the group flagged, group.no_shards, and those the peer knows as outbound-only, which own
    none either; then how many of each of those two kinds), asked for once every peer logged `until_step` (a Status
    answer holds a peer's last 16 rounds: a 2-peer swarm runs on meanwhile, so ask at once)."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.suppress(TimeoutError):
        swarm.wait_until(lambda: all(last_step(p.log()) >= until_step for p in swarm.peers), 300, "the last step")

    def ask(peer: Any) -> list[tuple[int, ...]]:
        try:
            st = peer.status(timeout=20.0)
        except Exception:  # a peer that does not answer is left out of the figure, not the bench
            return []
        outbound = {p.peer_id for p in st.peers if p.outbound_only}  # never dialled, so they own no shard either
        rows = []
        for r in st.recent_rounds:
            members, flagged = set(r.included), set(r.no_shards)
            owners = members - flagged - outbound
            rows.append((r.step, r.fragment, r.wire_bytes, r.raw_bytes, len(owners), len(members & flagged),
                         len((members & outbound) - flagged)))  # fmt: skip
        return rows

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(ask, swarm.peers))


def steps_bytes(summaries: list[list[tuple[int, ...]]], lo: int, hi: int) -> dict[str, Any]:
    """The median over peers of the wire and raw bytes a peer sent per round in the rounds that reached outer steps
    lo..hi, as the logs' "outer step N" lines and the rows' "steps" number them (a round's summary carries the step
    it averaged: N - 1), from each peer's round summaries; only peers that completed every one of those whole-model
    rounds count. Also the fewest shard owners in those rounds: a member the swarm flags slow, or an outbound-only
    one, owns no shard, and each owner then sends its average to more members (S (1 + (n - 2) / owners) per owner
    for a vector of S bytes, against 2 S (n - 1) / n with every member an owner), and the most members that owned
    none for each reason (flagged, outbound-only)."""
    wire, raw, owners, flagged, outbound = [], [], [], [0], [0]
    for rounds in summaries:
        by_step = {step: rest for step, frag, *rest in rounds if frag < 0 and lo <= step + 1 <= hi}
        if len(by_step) == hi - lo + 1:
            cols = list(zip(*by_step.values(), strict=True))  # wire, raw, owners, flagged, outbound-only
            wire.append(sum(cols[0]) / len(by_step))
            raw.append(sum(cols[1]) / len(by_step))
            owners.append(min(cols[2]))
            flagged.append(max(cols[3]))
            outbound.append(max(cols[4]))
    return {
        "steps_counted": [lo, hi],
        "steps_peers": len(wire),
        "steps_owners_min": min(owners) if owners else None,
        "steps_no_shard_flagged_max": max(flagged),
        "steps_no_shard_outbound_max": max(outbound),
        "steps_round_B_per_peer": round(statistics.median(wire)) if wire else None,
        "steps_round_raw_B_per_peer": round(statistics.median(raw)) if raw else None,
    }


def last_step(log: str) -> int:
    """The highest outer step a peer's log says it completed (-1: none yet)."""
    return max((int(m.group(2)) for m in LINE.finditer(log)), default=-1)


def _peer_id(log: str) -> str:
    m = SERVING.search(log)
    return m[2] if m else ""


def step_lines(log: str, t0: float, t1: float) -> list[tuple[float, int, int, int]]:
    """(time, step, included, expected) of each outer step a peer logged in [t0, t1] as a member of the round (a
    sponsored peer's steps read "peers via sponsor" and do not match)."""
    return [
        (_ts(m[1]), int(m[2]), int(m[3]), int(m[4]))
        for line in log.splitlines()
        if (m := LINE.match(line)) and t0 <= _ts(m[1]) <= t1
    ]


def _count(pattern: re.Pattern[str], log: str, t0: float, t1: float) -> int:
    return sum(1 for line in log.splitlines() if (m := pattern.match(line)) and t0 <= _ts(m[1]) <= t1)


def record_peer(logs: dict[int, str], killed: set[int], t0: float, t1: float) -> int | None:
    """The peer whose log is the swarm's round record: the lowest-numbered one that was never killed and never sent its
    work through a sponsor in [t0, t1], so it was a member of every round it completed. Usually the bootstrap peer
    (never killed); but the swarm may flag any peer slow, the bootstrap too (run AP), and a sponsored peer's log stops
    counting rounds. The lowest index, not the peer with the most rounds, so the choice does not pick a healthy log."""
    for i in sorted(logs):
        if i not in killed and not _count(SPONSORED, logs[i], t0, t1):
            return i
    return None


def _report(
    n: int,
    t0: float,
    t1: float,
    before: dict[int, dict[str, float]],
    after: dict[int, dict[str, float]],
    logs: dict[int, str],
    kills: list[tuple[float, str]],
    killed: set[int],
    kind: str = "reduce",
) -> dict[str, Any]:
    window = t1 - t0
    record = record_peer(logs, killed, t0, t1)
    record_log = logs[record] if record is not None else ""  # no such peer: no rounds on record
    steps = step_lines(record_log, t0, t1)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps)]
    # failed attempts seen by the record peer (never killed or sponsored: a member of every round it completes)
    failed = _count(FAILED, record_log, t0, t1)
    survived = _count(SURVIVED, record_log, t0, t1)
    # the same failures at every peer (a member whose own attempt failed then downloads the swarm's state)
    failed_any = sum(_count(FAILED, log, t0, t1) for log in logs.values())
    per_peer = [_diff(after[i], before[i]) for i in after if i in before]
    gossip_b = [d.get("peerd_sent_bytes_total:gossip", 0.0) / window for d in per_peer]
    gossip_m = [d.get("peerd_sent_messages_total:gossip", 0.0) / window for d in per_peer]
    all_b = [sum(v for k, v in d.items() if k.startswith("peerd_sent_bytes_total:")) / window for d in per_peer]
    all_m = [sum(v for k, v in d.items() if k.startswith("peerd_sent_messages_total:")) / window for d in per_peer]
    # each peer's own round bytes over its own completed rounds (both counted when a round completes, so a round in
    # flight at either end of the window cannot skew the ratio)
    done = [(d, sum(d.get(f"peerd_rounds_total:{o}", 0.0) for o in ("complete", "partial"))) for d in per_peer]
    round_b = [d.get(f"peerd_sent_bytes_total:{kind}", 0.0) / k for d, k in done if k > 0]
    round_raw = [d.get(f"peerd_sent_bytes_total:{kind}:raw", 0.0) / k for d, k in done if k > 0]
    # every round outcome the peers alive at both ends of the window counted in it (NoLoCo: each peer counts its own
    # group's exchange; "solo" is an outer step that found no partner, "partial" one that lost a partner mid-way)
    outcomes = {o: round(sum(d.get(f"peerd_rounds_total:{o}", 0.0) for d in per_peer)) for o in OUTCOMES}
    # rendezvous bytes per completed round: the leader's answers (n members each, to n members) against the median
    # peer's requests, to show whether the leader is a hot spot
    rdv = [d.get("peerd_sent_bytes_total:rendezvous", 0.0) / k for d, k in done if k > 0]
    det = detection(logs, kills, t1)
    rounds = len(steps)
    return {
        "peers": n,
        "window_s": round(window, 1),
        "record_peer": record,
        "rounds": rounds,
        "steps": [steps[0][1], steps[-1][1]] if steps else None,  # the first and last outer step in the window
        "round_s": round(statistics.median(gaps), 2) if gaps else None,
        "full_share": round(sum(1 for s in steps if s[2] == s[3]) / rounds, 3) if rounds else None,
        "failed_attempts": failed,
        "survived_a_loss": survived,
        "failed_attempts_all_peers": failed_any,
        "complete_share": round(rounds / (rounds + failed), 3) if rounds + failed else None,
        "outcomes": outcomes,
        # rounds that averaged (complete or partial) among every outcome the peers counted
        "averaged_share": round((outcomes["complete"] + outcomes["partial"]) / sum(outcomes.values()), 4)
        if sum(outcomes.values())
        else None,
        "gossip_Bps": round(statistics.median(gossip_b)) if gossip_b else None,
        "gossip_msgps": round(statistics.median(gossip_m), 2) if gossip_m else None,
        "gossip_B_per_msg": round(sum(gossip_b) / sum(gossip_m)) if sum(gossip_m) else None,
        "all_Bps": round(statistics.median(all_b)) if all_b else None,
        "all_msgps": round(statistics.median(all_m), 2) if all_m else None,
        "round_B_per_peer": round(statistics.median(round_b)) if round_b else None,
        "round_raw_B_per_peer": round(statistics.median(round_raw)) if round_raw else None,
        "rendezvous_B_per_round_median": round(statistics.median(rdv)) if rdv else None,
        "rendezvous_B_per_round_max": round(max(rdv)) if rdv else None,
        "kills": len(kills),
        **det,
        **false_losses(logs, kills, t0, t1),
        "peer_timeout": PEER_TIMEOUT,
    }


def false_losses(logs: dict[int, str], kills: list[tuple[float, str]], t0: float, t1: float) -> dict[str, Any]:
    """Live peers counted out: "lost" lines in the window [t0, t1] for a peer not killed in the 60 s before. Also what
    said so (`_how`), and how soon that observer heard from the peer again (a "back" line after it): a peer heard
    from seconds after a silence verdict was only slow to reach it, which is what bounded gossip under CPU
    starvation does (BENCHMARKS.md, "Scale", stop 44)."""
    killed_at: dict[str, list[float]] = {}
    for at, pid in kills:
        killed_at.setdefault(pid, []).append(at)
    count, by, probes, back = 0, {}, {}, []
    for log in logs.values():
        pending: dict[str, float] = {}  # peer -> when this observer counted it out
        for line in log.splitlines():
            if (b := BACK.match(line)) and b[2] in pending:
                back.append(_ts(b[1]) - pending.pop(b[2]))
                continue
            m = LOST.match(line)
            if not (m and m[3] == "lost" and t0 <= (t := _ts(m[1])) <= t1):
                continue
            if not any(at <= t <= at + 60 for at in killed_at.get(m[2], [])):
                count += 1
                how = _how(line)
                by[how] = by.get(how, 0) + 1
                pending[m[2]] = t
                if how == "silent":
                    probe = _probe_end(line)
                    probes[probe] = probes.get(probe, 0) + 1
    back.sort()
    return {
        "false_losses": count,
        "false_by": dict(sorted(by.items(), key=lambda kv: -kv[1])),
        "false_silent_probes": dict(sorted(probes.items(), key=lambda kv: -kv[1])),
        "false_back_s_median": round(statistics.median(back), 2) if back else None,
        "false_back_s_p90": round(back[int(0.9 * (len(back) - 1))], 2) if back else None,
    }


def _uptimes(logs: dict[int, str], kills: list[tuple[float, str]]) -> dict[int, list[tuple[float, float]]]:
    """Each log's process lifetimes: from each "serving run" line to the next kill of that peer (a restarted peer's
    log holds every process it ran)."""
    out: dict[int, list[tuple[float, float]]] = {}
    for i, log in logs.items():
        starts = [(_ts(m[1]), m[2]) for m in SERVING.finditer(log)]
        out[i] = [(s, min((t for t, p in kills if p == pid and t > s), default=float("inf"))) for s, pid in starts]
    return out


def _probe_end(line: str) -> str:
    """How the direct probes of a peer counted out by silence went, from its "lost" line (Membership.probe_note):
    "not probed", or the last probe's end ("answered", a gRPC status, "running")."""
    m = re.search(r"probed \d+x, last (\w+)", line)
    return m[1] if m else "not probed"


def _how(line: str) -> str:
    """What a "lost"/"restarted" line says found the peer: "silent", "restarted", or the call that failed."""
    if " restarted: " in line:
        return "restarted"
    if " lost: silent " in line:
        return "silent"
    m = re.search(r"lost: unreachable \((\w+)", line)
    return m[1] if m else "unreachable"


def detection(logs: dict[int, str], kills: list[tuple[float, str]], t1: float) -> dict[str, Any]:
    """Failure detection per kill: the seconds until each other peer logged the victim lost or restarted.

    An observer counts only while its own process runs: one that was itself killed and not yet serving again at
    the kill, or that died before it said anything, had nothing to detect with (in run Q, 733 such pairs had been
    counted as observers silent past twice the timeout)."""
    detect: list[float] = []
    half: list[float] = []  # per kill: seconds until half of the observers that counted the peer live had said so
    missed = down = 0
    by: dict[str, int] = {}  # what told the observers: silence, a refused probe or gossip call, a round, a restart
    ids = {i: {m[2] for m in SERVING.finditer(log)} for i, log in logs.items()}  # each log's own peer id
    lives = _uptimes(logs, kills)
    for k, (at, pid) in enumerate(kills):
        if not pid:
            continue
        # a line belongs to this kill only until the same peer is killed again (it was restarted in between)
        until = next((t for t, p in kills[k + 1 :] if p == pid), at + 60)
        end = min(until, at + 60, t1)  # not a later flap of the restarted process, minutes on
        mine: list[float] = []
        watching = 0
        for i, log in logs.items():
            if pid in ids.get(i, ()):
                continue  # the victim's own log
            life = next(((s, e) for s, e in lives.get(i, []) if s <= at < e), None)
            if life is None:
                down += 1  # this observer was itself dead or restarting when the victim was killed
                continue
            live = True  # whether this observer counted the peer live when it was killed (its own lines say)
            said, how = None, ""
            for line in log.splitlines():
                m = LOST.match(line)
                if m and m[2] == pid and _ts(m[1]) < at:
                    live = m[3] == "restarted"  # a new process of it is live; "lost": counted out
                elif (b := BACK.match(line)) and b[2] == pid and _ts(b[1]) < at:
                    live = True
                elif m and m[2] == pid and at <= _ts(m[1]) < end:  # not in the teardown after the window
                    said, how = _ts(m[1]), _how(line)
                    break
            if not live:
                continue  # one that had already counted it out (a false loss before) had nothing to detect
            if life[1] <= (said if said is not None else end):
                down += 1  # killed itself before it said anything (or its line is a later process's)
                continue
            watching += 1
            if said is not None:
                mine.append(said - at)
                by[how] = by.get(how, 0) + 1
            elif end - at >= 2 * PEER_TIMEOUT:
                missed += 1  # it counted the peer live, and said nothing for twice the timeout
        detect += mine
        if watching and len(mine) * 2 >= watching:
            half.append(sorted(mine)[(watching + 1) // 2 - 1])
    detect.sort()
    return {
        "detect_s_median": round(statistics.median(detect), 2) if detect else None,
        "detect_s_max": round(detect[-1], 2) if detect else None,
        "detect_s_p90": round(detect[int(0.9 * (len(detect) - 1))], 2) if detect else None,
        "half_detect_s_median": round(statistics.median(half), 2) if half else None,
        "half_detect_s_max": round(max(half), 2) if half else None,
        "detections": len(detect),
        "detect_late": sum(1 for d in detect if d > 2 * PEER_TIMEOUT),
        "detect_missed": missed,
        "observers_down": down,
        "detected_by": dict(sorted(by.items(), key=lambda kv: -kv[1])),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default="8,16,32,64", help="comma-separated swarm sizes")
    ap.add_argument("--seconds", type=float, default=60.0, help="measurement window per size")
    ap.add_argument("--churn", type=float, default=0.0, help="kill -9 and restart one peer every this many seconds")
    ap.add_argument("--params", type=int, default=1 << 20, help="parameters of the vector model")
    ap.add_argument("--gossip-entries", type=int, default=8, help="network.gossip_entries")
    ap.add_argument(
        "--inner-steps", type=int, default=1, help="AdamW steps per outer step: 1 keeps compute out of the figures, "
        "more makes the payload a sum of steps, as a real run's is (python -m bench.zstd_averages --inner-steps)"
    )  # fmt: skip
    ap.add_argument(
        "--until-step", type=int, default=0, help="also close the window once the bootstrap peer logged this outer "
        "step: every size's round bytes then cover the same steps"
    )  # fmt: skip
    ap.add_argument(
        "--from-step", type=int, default=0, help="with --until-step: also give the round bytes per peer over exactly "
        "these outer steps, at every size, from the peers' own round summaries"
    )  # fmt: skip
    ap.add_argument("--algorithm", default="diloco", choices=("diloco", "noloco"), help="run.algorithm")
    ap.add_argument("--group-size", type=int, default=2, help="noloco.group_size: peers per NoLoCo exchange")
    ap.add_argument("--codec", default="fp32", help="codec.name (fp32, the product default, unless set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep every peer's data dir and log (the path is printed)")
    args = ap.parse_args(argv)
    if args.from_step and not 0 < args.until_step - args.from_step + 1 <= 12:
        ap.error("--from-step M needs --until-step N, M <= N, at most 12 steps (Status holds a peer's last 16 rounds)")
    rows = []
    for n in (int(x) for x in args.peers.split(",")):
        row = run_size(
            n, args.seconds, args.churn, args.params, args.gossip_entries, args.seed, args.keep, args.inner_steps,
            args.until_step, args.from_step, args.codec, args.algorithm, args.group_size,
        )  # fmt: skip
        rows.append(row)
        steps_note = (
            f"over steps {row['steps_counted']} {row['steps_round_B_per_peer']} B/peer "
            f"({row['steps_round_raw_B_per_peer']} before the codec; {row['steps_peers']} peers, at least "
            f"{row['steps_owners_min']} shard owners; owning none, at most {row['steps_no_shard_flagged_max']} "
            f"flagged and {row['steps_no_shard_outbound_max']} outbound-only), "
            if "steps_counted" in row
            else ""
        )
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(
                f"{n:3d} peers ({args.algorithm}"
                f"{f', groups of {args.group_size}' if args.algorithm == 'noloco' else ''}): "
                f"{row['rounds']} rounds (steps {row['steps']}) at peer {row['record_peer']}, "
                f"{row['round_s']} s/round, "
                f"full {row['full_share']}, "
                f"failed attempts {row['failed_attempts']} ({row['complete_share']} completed), "
                f"outcomes at all peers {row['outcomes']} ({row['averaged_share']} averaged), "
                f"spread {row['spread_median']}/{row['spread_max']} (median/max over {row['spread_peers']} peers), "
                f"survived a loss {row['survived_a_loss']}, failed attempts at any peer "
                f"{row['failed_attempts_all_peers']}, "
                f"gossip {row['gossip_Bps']} B/s "
                f"{row['gossip_msgps']} msg/s per peer ({row['gossip_B_per_msg']} B/msg; "
                f"all traffic {row['all_Bps']} B/s {row['all_msgps']} msg/s), "
                f"round {row['round_B_per_peer']} B/peer ({row['round_raw_B_per_peer']} before the codec), "
                f"{steps_note}"
                f"rendezvous {row['rendezvous_B_per_round_median']} B/round per peer (max "
                f"{row['rendezvous_B_per_round_max']}), kills {row['kills']}, "
                f"detect {row['detect_s_median']}/{row['detect_s_p90']}/{row['detect_s_max']} s (median/p90/max) over "
                f"{row['detections']} observations ({row['detect_late']} past 2x the timeout), "
                f"{row['detect_missed']} observers "
                f"silent past 2x the timeout ({row['observers_down']} observers not running then, not counted) "
                f"(timeout {row['peer_timeout']}), half the swarm knew after {row['half_detect_s_median']} s "
                f"(worst kill {row['half_detect_s_max']} s), detected by {row['detected_by']}, "
                f"{row['false_losses']} live peers counted lost (by {row['false_by']}; those by silence, by how their "
                f"last direct probe ended: {row['false_silent_probes']}; heard from again after "
                f"{row['false_back_s_median']}/{row['false_back_s_p90']} s, median/p90)",
                flush=True,
            )


if __name__ == "__main__":
    main()
