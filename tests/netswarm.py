"""Swarms of real `peerd start` processes in network namespaces, for tests that need a real network's faults.

`NetSwarm` is tests/swarm.py's `Swarm` (same spawn / start / add_peer / wait_until / wait_exit) with peer i running
inside host i of a `bench.netfaults.FaultNet`: it listens on 0.0.0.0:PORT ([::]:PORT on an IPv6 net), announces
HOST_ADDRESS:PORT (unless asked not to, as a peer that must learn its address from others) and bootstraps from host 0.
The test can then cut links, partition the hosts, make a host undialable (behind NAT) and shape links through
`swarm.net`.

The root namespace cannot reach the hosts' addresses, so a peer's status is read by running `peerd status` inside
a host's namespace: the peer's own, or another host's to see what that host can reach.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf.json_format import ParseDict

from bench.netfaults import FaultNet
from peerd.v1 import peerd_pb2 as pb
from tests.swarm import REPO, Peer, Swarm, peer_env

PORT = 7000


class NetPeer(Peer):
    """A peer in host `index`'s namespace; `dial` is the HOST:PORT other hosts reach it at."""

    def __init__(
        self, index: int, data_dir: Path, proc: subprocess.Popen, net: FaultNet, dial: str, secure: bool
    ) -> None:
        super().__init__(index, data_dir, proc)
        self.net = net
        self.dial = dial
        self.secure = secure

    def status_json(self, timeout: float = 5.0, *, via: int | None = None) -> dict[str, Any]:
        """`peerd status --json` of this peer, run inside host `via`'s namespace (default: the peer's own)."""
        cmd = [sys.executable, "-m", "peerd", "status", self.dial, "--json", "--timeout", str(timeout)]
        if not self.secure:
            cmd.append("--insecure")
        host = self.index if via is None else via
        done = self.net.run(host, cmd, capture_output=True, text=True, timeout=timeout + 20, env=peer_env(), cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"peer {self.index} status from host {host} failed: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def status(self, timeout: float = 5.0, *, via: int | None = None) -> Any:
        """The same as `status_json`, as the StatusResponse `Peer.status` returns, so Swarm-style checks work.

        It passed through JSON: peers' public keys and state digests are missing, and an unknown loss reads 0.
        """
        return ParseDict(self.status_json(timeout, via=via), pb.StatusResponse(), ignore_unknown_fields=True)


class NetSwarm(Swarm):
    def __init__(
        self,
        tmp_path: Path,
        n: int,
        config: Path | None = None,
        *,
        net: FaultNet | None = None,
        rate_mbit: float | list[float] = 1000.0,
        down_rate_mbit: float | list[float] | None = None,
        port: int = PORT,
        announce: bool = True,
        wait_peers: bool = True,
        extra_args: list[str] | None = None,
        secure: bool = False,
        subnet: str | None = None,
    ) -> None:
        """`n` peers on a FaultNet of `n` hosts with the given rates (and `subnet`: an IPv6 one makes an IPv6-only
        net), or on `net` (already entered; the caller closes it, and it may have spare hosts for add_peer).
        `announce=False` leaves --announce out."""
        super().__init__(tmp_path, n, config, wait_peers=wait_peers, extra_args=extra_args, secure=secure)
        self._own_net = net is None
        if net is None:
            kw = {"subnet": subnet} if subnet is not None else {}
            net = FaultNet(n, rate_mbit, down_rate_mbit=down_rate_mbit, **kw)
        self.net = net
        self.port = port
        self.announce = announce
        self.spawned: dict[int, dict[str, Any]] = {}  # index -> spawn arguments, so restart repeats them

    def address(self, index: int) -> str:
        """HOST:PORT where other hosts reach peer `index`."""
        return self.net.hostport(index, self.port)

    def boot_address(self, index: int) -> str:
        return self.address(index)

    def spawn(  # type: ignore[override]
        self,
        index: int,
        bootstrap: str | None,
        *,
        config: Path | None = None,
        wait_peers: int = 0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        announce: bool | None = None,
    ) -> NetPeer:
        """Start peer `index` in host `index`'s namespace; `extra` and `env` are its own CLI args and env vars."""
        self.spawned[index] = {"config": config, "extra": extra, "env": env, "announce": announce}
        data = self.tmp_path / f"peer{index}"
        data.mkdir(parents=True, exist_ok=True)
        own = [*(extra or [])]
        if self.announce if announce is None else announce:
            own += ["--announce", self.address(index)]
        cmd = self.start_command(
            index,
            bootstrap,
            listen=f"[::]:{self.port}" if self.net.ipv6 else f"0.0.0.0:{self.port}",
            config=config,
            wait_peers=wait_peers,
            extra=own,
        )
        with open(data / "log", "ab") as log:
            proc = self.net.popen(index, cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env(env), cwd=REPO)
        return NetPeer(index, data, proc, self.net, self.address(index), self.secure)

    def kill(self, index: int) -> None:
        """kill -9 peer `index`: no leave, no checkpoint."""
        self.peers[index].kill()

    def restart(self, index: int, bootstrap: str | None = None, **changes: Any) -> NetPeer:
        """Start peer `index` again (kill -9 first if it runs) with the same data dir and spawn arguments.

        It bootstraps from `bootstrap`, by default from the lowest-index other peer that is still running.
        `changes` overrides spawn arguments (config, extra, env, announce).
        """
        self.kill(index)
        if bootstrap is None:
            alive = [p for p in self.peers if p.index != index and p.proc.poll() is None]
            bootstrap = self.address(alive[0].index) if alive else None
        peer = self.spawn(index, bootstrap, **{**self.spawned[index], **changes})
        self.peers[index] = peer
        peer.wait_file("address")
        return peer

    def status(self, index: int, *, via: int | None = None, timeout: float = 5.0) -> Any:
        """Peer `index`'s StatusResponse, asked from host `via` (default: its own host)."""
        peer = self.peers[index]
        assert isinstance(peer, NetPeer)
        return peer.status(timeout, via=via)

    def stop(self) -> None:
        """kill -9 every peer (a partitioned peer could take long to leave cleanly), then tear the net down."""
        try:
            for p in self.peers:
                with contextlib.suppress(subprocess.TimeoutExpired):  # closing the net kills what is left
                    p.kill()
        finally:
            if self._own_net:
                self.net.close()

    def __enter__(self) -> NetSwarm:
        if self._own_net:
            self.net.__enter__()
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
