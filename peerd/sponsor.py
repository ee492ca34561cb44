"""Sponsored contributions: a peer whose link cannot carry a round within a window hands its work to a sponsor.

Why: a DiLoCo round is synchronous, so it waits for its slowest link. One peer on a link 10x slower than the others'
made every round wait for its bytes, and the fast peers idled 43-57% of their time. Once the swarm flags such a peer
slow for its link (peerd/timings.py) it stops joining rounds. It uploads its whole pseudo-gradient to one live,
unflagged peer (its sponsor) over the Rounds.Sponsor stream, at its link's pace, while it trains on. The sponsor adds
that work to its own contribution in its next round and answers with the step of the round that included it. So no
round waits for the slow link, and the slow peer's work still counts, some rounds late.

The weight. A contribution that took k windows to get through covers k windows of inner steps: it already moves the
weights about k times as far as one window's. So it weighs what one window of its work weighs, its tokens per window
(`SponsoredWork.tokens`), not all its tokens. Weighted by all of them, its pull on the model would grow with k^2, and
the owners' norm screen would refuse it (as it refused carried work before the one-window rule in peerd/diloco.py).

The sponsor distrusts the upload like any round stream (peerd/streams.py): a signed header and trailer, the size
checked against the model before allocating, the run's codec, no NaN or Inf. Its norm is clipped to a quarter of
`robust.max_norm_ratio` times the sponsor's own pseudo-gradient's (direction kept): the owners screen the sponsor's
contribution with that ratio, so a hostile or very late upload can neither get its sponsor's contribution refused
nor pull harder than a member may. A contribution many windows long is clipped too (counted, and logged).

This module holds the wire side of both roles: `SponsorDesk` (the sponsor: hold, take, settle) and `upload` (the
sponsored peer). The sponsored peer's training side is peerd/sponsored.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from peerd.codecs import Codec, CodecError
from peerd.envelope import Verifier, sign
from peerd.identity import Identity
from peerd.statesync import StateSnapshot, read_state
from peerd.streams import StreamError, prepend, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, codec_to_wire, kind_name, kind_to_wire

log = logging.getLogger("peerd")
MAX_PEERS = 4  # sponsored peers one sponsor carries at a time: each adds a model-sized vector to its memory
MAX_STALE = 16  # outer steps a sponsored contribution's base may lag the round it joins; older: rebase first


@dataclass(frozen=True)
class Refusal:
    """Why a sponsor will not hold a peer's work. `later`: the same upload may succeed once this sponsor has room
    (RESOURCE_EXHAUSTED); otherwise the sender is not one a sponsor may carry at all (FAILED_PRECONDITION)."""

    text: str
    later: bool = False


@dataclass
class SponsoredWork:
    """One sponsored peer's pseudo-gradient, held for the sponsor's next round."""

    peer_id: str
    base_step: int  # the global state's step it was computed from
    tokens: int  # its weight: tokens per window of the work behind it
    vector: torch.Tensor  # float32, CPU, the model's size
    answer: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    held_at: float = 0.0  # monotonic time the sponsor began holding it
    held_ms: int = 0  # how long it waited for the round that took it

    def reply(self, included_step: int, reason: str = "") -> None:
        if not self.answer.done():
            resp = pb.SponsorResponse(included_step=included_step, reason=reason, held_ms=self.held_ms)
            self.answer.set_result(resp)


@dataclass(frozen=True)
class KeptAverage:
    """Our latest round that carried sponsored work: its average, served to the peers it carried (RoundAverage), so
    each applies the outer step itself instead of downloading the whole state."""

    step: int
    average: torch.Tensor  # float32, CPU: what every member applied
    included: int  # the distinct peers the round included: the state's work grows by that much
    carried: frozenset[str]  # the sponsored peers whose work rode in it: only they may ask


class SponsorDesk:
    """The sponsor's side: contributions arrive on the loop (`receive`), the training thread takes them into a round
    (`take`) and reports what became of them (`settle`). One held contribution per peer; thread-safe."""

    def __init__(
        self,
        numel: int,
        codec: Codec,
        max_norm_ratio: float,
        max_peers: int = MAX_PEERS,
        eligible: Callable[[str], bool] = lambda peer_id: True,
    ) -> None:
        """`eligible(peer_id)`: whether that peer may send its work through us (the daemon: flagged slow, and not
        faulty, by the swarm)."""
        self.eligible = eligible
        self.numel = numel
        self.codec = codec
        # The owners refuse a member whose contribution exceeds max_norm_ratio x theirs; ours holds the sponsored
        # work at its weight, scaled up by the token weights: a quarter of that ratio keeps us well inside it
        self.clip_ratio = max_norm_ratio / 4 if max_norm_ratio > 0 else 0.0
        self.max_peers = max_peers
        self._held: dict[str, SponsoredWork] = {}
        self._busy: set[str] = set()  # peers whose work is in a round of ours right now
        self._lock = threading.Lock()
        self.clipped = 0  # sponsored contributions scaled down to what the owners accept of us
        self.closed = False  # our last round is done: nothing we hold will be included by us
        self._average: KeptAverage | None = None

    def accepting(self, peer_id: str) -> Refusal | None:
        """Why we would not hold `peer_id`'s work now (None if we would)."""
        if not self.eligible(peer_id):
            return Refusal("only a peer the swarm flags slow (and not faulty) may send its work through a sponsor")
        with self._lock:
            if peer_id in self._busy:
                return Refusal(
                    "its previous contribution is in a round of ours right now; send again once answered", True
                )
            if peer_id not in self._held and len(self._held) + len(self._busy) >= self.max_peers:
                return Refusal(f"this peer already sponsors {self.max_peers} peers; choose another sponsor", True)
        return None

    async def receive(
        self,
        messages: AsyncIterator[pb.TensorMessage],
        verifier: Verifier,
        executor: concurrent.futures.Executor,
        sender: str,
    ) -> SponsoredWork:
        """Read and check one sponsored upload from `sender` (its header already verified), StreamError or
        CodecError for anything wrong with it."""
        limit = self.codec.max_encoded_size(self.numel)
        rx = await read_tensor(messages, verifier, limit, verified_sender=sender)
        h = rx.header
        if kind_name(h.kind) != "sponsored":
            raise StreamError("malformed", f"Sponsor: a {kind_name(h.kind) or 'unknown'} tensor, expected sponsored")
        if codec_name(h.codec) != self.codec.name:
            raise StreamError(
                "wrong_codec", f"Sponsor: codec {codec_name(h.codec)!r}, the run's is {self.codec.name!r}"
            )
        if h.numel != self.numel:
            raise StreamError("wrong_size", f"Sponsor: {h.numel} values, the model has {self.numel}")
        loop = asyncio.get_running_loop()
        vector = await loop.run_in_executor(executor, self.codec.decode, bytes(rx.payload), self.numel)
        vector = vector.float()
        if not math.isfinite(float(torch.linalg.vector_norm(vector, dtype=torch.float64))):
            raise StreamError("non_finite", "Sponsor: the contribution holds NaN or Inf")
        return SponsoredWork(rx.sender, int(h.base_step), int(h.tokens), vector)

    def withdraw(self, work: SponsoredWork) -> bool:
        """Drop `work` if no round of ours has taken it (its sender gave up waiting); False if one has."""
        with self._lock:
            if self._held.get(work.peer_id) is work:
                del self._held[work.peer_id]
                return True
            return work.peer_id not in self._busy

    def hold(self, work: SponsoredWork) -> None:
        """Keep `work` for our next round; an older contribution of the same peer is answered "replaced"."""
        work.held_at = time.monotonic()
        with self._lock:
            closed = self.closed
            old = None if closed else self._held.pop(work.peer_id, None)
            if not closed:
                self._held[work.peer_id] = work
        if closed:
            work.reply(-1, "closing")
        if old is not None:
            old.reply(-1, "replaced")

    def take(self, step: int, own_norm: float) -> list[SponsoredWork]:
        """The contributions our round for `step` carries, each clipped to CLIP_RATIO x `own_norm` (our own
        pseudo-gradient's); those based too far back are answered "stale"."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
            fresh = [w for w in held if step - w.base_step <= MAX_STALE]
            self._busy.update(w.peer_id for w in fresh)
        for w in held:
            if w not in fresh:
                w.reply(-1, "stale")
        limit = self.clip_ratio * own_norm
        now = time.monotonic()
        for w in fresh:
            w.held_ms = min(int((now - w.held_at) * 1000), 2**32 - 1) if w.held_at else 0
            norm = float(torch.linalg.vector_norm(w.vector, dtype=torch.float64))
            if limit > 0 and norm > limit:
                w.vector.mul_(limit / norm)
                self.clipped += 1
                log.info("sponsored work of %s clipped from norm %.3g to %.3g (%g x our own)",
                         w.peer_id[:8], norm, limit, self.clip_ratio)  # fmt: skip
        return fresh

    def settle(self, taken: Iterable[SponsoredWork], included_step: int | None) -> None:
        """Our round for `taken` completed at `included_step` (answer them), or failed (None: hold them again)."""
        with self._lock:
            for w in taken:
                self._busy.discard(w.peer_id)
                if included_step is None and w.peer_id not in self._held:
                    self._held[w.peer_id] = w
        if included_step is not None:
            for w in taken:
                w.reply(included_step)

    def keep_average(self, step: int, average: torch.Tensor, included: int, carried: Iterable[str]) -> None:
        """Our round for `step` carried `carried`'s work: keep its average for them (only the latest round's; call
        before `settle` answers them, so it is here when they ask)."""
        kept = KeptAverage(step, average.detach().to("cpu", torch.float32).clone(), included, frozenset(carried))
        with self._lock:
            self._average = kept

    def average_for(self, step: int, peer_id: str) -> KeptAverage | None:
        """The average of our round for `step`, if we still keep it and it carried `peer_id`'s work."""
        with self._lock:
            kept = self._average
        return kept if kept is not None and kept.step == step and peer_id in kept.carried else None

    def close(self) -> None:
        """We run no more rounds (our last step is done, or we stop): give every held contribution back."""
        with self._lock:
            self.closed = True
            held, self._held = list(self._held.values()), {}
        for w in held:
            w.reply(-1, "closing")


