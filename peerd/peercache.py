"""Remembered peers: the dialable members of this run, kept in the data dir, so a restarted peer can rejoin through
any of them when its own bootstrap address has left (like a libp2p peerstore, or hivemind's initial peers).

The file is JSON, never pickle, size-checked before it is parsed, and every entry is validated: it is written by
this daemon, but a data dir may be copied around. With TLS each address is pinned to the peer id seen there
("PEERID@host:port"), so a cached address that now holds another peer is refused, never trusted on first use.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

from peerd.datadir import write_atomic
from peerd.v1 import peerd_pb2 as pb

log = logging.getLogger("peerd")

FILE = "known_peers.json"
MAX_PEERS = 32  # enough to find one live member after heavy churn; more only makes a dead run slower to give up on
MAX_BYTES = 64 * 1024
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]{3,100}:[0-9]{1,5}$")
_PEER_ID = re.compile(r"^[0-9a-f]{32}$")


def save(data_dir: Path, run_id: bytes, peers: Iterable[pb.PeerInfo]) -> list[str]:
    """Write the addresses of `peers` (live, dialable members) for `run_id`; returns the addresses written."""
    entries = [{"peer_id": p.peer_id, "address": p.address} for p in peers if _valid(p.peer_id, p.address)]
    entries = entries[:MAX_PEERS]
    write_atomic(data_dir / FILE, json.dumps({"run_id": run_id.hex(), "peers": entries}, indent=1))
    return [e["address"] for e in entries]


def load(data_dir: Path, run_id: bytes, pinned: bool) -> list[str]:
    """Bootstrap specs remembered for `run_id` ("PEERID@host:port" when `pinned`, else "host:port"). A missing,
    oversized, damaged or other run's file gives none, with one line saying why (never an error: the cache only
    adds addresses to try)."""
    path = data_dir / FILE
    try:
        if path.stat().st_size > MAX_BYTES:
            log.warning("%s is over %d bytes: ignoring it (delete it to silence this)", path, MAX_BYTES)
            return []
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): ignoring it; delete it to silence this", path, exc)
        return []
    if not isinstance(raw, dict) or raw.get("run_id") != run_id.hex() or not isinstance(raw.get("peers"), list):
        return []  # another run's peers (a data dir reused with a new spec): not ours to dial
    specs = []
    for e in raw["peers"][:MAX_PEERS]:
        if isinstance(e, dict) and _valid(e.get("peer_id"), e.get("address")):
            specs.append(f"{e['peer_id']}@{e['address']}" if pinned else e["address"])
    return specs


def _valid(peer_id: object, address: object) -> bool:
    return (
        isinstance(peer_id, str)
        and isinstance(address, str)
        and bool(_PEER_ID.match(peer_id))
        and bool(_ADDRESS.match(address))
        and not address.startswith(("0.0.0.0:", "[::]:"))
    )
