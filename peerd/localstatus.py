"""This peer's own status: the counters the training loop and the daemon keep (`LocalStatus`), and the
StatusResponse built from them and the swarm view (`status_message`), which Status RPCs answer with.

(`peerd/status.py` is the other side: the `peerd status` client that asks for and prints it.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon


@dataclass
class LocalStatus:
    """What the training loop reports; read by Status RPCs, metrics and the demo."""

    state: str = "joining"
    inner_step: int = 0
    outer_step: int = 0
    loss: float = math.nan
    eval_loss: float = math.nan
    tokens_per_second: float = 0.0
    compute_seconds: float = 0.0
    compute_idle_seconds: float = 0.0
    bytes_sent_raw: int = 0
    bytes_sent_wire: int = 0
    bytes_received_wire: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    rejected_messages: int = 0
    rejected_contributions: int = 0
    solo_steps: int = 0
    steps_sat_out: int = 0  # of rounds_failed: an owner refused our contribution and we sat the step out
    state_downloads: int = 0
    forks_healed: int = 0
    finished: bool = False
    last_round: pb.RoundSummary | None = None
    recent_rounds: deque = field(default_factory=lambda: deque(maxlen=1024))
    history: deque = field(default_factory=lambda: deque(maxlen=64))  # dicts of OuterStepRecord fields


def round_record(r: pb.RoundSummary, default_part_bytes: int) -> dict:
    """One round as summary.json keeps it (plain ints, unlike MessageToDict's strings for 64-bit fields), for the
    demo's per-step lines and the benchmarks. `default_part_bytes` stands in for 0, the default part size."""
    return {
        "step": r.step,
        "fragment": r.fragment,
        "included": list(r.included),
        "expected": list(r.expected),
        "partial": r.partial,
        "seconds": r.seconds,
        "raw_bytes": r.raw_bytes,
        "wire_bytes": r.wire_bytes,
        "note": r.note,
        "tokens": list(r.tokens),
        "leader": r.leader,
        "no_shards": list(r.no_shards),
        "part_bytes": r.part_bytes or default_part_bytes,
    }


def status_message(d: Daemon, redact: bool = False) -> pb.StatusResponse:
    """This peer's view. `redact` (a caller not admitted to a non-open run) withholds every other peer's id and
    address: the peer list, the live set and round membership."""
    s = d.status
    msg = pb.StatusResponse(
        run_id=d.run_id.hex(),
        peer_id=d.identity.peer_id,
        address=d.me.address,
        algorithm=d.cfg.run.algorithm,
        codec=d.cfg.codec.name,
        outer_step=s.outer_step,
        inner_step=s.inner_step,
        loss=s.loss,
        eval_loss=s.eval_loss,
        tokens_per_second=s.tokens_per_second,
        peers=d.membership.gossip_view(),
        alive=[p.peer_id for p in d.membership.alive()],
        last_round=s.last_round,
        bytes_sent_raw=s.bytes_sent_raw,
        bytes_sent_wire=s.bytes_sent_wire,
        bytes_received_wire=s.bytes_received_wire,
        compute_idle_seconds=s.compute_idle_seconds,
        compute_seconds=s.compute_seconds,
        rounds_partial=s.rounds_partial,
        rounds_failed=s.rounds_failed,
        rejected_messages=s.rejected_messages,
        solo_steps=s.solo_steps,
        steps_sat_out=s.steps_sat_out,
        recent_rounds=list(s.recent_rounds)[-16:],
        finished=s.finished,
        state=s.state,
        history=[pb.OuterStepRecord(**h) for h in list(s.history)[-16:]],
        banned=d.bans.banned(),
        rejected_contributions=s.rejected_contributions,
        work=d.me.work,
        state_downloads=s.state_downloads,
        forks_healed=s.forks_healed,
        alone_since=d.alone.status,
        expected=d.membership.expected(),
        reachability=d.reach.line(),
        relayed_bytes=d.relay_server.relayed_bytes,
    )
    if redact:
        msg.redacted = True
        for name in ("peers", "alive", "banned", "expected"):
            msg.ClearField(name)
        for rnd in [*([msg.last_round] if msg.HasField("last_round") else []), *msg.recent_rounds]:
            rnd.ClearField("included")
            rnd.ClearField("expected")
    return msg
