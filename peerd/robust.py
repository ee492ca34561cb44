"""Poisoning defence: contributions are checked before they are averaged, averaged robustly if the run asks, and
peers that keep sending invalid data are banned.

Only a shard's owner sees the contributions to its shard, so the owner judges them: each contribution's norm is
compared with a reference the owner trusts: its *own* pseudo-gradient for that shard (now, and its recent history)
and, with three or more contributions, their upper median (which a minority cannot raise past an honest value, and
which keeps an owner whose own update happens to be tiny from refusing honest peers). An offender makes the owner
abort the round, before any average leaves it, naming the offender as suspect; the members retry without it, so
every shard of the final average covers the same peers (a round is never silently partial). An honest peer named so
sits the step out rather than retry with the same work (roundtypes.ContributionRefused).

Members check the averaged shards the owners send back against the lower median of all shards' norms. Every member
receives the same bytes from every owner that is honest with it, so every member reaches the same verdict: a
poisoning owner fails the round for all, never for some (which would split the swarm's global state). A two-peer
round has no median to compare with; there each side relies on its own check as owner.

Aggregation (``[robust] aggregation``) is computed by the owner alone and sent as encoded bytes that every member
decodes, so a robust statistic costs no extra agreement: ``mean``, coordinate-wise ``trimmed_mean``, or
``clipped_mean`` (each contribution's norm clipped to a multiple of the median norm).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

import torch

from peerd.config import RobustSection

# Invalid data a peer signed and sent: these count towards a ban. Transport trouble (truncated streams, timeouts)
# and envelope failures (a bad signature may be someone else's forgery) never do: they cannot be pinned on the key.
STRIKE_REASONS = frozenset(
    {"nan", "malformed", "oversized", "wrong_shape", "wrong_codec", "duplicate", "not_member", "too_large"}
)
HISTORY = 8  # own recent norms kept per fragment
NOLOCO_KEY = -2  # the own-norm history of NoLoCo deltas (fragments are >= -1)


class ContributionRejected(ValueError):
    """Contributions refused by the owner's checks; `offenders` are their members' indices in the round."""

    def __init__(self, offenders: list[int], message: str) -> None:
        super().__init__(message)
        self.offenders = offenders


def lower_median(values: Sequence[float]) -> float:
    """The lower of the two middle values: with n >= 3, a minority of outliers on either side cannot move it past
    an honest value."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def upper_median(values: Sequence[float]) -> float:
    """The higher of the two middle values (the median itself for an odd count): with n >= 3 and a strict minority
    of outliers it is still an honest value. The owners' norm screen uses it: with four members, two CPU-starved
    ones in lr warm-up put the lower median at their tiny norm, and an honest peer 15x above it was refused (CI)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def rms(t: torch.Tensor) -> float:
    """Root-mean-square: a norm that does not depend on how many elements a shard happens to have."""
    return float(torch.linalg.vector_norm(t.float())) / math.sqrt(t.numel()) if t.numel() else 0.0


class ContributionGuard:
    """One daemon's checks and aggregation rule, plus its own recent pseudo-gradient norms (per fragment)."""

    def __init__(self, cfg: RobustSection) -> None:
        self.aggregation = cfg.aggregation
        self.max_norm_ratio = cfg.max_norm_ratio
        self.trim_fraction = cfg.trim_fraction
        self.clip_ratio = cfg.clip_ratio
        self._own: dict[int, deque[float]] = {}
        # Comparing different shards' averages assumes every part of the vector has a similar scale: true of
        # pseudo-gradients (Adam normalises each coordinate's steps), false of raw gradients (ddp), whose scale
        # differs by layer; the owner-side check compares like with like and stays on.
        self.compare_shards = True

    def reference(self, fragment: int, own_rms: float) -> float:
        """The scale contributions are judged against: our own now, or our recent median if that is larger (our
        own pseudo-gradient may be small this round, which must not make honest peers' look hostile)."""
        hist = self._own.get(fragment)
        past = statistics.median(hist) if hist else 0.0
        return max(own_rms, past)

    def record_own(self, fragment: int, own_rms: float) -> None:
        if math.isfinite(own_rms) and own_rms > 0:
            self._own.setdefault(fragment, deque(maxlen=HISTORY)).append(own_rms)

    def too_large(self, value_rms: float, reference: float) -> bool:
        if self.max_norm_ratio <= 0 or reference <= 0:
            return False  # off, or nothing to judge by: the aggregation rule is the only defence left
        return not math.isfinite(value_rms) or value_rms > self.max_norm_ratio * reference

    def screen(
        self, fragment: int, me: int, contribs: Sequence[torch.Tensor], weights: Sequence[float] | None = None
    ) -> None:
        """Raise ContributionRejected naming every contribution whose norm is out of bounds; records our own."""
        self.screen_norms(fragment, me, [rms(c) for c in contribs], weights)

    def screen_norms(
        self, fragment: int, me: int, norms: Sequence[float], weights: Sequence[float] | None = None
    ) -> None:
        """`screen` on the contributions' RMS norms alone: a pipelined round (peerd/allreduce.py) sums each
        contribution's squares part by part as the parts arrive, and screens the whole before its last part leaves.

        `weights`: in a token-weighted group member i sent its pseudo-gradient times its weight w_i, and a peer
        that did k x our work honestly has a larger pseudo-gradient too (seen: 38x the steps in a windowed run gave
        10.5x the pseudo-gradient, and the weighted norms differed by 40x). So each norm is judged with its weight
        divided out, and against our reference scaled by the work it claims beyond ours, max(1, w_i / w_me).
        Claims count for at most rendezvous.MAX_WEIGHT_RATIO x the group's lower median, which bounds both."""
        if weights is not None and weights[me] > 0:
            mine = weights[me]
            norms = [n / w / max(1.0, w / mine) if w > 0 else n for n, w in zip(norms, weights, strict=True)]
        own = norms[me]
        ref = max(self.reference(fragment, own), upper_median(norms) if len(norms) >= 3 else 0.0)
        self.record_own(fragment, own)
        bad = [i for i, n in enumerate(norms) if i != me and self.too_large(n, ref)]
        if bad:
            worst = max(norms[i] for i in bad)
            per = " per claimed work" if weights is not None else ""
            raise ContributionRejected(
                bad, f"contribution norm{per} {worst:.3g} exceeds {self.max_norm_ratio:g} x this owner's {ref:.3g}"
            )

    def screen_replies(self, me: int, replies: Sequence[torch.Tensor]) -> list[int]:
        """Member side: indices of averaged shards (other owners' only) far above the lower median of all of them.
        Depends only on the bytes every member received alike, so all members agree."""
        return self.screen_reply_norms(me, [rms(r) for r in replies])

    def screen_reply_norms(self, me: int, norms: Sequence[float]) -> list[int]:
        """`screen_replies` on the averaged shards' RMS norms alone."""
        if len(norms) < 3 or not self.compare_shards:
            return []
        ref = lower_median(norms)
        return [j for j, n in enumerate(norms) if j != me and self.too_large(n, ref)]

    def screen_partners(
        self, own: Mapping[str, torch.Tensor], partners: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> dict[str, str]:
        """NoLoCo has no shard owner: each peer judges its partners' (delta, phi offset) itself, before averaging
        with them. A delta is judged like a contribution, against our own (and our recent ones); the gap between a
        partner's slow weights and ours against how far ours moved from the shared reference, or our delta's scale
        if larger. Returns {partner: why} for those out of bounds; records our own delta's norm.

        Without send-ahead partners send one tensor, "mix" (beta * delta + gamma * (phi - phi_ref)), and `own` holds
        our mix beside our delta and phi: a partner's gap to our mix is judged against our mix's scale, or our
        recent delta scale if larger (a huge delta and far-away slow weights both show up in that gap)."""
        own_rms = rms(own["pair"])
        ref = self.reference(NOLOCO_KEY, own_rms)
        self.record_own(NOLOCO_KEY, own_rms)
        gap_ref = max(rms(own["phi"]), ref)
        bad: dict[str, str] = {}
        if "mix" in own:
            mix_ref = max(rms(own["mix"]), ref)
            for pid, theirs in partners.items():
                gap = rms(theirs["mix"] - own["mix"])
                if self.too_large(gap, mix_ref):
                    bad[pid] = f"combined update {gap:.3g} from ours, over {self.max_norm_ratio:g} x {mix_ref:.3g}"
            return bad
        for pid, theirs in partners.items():
            delta, gap = rms(theirs["pair"]), rms(theirs["phi"] - own["phi"])
            if self.too_large(delta, ref):
                bad[pid] = f"delta norm {delta:.3g} exceeds {self.max_norm_ratio:g} x our {ref:.3g}"
            elif self.too_large(gap, gap_ref):
                bad[pid] = f"slow weights {gap:.3g} from ours, over {self.max_norm_ratio:g} x {gap_ref:.3g}"
        return bad

    @property
    def needs_whole(self) -> bool:
        """Whether aggregating a part needs every contribution whole first (the clipped mean scales each by its
        whole norm); the mean and the coordinate-wise trimmed mean work part by part."""
        return self.aggregation == "clipped_mean"

    def aggregate(
        self,
        contribs: Sequence[torch.Tensor],
        private: Sequence[bool] | None = None,
        norms: Sequence[float] | None = None,
    ) -> torch.Tensor:
        """Deterministic fp32 aggregate in member order. `private[i]` says contribution i's memory is ours to
        overwrite (the plain mean then sums in place). `norms`: the contributions' whole L2 norms when `contribs` are
        parts of them (for the clipped mean)."""
        n = len(contribs)
        if self.aggregation == "trimmed_mean" and n >= 3:
            k = min(max(1, int(n * self.trim_fraction)), (n - 1) // 2)
            ordered, _ = torch.sort(torch.stack(list(contribs)), dim=0)
            return ordered[k : n - k].mean(dim=0)
        if self.aggregation == "clipped_mean":
            if norms is None:
                norms = [float(torch.linalg.vector_norm(c)) for c in contribs]
            bound = self.clip_ratio * statistics.median(norms)
            acc = torch.zeros_like(contribs[0])
            for c, norm in zip(contribs, norms, strict=True):
                acc += c * (bound / norm) if norm > bound > 0 else c
            return acc / n
        return mean_of(contribs, private or [False] * n)


def mean_of(contribs: Sequence[torch.Tensor], private: Sequence[bool]) -> torch.Tensor:
    """Sum in member order, then divide. The sum goes into a contribution's own memory where that one may be
    overwritten (a 20 MB shard's fresh allocation costs more than the sum on small machines); since x0 + x1 is
    bit-identical to x1 + x0, either of the first two can hold it."""
    n = len(contribs)
    if private[0]:
        acc, rest = contribs[0], contribs[1:]
    elif n > 1 and private[1]:
        acc, rest = contribs[1].add_(contribs[0]), contribs[2:]
    else:
        acc, rest = contribs[0].clone(), contribs[1:]
    for c in rest:
        acc += c
    return acc.div_(n)


class BanList:
    """Strikes per peer within a window; `ban_after` strikes ban the peer for `ban_seconds` (local bookkeeping)."""

    def __init__(self, ban_after: int, window_s: float, ban_s: float, max_peers: int = 4096) -> None:
        self.ban_after = ban_after
        self.window_s = window_s
        self.ban_s = ban_s
        self.max_peers = max_peers
        self._strikes: OrderedDict[str, deque[float]] = OrderedDict()
        self._until: dict[str, float] = {}

    def strike(self, peer_id: str, now: float | None = None) -> bool:
        """Count one invalid message from `peer_id`; True when this strike got it banned."""
        now = time.monotonic() if now is None else now
        if self.is_banned(peer_id, now):
            return False
        hits = self._strikes.setdefault(peer_id, deque())
        self._strikes.move_to_end(peer_id)
        hits.append(now)
        while hits and hits[0] < now - self.window_s:
            hits.popleft()
        while len(self._strikes) > self.max_peers:
            self._strikes.popitem(last=False)
        if len(hits) >= self.ban_after:
            self._until[peer_id] = now + self.ban_s
            del self._strikes[peer_id]
            return True
        return False

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        until = self._until.get(peer_id)
        if until is None:
            return False
        if (time.monotonic() if now is None else now) < until:
            return True
        del self._until[peer_id]
        return False

    def banned(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return sorted(p for p in list(self._until) if self.is_banned(p, now))


def majority_suspects(views: dict[str, Sequence[str]]) -> set[str]:
    """Peers that a strict majority of the *other* peers in `views` (peer id -> the ids it banned) report.

    Gossip alone never bans anyone: this only keeps such peers out of round groups and leader choice. One hostile
    peer (or any minority) naming an honest one cannot reach a majority, so it cannot exclude it.
    """
    named: dict[str, int] = {}
    for voter, accused in views.items():
        for pid in set(accused):
            if pid != voter:
                named[pid] = named.get(pid, 0) + 1
    out = set()
    for pid, votes in named.items():
        voters = len(views) - (1 if pid in views else 0)
        if voters > 0 and 2 * votes > voters:
            out.add(pid)
    return out
