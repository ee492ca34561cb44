"""TCP congestion control for the slow-link bench's namespaces: which one a figure ran with, and which ones this
machine lets a namespace pick (bench/slowlink.py sets it per namespace; `python -m bench.wire --cc` chooses it)."""

from __future__ import annotations

import re
from pathlib import Path

CONGESTION = re.compile(r"^[a-z0-9_]{1,15}$")  # a kernel congestion-control name (TCP_CA_NAME_MAX is 16)
CC_SYSCTL = "net.ipv4.tcp_congestion_control"
CC_ALLOWED = "net.ipv4.tcp_allowed_congestion_control"


def check_congestion(name: object) -> str:
    """``name`` if it can be a kernel congestion-control name (cubic, bbr, reno...); ValueError otherwise, before any
    of it reaches a sysctl command line."""
    if not (isinstance(name, str) and CONGESTION.match(name)):
        raise ValueError(f"congestion must be a kernel congestion-control name such as cubic or bbr, got {name!r}")
    return name


def _sysctl(name: str) -> str | None:
    """This (root) namespace's value of sysctl `name`, from /proc; None where /proc does not say."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def host_congestion() -> str | None:
    """The machine's default TCP congestion control, which a namespace made with ``congestion=None`` inherits; None
    where /proc does not say."""
    return _sysctl(CC_SYSCTL)


def allowed_congestion() -> list[str]:
    """The congestion controls a namespace may pick for itself: in a container, root outside the machine's first user
    namespace may set only these (the kernel asks CAP_NET_ADMIN there for any other), even where
    tcp_available_congestion_control lists more. Empty where /proc does not say."""
    return (_sysctl(CC_ALLOWED) or "").split()
