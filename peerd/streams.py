"""Framing of one encoded tensor on a gRPC stream: a signed header, chunks of at most 1 MiB, a signed trailer.

The header is signed like any request (peerd/envelope.py). The trailer signs a SHA-256 digest of the header's
signature and every payload byte, so a peer cannot splice someone else's chunks into its stream, and a receiver never
uses a payload before the whole of it checked out. A stream that carries several tensors in a row (a Reduce stream's
parts) chains them: each digest starts from the previous one (`chain`), so the last trailer covers the whole stream.
The receiver learns the payload size from the header and refuses it before allocating anything when it exceeds what
the round's layout allows.

A tensor that fits one chunk may travel as one message (revision 16; a round's parts do): the header message carries
the payload in `body` and the trailer in `seal`. Signatures, digest and checks are the same; only the message count
differs, and each message costs both ends about 70 us of Python and gRPC work.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from peerd.codecs.frame import SealedFrame
from peerd.envelope import AuthError, Verifier, sign
from peerd.identity import Identity, verify
from peerd.v1 import peerd_pb2 as pb

HEADER_METHOD = "peerd.v1.TensorHeader"
MAX_CHUNK = 1 << 20


class StreamError(ValueError):
    """A tensor stream that is malformed, oversized, truncated or forged. `reason` is a metric label."""

    def __init__(self, reason: str, message: str, sender: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.sender = sender  # set once the header's signature checked out: the error is that member's fault


@dataclass
class ReceivedTensor:
    sender: str
    header: pb.TensorHeader
    payload: bytearray
    digest: bytes = b""  # the signed digest: the next tensor's `chain` on a stream that carries several
    signature: bytes = b""  # the sender's signature over `digest`: with the header, a third party can relay it


def relayed_messages(rx: ReceivedTensor, chunk_bytes: int = MAX_CHUNK) -> Iterator[pb.TensorMessage]:
    """`rx` as its sender signed it, for another peer to check against the sender's key: its header, its payload in
    chunks (the digest does not depend on how the payload is cut) and its trailer."""
    yield pb.TensorMessage(header=rx.header)
    for chunk in SealedFrame((b"", rx.payload, b"")).chunks(chunk_bytes):
        yield pb.TensorMessage(chunk=chunk)
    yield pb.TensorMessage(trailer=pb.TensorTrailer(digest=rx.digest, signature=rx.signature))


def tensor_messages(
    header: pb.TensorHeader,
    payload: bytes | bytearray | SealedFrame,
    identity: Identity,
    run_id: bytes,
    chunk_bytes: int = MAX_CHUNK,
    chain: bytes = b"",
    whole: bool = False,
) -> Iterator[pb.TensorMessage]:
    """Yield the messages that carry `payload` (already encoded by a codec) under a signed header. A SealedFrame is
    streamed from its parts, never joined into one buffer. `chain`: the previous tensor's digest on this stream.
    `whole` (revision 16): a payload that fits one chunk goes as one message, its header carrying body and trailer;
    a round's parts do, since every message costs both ends about 70 us."""
    frame = payload if isinstance(payload, SealedFrame) else SealedFrame((b"", payload, b""))
    header.wire_bytes = len(frame)
    sign(header, HEADER_METHOD, identity, run_id)
    h = _digest_start(chain, header)
    if whole and header.wire_bytes <= chunk_bytes:
        body = bytes(frame)
        h.update(body)
        yield pb.TensorMessage(header=header, body=body, seal=_trailer(h.digest(), identity))
        return
    yield pb.TensorMessage(header=header)
    for chunk in frame.chunks(chunk_bytes):
        h.update(chunk)
        yield pb.TensorMessage(chunk=chunk)
    yield pb.TensorMessage(trailer=_trailer(h.digest(), identity))


def _trailer(digest: bytes, identity: Identity) -> pb.TensorTrailer:
    return pb.TensorTrailer(digest=digest, signature=identity.sign(digest))


async def read_tensor(
    messages: AsyncIterator[pb.TensorMessage],
    verifier: Verifier,
    max_wire_bytes: int | Callable[[str, pb.TensorHeader], Awaitable[int]],
    verified_sender: str | None = None,
    chain: bytes = b"",
) -> ReceivedTensor:
    """Read one header/chunks/trailer sequence from `messages`, checking signature, sizes and digest.

    `verified_sender` is for a caller that already checked the first header's envelope (to route the stream before
    reading it); the header is then not verified again, which the replay guard would refuse. `chain`: the previous
    tensor's digest on this stream (ReceivedTensor.digest), for streams that carry several.

    `max_wire_bytes` may be a coroutine function of (sender, header) so the limit can come from the round the header
    names; it raises StreamError to refuse the stream outright.
    """
    first = await _next(messages, "header")
    if first.WhichOneof("part") != "header":
        raise StreamError("malformed", "tensor stream must start with a header")
    header = first.header
    sender = verified_sender or verify_header(verifier, header)
    try:
        if first.HasField("seal"):  # revision 16: the whole tensor in this one message
            return await _read_whole(first, sender, max_wire_bytes, chain)
        if first.body:
            raise StreamError("malformed", "tensor header carries a payload but no trailer")
        return await _read_body(messages, header, sender, max_wire_bytes, chain)
    except StreamError as exc:
        exc.sender = exc.sender or sender
        raise


