"""One line per mistake: the errors a user can fix, and how `peerd` reports them.

Volunteers run peerd by hand and make ordinary mistakes (a wrong address, a busy port, a full disk). Each is
reported as one line that names the problem and the remedy, with a non-zero exit; the traceback is shown only with
`--debug`, since for these errors it says nothing the line does not.
"""

from __future__ import annotations

import os
import sys
import traceback


class UserError(Exception):
    """A mistake in how peerd was started; the message says what is wrong and what to do. `code` is the exit code
    (2: bad input that no retry fixes, 1: the environment, e.g. no peer answered)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Interrupted(BaseException):
    """SIGINT/SIGTERM while peerd was blocked (joining, in a round, downloading state): stop now, not after it.
    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


def os_reason(exc: OSError) -> str:
    """'No space left on device' rather than '[Errno 28] No space left on device: /x/.checkpoint.pt.tmp'."""
    if exc.errno:
        return os.strerror(exc.errno)
    return exc.strerror or str(exc)


def report(exc: BaseException, debug: bool, prefix: str = "peerd") -> None:
    """Print `exc` as one line on stderr (and its traceback first with --debug)."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prefix}: {text}", file=sys.stderr, flush=True)


def unexpected(exc: BaseException, debug: bool) -> None:
    """A bug or an error peerd does not know: still one line, and how to get the details."""
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return
    text = " ".join(str(exc).split())
    print(
        f"peerd: unexpected error: {type(exc).__name__}: {text} (run again with --debug for the traceback)",
        file=sys.stderr,
        flush=True,
    )
