"""TLS links bound to peer ids: certificates prove the peer id, a client that expects peer X refuses peer Y, and
`peerd start` is TLS by default (with bootstrap pinning and trust on first use)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from peerd import tls
from peerd.channels import CHANNEL_OPTIONS, Channels
from peerd.config import RunConfig
from peerd.envelope import sign, signed_bytes
from peerd.identity import Identity
from peerd.streams import HEADER_METHOD
from peerd.swarmclock import TIME_KEY
from peerd.v1 import peerd_pb2 as pb
from peerd.v1 import peerd_pb2_grpc as rpc
from tests.swarm import REPO, Swarm, tiny_config


def test_certificate_is_bound_to_the_peer_id() -> None:
    ident = Identity.generate()
    cert = tls.TlsIdentity.create(ident)
    assert tls.verify_cert(cert.cert_der) == ident.peer_id
    assert tls.verify_cert(cert.cert_der, ident.public_key) == ident.peer_id
    names = x509.load_der_x509_certificate(cert.cert_der).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert names.value.get_values_for_type(x509.DNSName) == [f"{ident.peer_id}.peerd"]
    other = Identity.generate()
    with pytest.raises(tls.TlsError, match="belongs to peer"):
        tls.verify_cert(cert.cert_der, other.public_key)  # a gossip entry for `other` carrying our certificate


def test_certificates_without_a_valid_binding_are_refused() -> None:
    ident = Identity.generate()
    good = x509.load_der_x509_certificate(tls.TlsIdentity.create(ident).cert_der)
    # Same binding extension, different TLS key: the binding signs the original key, so it no longer holds.
    other_key = x509.load_der_x509_certificate(tls.TlsIdentity.create(ident).cert_der)
    binding = good.extensions.get_extension_for_oid(tls.BINDING_OID).value
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    forged = (
        x509.CertificateBuilder()
        .subject_name(good.subject)
        .issuer_name(good.subject)
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(good.not_valid_before_utc)
        .not_valid_after(good.not_valid_after_utc)
        .add_extension(good.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, critical=False)
        .add_extension(binding, critical=False)
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(tls.TlsError, match="not signed"):
        tls.verify_cert(forged.public_bytes(serialization.Encoding.DER))
    plain = (
        x509.CertificateBuilder()
        .subject_name(good.subject)
        .issuer_name(good.subject)
        .public_key(key.public_key())
        .serial_number(8)
        .not_valid_before(good.not_valid_before_utc)
        .not_valid_after(good.not_valid_after_utc)
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(tls.TlsError, match="not a peerd certificate"):
        tls.verify_cert(plain.public_bytes(serialization.Encoding.DER))
    for junk in (b"", b"\x30\x03\x02\x01\x00", b"x" * (tls.MAX_CERT_BYTES + 1)):
        with pytest.raises(tls.TlsError):
            tls.verify_cert(junk)
    assert other_key.public_key() != good.public_key()  # every start makes a fresh TLS key


def test_bootstrap_specs() -> None:
    pid = "ab" * 16
    assert tls.parse_bootstrap(f"{pid}@10.0.0.1:7000") == (pid, "10.0.0.1:7000")
    assert tls.parse_bootstrap("10.0.0.1:7000") == (None, "10.0.0.1:7000")
    with pytest.raises(tls.TlsError, match="32-hex-digit"):
        tls.parse_bootstrap("nothex@10.0.0.1:7000")


async def _serve(ident: Identity) -> tuple[grpc.aio.Server, int, tls.TlsIdentity]:
    own = tls.TlsIdentity.create(ident)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", own.server_credentials())
    await server.start()
    return server, port, own


async def _check(channels: Channels, address: str, peer: pb.PeerInfo | None) -> grpc.StatusCode:
    stub = health_pb2_grpc.HealthStub(channels.channel(address, peer))
    try:
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_client_expecting_peer_x_refuses_peer_y() -> None:
    async def main() -> None:
        x, y, me = Identity.generate(), Identity.generate(), Identity.generate()
        server_y, port_y, tls_y = await _serve(y)
        _, _, tls_x = await _serve(x)
        addr = f"127.0.0.1:{port_y}"
        channels = Channels(tls.TlsIdentity.create(me))
        try:
            info_y = pb.PeerInfo(peer_id=y.peer_id, public_key=y.public_key, address=addr, tls_cert=tls_y.cert_der)
            assert await _check(channels, addr, info_y) == grpc.StatusCode.OK
            # We mean to reach X (with X's real certificate) but Y answers at that address: the handshake fails.
            info_x = pb.PeerInfo(peer_id=x.peer_id, public_key=x.public_key, address=addr, tls_cert=tls_x.cert_der)
            assert await _check(channels, addr, info_x) == grpc.StatusCode.UNAVAILABLE
            # A hostile gossip entry for X that carries Y's certificate: refused before dialing.
            forged = pb.PeerInfo(peer_id=x.peer_id, public_key=x.public_key, address=addr, tls_cert=tls_y.cert_der)
            assert await _check(channels, addr, forged) == grpc.StatusCode.UNAVAILABLE
            # No certificate at all: never falls back to plaintext.
            bare = pb.PeerInfo(peer_id=x.peer_id, public_key=x.public_key, address=addr)
            assert await _check(channels, addr, bare) == grpc.StatusCode.UNAVAILABLE
            # First contact: the certificate read at the address is trusted, and names Y.
            cert = await tls.fetch_cert(addr)
            assert tls.verify_cert(cert) == y.peer_id
            channels.pin(addr, cert)
            assert await _check(channels, addr, None) == grpc.StatusCode.OK
        finally:
            await channels.close()
            await server_y.stop(0)

    asyncio.run(main())


def _peerd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def _replayed_stale_and_forged_are_refused_over_tls(addr: str, run_id: bytes) -> None:
    cert = tls.fetch_cert_sync(addr)
    me, victim = Identity.generate(), Identity.generate()
    opts = CHANNEL_OPTIONS + tls.channel_options(tls.verify_cert(cert))
    with grpc.secure_channel(addr, tls.channel_credentials(cert), options=opts) as ch:
        members, rounds = rpc.MembershipStub(ch), rpc.RoundsStub(ch)

        def refused(fn: Callable[[], object]) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as err:
                fn()
            return err.value

        ok = sign(pb.GossipRequest(), "Gossip", me, run_id)
        members.Gossip(ok, timeout=5)
        err = refused(lambda: members.Gossip(ok, timeout=5))  # captured and sent again
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "replay" in err.details()
        stale = pb.GossipRequest()
        sign(stale, "Gossip", me, run_id)
        stale.auth.timestamp_ms -= 3_600_000
        stale.auth.signature = me.sign(signed_bytes("Gossip", stale))  # validly signed, an hour old
        err = refused(lambda: members.Gossip(stale, timeout=5))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "3600 s behind this peer's clock" in err.details()
        said = dict(err.trailing_metadata() or ())  # the refusing peer's time, for a peer whose clock is wrong
        assert abs(int(said[TIME_KEY]) / 1000 - time.time()) < 60
        as_leave = sign(pb.GossipRequest(), "Gossip", me, run_id)  # a Gossip signature does not make a Leave
        leave = pb.LeaveRequest(auth=as_leave.auth, self=pb.PeerInfo(peer_id=me.peer_id, public_key=me.public_key))
        err = refused(lambda: members.Leave(leave, timeout=5))
        assert "signature" in err.details()
        # A tensor header signed by one peer but naming another's key: no fragment on someone else's behalf.
        tensor = pb.TensorHeader(round_id=b"r" * 32, shard=0, numel=4, codec=pb.CODEC_FP32)
        header = sign(tensor, HEADER_METHOD, me, run_id)
        header.auth.public_key = victim.public_key
        err = refused(lambda: list(rounds.Reduce(iter([pb.TensorMessage(header=header)]), timeout=5)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "signature" in err.details()


@pytest.mark.slow
def test_tls_by_default_pinning_and_status(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, 1, tiny_config(tmp_path, run__outer_steps=0), secure=True)
    with swarm:
        first = swarm.peers[0]
        addr = first.address
        st = first.status()  # TLS, certificate read on first contact
        assert st.peer_id and not st.redacted
        # Plaintext to a TLS peer gets nowhere.
        with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        text = _peerd("status", addr)
        assert text.returncode == 0 and st.peer_id[:16] in text.stdout, text.stderr
        pinned = _peerd("status", f"{st.peer_id}@{addr}", "--json")
        assert pinned.returncode == 0 and st.peer_id in pinned.stdout, pinned.stderr
        wrong = _peerd("status", f"{'0' * 32}@{addr}")
        assert wrong.returncode == 1 and "not " + "0" * 32 in wrong.stderr
        plain = _peerd("status", "--insecure", addr)
        assert plain.returncode == 1
        _replayed_stale_and_forged_are_refused_over_tls(addr, RunConfig.load(swarm.config).run_id())
        # A joiner told to expect another peer id at this address refuses to join through it.
        liar = swarm.spawn(5, f"{'1' * 32}@{addr}", config=tiny_config(tmp_path, "j.toml", run__outer_steps=1))
        assert liar.wait(120) != 0
        assert "not the expected" in liar.log(), liar.log_tail()
        # Pinned to the right id: it joins.
        ok = swarm.spawn(6, f"{st.peer_id}@{addr}", wait_peers=2)
        swarm.peers.append(ok)
        swarm.wait_until(lambda: len(first.status().alive) == 2, 120, "the pinned joiner to join")
        assert "joined through" in ok.log()
