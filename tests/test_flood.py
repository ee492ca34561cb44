"""A flood from one peer does not stop the honest peers' rounds: request floods are rate limited, stalled streams
(slow-loris) are dropped at a read deadline, and concurrent streams per peer are capped."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS
from peerd.config import RunConfig
from peerd.envelope import sign
from peerd.identity import Identity
from peerd.limits import PeerLimits
from peerd.reachability import ProbeLimiter
from peerd.streams import HEADER_METHOD
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from tests.swarm import Swarm, tiny_config


def test_token_bucket_and_stream_budgets() -> None:
    clock = [0.0]
    limits = PeerLimits(
        rate=10, burst=20, max_streams=2, max_inflight_bytes=100, read_timeout=1, clock=lambda: clock[0]
    )
    assert sum(limits.allow("a") for _ in range(50)) == 20  # the burst, then nothing
    assert limits.allow("b")  # other keys have their own budget
    clock[0] += 1.0
    assert sum(limits.allow("a") for _ in range(50)) == 10  # refilled at the rate
    with limits.stream("a"), limits.stream("a"), pytest.raises(ValueError, match="concurrent"), limits.stream("a"):
        pass
    assert limits.streams_open("a") == 0
    full = pytest.raises(ValueError, match="in flight")
    with limits.inflight("a", 60), limits.inflight("a", 0), full, limits.inflight("a", 50):
        pass
    with limits.inflight("a", 100):
        pass  # everything was released


def test_an_ipv6_host_is_budgeted_by_its_64_not_by_each_address() -> None:
    """A host picks any address in its /64: a budget per address would let one abuser take as many as it likes."""
    limits = PeerLimits(rate=1, burst=1, max_streams=2, max_inflight_bytes=100, read_timeout=1)
    a = dict(limits.connection_keys("ipv6:[2001:db8:1:2::a]:5000"))
    b = dict(limits.connection_keys("ipv6:[2001:db8:1:2:ffff::b]:6000"))
    other = dict(limits.connection_keys("ipv6:[2001:db8:1:3::a]:5000"))
    assert "ip:2001:db8:1:2::/64" in a and a.keys() & b.keys() == {"ip:2001:db8:1:2::/64"}
    assert "ip:2001:db8:1:3::/64" in other
    assert "ip:1.2.3.4" in dict(limits.connection_keys("ipv6:[::ffff:1.2.3.4]:1"))  # a mapped IPv4 host is that host
    assert "ip:1.2.3.4" in dict(limits.connection_keys("ipv4:1.2.3.4:1"))
    assert list(dict(limits.connection_keys("ipv6:[::1]:1"))) == ["conn:ipv6:[::1]:1"]  # loopback: per connection


def test_dial_back_probes_are_budgeted_per_64_too() -> None:
    lim = ProbeLimiter(per_key=(0.0, 100), per_host=(0.0, 3))
    assert all(lim.allow(f"k{i}", f"2001:db8::{i + 1:x}", 0) for i in range(3))
    assert not lim.allow("k9", "2001:db8::ffff", 0)  # a fourth address of the same /64: its budget is spent
    assert lim.allow("k9", "2001:db8:0:1::1", 0)


def _dial(address: str) -> grpc.Channel:
    cert = tls.fetch_cert_sync(address)
    opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
    return grpc.secure_channel(address, tls.channel_credentials(cert), options=opts)


class Flood:
    """One hostile (admitted: the run is open) peer hammering a daemon in three ways at once."""

    def __init__(self, address: str, run_id: bytes) -> None:
        self.address = address
        self.run_id = run_id
        self.me = Identity.generate()
        self.stop = threading.Event()
        self.codes: Counter = Counter()
        self.stall_seconds: list[float] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def _count(self, code: str) -> None:
        with self.lock:
            self.codes[code] += 1

    def requests(self) -> None:
        """Validly signed requests as fast as it can send them, on one connection."""
        with _dial(self.address) as ch:
            stub = rpc.MembershipStub(ch)
            while not self.stop.is_set():
                try:
                    stub.Gossip(sign(pb.GossipRequest(), "Gossip", self.me, self.run_id), timeout=5)
                    self._count("OK")
                except grpc.RpcError as exc:
                    self._count(exc.code().name)

    def stall(self, with_header: bool) -> None:
        """Open a Reduce stream, send (maybe) a signed header, then send nothing more."""

        def messages() -> Iterator[pb.TensorMessage]:
            if with_header:
                header = pb.TensorHeader(round_id=b"s" * 32, shard=0, numel=1000, codec=pb.CODEC_FP32, wire_bytes=4096)
                yield pb.TensorMessage(header=sign(header, HEADER_METHOD, self.me, self.run_id))
            self.stop.wait()

        with _dial(self.address) as ch:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    for _ in rpc.RoundsStub(ch).Reduce(messages(), timeout=120):
                        pass
                except grpc.RpcError as exc:
                    self._count(f"stall:{exc.code().name}")
                with self.lock:
                    self.stall_seconds.append(time.monotonic() - t0)

    def start(self) -> None:
        targets = [self.requests] * 3 + [lambda: self.stall(True)] * 20 + [lambda: self.stall(False)] * 4
        self.threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


@pytest.mark.slow
def test_a_flooding_peer_does_not_stop_the_honest_rounds(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        run__outer_steps=8,
        security__read_timeout=2.0,
        security__rate_limit=50.0,
        security__rate_burst=50.0,
        security__max_streams_per_peer=8,
    )
    swarm = Swarm(tmp_path, 2, config, secure=True)
    with swarm:
        victim = swarm.peers[0]
        swarm.wait_until(lambda: victim.status().outer_step >= 1, 120, "a first round")
        flood = Flood(victim.address, RunConfig.load(config).run_id())
        flood.start()
        try:
            swarm.wait_exit(180)  # every honest peer finishes all its outer steps under the flood
        finally:
            flood.finish()
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == 8 and s["finished"]
        assert s["rounds_partial"] == 0
    codes = flood.codes
    assert codes["RESOURCE_EXHAUSTED"] > 0 and codes["OK"] > 0, codes  # rate limited, not cut off
    assert codes["stall:RESOURCE_EXHAUSTED"] > 0, codes  # more concurrent streams than allowed are refused
    # Header-less stalls are dropped at the first-message deadline; stalls after a header wait at most for the
    # round they name (rendezvous_timeout + 10 s) and are then refused: none is held for long.
    assert max(flood.stall_seconds) < 30, sorted(flood.stall_seconds)[-5:]
    assert victim.summary()["rejected_messages"] > 0
    log = victim.log()
    assert "Traceback" not in log, log[-3000:]
