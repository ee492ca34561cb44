"""Addresses and bootstrap dials: HOST:PORT checked up front, a free listen port, and a probe that tells "nothing
answers there" from "something answers, but it is not a peerd peer".

A mistyped address must fail at once with a line saying so, not after a minute of silent retries; an address where
an HTTP server (or any other service) listens will never become a peer, so it fails at once too. Only "no answer"
is retried (with backoff, until the join deadline): the peer may be starting or restarting.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket

from peerd import tls
from peerd.errors import UserError, os_reason

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame
PROBE_TIMEOUT_S = 3.0


class NoAnswer(OSError):
    """Nothing accepted a connection at the address (refused, unreachable, timed out). Worth retrying."""


class NotPeerd(Exception):
    """Something accepted the connection but did not answer as a peerd peer (plain HTTP, another TLS service...)."""


def parse_hostport(text: str, what: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); UserError naming `what` (e.g. '--listen') otherwise."""
    example = "HOST:PORT, e.g. 127.0.0.1:7000"
    host, sep, port_text = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise UserError(f"{what} {text!r} is not {example}")
    if not port_text.isdigit():
        raise UserError(f"{what} {text!r}: port {port_text!r} is not a number; use {example}")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise UserError(f"{what} {text!r}: port {port} is out of range ({low}..65535)")
    return host, port


def parse_bootstrap(spec: str) -> tuple[str | None, str]:
    """'PEERID@HOST:PORT' or 'HOST:PORT' -> (pinned peer id or None, 'host:port'), checked; UserError otherwise."""
    try:
        pinned, address = tls.parse_bootstrap(spec)
    except tls.TlsError as exc:
        raise UserError(f"--bootstrap {exc}") from exc
    parse_hostport(address, "--bootstrap")
    return pinned, address.strip()


def check_port_free(address: str, what: str = "--listen") -> None:
    """Bind the port once, without SO_REUSEPORT, to refuse a busy port with a clear line before gRPC (which would
    otherwise share it with the other listener) or the metrics server bind it. Port 0 is always free."""
    host, port = parse_hostport(address, what, allow_port_zero=True)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"{what} {address}: cannot resolve host {host!r} ({exc.strerror})") from exc
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what servers use: TIME_WAIT leftovers are fine
        try:
            s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"{what} {address}: address already in use (another peerd or service listens there); "
                    "stop it or pick another port"
                ) from exc
            raise UserError(f"{what} {address}: cannot listen there ({os_reason(exc)})") from exc


def backoff_s(attempt: int) -> float:
    """0.5 s, 1 s, 2 s, 4 s, then 5 s between bootstrap attempts, with jitter so restarts do not synchronise."""
    return min(0.5 * 2**attempt, 5.0) * random.uniform(0.8, 1.2)


async def _connect(address: str, timeout: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = parse_hostport(address, "address")
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else os_reason(exc)
        raise NoAnswer(f"no answer ({reason})") from exc


async def classify(address: str, *, secure: bool, timeout: float = PROBE_TIMEOUT_S) -> None:
    """After a dial failed: raise NoAnswer when nothing accepts connections at `address`, NotPeerd when something
    does but does not speak gRPC the way a peer does (HTTP/2 with TLS, or plaintext HTTP/2 with --insecure).
    Returns when it looks like a gRPC server (the failure was something else: retry)."""
    reader, writer = await _connect(address, timeout)
    try:
        if secure:  # a peer would have completed the TLS handshake the caller tried: this is something else
            raise NotPeerd("accepted the connection but did not complete a TLS handshake")
        writer.write(H2_PREFACE + H2_SETTINGS)
        try:
            head = await asyncio.wait_for(reader.read(9), timeout)
        except (OSError, TimeoutError):
            head = b""
        if len(head) < 4 or head[3] != 0x04:  # an HTTP/2 server's first frame is SETTINGS (type 4)
            shown = head.split(b"\r\n")[0].decode("ascii", "replace") if head else "nothing"
            raise NotPeerd(f"it answered {shown!r}, not HTTP/2 as a gRPC server would")
    finally:
        writer.close()


async def fetch_cert(address: str, timeout: float = 5.0) -> bytes:
    """tls.fetch_cert with its failures sorted into NoAnswer (retry) and NotPeerd (give up)."""
    try:
        cert = await tls.fetch_cert(address, timeout=timeout)
    except tls.TlsError as exc:
        raise NotPeerd(str(exc)) from exc
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        await classify(address, secure=True, timeout=timeout)
        raise NoAnswer("no answer (TLS handshake failed)") from None
    try:
        tls.verify_cert(cert)
    except tls.TlsError as exc:
        raise NotPeerd(f"presented a certificate that is not a peerd peer's ({exc})") from exc
    return cert


def unspecified(address: str) -> bool:
    """Is `address` a wildcard (0.0.0.0, ::, or no host), i.e. not yet an address others could dial?"""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("", "0.0.0.0", "::")
