"""Ordinary mistakes, made the way a new user makes them, with real `python -m peerd` processes: each gets one line
naming the problem and the remedy, a non-zero exit, and no traceback (issue 12)."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.swarm import REPO, tiny_config

ROOT = os.geteuid() == 0


def peerd(*args: str, timeout: float = 60, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    """The lines peerd printed as its own (log lines carry a timestamp and a level)."""
    return [ln for ln in out.stderr.splitlines() if ln.startswith("peerd")]


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    """A plain HTTP server: something that answers on a port but is not a peer."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    srv.RequestHandlerClass.log_message = lambda *a: None  # type: ignore[method-assign]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def listening() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@dataclass
class Case:
    name: str
    args: list[str]  # after `peerd start --config C --data-dir D`
    code: int
    says: list[str]  # substrings of the one error line
    setup: str = ""  # "http", "busy", "corrupt", "truncated", "empty", "readonly"
    extra: dict = field(default_factory=dict)


CASES = [
    Case("bootstrap port not a number", ["--bootstrap", "host:abc"], 2, ["port 'abc' is not a number", "HOST:PORT"]),
    Case("bootstrap port out of range", ["--bootstrap", "127.0.0.1:99999"], 2, ["out of range", "1..65535"]),
    Case("bootstrap bad pinned id", ["--bootstrap", "xyz@127.0.0.1:7000"], 2, ["32-hex-digit peer id"]),
    Case("listen not HOST:PORT", ["--listen", "7000"], 2, ["--listen", "HOST:PORT"]),
    Case("metrics port out of range", ["--metrics", "127.0.0.1:70000"], 2, ["--metrics", "out of range"]),
    Case("negative shard", ["--shard", "-1"], 2, ["--shard -1", ">= 0"]),
    Case("listen port in use", ["--listen", "BUSY"], 2, ["address already in use", "pick another port"], "busy"),
    Case("metrics port in use", ["--metrics", "BUSY"], 2, ["--metrics", "address already in use"], "busy"),
    Case(
        "bootstrap: nothing answers",
        ["--bootstrap", "FREE", "--join-timeout", "1.5"],
        1,
        ["no bootstrap peer answered within 2s", "Connection refused", "--join-timeout"],
        "free",
    ),
    Case(
        "bootstrap: an HTTP server (TLS)",
        ["--bootstrap", "HTTP"],
        1,
        ["answered but is not a peerd peer", "does not speak TLS"],
        "http",
    ),
    Case(
        "bootstrap: an HTTP server (--insecure)",
        ["--bootstrap", "HTTP", "--insecure"],
        1,
        ["answered but is not a peerd peer", "not HTTP/2"],
        "http",
    ),
    Case("corrupt checkpoint", [], 2, ["checksum mismatch", "move it away", ".bad"], "corrupt"),
    Case("truncated checkpoint", [], 2, ["not a peerd checkpoint", "move it away"], "truncated"),
    Case("empty checkpoint", [], 2, ["0 bytes is too short", "move it away"], "empty"),
]
if ROOT:
    CASES.append(Case("read-only data dir", [], 2, ["not writable", "Read-only file system", "--data-dir"], "readonly"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mistake_gives_one_line(case: Case, tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    data = tmp_path / "data"
    with contextlib.ExitStack() as stack:
        subst: dict[str, str] = {}
        if case.setup == "busy":
            subst["BUSY"] = stack.enter_context(listening())
        if case.setup == "free":
            subst["FREE"] = free_port()
        if case.setup == "http":
            subst["HTTP"] = stack.enter_context(http_server())
        if case.setup in ("corrupt", "truncated", "empty"):
            _damaged_checkpoint(data / "checkpoint.pt", case.setup)
        if case.setup == "readonly":
            data = stack.enter_context(tmpfs(tmp_path / "ro", "1m", read_only=True))
        args = [subst.get(a, a) for a in case.args]
        if "--listen" not in args:
            args += ["--listen", "127.0.0.1:0"]
        out = peerd("start", "--config", str(config), "--data-dir", str(data), *args)
    assert out.returncode == case.code, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = error_lines(out)
    assert len(lines) == 1, out.stderr
    for text in case.says:
        assert text in lines[0], lines[0]


def _damaged_checkpoint(path: Path, how: str) -> None:
    import torch

    from trainer.checkpoint import save_checkpoint

    save_checkpoint(path, {"x": torch.arange(1000, dtype=torch.float32)})
    raw = bytearray(path.read_bytes())
    if how == "corrupt":
        raw[100] ^= 0xFF
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray()
    path.write_bytes(bytes(raw))


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    _damaged_checkpoint(tmp_path / "data" / "checkpoint.pt", "corrupt")
    out = peerd("start", "--config", str(tiny_config(tmp_path)), "--data-dir", str(tmp_path / "data"), "--debug")
    assert out.returncode == 2 and "Traceback" in out.stderr and "checksum mismatch" in out.stderr


@pytest.mark.skipif(not ROOT, reason="mounts a small tmpfs to fill the disk: needs root")
def test_full_disk_keeps_training_and_warns(tmp_path: Path) -> None:
    """A data dir too small for a checkpoint: a warning line per failed write, training goes on to the end, no
    traceback. --shard 20 with 16 data shards also shows that more peers than shards is legal."""
    config = tiny_config(tmp_path, run__outer_steps=2)
    with tmpfs(tmp_path / "full", "256k") as data:
        out = peerd(
            "start", "--config", str(config), "--data-dir", str(data), "--listen", "127.0.0.1:0", "--insecure",
            "--shard", "20", "--threads", "1", timeout=120,
        )  # fmt: skip
        assert not (data / "checkpoint.pt").exists()
        assert not list(data.glob(".checkpoint.pt.*"))  # no temp file left taking the space
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if "checkpoint at outer step" in ln]
    assert len(warnings) >= 2, out.stderr
    assert "No space left on device" in warnings[0] and "next checkpoint retries" in warnings[0]
    assert "stopped cleanly at outer step 2" in out.stderr


@pytest.mark.skipif(not ROOT, reason="mounts a small tmpfs to fill the disk: needs root")
def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    import torch

    from trainer.checkpoint import CheckpointWriteError, load_checkpoint, save_checkpoint

    with tmpfs(tmp_path / "small", "512k") as d:
        save_checkpoint(d / "checkpoint.pt", {"step": 1, "x": torch.ones(1000)})
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            save_checkpoint(d / "checkpoint.pt", {"step": 2, "x": torch.ones(400_000)})
        state = load_checkpoint(d / "checkpoint.pt")
        assert state is not None and state["step"] == 1
        assert sorted(p.name for p in d.iterdir()) == ["checkpoint.pt"]
