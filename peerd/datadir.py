"""The data dir: checked writable up front, and locked so that one daemon at a time uses it.

Two daemons on one data dir would run with the same peer id and overwrite each other's checkpoint. The lock is an
fcntl.flock on `peerd.lock` holding the owner's PID: the kernel drops it when the process dies, kill -9 included,
so there is never a stale lock to clean up by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from peerd.errors import UserError, os_reason

LOCK_FILE = "peerd.lock"


class DataDirLock:
    """An exclusive lock on a data dir, held as long as this object (or the process) lives."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def check_writable(data_dir: Path) -> None:
    """Create `data_dir` if needed and prove a file can be written in it (root ignores permission bits, so only
    a real write tells, e.g. on a read-only mount)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".peerd-write-test.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"data dir {data_dir} is not writable ({os_reason(exc)}); fix its permissions or mount, "
            "or choose another --data-dir"
        ) from exc


def lock(data_dir: Path) -> DataDirLock:
    """Take the data dir's lock or raise UserError naming the PID that holds it."""
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"cannot create {path} ({os_reason(exc)}); choose another --data-dir") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UserError(
            f"data dir {data_dir} is in use by another peerd (PID {holder}); stop that one, "
            "or give this one its own --data-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DataDirLock(path, fd)


def prepare(data_dir: Path) -> DataDirLock:
    """Everything `peerd start` needs from the data dir before it opens a port: writable, and ours alone."""
    check_writable(data_dir)
    return lock(data_dir)


def write_atomic(path: Path, text: str) -> None:
    """Write a small file (our address, our metrics address) so readers never see it half-written."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
