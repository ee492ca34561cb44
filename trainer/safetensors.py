"""A small, strict reader (and writer) of the safetensors format, in pure Python + torch.

Initial weights given with ``--init-from`` come from the user, so the file is treated as untrusted: nothing is
unpickled, every size is checked against the file before anything is allocated, offsets must tile the data area
exactly, and float tensors must be finite. Format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the raw little-endian
buffers (offsets relative to the end of the header).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import torch
from torch import Tensor

from trainer.flat import all_finite

MAX_HEADER = 100 * 1024 * 1024  # the format's own limit
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """The file is not valid safetensors, lies about its sizes, or holds non-finite values."""


def _entries(header: dict, data_len: int, path: Path) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """Validate the parsed header against the data area's length; entries sorted by offset."""
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict) or set(meta) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"{path}: entry {name!r} must have exactly dtype, shape and data_offsets")
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise SafetensorsError(f"{path}: {name!r} has unsupported dtype {meta['dtype']!r}")
        shape, offsets = meta["shape"], meta["data_offsets"]
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise SafetensorsError(f"{path}: {name!r} has a bad shape {shape!r}")
        ok = isinstance(offsets, list) and len(offsets) == 2
        ok = ok and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        if not ok or not 0 <= offsets[0] <= offsets[1] <= data_len:
            raise SafetensorsError(f"{path}: {name!r} has data_offsets {offsets!r} outside the {data_len}-byte data")
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsError(
                f"{path}: {name!r} claims {offsets[1] - offsets[0]} bytes, its shape {shape} needs {nbytes}"
            )
        out.append((name, dtype, tuple(shape), offsets[0], offsets[1]))
    out.sort(key=lambda e: (e[3], e[4]))
    pos = 0
    for name, _, _, begin, end in out:  # buffers must tile the data area: no overlap, no hidden gap
        if begin != pos:
            raise SafetensorsError(f"{path}: {name!r} starts at byte {begin}, expected {pos} (overlap or gap)")
        pos = end
    if pos != data_len:
        raise SafetensorsError(f"{path}: tensors cover {pos} of the {data_len} data bytes")
    return out


def read_header(path: str | os.PathLike[str]) -> tuple[dict, int]:
    """The parsed JSON header and the byte offset where the data area starts (sizes checked, nothing allocated)."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file ({size} bytes) or the 100 MB limit")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def load_safetensors(path: str | os.PathLike[str], *, finite: bool = True) -> dict[str, Tensor]:
    """Read every tensor of ``path`` onto the CPU; SafetensorsError on any inconsistency or non-finite value."""
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machines to test on
        raise SafetensorsError("safetensors buffers are little-endian; this machine is big-endian")
    path = Path(path)
    header, start = read_header(path)
    entries = _entries(header, path.stat().st_size - start, path)
    out: dict[str, Tensor] = {}
    with path.open("rb") as f:
        for name, dtype, shape, begin, end in entries:
            f.seek(start + begin)
            buf = bytearray(end - begin)
            if f.readinto(buf) != len(buf):
                raise SafetensorsError(f"{path}: file shrank while reading {name!r}")
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            t = t.reshape(shape)
            if finite and t.is_floating_point() and not all_finite(t.float()):
                raise SafetensorsError(f"{path}: {name!r} holds NaN or Inf")
            out[name] = t
    return out


def save_safetensors(path: str | os.PathLike[str], tensors: dict[str, Tensor], metadata: dict | None = None) -> None:
    """Write ``tensors`` (CPU copies, contiguous) as safetensors: for tests, benchmarks and exporting weights."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    blobs, pos = [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in NAMES:
            raise SafetensorsError(f"{name!r}: dtype {t.dtype} is not supported")
        data = bytearray(t.numel() * t.element_size())
        if data:  # copy the raw bytes through a uint8 view (no numpy in trainer/)
            torch.frombuffer(data, dtype=torch.uint8).copy_(t.reshape(-1).view(torch.uint8))
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
