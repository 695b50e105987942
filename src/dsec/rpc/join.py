"""Joining a node to a cluster with a one-time bootstrap token.

An admin creates a token (``dsec cluster token create``): ``dsj_<id>_<secret>_<ca hash>``.
The iam stores only the secret's SHA-256 and an expiry; the token names the cluster CA by
the SHA-256 of its DER certificate, so a node that has nothing else can still tell the real
cluster from an impostor (the same idea as kubeadm's discovery hash).

The node (``dsec edge join``):

1. opens TLS to the iam's join address without trusting anything yet, takes the
   certificate chain the server presents and keeps the one certificate whose hash the
   token names: that is the cluster CA (:func:`fetch_ca`);
2. makes its own key pair (the private key never leaves the node) and a CSR;
3. calls ``Join`` over TLS verified against that CA, sending the token's id and secret and
   the CSR; the iam checks the token (unknown, expired or used: refused), burns it,
   records the edge id (a taken id is refused) and returns a certificate for
   ``spiffe://dsec/edge/<id>`` signed by the CA.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dsec.core.errors import InvalidArgument, Unauthenticated, Unavailable
from dsec.rpc.tls import Identity, leaf_certificate, load_ca

_TOKEN = re.compile(r"^dsj_([a-z0-9]{12})_([A-Za-z0-9_-]{43})_([0-9a-f]{64})$")
DEFAULT_TTL_S = 3600
MAX_TTL_S = 7 * 24 * 3600


def ca_fingerprint(ca_pem: bytes) -> str:
    """The hex SHA-256 of the CA certificate's DER form."""
    cert = x509.load_pem_x509_certificate(ca_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def new_token_parts() -> tuple[str, str]:
    """A fresh (token id, secret)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(12)), secrets.token_urlsafe(32)


def format_token(token_id: str, secret: str, fingerprint: str) -> str:
    return f"dsj_{token_id}_{secret}_{fingerprint}"


def parse_token(token: str) -> tuple[str, str, str]:
    """(token id, secret, CA fingerprint). Raises InvalidArgument for a malformed token."""
    m = _TOKEN.match(token.strip())
    if m is None:
        raise InvalidArgument("not a bootstrap token (dsj_<id>_<secret>_<ca sha256>)")
    return m.group(1), m.group(2), m.group(3)


def new_csr(name: str) -> tuple[bytes, bytes]:
    """A new P-256 key and a CSR for it: (key PEM, CSR PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, csr.public_bytes(serialization.Encoding.PEM)


def sign_csr(pki_dir: Path, csr_pem: bytes, ident: Identity) -> tuple[bytes, bytes]:
    """Certify the CSR's key as ``ident`` (names come from ``ident``, never from the CSR).

    Returns:
        (certificate PEM, CA certificate PEM).

    Raises:
        InvalidArgument: the CSR is malformed, badly signed or not a P-256 key.
    """
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise InvalidArgument(f"malformed CSR: {e}") from None
    if not csr.is_signature_valid:
        raise InvalidArgument("the CSR's signature does not match its key")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise InvalidArgument("the CSR must hold an EC P-256 key")
    ca_key, ca_cert = load_ca(pki_dir)
    cert = leaf_certificate(key, ident, ca_key, ca_cert, dt.datetime.now(dt.UTC))
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        ca_cert.public_bytes(serialization.Encoding.PEM),
    )


def fetch_ca(address: str, fingerprint: str, *, timeout_s: float = 10.0) -> bytes:
    """The CA certificate the join server at ``address`` presents, if its hash matches.

    Raises:
        Unavailable: the server cannot be reached.
        Unauthenticated: it presents no certificate with that hash (not our cluster).
    """
    host, _, port = address.rpartition(":")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # nothing is trusted yet: the hash decides below
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s) as raw,
            ctx.wrap_socket(raw, server_hostname=host or "localhost") as tls,
        ):
            chain = _presented_chain(tls)
    except (OSError, ValueError) as e:
        raise Unavailable(f"cannot reach the cluster at {address}: {e}") from None
    for der in chain:
        if hashlib.sha256(der).hexdigest() == fingerprint:
            cert = x509.load_der_x509_certificate(der)
            return cert.public_bytes(serialization.Encoding.PEM)
    raise Unauthenticated(
        f"the server at {address} is not the cluster the token names (CA hash mismatch)"
    )


def _presented_chain(tls: ssl.SSLSocket) -> Sequence[bytes]:
    sslobj = getattr(tls, "_sslobj", None)
    getter = getattr(tls, "get_unverified_chain", None) or getattr(
        sslobj, "get_unverified_chain", None
    )
    if getter is None:  # pragma: no cover - every CPython >= 3.10 has it
        leaf = tls.getpeercert(binary_form=True)
        return [leaf] if leaf else []
    der = 2  # _ssl.ENCODING_DER
    return [c if isinstance(c, bytes) else c.public_bytes(der) for c in getter() or ()]


def verify_chain(cert_pem: bytes, ca_pem: bytes) -> None:
    """Raise Unauthenticated unless ``cert_pem`` is directly signed by ``ca_pem``."""
    try:
        x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_pem)
        )
    except (ValueError, TypeError, InvalidSignature) as e:
        raise Unauthenticated(f"the issued certificate does not chain to the CA: {e}") from None
