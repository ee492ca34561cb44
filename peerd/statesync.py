"""Lossless download of the current global state (params, outer optimizer state, step) for late joiners and peers
that missed rounds.

The serving peer streams a header (tensor names, shapes, dtypes, step, digest), raw little-endian fp32 bytes in chunks
of at most 1 MiB, and a signed trailer. The receiver checks the header against the shapes it expects from its own
model *before* allocating, verifies the digest and signature, and rejects NaN/Inf. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

from peerd.identity import Identity, verify
from peerd.streams import StreamError
from peerd.v1 import peerd_pb2 as pb


@dataclass
class StateSnapshot:
    """The global state as of `step`; tensors are CPU float32 and never mutated after publishing."""

    step: int
    tensors: dict[str, torch.Tensor]
    work: int = 0  # peer-rounds behind this state (peerd/consistency.py)
    parts: list[Ranges] | None = None  # Streaming: each fragment's element ranges in the flat state tensors
    # (step, digest) of this state's ancestors, most recent first (peerd/consistency.py, `lineage_verdict`); None: not
    # known yet (the daemon derives it from the state it published before, when it publishes this one)
    lineage: Lineage | None = None

    @cached_property
    def digest(self) -> bytes:
        """Hashed once: the tensors are never mutated after publishing, and a large state takes a while to hash."""
        return state_digest(self.step, self.tensors, self.work)


Ranges = list[tuple[int, int]]  # (offset, length) pairs of elements in a flat tensor
Lineage = tuple[tuple[int, bytes], ...]
LINEAGE_STEPS = 64  # ancestors a state carries: a peer further behind than this cannot tell lag from a fork
MAX_RANGES = 1 << 16  # a request asking for more slices than this is refused


def check_ranges(flat: list[int], numel: int) -> Ranges:
    """A request's (offset, length) pairs, checked against the state's size before anything is read or allocated."""
    if len(flat) % 2 or len(flat) > 2 * MAX_RANGES:
        raise StreamError("malformed", f"ranges must be at most {MAX_RANGES} (offset, length) pairs")
    pairs = [(int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]
    if any(length <= 0 or off + length > numel for off, length in pairs):
        raise StreamError("malformed", f"a range lies outside the state's {numel} elements")
    return pairs


def part_digests(tensors: dict[str, torch.Tensor], parts: list[Ranges]) -> list[bytes]:
    """One digest per part (fragment): its slices of every state tensor, in name order."""
    out = []
    for ranges in parts:
        h = hashlib.sha256()
        for name in sorted(tensors):
            flat = tensors[name].reshape(-1)
            for off, length in ranges:
                h.update(tensor_bytes(flat[off : off + length]))
        out.append(h.digest())
    return out


def tensor_bytes(t: torch.Tensor) -> bytearray:
    """Raw little-endian bytes of a tensor (one vectorised copy; no numpy needed)."""
    buf = bytearray(t.numel() * t.element_size())
    if buf:
        torch.frombuffer(buf, dtype=t.dtype).copy_(t.detach().reshape(-1))
    return buf


def state_digest(step: int, tensors: dict[str, torch.Tensor], work: int = 0) -> bytes:
    """SHA-256 over step, work, names and bytes: peers at the same step must report the same digest."""
    h = hashlib.sha256(f"{step}/{work}".encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensor_bytes(tensors[name]))
    return h.digest()


def state_messages(
    snapshot: StateSnapshot,
    identity: Identity,
    chunk_bytes: int,
    ranges: Ranges | None = None,
    next_digest: bytes = b"",
) -> Iterator[pb.StateMessage]:
    """The state as a stream; with `ranges` (checked by the caller) only those slices of every tensor.
    `next_digest`: a round average's stream (Rounds.RoundAverage) names the digest of the state it produces."""
    names = sorted(snapshot.tensors)
    if ranges:
        flats = [snapshot.tensors[n].reshape(-1) for n in names]
        blobs = [bytearray().join(tensor_bytes(f[o : o + k]) for o, k in ranges) for f in flats]
    else:
        blobs = [tensor_bytes(snapshot.tensors[n]) for n in names]
    digest = hashlib.sha256()
    for n, blob in zip(names, blobs, strict=True):
        digest.update(n.encode())
        digest.update(blob)
    header = pb.StateHeader(
        outer_step=snapshot.step,
        tensors=[pb.TensorSpec(name=n, shape=list(snapshot.tensors[n].shape), dtype="float32") for n in names],
        total_bytes=sum(len(b) for b in blobs),
        state_digest=snapshot.digest,
        work=snapshot.work,
        ranges=[v for pair in ranges or () for v in pair],
        next_digest=next_digest,
        lineage=[pb.StepDigest(step=step, digest=d) for step, d in snapshot.lineage or ()],
    )
    yield pb.StateMessage(header=header)
    for blob in blobs:
        view = memoryview(blob)
        for off in range(0, len(blob), chunk_bytes):
            yield pb.StateMessage(chunk=bytes(view[off : off + chunk_bytes]))
    d = digest.digest()
    yield pb.StateMessage(trailer=pb.TensorTrailer(digest=d, signature=identity.sign(d)))


