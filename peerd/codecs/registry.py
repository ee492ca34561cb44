"""Codec names and ids, and the one factory the rest of peerd uses."""

from __future__ import annotations

from peerd.codecs.base import Codec
from peerd.codecs.blockwise import BlockwiseCodec
from peerd.codecs.cast import Bf16Codec, Fp32Codec
from peerd.codecs.compression import DEFAULT_LEVEL
from peerd.codecs.quant import QUANTIZERS
from peerd.codecs.sparse import DEFAULT_BITS, DEFAULT_DENSITY, SparseCodec

CODEC_NAMES: tuple[str, ...] = ("fp32", "bf16", "int8", "fp8", "e3m0", "int4")
"""The dense codecs: every value is sent, each within the error bound its quantizer documents."""
SPARSE_CODEC_NAMES: tuple[str, ...] = (SparseCodec.name,)
"""Codecs that drop most values (they need error feedback); their error is bounded only by what they keep."""
ALL_CODEC_NAMES: tuple[str, ...] = CODEC_NAMES + SPARSE_CODEC_NAMES

CODEC_IDS: dict[str, int] = {
    Fp32Codec.name: Fp32Codec.codec_id,
    Bf16Codec.name: Bf16Codec.codec_id,
    **{name: q.codec_id for name, q in QUANTIZERS.items()},
    SparseCodec.name: SparseCodec.codec_id,
}
assert set(CODEC_IDS) == set(ALL_CODEC_NAMES) and len(set(CODEC_IDS.values())) == len(CODEC_IDS)


def make_codec(
    name: str,
    *,
    zstd_level: int = DEFAULT_LEVEL,
    block_size: int = 256,
    zstd: bool | None = None,
    density: float = DEFAULT_DENSITY,
    bits: int = DEFAULT_BITS,
) -> Codec:
    """Build a codec by name. ``zstd=None`` means on (each frame still drops zstd when it does not pay).

    ``block_size`` only matters for the blockwise codecs (int8, fp8, e3m0, int4), which need it even, and for
    ``sparse`` (at most 65536). ``density`` and ``bits`` only matter for ``sparse`` and are ignored otherwise
    (the run config refuses them with other codecs). Raises ValueError for unknown names and bad parameters.
    """
    if zstd is not None and not isinstance(zstd, bool):
        raise ValueError(f"zstd must be True, False or None, got {zstd!r}")
    use_zstd = True if zstd is None else zstd
    if name == Fp32Codec.name:
        return Fp32Codec(zstd_level=zstd_level, zstd=use_zstd)
    if name == Bf16Codec.name:
        return Bf16Codec(zstd_level=zstd_level, zstd=use_zstd)
    if name in QUANTIZERS:
        return BlockwiseCodec(QUANTIZERS[name], block_size=block_size, zstd_level=zstd_level, zstd=use_zstd)
    if name == SparseCodec.name:
        return SparseCodec(density=density, bits=bits, block_size=block_size, zstd_level=zstd_level, zstd=use_zstd)
    raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(ALL_CODEC_NAMES)}")
