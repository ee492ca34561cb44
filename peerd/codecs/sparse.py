"""Sparse low-bit codec: the top-k values of every block, each sent in a few bits, for outer pseudo-gradients.

Per block of ``block_size`` values only the ``k = ceil(density * block_size)`` largest magnitudes are kept (as in
SparseLoCo); the rest decode to zero. Dropping 98% of an update is only sound with error feedback, which carries
the dropped mass into the next round (``peerd.codecs.feedback``); the run config refuses this codec without it.

Each kept value is ``sign * level * scale / L`` with ``L = 2^(bits-1)`` magnitude levels ``1..L`` and the block's
absmax, rounded up to bfloat16, as ``scale``: a kept value is by choice not small, so no code is spent on zero, and
the scale's lost mantissa bits cost less than the error the 2-bit levels already make (error feedback carries both).
Positions within a block are sent as gaps: the first kept position, then for each next one how many values were
skipped since the last (1 byte each for blocks up to 256 values, 2 bytes up to 65536). Gaps are small numbers, so
zstd shrinks them (a sixth off a large frame at density 0.04), and no gap code can spell a repeated or unordered
position.

Body layout for ``numel`` values, ``full = numel // block_size`` whole blocks and a shorter tail block of ``tail``
values when ``numel`` is not a multiple (the tail keeps ``min(k, tail)`` values)::

    scales   one little-endian bfloat16 per block (the block absmax, rounded up)
    gaps     n = full * k + min(k, tail) of them, uint8 or uint16 little-endian: per block p_0, then p_i - p_(i-1) - 1
    codes    n codes of ``bits`` bits packed LSB-first, code = (level - 1) | sign << (bits - 1); unused bits zero

The layout is a function of ``numel`` alone, so the frame machinery checks every size before allocating. Decoding
refuses NaN, Inf or negative scales, gaps that run past their block (or past the tail), and non-zero padding bits.
With 256-value blocks and 2 bits, a block costs 2 + k + k/4 bytes before zstd instead of 1024: at density 0.04
(k = 11) 15.75 bytes, 65x fewer than fp32 (about 78x once zstd shrinks the gaps); at 0.02 (k = 6) 9.5 bytes, 108x.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from peerd.codecs.base import Codec
from peerd.codecs.compression import DEFAULT_LEVEL
from peerd.codecs.errors import CodecError
from peerd.codecs.quant import exact_div

DEFAULT_DENSITY = 0.04
DEFAULT_BITS = 2
BITS_CHOICES = (2, 4, 8)
MAX_SPARSE_BLOCK = 1 << 16
CHUNK_ELEMS = 1 << 18  # CPU work runs over row chunks of about this many values, so temporaries stay in cache
GROUP = 4  # values per group in the two-stage top-k (4 measured fastest of 4, 8 and 16 on 256-value blocks)


def check_sparse_params(density: float, bits: int, block_size: int) -> None:
    """Raise ValueError for parameters the sparse codec cannot use."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    if isinstance(bits, bool) or bits not in BITS_CHOICES:
        raise ValueError(f"bits must be one of {BITS_CHOICES}, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= MAX_SPARSE_BLOCK:
        raise ValueError(
            f"block_size must be an int in [2, {MAX_SPARSE_BLOCK}] for the sparse codec, got {block_size!r}"
        )


def kept_per_block(density: float, block_size: int) -> int:
    """k: values kept per whole block (at least 1). Rounded first so that 0.03 * 100 keeps 3, not 4."""
    return max(1, min(block_size, math.ceil(round(density * block_size, 9))))


class SparseCodec(Codec):
    """Top-k per block with ``bits``-bit sign + magnitude values and a float32 absmax scale per block."""

    name, codec_id = "sparse", 7

    def __init__(
        self,
        *,
        density: float = DEFAULT_DENSITY,
        bits: int = DEFAULT_BITS,
        block_size: int = 256,
        zstd_level: int = DEFAULT_LEVEL,
        zstd: bool = True,
    ) -> None:
        super().__init__(zstd_level=zstd_level, zstd=zstd)
        check_sparse_params(density, bits, block_size)
        self.density = float(density)
        self.bits = bits
        self.levels = 1 << (bits - 1)
        self._block = block_size
        self.k = kept_per_block(self.density, block_size)
        self.index_bytes = 1 if block_size <= 256 else 2

    @property
    def block_size(self) -> int:
        return self._block

    def _shape(self, numel: int) -> tuple[int, int, int, int]:
        """(whole blocks, tail length, blocks, kept values n)."""
        full, tail = divmod(numel, self._block)
        return full, tail, full + (tail > 0), full * self.k + min(self.k, tail)

    def body_layout(self, numel: int) -> tuple[int, int]:
        _, _, blocks, n = self._shape(numel)
        return 2 * blocks, n * self.index_bytes + -(-n * self.bits // 8)

    # -- encoding ------------------------------------------------------------------------------------------------
    decodes_while_encoding = True

    def _encode_body(self, x: Tensor) -> Tensor:
        return self._encode(x, None)

    def _encode_body_into(self, x: Tensor, out: Tensor) -> Tensor:
        return self._encode(x, out)

    def _encode(self, x: Tensor, out: Tensor | None) -> Tensor:
        full, tail, blocks, n = self._shape(x.numel())
        block, k = self._block, self.k
        scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
        index = torch.empty(n, dtype=torch.int64, device=x.device)
        values = torch.empty(n, dtype=torch.float32, device=x.device)
        main = x[: full * block].view(full, block)
        rows = max(1, CHUNK_ELEMS // block) if x.device.type == "cpu" else max(1, full)
        for r0 in range(0, full, rows):
            r1 = min(r0 + rows, full)
            self._top_k(main[r0:r1], k, scales[r0:r1], index[r0 * k : r1 * k], values[r0 * k : r1 * k])
        if tail:
            self._top_k(
                x[full * block :].view(1, tail), min(k, tail), scales[full:], index[full * k :], values[full * k :]
            )
        peak = float(scales.max())
        if not math.isfinite(peak):
            raise CodecError("input tensor contains NaN or Inf")
        half = _bf16_up(scales)
        if not bool(torch.isfinite(half).all()):
            raise CodecError(f"input tensor holds {peak:.3g}, past what a bfloat16 block scale can carry")
        scales = half.float()
        per_value = torch.cat([scales[:full].repeat_interleave(k), scales[full:].expand(n - full * k)])
        codes = self._codes(values, per_value)
        if out is not None:  # what the frame decodes to, through the same dequantization decoding runs
            self._place(scales, index, codes, full, out)
        gaps = _gaps(index, full, k)
        index_t = gaps.to(torch.uint8) if self.index_bytes == 1 else gaps.to(torch.int16).view(torch.uint8)
        return torch.cat([half.view(torch.uint8), index_t, _pack(codes, self.bits)]).cpu()

    @staticmethod
    def _top_k(xb: Tensor, k: int, scale_out: Tensor, index_out: Tensor, value_out: Tensor) -> None:
        """Per row: the absmax, and the ``k`` largest magnitudes' positions (ascending) and values.

        Magnitudes compare as their int32 bit patterns, which order non-negative floats as the floats do (NaN above
        Inf: the absmax carries it to the scale check) and which ``topk`` ranks faster. Where a row splits into
        groups of GROUP, the selection runs in two exact stages: the ``k`` largest values lie in the ``k`` groups
        with the largest maxima (a value in any other group has ``k`` group maxima at least as large), so the full
        ranking runs on ``k * GROUP`` candidates instead of the whole row. Top-k was 45% of a CPU sparse round; this
        is about half the CPU time on 256-value blocks (`python -m bench.codec --codecs sparse`)."""
        rows, width = xb.shape
        mag = xb.abs().view(torch.int32)
        if width % GROUP or k * GROUP >= width:
            scale_out.view(torch.int32).copy_(mag.amax(dim=1))
            idx = torch.topk(mag, k, dim=1, sorted=False).indices
        else:
            top = mag.view(rows, width // GROUP, GROUP).amax(dim=2)
            scale_out.view(torch.int32).copy_(top.amax(dim=1))
            groups = torch.topk(top, k, dim=1, sorted=False).indices
            within = torch.arange(GROUP, device=xb.device)
            candidates = (groups.unsqueeze(2) * GROUP + within).view(rows, k * GROUP)
            picked = torch.topk(mag.gather(1, candidates), k, dim=1, sorted=False).indices
            idx = candidates.gather(1, picked)
        idx = idx.sort(dim=1).values
        index_out.copy_(idx.reshape(-1))
        value_out.copy_(xb.gather(1, idx).reshape(-1))

    def _codes(self, values: Tensor, scale: Tensor) -> Tensor:
        """(level - 1) | sign << (bits - 1), level = round(|v| / scale * L) in [1, L]."""
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        level = (values.abs() / safe).mul_(self.levels).round_().clamp_(1, self.levels).to(torch.int32)
        code = (level - 1) | ((values < 0).to(torch.int32) << (self.bits - 1))
        return code.to(torch.uint8)

    # -- decoding ------------------------------------------------------------------------------------------------
    def _decode_body(self, raw: Tensor, numel: int) -> Tensor:
        out = torch.empty(numel, dtype=torch.float32, device=raw.device)  # _decode_body_into zeroes it
        self._decode_body_into(raw, numel, out)
        return out

    def _decode_body_into(self, raw: Tensor, numel: int, out: Tensor) -> None:
        """Check the whole body first, then zero ``out`` and scatter the kept values into it."""
        full, tail, blocks, n = self._shape(numel)
        block, k = self._block, self.k
        scales_len = 2 * blocks
        scales = raw[:scales_len].view(torch.bfloat16).float()
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise CodecError("sparse frame has a NaN, Inf or negative block scale")
        index_raw = raw[scales_len : scales_len + n * self.index_bytes]
        if self.index_bytes == 1:
            gaps = index_raw.to(torch.int64)
        else:
            gaps = index_raw.view(torch.int16).to(torch.int64) & 0xFFFF
        codes = _unpack(raw[scales_len + n * self.index_bytes :], n, self.bits)
        if codes is None:
            raise CodecError("sparse frame has non-zero padding bits after its last code")
        index = _positions(gaps, full, k)
        # Positions only grow within a block, so its last one is its largest: one check per block.
        last = index[k - 1 : full * k : k]
        if bool((last >= block).any()) or (n > full * k and int(index[-1]) >= tail):
            raise CodecError("sparse frame has gaps that run past the end of their block")
        self._place(scales, index, codes, full, out)

    def _place(self, scales: Tensor, index: Tensor, codes: Tensor, full: int, out: Tensor) -> None:
        """Zero ``out`` and put each kept value (its code times its block's step) at its position. Encoding (for
        ``encode_frame_into``) and decoding share it, so an owner's own copy of its average is bit-identical to
        what every member decodes."""
        block, k, n = self._block, self.k, index.numel()
        start = torch.cat(
            [
                torch.arange(full, device=out.device).mul_(block).repeat_interleave(k),
                torch.full((n - full * k,), full * block, dtype=torch.int64, device=out.device),
            ]
        )
        steps = exact_div(scales, float(self.levels))
        per_value = torch.cat([steps[:full].repeat_interleave(k), steps[full:].expand(n - full * k)])
        level = ((codes & (self.levels - 1)) + 1).to(torch.float32)
        value = level.mul_(per_value)
        value = torch.where((codes >> (self.bits - 1)).bool(), -value, value)
        out.zero_()
        out.index_put_((start.add_(index),), value)

    def __repr__(self) -> str:
        zstd = f"zstd={self.zstd_level}" if self.zstd else "zstd=off"
        return f"SparseCodec(density={self.density}, k={self.k}, bits={self.bits}, block_size={self._block}, {zstd})"


def _gaps(index: Tensor, full: int, k: int) -> Tensor:
    """Ascending positions per block (``full`` blocks of ``k``, then the tail's) as gaps: the first position, then
    how many values lie between each position and the one before it."""
    gaps = index.clone()
    main = gaps[: full * k].view(full, k)
    main[:, 1:] -= index[: full * k].view(full, k)[:, :-1] + 1
    if gaps.numel() > full * k:
        tail = gaps[full * k :]
        tail[1:] -= index[full * k : -1] + 1
    return gaps


def _positions(gaps: Tensor, full: int, k: int) -> Tensor:
    """The inverse of ``_gaps``: positions per block are running sums of (gap + 1), minus one."""
    steps = gaps + 1
    index = torch.empty_like(gaps)
    index[: full * k] = steps[: full * k].view(full, k).cumsum(dim=1).view(-1) - 1
    if gaps.numel() > full * k:
        index[full * k :] = steps[full * k :].cumsum(dim=0) - 1
    return index


def _bf16_up(x: Tensor) -> Tensor:
    """Non-negative float32 values rounded up to bfloat16 (so no kept value exceeds its block's scale); Inf past
    bfloat16's largest finite value. Truncating the low 16 bits rounds down, so any that are set carry one up."""
    bits = x.contiguous().view(torch.int32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    return up.to(torch.int16).view(torch.bfloat16)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes of ``bits`` bits (a divisor of 8) LSB-first; the last byte's unused bits stay zero."""
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (groups << shifts).sum(dim=1).to(torch.uint8)


def _unpack(packed: Tensor, n: int, bits: int) -> Tensor | None:
    """The ``n`` codes of ``packed`` as uint8, or None when a padding bit past the last code is set."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if bool(codes[n:].any()):
        return None
    return codes[:n]
