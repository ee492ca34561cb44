"""Admission control: which keys may take part in a run.

Modes (``[admission] mode`` in the run spec, so every peer of a run enforces the same one):

* ``open``: any key with the right run spec.
* ``secret``: peers share a join secret (a local file, never in the spec). Every signed request carries
  HMAC-SHA256(secret, run id | sender key | timestamp | nonce) in ``Auth.admission``; the secret itself never goes
  on the wire, and each proof is bound to one nonce, so a captured proof cannot be reused.
* ``allowlist``: the spec lists the admitted Ed25519 public keys (hex).
* ``invite``: the spec names the run owner's public key; the owner signs invitations naming a peer key and an
  expiry (``peerd invite``), and a peer attaches its invitation to every request.

Proofs ride on every request (envelope.sign attaches them through :func:`peerd.envelope.set_admission_prover`), so
a peer that learned of another through gossip can check it without ever having seen its Join.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peerd.identity import peer_id_of, verify
from peerd.v1 import peerd_pb2 as pb

if TYPE_CHECKING:
    from peerd.config import RunConfig

MODES = ("open", "secret", "allowlist", "invite")
SECRET_DOMAIN = b"peerd-join-secret-v1\x00"
INVITE_DOMAIN = b"peerd-invite-v1\x00"
INVITE_MAGIC = b"PDI1"
INVITE_BYTES = len(INVITE_MAGIC) + 32 + 8 + 64
MIN_SECRET_BYTES = 16
MAX_FILE_BYTES = 64 * 1024


class AdmissionError(ValueError):
    """A key that is not admitted to the run, or an unusable secret/invite/owner-key file. `reason` is a label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# -- files --------------------------------------------------------------------------------------------------------
def read_private_file(path: str | Path, what: str) -> bytes:
    """Read a secret file, refusing one that group or others can read (as identity.key is refused)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError as exc:
        raise AdmissionError("config", f"{what} {p} does not exist") from exc
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise AdmissionError(
            "config", f"{what} {p} has mode {mode:04o}; it must not be readable by group or others (chmod 600 {p})"
        )
    if st.st_size > MAX_FILE_BYTES:
        raise AdmissionError("config", f"{what} {p} is larger than {MAX_FILE_BYTES} bytes")
    return p.read_bytes()


def write_private_file(path: str | Path, data: bytes) -> None:
    """Create a file with mode 0600 (never overwriting one), written in full before it appears."""
    p = Path(path)
    if p.exists():
        raise AdmissionError("config", f"{p} already exists; not overwriting it")
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)


def load_join_secret(path: str | Path) -> bytes:
    secret = read_private_file(path, "join secret file").strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise AdmissionError("config", f"join secret in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def create_owner_key(path: str | Path) -> bytes:
    """Make a run owner key (hex, mode 0600); returns its public key, the value for ``[admission] owner_key``."""
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    write_private_file(path, raw.hex().encode() + b"\n")
    return _public(key)


def load_owner_key(path: str | Path) -> Ed25519PrivateKey:
    text = read_private_file(path, "owner key file").strip()
    try:
        raw = bytes.fromhex(text.decode())
    except (UnicodeDecodeError, ValueError):
        raw = b""
    if len(raw) != 32:
        raise AdmissionError("config", f"{path} is not a hex Ed25519 private key (see `peerd owner-key`)")
    return Ed25519PrivateKey.from_private_bytes(raw)


def _public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def parse_hex_key(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise AdmissionError("config", f"{what} must be a 64-hex-digit Ed25519 public key, got {text!r}")
    return raw


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s' or plain seconds -> seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise AdmissionError("config", f"cannot read duration {text!r} (use e.g. 7d, 12h, 30m, 90s)")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}[m.group(2)]
    return float(m.group(1)) * unit


# -- invitations --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Invite:
    """The owner's signature over (owner key, peer key, expiry): lets exactly that peer key in until then."""

    peer_key: bytes
    expires: int  # unix seconds
    signature: bytes

    @staticmethod
    def signed_bytes(owner_key: bytes, peer_key: bytes, expires: int) -> bytes:
        return INVITE_DOMAIN + owner_key + peer_key + struct.pack(">q", expires)

    @classmethod
    def issue(cls, owner: Ed25519PrivateKey, peer_key: bytes, expires: int) -> Invite:
        if len(peer_key) != 32:
            raise AdmissionError("config", "an invitation names a 32-byte Ed25519 public key")
        return cls(peer_key, int(expires), owner.sign(cls.signed_bytes(_public(owner), peer_key, int(expires))))

    def encode(self) -> bytes:
        return INVITE_MAGIC + self.peer_key + struct.pack(">q", self.expires) + self.signature

    @classmethod
    def decode(cls, blob: bytes) -> Invite:
        if len(blob) != INVITE_BYTES or not blob.startswith(INVITE_MAGIC):
            raise AdmissionError("not_admitted", "malformed invitation")
        off = len(INVITE_MAGIC)
        (expires,) = struct.unpack(">q", blob[off + 32 : off + 40])
        return cls(blob[off : off + 32], expires, blob[off + 40 :])

    def check(self, owner_key: bytes, peer_key: bytes, now: float) -> None:
        if self.peer_key != peer_key:
            raise AdmissionError("not_admitted", "the invitation names another peer's key")
        if not verify(owner_key, self.signature, self.signed_bytes(owner_key, self.peer_key, self.expires)):
            raise AdmissionError("not_admitted", "the invitation is not signed by this run's owner")
        if now > self.expires:
            raise AdmissionError("not_admitted", "the invitation has expired")

    def to_text(self) -> str:
        return self.encode().hex() + "\n"

    @classmethod
    def from_text(cls, text: bytes | str) -> Invite:
        raw = text.decode(errors="replace") if isinstance(text, bytes) else text
        try:
            return cls.decode(bytes.fromhex(raw.strip()))
        except ValueError as exc:
            raise AdmissionError("config", f"invitation is not valid hex: {exc}") from exc


