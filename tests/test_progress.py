"""Progress display: redrawn status line on a real pseudo-terminal, plain rate-limited lines on a pipe."""

from __future__ import annotations

import io
import os
import pty
import re
import select
from collections.abc import Iterator

import pytest

from peerd.progress import Progress, format_bytes, format_duration

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class Clock:
    """A controllable monotonic clock, so rate limits are tested without sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def read_available(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the slave side closed (Linux reports EIO)
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode()


@pytest.fixture
def terminal() -> Iterator[tuple[int, io.TextIOWrapper]]:
    """A real pseudo-terminal: the slave end is the stream under test, the master end is what a user would see."""
    master, slave = pty.openpty()
    stream = open(slave, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    try:
        yield master, stream
    finally:
        stream.close()
        os.close(master)


@pytest.fixture
def pipe() -> Iterator[tuple[int, io.TextIOWrapper]]:
    r, w = os.pipe()
    stream = open(w, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    try:
        yield r, stream
    finally:
        if not stream.closed:
            stream.close()
        os.close(r)


def test_tty_is_detected_on_a_pty_and_not_on_a_pipe(terminal, pipe, monkeypatch) -> None:
    monkeypatch.setenv("TERM", "xterm")
    assert Progress(terminal[1]).tty is True
    assert Progress(pipe[1]).tty is False
    monkeypatch.setenv("TERM", "dumb")  # e.g. an editor's embedded shell: no ANSI
    assert Progress(terminal[1]).tty is False


def test_tty_redraws_one_line_in_place(terminal) -> None:
    master, stream = terminal
    clock = Clock()
    p = Progress(stream, total_steps=100, tty=True, clock=clock)
    p.update(step=10, loss=3.14159, peers=3, sent=1536 * 1024)
    clock.t += 0.05
    p.update(step=11)  # too soon: coalesced, not drawn
    clock.t += 0.3
    p.update(step=20, loss=2.5)
    out = read_available(master)
    assert "\n" not in out  # still one line
    frames = out.split("\r\x1b[2K")[1:]
    assert len(frames) == 2, out
    assert frames[0] == "step 10/100 | loss 3.142 | peers 3 | sent 1.5 MiB"
    # 10 steps in 0.35 s -> 80 steps to go take 2.8 s.
    assert frames[1] == "step 20/100 | loss 2.5 | peers 3 | sent 1.5 MiB | eta 3s"
    p.close()
    final = read_available(master)
    # close shows the final status once more and ends the live line (the pty maps \n to \r\n).
    assert final == "\r\x1b[2K" + frames[1] + "\r\n"


def test_tty_log_goes_above_the_live_line(terminal) -> None:
    master, stream = terminal
    p = Progress(stream, tty=True, clock=Clock())
    p.update(step=1, peers=2)
    p.log("peer 9f2c joined")
    out = read_available(master)
    # Clear the status, print the permanent line, then redraw the status below it.
    assert out == "\r\x1b[2Kstep 1 | peers 2\r\x1b[2Kpeer 9f2c joined\r\n\r\x1b[2Kstep 1 | peers 2"
    p.close()


def test_tty_truncates_to_terminal_width(terminal) -> None:
    import fcntl
    import struct
    import termios

    master, stream = terminal
    fcntl.ioctl(stream.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    p = Progress(stream, tty=True, clock=Clock())
    p.update(step=1, note="x" * 200)
    frame = read_available(master).split("\r\x1b[2K")[-1]
    assert len(frame) < 40  # a wrapped line could not be redrawn with \r
    assert frame.startswith("step 1 | note xxx") and frame.endswith("…")
    p.close()


def test_pipe_gets_plain_rate_limited_lines(pipe) -> None:
    r, stream = pipe
    clock = Clock()
    p = Progress(stream, total_steps=50, tty=False, log_interval=10.0, clock=clock)
    p.update(step=1, loss=4.0)
    for step in range(2, 10):  # within the interval: not logged
        clock.t += 1
        p.update(step=step)
    clock.t += 2  # 10 s after the first line
    p.update(step=10)
    p.log("checkpoint saved")
    clock.t += 1
    p.update(step=11, loss=3.5)
    p.close()  # flushes the pending status
    stream.close()
    out = read_available(r)
    assert not ANSI.search(out) and "\r" not in out
    lines = out.splitlines()
    assert lines[0] == "step 1/50 | loss 4"
    assert lines[1] == "step 10/50 | loss 4 | eta 44s"  # 9 steps in 10 s; 40 to go
    assert lines[2] == "checkpoint saved"
    assert lines[3] == "step 11/50 | loss 3.5 | eta 43s"  # 10 steps in 11 s; 39 to go -> 42.9 s
    assert len(lines) == 4


def test_close_is_idempotent_and_update_after_close_is_ignored(pipe) -> None:
    r, stream = pipe
    p = Progress(stream, tty=False, clock=Clock())
    with p:
        p.update(peers=3)
    p.close()
    p.update(peers=4)
    stream.close()
    assert read_available(r) == "peers 3\n"


def test_extra_fields_and_explicit_eta() -> None:
    buf = io.StringIO()
    p = Progress(buf, tty=False, clock=Clock())
    p.update(outer=4, tokens_per_second=12345.6, eta=3725.0, zeta="z", alpha=1)
    assert buf.getvalue() == "outer 4 | 1.235e+04 tok/s | eta 1h02m | alpha 1 | zeta z\n"


def test_rejects_negative_total() -> None:
    with pytest.raises(ValueError):
        Progress(io.StringIO(), total_steps=-1)


def test_formatters() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.0 KiB"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"
    assert format_bytes(float("nan")) == "?"
    assert format_duration(45) == "45s"
    assert format_duration(725) == "12m05s"
    assert format_duration(3 * 3600 + 7 * 60) == "3h07m"
    assert format_duration(-1) == "?"
