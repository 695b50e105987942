"""A local PKI for the internal gRPC mesh: one EC P-256 CA and one leaf per component.

Layout of ``pki_dir`` (created 0700)::

    ca.crt  ca.key                 the trust root (10 years; key 0600)
    <name>.crt  <name>.key         one leaf per identity (1 year by default; key 0600)

A leaf names its owner with a SPIFFE-style URI SAN ``spiffe://dsec/<role>/<name>``; that URI
is what servers authorize on (see :mod:`dsec.rpc.server`). Every leaf also carries DNS
``localhost``, DNS ``<name>.<role>.dsec`` (so a client can pin the server it expects), IP
``127.0.0.1`` and ``::1``, plus any extra SANs, and is good for both serverAuth and
clientAuth because every component both serves and dials.

The one-year leaf lifetime is a single-node default: the keys never leave this machine and
nothing rotates them automatically. :func:`ensure_pki` is idempotent and safe to call from
several processes at once (it holds an exclusive ``flock``): it keeps valid certificates and
re-issues ones that are missing, unreadable, not signed by the current CA, lacking a required
SAN, or expiring within ``renew_before``. A daemon picks up a re-issued certificate when it
restarts. A directory with ``ca.crt`` but no ``ca.key`` belongs to a member of a cluster
whose CA lives elsewhere: there it only checks the leaves (see :mod:`dsec.rpc.join`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import functools
import ipaddress
import logging
import os
import secrets
import ssl
import string
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsec.core.errors import InvalidArgument, Unavailable
from dsec.core.ids import validate_edge_id

TRUST_DOMAIN = "dsec"
ROLES = frozenset({"iam", "watcher", "edge", "apiserver", "admin"})
CA_LIFETIME = dt.timedelta(days=3650)
LEAF_LIFETIME = dt.timedelta(days=365)
RENEW_BEFORE = dt.timedelta(days=30)
_CLOCK_SKEW = dt.timedelta(minutes=5)
_NAME_CHARS = frozenset(string.ascii_lowercase + string.digits + "-")
_EDGE_ID_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a certificate speaks for: a role and an instance name, plus extra SANs.

    The certificate files are named after ``name`` (``<name>.crt``), so names are unique
    across roles: ``iam`` for the iam, the edge id for an edge. ``extra_sans`` are DNS names
    or IP addresses (as text) the leaf must also carry, e.g. the address other nodes dial an
    edge on.
    """

    role: str
    name: str
    extra_sans: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument(f"unknown role {self.role!r} (expected one of {sorted(ROLES)})")
        if not self.name or not set(self.name) <= _NAME_CHARS or len(self.name) > 48:
            raise InvalidArgument(f"identity name must be [a-z0-9-]{{1,48}}, got {self.name!r}")
        if self.name == "ca":
            raise InvalidArgument("identity name 'ca' is reserved for the CA")

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @property
    def dns_name(self) -> str:
        """A DNS SAN unique to this identity, for pinning the server a client expects."""
        return f"{self.name}.{self.role}.{TRUST_DOMAIN}"

    @classmethod
    def singleton(cls, role: str) -> Identity:
        """The identity of a component that runs once per cluster (name == role)."""
        return cls(role=role, name=role)

    @classmethod
    def edge(cls, edge_id: str, extra_sans: Sequence[str] = ()) -> Identity:
        return cls(role="edge", name=validate_edge_id(edge_id), extra_sans=tuple(extra_sans))


@functools.lru_cache(maxsize=4096)  # every call a server takes asks (identities are frozen)
def parse_spiffe_id(uri: str) -> Identity:
    """Turn ``spiffe://dsec/<role>/<name>`` back into an :class:`Identity`.

    Raises:
        InvalidArgument: the URI is not a dsec SPIFFE id of a known role.
    """
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        raise InvalidArgument(f"not a {TRUST_DOMAIN} SPIFFE id: {uri!r}")
    parts = uri[len(prefix) :].split("/")
    if len(parts) != 2:
        raise InvalidArgument(f"SPIFFE id must be {prefix}<role>/<name>: {uri!r}")
    return Identity(role=parts[0], name=parts[1])


