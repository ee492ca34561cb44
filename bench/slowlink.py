"""Slow-link test bench: peers in network namespaces whose egress is shaped with ``tc tbf``.

peerd's users sit behind 10-1000 Mbit/s internet links, so claims such as "syncs use 85 % of the link" and
"syncs overlap with compute" must be checked on a link that is actually slow. This module builds that link on
one machine with no network access and without netem:

* a *hub* namespace holds a Linux bridge, so nothing touches the root namespace's interfaces;
* each host lives in a namespace of its own, joined to the bridge by a veth pair created directly inside the
  hub/host namespaces (the pair never exists in the root namespace);
* each host's egress (its "upload") is shaped by a token-bucket filter on its ``eth0``; optionally the hub-side
  end of its veth is shaped too, which models the host's download rate.

Every instance uses namespace names with the pid and a random suffix, and tears everything down on exit,
exceptions, Ctrl-C and interpreter exit (``atexit``). Namespaces left behind by a process that was SIGKILLed can
be removed with :func:`remove_stale_namespaces`.

Link faults (cut links, partitions, hosts that cannot be dialed) are in :mod:`bench.netfaults`, on top of this, and
the harness's own TCP goodput check is :mod:`bench.goodput` (``python -m bench.goodput``).

Choice of tbf parameters (see :func:`tbf_params`):

* ``burst`` (bucket size) is 4 ms worth of tokens at the shaped rate, and at least 4 KiB (two full frames plus
  slack). The kernel refills the bucket with high-resolution timers, so a few ms holds the rate exactly; GSO
  packets larger than the bucket are split by tbf itself. A 64 KiB bucket was worse on both counts we measured:
  at 10 Mbit/s a fresh TCP flow (BBR is this kernel's default) overshot it, lost ~350 packets and reached 88 % of
  the rate; at 20 Mbit/s the extra bucketful at veth speed pushed measured goodput to 97 %, above the 95.6 %
  that headers allow. With 4 ms both gave 95.6-95.9 % and no drops.
* the queue limit is 50 ms of traffic at the shaped rate plus the bucket, and at least 256 KiB. 50 ms is the
  order of the buffering of a real access link, so a sync that fills the link sees a realistic queueing delay.
  The 256 KiB floor (about 210 ms at 10 Mbit/s, as bufferbloated as many home uplinks) keeps TCP start-up from
  losing packets at low rates. Smaller queues cost little goodput in our 2 s runs at 10-20 Mbit/s (95.5 % with
  both BBR and cubic at 64 KiB, one cubic run at 90 % with 128 KiB) but 45-250 tail drops per fresh BBR flow,
  which makes short transfers and round latencies noisy; 256 KiB gave no drops with either.

tbf counts whole Ethernet frames, so the best possible TCP payload rate is 1448/1514 (about 95.6 %) of the shaped
rate with a 1500-byte MTU and TCP timestamps.

Congestion control: a host namespace inherits the machine's default (``congestion=None``), or runs the one named
(``congestion="cubic"``, bench.wire ``--cc``), for a figure that must not change with the machine it was measured
on. This machine's default is BBR (v1); cubic is the default of Linux, Windows and macOS. On these tbf queues they
differ cell by cell (BENCHMARKS.md, "The wire at the link's limit", stop 57): peerd's 4-peer rounds at 20 Mbit/s
lost 8,000-15,000 packets per round with BBR against 150-400 with cubic and took 2-13 % longer, while raw TCP's one
connection per pair at 2 peers and 20 Mbit/s, carrying both directions, reached only 0.64-0.88 of the link with cubic.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from bench.congestion import CC_ALLOWED, CC_SYSCTL, allowed_congestion, check_congestion, host_congestion

__all__ = [
    "SlowLinkError",
    "SlowLinkNet",
    "SlowLinkUnavailable",
    "allowed_congestion",
    "available",
    "check_congestion",
    "host_congestion",
    "remove_stale_namespaces",
    "tbf_params",
]

_NS_PREFIX = "slowlink-"
_NS_PATTERN = re.compile(r"^slowlink-(\d+)-[0-9a-f]{6}-(?:h\d+|hub|probe)$")
_HOST_IF = "eth0"
_BRIDGE = "br0"
_MAX_RATE_MBIT = 100_000.0  # 100 Gbit/s: beyond anything a veth on this class of machine carries
_MAX_HOSTS = 1000  # a Linux bridge has at most 1024 ports
_MIN_BURST = 4 * 1024
_MIN_LIMIT = 256 * 1024
_BURST_SECONDS = 0.004
_QUEUE_SECONDS = 0.050
_CMD_TIMEOUT = 20.0


class SlowLinkUnavailable(RuntimeError):
    """This machine cannot build a slow-link net (not root, no ``ip``/``tc``, or no netns/veth/bridge/tbf)."""


class SlowLinkError(RuntimeError):
    """A command that builds, drives or tears down the net failed; the message carries its stderr."""


def _tool(name: str) -> str | None:
    """Find ``ip``/``tc`` even when ``/usr/sbin`` is not on PATH (common for non-login shells)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _exec(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one setup/teardown command; a failure becomes a SlowLinkError naming the command."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlowLinkError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        raise SlowLinkError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _unique_tag() -> str:
    """pid plus random bits: two runs (or two nets in one run) never pick the same namespace names."""
    return f"{os.getpid()}-{secrets.token_hex(3)}"


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Say whether slow-link nets can be built here, and if not, why.

    Beyond the cheap checks (Linux, root, tools on disk) this builds and removes a throwaway namespace with a
    bridge, a veth pair and a tbf qdisc, because containers often have root without the capabilities or kernel
    modules these need. The answer is cached; ``available.cache_clear()`` forgets it.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces and tc need root (os.geteuid() != 0)"
    ip, tc = _tool("ip"), _tool("tc")
    if ip is None or tc is None:
        missing = " and ".join(n for n, p in (("ip", ip), ("tc", tc)) if p is None)
        return False, f"{missing} not found (install iproute2)"
    probe = f"{_NS_PREFIX}{_unique_tag()}-probe"
    steps = [
        [ip, "netns", "add", probe],
        [ip, "-n", probe, "link", "add", _BRIDGE, "type", "bridge"],
        [ip, "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
        [ip, "-n", probe, "link", "set", "pa", "master", _BRIDGE],
        [tc, "-n", probe, "qdisc", "add", "dev", "pb", "root", "tbf", "rate", "10mbit", "burst", "64kb",
         "limit", "256kb"],
    ]  # fmt: skip
    try:
        for argv in steps:
            _exec(argv)
    except SlowLinkError as exc:
        return False, f"probe failed: {exc}"
    finally:
        _exec([ip, "netns", "del", probe], check=False)
    return True, "ok"


def _require() -> tuple[str, str]:
    """Return the ``ip`` and ``tc`` paths, or raise SlowLinkUnavailable with the reason."""
    ok, reason = available()
    ip, tc = _tool("ip"), _tool("tc")
    if not ok or ip is None or tc is None:
        raise SlowLinkUnavailable(reason)
    return ip, tc


def _check_rate(rate_mbit: float, what: str) -> float:
    """Reject rates tbf cannot honour, before any namespace exists."""
    if isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float)):
        raise ValueError(f"{what} must be a number of Mbit/s, got {type(rate_mbit).__name__}")
    rate = float(rate_mbit)
    if not math.isfinite(rate) or rate <= 0.0:
        raise ValueError(f"{what} must be finite and > 0, got {rate_mbit!r}")
    if rate > _MAX_RATE_MBIT:
        raise ValueError(f"{what} must be at most {_MAX_RATE_MBIT:g} Mbit/s, got {rate:g}")
    if rate * 1e6 < 8 * 1514:
        raise ValueError(f"{what} must carry at least one 1514-byte frame per second, got {rate:g} Mbit/s")
    return rate


