"""Identity keys and signed envelopes."""

import os
import stat
from pathlib import Path

import pytest

from peerd.envelope import AuthError, Verifier, sign
from peerd.identity import Identity, IdentityError, peer_id_of, verify
from peerd.v1 import peerd_pb2 as pb

RUN = b"r" * 32


def test_key_created_0600_and_reloaded(tmp_path: Path) -> None:
    a = Identity.load_or_create(tmp_path)
    mode = stat.S_IMODE((tmp_path / "identity.key").stat().st_mode)
    assert mode == 0o600
    b = Identity.load_or_create(tmp_path)
    assert a.peer_id == b.peer_id == peer_id_of(a.public_key)


def test_group_readable_key_is_refused(tmp_path: Path) -> None:
    Identity.load_or_create(tmp_path)
    os.chmod(tmp_path / "identity.key", 0o640)
    with pytest.raises(IdentityError, match="chmod 600"):
        Identity.load_or_create(tmp_path)


def _gossip(ident: Identity) -> pb.GossipRequest:
    return sign(pb.GossipRequest(peers=[pb.PeerInfo(peer_id="x")]), "Gossip", ident, RUN)


def test_signed_request_verifies_and_names_sender() -> None:
    ident = Identity.generate()
    assert Verifier(RUN).verify("Gossip", _gossip(ident)) == ident.peer_id


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda m, other: m.peers[0].__setattr__("peer_id", "y"), "bad_signature"),
        (lambda m, other: m.auth.__setattr__("public_key", other.public_key), "bad_signature"),
        (lambda m, other: m.auth.__setattr__("run_id", b"s" * 32), "wrong_run"),
        (lambda m, other: m.auth.__setattr__("timestamp_ms", 1), "bad_signature"),
        (lambda m, other: m.ClearField("auth"), "unsigned"),
    ],
)
def test_forged_or_tampered_requests_are_refused(tamper, reason: str) -> None:
    msg = _gossip(Identity.generate())
    tamper(msg, Identity.generate())
    with pytest.raises(AuthError) as err:
        Verifier(RUN).verify("Gossip", msg)
    assert err.value.reason == reason


def test_replay_and_method_confusion_are_refused() -> None:
    v = Verifier(RUN)
    msg = _gossip(Identity.generate())
    v.verify("Gossip", msg)
    with pytest.raises(AuthError) as err:
        v.verify("Gossip", msg)
    assert err.value.reason == "replay"
    with pytest.raises(AuthError) as err:
        Verifier(RUN).verify("Leave", msg)
    assert err.value.reason == "bad_signature"


def test_stale_timestamp_is_refused() -> None:
    ident = Identity.generate()
    msg = pb.GossipRequest()
    msg.auth.timestamp_ms = 1
    sign(msg, "Gossip", ident, RUN)
    v = Verifier(RUN, max_skew_s=5)
    msg.auth.timestamp_ms = 1000  # re-sign with an old timestamp
    msg.auth.signature = b""
    from peerd.envelope import signed_bytes

    msg.auth.signature = ident.sign(signed_bytes("Gossip", msg))
    with pytest.raises(AuthError) as err:
        v.verify("Gossip", msg)
    assert err.value.reason == "stale"


def test_kept_keys_still_judge_every_signature_on_its_own() -> None:
    """Keys and ids are kept between checks (gossip checks the same few dozen all the time): a key seen before must
    still refuse data it did not sign, and another key's signature."""
    a, b = Identity.generate(), Identity.generate()
    for _ in range(2):  # the second pass hits the kept key objects
        assert verify(a.public_key, a.sign(b"x"), b"x")
        assert not verify(a.public_key, a.sign(b"x"), b"y")
        assert not verify(a.public_key, b.sign(b"x"), b"x")
        assert peer_id_of(a.public_key) == a.peer_id and peer_id_of(bytearray(b.public_key)) == b.peer_id
