"""How a round cuts the flat vector: shards (one per member), parts of a shard (each its own frame), and the
bitmask by which a reply says whose contributions it averages. Both sides of a Reduce stream derive the same layout
from the group and the codec, so none of it travels on the wire beyond part numbers and the group's part size."""

from __future__ import annotations

from collections.abc import Iterable

from peerd.codecs import Codec

PART_BYTES = 256 << 10
"""Most bytes one part's frame may take, part of the wire protocol (both sides derive the parts from it): an owner
averages and returns a shard part by part, so the gather starts after one part has arrived from every member instead
of after the whole shard. On tbf-shaped 20 Mbit/s links (bench/wire.py) 128-256 KiB parts came within 5 % of raw TCP
where 1 MiB parts lost 8-12 % (the last part's round trip is not overlapped); at 100 Mbit/s 128 KiB parts cost more
in per-part work (signing, executor hops) than they saved."""
MAX_PART_ELEMS = 1 << 21
"""Most values in one part, part of the wire protocol since revision 14: a part bounds the CPU work that is not
overlapped (encoding the first part before anything is sent, the owner's decode, mean and re-encode of the last),
not only its bytes. Only the sparse codec reaches it: 256 KiB of sparse frame held 4.26M values, so a 10M-value
vector went in two parts per shard. bench.wire, sparse, 10M values (BENCHMARKS.md, "The wire at the link's
limit"): 2 peers at 20 Mbit/s went from 0.56-0.60 of raw TCP to 0.77-0.87; 1M-value parts did as well there but lost
more at 4 peers and 100 Mbit/s, where four daemons' per-part work on two cores sets the pace."""
MIN_PART_BYTES = 64 << 10
PART_SECONDS = 0.2
"""A round's part size (Group.part_bytes, picked by its leader): what the slowest member's measured stream moves in
PART_SECONDS, as a power of two from MIN_PART_BYTES to PART_BYTES. On a slow link a part's return trip is what the
pipeline cannot overlap, so parts shrink there; on a fast one per-part work dominates, so they stay at PART_BYTES.
bench.wire, 4 peers on 2 cores: 64 KiB parts lifted int4 at 20 Mbit/s from 0.87 to 0.91-0.94 of raw TCP, and sank
int4 at 100 Mbit/s from 0.85 to 0.56-0.62 (BENCHMARKS.md, "The wire at the link's limit")."""


def part_bytes_for(stream_rates: Iterable[float]) -> int:
    """The part size for a round whose members' streams measured `stream_rates` bytes/s (0 or none known:
    PART_BYTES). 0 stands for PART_BYTES on the wire, so a round on fast links leaves Group.part_bytes unset."""
    known = [r for r in stream_rates if r > 0]
    if not known:
        return 0
    size = PART_BYTES
    while size > MIN_PART_BYTES and size > min(known) * PART_SECONDS:
        size //= 2
    return 0 if size == PART_BYTES else size


def checked_part_bytes(value: int) -> int:
    """Group.part_bytes as a size: 0 is PART_BYTES; a leader's value outside [MIN_PART_BYTES, PART_BYTES] (tiny
    parts would multiply the per-part work, large ones the memory a part may take) is refused."""
    if value == 0:
        return PART_BYTES
    if not MIN_PART_BYTES <= value <= PART_BYTES:
        raise ValueError(f"the leader's part size {value} is outside [{MIN_PART_BYTES}, {PART_BYTES}]")
    return value


def shard_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal shards; the first numel % n shards get one extra element."""
    base, extra = divmod(numel, n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def part_elems(codec: Codec, limit: int = PART_BYTES) -> int:
    """Elements per part: the most whole codec blocks whose frame can never exceed `limit` bytes (at least one
    block), so every part is a frame of its own that decodes to exactly what the whole shard's frame would."""
    unit = max(codec.block_size, 1)
    if codec.max_encoded_size(unit) >= limit:
        return unit
    cap = max(MAX_PART_ELEMS // unit, 1)  # whole blocks within MAX_PART_ELEMS
    lo, hi = 1, 2
    while hi <= cap and codec.max_encoded_size(hi * unit) <= limit:
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:  # max_encoded_size(lo * unit) <= limit < max_encoded_size(hi * unit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if codec.max_encoded_size(mid * unit) <= limit else (lo, mid)
    return lo * unit


def part_bounds(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into parts of `size` elements (the last one shorter); an empty shard is one empty part, so every
    stream carries at least one part."""
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)] or [(lo, hi)]


def included_mask(members: int, included: Iterable[int]) -> bytes:
    """TensorHeader.included_mask: bit i (byte i // 8, bit i % 8) set for group.members[i]. Eight bytes at 64
    members, where the ids it replaces took 2 KiB in every reply part."""
    mask = bytearray((members + 7) // 8)
    for i in included:
        mask[i // 8] |= 1 << (i % 8)
    return bytes(mask)


def mask_members(mask: bytes, members: int) -> set[int] | None:
    """The member indices an included_mask names; None if it is malformed (wrong length, bits past the members)."""
    if len(mask) != (members + 7) // 8 or (members % 8 and mask[-1] >> (members % 8)):
        return None
    return {i for i in range(members) if mask[i // 8] >> (i % 8) & 1}
