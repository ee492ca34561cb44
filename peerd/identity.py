"""A peer's Ed25519 identity: created at first start, kept with mode 0600, and the source of the peer id."""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_FILE = "identity.key"
# Gossip checks every entry it merges: at 64 peers that is dozens of ids and keys a second per daemon, the same few
# dozen over and over. Parsing each key anew was 1% of a daemon's CPU (py-spy, bench.scale 64 peers): keep them.
KNOWN_KEYS = 4096


class IdentityError(ValueError):
    """The key file is unusable or unsafe."""


def peer_id_of(public_key: bytes) -> str:
    """Peer ids are the first 16 bytes of SHA-256 of the raw public key, in hex: short, and bound to the key."""
    if len(public_key) != 32:
        raise IdentityError("an Ed25519 public key is 32 bytes")
    return _peer_id(bytes(public_key))


@functools.lru_cache(maxsize=KNOWN_KEYS)
def _peer_id(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:32]


@functools.lru_cache(maxsize=KNOWN_KEYS)
def _public_key(public_key: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(public_key)  # raises ValueError on a bad key: never cached


class Identity:
    """A private key plus the derived public key and peer id."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: str = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: str | Path) -> Identity:
        """Load DATA_DIR/identity.key, creating it (mode 0600) on first start.

        Refuses a key file that group or others can read: a leaked key lets anyone speak as this peer.
        """
        path = Path(data_dir) / KEY_FILE
        if path.exists():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o077:
                raise IdentityError(
                    f"{path} has mode {mode:04o}; it must not be readable by group or others (chmod 600 {path})"
                )
            raw = path.read_bytes()
            if len(raw) != 32:
                raise IdentityError(f"{path} is not a 32-byte Ed25519 private key")
            return cls(Ed25519PrivateKey.from_private_bytes(raw))
        path.parent.mkdir(parents=True, exist_ok=True)
        ident = cls.generate()
        raw = ident._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path.with_suffix(".tmp"), path)
        return ident

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._key


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when `signature` is `public_key`'s signature of `data`; never raises on malformed input."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        _public_key(bytes(public_key)).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True
