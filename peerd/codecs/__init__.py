"""Turn 1-D float32 tensors (fragments of pseudo-gradients or parameters) into frames of bytes and back.

Every exchange in peerd goes through this layer::

    codec = make_codec("int4", zstd_level=1, block_size=256)
    frame = codec.encode(x)                     # quantized on x's device, framed, zstd when it pays
    y = codec.decode(frame, x.numel(), "cuda")  # strict: raises CodecError on anything suspicious

Codecs: ``fp32`` (lossless), ``bf16`` (cast), ``int8`` / ``int4`` (blockwise absmax), ``fp8`` (e4m3 with a
per-block scale), ``e3m0`` (sign + 3-bit exponent, as in Streaming DiLoCo), and ``sparse`` (top-k per block in
2-8 bits, for outer pseudo-gradients with error feedback; ``sparse.py``). See ``frame.py`` for the wire format and
``quant.py`` for the quantizers and their error bounds.
"""

from peerd.codecs.base import MAX_NUMEL, Codec
from peerd.codecs.errors import CodecError
from peerd.codecs.feedback import ErrorFeedback
from peerd.codecs.frame import HEADER_SIZE, TRAILER_SIZE, FrameHeader, parse_header
from peerd.codecs.registry import ALL_CODEC_NAMES, CODEC_IDS, CODEC_NAMES, SPARSE_CODEC_NAMES, make_codec

__all__ = [
    "ALL_CODEC_NAMES",
    "CODEC_IDS",
    "CODEC_NAMES",
    "HEADER_SIZE",
    "MAX_NUMEL",
    "SPARSE_CODEC_NAMES",
    "TRAILER_SIZE",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "FrameHeader",
    "make_codec",
    "parse_header",
]
