"""Blockwise quantizers: rows of float32 blocks to packed codes and back, bit-identical on CPU and CUDA.

Every block stores one float32 scale, its absmax ``a``. Encoders work on ``u = x / a``, which lies in
[-1, 1] *exactly* (IEEE division is correctly rounded and ``|x| <= a``), so no clamp is needed and nothing
overflows; storing ``a`` rather than ``a / 127`` also keeps the stored scale exact for subnormal blocks.
Decoders multiply each code's value by a per-block ``step = a / max_code``.

Determinism rules followed here: only correctly rounded IEEE operations (tensor/tensor division,
multiplication, round-half-even, comparisons, integer bit operations, float8 casts); no transcendental
functions (their last bit differs between libm and CUDA); no division by a Python scalar (CUDA rewrites
``t / c`` into ``t * (1 / c)``, which rounds differently). Codes are written straight into the caller's
output slice and dequantized values straight into the caller's output tensor, so no full-size temporaries
exist beyond the one float row-chunk the caller passes in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor


def exact_div(t: Tensor, divisor: float) -> Tensor:
    """``t / divisor`` correctly rounded on every device (a tensor divisor avoids CUDA's reciprocal trick)."""
    return t / torch.full_like(t, divisor)


def unit(xb: Tensor, absmax: Tensor) -> Tensor:
    """``xb / absmax`` per row, in [-1, 1]; all-zero rows divide by 1 instead of 0."""
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    return xb / safe.unsqueeze(1)


class BlockQuantizer(ABC):
    """One code format. ``quantize``/``dequantize`` see [rows, block] float32 and [rows, code bytes] uint8."""

    name: str
    codec_id: int
    bits: int
    max_code: float
    """Magnitude of the largest code in units of the dequantization step (step = absmax / max_code)."""

    def code_bytes(self, block_size: int) -> int:
        return block_size * self.bits // 8

    def steps(self, absmax: Tensor) -> Tensor:
        return exact_div(absmax, self.max_code)

    @abstractmethod
    def quantize(self, xb: Tensor, absmax: Tensor, out: Tensor) -> None:
        """Write the codes of ``xb`` (finite ``absmax`` per row) into ``out``."""

    @abstractmethod
    def dequantize(self, codes: Tensor, steps: Tensor, out: Tensor) -> Tensor:
        """Write values into ``out``; return a 0-d bool tensor, True if any code is one the encoder never makes."""


class Int8Quantizer(BlockQuantizer):
    """Symmetric absmax int8: q = round(x / a * 127) in [-127, 127]; -128 is invalid."""

    name, codec_id, bits, max_code = "int8", 3, 8, 127.0

    def quantize(self, xb: Tensor, absmax: Tensor, out: Tensor) -> None:
        t = unit(xb, absmax)
        t.mul_(self.max_code).round_()
        out.view(torch.int8).copy_(t)

    def dequantize(self, codes: Tensor, steps: Tensor, out: Tensor) -> Tensor:
        # Convert, then scale in place: the same two roundings as a mixed int8 * float32 multiply (the int8 to
        # float32 conversion is exact), but both passes vectorize, where the mixed-dtype kernel is ~40% slower.
        q = codes.view(torch.int8)
        out.copy_(q).mul_(steps.unsqueeze(1))
        return q.amin() == -128


class Fp8Quantizer(BlockQuantizer):
    """float8 e4m3fn of x / a * 448 (round-half-even by the cast); the NaN codes 0x7f/0xff are invalid."""

    name, codec_id, bits, max_code = "fp8", 4, 8, 448.0

    def quantize(self, xb: Tensor, absmax: Tensor, out: Tensor) -> None:
        t = unit(xb, absmax)
        t.mul_(self.max_code)
        out.view(torch.float8_e4m3fn).copy_(t)

    def dequantize(self, codes: Tensor, steps: Tensor, out: Tensor) -> Tensor:
        # A 256-entry lookup is ~4x faster on the CPU than torch's scalar float8 -> float32 conversion.
        torch.index_select(_fp8_table(out.device), 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))
        out.mul_(steps.unsqueeze(1))
        return out.amax().isnan()  # amax propagates NaN


