"""Our own network changed under us: the address this machine sends from is gone (a new DHCP lease, an ISP's forced
reconnect, a laptop moving from one network to another).

Connections opened from the old address do not fail: the kernel can no longer send on them, nobody answers them, and
gRPC's keepalive takes tens of seconds to give up. Meanwhile every call to every peer hangs, and the peer trains
alone (35 solo steps of 40 in tests/test_renumber.py before this module). `SourceWatch` asks the kernel, once per
gossip tick, which source address it would pick to reach a few peers: a UDP `connect` sends nothing, and works the
same on Linux, macOS and Windows. When the address it picked for a destination before can no longer be bound here,
it is gone, and every cached connection goes with it (Channels.renew). A new address that joins the old one (IPv6
privacy addresses rotate daily while the old stays usable) leaves the connections alone.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Iterable

from peerd.addresses import split_host

MAX_DESTINATIONS = 64  # destinations remembered (a few are sampled per tick); the oldest go first


def source_for(host: str, port: int = 9) -> str | None:
    """The local address the kernel picks to reach `host` (an IP address) now; None when it has no route (a cut
    link). Nothing is sent."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None


def _bind_errno(ip: str) -> int | None:
    """Bind a UDP socket to `ip` (an IP address): None when it binds, else the error number."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
            return None
    except OSError as exc:
        return exc.errno if exc.errno is not None else -1


def is_local(address: str) -> bool:
    """Is `address` (an IP address, never a name: no lookup) one of this machine's own? (A socket binds to it.)"""
    try:
        ip = str(ipaddress.ip_address(address))
    except ValueError:
        return False
    return _bind_errno(ip) is None


def still_local(address: str) -> bool:
    """Can this machine still send from `address`? Only "not an address here" says no: any other failure to bind
    is no evidence."""
    return _bind_errno(address) not in (errno.EADDRNOTAVAIL, getattr(errno, "WSAEADDRNOTAVAIL", -1))


class SourceWatch:
    """The source address the kernel picks for each destination host, and whether the one it picked last is gone."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}  # destination host -> source address picked for it last

    def sample(self, addresses: Iterable[str]) -> tuple[str, str] | None:
        """Look up the source for each of `addresses` (peers' 'host:port'); (old, new) when one changed and the old
        is no longer an address of this machine, else None. Names and loopback destinations are skipped."""
        gone: tuple[str, str] | None = None
        for address in addresses:
            host = split_host(address)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                continue  # a name: looking it up would block the event loop, and says nothing of our address
            if ip.is_loopback or ip.is_unspecified:
                continue
            new = source_for(host)
            if new is None:
                continue  # no route now: a cut link says nothing about our address
            old = self.sources.pop(host, None)
            self.sources[host] = new  # re-inserted: the dict keeps the most recently seen last
            if old is not None and old != new and gone is None and not still_local(old):
                gone = (old, new)
        while len(self.sources) > MAX_DESTINATIONS:
            del self.sources[next(iter(self.sources))]
        return gone
