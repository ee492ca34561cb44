"""Relaying a lost owner's finished shard, so that a round never completes with two versions of one shard.

An owner that dies while it sends its averaged shard reaches some members and not others. The members it missed
send that shard to the next owner in line (the fallback, allreduce.py), which would reduce it anew: without the dead
owner's contribution, and waiting for the members that already have the shard and left the round. Those would end
with the dead owner's average and the rest with the fallback's, or the fallback would wait for them until the round
timed out (seen at 64 peers under churn: one attempt in seven).

Instead, every member keeps the signed parts of each shard it received (`HeldShard`) while the round may still need
them. When it sees a shard's sender gone, it relays those parts, verbatim, to the next in line (`relay_stream`). The
fallback checks the lost owner's own signatures on them (`read_relay`) and serves those bytes, with their masks, to
every member that asks it, instead of its own average. A fallback that itself holds the shard serves it the same way.
Every member so decodes the same bytes for every shard, and the round completes once, with one model.

A relay needs the member to see the owner gone. An owner that only *looked* lost to some members (their streams to
it failed on a starved loop, or they saw it silent in gossip) is alive to the rest, which finish with it and relay
nothing, while the fallback waits for them until the round times out (seen at 64 peers under churn). So the fallback
also asks the members it waits for (`pull_request`): one that holds the shard whole answers with the same signed
parts a relay would carry (`pull_reply`), and one that does not answers with nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from peerd.codecs import Codec
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.layout import mask_members
from peerd.roundtypes import part_messages
from peerd.streams import ReceivedTensor, StreamError, read_tensor, relayed_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, kind_to_wire

PULL_EVERY_S = 2.0  # how often a fallback owner asks the members it still waits for
PULL_FANOUT = 3  # members asked at a time


@dataclass
class HeldShard:
    """Every averaged part of one shard, as `source` (its owner, or a fallback) signed them for us."""

    source: str
    parts: list[ReceivedTensor]

    def frames(self) -> list[tuple[bytes | bytearray, bytes]]:
        """(payload, included mask) of each part, for a fallback owner to serve."""
        return [(rx.payload, bytes(rx.header.included_mask)) for rx in self.parts]


def relay_stream(
    held: HeldShard,
    round_id: bytes,
    shard: int,
    identity: Identity,
    run_id: bytes,
    chunk_bytes: int,
    to_incarnation: int = 0,
) -> Iterator[pb.TensorMessage]:
    """A Reduce stream that hands `held` to a fallback: our own signed, empty RELAY tensor (so the service knows
    whose stream it is and which round and shard it is for), then the source's parts exactly as it signed them."""
    yield from _own_empty("relay", round_id, shard, identity, run_id, chunk_bytes, to_incarnation)
    yield from pull_reply(held, chunk_bytes)


def _own_empty(
    kind: str, round_id: bytes, shard: int, identity: Identity, run_id: bytes, chunk_bytes: int, to_incarnation: int
) -> Iterator[pb.TensorMessage]:
    """Our own signed, empty tensor of `kind` naming the round, the shard and the process it is for."""
    header = pb.TensorHeader(
        round_id=round_id, shard=shard, part=0, numel=0, kind=kind_to_wire(kind), to_incarnation=to_incarnation
    )
    msgs, _ = part_messages(header, b"", identity, run_id, chunk_bytes, b"")
    yield from msgs


def pull_request(
    round_id: bytes, shard: int, identity: Identity, run_id: bytes, chunk_bytes: int, to_incarnation: int = 0
) -> Iterator[pb.TensorMessage]:
    """A Reduce stream that asks a member for `shard`'s average: our own signed, empty PULL tensor."""
    yield from _own_empty("pull", round_id, shard, identity, run_id, chunk_bytes, to_incarnation)


def pull_reply(held: HeldShard | None, chunk_bytes: int) -> Iterator[pb.TensorMessage]:
    """The answer to a pull: the parts we hold exactly as their source signed them, or nothing."""
    for rx in held.parts if held is not None else ():
        yield from relayed_messages(rx, chunk_bytes)


async def read_relay(
    messages: AsyncIterator[pb.TensorMessage],
    verifier: Verifier,
    sender: str,
    *,
    round_id: bytes,
    shard: int,
    parts: list[tuple[int, int]],
    codec: Codec,
    n: int,
    sources: list[str],
    own_first: bool = True,
) -> HeldShard:
    """Read a relay stream whose first header the service verified as `sender`'s (`own_first`), or a pull's answer
    (parts only). The parts must be signed by one of `sources` (the shard's owner, or a fallback before us in line),
    name this round, this shard and each part in order, fit the round's layout, and carry a well-formed mask; nothing
    is decoded here."""
    if own_first:
        await read_tensor(messages, verifier, 0, verified_sender=sender)  # the relayer's own empty tensor
    got: list[ReceivedTensor] = []
    chain = b""
    for k, (lo, hi) in enumerate(parts):
        rx = await read_tensor(messages, verifier, codec.max_encoded_size(hi - lo), chain=chain)
        h = rx.header
        if rx.sender not in sources or (got and rx.sender != got[0].sender):
            raise StreamError("malformed", f"relayed part {k} is not signed by shard {shard}'s owner", sender)
        if h.round_id != round_id or h.shard != shard or h.part != k or h.numel != hi - lo:
            raise StreamError("wrong_shape", f"relayed part {k} does not match shard {shard} of this round", sender)
        if h.kind != kind_to_wire("gather") or codec_name(h.codec) != codec.name:
            raise StreamError("malformed", f"relayed part {k} is not an averaged part in the run's codec", sender)
        if mask_members(bytes(h.included_mask), n) is None:
            raise StreamError("malformed", f"relayed part {k} carries a malformed set of included peers", sender)
        chain = rx.digest
        got.append(rx)
    return HeldShard(got[0].sender, got)


class Adopter(Protocol):
    """What a pull needs of a fallback owner's shard (shard_owner.ShardOwner)."""

    reduced: asyncio.Future[None]

    def missing(self) -> set[str]: ...

    async def adopt(self, frames: list[tuple[bytes | bytearray, bytes]], source: str) -> bool: ...


async def pull_until_reduced(
    owner: Adopter, ask: Callable[[str], Awaitable[HeldShard | None]], deadline: float, first_after_s: float
) -> str | None:
    """Ask the members `owner` still waits for, PULL_FANOUT at a time and each in turn, whether they hold the shard
    whole, until one does (its source's parts are adopted: returns that source), the shard is reduced here after all,
    or the round's deadline passes. `ask` returns None for a member that holds nothing or cannot be reached."""
    await asyncio.sleep(first_after_s)
    asked: set[str] = set()
    while not owner.reduced.done() and time.monotonic() < deadline:
        waiting = owner.missing()
        batch = sorted(waiting - asked)[:PULL_FANOUT]
        if not batch:  # every one asked once: start over (a member may have finished with the owner since)
            asked.clear()
            batch = sorted(waiting)[:PULL_FANOUT]
        asked |= set(batch)
        for held in await asyncio.gather(*(ask(pid) for pid in batch)):
            if held is None or owner.reduced.done():
                continue
            try:
                if await owner.adopt(held.frames(), held.source):
                    return held.source
            except StreamError:  # cannot be: the member decoded these very parts; ask the others
                continue
        await asyncio.sleep(PULL_EVERY_S)
    return None
