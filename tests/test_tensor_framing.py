"""Unit tests of a tensor's framing on a stream (peerd/streams.py): a round's part as one message (revision 16) or as
header, chunks and trailer, read back through the same checks. The real-process paths are the round tests
(tests/test_pipelined_round.py) and the forged-stream tests (tests/test_refusals.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest

from peerd.envelope import Verifier
from peerd.identity import Identity
from peerd.roundtypes import RoundStats, part_messages
from peerd.streams import ReceivedTensor, StreamError, read_tensor, tensor_messages
from peerd.v1 import peerd_pb2 as pb

RUN = b"r" * 32


async def _stream(msgs: Iterable[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
    for m in msgs:
        yield m


def _read(msgs: Iterable[pb.TensorMessage], limit: int = 1 << 20, chain: bytes = b"") -> ReceivedTensor:
    return asyncio.run(read_tensor(_stream(msgs), Verifier(RUN), limit, chain=chain))


def _header(part: int = 0) -> pb.TensorHeader:
    return pb.TensorHeader(round_id=b"x" * 32, shard=1, part=part, numel=64)


def test_a_round_part_that_fits_a_chunk_is_one_message_and_reads_back_as_signed() -> None:
    me = Identity.generate()
    stats = RoundStats()
    payload = bytes(range(256)) * 4
    msgs, digest = part_messages(_header(), payload, me, RUN, 1 << 20, b"", stats)
    assert len(msgs) == 1 and stats.messages == 1  # header, body and trailer together
    assert msgs[0].WhichOneof("part") == "header" and msgs[0].body == payload  # routed like any stream's first header
    rx = _read(msgs)
    assert (rx.sender, bytes(rx.payload), rx.digest) == (me.peer_id, payload, digest)
    # The chunked form of the same tensor carries the same digest, so a relay may cut it otherwise than it was sent.
    chunked = list(tensor_messages(_header(), payload, me, RUN, 100))
    assert len(chunked) == 2 + 11 and chunked[-1].trailer.digest != b""
    assert bytes(_read(chunked).payload) == payload


def test_a_part_larger_than_a_chunk_still_goes_in_chunks() -> None:
    me = Identity.generate()
    msgs, _ = part_messages(_header(), b"\1" * 1000, me, RUN, 300, b"")
    assert [m.WhichOneof("part") for m in msgs] == ["header", "chunk", "chunk", "chunk", "chunk", "trailer"]
    assert not msgs[0].body and not msgs[0].HasField("seal")
    assert bytes(_read(msgs).payload) == b"\1" * 1000


def test_parts_chain_across_one_message_parts() -> None:
    me = Identity.generate()
    first, chain = part_messages(_header(0), b"a" * 10, me, RUN, 1 << 20, b"")
    second, _ = part_messages(_header(1), b"b" * 10, me, RUN, 1 << 20, chain)

    async def both() -> list[ReceivedTensor]:
        stream, verifier = _stream(first + second), Verifier(RUN)
        one = await read_tensor(stream, verifier, 100)
        return [one, await read_tensor(stream, verifier, 100, chain=one.digest)]

    assert [bytes(rx.payload) for rx in asyncio.run(both())] == [b"a" * 10, b"b" * 10]
    with pytest.raises(StreamError) as err:  # the second part out of its place in the stream
        _read(second)
    assert err.value.reason == "bad_signature" and err.value.sender == me.peer_id


def _one(payload: bytes = b"p" * 64) -> pb.TensorMessage:
    msgs, _ = part_messages(_header(), payload, Identity.generate(), RUN, 1 << 20, b"")
    return msgs[0]


def test_a_one_message_part_is_checked_like_a_chunked_one() -> None:
    tampered = _one()
    tampered.body = b"q" + tampered.body[1:]
    cut = _one()
    cut.body = cut.body[:-1]
    big = _one(b"z" * 200)
    for msg, limit, reason in ((tampered, 100, "bad_signature"), (cut, 100, "truncated"), (big, 100, "oversized")):
        with pytest.raises(StreamError) as err:
            _read([msg], limit)
        assert err.value.reason == reason and err.value.sender  # blamed on the header's signer


def test_a_payload_outside_a_signed_header_message_is_refused() -> None:
    me = Identity.generate()
    msgs = list(tensor_messages(_header(), b"c" * 40, me, RUN, 16))
    bare = pb.TensorMessage()
    bare.CopyFrom(msgs[0])
    bare.body = b"c" * 40  # a payload but no trailer
    stray = pb.TensorMessage()
    stray.CopyFrom(msgs[1])
    stray.seal.CopyFrom(msgs[-1].trailer)  # a chunk that claims to end the tensor
    for bad in ([bare, *msgs[1:]], [msgs[0], stray, *msgs[2:]]):
        with pytest.raises(StreamError) as err:
            _read(bad)
        assert err.value.reason == "malformed"