def load_invite(path: str | Path) -> Invite:
    return Invite.from_text(read_private_file(path, "invite file"))


# -- the policy ---------------------------------------------------------------------------------------------------
def secret_proof(secret: bytes, auth: pb.Auth) -> bytes:
    """HMAC of the request's identifying fields: proves the secret without revealing it, valid for one nonce."""
    msg = SECRET_DOMAIN + auth.run_id + auth.public_key + struct.pack(">q", auth.timestamp_ms) + auth.nonce
    return hmac.new(secret, msg, hashlib.sha256).digest()


class Admission:
    """One run's admission policy plus this peer's own proof material (secret or invitation)."""

    def __init__(
        self,
        mode: str = "open",
        *,
        secret: bytes = b"",
        allowlist: list[bytes] | tuple[bytes, ...] = (),
        owner_key: bytes = b"",
        invite: Invite | None = None,
    ) -> None:
        if mode not in MODES:
            raise AdmissionError("config", f"unknown admission mode {mode!r}")
        if mode == "secret" and len(secret) < MIN_SECRET_BYTES:
            raise AdmissionError(
                "config", "admission mode 'secret' needs a join secret file ([security] join_secret_file)"
            )
        if mode == "allowlist" and not allowlist:
            raise AdmissionError("config", "admission mode 'allowlist' needs [admission] allowlist")
        if mode == "invite" and len(owner_key) != 32:
            raise AdmissionError("config", "admission mode 'invite' needs [admission] owner_key")
        self.mode = mode
        self.secret = secret
        self.allowlist = frozenset(allowlist)
        self.owner_key = owner_key
        self.invite = invite
        self._invite_blob = invite.encode() if invite is not None else b""
        self._valid_invites: OrderedDict[bytes, int] = OrderedDict()  # blob -> expiry, verified already

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Admission:
        """Build the policy from the run spec and the local [security] files it needs."""
        mode = cfg.admission.mode
        sec = cfg.security
        secret = load_join_secret(sec.join_secret_file) if mode == "secret" and sec.join_secret_file else b""
        invite = load_invite(sec.invite_file) if mode == "invite" and sec.invite_file else None
        return cls(
            mode,
            secret=secret,
            allowlist=[parse_hex_key(k, "admission.allowlist entry") for k in cfg.admission.allowlist],
            owner_key=parse_hex_key(cfg.admission.owner_key, "admission.owner_key") if cfg.admission.owner_key else b"",
            invite=invite,
        )

    @property
    def open(self) -> bool:
        return self.mode == "open"

    def prove(self, auth: pb.Auth) -> bytes:
        """What this peer puts in `auth.admission` (run id, key, timestamp and nonce are already set)."""
        if self.mode == "secret":
            return secret_proof(self.secret, auth)
        if self.mode == "invite":
            return self._invite_blob
        return b""

    def check(self, auth: pb.Auth, now: float | None = None) -> None:
        """Raise AdmissionError unless the request's sender is admitted. Cheap: no signature check on a hit."""
        if self.mode == "open":
            return
        if self.mode == "secret":
            if not self.secret or not hmac.compare_digest(auth.admission, secret_proof(self.secret, auth)):
                raise AdmissionError("not_admitted", "not admitted: missing or wrong join-secret proof")
            return
        if self.mode == "allowlist":
            if auth.public_key not in self.allowlist:
                raise AdmissionError("not_admitted", "not admitted: this key is not on the run's allowlist")
            return
        now = time.time() if now is None else now
        blob = bytes(auth.admission)
        expiry = self._valid_invites.get(blob)
        if expiry is not None and blob[len(INVITE_MAGIC) : len(INVITE_MAGIC) + 32] == auth.public_key:
            if now <= expiry:
                return
            raise AdmissionError("not_admitted", "not admitted: the invitation has expired")
        if not blob:
            raise AdmissionError("not_admitted", "not admitted: this run needs an invitation from its owner")
        try:
            invite = Invite.decode(blob)
            invite.check(self.owner_key, bytes(auth.public_key), now)
        except AdmissionError as exc:
            raise AdmissionError("not_admitted", f"not admitted: {exc}") from None
        self._valid_invites[blob] = invite.expires
        if len(self._valid_invites) > 4096:
            self._valid_invites.popitem(last=False)

    def check_self(self, public_key: bytes) -> None:
        """Refuse to start a peer the others would refuse, with a message that says what is missing."""
        if self.mode == "allowlist" and public_key not in self.allowlist:
            raise AdmissionError(
                "config", f"this peer's key {public_key.hex()} is not on the run's allowlist; ask the run owner"
            )
        if self.mode == "invite":
            if self.invite is None:
                raise AdmissionError(
                    "config",
                    f"admission mode 'invite' needs an invitation for this peer's key {public_key.hex()} "
                    "([security] invite_file or --invite-file)",
                )
            self.invite.check(self.owner_key, public_key, time.time())


def describe(public_key: bytes) -> str:
    return f"peer {peer_id_of(public_key)} (key {public_key.hex()})"
