"""Live progress display for ``peerd demo`` and ``peerd start``.

On a terminal it keeps one status line redrawn in place (carriage return + ANSI clear-line, no dependency);
anywhere else (pipes, files, journald) it writes plain, rate-limited log lines, so logs stay greppable and small.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "format_bytes", "format_duration"]

_CLEAR_LINE = "\r\x1b[2K"
# Fields shown first, in this order; anything else follows as key=value.
_KNOWN = ("step", "outer", "loss", "eval_loss", "peers", "sent", "received", "tokens_per_second", "eta")


def format_bytes(n: float) -> str:
    """Human-readable byte count with binary prefixes (1.5 MiB)."""
    if not math.isfinite(n):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """Compact duration: 45s, 12m05s, 3h07m."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "-"  # not measured yet (a loss before the first step): "nan" reads like a failure
    if isinstance(value, float):
        if key in ("sent", "received"):
            return format_bytes(value)
        if key == "eta":
            return format_duration(value)
        return f"{value:.4g}"
    if isinstance(value, int) and key in ("sent", "received"):
        return format_bytes(value)
    return str(value)


class Progress:
    """A status line that is redrawn in place on a TTY and logged as plain lines otherwise.

    ``update(**fields)`` merges fields (e.g. ``step=12, loss=3.1, peers=3, sent=1.2e6``) into the current state and
    redraws at most every ``redraw_interval`` seconds on a TTY, or logs at most every ``log_interval`` seconds
    elsewhere. The ETA is estimated from the step rate when ``total_steps`` is known, unless ``eta`` is given.
    Thread-safe: the daemon may ``log()`` while the trainer calls ``update()``.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        total_steps: int | None = None,
        tty: bool | None = None,
        *,
        redraw_interval: float = 0.2,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        self.stream = stream if stream is not None else sys.stderr
        self.total_steps = total_steps
        self.tty = _is_tty(self.stream) if tty is None else tty
        self._interval = redraw_interval if self.tty else log_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = {}
        self._last_draw = -math.inf
        self._pending = False  # fields changed since the last draw
        self._shown = False  # a live line is on screen (TTY only)
        self._first_step: tuple[float, float] | None = None  # (time, step) at the first update with a step
        self._closed = False

    def update(self, **fields: Any) -> None:
        """Merge fields into the status and redraw if the last draw is old enough."""
        with self._lock:
            if self._closed:
                return
            self._fields.update(fields)
            now = self._clock()
            if "step" in fields and self._first_step is None:
                self._first_step = (now, float(fields["step"]))
            self._pending = True
            if now - self._last_draw >= self._interval:
                self._draw(now)

    def log(self, line: str) -> None:
        """Print a permanent line; on a TTY it goes above the live status line, which is then redrawn."""
        with self._lock:
            if self.tty and self._shown:
                self.stream.write(_CLEAR_LINE)
                self._shown = False
            self.stream.write(line.rstrip("\n") + "\n")
            if self.tty and self._fields and not self._closed:
                self._draw(self._clock())
            else:
                self.stream.flush()

    def close(self) -> None:
        """Show the final status and end the live line, leaving the cursor on a fresh line. Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._pending or (self.tty and self._shown):
                self._draw(self._clock())
            if self.tty and self._shown:
                self.stream.write("\n")
                self._shown = False
            self._closed = True
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def status_line(self) -> str:
        """The current status as one line of text (what the next draw will show)."""
        with self._lock:
            return self._render(self._clock())

    def _render(self, now: float) -> str:
        fields = dict(self._fields)
        if "eta" not in fields and (eta := self._eta(now)) is not None:
            fields["eta"] = eta
        parts = []
        for key in (*_KNOWN, *sorted(k for k in fields if k not in _KNOWN)):
            if key not in fields or fields[key] is None:
                continue
            value = fields[key]
            if key == "step" and self.total_steps is not None:
                parts.append(f"step {value}/{self.total_steps}")
            elif key == "tokens_per_second":
                parts.append(f"{_format_value(key, float(value))} tok/s")
            else:
                parts.append(f"{key} {_format_value(key, value)}")
        return " | ".join(parts)

    def _eta(self, now: float) -> float | None:
        if self.total_steps is None or self._first_step is None or "step" not in self._fields:
            return None
        t0, s0 = self._first_step
        done = float(self._fields["step"]) - s0
        if done <= 0 or now <= t0:
            return None
        return max(0.0, (self.total_steps - float(self._fields["step"])) * (now - t0) / done)

    def _draw(self, now: float) -> None:
        line = self._render(now)
        if self.tty:
            width = _terminal_width(self.stream)
            if len(line) >= width:  # a wrapped line cannot be redrawn with \r
                line = line[: max(0, width - 2)] + "…"
            self.stream.write(_CLEAR_LINE + line)
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_draw = now
        self._pending = False


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):  # closed or fake streams
        return False


def _terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size().columns
