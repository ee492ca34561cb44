"""Link faults on a slow-link net: cut a host off, split the hosts into groups, refuse inbound connections.

Split-brain healing and peers behind NAT can only be tested against faults a real network makes, so
:class:`FaultNet` is a :class:`~bench.slowlink.SlowLinkNet` whose links can also fail. Everything is done with
iproute2 (``ip``, ``tc``) in the namespaces the net already owns, with no firewall tools, and without the two
obvious features, which kernels such as this repository's test machines' lack: bridge VLAN filtering and tc's drop
action (``act_gact``). So:

* :meth:`FaultNet.cut` sets the hub-side end of the host's veth down. The host loses carrier: its frames and the
  frames sent to it are dropped silently, so open TCP connections stall and retransmit instead of being reset, as
  across a real outage. Addresses, routes (marked ``linkdown``) and tbf shaping stay configured, so
  :meth:`FaultNet.restore` only has to bring the link up again.
* :meth:`FaultNet.partition` moves each group's hub-side ports onto a bridge of its own (the first group stays on
  the main bridge). Bridges are not joined, so a group talks within itself and to nobody else; again no RST.
* :meth:`FaultNet.block_inbound` drops TCP SYNs (SYN set, ACK clear) as they arrive at the host: an ingress u32
  filter redirects them (``mirred``) to a veth whose peer is down, which discards them. The host's own SYNs go
  out and the SYN-ACKs come back, so it can dial out but cannot be dialed: a peer behind NAT.
* :meth:`FaultNet.block_between` drops every packet between two hosts, each at its own ingress, with the same
  redirect: both reach everyone else, but not each other. Reachability on the internet is not transitive (a broken
  route, a firewall rule, two NATs), and a partition into groups cannot make that shape.
* :meth:`FaultNet.blackhole_between` is that block with higher-priority filters in front of it which let packets
  under ``max_bytes`` through (u32 matches on the IP total length that only classify, as ``act_gact`` is absent):
  a path MTU blackhole, as a tunnel whose ICMP "fragmentation needed" is filtered makes. Handshakes and small calls
  pass; full-size segments of bulk transfers are dropped.

All of these work on an IPv6 net too (an IPv6 ``subnet``; the filters match ``ip6``), except
:meth:`FaultNet.blackhole_between`, which matches IPv4's total length.

The faults are independent of each other and of the rate shaping (``set_rate``, ``set_down_rate``): a host can
be shaped asymmetrically, behind "NAT" and in one group of a partition at once.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Sequence

from bench.slowlink import _BRIDGE, _HOST_IF, SlowLinkError, SlowLinkNet, _exec

__all__ = ["FaultNet"]

_SINK = "synsink"  # in a host namespace: the veth inbound SYNs are redirected to; its peer stays down
_SINK_PEER = "synsink1"
_CARRIER_WAIT = 5.0

# IPv4 (IHL 5, no options: peerd's stacks send none) carrying TCP whose flags byte (offset 20 + 13) has SYN set and
# ACK clear. A SYN with IP options would slip through; nothing on these nets sends one.
_SYN_MATCH = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
              "match", "u8", "0x02", "0x12", "at", "33"]  # fmt: skip
# The same for IPv6 with TCP as the next header (no extension headers; the fixed header is 40 bytes): flags at 53.
_SYN_MATCH6 = ["match", "ip6", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12", "at", "53"]


class FaultNet(SlowLinkNet):
    """A SlowLinkNet whose hosts can be cut off, partitioned into groups and made undialable (see module doc)."""

    def __init__(self, n_hosts: int, rate_mbit: float | list[float], **kw: object) -> None:
        super().__init__(n_hosts, rate_mbit, **kw)  # type: ignore[arg-type]
        self._cut: set[int] = set()
        self._blocked: set[int] = set()
        self._pairs: set[tuple[int, int]] = set()  # (host, source host) whose packets the host drops
        self._small: set[tuple[int, int]] = set()  # of those, pairs whose small packets pass (blackhole_between)
        self._bridge_of: list[str | None] = [_BRIDGE] * n_hosts  # None: on no bridge (alone)
        self._extra_bridges: list[str] = []

    def _port(self, i: int) -> str:
        return f"p{self._host(i)}"

    def _hub_ip(self, *args: str) -> None:
        _exec([self._ip, "-n", self._hub, *args])

    # ----------------------------------------------------------------- cut
    def cut(self, i: int) -> None:
        """Take host ``i``'s link down: nothing gets in or out, and open connections stall (no RST)."""
        self._require_up()
        self._hub_ip("link", "set", self._port(i), "down")
        self._cut.add(i)

    def restore(self, i: int) -> None:
        """Bring host ``i``'s link back up and return once the host sees carrier again, so traffic flows.

        The host's connected route is re-asserted too: the kernel keeps it through a loss of carrier, so this is
        normally a no-op, but a route gone missing would otherwise leave the host silently unreachable.
        """
        self._require_up()
        self._hub_ip("link", "set", self._port(i), "up")
        ns = self.netns(i)
        deadline = time.monotonic() + _CARRIER_WAIT
        while "LOWER_UP" not in self._flags(ns, _HOST_IF):
            if time.monotonic() > deadline:
                raise SlowLinkError(f"host {i}'s link has no carrier {_CARRIER_WAIT:g} s after restore")
            time.sleep(0.01)
        if self.ipv6:
            _exec([self._ip, "-n", ns, "-6", "route", "replace", str(self._network), "dev", _HOST_IF, "proto",
                   "kernel", "metric", "256"])  # fmt: skip
        else:
            _exec([self._ip, "-n", ns, "route", "replace", str(self._network), "dev", _HOST_IF, "proto", "kernel",
                   "scope", "link", "src", self.address(i)])  # fmt: skip
        self._cut.discard(i)

    def is_cut(self, i: int) -> bool:
        return self._host(i) in self._cut

    def _flags(self, ns: str, dev: str) -> list[str]:
        done = _exec([self._ip, "-n", ns, "-j", "link", "show", "dev", dev])
        try:
            return list(json.loads(done.stdout)[0]["flags"])
        except (ValueError, LookupError, TypeError) as exc:
            raise SlowLinkError(f"unexpected `ip -j link` output for {dev} in {ns}: {exc}") from exc

    # ----------------------------------------------------------- partition
    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Split the hosts into ``groups`` that reach only each other; a host in no group reaches nobody.

        Replaces any earlier partition. Hosts keep their addresses, so healing later needs no reconfiguration.
        """
        self._require_up()
        target: list[str | None] = [None] * self._n
        seen: set[int] = set()
        if isinstance(groups, (str, bytes)) or not all(isinstance(g, (list, tuple)) and g for g in groups):
            raise ValueError("groups must be a list of non-empty lists of host indices")
        for g, group in enumerate(groups):
            for i in group:
                if self._host(i) in seen:
                    raise ValueError(f"host {i} is in more than one group")
                seen.add(i)
                target[i] = _BRIDGE if g == 0 else self._bridge(g)
        self._move(target)

    def heal(self) -> None:
        """Undo :meth:`partition`: every host is on the main bridge again (cut hosts stay cut until restored)."""
        self._require_up()
        self._move([_BRIDGE] * self._n)
        for bridge in self._extra_bridges:
            self._hub_ip("link", "del", bridge)
        self._extra_bridges.clear()

    def groups(self) -> list[list[int]]:
        """The current groups, main bridge's first (hosts on no bridge are left out); one group when whole."""
        bridges = [_BRIDGE, *self._extra_bridges]
        found = [[i for i, b in enumerate(self._bridge_of) if b == bridge] for bridge in bridges]
        return [g for g in found if g]

    def _bridge(self, g: int) -> str:
        """The hub bridge of group ``g`` > 0, made on first use with the main bridge's settings."""
        name = f"part{g}"
        if name not in self._extra_bridges:
            self._hub_ip("link", "add", name, "type", "bridge", "stp_state", "0", "mcast_snooping", "0")
            self._hub_ip("link", "set", name, "up")
            self._extra_bridges.append(name)
        return name

    def _move(self, target: list[str | None]) -> None:
        # Without STP a port forwards as soon as it is enslaved, so a move takes effect at once.
        for i, bridge in enumerate(target):
            if bridge == self._bridge_of[i]:
                continue
            if bridge is None:
                self._hub_ip("link", "set", self._port(i), "nomaster")
            else:
                self._hub_ip("link", "set", self._port(i), "master", bridge)
            self._bridge_of[i] = bridge

    # ------------------------------------------------------------- inbound
    def block_inbound(self, i: int) -> None:
        """Drop TCP connection attempts arriving at host ``i``; it can still dial out (a peer behind NAT).

        Only SYNs without ACK are dropped, so connections that are already open keep working, as a NAT keeps
        the mappings it has.
        """
        self._require_up()
        if self._host(i) in self._blocked:
            return
        self._drop_at(i, "1", _SYN_MATCH6 if self.ipv6 else _SYN_MATCH)
        self._blocked.add(i)

    def _drop_at(self, i: int, prio: str, match: list[str]) -> None:
        """Add an ingress filter at host ``i`` that sends what ``match`` selects to the sink, which drops it."""
        ns = self.netns(i)
        if not _exec([self._ip, "-n", ns, "link", "show", "dev", _SINK], check=False).stdout:
            _exec([self._ip, "-n", ns, "link", "add", _SINK, "type", "veth", "peer", "name", _SINK_PEER])
            _exec([self._ip, "-n", ns, "link", "set", _SINK, "up"])  # its peer stays down: what it sends is dropped
        fresh = not self._filters(i)
        if fresh:
            _exec([self._tc, "-n", ns, "qdisc", "add", "dev", _HOST_IF, "handle", "ffff:", "ingress"])
        try:
            _exec([self._tc, "-n", ns, "filter", "add", "dev", _HOST_IF, "parent", "ffff:", "protocol", self._proto,
                   "prio", prio, "u32", *match, "action", "mirred", "egress", "redirect", "dev",
                   _SINK])  # fmt: skip
        except SlowLinkError:  # no u32 or mirred in this kernel: leave no half-made block behind
            if fresh:
                _exec([self._tc, "-n", ns, "qdisc", "del", "dev", _HOST_IF, "ingress"], check=False)
            raise

    @property
    def _proto(self) -> str:
        """The ethertype tc filters match on this net."""
        return "ipv6" if self.ipv6 else "ip"

    def _undrop_at(self, i: int, prio: str) -> None:
        """Remove host ``i``'s ingress filter of ``prio``, and the ingress qdisc with its last filter."""
        ns = self.netns(i)
        _exec([self._tc, "-n", ns, "filter", "del", "dev", _HOST_IF, "parent", "ffff:", "prio", prio], check=False)
        if not self._filters(i):
            _exec([self._tc, "-n", ns, "qdisc", "del", "dev", _HOST_IF, "ingress"], check=False)

    def _filters(self, i: int) -> int:
        """How many of this net's drop rules host ``i`` has (the NAT block and one per blocked pair)."""
        return (self._host(i) in self._blocked) + sum(1 for host, _ in self._pairs if host == self._host(i))

    def unblock_inbound(self, i: int) -> None:
        """Let host ``i`` be dialed again."""
        self._require_up()
        if self._host(i) not in self._blocked:
            return
        self._blocked.discard(i)
        self._undrop_at(i, "1")

    def is_blocked(self, i: int) -> bool:
        return self._host(i) in self._blocked

    # --------------------------------------------------------------- pairs
    def block_between(self, i: int, j: int) -> None:
        """Drop every packet between hosts ``i`` and ``j``, both ways; open connections stall (no RST). Both still
        reach every other host."""
        self._require_up()
        if self._host(i) == self._host(j):
            raise ValueError(f"host {i} cannot be blocked from itself")
        for a, b in ((i, j), (j, i)):
            if (self._host(a), self._host(b)) in self._pairs:
                continue
            src = (
                ["match", "ip6", "src", f"{self.address(b)}/128"]
                if self.ipv6
                else ["match", "ip", "src", f"{self.address(b)}/32"]
            )
            self._drop_at(a, str(10 + self._host(b)), src)
            self._pairs.add((self._host(a), self._host(b)))

    def unblock_between(self, i: int, j: int) -> None:
        """Let hosts ``i`` and ``j`` reach each other again (and undo :meth:`blackhole_between`)."""
        self._require_up()
        for a, b in ((i, j), (j, i)):
            if (self._host(a), self._host(b)) in self._pairs:
                self._pairs.discard((self._host(a), self._host(b)))
                self._undrop_at(a, str(10 + self._host(b)))
                if (self._host(a), self._host(b)) in self._small:
                    self._small.discard((self._host(a), self._host(b)))
                    _exec([self._tc, "-n", self.netns(a), "filter", "del", "dev", _HOST_IF, "parent", "ffff:", "prio",
                           str(2 + self._host(b))], check=False)  # fmt: skip

    def blackhole_between(self, i: int, j: int, max_bytes: int = 1280) -> None:
        """Between hosts ``i`` and ``j``, both ways, pass IP packets shorter than ``max_bytes`` (a multiple of 256) and
        drop the rest: TCP and TLS handshakes and small calls work, full-size segments vanish (a path MTU
        blackhole; 1280 is the IPv6 minimum MTU, as tunnels that lose "fragmentation needed" often are)."""
        if max_bytes % 256 or not 256 <= max_bytes <= 32768:
            raise ValueError(f"max_bytes must be a multiple of 256 in [256, 32768], not {max_bytes}")
        if self.ipv6:
            raise ValueError("blackhole_between matches the IPv4 total length: use it on an IPv4 net")
        if max(self._host(i), self._host(j)) > 7:
            raise ValueError("blackhole_between takes hosts 0-7 (one filter priority per source host below the drop)")
        self.block_between(i, j)
        for a, b in ((i, j), (j, i)):
            if (self._host(a), self._host(b)) in self._small:
                continue
            # Classify without an action: the packet leaves the filter chain before the drop and is let through.
            for value, mask in _aligned_blocks(max_bytes):  # u32 matches masked bits, so cover [0, max) in blocks
                _exec([self._tc, "-n", self.netns(a), "filter", "add", "dev", _HOST_IF, "parent", "ffff:", "protocol",
                       "ip", "prio", str(2 + self._host(b)), "u32", "match", "ip", "src", f"{self.address(b)}/32",
                       "match", "u16", f"0x{value:04x}", f"0x{mask:04x}", "at", "2", "flowid", "ffff:1"])  # fmt: skip
            self._small.add((self._host(a), self._host(b)))

    # ------------------------------------------------------------ renumber
    def renumber(self, i: int, address: str) -> None:
        """Give host ``i`` a new address in the net's subnet and drop its old one, as an ISP's new DHCP lease or a
        laptop moving networks does: open connections from the old address die, and the old address answers nobody.
        Call it before any block that names host ``i`` (the filters match addresses)."""
        self._require_up()
        new = ipaddress.ip_address(address)
        if new not in self._network or new in (self._network.network_address, self._network.broadcast_address):
            raise ValueError(f"{address} is not a host address in {self._network}")
        if str(new) in self._addresses:
            raise ValueError(f"{address} is already a host's address")
        if any(self._host(i) in pair for pair in self._pairs) or self._host(i) in self._blocked:
            raise ValueError(f"host {i} has blocks naming its address: renumber it before blocking")
        ns = self.netns(i)
        _exec([self._ip, "-n", ns, "addr", "flush", "dev", _HOST_IF])
        nodad = ["nodad"] if self.ipv6 else []
        _exec([self._ip, "-n", ns, "addr", "add", f"{new}/{self._network.prefixlen}", "dev", _HOST_IF, *nodad])
        self._addresses[self._host(i)] = str(new)

    def syns_dropped(self, i: int) -> int:
        """How many inbound SYNs host ``i``'s block has dropped (so a test can check it was exercised)."""
        return self._dropped(i, "1") if self._host(i) in self._blocked else 0

    def dropped_between(self, i: int, j: int) -> int:
        """How many packets from ``j`` host ``i`` has dropped since :meth:`block_between`."""
        blocked = (self._host(i), self._host(j)) in self._pairs
        return self._dropped(i, str(10 + self._host(j))) if blocked else 0

    def _dropped(self, i: int, prio: str) -> int:
        self._require_up()
        done = _exec([self._tc, "-n", self.netns(i), "-s", "-j", "filter", "show", "dev", _HOST_IF, "parent", "ffff:",
                      "prio", prio])  # fmt: skip
        try:
            entries = json.loads(done.stdout)
            actions = [a for e in entries for a in e.get("options", {}).get("actions", [])]
            return sum(int(a["stats"]["packets"]) for a in actions if a.get("kind") == "mirred")
        except (ValueError, LookupError, TypeError, AttributeError) as exc:
            raise SlowLinkError(f"unexpected `tc -j filter` output on host {i}: {exc}") from exc


def _aligned_blocks(limit: int) -> list[tuple[int, int]]:
    """[0, limit) as (value, mask) pairs of the IP total length, each a power-of-two block aligned to its size."""
    blocks, start = [], 0
    while start < limit:
        size = 1 << 15
        while start % size or start + size > limit:
            size >>= 1
        blocks.append((start, 0xFFFF & ~(size - 1)))
        start += size
    return blocks
