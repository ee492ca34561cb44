"""Codecs without scales: lossless float32, and bfloat16 (a plain round-half-even cast)."""

from __future__ import annotations

import torch
from torch import Tensor

from peerd.codecs.base import Codec, finite_or_raise
from peerd.codecs.errors import CodecError

# float32 values at or beyond this magnitude round to Inf in bfloat16: it is halfway between the largest
# bfloat16 (2 - 2^-7) * 2^127 and 2^128, and the tie goes to the even neighbour, Inf.
_BF16_OVERFLOW = (2.0 - 2.0**-8) * 2.0**127


class Fp32Codec(Codec):
    """Lossless: the body is the tensor's float32 bytes (little-endian)."""

    name, codec_id = "fp32", 1
    lossless = True
    plane_width = 4

    def body_layout(self, numel: int) -> tuple[int, int]:
        return 0, 4 * numel

    def _encode_body(self, x: Tensor) -> Tensor:
        finite_or_raise(x, "input tensor")
        return x.cpu().view(torch.uint8)

    def _decode_body(self, raw: Tensor, numel: int) -> Tensor:
        out = raw.view(torch.float32)
        finite_or_raise(out, "decoded fp32 frame")
        return out


class Bf16Codec(Codec):
    """bfloat16 cast: relative error <= 2^-8; rejects inputs that would round to Inf."""

    name, codec_id = "bf16", 2
    plane_width = 2

    def body_layout(self, numel: int) -> tuple[int, int]:
        return 0, 2 * numel

    def _encode_body(self, x: Tensor) -> Tensor:
        lo, hi = torch.aminmax(x)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise CodecError("input tensor contains NaN or Inf")
        if max(-float(lo), float(hi)) >= _BF16_OVERFLOW:
            raise CodecError(f"input magnitude {max(-float(lo), float(hi)):.4g} overflows bfloat16")
        return x.to(torch.bfloat16).cpu().view(torch.uint8)

    def _decode_body(self, raw: Tensor, numel: int) -> Tensor:
        out = raw.view(torch.bfloat16).float()
        finite_or_raise(out, "decoded bf16 frame")
        return out