def combine(own: torch.Tensor, own_tokens: int, taken: list[SponsoredWork]) -> tuple[torch.Tensor, int]:
    """Our contribution with the sponsored ones in it: their token-weighted mean, and the tokens behind it (the
    round then weighs it by the sum, so each part keeps its own weight in the swarm's average)."""
    if not taken:
        return own, own_tokens
    weights = [max(own_tokens, 1)] + [max(w.tokens, 1) for w in taken]
    total = sum(weights)
    out = own.detach().float().cpu() * (weights[0] / total)
    for w, weight in zip(taken, weights[1:], strict=True):
        out.add_(w.vector, alpha=weight / total)
    return out.to(own.device), total if own_tokens > 0 else 0


def choose_sponsor(me: str, candidates: Iterable[pb.PeerInfo], is_flagged: Callable[[str], bool]) -> pb.PeerInfo | None:
    """A live peer that can carry our work: dialable, not flagged, not sponsored itself, still training. Each
    sponsored peer hashes to its own choice, so several slow peers spread over the swarm rather than all pick one."""
    ok = [
        p
        for p in candidates
        if p.peer_id != me
        and not p.outbound_only
        and not p.sponsor
        and not p.finished
        and not p.left
        and not is_flagged(p.peer_id)
    ]
    return min(ok, key=lambda p: hashlib.sha256(f"{me}/{p.peer_id}".encode()).digest(), default=None)


