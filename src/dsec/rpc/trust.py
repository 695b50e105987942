"""CA rotation on disk: the trust bundle, the signing CA, and which CA issued a certificate.

A rotation runs in three steps (the iam drives them, :mod:`dsec.iam.ca_rpcs`)::

    idle          ca.crt = [A]         ca.key = A's key
    rotate        ca.crt = [B, A]      ca.key = B's key     every component trusts both
    (re-issue)                                              leaves move from A to B
    finish        ca.crt = [B]         ca.key = B's key     A-issued leaves are refused

``ca.crt`` is the trust bundle, signing CA first; the signing CA is the one certificate of the
bundle that ``ca.key`` belongs to (so a crash between two writes leaves a working PKI: see
:func:`dsec.rpc.tls._load_ca`). Rotation writes the new key to ``ca.key.next`` first, then the
bundle, then renames the key into place; a rotation that stopped half-way is completed by
running it again.

Members of the cluster (no ``ca.key``) keep a copy of the bundle and their own leaf; they
renew both over mTLS (:mod:`dsec.rpc.renewal`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from dsec.core.errors import InvalidState, Unavailable
from dsec.rpc.tls import (
    Identity,
    key_pem,
    leaf_certificate,
    load_bundle,
    load_ca,
    load_key,
    locked,
    make_ca,
    write_atomic,
)

_DER = serialization.Encoding.DER
_PEM = serialization.Encoding.PEM


def fingerprint(cert: x509.Certificate) -> str:
    """The hex SHA-256 of a certificate's DER form (the same as a join token names)."""
    return hashlib.sha256(cert.public_bytes(_DER)).hexdigest()


def bundle_pem(certs: Sequence[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(_PEM) for c in certs)


def issuer_of(cert: x509.Certificate, cas: Sequence[x509.Certificate]) -> x509.Certificate | None:
    """The CA among ``cas`` that signed ``cert`` directly, if any."""
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return ca
    return None


def issuer_fingerprint(cert_pem: bytes, cas: Sequence[x509.Certificate]) -> str:
    """Fingerprint of the CA in ``cas`` that issued ``cert_pem``; empty if none did."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return ""
    ca = issuer_of(cert, cas)
    return fingerprint(ca) if ca is not None else ""


@dataclass(frozen=True, slots=True)
class CaState:
    """What a CA directory says: the signing CA and the others still trusted."""

    signing: x509.Certificate
    trusted: tuple[x509.Certificate, ...]  # signing first

    @property
    def rotating(self) -> bool:
        return len(self.trusted) > 1

    @property
    def signing_fingerprint(self) -> str:
        return fingerprint(self.signing)

    @property
    def old_fingerprints(self) -> list[str]:
        return [fingerprint(c) for c in self.trusted[1:]]

    @property
    def bundle(self) -> bytes:
        return bundle_pem(self.trusted)


def ca_state(pki_dir: Path) -> CaState:
    """Read the CA directory (one that holds ``ca.key``).

    Raises:
        Unavailable: no CA key, or it belongs to no certificate of the bundle.
    """
    _, signing = load_ca(pki_dir)
    others = [c for c in load_bundle(pki_dir / "ca.crt") if fingerprint(c) != fingerprint(signing)]
    return CaState(signing, (signing, *others))


def begin_rotation(pki_dir: Path, now: dt.datetime | None = None) -> CaState:
    """Make a new CA and trust it next to the current one; the new one signs from now on.

    Raises:
        InvalidState: a rotation is already in progress (finish it first).
        Unavailable: this directory holds no CA key.
    """
    now = now or dt.datetime.now(dt.UTC)
    with locked(pki_dir / ".lock"):
        pending = load_key(pki_dir / "ca.key.next")
        current = ca_state(pki_dir)
        if pending is not None:  # a rotation stopped after writing the key: complete it
            return _install(pki_dir, pending, current)
        if current.rotating:
            raise InvalidState(
                "a CA rotation is already in progress (old CA "
                f"{current.old_fingerprints[0][:16]}); run `dsec ca rotate --finish` first"
            )
        key, cert = make_ca(now)
        write_atomic(pki_dir / "ca.key.next", key_pem(key), 0o600)
        write_atomic(pki_dir / "ca.crt", bundle_pem([cert, *current.trusted]), 0o644)
        os.replace(pki_dir / "ca.key.next", pki_dir / "ca.key")
        return ca_state(pki_dir)


def _install(pki_dir: Path, key: object, current: CaState) -> CaState:
    from cryptography.hazmat.primitives.asymmetric import ec

    assert isinstance(key, ec.EllipticCurvePrivateKey)
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    mine = key.public_key().public_bytes(_DER, fmt)
    if not any(c.public_key().public_bytes(_DER, fmt) == mine for c in current.trusted):
        with contextlib.suppress(FileNotFoundError):  # its certificate was never published
            (pki_dir / "ca.key.next").unlink()
        return begin_rotation(pki_dir)
    os.replace(pki_dir / "ca.key.next", pki_dir / "ca.key")
    return ca_state(pki_dir)


def finish_rotation(pki_dir: Path) -> CaState:
    """Drop every CA but the signing one from the bundle.

    Raises:
        InvalidState: no rotation is in progress.
    """
    with locked(pki_dir / ".lock"):
        current = ca_state(pki_dir)
        if not current.rotating:
            raise InvalidState("no CA rotation is in progress: run `dsec ca rotate` first")
        write_atomic(pki_dir / "ca.crt", bundle_pem([current.signing]), 0o644)
        return ca_state(pki_dir)


def reissue_local(pki_dir: Path, idents: Sequence[Identity]) -> list[str]:
    """Re-issue, with the signing CA, those of ``idents`` whose leaf it did not sign.

    Only leaves already present in ``pki_dir`` are touched. Returns the renewed names.
    """
    done: list[str] = []
    with locked(pki_dir / ".lock"):
        ca_key, ca_cert = load_ca(pki_dir)
        for ident in idents:
            crt = pki_dir / f"{ident.name}.crt"
            if not crt.exists() or issuer_fingerprint(crt.read_bytes(), [ca_cert]):
                continue
            key = load_key(pki_dir / f"{ident.name}.key")
            if key is None:
                raise Unavailable(f"no readable key {ident.name}.key in {pki_dir}")
            cert = leaf_certificate(key.public_key(), ident, ca_key, ca_cert, _now())
            write_atomic(crt, cert.public_bytes(_PEM), 0o644)
            done.append(ident.name)
    return done


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True, slots=True)
class LocalView:
    """What a member's own files say: whom it trusts and who issued its leaf."""

    trusted: tuple[str, ...]  # fingerprints of ca.crt's certificates
    leaf_issuer: str  # fingerprint of the CA that issued <name>.crt, "" if none of them


def local_view(pki_dir: Path, name: str) -> LocalView:
    cas = load_bundle(pki_dir / "ca.crt")
    try:
        leaf = (pki_dir / f"{name}.crt").read_bytes()
    except OSError:
        leaf = b""
    return LocalView(tuple(fingerprint(c) for c in cas), issuer_fingerprint(leaf, cas))