def _rate_list(rate_mbit: float | Sequence[float], n_hosts: int, what: str) -> list[float]:
    """Expand one rate to every host, or check a per-host list has one entry per host."""
    if isinstance(rate_mbit, (list, tuple)):
        if len(rate_mbit) != n_hosts:
            raise ValueError(f"{what} has {len(rate_mbit)} entries for {n_hosts} hosts")
        return [_check_rate(r, f"{what}[{i}]") for i, r in enumerate(rate_mbit)]
    return [_check_rate(rate_mbit, what)] * n_hosts  # type: ignore[arg-type]


def tbf_params(rate_mbit: float) -> tuple[int, int, int]:
    """Return ``(rate_bit_per_s, burst_bytes, limit_bytes)`` for a tbf shaping to ``rate_mbit``.

    Why these values is explained in the module docstring: a 4 ms (>= 4 KiB) bucket and a 50 ms (>= 256 KiB)
    queue on top of it.
    """
    rate = _check_rate(rate_mbit, "rate_mbit")
    rate_bit = max(1, round(rate * 1e6))
    bytes_per_s = rate_bit / 8.0
    burst = max(_MIN_BURST, math.ceil(bytes_per_s * _BURST_SECONDS))
    limit = max(_MIN_LIMIT, burst + math.ceil(bytes_per_s * _QUEUE_SECONDS))
    return rate_bit, burst, limit


