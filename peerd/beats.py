"""Heartbeat hash chains: a heartbeat advance is proven with a hash, not a fresh signature.

Every gossip entry is signed by the peer it describes, so a relay cannot forge or revive it. Before wire revision 12
the heartbeat was inside the signature: each advance (one a second per peer) carried a new Ed25519 signature, and
every receiver checked one per entry it merged. At 64 daemons on 2 cores that check was 9% of each daemon's CPU, the
largest single cost, and the crunches where gossip falls behind and live peers are counted lost are CPU crunches.

So a peer signs its entry once per chain with the heartbeat left out, and proves each advance the S/KEY way: it
draws a random seed and hashes it CHAIN_LEN times; the top (the anchor) goes under the signature, with `beat_base`,
the heartbeat the top stands for. At heartbeat `beat_base + j` it reveals the value j hashes below the top
(`beat_proof`). The anchor itself is not sent: hashing the proof j times gives it, and the signature only checks out
with the right one. From a value already checked, the next one takes a hash or two. Only the subject knows values
below what it revealed, so nobody can advance its heartbeat; an old value is an old heartbeat, which gossip ignores
anyway. A chain runs out after CHAIN_LEN heartbeats and the peer signs a new one. The fields cost 23 bytes an entry.
"""

from __future__ import annotations

import hashlib
import os

BEAT_DOMAIN = b"peerd/beat/v1"
VALUE_BYTES = 16  # 128-bit preimage resistance for a chain that lives about a minute
CHAIN_LEN = 64  # heartbeats one signature covers (one a gossip interval: about a minute at the default 1 s)
MAX_STEPS = 256  # the most hashes a receiver spends on one proof; a longer claim is refused as forged


def beat_hash(value: bytes) -> bytes:
    return hashlib.sha256(BEAT_DOMAIN + value).digest()[:VALUE_BYTES]


def hash_up(value: bytes, steps: int) -> bytes | None:
    """`value` hashed `steps` times, or None for a value of the wrong size or 0 <= steps <= MAX_STEPS not holding."""
    if not 0 <= steps <= MAX_STEPS or len(value) != VALUE_BYTES:
        return None
    for _ in range(steps):
        value = beat_hash(value)
    return value


def hashes_to(value: bytes, steps: int, target: bytes) -> bool:
    """Whether hashing `value` `steps` times (0 <= steps <= MAX_STEPS) gives `target`."""
    return len(target) == VALUE_BYTES and hash_up(value, steps) == target


class BeatChain:
    """The signer's side: one chain from a fresh random seed, standing for heartbeats base .. base + CHAIN_LEN."""

    def __init__(self, base: int, length: int = CHAIN_LEN) -> None:
        values = [os.urandom(VALUE_BYTES)]
        for _ in range(length):
            values.append(beat_hash(values[-1]))
        self.base = base
        self._values = values  # values[i] is i hashes above the seed; the top is the anchor

    @property
    def anchor(self) -> bytes:
        return self._values[-1]

    def covers(self, heartbeat: int) -> bool:
        return 0 <= heartbeat - self.base < len(self._values)

    def proof(self, heartbeat: int) -> bytes:
        """The value that hashes to the anchor in heartbeat - base steps (the caller checks `covers` first)."""
        return self._values[len(self._values) - 1 - (heartbeat - self.base)]
