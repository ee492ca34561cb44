"""Addresses, IPv4 and IPv6 alike: 'host:port' as peers announce and dial them ('[v6]:port' for IPv6), and the peer
strings gRPC reports for a caller.

The daemon's peer addresses are split, joined and read here, so an IPv6 one is never written without its brackets
('fd77::2:7000' dials nothing) nor read as gRPC spells it ('ipv6:%5Bfd77::2%5D:51234', percent-encoded) without
decoding. Twins remain: bootstrap.parse_hostport (CLI flags, with UserError) and tls._split (TlsError).
tests/test_ipv6_netns.py runs a swarm whose hosts have IPv6 addresses alone.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import unquote

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def split_address(address: str) -> tuple[str, int]:
    """'host:port' / '[v6]:port' -> (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"not a host:port address: {address[:80]!r}")
    return host.strip("[]"), int(port)


def split_host(address: str) -> str:
    """The host of 'host:port' or '[v6]:port'; '' for anything that is not such an address."""
    try:
        return split_address(address)[0]
    except ValueError:
        return ""


def hostport(host: str, port: int | str) -> str:
    """(host, port) -> the address peers dial: '10.0.0.2:7000', '[fd77::2]:7000', 'peer.example:7000'."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def remote_ip(peer: str) -> IPAddress | None:
    """gRPC's `context.peer()` ('ipv4:1.2.3.4:5678', 'ipv6:%5B::1%5D:5678') -> the caller's address (IPv4 for an
    IPv4-mapped one); None for anything else (a unix socket)."""
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            host = unquote(peer[len(prefix) :]).rsplit(":", 1)[0].strip("[]")
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return None
            # an IPv4 caller of a dual-stack listener shows as ::ffff:a.b.c.d: it is the IPv4 host
            return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
    return None


def host_block(ip: IPAddress) -> str:
    """The unit one remote host is budgeted by: its IPv4 address, or the /64 around its IPv6 one. An ISP gives each
    subscriber a /64 or more, and a host picks addresses in it at will: budgets per single IPv6 address would cost an
    abuser nothing (and a new address per request could fill a table of budgets)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