async def _check_size(
    header: pb.TensorHeader, sender: str, max_wire_bytes: int | Callable[[str, pb.TensorHeader], Awaitable[int]]
) -> None:
    limit = max_wire_bytes if isinstance(max_wire_bytes, int) else await max_wire_bytes(sender, header)
    if header.wire_bytes > limit:
        raise StreamError("oversized", f"tensor payload of {header.wire_bytes} bytes exceeds the {limit} allowed")


async def _read_whole(
    msg: pb.TensorMessage,
    sender: str,
    max_wire_bytes: int | Callable[[str, pb.TensorHeader], Awaitable[int]],
    chain: bytes,
) -> ReceivedTensor:
    """A tensor whose header message carries its payload and trailer: the same checks as the chunked form."""
    header = msg.header
    await _check_size(header, sender, max_wire_bytes)
    if len(msg.body) > MAX_CHUNK:
        raise StreamError("oversized", f"payload of {len(msg.body)} bytes in one message exceeds 1 MiB")
    if len(msg.body) != header.wire_bytes:
        raise StreamError("truncated", f"message carries {len(msg.body)} of the {header.wire_bytes} bytes declared")
    h = _digest_start(chain, header)
    h.update(msg.body)
    return _sealed(header, sender, bytearray(msg.body), h.digest(), msg.seal)


def _sealed(
    header: pb.TensorHeader, sender: str, payload: bytearray, digest: bytes, trailer: pb.TensorTrailer
) -> ReceivedTensor:
    if trailer.digest != digest or not verify(header.auth.public_key, trailer.signature, digest):
        raise StreamError("bad_signature", "tensor payload does not match the sender's signed digest")
    return ReceivedTensor(sender, header, payload, digest, bytes(trailer.signature))


async def _read_body(
    messages: AsyncIterator[pb.TensorMessage],
    header: pb.TensorHeader,
    sender: str,
    max_wire_bytes: int | Callable[[str, pb.TensorHeader], Awaitable[int]],
    chain: bytes,
) -> ReceivedTensor:
    await _check_size(header, sender, max_wire_bytes)
    # The size is bounded above, so allocate once and fill in place: on small machines every extra copy of a
    # 40 MB payload costs tens of milliseconds.
    buf = bytearray(header.wire_bytes)
    view = memoryview(buf)
    filled = 0
    h = _digest_start(chain, header)
    while True:
        msg = await _next(messages, "chunk or trailer")
        part = msg.WhichOneof("part")
        if msg.body or msg.HasField("seal"):
            raise StreamError("malformed", "only a tensor's header message may carry a whole payload")
        if part == "chunk":
            n = len(msg.chunk)
            if n > MAX_CHUNK:
                raise StreamError("oversized", f"chunk of {n} bytes exceeds 1 MiB")
            if filled + n > header.wire_bytes:
                raise StreamError("oversized", "stream carries more bytes than its header declared")
            view[filled : filled + n] = msg.chunk
            h.update(msg.chunk)
            filled += n
        elif part == "trailer":
            break
        else:
            raise StreamError("malformed", "unexpected message inside a tensor stream")
    view.release()
    if filled != header.wire_bytes:
        raise StreamError("truncated", f"stream ended after {filled} of {header.wire_bytes} bytes")
    return _sealed(header, sender, buf, h.digest(), msg.trailer)


def _digest_start(chain: bytes, header: pb.TensorHeader) -> hashlib._Hash:
    h = hashlib.sha256(chain)
    h.update(header.auth.signature)
    return h


def verify_header(verifier: Verifier, header: pb.TensorHeader) -> str:
    """Check a tensor header's envelope; returns the sender's peer id."""
    try:
        return verifier.verify(HEADER_METHOD, header)
    except AuthError as exc:
        raise StreamError(exc.reason, str(exc)) from exc


async def _next(messages: AsyncIterator[pb.TensorMessage], what: str) -> pb.TensorMessage:
    try:
        return await messages.__anext__()
    except StopAsyncIteration:
        raise StreamError("truncated", f"stream ended while waiting for a {what}") from None


async def prepend(first: pb.TensorMessage, rest: AsyncIterator[pb.TensorMessage]) -> AsyncIterator[pb.TensorMessage]:
    """`first` and then the rest of the stream: hand a message read to peek at (which group, which sender) back to a
    reader that wants the whole stream."""
    yield first
    while True:
        try:
            msg = await rest.__anext__()
        except StopAsyncIteration:
            return
        yield msg
