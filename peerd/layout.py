"""How a round cuts the flat vector: shards (one per member), parts of a shard (each its own frame), and the
bitmask by which a reply says whose contributions it averages. Both sides of a Reduce stream derive the same layout
from the group and the codec, so none of it travels on the wire beyond part numbers."""

from __future__ import annotations

from collections.abc import Iterable

from peerd.codecs import Codec

PART_BYTES = 256 << 10
"""Most bytes one part's frame may take, part of the wire protocol (both sides derive the parts from it): an owner
averages and returns a shard part by part, so the gather starts after one part has arrived from every member instead
of after the whole shard. On tbf-shaped 20 Mbit/s links (bench/wire.py) 128-256 KiB parts came within 5 % of raw TCP
where 1 MiB parts lost 8-12 % (the last part's round trip is not overlapped); at 100 Mbit/s 128 KiB parts cost more
in per-part work (signing, executor hops) than they saved."""
MAX_PART_ELEMS = 1 << 40


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
    lo, hi = 1, 2
    while hi * unit <= MAX_PART_ELEMS and codec.max_encoded_size(hi * unit) <= limit:
        lo, hi = hi, hi * 2
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
