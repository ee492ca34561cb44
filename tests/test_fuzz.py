"""A hostile client fuzzes every RPC of a real TLS daemon for a bounded time with random and mutated protobuf
messages and chunk streams: the daemon stays up, its memory stays bounded, and the honest peers' rounds complete."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS
from peerd.config import RunConfig
from peerd.envelope import sign
from peerd.identity import Identity
from peerd.streams import HEADER_METHOD
from peerd.v1 import peerd_pb2 as pb
from tests.swarm import Swarm, tiny_config

pytestmark = pytest.mark.slow

FUZZ_SECONDS = float(os.environ.get("PEERD_FUZZ_SECONDS", "12"))
UNARY = {
    "/peerd.v1.Membership/Join": (pb.JoinRequest, "Join"),
    "/peerd.v1.Membership/Gossip": (pb.GossipRequest, "Gossip"),
    "/peerd.v1.Membership/Leave": (pb.LeaveRequest, "Leave"),
    "/peerd.v1.Membership/Status": (pb.StatusRequest, "Status"),
    "/peerd.v1.Rounds/Rendezvous": (pb.RendezvousRequest, "Rendezvous"),
    "/peerd.v1.Rounds/Match": (pb.MatchRequest, "Match"),
}
STREAMS = ["/peerd.v1.Rounds/Reduce", "/peerd.v1.Rounds/Exchange"]
DOWNLOAD = "/peerd.v1.State/Download"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Fuzzer:
    """Random, structured-random (validly signed, so it reaches deep into handlers) and byte-mutated messages."""

    def __init__(self, run_id: bytes, known_ids: list[str], seed: int) -> None:
        self.rng = random.Random(seed)
        self.run_id = run_id
        self.known_ids = known_ids
        self.identities = [Identity.generate() for _ in range(2)]  # a hostile peer with two keys, not a Sybil army

    # -- values ---------------------------------------------------------------------------------------------------
    def _int(self) -> int:
        r = self.rng
        return r.choice([0, 1, -1, r.randint(-5, 50), r.randint(-(2**31), 2**31 - 1), 2**40, -(2**62)])

    def _bytes(self) -> bytes:
        r = self.rng
        return r.choice([b"", os.urandom(r.choice([1, 16, 32, 64])), os.urandom(r.randint(0, 3000))])

    def _str(self) -> str:
        r = self.rng
        return r.choice(["", "fp32", "int4", "127.0.0.1:1", r.choice(self.known_ids), "x" * r.randint(0, 5000)])

    def fill(self, msg: Message, depth: int = 0) -> Message:
        """Give random values to a random subset of fields (recursing into sub-messages a little)."""
        r = self.rng
        for f in msg.DESCRIPTOR.fields:
            if r.random() < 0.4:
                continue
            n = r.choice([1, 1, 2, 5, 50]) if f.is_repeated else 1
            for _ in range(n):
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    if depth > 2:
                        break
                    sub = getattr(msg, f.name).add() if n > 1 or f.is_repeated else None
                    self.fill(sub if sub is not None else getattr(msg, f.name), depth + 1)
                    continue
                value = self._value(f)
                if f.is_repeated:
                    getattr(msg, f.name).append(value)
                else:
                    with contextlib.suppress(ValueError, TypeError):
                        setattr(msg, f.name, value)
        return msg

    def _value(self, f: FieldDescriptor) -> object:
        if f.type in (FieldDescriptor.TYPE_BYTES,):
            return self._bytes()
        if f.type == FieldDescriptor.TYPE_STRING:
            return self._str()
        if f.type == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return self.rng.choice([0.0, -1.0, 1e300, float("nan")])
        value = self._int()
        if f.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64):
            value = abs(value)
        if f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32):
            value = max(min(value, 2**31 - 1), -(2**31)) if f.type == FieldDescriptor.TYPE_INT32 else value % 2**32
        return value

    def signed(self, msg: Message, method: str) -> Message:
        ident = self.rng.choice(self.identities)
        if "self" in [f.name for f in msg.DESCRIPTOR.fields] and self.rng.random() < 0.7:
            msg.self.peer_id = ident.peer_id  # type: ignore[attr-defined]
            msg.self.public_key = ident.public_key  # type: ignore[attr-defined]
        if isinstance(msg, pb.JoinRequest):
            msg.self.address = "127.0.0.1:1"  # a dead address: never a live member the honest peers would wait for
        return sign(msg, method, ident, self.run_id)

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.randint(1, 4)):
            op = r.randrange(4)
            if op == 0 and buf:
                buf[r.randrange(len(buf))] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                del buf[r.randrange(len(buf)) :]
            elif op == 2:
                buf[r.randrange(len(buf) + 1) : 0] = os.urandom(r.randint(1, 20))
            elif buf:
                i = r.randrange(len(buf))
                buf[i:i] = buf[i : i + r.randint(1, 40)]
        return bytes(buf)

    def payload(self, cls: type[Message], method: str) -> bytes:
        """One request body: raw random bytes, a structured message (maybe signed), or a mutation of one."""
        r = self.rng.random()
        if r < 0.15:
            return os.urandom(self.rng.randint(0, 2000))
        msg = self.fill(cls())
        if self.rng.random() < 0.7 and "auth" in [f.name for f in cls.DESCRIPTOR.fields]:
            msg = self.signed(msg, method)
        data = msg.SerializeToString()
        return self.mutate(data) if r > 0.6 else data

    def stream(self) -> Iterator[bytes]:
        """A chunk stream: a header (often validly signed), chunks of random sizes, maybe a trailer."""
        header = self.fill(pb.TensorHeader())
        if self.rng.random() < 0.7:
            header = self.signed(header, HEADER_METHOD)
        first = pb.TensorMessage(header=header).SerializeToString()
        yield self.mutate(first) if self.rng.random() < 0.3 else first
        for _ in range(self.rng.randint(0, 6)):
            size = self.rng.choice([0, 1, 1000, 65536, (1 << 20) + 1])
            yield pb.TensorMessage(chunk=bytes(size) if size > 65536 else os.urandom(size)).SerializeToString()
        if self.rng.random() < 0.5:
            trailer = self.fill(pb.TensorTrailer())
            yield pb.TensorMessage(trailer=trailer).SerializeToString()


def _dial(address: str) -> grpc.Channel:
    cert = tls.fetch_cert_sync(address)
    opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
    return grpc.secure_channel(address, tls.channel_credentials(cert), options=opts)


def fuzz(addresses: list[str], fuzzer: Fuzzer, seconds: float, threads: int = 3) -> Counter:
    """Hammer every RPC of every address for `seconds`; returns status codes seen per outcome."""
    seen: Counter = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def one(ch: grpc.Channel, rng: random.Random) -> str:
        kind = rng.random()
        try:
            if kind < 0.55:
                method, (cls, name) = rng.choice(list(UNARY.items()))
                ch.unary_unary(method)(fuzzer.payload(cls, name), timeout=2)
            elif kind < 0.9:
                call = ch.stream_stream(rng.choice(STREAMS))
                for _ in call(fuzzer.stream(), timeout=3):
                    pass
            else:
                for _ in ch.unary_stream(DOWNLOAD)(fuzzer.payload(pb.StateRequest, "Download"), timeout=3):
                    pass
        except grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    def loop(index: int) -> None:
        rng = random.Random(index)
        chans = [_dial(a) for a in addresses]
        try:
            while time.monotonic() < deadline:
                code = one(rng.choice(chans), rng)
                with lock:
                    seen[code] += 1
        finally:
            for ch in chans:
                ch.close()

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(seconds + 30)
    return seen


def _serving(address: str) -> bool:
    with _dial(address) as ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_fuzzing_every_rpc_leaves_the_daemons_up_bounded_and_training(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, run__outer_steps=0, security__read_timeout=3.0)
    swarm = Swarm(tmp_path, 2, config, secure=True)
    with swarm:
        peers = swarm.peers
        swarm.wait_until(lambda: min(p.status().outer_step for p in peers) >= 1, 120, "a first round")
        rss0 = [rss_bytes(p.proc.pid) for p in peers]
        ids = [p.status().peer_id for p in peers]
        fuzzer = Fuzzer(RunConfig.load(config).run_id(), ids, seed=1234)
        start = min(p.status().outer_step for p in peers)
        seen: Counter = Counter()
        hostile = threading.Thread(target=lambda: seen.update(fuzz([p.address for p in peers], fuzzer, FUZZ_SECONDS)))
        hostile.start()
        peak = list(rss0)
        while hostile.is_alive():  # sample memory while under attack, not just after it
            peak = [max(m, rss_bytes(p.proc.pid)) for m, p in zip(peak, peers, strict=True)]
            hostile.join(0.5)
        for p in peers:
            assert p.proc.poll() is None, p.log_tail()
            assert _serving(p.address)
        grown = [m - r for m, r in zip(peak, rss0, strict=True)]
        assert max(grown) < 200 << 20, (grown, seen)
        assert sum(seen.values()) > 100 and len(seen) >= 3, seen  # it did reach the handlers, in several ways
        # Rounds went on during the fuzzing and still do after it.
        swarm.wait_until(lambda: min(p.status().outer_step for p in peers) >= start + 3, 120, "three more rounds")
        assert all(p.status().rejected_messages > 0 for p in peers)
        for p in peers:
            assert "Traceback" not in p.log(), p.log_tail(60)
