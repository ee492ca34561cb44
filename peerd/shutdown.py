"""SIGINT/SIGTERM stop `peerd start` within a deadline, whatever it is doing.

A signal while the worker trains asks it to finish the current inner step, checkpoint and leave. But the worker may
be blocked on the network (a round waits up to round_timeout, a state download likewise, the join up to
join_timeout), so after GRACE_S the signal is re-delivered to the main thread as `Interrupted`, which unwinds out of
the blocking wait; the checkpoint on disk is then the last complete one (writes are atomic), never a half-written
one. Outside training (starting, joining) a signal interrupts at once. A last-resort timer ends the process at
DEADLINE_S after the first signal if shutdown itself hangs.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

from peerd.errors import Interrupted

log = logging.getLogger("peerd")
GRACE_S = 2.0  # how long a training worker gets to reach the end of its inner step
DEADLINE_S = 9.0  # from the first signal to process exit, at the latest
EXIT_RESERVE_S = 1.5  # of the deadline, kept for the interpreter to exit after the daemon stopped
DRAIN_S = 10.0  # at shutdown, how long streams in flight may take to finish (a 17 MB reply at 20 Mbit/s: ~7 s)
# NoLoCo's close lets streams carrying our last contributions finish this long, before the daemon stops and drains.
# Shorter than DRAIN_S: it comes first and no signal cuts it short, so GRACE_S + this + the daemon's drain must fit
# within DEADLINE_S, and the trainer waits at most 10 s for the close (peerd/swarm.py).
PAIR_DRAIN_S = 5.0
EXIT_GUARD_S = 10.0  # after a clean stop, how long leftover non-daemon threads may hold the process before it exits


class Shutdown:
    """Signal handling for one `peerd start`. `phase` is "starting", "training" or "stopping"."""

    def __init__(self) -> None:
        self.stop = threading.Event()  # the worker checks it between inner steps
        self.worker_done = threading.Event()
        self.phase = "starting"
        self.signalled_at: float | None = None

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def training(self) -> None:
        self.phase = "training"

    def stopping(self) -> None:
        self.phase = "stopping"
        self.worker_done.set()

    def drain_s(self, default: float) -> float:
        """Seconds the daemon may spend draining streams at shutdown: all it wants, unless a signal set a deadline."""
        if self.signalled_at is None:
            return default
        left = DEADLINE_S - EXIT_RESERVE_S - (time.monotonic() - self.signalled_at)
        return max(0.5, min(default, left))

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        first = self.signalled_at is None
        if first:
            self.signalled_at = time.monotonic()
            threading.Thread(target=self._deadline, name="peerd-deadline", daemon=True).start()
        if self.phase == "stopping":
            return  # already on the way out; the deadline timer bounds it
        if self.phase == "training" and not self.stop.is_set():
            log.info("received %s: finishing the current step, then leaving the swarm", name)
            self.stop.set()
            threading.Thread(target=self._grace, args=(signum,), name="peerd-grace", daemon=True).start()
            return
        raise Interrupted(name)

    def _grace(self, signum: int) -> None:
        if not self.worker_done.wait(GRACE_S) and self.phase == "training":
            log.info("still busy (a round, a state download or a checkpoint) after %.0fs: interrupting it", GRACE_S)
            # A real signal to the main thread: it wakes a blocking lock wait (Future.result) with EINTR, so the
            # handler runs now; _thread.interrupt_main only sets a flag that a blocked thread never looks at.
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def _deadline(self) -> None:
        assert self.signalled_at is not None
        time.sleep(max(DEADLINE_S - (time.monotonic() - self.signalled_at), 0.0))
        _exit_now(1, "did not stop within %.0fs of the signal: exiting now (the last checkpoint is intact)", DEADLINE_S)


def _exit_now(code: int, message: str, *args: object) -> None:
    """Log why, flush the log, and end the process at once: no thread, pool or atexit hook can hold it any more."""
    log.error(message, *args)
    logging.shutdown()
    os._exit(code)


def guard_exit(seconds: float = EXIT_GUARD_S) -> None:
    """Call once the daemon has stopped cleanly: the process then exits within `seconds` even if a thread it left
    behind (a pool worker blocked in a call) would hold the interpreter's exit. Such a hang kept a sponsored peer
    alive for minutes after "stopped cleanly" in CI; the log names the threads so the cause can be found."""

    def guard() -> None:
        time.sleep(seconds)
        held = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        _exit_now(0, "still running %.0fs after a clean stop, held by threads %s: exiting now", seconds, held)

    threading.Thread(target=guard, name="peerd-exit-guard", daemon=True).start()
