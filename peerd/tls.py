"""TLS for links between peers, with each peer's certificate bound to its Ed25519 peer id.

gRPC's TLS stack (BoringSSL) refuses Ed25519 certificates: the client offers no Ed25519 signature algorithm and
the handshake fails with NO_COMMON_SIGNATURE_ALGORITHMS (checked with grpcio 1.85). So each daemon makes a fresh
P-256 TLS key at start and a self-signed certificate for it that carries a *binding*: a non-critical extension
holding the peer's Ed25519 public key and that key's signature over the certificate's SubjectPublicKeyInfo. The
certificate's only DNS name is ``<peer_id>.peerd``.

A client dialing peer X checks X's certificate with :func:`verify_cert` (the binding must verify under X's public
key, so a hostile gossip entry cannot substitute its own certificate), then dials with that certificate as the *only*
trust root and ``grpc.ssl_target_name_override = <X>.peerd``. The handshake then proves the server holds the TLS key
that X's identity key vouched for: reaching any other peer fails the handshake. Clients are not authenticated by TLS
(gRPC Python cannot verify self-signed client certificates without a shared CA); every request is signed with the
sender's Ed25519 key instead (peerd/envelope.py).

A bare bootstrap address has no known certificate: :func:`fetch_cert` reads it on first contact (trust on first
use) and the caller logs the peer id it got; ``PEERID@host:port`` pins the id instead.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import socket
import ssl
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from peerd.identity import Identity, peer_id_of, verify

# A UUID-derived OID (ITU-T X.667, arc 2.25): no registration needed and no clash with anyone else's extension.
BINDING_OID = x509.ObjectIdentifier("2.25.119892653132825505473233906332695850921")
BINDING_DOMAIN = b"peerd-tls-binding-v1\x00"
BINDING_VERSION = 1
NAME_SUFFIX = ".peerd"
MAX_CERT_BYTES = 8 * 1024
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)  # RFC 5280: no expiry


class TlsError(ValueError):
    """A certificate that does not prove the peer id it should, or a peer whose certificate could not be read."""


def server_name(peer_id: str) -> str:
    """The DNS name in peer `peer_id`'s certificate; clients override the target name with it."""
    return f"{peer_id}{NAME_SUFFIX}"


@dataclass(frozen=True)
class TlsIdentity:
    """This process's TLS key and bound certificate. The key lives only in memory: a restart makes a new one."""

    key_pem: bytes
    cert_pem: bytes
    cert_der: bytes
    peer_id: str

    @classmethod
    def create(cls, identity: Identity) -> TlsIdentity:
        key = ec.generate_private_key(ec.SECP256R1())
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        binding = bytes([BINDING_VERSION]) + identity.public_key + identity.sign(BINDING_DOMAIN + spki)
        name = server_name(identity.peer_id)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_NOT_BEFORE)
            .not_valid_after(_NOT_AFTER)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.UnrecognizedExtension(BINDING_OID, _der_octets(binding)), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        der = cert.public_bytes(serialization.Encoding.DER)
        return cls(key_pem, cert.public_bytes(serialization.Encoding.PEM), der, identity.peer_id)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _der_octets(data: bytes) -> bytes:
    """DER OCTET STRING (short or two-byte length form: the binding is 97 bytes)."""
    if len(data) < 0x80:
        return bytes([0x04, len(data)]) + data
    return bytes([0x04, 0x81, len(data)]) + data


def _parse_octets(der: bytes) -> bytes:
    if len(der) >= 2 and der[0] == 0x04 and der[1] < 0x80 and len(der) == 2 + der[1]:
        return der[2:]
    if len(der) >= 3 and der[0] == 0x04 and der[1] == 0x81 and len(der) == 3 + der[2]:
        return der[3:]
    raise TlsError("malformed peer binding in certificate")


