"""A daemon that stopped cleanly exits even when a thread it left behind would hold the interpreter's exit
(peerd/shutdown.py guard_exit): in CI a sponsored peer logged "stopped cleanly" and then stayed alive for minutes,
until the test's own timeout. A real child process, because the hang is in interpreter exit."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.swarm import REPO

CHILD = """
import logging, threading
from peerd.shutdown import guard_exit
logging.basicConfig(level=logging.INFO, format="%(message)s")
threading.Thread(target=threading.Event().wait, name="stuck-pool-worker").start()  # never returns, not a daemon
guard_exit(0.5)
"""


def test_a_thread_left_behind_does_not_hold_a_cleanly_stopped_process() -> None:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert time.monotonic() - t0 < 20
    assert done.returncode == 0, done.stderr
    assert "held by threads ['stuck-pool-worker']: exiting now" in done.stderr, done.stderr
