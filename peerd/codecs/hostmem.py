"""Large host buffers that are cheap to touch for the first time.

A decoded fragment is tens of MB of fresh memory. glibc hands such sizes out as new anonymous mappings, and the
first write to each 4 KiB page costs a fault: on the 2-core machines peers run on, faulting in 40 MB takes
~10 ms, more than the dequantization itself. Advising the kernel to back the buffer with 2 MiB transparent huge
pages (``MADV_HUGEPAGE``) cuts that to ~3 ms. The advice is only a hint: where THP is off (``never``), the
platform is not Linux, or the call fails, the buffer is an ordinary one and nothing else changes.

Huge pages still cost their zeroing on every first touch, and with four daemons on two cores a fresh 40 MB result per
round cost far more than on an idle machine. Round results therefore come from `RESULTS`, a pool that hands a buffer
out again once no tensor uses it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading

import torch
from torch import Tensor

HUGE_FROM_BYTES = 32 << 20
"""glibc's largest mmap threshold: buffers this big always get a mapping of their own, unmapped on free, so the
advice never splits the malloc heap into many VMAs. Smaller ones come from the heap, which peerd/allocator.py keeps
faulted in for reuse in the daemon."""
_PAGE = 4096
_MADV_HUGEPAGE = 14


def _load_madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - every glibc/musl has madvise
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def advise_huge(t: Tensor) -> None:
    """Hint that ``t``'s (CPU, not yet touched) memory should use huge pages; a no-op where that is unsupported."""
    nbytes = t.numel() * t.element_size()
    if _madvise is None or t.device.type != "cpu" or nbytes < HUGE_FROM_BYTES:
        return
    start = (t.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)  # only whole pages inside the buffer
    end = (t.data_ptr() + nbytes) & ~(_PAGE - 1)
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)  # failure (EINVAL where THP is compiled out) is harmless


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.empty`` that, for a large CPU buffer, asks for huge pages before anything touches it."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge(t)
    return t


class Recycler:
    """Large host buffers handed out again once nothing uses them: a round's result vector (tens of MB) was fresh
    memory every round, and faulting it in was the largest single cost of a 4-peer int4 round on two cores (zeroing
    huge pages: 18% of all CPU). Each buffer is an anonymous ``mmap``; the tensors made from it hold a reference to
    it, so its reference count says whether any tensor or view of it is still alive, with no private torch API.

    At most ``keep`` buffers and ``max_bytes`` are kept. A request no free buffer fits makes room by dropping free
    buffers (sizes change: Streaming's fragments); when the kept ones are in use (callers hold results), or the
    request alone is past ``max_bytes``, the buffer is an ordinary fresh one, as before. Between rounds resident
    memory stays at most ``max_bytes`` above what callers hold, as with the tuned allocator (peerd/allocator.py)."""

    def __init__(self, keep: int = 4, max_bytes: int = 512 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._buffers: list[mmap.mmap] = []
        self._lock = threading.Lock()
        held = [object()]  # what _refs says of something only a list holds, in the same check as _take's
        (self._free_refs,) = [_refs(b) for b in held]

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A CPU tensor of ``numel`` values whose contents are undefined (like ``torch.empty``)."""
        nbytes = numel * dtype.itemsize
        if nbytes < HUGE_FROM_BYTES:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            buf = self._take(nbytes)
            if buf is None:
                return empty(numel, dtype, torch.device("cpu"))
            t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype)
        advise_huge(t)  # a no-op in effect once the pages are huge; first use asks before the first touch
        return t

    def _take(self, nbytes: int) -> mmap.mmap | None:
        free = self._free()
        fits = [b for b in free if len(b) >= nbytes]
        if fits:
            return min(fits, key=len)  # the tightest fit leaves the big ones for big requests
        if nbytes > self.max_bytes:
            return None

        def room() -> bool:
            return len(self._buffers) < self.keep and self.kept_bytes() + nbytes <= self.max_bytes

        smallest_first = sorted(free, key=len)  # none fits: a free buffer too small for this is only memory held
        while smallest_first and not room():
            self._buffers.remove(smallest_first.pop(0))
        if not room():
            return None
        buf = mmap.mmap(-1, nbytes)
        self._buffers.append(buf)
        return buf

    def _free(self) -> list[mmap.mmap]:
        """The kept buffers no tensor uses (the comprehension ``_free_refs`` was measured in)."""
        return [b for b in self._buffers if _refs(b) <= self._free_refs]

    def kept_bytes(self) -> int:
        return sum(len(b) for b in self._buffers)

    def in_use(self) -> int:
        """How many kept buffers some tensor still uses (for tests and metrics)."""
        with self._lock:
            return len(self._buffers) - len(self._free())


def _refs(obj: object) -> int:
    """``obj``'s reference count as seen from here. The pool compares it with a count measured the same way, not with
    a constant: interpreters differ in which references on the stack they count (3.14 borrows some)."""
    return sys.getrefcount(obj)


RESULTS = Recycler()
"""The process's pool for round results (peerd/allreduce.py)."""
