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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from peerd.codecs import Codec
from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.layout import mask_members
from peerd.roundtypes import part_messages
from peerd.streams import ReceivedTensor, StreamError, read_tensor, relayed_messages
from peerd.v1 import peerd_pb2 as pb
from peerd.wire import codec_name, kind_to_wire


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
    header = pb.TensorHeader(
        round_id=round_id, shard=shard, part=0, numel=0, kind=kind_to_wire("relay"), to_incarnation=to_incarnation
    )
    msgs, _ = part_messages(header, b"", identity, run_id, chunk_bytes, b"")
    yield from msgs
    for rx in held.parts:
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
) -> HeldShard:
    """Read a relay stream whose first header the service verified as `sender`'s. The parts must be signed by one
    of `sources` (the shard's owner, or a fallback before us in line), name this round, this shard and each part in
    order, fit the round's layout, and carry a well-formed mask; nothing is decoded here."""
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
