"""Atomic, self-checking checkpoints.

A crash must lose at most the steps since the last checkpoint, so a checkpoint is written to a temp file in the
same directory, flushed, fsynced, renamed over the target, and the directory is fsynced: the target is always
either the old file or the complete new one.

The file is a ``torch.save`` archive followed by a 48-byte footer: ``PEERDCK1``, the archive length (u64 LE) and
its SHA-256. torch's zip reader does not verify data CRCs, so without the digest a flipped bit in a tensor would
load silently. Loading checks the digest first, then uses ``torch.load(weights_only=True)``: nothing is
unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

MAGIC = b"PEERDCK1"
_FOOTER = struct.Struct("<8sQ32s")
_CHUNK = 1 << 20
_MAX_DEPTH = 64


class CheckpointError(ValueError):
    """A checkpoint is corrupt, truncated, or its state holds unsupported values."""


class CheckpointWriteError(OSError):
    """The checkpoint could not be written (disk full, read-only, I/O error); the previous one is untouched."""


def _prepare(value: Any, where: str, depth: int = 0) -> Any:
    """Copy the container structure, checking types; tensors that view a larger storage are cloned (else
    torch.save would write the whole storage)."""
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"state nested deeper than {_MAX_DEPTH} levels at {where}")
    if isinstance(value, Tensor):
        t = value.detach()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
            t = t.clone()
        return t
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_prepare(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not (k is None or isinstance(k, (str, int))):
                raise CheckpointError(f"dict key {k!r} at {where} is not a str, int or None")
            out[k] = _prepare(v, f"{where}[{k!r}]", depth + 1)
        return out
    raise CheckpointError(f"unsupported value of type {type(value).__name__} at {where}")


class _HashingWriter(io.RawIOBase):
    """Write-through file wrapper that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch's writer replaces it with a RuntimeError that hides the cause

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += len(view)
        try:
            return self._f.write(view)
        except OSError as exc:
            self.error = exc
            raise


class _BoundedReader(io.RawIOBase):
    """Read-only view of the first ``size`` bytes of a file, so torch.load never sees the footer."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        super().__init__()
        self._f = f
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: Path, state: dict) -> None:
    """Atomically write ``state`` (tensors, ints, floats, bools, strings, None, lists, tuples, dicts) to ``path``."""
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    prepared = _prepare(state, "state")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    writer: _HashingWriter | None = None
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(prepared, writer)
            f.write(_FOOTER.pack(MAGIC, writer.size, writer.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = writer.error if writer is not None and writer.error is not None else exc
        if isinstance(cause, OSError):
            raise CheckpointWriteError(cause.errno, f"cannot write {path}: {cause.strerror or cause}") from None
        raise
    _fsync_dir(path.parent)


def _check_file(f: BinaryIO, path: Path) -> int:
    """Check the footer and the digest of an open checkpoint; returns the archive's length."""
    size = os.fstat(f.fileno()).st_size
    if size < _FOOTER.size:
        raise CheckpointError(f"{path}: {size} bytes is too short to be a checkpoint")
    f.seek(size - _FOOTER.size)
    magic, body_size, digest = _FOOTER.unpack(f.read(_FOOTER.size))
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a peerd checkpoint (bad footer), or truncated")
    if body_size != size - _FOOTER.size:
        raise CheckpointError(f"{path}: footer says {body_size} bytes of data, file has {size - _FOOTER.size}")
    f.seek(0)
    sha = hashlib.sha256()
    remaining = body_size
    while remaining:
        chunk = f.read(min(_CHUNK, remaining))
        if not chunk:
            raise CheckpointError(f"{path}: file shrank while reading")
        sha.update(chunk)
        remaining -= len(chunk)
    if sha.digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch, the checkpoint is corrupt")
    return body_size


def verify_checkpoint(path: Path) -> bool:
    """False if ``path`` does not exist; CheckpointError if it is damaged (checked without unpickling anything),
    so a daemon can refuse a bad checkpoint before it joins a swarm."""
    path = Path(path)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return False
    with f:
        _check_file(f, path)
    return True


def load_checkpoint(path: Path) -> dict | None:
    """Load a checkpoint to CPU; None if ``path`` does not exist, CheckpointError if it is damaged."""
    path = Path(path)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return None
    with f:
        body_size = _check_file(f, path)
        try:
            state = torch.load(_BoundedReader(f, body_size), weights_only=True, map_location="cpu")
        except Exception as exc:  # a digest-valid file that torch rejects: unsupported content or torch version
            raise CheckpointError(f"{path}: cannot load checkpoint: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: checkpoint holds a {type(state).__name__}, not a dict")
    return state
