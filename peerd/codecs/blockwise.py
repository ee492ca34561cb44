"""Codecs with one float32 scale (the absmax) per block: int8, fp8, e3m0, int4.

Body layout: ``scales`` (one little-endian float32 per block) then ``payload`` (the packed codes of every
block, ``block_size * bits / 8`` bytes each). The last block is zero-padded on encode and the padding is
dropped on decode, so any numel works.

On the CPU the work runs over row chunks of about CHUNK_ELEMS values so every temporary stays in cache and is
reused by the allocator; fresh full-size buffers cost more in page faults than the arithmetic itself. On
CUDA the whole tensor is one chunk. Chunking never changes results: every block is quantized on its own.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from peerd.codecs import hostmem
from peerd.codecs.base import Codec
from peerd.codecs.compression import DEFAULT_LEVEL
from peerd.codecs.errors import CodecError
from peerd.codecs.quant import BlockQuantizer

CHUNK_ELEMS = 1 << 18
MAX_BLOCK_SIZE = 1 << 20
_FIT_SCALES_FROM = 2.0**127  # below this, step * max_code <= a * (1 + 2^-23) cannot overflow


def check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size must be an int, got {block_size!r}")
    if not 2 <= block_size <= MAX_BLOCK_SIZE or block_size % 2:
        raise ValueError(f"block_size must be even and in [2, {MAX_BLOCK_SIZE}], got {block_size}")
    return block_size


class BlockwiseCodec(Codec):
    """A frame codec around one :class:`~peerd.codecs.quant.BlockQuantizer`."""

    decodes_while_encoding = True

    def __init__(
        self, quantizer: BlockQuantizer, *, block_size: int = 256, zstd_level: int = DEFAULT_LEVEL, zstd: bool = True
    ) -> None:
        super().__init__(zstd_level=zstd_level, zstd=zstd)
        self.quantizer = quantizer
        self.name = quantizer.name
        self.codec_id = quantizer.codec_id
        self._block = check_block_size(block_size)

    @property
    def block_size(self) -> int:
        return self._block

    def _blocks(self, numel: int) -> int:
        return -(-numel // self._block)

    def body_layout(self, numel: int) -> tuple[int, int]:
        blocks = self._blocks(numel)
        return 4 * blocks, blocks * self.quantizer.code_bytes(self._block)

    def _rows_per_chunk(self, device: torch.device, blocks: int) -> int:
        return max(1, CHUNK_ELEMS // self._block) if device.type == "cpu" else max(1, blocks)

    def _encode_body(self, x: Tensor) -> Tensor:
        return self._encode(x, None)

    def _encode_body_into(self, x: Tensor, out: Tensor) -> Tensor:
        return self._encode(x, out)

    def _encode(self, x: Tensor, out: Tensor | None) -> Tensor:
        """The body of ``x``; with ``out``, each row chunk's codes are also dequantized into it while still in cache,
        by the decoder's own :meth:`_dequantize`, so ``out`` is bit-identical to what every receiver decodes."""
        numel, block = x.numel(), self._block
        blocks, full = self._blocks(numel), numel // block
        scales_len, payload_len = self.body_layout(numel)
        body = torch.empty(scales_len + payload_len, dtype=torch.uint8, device=x.device)
        scales = body[:scales_len].view(torch.float32)
        codes = body[scales_len:].view(blocks, -1)
        rows = self._rows_per_chunk(x.device, blocks)
        main = x[: full * block].view(full, block)
        main_out = out[: full * block].view(full, block) if out is not None else None
        for r0 in range(0, full, rows):
            r1 = min(r0 + rows, full)  # the tail block, if any, is not part of main
            self._encode_rows(main[r0:r1], scales[r0:r1], codes[r0:r1])
            if main_out is not None:
                self._dequantize(codes[r0:r1], self.quantizer.steps(scales[r0:r1]), main_out[r0:r1])
        if full < blocks:
            tail = x.new_zeros(1, block)
            tail[0, : numel - full * block] = x[full * block :]
            self._encode_rows(tail, scales[full:], codes[full:])
            if out is not None:
                self._dequantize_tail(codes[full:], self.quantizer.steps(scales[full:]), out[full * block :])
        return body.cpu()

    def _encode_rows(self, xb: Tensor, absmax_out: Tensor, codes_out: Tensor) -> None:
        torch.amax(xb.abs(), dim=1, out=absmax_out)  # NaN propagates; abs() makes zero blocks +0.0
        peak = float(absmax_out.max())
        if not math.isfinite(peak):
            raise CodecError("input tensor contains NaN or Inf")
        if peak >= _FIT_SCALES_FROM:
            self._fit_scales(absmax_out)
        self.quantizer.quantize(xb, absmax_out, codes_out)

    def _fit_scales(self, absmax: Tensor) -> None:
        """Lower, by an ulp or two, scales so close to the float32 maximum that ``step * max_code`` is Inf.

        ``a / max_code`` can round up, so the largest code would decode to Inf. With the scale one ulp lower,
        ``|x| / a`` exceeds 1 by at most an ulp, which rounding absorbs into the largest code; every finite
        input therefore encodes, and the decoder's overflow check only ever fires on forged frames.
        """
        for _ in range(8):
            overflow = ~torch.isfinite(self.quantizer.steps(absmax) * self.quantizer.max_code)
            if not bool(overflow.any()):
                return
            absmax.copy_(torch.where(overflow, torch.nextafter(absmax, torch.zeros_like(absmax)), absmax))
        raise AssertionError("scale fitting did not converge")  # pragma: no cover - a few ulps always suffice

    def _decode_body(self, raw: Tensor, numel: int) -> Tensor:
        blocks = self._blocks(numel)
        out = hostmem.empty(blocks * self._block, torch.float32, raw.device)
        codes, steps = self._checked_codes(raw, numel)
        self._dequantize(codes, steps, out.view(blocks, self._block))
        return out[:numel]

    def _decode_body_into(self, raw: Tensor, numel: int, out: Tensor) -> None:
        """Full blocks are dequantized straight into ``out`` (a round's result vector): a fresh tensor copied there
        cost a 4-peer int4 round more than the dequantization itself. Only a partial last block goes via a row."""
        block, blocks, full = self._block, self._blocks(numel), numel // self._block
        codes, steps = self._checked_codes(raw, numel)
        self._dequantize(codes[:full], steps[:full], out[: full * block].view(full, block))
        if full < blocks:
            self._dequantize_tail(codes[full:], steps[full:], out[full * block :])

    def _checked_codes(self, raw: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """The body's codes as [blocks, code bytes] and each block's dequantization step, after checking the scales."""
        blocks = self._blocks(numel)
        scales_len = 4 * blocks
        scales = raw[:scales_len].view(torch.float32)
        codes = raw[scales_len:].view(blocks, -1)
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise CodecError(f"{self.name} frame has a NaN, Inf or negative block scale")
        steps = self.quantizer.steps(scales)
        if not bool(torch.isfinite(steps * self.quantizer.max_code).all()):
            raise CodecError(f"{self.name} frame has a block scale that overflows float32 when decoded")
        return codes, steps

    def _dequantize_tail(self, codes: Tensor, steps: Tensor, out: Tensor) -> None:
        """The partial last block: dequantized as one whole row, of which ``out`` takes the first ``out.numel()``."""
        row = torch.empty(1, self._block, dtype=torch.float32, device=out.device)
        self._dequantize(codes, steps, row)
        out.copy_(row[0, : out.numel()])

    def _dequantize(self, codes: Tensor, steps: Tensor, rows_out: Tensor) -> None:
        """Dequantize [rows, code bytes] into [rows, block] float32 in cache-sized chunks; CodecError on a code the
        encoder never makes (``rows_out`` may then hold part of the frame)."""
        rows = self._rows_per_chunk(codes.device, codes.shape[0])
        invalid = [
            self.quantizer.dequantize(codes[r0 : r0 + rows], steps[r0 : r0 + rows], rows_out[r0 : r0 + rows])
            for r0 in range(0, codes.shape[0], rows)
        ]
        if invalid and bool(torch.stack(invalid).any()):
            raise CodecError(f"{self.name} frame holds codes its encoder never produces")
