"""Every malformed, corrupted or lying frame must raise CodecError: never another exception, crash or hang.

Most forgeries are *resealed* (the CRC recomputed after the edit), because a malicious peer can always make
the checksum match; these tests therefore exercise the field validation behind the checksum.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.codecs import CODEC_IDS, CODEC_NAMES, HEADER_SIZE, MAX_NUMEL, TRAILER_SIZE, CodecError, make_codec
from peerd.codecs import parse_header as parse

HYPO = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = struct.Struct("<4sBBBBIIQQQQ")  # the documented layout, written out independently of frame.py
FIELDS = ("magic", "version", "codec", "dtype", "flags", "block", "reserved", "numel", "scales", "payload", "stored")
N = 1000


def reseal(frame: bytes | bytearray) -> bytes:
    """Recompute the CRC trailer over header and body, as a forger would."""
    body = bytes(frame[:-TRAILER_SIZE])
    return body + struct.pack("<I", zlib.crc32(body))


def with_fields(frame: bytes, **changes: int | bytes) -> bytes:
    values = dict(zip(FIELDS, HEADER.unpack_from(frame), strict=True))
    values.update(changes)
    return reseal(HEADER.pack(*values.values()) + frame[HEADER_SIZE:])


def with_body(frame: bytes, body: bytes, **changes: int) -> bytes:
    """Replace the stored body (fixing stored_len unless told otherwise) and reseal."""
    values = dict(zip(FIELDS, HEADER.unpack_from(frame), strict=True))
    values["stored"] = len(body)
    values.update(changes)
    return reseal(HEADER.pack(*values.values()) + body + b"\0" * TRAILER_SIZE)


def sample(n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def frame_of(name: str, zstd: bool = False, n: int = N) -> bytes:
    x = sample(n)
    x[: n // 2] = 0.0  # compressible, so zstd=True really compresses
    return make_codec(name, zstd=zstd).encode(x)


def rejects(name: str, data: object, numel: int = N, match: str | None = None) -> None:
    with pytest.raises(CodecError, match=match):
        make_codec(name).decode(data, numel)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("zstd", [False, True])
def test_every_single_byte_flip_is_caught(name: str, zstd: bool) -> None:
    frame = frame_of(name, zstd, n=64)
    for pos in range(len(frame)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(frame)
            bad[pos] ^= mask
            rejects(name, bytes(bad), 64)


@HYPO
@given(name=st.sampled_from(CODEC_NAMES), zstd=st.booleans(), data=st.data())
def test_random_corruption_is_caught(name: str, zstd: bool, data: st.DataObject) -> None:
    frame = bytearray(frame_of(name, zstd))
    pos = data.draw(st.integers(0, len(frame) - 4))
    burst = data.draw(st.binary(min_size=1, max_size=4))
    if bytes(frame[pos : pos + len(burst)]) == burst:
        return
    frame[pos : pos + len(burst)] = burst  # any burst of <= 32 bits is caught by CRC32
    rejects(name, bytes(frame))


@HYPO
@given(name=st.sampled_from(CODEC_NAMES), zstd=st.booleans(), data=st.data())
def test_resealed_body_edits_decode_or_raise_codec_error(name: str, zstd: bool, data: st.DataObject) -> None:
    """With a valid CRC, body edits must give a finite tensor of the right size or a CodecError."""
    frame = bytearray(frame_of(name, zstd))
    lo, hi = HEADER_SIZE, len(frame) - TRAILER_SIZE - 1
    for _ in range(data.draw(st.integers(1, 8))):
        frame[data.draw(st.integers(lo, hi))] = data.draw(st.integers(0, 255))
    try:
        y = make_codec(name).decode(reseal(frame), N)
    except CodecError:
        return
    assert y.shape == (N,) and y.dtype == torch.float32 and bool(torch.isfinite(y).all())


@HYPO
@given(garbage=st.binary(max_size=300), name=st.sampled_from(CODEC_NAMES))
def test_garbage_is_rejected(garbage: bytes, name: str) -> None:
    rejects(name, garbage, 10)
    rejects(name, b"PDCF\x01" + garbage, 10)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("zstd", [False, True])
def test_truncation_and_extension_are_caught(name: str, zstd: bool) -> None:
    frame = frame_of(name, zstd)
    for cut in [0, 1, 4, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, len(frame) // 2, len(frame) - 1]:
        rejects(name, frame[:cut], match="empty|truncated")
        rejects(name, reseal(frame[:cut] + b"\0" * TRAILER_SIZE) if cut >= HEADER_SIZE else frame[:cut])
    rejects(name, frame + b"\0", match="oversized")
    rejects(name, frame + frame, match="oversized")


def test_empty_and_non_bytes_input() -> None:
    for name in CODEC_NAMES:
        rejects(name, b"", match="empty")
        rejects(name, b"", 0, match="empty")  # even an empty tensor travels as a full frame
        rejects(name, bytearray(), 0)
        rejects(name, memoryview(b""), 0)
        for bad in (None, "PDCF", 12, [0, 1], torch.zeros(10, dtype=torch.uint8)):
            rejects(name, bad, match="bytes, bytearray or memoryview")
    frame = frame_of("int8")
    strided = memoryview(frame + frame)[::2]
    rejects("int8", strided, match="contiguous")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_lying_header_fields(name: str) -> None:
    frame = frame_of(name)
    h = parse(frame)
    lies = {
        "magic": (b"PDCG", "magic"),
        "version": (2, "version"),
        "dtype": (2, "dtype"),
        "flags": (0x04, "flags"),
        "reserved": (1, "reserved"),
        "numel": (N + 1, "elements"),
        "block": (h.block_size + 2, "block size"),
        "scales": (h.scales_len + 4, "scales|body length"),
        "payload": (h.payload_len - 1, "scales|body length"),
        "stored": (h.stored_len + 1, "body length"),
    }
    for field, (value, match) in lies.items():
        rejects(name, with_fields(frame, **{field: value}), match=match)
    for value in (0, 2**63, 2**64 - 1):
        rejects(name, with_fields(frame, numel=value), match="elements")
        rejects(name, with_fields(frame, payload=value, stored=value), match="scales/payload|length")
        rejects(name, with_fields(frame, stored=value))
    rejects(name, with_fields(frame, flags=1), match="compressed body length")  # raw body claimed compressed
    rejects(name, with_fields(frame, flags=2), match="byte planes but not compressed")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_byte_planes_only_from_codecs_that_send_them(name: str) -> None:
    """A compressed frame that claims byte planes decodes only for fp32 and bf16 (the codecs without scales that
    send them); every other codec refuses it rather than shuffle its scales and codes."""
    x = torch.zeros(N)
    x[::10] = 1.0  # compressible in every codec
    frame = make_codec(name).encode(x)
    h = parse(frame)
    assert h.compressed and h.planes == (name in ("fp32", "bf16"))
    if h.planes:
        return
    forged = with_fields(frame, flags=0x03)
    rejects(name, forged, match="byte planes, which the")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_frame_of_another_codec_or_block_size(name: str) -> None:
    frame = frame_of(name)
    for other in CODEC_NAMES:
        if other != name:
            rejects(other, frame, match="codec id")
            rejects(name, with_fields(frame, codec=CODEC_IDS[other]), match="codec id")
    rejects(name, with_fields(frame, codec=0), match="codec id")
    rejects(name, with_fields(frame, codec=255), match="codec id")
    if name not in ("fp32", "bf16"):
        with pytest.raises(CodecError, match="block size"):
            make_codec(name, block_size=128).decode(frame, N)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_wrong_expected_numel(name: str) -> None:
    frame = frame_of(name)
    for numel in (N - 1, N + 1, 0, 2 * N, MAX_NUMEL):
        rejects(name, frame, numel, match="elements")
    for numel in (-1, MAX_NUMEL + 1, 2**64, 1.0, True, "1000", None):
        rejects(name, frame, numel, match="expected_numel")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_encode_rejects_nan_and_inf(name: str) -> None:
    codec = make_codec(name)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 255, 256, N - 1):  # first/last of a block, and the zero-padded tail block
            x = sample()
            x[where] = bad
            with pytest.raises(CodecError, match="NaN or Inf"):
                codec.encode(x)
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(torch.tensor([float("nan")]))


def set_scale(frame: bytes, block: int, value: float) -> bytes:
    raw = bytearray(frame)
    struct.pack_into("<f", raw, HEADER_SIZE + 4 * block, value)
    return reseal(raw)


@pytest.mark.parametrize("name", ["int8", "fp8", "e3m0", "int4"])
def test_bad_scales_are_rejected(name: str) -> None:
    frame = frame_of(name)
    last = parse(frame).scales_len // 4 - 1
    for block in (0, last):
        for value in (float("nan"), float("inf"), float("-inf"), -1.0, -1e-30):
            rejects(name, set_scale(frame, block, value), match="NaN, Inf or negative block scale")
    # The largest scale: int8's step a/127 rounds up so that 127 * step is Inf (refused); the others round
    # down or are exact, and must decode to finite values.
    huge = set_scale(frame, 0, torch.finfo(torch.float32).max)
    if name == "int8":
        rejects(name, huge, match="overflows")
    else:
        assert bool(torch.isfinite(make_codec(name).decode(huge, N)).all())
    y = make_codec(name).decode(set_scale(frame, 0, 0.0), N)  # a zero scale is legal: the block is zeros
    assert bool((y[:256] == 0).all())


def test_codes_the_encoder_never_makes_are_rejected() -> None:
    # int8: -128; fp8: NaN (0x7f/0xff); int4: nibble 8 (-8); e3m0: nibble 8 (negative zero).
    for name, byte in (("int8", 0x80), ("fp8", 0x7F), ("fp8", 0xFF), ("int4", 0x08), ("int4", 0x80), ("e3m0", 0x80)):
        frame = bytearray(frame_of(name))
        h = parse(frame)
        for offset in (0, h.payload_len - 1):
            bad = bytearray(frame)
            bad[HEADER_SIZE + h.scales_len + offset] = byte
            rejects(name, reseal(bad), match="codes its encoder never produces")


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_nan_and_inf_payloads_are_rejected(name: str) -> None:
    frame = frame_of(name)
    width = 4 if name == "fp32" else 2
    for pattern in (float("nan"), float("inf"), float("-inf")):
        code = struct.pack("<f", pattern) if width == 4 else struct.pack("<f", pattern)[2:]
        for element in (0, N - 1):
            bad = bytearray(frame)
            bad[HEADER_SIZE + width * element : HEADER_SIZE + width * (element + 1)] = code
            rejects(name, reseal(bad), match="NaN or Inf")


def raw_body(name: str, n: int = N) -> tuple[bytes, bytes]:
    """An uncompressed frame and its raw body (what a compressed frame must decompress to)."""
    frame = frame_of(name, zstd=False, n=n)
    return frame, frame[HEADER_SIZE:-TRAILER_SIZE]


def compressed_frame(frame: bytes, zbody: bytes) -> bytes:
    return with_body(frame, zbody, flags=1)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_honest_compressed_forgery_decodes(name: str) -> None:
    """Control: the helpers build frames the decoder accepts, so the rejections below are meaningful."""
    frame, raw = raw_body(name)
    forged = compressed_frame(frame, zstandard.ZstdCompressor(level=19).compress(raw))
    assert torch.equal(make_codec(name).decode(forged, N), make_codec(name).decode(frame, N))


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zstd_bombs_and_lies(name: str) -> None:
    n = 40_000
    frame, raw = raw_body(name, n)
    comp = zstandard.ZstdCompressor(level=3)
    bomb = comp.compress(b"\0" * (256 << 20))  # 256 MiB of zeros in ~8 KiB
    assert len(bomb) < len(raw)
    tracemalloc.start()
    try:
        rejects(name, compressed_frame(frame, bomb), n, match="declares 268435456 content bytes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"decoding a bomb allocated {peak} bytes"
    nosize = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(raw)
    rejects(name, compressed_frame(frame, nosize), n, match="content bytes")
    short = comp.compress(raw[:-1])
    rejects(name, compressed_frame(frame, short), n, match="content bytes")
    good = comp.compress(raw)
    assert torch.equal(make_codec(name).decode(compressed_frame(frame, good), n), make_codec(name).decode(frame, n))
    rejects(name, compressed_frame(frame, good + b"\0\0"), n, match="trailing data")
    rejects(name, compressed_frame(frame, good + comp.compress(b"x")), n, match="trailing data")
    rejects(name, compressed_frame(frame, good[:-1]), n, match="truncated|corrupt")
    rejects(name, compressed_frame(frame, b"\0" * (len(raw) // 2)), n, match="zstd magic")
    rejects(name, compressed_frame(frame, good[:4]), n, match="zstd")


def set_content_size(zframe: bytes, size: int) -> bytes:
    """Rewrite a single-segment zstd frame's 4-byte Frame_Content_Size field (RFC 8878, 3.1.1.1)."""
    descriptor = zframe[4]
    assert descriptor >> 6 == 2 and descriptor & 0x20 and descriptor & 0x03 == 0, "expected FCS=4 bytes"
    return zframe[:5] + struct.pack("<I", size) + zframe[9:]