async def read_state(
    messages: AsyncIterator[pb.StateMessage],
    expected: dict[str, tuple[int, ...]],
    sender_key: bytes,
    base: dict[str, torch.Tensor] | None = None,
    ranges: Ranges | None = None,
) -> StateSnapshot:
    """Receive a state stream; `expected` maps each tensor name to the shape this peer's model needs. With `ranges`
    the stream carries only those slices, which are patched into copies of `base` (our own state); the result must
    then match the sender's whole-state digest, so a partial download ends bit-identical to a full one."""
    first = await messages.__anext__()
    if first.WhichOneof("part") != "header":
        raise StreamError("malformed", "state stream must start with a header")
    header = first.header
    names = [t.name for t in header.tensors]
    if sorted(names) != sorted(expected) or len(set(names)) != len(names):
        raise StreamError("wrong_shape", f"state holds tensors {names}, expected {sorted(expected)}")
    sizes = []
    for spec in header.tensors:
        if spec.dtype != "float32" or tuple(spec.shape) != tuple(expected[spec.name]):
            raise StreamError(
                "wrong_shape",
                f"state tensor {spec.name} is {spec.dtype}{list(spec.shape)}, expected "
                f"float32{list(expected[spec.name])}",
            )
        n = 1
        for d in spec.shape:
            n *= d
        sizes.append(4 * (sum(k for _, k in ranges) if ranges else n))
    if list(header.ranges) != [v for pair in ranges or () for v in pair]:
        raise StreamError("malformed", "state stream carries other ranges than the ones asked for")
    if header.total_bytes != sum(sizes):
        raise StreamError("malformed", "state header's total size does not match its tensors")
    if len(header.lineage) > LINEAGE_STEPS or any(
        len(e.digest) != 32 or not 0 <= e.step < header.outer_step for e in header.lineage
    ):
        raise StreamError("malformed", "state header's lineage is too long, or names a step or digest that cannot be")
    buf = bytearray()
    trailer = None
    async for msg in messages:
        part = msg.WhichOneof("part")
        if part == "chunk":
            if len(buf) + len(msg.chunk) > header.total_bytes:
                raise StreamError("oversized", "state stream carries more bytes than declared")
            buf += msg.chunk
        elif part == "trailer":
            trailer = msg.trailer
            break
        else:
            raise StreamError("malformed", "unexpected message in a state stream")
    if trailer is None or len(buf) != header.total_bytes:
        raise StreamError("truncated", f"state stream ended after {len(buf)} of {header.total_bytes} bytes")
    tensors: dict[str, torch.Tensor] = {}
    digest = hashlib.sha256()
    off = 0
    for spec, size in zip(header.tensors, sizes, strict=True):
        blob = memoryview(buf)[off : off + size]
        digest.update(spec.name.encode())
        digest.update(blob)
        t = torch.frombuffer(bytearray(blob), dtype=torch.float32)
        if not torch.isfinite(t).all():
            raise StreamError("nan", f"state tensor {spec.name} contains NaN or Inf")
        if ranges:
            assert base is not None
            full = base[spec.name].detach().to("cpu", torch.float32).reshape(-1).clone()
            pos = 0
            for o, k in ranges:
                full[o : o + k] = t[pos : pos + k]
                pos += k
            t = full
        tensors[spec.name] = t.reshape(tuple(spec.shape))
        off += size
    d = digest.digest()
    if trailer.digest != d or not verify(sender_key, trailer.signature, d):
        raise StreamError("bad_signature", "state payload does not match the sender's signed digest")
    lineage = tuple((int(e.step), bytes(e.digest)) for e in header.lineage)
    snap = StateSnapshot(header.outer_step, tensors, int(header.work), lineage=lineage)
    if snap.digest != header.state_digest:
        raise StreamError("bad_digest", "state digest does not match its contents")
    return snap