@lru_cache(maxsize=16)
def _fp8_table(device: torch.device) -> Tensor:
    """float32 value of every e4m3fn byte (exact; the NaN bytes 0x7f and 0xff stay NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def _pack_nibbles(codes: Tensor, out: Tensor) -> None:
    """Pack [rows, block] int8 codes in -8..15 two per byte: element 2i in the low nibble, 2i+1 in the high.

    Viewing each pair as one little-endian int16 turns the packing into three contiguous integer ops (a
    stride-2 gather of the pairs is ~5x slower on the CPU).
    """
    pairs = codes.view(torch.int16)
    torch.bitwise_or(pairs & 0x0F, (pairs >> 4) & 0xF0, out=out)


def _unpack_int4(codes: Tensor) -> Tensor:
    """[rows, bytes] packed nibbles to [rows, 2 * bytes] int8 codes in -8..7, low nibble first.

    Integer ops only, ~2x faster on the CPU than a byte lookup table: widening each byte ``16h + l`` to int16
    and adding ``15 * 16h`` gives ``256h + l``, whose little-endian bytes are ``l, h``; ``(v ^ 8) - 8`` then
    sign-extends each 4-bit two's complement value.
    """
    wide = codes.to(torch.int16)
    high = wide & 0xF0
    wide.add_(high.mul_(15))
    return wide.view(torch.int8).bitwise_xor_(8).sub_(8)


def _unpack_with_table(codes: Tensor, table: Tensor, steps: Tensor, out: Tensor) -> Tensor:
    """Look up both nibbles of every byte in a [256, 2] table, scale per block, flag NaN (invalid) codes."""
    torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1, 2))
    out.mul_(steps.unsqueeze(1))
    return out.amax().isnan()  # amax propagates NaN


def _byte_table(nibble_value: Callable[[int], float], device: torch.device) -> Tensor:
    rows = [(nibble_value(b & 15), nibble_value(b >> 4)) for b in range(256)]
    return torch.tensor(rows, dtype=torch.float32, device=device)


class Int4Quantizer(BlockQuantizer):
    """Symmetric absmax int4: q = round(x / a * 7) in [-7, 7], two's complement nibbles; -8 is invalid."""

    name, codec_id, bits, max_code = "int4", 6, 4, 7.0

    def quantize(self, xb: Tensor, absmax: Tensor, out: Tensor) -> None:
        t = unit(xb, absmax)
        t.mul_(self.max_code).round_()
        _pack_nibbles(t.to(torch.int8), out)

    def dequantize(self, codes: Tensor, steps: Tensor, out: Tensor) -> Tensor:
        q = _unpack_int4(codes)
        out.copy_(q).mul_(steps.unsqueeze(1))  # float(q) * step, exactly what the [256, 2] lookup table gave
        return q.amin() == -8


# e3m0 levels, in units of the block absmax: 0 and 2^-6 .. 2^0. Rounding is to the nearest level in
# *linear* space, which minimises each element's absolute (hence squared) error -- the quantity that matters
# when contributions are averaged. Log-space rounding would put the cut between 2^k and 2^(k+1) at
# 2^(k+0.5) ~ 1.414 * 2^k instead of 1.5 * 2^k and round more values up. Ties round away from zero.
_E3M0_ZERO_CUT = 2.0**-7  # halfway between 0 and the smallest level 2^-6
_HALF_MANTISSA = 1 << 22
_MANTISSA_BITS = 23
_EXP_BIAS_OF_LEVEL_0 = 127 - 7  # biased float32 exponent of 2^-7, i.e. of e3m0 exponent code 0


def _e3m0_value(code: int) -> float:
    """Nibble ``s eee``: 0 for e == 0, else (-1)^s * 2^(e - 7). Code 8 (a negative zero) is never emitted."""
    sign, exp = code >> 3, code & 7
    if exp == 0:
        return 0.0 if sign == 0 else float("nan")
    return (-1.0) ** sign * 2.0 ** (exp - 7)


@lru_cache(maxsize=16)
def _e3m0_table(device: torch.device) -> Tensor:
    return _byte_table(_e3m0_value, device)


class E3M0Quantizer(BlockQuantizer):
    """4-bit sign + 3-bit exponent, no mantissa (as in Streaming DiLoCo); scale = absmax, step = absmax."""

    name, codec_id, bits, max_code = "e3m0", 5, 4, 1.0

    def quantize(self, xb: Tensor, absmax: Tensor, out: Tensor) -> None:
        t = unit(xb, absmax)
        negative = t <= -_E3M0_ZERO_CUT  # the sign bit is set only on non-zero levels
        t.abs_()
        nonzero = t >= _E3M0_ZERO_CUT
        # Nearest power of two in linear space straight from the float bits: adding half the mantissa range
        # carries into the exponent exactly when the mantissa is >= 1.5 (the linear midpoint; ties go up).
        exp = t.view(torch.int32)
        exp.add_(_HALF_MANTISSA).bitwise_right_shift_(_MANTISSA_BITS).sub_(_EXP_BIAS_OF_LEVEL_0).clamp_(max=7)
        torch.maximum(exp, nonzero, out=exp)  # [2^-7, 1.5 * 2^-7) belongs to 2^-6, not to zero
        exp.add_(negative, alpha=8)
        _pack_nibbles(exp.to(torch.int8), out)

    def dequantize(self, codes: Tensor, steps: Tensor, out: Tensor) -> Tensor:
        return _unpack_with_table(codes, _e3m0_table(out.device), steps, out)


QUANTIZERS: dict[str, BlockQuantizer] = {
    q.name: q for q in (Int8Quantizer(), Fp8Quantizer(), E3M0Quantizer(), Int4Quantizer())
}
