"""The slow-link harness's own check: TCP goodput between two hosts of a :class:`bench.slowlink.SlowLinkNet`.

``python -m bench.goodput --hosts 2 --rate 100 --seconds 3`` builds a net, sends as fast as TCP lets one flow for
a few seconds, and reports the payload rate against the shaped rate (about 95.6 % is the ceiling with TCP/IP
headers; see bench/slowlink.py for the tbf parameters behind it).
"""

from __future__ import annotations

import argparse
import json
import math
import select
import signal
import subprocess
import sys
from collections.abc import Sequence

from bench.slowlink import SlowLinkError, SlowLinkNet, available

__all__ = ["main", "measure_goodput"]

# ------------------------------------------------------------------ goodput
# The receiver decides how long the test runs (it closes the socket), so bytes parked in the sender's socket
# buffer cannot stretch the measurement. The clock starts at the first payload byte, not after a warm-up: after a
# loss, TCP holds out-of-order data back and hands it to the application in one lump when the hole is filled, so
# bytes that arrived before a mid-stream mark would be counted after it (we saw +14 % at 10 Mbit/s). Counting from
# the first byte can only overstate by the initial tbf bucket, and includes TCP start-up, as a real transfer does.
_RECEIVER = r"""
import json, socket, sys, time
window, wait = float(sys.argv[1]), float(sys.argv[2])
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 0))
srv.listen(1)
srv.settimeout(wait)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(wait)
view = memoryview(bytearray(1 << 20))
first = None
got = 0
while True:
    n = conn.recv_into(view)
    if n == 0:
        break
    now = time.perf_counter()
    if first is None:
        first = now  # these bytes arrived before the clock started, so they are not counted
        continue
    got += n
    if now - first >= window:
        break
end = time.perf_counter()
conn.close()
print(json.dumps({"bytes": got, "seconds": (end - first) if first else 0.0}), flush=True)
"""

_SENDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
s.settimeout(float(sys.argv[3]))
chunk = bytes(256 * 1024)
try:
    while True:
        s.sendall(chunk)
except (BrokenPipeError, ConnectionResetError):
    pass
"""


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """Read one line from a child's stdout without hanging forever if it never writes one."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise SlowLinkError(f"no answer from child within {timeout:.0f} s")
    return proc.stdout.readline()


def measure_goodput(net: SlowLinkNet, src: int, dst: int, seconds: float) -> float:
    """Mbit/s of TCP payload a sender in host ``src`` delivers to a receiver in host ``dst``.

    Both ends are small stdlib-only Python programs (``sys.executable -I -S -c``). The receiver listens on
    0.0.0.0 in ``dst``; the sender connects to ``net.address(dst)`` and writes as fast as TCP lets it for
    ``seconds``, timed from the first payload byte (so TCP start-up counts, as in a real transfer). The ceiling
    is about 95.6 % of the shaped rate (header overhead; see the module docstring).
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError("seconds must be a number")
    if not math.isfinite(seconds) or not 0.05 <= seconds <= 3600:
        raise ValueError(f"seconds must be in [0.05, 3600], got {seconds!r}")
    net._host(src)
    net._host(dst)
    if src == dst:
        raise ValueError("src and dst must be different hosts")
    wait = seconds + 15.0
    py = [sys.executable, "-I", "-S", "-c"]
    recv = net.popen(
        dst,
        [*py, _RECEIVER, str(seconds), str(wait)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    send: subprocess.Popen[str] | None = None
    try:
        port_line = _read_line(recv, 15.0).strip()
        if not port_line.isdigit():
            recv.kill()
            err = recv.communicate()[1]
            raise SlowLinkError(f"goodput receiver did not report a port: {port_line!r} {err.strip()}")
        send = net.popen(
            src,
            [*py, _SENDER, net.address(dst), port_line, str(wait)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = recv.communicate(timeout=wait + 5.0)
        except subprocess.TimeoutExpired as exc:
            raise SlowLinkError(f"goodput receiver did not finish within {wait + 5.0:.0f} s") from exc
        if recv.returncode != 0:
            raise SlowLinkError(f"goodput receiver failed ({recv.returncode}): {err.strip()}")
        try:
            send_err = send.communicate(timeout=10.0)[1]
        except subprocess.TimeoutExpired as exc:
            raise SlowLinkError("goodput sender did not stop after the receiver closed") from exc
        if send.returncode != 0:
            raise SlowLinkError(f"goodput sender failed ({send.returncode}): {send_err.strip()}")
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in (send, recv):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    got, elapsed = int(result["bytes"]), float(result["seconds"])
    if elapsed <= 0.0 or got <= 0:
        raise SlowLinkError(f"no payload measured (bytes={got}, seconds={elapsed})")
    return got * 8 / elapsed / 1e6


# ---------------------------------------------------------------------- CLI
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput",
        description="Build a tbf-shaped slow-link net and measure TCP goodput between two of its hosts.",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--rate", type=float, default=100.0, help="egress rate of every host in Mbit/s")
    parser.add_argument("--down-rate", type=float, default=None, help="also shape what each host receives")
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement window (default 3)")
    parser.add_argument("--src", type=int, default=0, help="sending host (default 0)")
    parser.add_argument("--dst", type=int, default=1, help="receiving host (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m bench.goodput --hosts 2 --rate 100 --seconds 3``."""
    args = _parse_args(argv)
    ok, reason = available()
    if not ok:
        print(f"slow-link net unavailable: {reason}", file=sys.stderr)
        return 2

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__, so the namespaces go away

    signal.signal(signal.SIGTERM, _terminate)
    try:
        net = SlowLinkNet(args.hosts, args.rate, down_rate_mbit=args.down_rate)
        with net:
            goodput = measure_goodput(net, args.src, args.dst, args.seconds)
            drops = net.qdisc_stats(args.src)["drops"]
    except (ValueError, SlowLinkError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    shaped = min(args.rate, args.down_rate) if args.down_rate is not None else args.rate
    report = {
        "hosts": args.hosts,
        "rate_mbit": args.rate,
        "down_rate_mbit": args.down_rate,
        "seconds": args.seconds,
        "goodput_mbit": round(goodput, 3),
        "fraction_of_rate": round(goodput / shaped, 4),
        "tbf_drops": drops,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"goodput host {args.src} -> host {args.dst}: {goodput:.2f} Mbit/s = "
            f"{goodput / shaped:.1%} of the shaped {shaped:g} Mbit/s "
            f"(ceiling with TCP/IP headers ~95.6%; tbf drops {drops})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
