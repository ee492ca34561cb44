"""Real local swarms for tests: each peer is a `peerd start` process talking gRPC on 127.0.0.1.

Like hivemind's tests, nothing is simulated in-process: a test that needs three peers starts three daemons.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from peerd.demo import to_toml
from peerd.identity import Identity
from tests import forkserver

REPO = Path(__file__).resolve().parent.parent

# Each test process names its runs apart: tests on other xdist workers (or in another pytest session) run the same
# spec, and a port one test's dead peer freed, taken by another test's peer, once merged the two swarms (one test's
# peers then counted the other's as expected members and adopted its states). A run name of its own gives each
# process's swarms their own run id, which every signed request carries and every peer checks.
RUN_NAME = f"test-{secrets.token_hex(4)}"

TINY: dict[str, dict[str, Any]] = {
    "run": {"name": RUN_NAME, "algorithm": "diloco", "outer_steps": 3},
    "model": {"preset": "tiny", "seq_len": 32},
    "data": {"batch_size": 4, "eval_batches": 2},
    "inner": {"steps": 5, "warmup_steps": 5, "lr": 3e-3},
    "network": {
        "gossip_interval": 0.3,
        "peer_timeout": 3.0,
        "rendezvous_timeout": 8.0,
        "round_timeout": 20.0,
        "match_timeout": 3.0,
        "linger": 5.0,
    },
}


def ids_in_order(tmp_path: Path, n: int, descending: bool = False) -> None:
    """Give peer0 .. peer{n-1} identity keys whose ids ascend (or descend), so a test knows which peers are the lowest
    ids (round leaders are the lowest live id; a hostile leader is a limitation of its own, see SECURITY.md)."""
    keys = sorted((Identity.generate() for _ in range(n)), key=lambda ident: ident.peer_id, reverse=descending)
    for i, ident in enumerate(keys):
        (tmp_path / f"peer{i}").mkdir(parents=True, exist_ok=True)
        raw = ident.private_key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        fd = os.open(tmp_path / f"peer{i}" / "identity.key", os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)


def tiny_config(tmp_path: Path, name: str = "run.toml", **overrides: Any) -> Path:
    """Write a tiny, fast run config. Overrides use SECTION__KEY=value, e.g. inner__steps=10."""
    raw = {section: dict(values) for section, values in TINY.items()}
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        raw.setdefault(section, {})[field] = value
    path = tmp_path / name
    path.write_text(to_toml(raw))
    return path


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a peer process runs with: this repo's code first, unbuffered output for its log."""
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", **(extra or {}))


class Peer:
    def __init__(self, index: int, data_dir: Path, proc: subprocess.Popen | forkserver.ForkedProc) -> None:
        self.index = index
        self.data_dir = data_dir
        self.proc = proc

    def wait_file(self, name: str, timeout: float = 60.0) -> str:
        path = self.data_dir / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text().strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer {self.index} exited ({self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"peer {self.index}: {name} did not appear\n{self.log_tail()}")

    @property
    def address(self) -> str:
        return self.wait_file("address")

    @property
    def metrics_address(self) -> str:
        return self.wait_file("metrics_address")

    def status(self, timeout: float = 3.0) -> Any:
        from peerd.status import fetch_status

        return fetch_status(self.address, timeout)

    def summary(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "summary.json").read_text())

    def log(self) -> str:
        path = self.data_dir / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def kill(self) -> None:
        """kill -9: no leave, no checkpoint."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"peer {self.index} still running after {timeout}s:\n{self.log_tail()}") from None


class Swarm:
    def __init__(
        self,
        tmp_path: Path,
        n: int,
        config: Path | None = None,
        metrics: bool = False,
        wait_peers: bool | int = True,
        extra_args: list[str] | None = None,
        secure: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """`secure` runs peers with TLS (no --insecure), as `peerd start` does by default; `env`: extra environment of
        every peer `start()` spawns (fault injectors). `wait_peers`: True waits for the `n` peers, a number for that
        many (peers the test spawns itself after `start()`, such as a faulty one)."""
        self.secure = secure
        self.env = env
        self.tmp_path = tmp_path
        self.n = n
        self.config = config or tiny_config(tmp_path)
        self.metrics = metrics
        self.wait_peers = wait_peers
        self.extra_args = extra_args or []
        self.peers: list[Peer] = []

    def start_command(
        self,
        index: int,
        bootstrap: str | None,
        *,
        listen: str = "127.0.0.1:0",
        config: Path | None = None,
        wait_peers: int = 0,
        extra: list[str] | None = None,
    ) -> list[str]:
        """The `peerd start` argv for peer `index` (its data dir is tmp_path/peer{index}); NetSwarm reuses it."""
        cmd = [
            sys.executable, "-m", "peerd", "start", "--config", str(config or self.config),
            "--listen", listen, "--data-dir", str(self.tmp_path / f"peer{index}"), "--shard", str(index),
            "--threads", "1", *([] if self.secure else ["--insecure"]), *self.extra_args, *(extra or []),
        ]  # fmt: skip
        if wait_peers > 1:
            cmd += ["--wait-peers", str(wait_peers)]
        if self.metrics:
            cmd += ["--metrics", "127.0.0.1:0"]
        if bootstrap:
            cmd += ["--bootstrap", bootstrap]
        return cmd

    def spawn(
        self,
        index: int,
        bootstrap: str | None,
        *,
        config: Path | None = None,
        wait_peers: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> Peer:
        data = self.tmp_path / f"peer{index}"
        data.mkdir(parents=True, exist_ok=True)
        cmd = self.start_command(index, bootstrap, config=config, wait_peers=wait_peers, extra=extra)
        proc = forkserver.start(cmd, peer_env(env), env, REPO, data / "log")
        peer = Peer(index, data, proc)
        return peer

    def boot_address(self, index: int) -> str:
        """The address other peers bootstrap from to reach peer `index`."""
        return self.peers[index].address

    def start(self) -> Swarm:
        wait = self.n if self.wait_peers is True else int(self.wait_peers)
        first = self.spawn(0, None, wait_peers=wait, env=self.env)
        self.peers.append(first)
        boot = self.boot_address(0)
        for i in range(1, self.n):
            self.peers.append(self.spawn(i, boot, wait_peers=wait, env=self.env))
        # every peer imports torch at once: on 2 cores 64 daemons take over a minute to listen (bench.scale)
        for p in self.peers:
            p.wait_file("address", max(60.0, 2.0 * self.n))
        return self

    def add_peer(self, bootstrap_index: int = 0, **kw: Any) -> Peer:
        peer = self.spawn(len(self.peers), self.boot_address(bootstrap_index), **kw)
        self.peers.append(peer)
        return peer

    def wait_until(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if pred():
                    return
            except Exception:  # a peer may be restarting; ask again
                pass
            time.sleep(0.2)
        logs = "\n".join(f"--- peer {p.index}\n{p.log_tail()}" for p in self.peers)
        raise TimeoutError(f"timed out waiting for {what}\n{logs}")

    def wait_exit(self, timeout: float, peers: list[Peer] | None = None) -> None:
        for p in peers or self.peers:
            code = p.wait(timeout)
            assert code == 0, f"peer {p.index} exited with {code}:\n{p.log_tail()}"

    def stop(self) -> None:
        for p in self.peers:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.peers:
            try:
                p.proc.wait(20)
            except subprocess.TimeoutExpired:
                p.proc.kill()

    def __enter__(self) -> Swarm:
        try:
            return self.start()
        except BaseException:  # a peer that never came up must not leave the others running (orphans slow all else)
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
