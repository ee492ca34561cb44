"""Link faults (bench/netfaults.py) proved with plain sockets, and peerd daemons in namespaces (tests/netswarm.py).

Needs root for network namespaces (`needs_netns` marks the tests `root`); skipped with the reason otherwise.
"""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.netfaults import FaultNet
from tests.netswarm import NetSwarm
from tests.swarm import tiny_config
from tests.test_slowlink import needs_netns
from tests.test_swarm_diloco import assert_identical_globals

pytestmark = pytest.mark.slow

_PY = [sys.executable, "-I", "-S", "-c"]
_PORT = 9000

# Echoes on 0.0.0.0:PORT, one thread per connection.
_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", int(sys.argv[1])))
    srv.listen(16)
    print("ready", flush=True)
    def echo(conn):
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)
    while True:
        threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
    """
)
# Answers one line per command read from stdin:
#   connect NAME ADDR PORT TIMEOUT  -> ok | timeout | the OSError's class name (e.g. ConnectionRefusedError)
#   echo NAME TIMEOUT               -> ok once every byte ever sent on NAME came back | timeout | error name
# A timed-out echo leaves its bytes owed, so a later echo says ok only if the stalled bytes were delivered too.
_CLIENT = textwrap.dedent(
    """
    import socket, sys
    conns, owed = {}, {}
    for line in sys.stdin:
        cmd, name, *args = line.split()
        try:
            if cmd == "connect":
                conns[name] = socket.create_connection((args[0], int(args[1])), timeout=float(args[2]))
                owed[name] = 0
            else:
                s = conns[name]
                s.settimeout(float(args[0]))
                s.sendall(b"ping")
                owed[name] += 4
                while owed[name]:
                    got = s.recv(owed[name])
                    if not got:
                        raise ConnectionResetError("closed")
                    owed[name] -= len(got)
            print("ok", flush=True)
        except TimeoutError:
            print("timeout", flush=True)
        except OSError as exc:
            print(type(exc).__name__, flush=True)
    """
)


class Client:
    """A long-lived socket client in one host, so a test can keep a connection open across a fault."""

    def __init__(self, net: FaultNet, host: int) -> None:
        self.net = net
        self.proc = net.popen(host, [*_PY, _CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, line: str, timeout: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 5)
        assert ready, f"client did not answer {line!r}"
        return self.proc.stdout.readline().strip()

    def connect(self, name: str, host: int, timeout: float = 1.0) -> str:
        return self._ask(f"connect {name} {self.net.address(host)} {_PORT} {timeout}", timeout)

    def echo(self, name: str, timeout: float = 1.0) -> str:
        return self._ask(f"echo {name} {timeout}", timeout)


@pytest.fixture
def net4() -> Iterator[FaultNet]:
    with FaultNet(4, 1000.0) as net:
        for i in range(net.n_hosts):
            server = net.popen(i, [*_PY, _SERVER, str(_PORT)], stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield net


@needs_netns
def test_partition_splits_into_groups_and_heal_joins_them(net4: FaultNet) -> None:
    net = net4
    left, right = Client(net, 0), Client(net, 3)
    assert left.connect("across", 2) == "ok" and left.echo("across") == "ok"

    net.partition([[0, 1], [2, 3]])
    assert net.groups() == [[0, 1], [2, 3]]
    assert left.connect("a", 1) == "ok" and left.echo("a") == "ok"  # inside a group: as before
    assert right.connect("b", 2) == "ok" and right.echo("b") == "ok"  # the other group talks too
    assert left.connect("c", 2) == "timeout"  # across: silence, no RST
    assert left.echo("across") == "timeout"  # the open connection stalls, it is not reset

    net.heal()
    assert net.groups() == [[0, 1, 2, 3]]
    assert left.connect("d", 2) == "ok" and left.echo("d") == "ok"
    assert left.echo("across", timeout=10.0) == "ok"  # the stalled bytes arrive: same connection, no RST


@needs_netns
def test_block_inbound_lets_the_host_dial_out_but_not_be_dialed(net4: FaultNet) -> None:
    net = net4
    net.set_rate(1, 20.0)  # asymmetric: 20 Mbit/s up, 50 down, with the block on top
    net.set_down_rate(1, 50.0)
    outside, inside = Client(net, 0), Client(net, 1)
    assert outside.connect("before", 1) == "ok"

    net.block_inbound(1)
    assert outside.connect("in", 1) == "timeout"  # dropped, not refused: as a NAT does
    assert net.syns_dropped(1) >= 1
    assert inside.connect("out", 0) == "ok" and inside.echo("out") == "ok"
    assert outside.echo("before") == "ok"  # a connection made before the block keeps working
    assert net.qdisc_stats(1)["packets"] > 0 and net.down_rate(1) == 50.0  # shaping is untouched

    net.unblock_inbound(1)
    assert outside.connect("again", 1) == "ok" and outside.echo("again") == "ok"


@needs_netns
def test_cut_stalls_the_host_and_restore_resumes_it(net4: FaultNet) -> None:
    net = net4
    client = Client(net, 0)
    assert client.connect("open", 2) == "ok" and client.echo("open") == "ok"

    net.cut(2)
    assert net.is_cut(2)
    assert client.echo("open") == "timeout"
    assert client.connect("new", 2) != "ok"
    assert client.connect("other", 1) == "ok"  # only host 2 is cut off

    net.restore(2)
    assert not net.is_cut(2)
    assert client.echo("open", timeout=10.0) == "ok"
    assert client.connect("after", 2) == "ok" and client.echo("after") == "ok"


@needs_netns
def test_three_diloco_peers_in_namespaces_agree(tmp_path: Path) -> None:
    swarm = NetSwarm(tmp_path, 3, tiny_config(tmp_path, run__outer_steps=3), rate_mbit=100.0)
    with swarm:
        assert [p.address for p in swarm.peers] == [swarm.address(i) for i in range(3)]  # --announce took effect
        swarm.wait_until(lambda: len(swarm.status(2, via=0).alive) == 3, 60, "peer 2, asked from host 0, to know all")
        swarm.wait_exit(120)
    assert_identical_globals([p.data_dir for p in swarm.peers])
    for p in swarm.peers:
        s = p.summary()
        assert s["outer_step"] == 3 and s["finished"], s