def test_zstd_frame_that_expands_past_its_declared_size() -> None:
    """The zstd header says exactly the expected size, but the blocks hold more: decoding must stop."""
    name = "fp32"
    frame, raw = raw_body(name)  # 4000 raw bytes
    big = zstandard.ZstdCompressor(level=3).compress(raw * 40)  # 160000 bytes -> 4-byte FCS field
    assert zstandard.frame_content_size(big) == 40 * len(raw)
    liar = set_content_size(big, len(raw))
    assert zstandard.frame_content_size(liar) == len(raw)
    rejects(name, compressed_frame(frame, liar), match="corrupt zstd body|blocks")


def test_too_many_zstd_blocks_is_bounded() -> None:
    """A frame of endless empty raw blocks is refused after a bounded walk, not looped over."""
    name = "fp32"
    frame, raw = raw_body(name)
    zheader = b"\x28\xb5\x2f\xfd" + bytes([0x80 | 0x20]) + struct.pack("<I", len(raw))  # FCS=4, single segment
    empty_raw_block = (0 << 3 | 0 << 1 | 0).to_bytes(3, "little")
    body = zheader + empty_raw_block * 2000
    rejects(name, compressed_frame(frame, body[: len(raw) - 1]), match="blocks|truncated")


def test_decoder_survives_every_prefix_of_a_compressed_frame() -> None:
    frame = frame_of("int4", zstd=True)
    assert parse(frame).compressed
    body = frame[HEADER_SIZE:-TRAILER_SIZE]
    for cut in range(1, len(body)):
        rejects("int4", with_body(frame, body[:cut], flags=1))


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_byte_plane_frames_that_lie(name: str) -> None:
    """A planes body is one zstd frame per plane, each declaring exactly its plane's bytes: a missing plane, a
    plane that declares another size, and bytes after the last plane are refused before anything is trusted."""
    width = 4 if name == "fp32" else 2
    frame = frame_of(name, zstd=True)
    h = parse(frame)
    assert h.planes
    body = frame[HEADER_SIZE : HEADER_SIZE + h.stored_len]
    plane = h.raw_len // width
    planes = [zstandard.ZstdCompressor().compress(bytes(plane)) for _ in range(width)]
    assert len(make_codec(name).decode(with_body(frame, b"".join(planes)), N)) == N  # a forged but honest body
    rejects(name, with_body(frame, b"".join(planes[:-1])), match="lacks plane")
    rejects(name, with_body(frame, body + b"\0"), match="trailing data|lacks plane")
    rejects(name, with_body(frame, b"".join(planes) + planes[0]), match="trailing data")
    wrong = zstandard.ZstdCompressor().compress(bytes(plane + 1))
    rejects(name, with_body(frame, b"".join([wrong, *planes[1:]])), match="declares")
