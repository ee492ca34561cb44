"""The client side of a state download (peerd/statesync.py is the wire format and the serving side): pick the live
peer holding the canonical state, ask it for the whole state or only the fragments where ours differs, check what
arrives against the digest it gossiped, and fall back to the next holder on any failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import torch

from peerd.allreduce import RoundFailed
from peerd.channels import end_call
from peerd.consistency import claim_of, outranks
from peerd.envelope import sign
from peerd.limits import paced
from peerd.reachability import dialable
from peerd.statesync import StateSnapshot, part_digests, read_state
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.daemon import Daemon

log = logging.getLogger("peerd")


def differing_ranges(
    holder: pb.PeerInfo, mine: list[bytes] | None, parts: list[list[tuple[int, int]]] | None
) -> list[tuple[int, int]] | None:
    """The element ranges of the fragments where `holder`'s state differs from ours (`mine`: our part digests);
    None: download it all."""
    if not mine or not parts or len(holder.part_digests) != len(parts):
        return None
    ranges = [r for p, theirs in enumerate(holder.part_digests) if theirs != mine[p] for r in parts[p]]
    return ranges or None


STALL_MIN_S = 10.0


def stall_limit(peer_timeout: float) -> float:
    """How long a download may go without a message before we try the next holder: a link cut in silence sends no
    reset, and the call's own deadline (the whole download's, network.round_timeout: 120 s) held a joiner on a holder
    cut off mid-download for all of it, though another holder of the same state was a reachable peer away."""
    return max(2.0 * peer_timeout, STALL_MIN_S)


JUMP_RATE = 4.0  # a holder of a state one round older goes first if its uplink is this many times the best one's


def holder_order(live: list[pb.PeerInfo], rate: Callable[[str], float], round_work: int = 0) -> list[pb.PeerInfo]:
    """Whom to download from, in turn: the highest-ranked claim first (the split-brain rule), then, among holders of
    that same state (equal rank means equal digest), the fastest uplink we measured (`rate`: bytes/s, 0 when
    unmeasured). In CI a peer on a 2 Mbit/s uplink served every other whole state in 5 s, longer than the 3 s window,
    and kept the downloading peer a round behind for 15 rounds.

    One exception: a holder at most one round (`round_work`, default every holder and us) below the best claim whose
    measured uplink is JUMP_RATE times the best holder's goes first. A slow-uplink peer owns no shard, so it finishes
    each round first and, for a moment, alone holds the newest claim: a peer catching up after a split downloaded
    from it (3 s a state, at 5 Mbit/s) 6 times in a row while the swarm moved 3-5 steps per download, and never
    caught up (the chaos test). The fast holder's state is one round older at most; the next download, if any, is
    quick too."""
    order = sorted(live, key=lambda p: (claim_of(p).rank, rate(p.peer_id)), reverse=True)
    if len(order) < 2:
        return order
    top, top_rate = claim_of(order[0]), rate(order[0].peer_id)
    margin = round_work or len(live) + 1
    near = [
        p
        for p in order[1:]
        if claim_of(p).step >= top.step - 1 and claim_of(p).work >= top.work - margin
        and rate(p.peer_id) >= JUMP_RATE * top_rate > 0
    ]  # fmt: skip
    if near:
        fastest = max(near, key=lambda p: rate(p.peer_id))
        order.remove(fastest)
        order.insert(0, fastest)
    return order


async def fetch_state(
    d: Daemon,
    min_step: int,
    expected: dict[str, tuple[int, ...]],
    timeout: float,
    better: bool = False,
    base: dict[str, torch.Tensor] | None = None,
    parts: list[list[tuple[int, int]]] | None = None,
) -> StateSnapshot:
    """Download the canonical global state (at least `min_step`) from a live peer that holds it (runs on the loop).
    `better`: only a state that outranks ours. With `base` (our state) and `parts` (its fragments' ranges), only the
    fragments whose gossiped digests differ from ours are downloaded and patched in."""
    assert d.channels is not None
    deadline = time.monotonic() + timeout
    stall_s = stall_limit(d.cfg.network.peer_timeout)
    errors: list[str] = []
    # Our own part digests do not change while we download: computed once, not once per candidate holder.
    mine_parts = part_digests(base, parts) if base and parts else None
    while time.monotonic() < deadline:
        mine = d.my_claim()
        live = [
            p
            for p in d.membership.alive(include_self=False)
            if p.outer_step >= min_step
            and p.state_digest
            and dialable(p)
            and not d.membership.cannot_dial(p.peer_id)  # a route broken between us: its dial hangs (pairblocks.py)
            and (not better or outranks(claim_of(p), mine))
        ]
        if d.me.outbound_only and not await d.reach.wait_for_dialable(deadline - time.monotonic()):
            break  # nobody we could download from
        for p in holder_order(live, d.stream_rate, len(d.membership.alive())):
            ranges = differing_ranges(p, mine_parts, parts)
            flat = [v for pair in ranges or () for v in pair]
            req = sign(pb.StateRequest(min_step=min_step, ranges=flat), "Download", d.identity, d.run_id)
            call = d.channels.state(p.address, p).Download(req, timeout=max(deadline - time.monotonic(), 1.0))
            t0 = time.monotonic()
            try:
                snap = await read_state(paced(call, stall_s, stall_s), expected, p.public_key, base, ranges)
                if p.state_digest and snap.step == p.outer_step and snap.digest != p.state_digest:
                    raise StreamError("bad_digest", "served state does not match the digest it gossiped")
            except (grpc.aio.AioRpcError, StreamError, StopAsyncIteration) as exc:
                if isinstance(exc, StreamError) and exc.reason == "timeout":  # it went silent: no bad input
                    end_call(call)
                    log.info("state download from %s stalled for %.0fs: trying the next holder", p.peer_id[:8],
                             stall_s)  # fmt: skip
                elif isinstance(exc, StreamError):
                    d.checks.count_rejected(exc.reason)
                errors.append(f"{p.peer_id[:8]}: {exc}")
                continue
            what = f"{len(ranges)} changed slices" if ranges else "whole"
            if not ranges:  # its uplink, as a whole state measures it: whom the next download asks first
                nbytes = sum(t.numel() * t.element_size() for t in snap.tensors.values())
                d.timing.local.stats(p.peer_id).throughput.append(nbytes / max(time.monotonic() - t0, 1e-3))
            log.info("downloaded state at step %d (work %d, %s) from %s", snap.step, snap.work, what, p.peer_id[:8])
            d.status.state_downloads += 1
            return snap
        await asyncio.sleep(0.5)
    raise RoundFailed(f"no peer served state at step >= {min_step}: {errors[-3:]}")