def _tbf_argv(rate_mbit: float) -> list[str]:
    rate_bit, burst, limit = tbf_params(rate_mbit)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]


@contextlib.contextmanager
def _deferred_sigint() -> Iterator[None]:
    """Hold off Ctrl-C while namespaces are created or deleted, then raise it once the step is done.

    An interrupt in the middle of teardown would leave namespaces behind, which is exactly what must not
    happen. Signal handlers can only be swapped from the main thread; elsewhere this is a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _kill_pids(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM the given processes, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and not _is_zombie(p)]
        if alive:
            time.sleep(0.02)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _namespace_pids(ip: str, ns: str) -> list[int]:
    done = _exec([ip, "netns", "pids", ns], check=False)
    return [int(tok) for tok in done.stdout.split() if tok.isdigit()]


def _delete_namespace(ip: str, ns: str) -> str | None:
    """Kill what still runs in ``ns`` (so the namespace really dies) and delete it; return an error or None."""
    pids = _namespace_pids(ip, ns)
    if pids:
        _kill_pids(pids)
    done = _exec([ip, "netns", "del", ns], check=False)
    if done.returncode != 0 and os.path.exists(f"/run/netns/{ns}"):
        return f"ip netns del {ns}: {done.stderr.strip()}"
    return None


def _list_namespaces(ip: str) -> list[str]:
    done = _exec([ip, "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by slow-link nets whose owning process no longer exists; return their names.

    Only names this module creates (``slowlink-<pid>-<hex>-...``) whose pid is dead are touched, so nets of
    other live runs are safe, as long as they share this process's pid namespace (another container sharing
    ``/run/netns`` would look dead from here).
    """
    ip, _tc = _require()
    removed = []
    for ns in _list_namespaces(ip):
        match = _NS_PATTERN.match(ns)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        if _delete_namespace(ip, ns) is None:
            removed.append(ns)
    return removed


_LIVE: set[SlowLinkNet] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _close_live_nets() -> None:
    """Last line of defence: tear down nets whose owner exited without leaving the ``with`` block."""
    with _LIVE_LOCK:
        nets = list(_LIVE)
    for net in nets:
        with contextlib.suppress(Exception):
            net.close()


