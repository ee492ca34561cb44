"""Multi-process peers (trainer/ranks.py, peerd/follower.py): one peer as several local processes with gloo, started
by `peerd start --procs-per-peer N` or torchrun-style env vars; the swarm sees one peer."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from tests.swarm import REPO, Swarm, peer_env, tiny_config
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = pytest.mark.slow


def digests(data_dir: Path, n: int) -> list[str]:
    return [(data_dir / f"rank{r}.digest").read_text() for r in range(n)]


def test_a_two_process_peer_trains_with_a_one_process_peer(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=3)
    swarm = Swarm(tmp_path, 2, cfg)
    try:
        swarm.peers.append(swarm.spawn(0, None, wait_peers=2, extra=["--procs-per-peer", "2"]))
        swarm.peers.append(swarm.spawn(1, swarm.boot_address(0), wait_peers=2))
        for p in swarm.peers:
            p.wait_file("address")
        swarm.wait_exit(180)
    finally:
        swarm.stop()
    assert_identical_globals([p.data_dir for p in swarm.peers])
    multi, single = (p.summary() for p in swarm.peers)
    assert multi["procs_per_peer"] == 2 and single["procs_per_peer"] == 1
    assert multi["tokens_per_step"] == 2 * single["tokens_per_step"]  # the peer trains with twice the batch
    assert multi["outer_step"] == 3 and all(len(r["included"]) == 2 for r in multi["rounds"])
    # the outer step is applied identically on every rank: bit-identical weights at the end
    a, b = digests(swarm.peers[0].data_dir, 2)
    assert a == b


def test_torchrun_style_env_starts_the_ranks(tmp_path: Path) -> None:
    """Every rank started by hand with RANK/WORLD_SIZE/MASTER_* (what torchrun sets); rank 1 is a follower."""
    cfg = tiny_config(tmp_path, run__outer_steps=2)
    data = tmp_path / "peer0"
    data.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    cmd = ["-m", "peerd", "start", "--config", str(cfg), "--listen", "127.0.0.1:0", "--data-dir", str(data),
           "--insecure", "--threads", "1", "--shard", "0"]  # fmt: skip
    procs = []
    for rank in (0, 1):
        env = peer_env({**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        log = open(data / f"log{rank}", "wb")  # noqa: SIM115 - the child owns it
        procs.append(subprocess.Popen([os.sys.executable, *cmd], env=env, cwd=REPO, stdout=log, stderr=log))
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [(data / f"log{r}").read_text()[-2000:] for r in (0, 1)]
    a, b = digests(data, 2)
    assert a == b
    assert "stopped after" in (data / "log1").read_text()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_peer_uses_nccl(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, run__outer_steps=2)
    swarm = Swarm(tmp_path, 1, cfg)
    try:
        swarm.peers.append(swarm.spawn(0, None, extra=["--procs-per-peer", "2"]))
        swarm.wait_exit(300)
    finally:
        swarm.stop()
    a, b = digests(swarm.peers[0].data_dir, 2)
    assert a == b