class SponsorProbe:
    """When a sponsored peer tries the swarm's rounds again, to learn whether its link recovered.

    A sponsored peer joins no round, so no round times it, and the swarm's slow verdict on it (peerd/timings.py)
    would never lift. Only a round can show a link keeps up again: after `every` sponsored contributions the peer
    rejoins rounds on probation until it has been in `rounds` of them (or `3 x rounds` windows went by: rounds may
    fail, or the first may find the swarm a step ahead). Its verdict lifts after RECOVER normal rounds in a row; if
    it is still flagged when probation ends, its link is still slow: it turns sponsored again and waits twice as long
    (up to `cap`) before the next probe, so a link that stays slow costs the swarm a few waited-for rounds per
    doubling interval, not one per window.

    Probation also lasts `min_s` seconds at least (a few gossip intervals): the others' lifted verdicts reach us by
    gossip. With rounds of 0.3 s, 5 rounds ended in 1.7 s, before the verdicts came; a flaky peer whose link had
    recovered was judged "still slow" twice and stayed sponsored 37 s after its last drop (tests/test_flap.py)."""

    def __init__(self, every: int, rounds: int, cap: int = 256, min_s: float = 0.0) -> None:
        self.every = every  # sponsored contributions before the next probe (0: never probe)
        self.rounds = rounds
        self.min_s = min_s
        self.began = 0.0  # when the current probe began (monotonic)
        self.cap = max(cap, every)
        self.sponsored = 0  # contributions since sponsorship began or the last probe ended
        self.left = 0  # windows of probation left at most (0: not on probation)
        self.probes = 0  # probes started (summary.json)
        self.recovered = 0  # probes that ended with the verdict lifted

    def next(self, flagged: bool, joined: int = 0, now: float | None = None) -> str:
        """Called once per window in which we would pick a sponsor; `joined`: the rounds we completed as a member
        since the probe began. Returns "sponsor" (send our work through one), "rounds" (join the round ourselves) or
        "probe" (start probation now: join the round)."""
        now = time.monotonic() if now is None else now
        if self.left:
            if not flagged:
                self.left, self.sponsored, self.recovered = 0, 0, self.recovered + 1
                return "rounds"
            self.left -= 1
            if self.left and (joined < self.rounds or now - self.began < self.min_s):
                return "rounds"
            self.left = 0
            self.every = min(self.every * 2, self.cap)  # still slow after probation: back off
        if not flagged:
            self.sponsored = 0
            return "rounds"
        if self.every and self.sponsored >= self.every:
            self.left, self.sponsored, self.probes = 3 * self.rounds, 0, self.probes + 1
            self.began = now
            return "probe"
        self.sponsored += 1
        return "sponsor"