def default_identities(edge_id: str, edge_sans: Sequence[str] = ()) -> list[Identity]:
    """The identities one single-node installation needs: every singleton and one edge."""
    singles = [Identity.singleton(r) for r in ("iam", "watcher", "apiserver", "admin")]
    return [*singles, Identity.edge(edge_id, edge_sans)]


def ensure_edge_id(home: Path) -> str:
    """Return this node's edge id from ``<home>/edge.id``, creating it on first use.

    The id is 4 random characters ``[a-z0-9]``; creation is race-free (``O_EXCL``).

    Raises:
        InvalidArgument: the file exists but does not hold a valid edge id.
    """
    path = home / "edge.id"
    home.mkdir(parents=True, exist_ok=True)
    candidate = "".join(secrets.choice(_EDGE_ID_ALPHABET) for _ in range(4))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return validate_edge_id(path.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(candidate + "\n")
    return candidate


def ensure_node_pki(home: Path, edge_sans: Sequence[str] = ()) -> str:
    """Set up everything one single-node installation needs under ``home``.

    Creates ``<home>/edge.id`` and ``<home>/pki`` with :func:`default_identities`.

    Returns:
        The edge id, which is also the name of the edge's certificate (``<id>.crt``).
    """
    edge_id = ensure_edge_id(home)
    ensure_pki(home / "pki", default_identities(edge_id, edge_sans))
    return edge_id


def ensure_pki(
    pki_dir: Path,
    identities: Sequence[Identity],
    *,
    leaf_lifetime: dt.timedelta = LEAF_LIFETIME,
    renew_before: dt.timedelta = RENEW_BEFORE,
) -> None:
    """Create the CA and a leaf per identity where missing or due; keep everything valid.

    Args:
        pki_dir: directory holding ``ca.*`` and ``<name>.*`` (created 0700).
        identities: the leaves that must exist; names must be unique across roles.
        leaf_lifetime: validity of newly issued leaves.
        renew_before: re-issue a leaf (or the CA) that expires sooner than this.
    """
    by_name: dict[str, Identity] = {}
    for ident in identities:
        if by_name.setdefault(ident.name, ident).role != ident.role:
            raise InvalidArgument(f"two identities named {ident.name!r} with different roles")
    pki_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(pki_dir, 0o700)
    with locked(pki_dir / ".lock"):
        now = dt.datetime.now(dt.UTC)
        ca = _load_ca(pki_dir, now, renew_before)
        if ca is None and (pki_dir / "ca.crt").exists() and not (pki_dir / "ca.key").exists():
            _check_member(pki_dir, identities, now)  # a cluster member: the CA is elsewhere
            return
        if ca is None:
            ca = _new_ca(pki_dir, now)
        ca_key, ca_cert = ca
        for ident in identities:
            if not _leaf_ok(pki_dir, ident, ca_cert, now, renew_before):
                _issue_leaf(pki_dir, ident, ca_key, ca_cert, now, leaf_lifetime)


def _check_member(pki_dir: Path, identities: Sequence[Identity], now: dt.datetime) -> None:
    cas = load_bundle(pki_dir / "ca.crt")  # two during a CA rotation: either may have signed
    for ident in identities:
        if not any(_leaf_ok(pki_dir, ident, ca, now, dt.timedelta(0)) for ca in cas):
            raise Unavailable(
                f"no valid certificate {ident.name!r} in {pki_dir} and no CA key to issue one: "
                "get it from the cluster's CA (dsec edge join, or copy it from the iam)"
            )


def read_pki(pki_dir: Path, name: str) -> tuple[bytes, bytes, bytes]:
    """Return (CA cert, leaf key, leaf cert) PEM bytes of the identity called ``name``.

    Raises:
        Unavailable: the PKI has not been created (run ``ensure_pki``) or is unreadable.
    """
    try:
        return (
            (pki_dir / "ca.crt").read_bytes(),
            (pki_dir / f"{name}.key").read_bytes(),
            (pki_dir / f"{name}.crt").read_bytes(),
        )
    except OSError as e:
        raise Unavailable(f"no certificate {name!r} in {pki_dir}: {e.strerror}") from e


def server_credentials(pki_dir: Path, name: str) -> grpc.ServerCredentials:
    """mTLS server credentials for leaf ``name``: clients must present a cert of our CA."""
    ca, key, cert = read_pki(pki_dir, name)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(pki_dir: Path, name: str) -> grpc.ChannelCredentials:
    """mTLS channel credentials for leaf ``name``, trusting only our CA."""
    ca, key, cert = read_pki(pki_dir, name)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _same_key(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    return cert.public_key().public_bytes(enc, fmt) == key.public_key().public_bytes(enc, fmt)


def load_bundle(path: Path) -> list[x509.Certificate]:
    """Every certificate in a PEM trust bundle (empty if missing or unreadable)."""
    try:
        return x509.load_pem_x509_certificates(path.read_bytes())
    except (OSError, ValueError):
        return []


def _load_ca(
    pki_dir: Path, now: dt.datetime, renew_before: dt.timedelta
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None:
    # During a rotation ca.crt holds two CAs; the one ca.key belongs to signs (dsec.rpc.trust).
    key = load_key(pki_dir / "ca.key")
    certs = load_bundle(pki_dir / "ca.crt")
    cert = next((c for c in certs if key is not None and _same_key(c, key)), None)
    if key is None or cert is None:
        return None
    if cert.not_valid_after_utc - now < renew_before:
        return None
    return key, cert


def _new_ca(pki_dir: Path, now: dt.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key, cert = make_ca(now)
    write_atomic(pki_dir / "ca.key", key_pem(key), 0o600)
    write_atomic(pki_dir / "ca.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return key, cert


def make_ca(now: dt.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new self-signed CA key and certificate (nothing is written)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "OpenDsec"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"dsec local CA {secrets.token_hex(4)}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _required_sans(ident: Identity) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(ident.spiffe_id),
        x509.DNSName("localhost"),
        x509.DNSName(ident.dns_name),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    for extra in ident.extra_sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            names.append(x509.DNSName(extra))
    return list(dict.fromkeys(names))


def _leaf_ok(
    pki_dir: Path,
    ident: Identity,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    renew_before: dt.timedelta,
) -> bool:
    key = load_key(pki_dir / f"{ident.name}.key")
    cert = load_cert(pki_dir / f"{ident.name}.crt")
    if key is None or cert is None or not _same_key(cert, key):
        return False
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    if cert.not_valid_after_utc - now < renew_before:
        return False
    try:
        have = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return False
    return set(_required_sans(ident)) <= have


def _issue_leaf(
    pki_dir: Path,
    ident: Identity,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    lifetime: dt.timedelta,
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = leaf_certificate(key.public_key(), ident, ca_key, ca_cert, now, lifetime)
    write_atomic(pki_dir / f"{ident.name}.key", key_pem(key), 0o600)
    write_atomic(
        pki_dir / f"{ident.name}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644
    )


def leaf_certificate(
    public_key: ec.EllipticCurvePublicKey,
    ident: Identity,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    lifetime: dt.timedelta = LEAF_LIFETIME,
) -> x509.Certificate:
    """A mesh leaf for ``ident`` holding ``public_key``, signed by the CA."""
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _sign_leaf(
        public_key, ident.name, _required_sans(ident), usages, ca_key, ca_cert, now, lifetime
    )


def _sign_leaf(
    public_key: ec.EllipticCurvePublicKey,
    common_name: str,
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    lifetime: dt.timedelta,
) -> x509.Certificate:
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "OpenDsec"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + lifetime, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(aki, critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def load_ca(pki_dir: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA's key and certificate. Raises Unavailable if they are missing or do not match."""
    ca = _load_ca(pki_dir, dt.datetime.now(dt.UTC), dt.timedelta(0))
    if ca is None:
        raise Unavailable(f"no valid CA in {pki_dir}")
    return ca


def write_leaf(pki_dir: Path, name: str, key_pem: bytes, cert_pem: bytes, ca_pem: bytes) -> None:
    """Store a leaf obtained elsewhere (e.g. by joining a cluster) and the CA it chains to."""
    pki_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(pki_dir, 0o700)
    write_atomic(pki_dir / "ca.crt", ca_pem, 0o644)
    write_atomic(pki_dir / f"{name}.key", key_pem, 0o600)
    write_atomic(pki_dir / f"{name}.crt", cert_pem, 0o644)


# -- web certificates (host-style routing over HTTPS) -----------------------------------------

WEB_CERT = "web"


def web_names(domain: str) -> list[str]:
    """The DNS names of the web certificate for ``domain``: itself and ``*.<domain>``.

    Raises:
        InvalidArgument: ``domain`` is not a DNS name of at least two labels (a wildcard on
            a single label, ``*.test``, is refused by TLS clients).
    """
    labels = domain.lower().split(".")
    if len(labels) < 2 or not all(
        lab and len(lab) <= 63 and set(lab) <= _NAME_CHARS and not lab.startswith("-")
        for lab in labels
    ):
        raise InvalidArgument(f"--domain must be a DNS name of two or more labels, got {domain!r}")
    return [domain.lower(), f"*.{domain.lower()}"]


def ensure_web_cert(pki_dir: Path, domain: str) -> tuple[Path, Path]:
    """A server certificate for ``domain`` and ``*.<domain>`` issued by the cluster CA.

    It carries no SPIFFE id and only the serverAuth usage, so it can never act as a mesh
    identity. Re-issued when missing, due, or for another domain. Returns (cert, key) paths.
    """
    names = web_names(domain)
    cert_path, key_path = pki_dir / f"{WEB_CERT}.crt", pki_dir / f"{WEB_CERT}.key"
    pki_dir.mkdir(parents=True, exist_ok=True)
    with locked(pki_dir / ".lock"):
        now = dt.datetime.now(dt.UTC)
        ca = _load_ca(pki_dir, now, dt.timedelta(0))
        if ca is None:
            raise Unavailable(f"no cluster CA in {pki_dir}: set up the PKI first")
        ca_key, ca_cert = ca
        if not _web_ok(cert_path, key_path, names, ca_cert, now):
            _issue_web(cert_path, key_path, names, ca_key, ca_cert, now)
    return cert_path, key_path


def _web_ok(
    cert_path: Path, key_path: Path, names: list[str], ca: x509.Certificate, now: dt.datetime
) -> bool:
    key, cert = load_key(key_path), load_cert(cert_path)
    if key is None or cert is None or not _same_key(cert, key):
        return False
    try:
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return cert.not_valid_after_utc - now >= RENEW_BEFORE and sorted(
        sans.get_values_for_type(x509.DNSName)
    ) == sorted(names)


def _issue_web(
    cert_path: Path,
    key_path: Path,
    names: list[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]  # never a mesh identity: no client auth
    cert = _sign_leaf(key.public_key(), names[0], sans, usages, ca_key, ca_cert, now, LEAF_LIFETIME)
    write_atomic(key_path, key_pem(key), 0o600)
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def web_ssl_context(pki_dir: Path, domain: str) -> ssl.SSLContext:
    """A TLS server context with the web certificate for ``domain`` (HTTP/1.1 via ALPN).

    The certificate follows CA rotations without a restart: at a handshake (at most once a
    second) the files are checked and, if the CA changed, the certificate is re-issued and the
    connection gets a context holding the new one (see :class:`_WebCert`).
    """
    return _WebCert(pki_dir, domain).ctx


class _WebCert:
    def __init__(self, pki_dir: Path, domain: str) -> None:
        self.pki_dir, self.domain = pki_dir, domain
        self.ctx = self._make()
        self._stamp = self._stat()
        self._checked = time.monotonic()

    def _make(self) -> ssl.SSLContext:
        cert, key = ensure_web_cert(self.pki_dir, self.domain)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.sni_callback = self._on_hello
        return ctx

    def _stat(self) -> tuple[int, ...]:
        names = ("ca.crt", "ca.key", f"{WEB_CERT}.crt", f"{WEB_CERT}.key")
        with contextlib.suppress(OSError):
            return tuple((self.pki_dir / n).stat().st_mtime_ns for n in names)
        return ()

    def _on_hello(self, conn: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        now = time.monotonic()
        if now - self._checked >= 1.0:
            self._checked = now
            if self._stat() != self._stamp:
                try:
                    self.ctx = self._make()
                except Exception:
                    logging.getLogger("dsec.rpc.tls").exception("web certificate reload failed")
                self._stamp = self._stat()
        if conn.context is not self.ctx:
            conn.context = self.ctx