@functools.lru_cache(maxsize=4096)
def _bound_key(cert_der: bytes) -> bytes:
    """The Ed25519 public key the certificate is bound to; raises TlsError when the binding does not hold."""
    if not cert_der or len(cert_der) > MAX_CERT_BYTES:
        raise TlsError(f"certificate missing or larger than {MAX_CERT_BYTES} bytes")
    try:
        cert = x509.load_der_x509_certificate(cert_der)
        ext = cert.extensions.get_extension_for_oid(BINDING_OID).value
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        tls_key = cert.public_key()
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise TlsError(f"certificate is not a peerd certificate: {exc}") from exc
    if not isinstance(tls_key, ec.EllipticCurvePublicKey) or not isinstance(tls_key.curve, ec.SECP256R1):
        raise TlsError("certificate key is not P-256")
    if not isinstance(ext, x509.UnrecognizedExtension):
        raise TlsError("malformed peer binding in certificate")
    binding = _parse_octets(ext.value)
    if len(binding) != 1 + 32 + 64 or binding[0] != BINDING_VERSION:
        raise TlsError("unsupported peer binding in certificate")
    public_key, signature = binding[1:33], binding[33:]
    spki = tls_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if not verify(public_key, signature, BINDING_DOMAIN + spki):
        raise TlsError("certificate's peer binding is not signed by the key it names")
    if server_name(peer_id_of(public_key)) not in san.get_values_for_type(x509.DNSName):
        raise TlsError("certificate's name does not match the peer id it is bound to")
    return public_key


def bound_key(cert_der: bytes) -> bytes:
    """The Ed25519 public key a checked certificate is bound to (TlsError when the binding does not hold)."""
    return _bound_key(bytes(cert_der))


def verify_cert(cert_der: bytes, expected_public_key: bytes | None = None) -> str:
    """Check a peer certificate's binding (against `expected_public_key` when given); returns the peer id."""
    public_key = _bound_key(bytes(cert_der))
    if expected_public_key is not None and public_key != expected_public_key:
        raise TlsError(
            f"certificate belongs to peer {peer_id_of(public_key)[:8]}, not {peer_id_of(expected_public_key)[:8]}"
        )
    return peer_id_of(public_key)


def pem(cert_der: bytes) -> bytes:
    return x509.load_der_x509_certificate(cert_der).public_bytes(serialization.Encoding.PEM)


def channel_credentials(cert_der: bytes) -> grpc.ChannelCredentials:
    """Trust exactly this certificate and nothing else."""
    return grpc.ssl_channel_credentials(root_certificates=pem(cert_der))


def channel_options(peer_id: str) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", server_name(peer_id))]


def parse_bootstrap(spec: str) -> tuple[str | None, str]:
    """'PEERID@host:port' -> (peer id, 'host:port'); a bare 'host:port' -> (None, 'host:port')."""
    spec = spec.strip()
    if "@" not in spec:
        return None, spec
    pid, _, address = spec.partition("@")
    pid = pid.lower()
    if len(pid) != 32 or any(c not in "0123456789abcdef" for c in pid):
        raise TlsError(f"bootstrap {spec!r}: the part before '@' must be a 32-hex-digit peer id")
    return pid, address


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TlsError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _probe_context() -> ssl.SSLContext:
    """For reading a certificate on first contact only: nothing is trusted yet, verify_cert judges what comes back."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def fetch_cert(address: str, timeout: float = 5.0) -> bytes:
    """Read the certificate a peer presents at `address` (trust on first use). Raises TlsError when it speaks no
    TLS, or OSError when nothing answers."""
    host, port = _split(address)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=_probe_context(), server_hostname=""), timeout
        )
    except ssl.SSLError as exc:
        raise TlsError(f"{address} does not speak TLS ({exc.reason}); was it started with --insecure?") from exc
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    if not der:
        raise TlsError(f"{address} presented no certificate")
    return der


def fetch_cert_sync(address: str, timeout: float = 5.0) -> bytes:
    """Blocking twin of fetch_cert, for `peerd status` (which runs outside any event loop)."""
    host, port = _split(address)
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with _probe_context().wrap_socket(raw, server_hostname=None) as conn:
                der = conn.getpeercert(binary_form=True)
        except ssl.SSLError as exc:
            raise TlsError(f"{address} does not speak TLS ({exc.reason}); was it started with --insecure?") from exc
    if not der:
        raise TlsError(f"{address} presented no certificate")
    return der