async def upload(
    stub: Any,
    identity: Identity,
    run_id: bytes,
    codec: Codec,
    vector: torch.Tensor,
    base_step: int,
    tokens: int,
    timeout: float,
    chunk_bytes: int,
    executor: concurrent.futures.Executor,
) -> pb.SponsorResponse:
    """Send our pseudo-gradient to a sponsor and wait until its round took it (or gave it up)."""
    x = vector.detach().float().cpu().contiguous()
    loop = asyncio.get_running_loop()
    try:
        frame = await loop.run_in_executor(executor, codec.encode_frame, x)
    except CodecError as exc:
        raise ValueError(f"cannot encode our contribution: {exc}") from exc
    header = pb.TensorHeader(
        kind=kind_to_wire("sponsored"),
        codec=codec_to_wire(codec.name),
        numel=x.numel(),
        base_step=base_step,
        tokens=tokens,
    )
    messages = tensor_messages(header, frame, identity, run_id, chunk_bytes)
    return await stub.Sponsor(messages, timeout=timeout)


async def fetch_average(
    stub: Any, identity: Identity, run_id: bytes, step: int, numel: int, sender_key: bytes, timeout: float
) -> tuple[StateSnapshot, bytes]:
    """Download the average of our sponsor's round for `step` (RoundAverage): the snapshot holds it as "average",
    with the round's included count as its work; also returns the digest of the state it must produce. Checked as a
    state download is: sizes before allocating, the signed digest, no NaN or Inf."""
    req = sign(pb.AverageRequest(step=step), "RoundAverage", identity, run_id)
    it = stub.RoundAverage(req, timeout=timeout).__aiter__()
    first = await it.__anext__()
    head = first.header if first.WhichOneof("part") == "header" else None
    if head is None or head.outer_step != step or len(head.next_digest) != 32:
        raise StreamError("malformed", f"RoundAverage: expected a header for step {step} naming the next digest")
    snap = await read_state(prepend(first, it), {"average": (numel,)}, sender_key)
    return snap, bytes(head.next_digest)
