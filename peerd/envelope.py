"""Signed request envelopes: every request names its run and sender, carries a timestamp and nonce, and is signed.

The signature covers a domain tag, the RPC method name and the deterministic serialization of the message with
`auth.signature` cleared. Binding the method name stops a signed Gossip from being replayed as, say, a Leave.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from peerd.identity import Identity, peer_id_of, verify
from peerd.swarmclock import CLOCK

DOMAIN = b"peerd.v1\x00"
MAX_CLOCK_SKEW_S = 300.0

# Admission proofs by signing key (peerd/admission.py). Every request and stream header is signed through `sign`,
# including by modules that know nothing of admission, so the proof is attached here, in one place.
_PROVERS: dict[bytes, Callable[[Any], bytes]] = {}


def set_admission_prover(public_key: bytes, prover: Callable[[Any], bytes] | None) -> None:
    """Make `sign` fill `auth.admission` with `prover(auth)` for messages signed by `public_key` (None: stop)."""
    if prover is None:
        _PROVERS.pop(public_key, None)
    else:
        _PROVERS[public_key] = prover


class AuthError(ValueError):
    """A request whose envelope is missing, forged, stale, replayed or for another run. `reason` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def signed_bytes(method: str, msg: Message) -> bytes:
    """The exact bytes a request's signature covers."""
    sig = msg.auth.signature
    msg.auth.signature = b""
    try:
        body = msg.SerializeToString(deterministic=True)
    finally:
        msg.auth.signature = sig
    return DOMAIN + method.encode() + b"\x00" + body


def sign(msg: Message, method: str, identity: Identity, run_id: bytes, admission: bytes = b"") -> Message:
    """Fill `msg.auth` and sign it in place; returns msg for chaining."""
    auth = msg.auth
    auth.run_id = run_id
    auth.public_key = identity.public_key
    auth.timestamp_ms = int(CLOCK.now() * 1000)
    auth.nonce = os.urandom(16)
    prover = None if admission else _PROVERS.get(identity.public_key)
    auth.admission = prover(auth) if prover is not None else admission
    auth.signature = b""
    auth.signature = identity.sign(signed_bytes(method, msg))
    return msg


class ReplayGuard:
    """Remembers recent nonces so a captured request cannot be sent again while it is still fresh."""

    def __init__(self, window_s: float = MAX_CLOCK_SKEW_S, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, nonce: bytes, now: float) -> bool:
        """True (and remember) if the nonce is new; False for a replay."""
        while self._seen:
            oldest, expiry = next(iter(self._seen.items()))
            if expiry > now and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now + 2 * self.window_s
        return True


class Verifier:
    """Checks envelopes for one run; returns the sender's peer id."""

    def __init__(self, run_id: bytes, max_skew_s: float = MAX_CLOCK_SKEW_S) -> None:
        self.run_id = run_id
        self.max_skew_s = max_skew_s
        self.replay = ReplayGuard(max_skew_s)
        # Admission and bans (set by the daemon): raises AuthError for a key that may not speak in this run. It runs
        # before the signature check so a refused key costs no Ed25519 verification.
        self.gate: Callable[[Any], None] | None = None

    def verify(self, method: str, msg: Message, *, check_run: bool = True) -> str:
        if not msg.HasField("auth"):
            raise AuthError("unsigned", f"{method}: request carries no auth envelope")
        auth = msg.auth
        if len(auth.public_key) != 32 or len(auth.signature) != 64 or len(auth.nonce) != 16:
            raise AuthError("malformed", f"{method}: malformed auth envelope")
        if check_run and auth.run_id != self.run_id:
            raise AuthError("wrong_run", f"{method}: request is for another run")
        if check_run and self.gate is not None:
            self.gate(auth)
        if not verify(auth.public_key, auth.signature, signed_bytes(method, msg)):
            raise AuthError("bad_signature", f"{method}: signature does not match the sender's key")
        now = CLOCK.now()
        skew = auth.timestamp_ms / 1000.0 - now
        if abs(skew) > self.max_skew_s:
            where = "ahead of" if skew > 0 else "behind"
            raise AuthError(
                "stale",
                f"{method}: timestamp is {abs(skew):.0f} s {where} this peer's clock (at most {self.max_skew_s:.0f} s "
                "is accepted): one of the two clocks is wrong",
            )
        if not self.replay.check(auth.nonce, now):
            raise AuthError("replay", f"{method}: nonce was already used (replayed request)")
        return peer_id_of(auth.public_key)
