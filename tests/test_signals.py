"""SIGTERM stops `peerd start` within 10 s in every state (joining, training, in a round, in a state download) and
leaves a checkpoint that loads; while it runs, a second daemon on its data dir or its port is refused; it serves
reflection v1 as well as v1alpha. Real processes throughout (issue 12)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2

from peerd.reflection import V1_PACKAGE, v1_file
from tests.swarm import REPO, Peer, Swarm, tiny_config
from trainer.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow
LIMIT_S = 10.0


def sigterm_time(peer: Peer) -> float:
    t0 = time.monotonic()
    peer.proc.send_signal(signal.SIGTERM)
    try:
        peer.proc.wait(30)
    except subprocess.TimeoutExpired:
        peer.kill()
    return time.monotonic() - t0


def assert_stopped_in_time(peer: Peer) -> None:
    seconds = sigterm_time(peer)
    assert seconds < LIMIT_S, f"took {seconds:.1f}s:\n{peer.log_tail()}"
    assert peer.proc.returncode == 0, peer.log_tail()
    assert "Traceback" not in peer.log(), peer.log_tail()
    load_checkpoint(peer.data_dir / "checkpoint.pt")  # absent is fine; damaged raises


def wait_log(peer: Peer, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in peer.log():
        assert peer.proc.poll() is None, peer.log_tail()
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{peer.log_tail()}"
        time.sleep(0.1)


def peerd(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "peerd", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def test_sigterm_while_joining(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    swarm = Swarm(tmp_path, 1)
    peer = swarm.spawn(0, nobody)
    wait_log(peer, "retrying for up to")
    assert_stopped_in_time(peer)


def reflection_services(address: str, version: str) -> list[str]:
    """A real reflection client call with `version`'s own messages on its method path: list the services, then ask
    for the file that defines the v1 reflection service."""
    if version == "v1":
        pool = descriptor_pool.Default()
        v1_file()
        request_cls = message_factory.GetMessageClass(
            pool.FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionRequest")
        )
        response_cls = message_factory.GetMessageClass(
            pool.FindMessageTypeByName(f"{V1_PACKAGE}.ServerReflectionResponse")
        )
    else:
        request_cls, response_cls = reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        requests = [request_cls(list_services=""), request_cls(file_containing_symbol=f"{V1_PACKAGE}.ServerReflection")]
        listed, described = list(call(iter(requests), timeout=10))
    assert described.file_descriptor_response.file_descriptor_proto, described
    return [s.name for s in listed.list_services_response.service]


def test_sigterm_while_training_and_the_data_dir_and_port_are_ours(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, run__outer_steps=0)
    swarm = Swarm(tmp_path, 1, config, wait_peers=False)
    with swarm:
        peer = swarm.peers[0]
        swarm.wait_until(lambda: peer.status().outer_step >= 1, 60, "an outer step")
        same_dir = peerd("start", "--config", str(config), "--data-dir", str(peer.data_dir), "--listen", "127.0.0.1:0")
        assert same_dir.returncode == 2 and f"in use by another peerd (PID {peer.proc.pid})" in same_dir.stderr
        same_port = peerd("start", "--config", str(config), "--data-dir", str(tmp_path / "x"), "--listen", peer.address)
        assert same_port.returncode == 2 and "address already in use" in same_port.stderr
        for version in ("v1", "v1alpha"):
            names = reflection_services(peer.address, version)
            assert "peerd.v1.Membership" in names and "grpc.reflection.v1.ServerReflection" in names, names
        assert_stopped_in_time(peer)
        assert "stopped cleanly" in peer.log()


def test_sigterm_in_a_round(tmp_path: Path) -> None:
    """Peer 1 is frozen (SIGSTOP), so peer 0 waits in a round that cannot finish (round_timeout is 20 s)."""
    with Swarm(tmp_path, 2, tiny_config(tmp_path, run__outer_steps=0)) as swarm:
        a, b = swarm.peers
        swarm.wait_until(lambda: min(p.status().outer_step for p in swarm.peers) >= 1, 90, "a round")
        b.proc.send_signal(signal.SIGSTOP)
        try:
            last, still = -1, 0
            deadline = time.monotonic() + 30
            while still < 8 and time.monotonic() < deadline:  # inner step unchanged for 2 s: blocked in a round
                step = a.status().inner_step
                still, last = (still + 1, last) if step == last else (0, step)
                time.sleep(0.25)
            assert still >= 8, a.log_tail()
            assert_stopped_in_time(a)
            assert "interrupting it" in a.log()
        finally:
            b.proc.send_signal(signal.SIGCONT)
        assert_stopped_in_time(b)


def test_sigterm_in_a_state_download(tmp_path: Path) -> None:
    """Peer 0 stalls every state download it serves; peer 1 joins late and must download: stop it there."""
    swarm = Swarm(tmp_path, 1, tiny_config(tmp_path, run__outer_steps=0), wait_peers=False)
    try:
        a = swarm.spawn(0, None, env={"PEERD_FAULT_STATE_STALL_S": "60"})
        swarm.peers.append(a)
        swarm.wait_until(lambda: a.status().outer_step >= 2, 60, "two outer steps")
        b = swarm.add_peer()
        wait_log(b, "downloading state")
        time.sleep(0.5)
        assert_stopped_in_time(b)
    finally:
        swarm.stop()