class SlowLinkNet:
    """N hosts, each in its own netns, joined by veth pairs to a bridge in a separate hub namespace.

    Each host's egress is shaped with tbf to ``rate_mbit`` (one rate for all, or one per host); with
    ``down_rate_mbit`` the traffic the bridge sends to a host is shaped too. Host ``i`` has address
    ``subnet[i + 1]`` on its ``eth0``; its loopback is up, so servers listening on 0.0.0.0, on the host's
    address or on 127.0.0.1 all work. An IPv6 ``subnet`` (``fd77::/64``) makes an IPv6-only net: hosts have that
    address alone (and ``::1``), so software that quietly assumes IPv4 fails there as it would on such a network.
    Use as a context manager; nothing exists before ``__enter__`` and nothing is left after ``__exit__``.
    """

    def __init__(
        self,
        n_hosts: int,
        rate_mbit: float | list[float],
        *,
        subnet: str = "10.77.0.0/24",
        down_rate_mbit: float | list[float] | None = None,
        congestion: str | None = None,
    ) -> None:
        if congestion is not None:
            check_congestion(congestion)
        if isinstance(n_hosts, bool) or not isinstance(n_hosts, int):
            raise ValueError(f"n_hosts must be an int, got {type(n_hosts).__name__}")
        if not 1 <= n_hosts <= _MAX_HOSTS:
            raise ValueError(f"n_hosts must be in [1, {_MAX_HOSTS}], got {n_hosts}")
        try:
            network = ipaddress.ip_network(subnet, strict=True)
        except ValueError as exc:
            raise ValueError(f"subnet must be a network such as 10.77.0.0/24 or fd77::/64: {exc}") from exc
        if network.num_addresses - 2 < n_hosts:
            raise ValueError(f"subnet {network} has room for {max(0, network.num_addresses - 2)} hosts, not {n_hosts}")
        self._n = n_hosts
        self._network = network
        self._rates = _rate_list(rate_mbit, n_hosts, "rate_mbit")
        self._down: list[float | None] = (
            [None] * n_hosts if down_rate_mbit is None else list(_rate_list(down_rate_mbit, n_hosts, "down_rate_mbit"))
        )
        self._addresses = [str(network.network_address + 1 + i) for i in range(n_hosts)]
        self._congestion = congestion
        tag = _unique_tag()
        self._hub = f"{_NS_PREFIX}{tag}-hub"
        self._hosts = [f"{_NS_PREFIX}{tag}-h{i}" for i in range(n_hosts)]
        self._procs: list[subprocess.Popen[Any]] = []
        self._procs_lock = threading.Lock()
        self._created: list[str] = []
        self._ip = ""
        self._tc = ""
        self._up = False

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> SlowLinkNet:
        if self._up or self._created:
            raise SlowLinkError("this SlowLinkNet is already set up; make a new one")
        self._ip, self._tc = _require()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            with _deferred_sigint():
                self._build()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except SlowLinkError:
            if exc is None:
                raise  # nothing else is failing: a leak must not pass silently
            # another error is already propagating; keep it as the primary one
            print(f"slowlink: teardown after {exc_type.__name__ if exc_type else 'error'} failed", file=sys.stderr)

    def _ns_add(self, ns: str) -> None:
        _exec([self._ip, "netns", "add", ns])
        self._created.append(ns)

    def _build(self) -> None:
        ip, hub = self._ip, self._hub
        self._ns_add(hub)
        self._set_ipv6(hub, False)
        _exec([ip, "-n", hub, "link", "set", "lo", "up"])
        # no STP (ports forward at once) and no multicast snooping (its IGMP packets would show in byte counts)
        _exec([ip, "-n", hub, "link", "add", _BRIDGE, "type", "bridge", "stp_state", "0", "mcast_snooping", "0"])
        _exec([ip, "-n", hub, "link", "set", _BRIDGE, "up"])
        prefix = self._network.prefixlen
        for i, ns in enumerate(self._hosts):
            port = f"p{i}"
            self._ns_add(ns)
            # the pair is born inside the hub/host namespaces, so the root namespace never sees it
            _exec([ip, "-n", hub, "link", "add", port, "type", "veth", "peer", "name", _HOST_IF, "netns", ns])
            _exec([ip, "-n", hub, "link", "set", port, "master", _BRIDGE])
            _exec([ip, "-n", hub, "link", "set", port, "up"])
            self._set_ipv6(ns, self.ipv6)
            self._set_congestion(ns)
            _exec([ip, "-n", ns, "link", "set", "lo", "up"])
            # nodad: the address works at once (duplicate detection would hold it "tentative" for a second or more)
            nodad = ["nodad"] if self.ipv6 else []
            _exec([ip, "-n", ns, "addr", "add", f"{self._addresses[i]}/{prefix}", "dev", _HOST_IF, *nodad])
            _exec([ip, "-n", ns, "link", "set", _HOST_IF, "up"])
            self._shape(ns, _HOST_IF, self._rates[i])
            down = self._down[i]
            if down is not None:
                self._shape(hub, port, down)

    def _set_ipv6(self, ns: str, on: bool) -> None:
        """IPv6 off in ``ns`` (its autoconfiguration chatter would pollute tx/rx byte counts), or on for an IPv6 net
        without router solicitations or autoconfigured addresses: the host has its one static address (neighbour
        discovery remains). A missing ``sysctl`` only costs byte-count accuracy, so it is not an error."""
        keys = ["disable_ipv6=0", "accept_ra=0", "autoconf=0", "router_solicitations=0", "dad_transmits=0"]
        sets = [
            f"net.ipv6.conf.{dev}.{key}" for dev in ("all", "default") for key in (keys if on else ["disable_ipv6=1"])
        ]
        _exec([self._ip, "netns", "exec", ns, "sysctl", "-q", "-w", *sets], check=False)

    @property
    def ipv6(self) -> bool:
        """Whether this is an IPv6-only net (an IPv6 ``subnet``)."""
        return self._network.version == 6

    def hostport(self, i: int, port: int) -> str:
        """Host ``i``'s address with ``port``, as dialled: ``10.77.0.2:7000`` or ``[fd77::2]:7000``."""
        host = self.address(i)
        return f"[{host}]:{port}" if self.ipv6 else f"{host}:{port}"

    def _set_congestion(self, ns: str) -> None:
        """Give ``ns`` its own TCP congestion control (a per-namespace sysctl); None keeps the one it inherited."""
        if self._congestion is None:
            return
        setting = f"{CC_SYSCTL}={self._congestion}"
        done = _exec([self._ip, "netns", "exec", ns, "sysctl", "-q", "-w", setting], check=False)
        if done.returncode != 0:
            allowed = " ".join(allowed_congestion()) or "unknown"
            raise SlowLinkError(
                f"cannot set {setting} in a namespace ({done.stderr.strip()}); namespaces here may pick: {allowed} "
                f"({CC_ALLOWED}); pick one of those, or, as root on the host itself, load the module (modprobe "
                f"tcp_<name>) and add it to {CC_ALLOWED}"
            )

    def _shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        _exec([self._tc, "-n", ns, "qdisc", "replace", "dev", dev, "root", *_tbf_argv(rate_mbit)])

    def close(self) -> None:
        """Kill processes started in the net and delete every namespace (idempotent).

        Deleting a namespace destroys the veth ends inside it, and a veth pair dies with either end, so no
        interface can outlive the namespaces. Raises SlowLinkError if a namespace could not be deleted.
        """
        errors: list[str] = []
        with _deferred_sigint():
            with self._procs_lock:
                running = [p for p in self._procs if p.poll() is None]
                self._procs.clear()
            _kill_pids([p.pid for p in running])
            for proc in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
            # hosts first, hub last: the hub is the only thing joining them
            for ns in reversed(self._created):
                err = _delete_namespace(self._ip, ns)
                if err is not None:
                    errors.append(err)
            self._created.clear()
            self._up = False
            with _LIVE_LOCK:
                _LIVE.discard(self)
        if errors:
            raise SlowLinkError("teardown left namespaces behind: " + "; ".join(errors))

    # ------------------------------------------------------------------ queries
    @property
    def n_hosts(self) -> int:
        return self._n

    def congestion(self, i: int) -> str:
        """The TCP congestion control host ``i``'s connections use, as its namespace reports it."""
        self._require_up()
        done = _exec([self._ip, "netns", "exec", self.netns(i), "sysctl", "-n", CC_SYSCTL])
        return done.stdout.strip()

    def namespaces(self) -> list[str]:
        """Every namespace this net owns (hosts, then hub), so callers can check for leftovers."""
        return [*self._hosts, self._hub]

    def _host(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self._n:
            raise ValueError(f"host index must be an int in [0, {self._n}), got {i!r}")
        return i

    def _require_up(self) -> None:
        if not self._up:
            raise SlowLinkError("the net is not set up; use it inside `with SlowLinkNet(...) as net:`")

    def address(self, i: int) -> str:
        """Host ``i``'s address (IPv4, or IPv6 on an IPv6 net), reachable from every other host."""
        return self._addresses[self._host(i)]

    def netns(self, i: int) -> str:
        """Name of host ``i``'s network namespace (for ``ip netns exec`` and friends)."""
        return self._hosts[self._host(i)]

    def rate(self, i: int) -> float:
        """Host ``i``'s current egress (upload) rate in Mbit/s."""
        return self._rates[self._host(i)]

    def down_rate(self, i: int) -> float | None:
        """Host ``i``'s current ingress (download) rate in Mbit/s, or None if unshaped."""
        return self._down[self._host(i)]

    # ---------------------------------------------------------------- processes
    def _argv(self, i: int, argv: Sequence[str]) -> list[str]:
        self._require_up()
        if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a non-empty list of str")
        return [self._ip, "netns", "exec", self.netns(i), *argv]

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``'s namespace; ``kw`` goes to ``subprocess.Popen``.

        ``ip netns exec`` execs the command in place, so the returned Popen's pid is the command's own pid. The
        net kills it at teardown if it is still running.
        """
        proc: subprocess.Popen[Any] = subprocess.Popen(self._argv(i, argv), **kw)
        with self._procs_lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            self._procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion inside host ``i``'s namespace; ``kw`` goes to ``subprocess.run``."""
        return subprocess.run(self._argv(i, argv), **kw)

    # ------------------------------------------------------------------ shaping
    def _link_stats(self, ns: str, dev: str) -> dict[str, Any]:
        done = _exec([self._ip, "-n", ns, "-s", "-j", "link", "show", "dev", dev])
        try:
            return json.loads(done.stdout)[0]["stats64"]
        except (ValueError, LookupError, TypeError) as exc:
            raise SlowLinkError(f"unexpected `ip -s -j link` output for {dev} in {ns}: {exc}") from exc

    def tx_bytes(self, i: int) -> int:
        """Bytes (whole Ethernet frames) host ``i``'s interface has sent: payload plus all header overhead."""
        self._require_up()
        return int(self._link_stats(self.netns(i), _HOST_IF)["tx"]["bytes"])

    def rx_bytes(self, i: int) -> int:
        """Bytes (whole Ethernet frames) host ``i``'s interface has received."""
        self._require_up()
        return int(self._link_stats(self.netns(i), _HOST_IF)["rx"]["bytes"])

    def qdisc_stats(self, i: int) -> dict[str, int]:
        """tbf counters of host ``i``'s egress: bytes, packets, drops, overlimits, requeues, backlog."""
        self._require_up()
        done = _exec([self._tc, "-n", self.netns(i), "-s", "-j", "qdisc", "show", "dev", _HOST_IF])
        try:
            entries = json.loads(done.stdout)
            tbf = next(e for e in entries if e.get("kind") == "tbf")
        except (ValueError, StopIteration, AttributeError) as exc:
            raise SlowLinkError(f"no tbf qdisc found on host {i}: {exc}") from exc
        keys = ("bytes", "packets", "drops", "overlimits", "requeues", "backlog")
        return {k: int(tbf.get(k, 0)) for k in keys}

    def set_rate(self, i: int, rate_mbit: float) -> None:
        """Change host ``i``'s egress rate in place; open connections keep running and see the new rate."""
        self._require_up()
        i = self._host(i)
        rate = _check_rate(rate_mbit, "rate_mbit")
        self._shape(self.netns(i), _HOST_IF, rate)
        self._rates[i] = rate

    def set_down_rate(self, i: int, rate_mbit: float | None) -> None:
        """Change (or with None, remove) the shaping of what host ``i`` receives."""
        self._require_up()
        i = self._host(i)
        port = f"p{i}"
        if rate_mbit is None:
            if self._down[i] is not None:
                _exec([self._tc, "-n", self._hub, "qdisc", "del", "dev", port, "root"])
            self._down[i] = None
            return
        rate = _check_rate(rate_mbit, "down_rate_mbit")
        self._shape(self._hub, port, rate)
        self._down[i] = rate
