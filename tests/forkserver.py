"""Start test daemons from a fork server that imported peerd and torch once, instead of a fresh interpreter each.

Every `peerd start` process pays about 3 s of CPU to import torch, grpc and peerd before it does anything; swarm
tests start hundreds of them on CI's two cores. A forked daemon is still a separate process running the real `peerd
start` code path (`peerd.cli.main`) and talking real gRPC; only the imports are shared. The server is
`multiprocessing`'s forkserver: a clean process with no threads and no gRPC objects, so forking it is safe.

Fault injectors are read from the environment at import (peerd/faults.py), so a daemon started with environment
overrides or any `PEERD_FAULT*` variable runs as a fresh interpreter (`subprocess.Popen`), never forked.
`PEERD_TEST_FORKSERVER=0` turns the fork server off: every daemon then starts as a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.context import BaseContext
from pathlib import Path

PRELOAD = ["peerd.cli", "peerd.daemon", "peerd.worker"]
_ctx: list[BaseContext] = []


def enabled() -> bool:
    """On by default (Linux): the suite took 36 min without it and 25-31 with it in three whole CI runs.
    `PEERD_TEST_FORKSERVER=0` is the way back to fresh interpreters, to rule the server out when a test fails."""
    return os.environ.get("PEERD_TEST_FORKSERVER", "1") != "0" and sys.platform.startswith("linux")


def _context() -> BaseContext:
    if not _ctx:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ctx.append(ctx)
    return _ctx[0]


def _run(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """The child: the log as stdout and stderr, the peer's environment and directory, then `peerd <argv>`."""
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered, like PYTHONUNBUFFERED
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["peerd", *argv]  # as `python -m peerd` sees it: --procs-per-peer re-runs sys.argv[1:] (launch.py)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    from peerd.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    # As the interpreter does at exit: join non-daemon threads and thread pools (an exit that hangs there must hang
    # here too, or the tests would hide it), then flush the log.
    threading._shutdown()  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)


class ForkedProc:
    """The part of `subprocess.Popen` the test harness uses, for a daemon forked from the server."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self._p = process
        self.args = args
        self.pid: int = process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode  # negative: killed by that signal, as Popen says

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        code = self._p.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    cmd: list[str], env: dict[str, str], overrides: dict[str, str] | None, cwd: Path, log_path: Path
) -> subprocess.Popen | ForkedProc:
    """`cmd` is `[python, -m, peerd, ...]`. Forked when the fork server is on, unless `overrides` changes the
    environment or it holds a fault injector's variable (they are read at import)."""
    faults = any(k.startswith("PEERD_FAULT") for k in env)  # also set by monkeypatch.setenv in the test process
    if not enabled() or overrides or faults or cmd[1:3] != ["-m", "peerd"]:
        with open(log_path, "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    # daemon=True: one the test left running is killed at exit instead of joined (a hang)
    proc = _context().Process(target=_run, args=(cmd[3:], env, str(cwd), str(log_path)), daemon=True)
    proc.start()
    return ForkedProc(proc, cmd)
