"""The Codec interface and the frame handling every codec shares (framing, zstd, checksum, validation).

Subclasses only turn a tensor into a raw body (``scales || payload``) and back; this class wraps that body
in a frame on the way out and, on the way in, checks the frame against the receiver's own expectations
before a single byte is allocated.
"""

from __future__ import annotations

import ctypes
import operator
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from peerd.codecs import hostmem
from peerd.codecs.byteplanes import from_planes, to_planes
from peerd.codecs.compression import (
    DEFAULT_LEVEL,
    check_level,
    compress_if_pays,
    decompress_into,
    decompress_planes_into,
)
from peerd.codecs.errors import CodecError
from peerd.codecs.frame import (
    FLAG_PLANES,
    FLAG_ZSTD,
    HEADER_SIZE,
    TRAILER_SIZE,
    FrameHeader,
    SealedFrame,
    open_frame,
    seal_parts,
)

MAX_NUMEL = 1 << 40
"""Largest tensor a frame may describe (4 TiB of float32): a sanity bound on sizes, far above any fragment."""


def host_byte_view(t: Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (torch tensors do not export the buffer protocol).

    The caller must keep ``t`` alive while the view is in use.
    """
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def check_input(x: Tensor) -> Tensor:
    """Accept only a 1-D float32 tensor; returns it contiguous."""
    if not isinstance(x, Tensor):
        raise CodecError(f"encode expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise CodecError(f"encode expects float32, got {x.dtype}")
    if x.dim() != 1:
        raise CodecError(f"encode expects a 1-D tensor, got shape {tuple(x.shape)}")
    if x.numel() > MAX_NUMEL:
        raise CodecError(f"tensor of {x.numel()} elements exceeds the frame limit of {MAX_NUMEL}")
    return x.detach().contiguous()


def check_numel(numel: int) -> int:
    """An element count the caller expects: any integer type (numpy, 0-d tensor) but bool, within bounds."""
    try:
        value = operator.index(numel) if not isinstance(numel, bool) else -1
    except TypeError:
        value = -1
    if not 0 <= value <= MAX_NUMEL:
        raise CodecError(f"expected_numel must be an int in [0, {MAX_NUMEL}], got {numel!r}")
    return value


def finite_or_raise(t: Tensor, what: str) -> None:
    """One pass, no full-size temporary: min/max propagate NaN, and a finite min and max bound everything."""
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise CodecError(f"{what} contains NaN or Inf")


class Codec(ABC):
    """Turns a 1-D float32 tensor into one self-describing frame and back (see ``peerd.codecs``)."""

    name: str
    codec_id: int
    lossless: bool = False
    """True when ``decode(encode(x))`` is bit-identical to ``x``: a round may then use ``x`` itself."""
    plane_width: int = 0
    """Bytes per value of a scale-free body that zstd gets as byte planes (peerd/codecs/byteplanes.py); 0: as is."""
    decodes_while_encoding: bool = False
    """True when ``_encode_body_into`` knows the decoded values while encoding (see ``encode_frame_into``)."""

    def __init__(self, *, zstd_level: int = DEFAULT_LEVEL, zstd: bool = True) -> None:
        self.zstd_level = check_level(zstd_level)
        self.zstd = bool(zstd)

    @property
    def block_size(self) -> int:
        """Elements per scale block, 0 for codecs without scales."""
        return 0

    @abstractmethod
    def body_layout(self, numel: int) -> tuple[int, int]:
        """Raw byte lengths ``(scales_len, payload_len)`` of the body for ``numel`` elements."""

    @abstractmethod
    def _encode_body(self, x: Tensor) -> Tensor:
        """Raw body of a checked, non-empty ``x`` as a contiguous uint8 CPU tensor of exactly the layout size."""

    def _encode_body_into(self, x: Tensor, out: Tensor) -> Tensor:
        """``_encode_body``, also writing what the body decodes to into ``out``; only where
        ``decodes_while_encoding``."""
        raise NotImplementedError

    @abstractmethod
    def _decode_body(self, raw: Tensor, numel: int) -> Tensor:
        """Float32 tensor of ``numel`` values from a raw body (uint8, already on the target device)."""

    def encode(self, x: Tensor) -> bytes:
        """Quantize on ``x``'s device, copy only the encoded body to the host, and frame it.

        Raises CodecError for a tensor that is not 1-D float32 or holds NaN/Inf.
        """
        return bytes(self.encode_frame(x))

    def encode_frame(self, x: Tensor) -> SealedFrame:
        """`encode` without the final join: the frame's parts, the body possibly sharing ``x``'s memory (fp32 on the
        CPU), so ``x`` must not change until the frame is sent."""
        return self._frame(check_input(x), None)

    def encode_frame_into(self, x: Tensor, out: Tensor) -> SealedFrame:
        """`encode_frame`, with what the frame decodes to written into ``out`` (bit-identical to `decode_into` of
        it). A round needs both for its own parts (an owner's average, its contribution to its own shard): a codec
        that knows its decoded values while encoding (sparse) skips decompressing and re-checking its own frame."""
        x = check_input(x)
        if out.numel() != x.numel() or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 tensor of {x.numel()} values")
        if not self.decodes_while_encoding or out.device != x.device:
            frame = self._frame(x, None)
            self.decode_into(bytes(frame), out)
            return frame
        return self._frame(x, out)

    def _frame(self, x: Tensor, out: Tensor | None) -> SealedFrame:
        numel = x.numel()
        scales_len, payload_len = self.body_layout(numel)
        if not numel:
            body = torch.empty(0, dtype=torch.uint8)
        else:
            body = self._encode_body(x) if out is None else self._encode_body_into(x, out)
        if body.numel() != scales_len + payload_len:  # pragma: no cover - guards subclass bugs
            raise AssertionError(f"{self.name} body is {body.numel()} bytes, layout says {scales_len + payload_len}")
        raw = host_byte_view(body) if body.numel() else memoryview(b"")
        packed, flags = None, 0
        if self.zstd and self.plane_width and not scales_len and body.numel():
            planes = to_planes(body, self.plane_width)
            packed = compress_if_pays(host_byte_view(planes), self.zstd_level, planes=self.plane_width)
            flags = FLAG_ZSTD | FLAG_PLANES
        elif self.zstd:
            packed, flags = compress_if_pays(raw, self.zstd_level), FLAG_ZSTD
        header = FrameHeader(
            codec_id=self.codec_id,
            numel=numel,
            block_size=self.block_size,
            flags=flags if packed is not None else 0,
            scales_len=scales_len,
            payload_len=payload_len,
            stored_len=len(packed) if packed is not None else len(raw),
        )
        if packed is not None:
            return seal_parts(header, packed)
        return seal_parts(header, raw, owner=body)  # the view borrows body's memory: the frame keeps body alive

    def decode(
        self, data: bytes | bytearray | memoryview, expected_numel: int, device: str | torch.device = "cpu"
    ) -> Tensor:
        """Decode one frame into a fresh float32 tensor of ``expected_numel`` elements on ``device``.

        Raises CodecError on any truncation, corruption, lie, or NaN/Inf; bit-identical on every device.
        A ``bytearray`` argument is taken over: an fp32 result may share its memory rather than copy it.
        """
        numel = check_numel(expected_numel)
        target = torch.device(device)
        body = self._open_body(data, numel, target)
        if body is None:
            return torch.empty(0, dtype=torch.float32, device=target)
        return self._decode_body(body, numel)

    def decode_into(self, data: bytes | bytearray | memoryview, out: Tensor) -> Tensor:
        """Decode one frame of ``out.numel()`` values into ``out`` (a contiguous float32 slice of the caller's
        result) and return it. Checked as ``decode`` is; after a CodecError ``out`` may hold part of the frame. A
        codec that scatters (sparse) writes there directly: a fresh dense tensor the caller then copied cost a
        sparse round as much as its decoding."""
        numel = check_numel(out.numel())
        body = self._open_body(data, numel, out.device)
        if body is not None:
            self._decode_body_into(body, numel, out)
        return out

    def _decode_body_into(self, raw: Tensor, numel: int, out: Tensor) -> None:
        out.copy_(self._decode_body(raw, numel))

    def _open_body(self, data: bytes | bytearray | memoryview, numel: int, target: torch.device) -> Tensor | None:
        """The frame's checked raw body on ``target`` (None for an empty frame)."""
        scales_len, payload_len = self.body_layout(numel)
        header, stored = open_frame(
            data,
            codec_id=self.codec_id,
            numel=numel,
            block_size=self.block_size,
            scales_len=scales_len,
            payload_len=payload_len,
        )
        if numel == 0:
            return None
        # A private writable copy (or the bounded decompression output) backs the tensor: frames arrive as
        # read-only bytes, which torch can only wrap with a warning, and fp32 returns this memory as-is. The
        # copy goes to memory advised for huge pages: faulting in fresh 4 KiB pages costs more than copying.
        if isinstance(data, bytearray) and not header.compressed:
            # The caller handed over a private writable buffer: wrap it instead of copying 4 B/value.
            body = torch.frombuffer(stored, dtype=torch.uint8)
        else:
            body = hostmem.empty(header.raw_len, torch.uint8, torch.device("cpu"))
            if header.planes:
                if not self.plane_width or scales_len:
                    raise CodecError(f"frame says its body is in byte planes, which the {self.name} codec never sends")
                decompress_planes_into(stored, host_byte_view(body), self.plane_width)
                body = from_planes(body, self.plane_width)
            elif header.compressed:
                decompress_into(stored, host_byte_view(body))
            else:
                host_byte_view(body)[:] = stored
        return body.to(target) if target.type != "cpu" else body

    def max_encoded_size(self, numel: int) -> int:
        """Upper bound of ``len(encode(x))`` for ``x.numel() == numel`` (compression never grows a frame)."""
        scales_len, payload_len = self.body_layout(check_numel(numel))
        return HEADER_SIZE + scales_len + payload_len + TRAILER_SIZE

    def __repr__(self) -> str:
        zstd = f"zstd={self.zstd_level}" if self.zstd else "zstd=off"
        block = f", block_size={self.block_size}" if self.block_size else ""
        return f"{type(self).__name__}({self.name!r}{block}, {zstd})"
