"""Large host buffers that are cheap to touch for the first time.

A decoded fragment is tens of MB of fresh memory. glibc hands such sizes out as new anonymous mappings, and the
first write to each 4 KiB page costs a fault: on the 2-core machines peers run on, faulting in 40 MB takes
~10 ms, more than the dequantization itself. Advising the kernel to back the buffer with 2 MiB transparent huge
pages (``MADV_HUGEPAGE``) cuts that to ~3 ms. The advice is only a hint: where THP is off (``never``), the
platform is not Linux, or the call fails, the buffer is an ordinary one and nothing else changes.
"""

from __future__ import annotations

import ctypes
import sys

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
