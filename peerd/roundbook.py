"""The record of each completed DiLoCo / Streaming round: whom it included against whom the run expected (so a
partial round, a solo step or training alone is counted and shown, never dressed up as healthy), its bytes and
outcome in status, logs and metrics, and what its per-member timings say about who is slow (peerd/timings.py),
including this peer itself (`self_evidence`, for gossip's one-line diagnosis). The round client
(peerd/roundclient.py) runs the rounds; this module only books them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from peerd.rendezvous import included_tokens
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.allreduce import RoundResult
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")


class RoundBook:
    """One daemon's round bookkeeping (`daemon.round_client.book`)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.self_evidence = ""  # why this peer itself looks slow in its last round (for the one-line diagnosis)

    def observe_timings(
        self,
        group: pb.Group,
        arrival_s: dict[str, float],
        stream_s: dict[str, tuple[float, int]] | None = None,
        reply_s: dict[str, float] | None = None,
    ) -> None:
        """Feed one completed round's per-member timings to peerd/timings.py: how late each member joined (the
        leader's lag) plus, for shards we own, how late its contribution arrived and how fast its stream moved; and
        the tokens behind it."""
        ids = [m.peer_id for m in group.members]
        lags = list(group.join_lag_ms) if len(group.join_lag_ms) == len(ids) else [0] * len(ids)
        # Measures judged apart: joining late (slow compute, or a previous round that ended late for it), its
        # contribution reaching our shard late, its averaged shard reaching us late (a slow uplink). Summed, a slow
        # owner hid behind the others, who join late because its averaged shard reached them late.
        lag_s = {pid: ms / 1000.0 for pid, ms in zip(ids, lags, strict=True)}
        if group.fragment >= 0:
            # Streaming: a fragment round starts when each peer's schedule reaches it, which differs by design (a
            # peer that waited longer at its cycle boundary starts later): joining late there is no sign of slowness
            lag_s = {}
        tokens = dict(zip(ids, group.tokens, strict=True)) if len(group.tokens) == len(ids) else None
        timing = self.d.timing.local
        streams = stream_s or {}
        throughput = {pid: n / max(sec, 1e-6) for pid, (sec, n) in streams.items()}
        timing.round(
            lag_s=lag_s,
            tokens=tokens,
            throughput=throughput,
            stream_s={p: v[0] for p, v in streams.items()},
            delivery_s=dict(arrival_s),
            reply_s=dict(reply_s or {}),
        )
        timing.succeeded(ids)
        me = self.d.identity.peer_id
        if tokens and len(tokens) >= 3:
            others = sorted(t for pid, t in tokens.items() if pid != me)
            self.self_evidence = (
                f"your compute is the bottleneck: {tokens[me]} tokens per window vs {others[len(others) // 2]} (median)"
                if tokens[me] * timing.ratio < others[len(others) // 2]
                else ""
            )
        if not self.self_evidence and len(lag_s) >= 3:  # compute: we join the rounds last
            mine, rest = lag_s[me], sorted(v for pid, v in lag_s.items() if pid != me)
            if mine > 0.5 and mine > timing.lag_ratio * rest[len(rest) // 2]:
                self.self_evidence = f"your contribution comes last: {mine:.1f} s after the others' median"

    def record_round(
        self, group: pb.Group, result: RoundResult, fragment: int, note: str = "", rendezvous_s: float = 0.0
    ) -> None:
        s = result.stats
        # DiLoCo, Streaming and ddp rounds (recorded on the loop) are judged against the run, not the shrunken live
        # set: peers seen live within network.forget_after count as expected, so a round held by one half of a split
        # is partial, and a round of one is a solo step. (ddp was judged by its group: a leader that trained 13 steps
        # without the other, live peer said "peers 1/1" and counted no solo step.) NoLoCo's rounds are pairs by
        # design and judged by their group (recorded from the training thread, which never reads the table); it
        # counts its own solo steps.
        run_level = self.d.cfg.run.algorithm in ("diloco", "streaming", "ddp")
        # Sponsored peers (peerd/sponsor.py) are in a round when a member carried their work, and otherwise not
        # expected in it: their link brings their work every few rounds, by design.
        sponsored = self.d.membership.sponsored() if run_level else set()
        expected = (
            sorted((set(group.expected) | set(self.d.membership.expected())) - (sponsored - set(result.carried)))
            if run_level
            else list(group.expected)
        )
        included = [*result.included, *(c for c in result.carried if c not in result.included)]
        # the leader's expected list may name a peer that turned sponsored as the group formed
        left_out = set(group.expected) - set(included) - (sponsored - set(result.carried))
        partial = bool(left_out) or len(set(included)) < len(expected)
        partial = partial or (run_level and self.d.alone.run_shrank_to_us(len(set(included))))
        solo = len(set(included)) <= 1
        solo_step = run_level and solo  # NoLoCo keeps its old accounting: a lost partner is a partial step
        summary = pb.RoundSummary(
            step=group.step,
            algorithm=self.d.cfg.run.algorithm,
            included=included,
            expected=expected,
            partial=partial,
            raw_bytes=s.raw_bytes,
            wire_bytes=s.wire_bytes,
            seconds=s.seconds,
            note=note,
            fragment=fragment,
            tokens=included_tokens(group, included),
            leader=group.leader,
            no_shards=list(group.no_shards),
            part_bytes=group.part_bytes,
        )
        self.d.status.last_round = summary
        self.d.status.recent_rounds.append(summary)
        self.d.status.bytes_sent_raw += s.raw_bytes
        self.d.status.bytes_sent_wire += s.wire_bytes
        self.d.status.bytes_received_wire += s.received_wire_bytes
        if run_level:  # NoLoCo says "no partner ...; stepped alone" for each such step itself
            self.note_alone(len(set(included)), len(expected))
        if solo_step:
            self.d.status.solo_steps += 1
        elif partial:
            self.d.status.rounds_partial += 1
            missing = sorted(set(expected) - set(included))
            log.warning(
                "step %d: PARTIAL round: averaged %d of %d expected peers (missing %s)",
                group.step,
                len(included),
                len(expected),
                [m[:8] for m in missing],
            )
        if self.d.metrics is not None:
            m = self.d.metrics
            outcome = "solo" if solo_step or (solo and not partial) else ("partial" if partial else "complete")
            m.record_round(
                outcome,
                peers=len(included),
                total_seconds=s.seconds,
                rendezvous_seconds=rendezvous_s,
                exchange_seconds=max(s.seconds - rendezvous_s, 0.0),
            )
            kind = "pair" if self.d.cfg.run.algorithm == "noloco" else "reduce"
            m.record_sent(kind, s.raw_bytes, s.wire_bytes, messages=max(s.messages, 1))
            m.record_received(kind, s.received_wire_bytes * s.raw_bytes // max(s.wire_bytes, 1), s.received_wire_bytes)

    def note_alone(self, included: int, expected: int) -> None:
        line = self.d.alone.update(included, expected)
        if line is not None:
            (log.warning if included <= 1 else log.info)(line)
        if self.d.metrics is not None:
            self.d.metrics.alone.set(1 if self.d.alone.alone_since is not None else 0)
