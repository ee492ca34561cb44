"""The paper model of a DiLoCo swarm's per-peer costs, with NoLoCo's bounded groups beside it (ARCHITECTURE.md,
"Scale"): what each peer and the round leader send per round and per second as the swarm grows, and what limits
first. bench.scale measures the same quantities at 8-64 peers on this machine; `python -m bench.scale_paper` prints
the extrapolation to 1,000 peers.

    python -m bench.scale_paper [--params 1e9] [--bytes-per-param 1] [--peers 8,64,256,1000] [--mbit 20,100,1000]

Symbols: n peers, P parameters, b wire bytes per parameter (fp32 4, int8 1, e3m0 0.5), R link rate (bytes/s, each way),
E bytes of one signed peer entry (about 275 without TLS, 675 with its certificate; 23 of them the heartbeat chain), E_r
bytes of a group's member entry (rendezvous.round_entry: about 130 without TLS, 530 with it), K gossip entries per
message (network.gossip_entries), f = 3 gossip targets per interval g, T = peer_timeout, c member entries that change
between a member's consecutive groups (joins, deaths, restarts: peerd/group_delta.py sends only those), w bytes per
member that a delta answer still carries (its token claim and join lag: about 5), H a delta answer's fixed bytes (about
60).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

PART = 256 * 1024  # bytes per pipelined Reduce part (peerd/allreduce.py)
FANOUT = 3  # gossip targets per interval (peerd/gossip.py)
PROBE_AT = 0.6  # an entry this far into peer_timeout is probed directly (Membership.expiring)


@dataclass(frozen=True)
class Swarm:
    n: int
    params: float = 1e6
    bytes_per_param: float = 4.0
    mbit: float = 1000.0
    entry: float = 275.0
    round_entry: float = 130.0
    gossip_entries: int = 8
    interval: float = 1.0
    peer_timeout: float = 10.0
    changed: float = 2.0
    per_member: float = 5.0
    answer_fixed: float = 60.0

    @property
    def rate(self) -> float:
        return self.mbit * 1e6 / 8

    def allreduce_bytes(self) -> float:
        """Reduce-scatter plus all-gather: each peer sends (and receives) 2 P b (n-1)/n per round, under 2x its own
        contribution whatever n is."""
        return 2 * self.params * self.bytes_per_param * (self.n - 1) / self.n

    def group_bytes(self, group_size: int = 2) -> float:
        """NoLoCo instead: each member of a group of g sends its tensor to the g-1 others, (g-1) P b per round
        whatever n is (peerd/pair_exchange.py); no leader, and matchmaking is a proposal and an answer of a few dozen
        bytes per step."""
        return (min(group_size, self.n) - 1) * self.params * self.bytes_per_param

    def allreduce_messages(self) -> float:
        """Stream parts a peer sends per round: one set of parts per other member and direction."""
        shard = self.params * self.bytes_per_param / self.n
        return 2 * (self.n - 1) * max(1, math.ceil(shard / PART))

    def leader_bytes(self) -> float:
        """The leader answers each of the n members with the changes from its previous group (peerd/group_delta.py):
        n (H + c E_r + n w) per round. Whole groups were n^2 E_r."""
        return self.n * (self.answer_fixed + self.changed * self.round_entry + self.n * self.per_member)

    def whole_leader_bytes(self) -> float:
        """What whole-group answers took (a member's first round, or one whose previous group another peer led)."""
        return self.n * self.n * self.round_entry

    def gossip_copies(self) -> float:
        """Copies of one given entry a peer receives before it would probe it: pushes and pull answers, each with K
        of the sender's n-1 entries, over PROBE_AT x T."""
        per_interval = 2 * FANOUT * min(1.0, self.gossip_entries / max(self.n - 1, 1))
        return per_interval * PROBE_AT * self.peer_timeout / self.interval

    def gossip_probes_per_s(self) -> float:
        """Direct probes a peer makes per second for entries no gossip brought in time (Poisson estimate)."""
        if self.n - 1 <= self.gossip_entries:
            return 0.0
        missed = (self.n - 1) * math.exp(-self.gossip_copies())
        return missed / (PROBE_AT * self.peer_timeout)

    def gossip_bytes_per_s(self) -> float:
        """What one peer sends for membership: f requests and about f answers per interval, K+1 entries each,
        plus a request and an answer per probe."""
        msg = (min(self.gossip_entries, self.n - 1) + 1) * self.entry
        return (2 * FANOUT / self.interval + 2 * self.gossip_probes_per_s()) * msg

    def round_seconds(self) -> float:
        """The link-bound floor of one round: the all-reduce at line rate, or the leader's answers if those take
        longer (they go out before any member can start)."""
        return self.leader_bytes() / self.rate + self.allreduce_bytes() / self.rate

    def limit(self) -> str:
        ar, lead = self.allreduce_bytes() / self.rate, self.leader_bytes() / self.rate
        gossip_share = self.gossip_bytes_per_s() / self.rate
        if gossip_share > 0.1:
            return f"gossip ({100 * gossip_share:.0f}% of the link)"
        return "leader's group answers" if lead > ar else "all-reduce bandwidth"


def success(n: int, attempt_s: float, kills_per_s: float) -> float:
    """Chance an all-or-nothing round attempt of `attempt_s` sees no member die, with kills spread over the swarm at
    `kills_per_s` (the bench's churn is 0.1/s whatever n is; volunteers' own churn grows with n)."""
    del n
    return math.exp(-kills_per_s * attempt_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scale_paper", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--bytes-per-param", type=float, default=1.0, help="wire bytes per parameter (int8: 1)")
    ap.add_argument("--peers", default="8,64,256,1000")
    ap.add_argument("--mbit", default="20,100,1000")
    ap.add_argument("--entry", type=float, default=675.0, help="bytes of one signed peer entry (TLS: ~675)")
    ap.add_argument("--round-entry", type=float, default=530.0, help="bytes of a group's member entry (TLS: ~530)")
    ap.add_argument("--gossip-entries", type=int, default=8)
    ap.add_argument("--changed", type=float, default=2.0, help="member entries that change per round (churn)")
    ap.add_argument("--group-size", type=int, default=2, help="NoLoCo's noloco.group_size, for its column")
    args = ap.parse_args(argv)
    print(
        "| peers | link | all-reduce s | leader s (whole groups) | gossip KB/s | probes/s | round floor s | "
        f"limits first | NoLoCo groups of {args.group_size} s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mbit in (float(x) for x in args.mbit.split(",")):
        for n in (int(x) for x in args.peers.split(",")):
            s = Swarm(
                n, args.params, args.bytes_per_param, mbit, args.entry, args.round_entry, args.gossip_entries,
                changed=args.changed,
            )  # fmt: skip
            print(
                f"| {n} | {mbit:g} Mbit/s | {s.allreduce_bytes() / s.rate:.1f} | {s.leader_bytes() / s.rate:.2f} "
                f"({s.whole_leader_bytes() / s.rate:.1f}) | "
                f"{s.gossip_bytes_per_s() / 1e3:.1f} | {s.gossip_probes_per_s():.2f} | {s.round_seconds():.1f} | "
                f"{s.limit()} | {s.group_bytes(args.group_size) / s.rate:.1f} |"
            )


if __name__ == "__main__":
    main()
