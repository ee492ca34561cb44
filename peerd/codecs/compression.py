"""zstd on top of a frame body: compress only when it pays, decompress only into a buffer of known size.

``decompress_into`` never lets the sender size an allocation: the output buffer is the raw length the
receiver derived from its own expected numel, the zstd frame must declare exactly that content size, the
decoder's window is capped by it, and the frame's block structure must end exactly at the end of the body
(no trailing bytes, no second frame). zstandard's one-shot ``decompress`` trusts a declared content size over
``max_output_size``, so it is not used.
"""

from __future__ import annotations

import threading

import zstandard

from peerd.codecs.errors import CodecError

PAYS_RATIO = 0.97
"""Keep the compressed body only when it is smaller than this fraction of the raw body."""
MIN_COMPRESS_BYTES = 64
DEFAULT_LEVEL = 1
"""zstd level 1: on peerd's payloads it compresses within 1-2.5% of level 3's size and encodes 1.1-3.6x faster (int8
1.41-1.61 -> 1.97-2.18 GB/s of fp32 input on one core; `python -m bench.codec --cpu-time`, table in BENCHMARKS.md)."""
MIN_LEVEL, MAX_LEVEL = -7, zstandard.MAX_COMPRESSION_LEVEL

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BLOCK_HEADER = 3
_MAX_WINDOW_LOG = 27  # zstd's own default limit; windows never exceed next_pow2(content size) anyway
_MIN_WINDOW_LOG = 10

_local = threading.local()  # zstd contexts are not thread-safe; keep one per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return comp


def _decompressor(window_log: int) -> zstandard.ZstdDecompressor:
    cache: dict[int, zstandard.ZstdDecompressor] = _local.__dict__.setdefault("decompressors", {})
    dec = cache.get(window_log)
    if dec is None:
        dec = cache[window_log] = zstandard.ZstdDecompressor(max_window_size=1 << window_log)
    return dec


def check_level(level: int) -> int:
    """Validate a zstd level (negative levels are zstd's fast modes)."""
    if isinstance(level, bool) or not isinstance(level, int) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"zstd level must be an int in [{MIN_LEVEL}, {MAX_LEVEL}], got {level!r}")
    return level


def compress_if_pays(raw: memoryview, level: int, planes: int = 1) -> bytes | None:
    """zstd-compress ``raw``; None when the result would not be below PAYS_RATIO of the raw size.

    With ``planes`` > 1, ``raw`` is that many equal byte planes (byteplanes.py), each compressed as a zstd frame of
    its own and concatenated (`decompress_planes_into` reads them): each frame gets its own entropy tables, where in
    one frame the planes of a part up to 128 KiB (one zstd block) shared a single table and compressed no better than
    the interleaved bytes. No sampling heuristic is needed: zstd detects incompressible blocks and stores them at
    >1 GB/s.
    """
    if len(raw) < MIN_COMPRESS_BYTES:
        return None
    comp = _compressor(level)
    if planes == 1:
        packed = comp.compress(raw)
    else:
        n = len(raw) // planes
        packed = b"".join(comp.compress(raw[i * n : (i + 1) * n]) for i in range(planes))
    return packed if len(packed) < PAYS_RATIO * len(raw) else None


def decompress_planes_into(stored: memoryview, out: memoryview, width: int) -> None:
    """The inverse of `compress_if_pays` with ``planes=width``: ``width`` zstd frames back to back, each filling
    exactly its plane of ``out`` and checked as `decompress_into` checks one; no bytes may follow the last."""
    n = len(out) // width
    pos = 0
    for i in range(width):
        rest = stored[pos:]
        if len(rest) < 4 or bytes(rest[:4]) != _ZSTD_MAGIC:
            raise CodecError(f"compressed body lacks plane {i + 1} of {width} (bad zstd magic)")
        length = _frame_length(rest, max_blocks=n // 1024 + 2)
        decompress_into(rest[:length], out[i * n : (i + 1) * n])
        pos += length
    if pos != len(stored):
        raise CodecError(f"compressed body has {len(stored) - pos} bytes after its last plane: trailing data")


def _frame_length(stored: memoryview, max_blocks: int) -> int:
    """Byte length of the single zstd frame at the start of ``stored``, walking its block headers."""
    try:
        pos = zstandard.frame_header_size(stored)
        has_checksum = zstandard.get_frame_parameters(stored).has_checksum
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd frame header: {exc}") from exc
    for _ in range(max_blocks):
        if pos + _BLOCK_HEADER > len(stored):
            raise CodecError("truncated zstd frame (block header past the end of the body)")
        head = int.from_bytes(stored[pos : pos + _BLOCK_HEADER], "little")
        pos += _BLOCK_HEADER
        last, kind, size = head & 1, (head >> 1) & 3, head >> 3
        if kind == 3:
            raise CodecError("corrupt zstd frame (reserved block type)")
        pos += 1 if kind == 1 else size
        if last:
            pos += 4 if has_checksum else 0
        if pos > len(stored):
            raise CodecError("truncated zstd frame (block past the end of the body)")
        if last:
            return pos
    raise CodecError(f"zstd frame has more than {max_blocks} blocks for its declared size")


def decompress_into(stored: memoryview, out: memoryview) -> None:
    """Decompress one zstd frame into ``out``, which it must fill exactly (bounded, strict).

    The caller allocates ``out`` from its own expectations, so it can choose memory that is cheap to fault in.
    """
    raw_len = len(out)
    if len(stored) < 4 or bytes(stored[:4]) != _ZSTD_MAGIC:
        raise CodecError("compressed body is not a zstd frame (bad zstd magic)")
    try:
        declared = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as exc:
        raise CodecError(f"bad zstd frame header: {exc}") from exc
    if declared != raw_len:
        raise CodecError(f"zstd frame declares {declared} content bytes, expected exactly {raw_len}")
    # A zstd block holds up to 128 KiB and our encoder's window is >= 1 KiB, so a genuine frame has at most
    # raw_len / 1 KiB + 1 blocks; the cap keeps the walk short whatever the sender claims.
    frame_len = _frame_length(stored, max_blocks=raw_len // 1024 + 2)
    if frame_len != len(stored):
        raise CodecError(f"zstd frame is {frame_len} bytes but the body holds {len(stored)}: trailing data")
    window_log = min(_MAX_WINDOW_LOG, max(_MIN_WINDOW_LOG, (raw_len - 1).bit_length()))
    try:
        reader = _decompressor(window_log).stream_reader(stored, read_size=len(stored))
        with reader:
            got = 0
            while got < raw_len:
                n = reader.readinto(out[got:])
                if n == 0:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd body: {exc}") from exc
    if got != raw_len or extra:
        raise CodecError(f"zstd body expands to {'more' if extra else got} bytes, expected {raw_len}")
