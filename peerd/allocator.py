"""glibc malloc tuning for a process that moves tens of MB through fresh buffers every round.

On the small machines volunteers run, first touching fresh memory costs about 0.7 ms per MB (page faults and
zeroing: a 40 MB tensor takes ~30 ms before a byte of it is used). By default glibc hands freed memory straight back:
blocks above the mmap threshold are unmapped on free, a heap top above the trim threshold is trimmed, and each thread
allocates from its own arena. A round's gRPC chunks, frames and shards were therefore faulted in again every round,
and that was much of a round's cost on two cores (a 20 MB gRPC stream of 1 MiB messages: 70 ms by default, 23 ms
tuned). Tuned, freed memory stays in the process for the next round: resident memory stays at its high-water mark,
as with PyTorch's caching allocators, instead of dropping between rounds.

Call `tune_allocator()` first thing in a process, before threads start (arenas are made per thread). It is a no-op
off glibc, and `PEERD_MALLOC_TUNE=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: blocks up to 32 MB come from the heap and are reused
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GB of freed heap for reuse
ARENA_MAX = 1  # one arena: a buffer freed by one thread is reused by the next, whichever thread asks


def tune_allocator() -> bool:
    """Apply the settings above; True when glibc accepted all of them."""
    if os.environ.get("PEERD_MALLOC_TUNE", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX))
    return all(mallopt(param, value) == 1 for param, value in settings)
