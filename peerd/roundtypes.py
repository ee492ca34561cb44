"""What both sides of a round share: its failure (with whom it blames), its byte counters, the float64 squares the
screening sums part by part, and one part's signed messages. Kept apart so that the member side (allreduce.py) and
the owner side (shard_owner.py) import them without importing each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from peerd.codecs.frame import SealedFrame
from peerd.identity import Identity
from peerd.robust import STRIKE_REASONS
from peerd.streams import tensor_messages
from peerd.v1 import peerd_pb2 as pb


class RoundFailed(RuntimeError):
    """The round could not complete. `suspects` are peers that seem to be at fault (unreachable, silent). With
    reason "aborted" they are another member's word, not something we saw: worth skipping in the retry, not
    worth marking unreachable."""

    def __init__(self, message: str, suspects: set[str] | None = None, reason: str = "aborted") -> None:
        super().__init__(message)
        self.suspects = suspects or set()
        self.reason = reason


def own_evidence(exc: BaseException) -> bool:
    """A failure that names suspects on what we saw ourselves, not on another member's word."""
    return isinstance(exc, RoundFailed) and bool(exc.suspects) and exc.reason != "aborted"


class OwnerLost(RoundFailed):
    """Our exchange with a shard's owner failed because the owner is gone (UNAVAILABLE: refused, reset; NOT_FOUND:
    restarted): the shard moves to the next in line instead of failing the round."""


class ContributionRefused(RoundFailed):
    """An owner refused our own contribution (its norm screen, robust.py, or its checks of our data) and aborted the
    round naming us. The same work sent again is refused again, and each refusal is a strike towards a ban there: an
    honest peer with 12x a CPU-starved owner's steps in lr warm-up was banned for 600 s within one outer step, and
    every round after it was partial. So we sit the step out (roundclient.py) and our work carries into the next
    round; a hostile owner that names us costs us one step, as aborting the round always could."""


class StreamLate(RoundFailed):
    """An owner closed our contribution stream because its first part came too late (the slow-loris limit): our own
    lateness, not the owner's fault, so the exchange is opened again rather than the round failed."""


# Failures that every member must share: bad data (signed, so someone answers for it: robust.STRIKE_REASONS, and
# a refused norm) and refusals. A round that
# fails for any other reason (a timeout, a refused fallback, an unreachable owner) fails only here: what we reduce for
# the others keeps serving them until the deadline, so one member's trouble does not fail everyone's round.
SHARED_FAILURES = STRIKE_REASONS | {"rejected", "banned", "not_admitted", "local"}


def shared(failure: BaseException) -> bool:
    """Whether a failure of our round must fail the others' too (see SHARED_FAILURES); cancellation (the daemon
    stopping, or our caller giving up) and the deadline end everything we serve as well."""
    if not isinstance(failure, RoundFailed):
        return True
    return failure.reason in SHARED_FAILURES or failure.reason == "timeout"


SUSPECTS_KEY = "peerd-suspects"
"""Trailing metadata of an aborted Reduce stream: whom the owner blames. Without it, a member whose round an owner
aborted retried with the offender again, while the rest of the group retried without it: two groups, one step."""


REASON_KEY = "peerd-abort-reason"
"""Trailing metadata next to SUSPECTS_KEY: why the owner aborted. Only "rejected" (its checks refused the named
members' data) makes a named member sit the step out; one named because the owner timed out waiting for it retries
(run AV: an owner that heard from nobody in 120 s named 57 members, and one of them logged that its contribution was
refused and sat the step out)."""


WRONG_PEER = "wrong_peer"
"""REASON_KEY of a Gossip refused because the receiver is not the peer the caller meant (GossipRequest.to): the
address outlived the peer that announced it."""


def suspects_metadata(exc: RoundFailed) -> tuple[tuple[str, str], ...]:
    if not exc.suspects:
        return ()
    return (SUSPECTS_KEY, ",".join(sorted(exc.suspects))), (REASON_KEY, exc.reason[:64])


REFUSED_REASONS = frozenset({"rejected", "malformed"})
"""Abort reasons that mean an owner's checks refused the named members' data (its norm screen, or data that did not
decode or match the round), as opposed to its waiting for them ("timeout") or relaying another owner's word."""


def _reasons(metadata: object) -> set[str]:
    return {value for key, value in metadata or () if key == REASON_KEY}  # type: ignore[attr-defined]


def refuses(metadata: object, me: str, allowed: set[str]) -> bool:
    """Whether an aborting owner's metadata says its checks refused our own data (ContributionRefused)."""
    reasons = _reasons(metadata)
    return bool(reasons) and reasons <= REFUSED_REASONS and me in relayed_suspects(metadata, allowed | {me})


def refused_stream(metadata: object) -> bool:
    """Whether an owner that ended our contribution stream with INVALID_ARGUMENT refused the data on it (it tags the
    refusal with REASON_KEY): our contribution was refused, not the owner lost. A stream that stalled ("timeout") or
    broke off ("truncated") was our lateness, which the owner forgives by dropping it."""
    reasons = _reasons(metadata)
    return bool(reasons) and not reasons & {"timeout", "truncated"}


def relayed_suspects(metadata: object, allowed: set[str]) -> set[str]:
    """The suspects an aborting owner named, limited to `allowed` (the round's other members)."""
    named: set[str] = set()
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == SUSPECTS_KEY and isinstance(value, str):
            named |= set(value[:4096].split(",")) & allowed
    return named


@dataclass
class RoundStats:
    raw_bytes: int = 0  # fp32 bytes this peer's sends would have taken uncompressed
    wire_bytes: int = 0  # bytes it actually sent
    received_wire_bytes: int = 0
    seconds: float = 0.0
    messages: int = 0  # stream messages sent (bench.scale: per-peer message rate)


SQUARES_ROW = 1024
"""Values per float32 partial sum in `sum_of_squares`."""


def sum_of_squares(t: torch.Tensor) -> float:
    """Sum of squares as float32 sums of 1024-value rows, added up in float64: members summing the same bytes' parts
    in part order get the same whole norm. A float64 norm converts every value and ran at 4 ns per value on parts
    past the cache (21 ms for a 5M-value sparse part, whose parts are whole shards, on one core); the rows take
    0.2-0.3 ns, and keep the float32 rounding error to one row's."""
    flat = t.reshape(-1).float()
    whole = flat.numel() - flat.numel() % SQUARES_ROW
    total = 0.0
    if whole:
        total = float(torch.linalg.vector_norm(flat[:whole].view(-1, SQUARES_ROW), dim=1).square_().double().sum())
    if whole < flat.numel():
        total += float(torch.linalg.vector_norm(flat[whole:], dtype=torch.float64)) ** 2
    return total


def rms(parts_sumsq: list[float], numel: int) -> float:
    return math.sqrt(sum(parts_sumsq) / numel) if numel else 0.0


def part_messages(
    header: pb.TensorHeader,
    payload: bytes | SealedFrame,
    identity: Identity,
    run_id: bytes,
    chunk: int,
    chain: bytes,
    stats: RoundStats | None = None,
) -> tuple[list[pb.TensorMessage], bytes]:
    """One part's signed messages (one, where it fits a chunk) and its digest (the next part's chain), counted in
    `stats` as sent."""
    msgs = list(tensor_messages(header, payload, identity, run_id, chunk, chain, whole=True))
    if stats is not None:
        stats.wire_bytes += len(payload)
        stats.messages += len(msgs)
        stats.raw_bytes += 4 * header.numel
    last = msgs[-1]
    return msgs, (last.seal if last.HasField("seal") else last.trailer).digest
