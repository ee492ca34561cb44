"""peerd/allocator.py in a fresh process each (malloc settings are per process): after tuning, a freed 20 MB
buffer is reused by the next allocation instead of being faulted in again; PEERD_MALLOC_TUNE=0 keeps the defaults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import json, resource
from peerd.allocator import tune_allocator
tuned = tune_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(3):
    before = faults()
    buf = bytearray(20_000_000)
    buf[::4096] = b"x" * len(buf[::4096])  # touch every page
    counts.append(faults() - before)
    del buf
print(json.dumps({"tuned": tuned, "faults": counts}))
"""

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only"
)


def _probe(tune: str) -> dict:
    env = {**os.environ, "PEERD_MALLOC_TUNE": tune}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuned_process_reuses_freed_buffers() -> None:
    tuned, default = _probe("1"), _probe("0")
    pages = 20_000_000 // 4096
    assert tuned["tuned"] is True and default["tuned"] is False
    # glibc's default unmaps the freed buffer, so the next one is faulted in again (its adaptive threshold only
    # catches up later, and not across threads); tuned, the freed memory is reused at once
    assert default["faults"][1] > pages // 2, default
    assert all(n < pages // 10 for n in tuned["faults"][1:]), tuned
