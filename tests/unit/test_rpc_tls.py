"""The local PKI: what ensure_pki creates, that it is idempotent, and when it re-issues."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from dsec.core.errors import InvalidArgument, Unavailable
from dsec.rpc.tls import (
    Identity,
    default_identities,
    ensure_edge_id,
    ensure_node_pki,
    ensure_pki,
    parse_spiffe_id,
    read_pki,
)


def _cert(pki: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((pki / f"{name}.crt").read_bytes())


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_creates_ca_and_leaves_with_identities(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    ensure_pki(pki, default_identities("ab12", ["edge1.example", "10.0.0.7"]))

    assert stat.S_IMODE(pki.stat().st_mode) == 0o700
    for name in ("ca", "iam", "watcher", "apiserver", "admin", "ab12"):
        assert stat.S_IMODE((pki / f"{name}.key").stat().st_mode) == 0o600, name
        assert (pki / f"{name}.crt").exists()

    ca = _cert(pki, "ca")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    edge = _cert(pki, "ab12")
    edge.verify_directly_issued_by(ca)
    sans = _sans(edge)
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://dsec/edge/ab12"]
    assert set(sans.get_values_for_type(x509.DNSName)) == {
        "localhost",
        "ab12.edge.dsec",
        "edge1.example",
    }
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("10.0.0.7") in sans.get_values_for_type(x509.IPAddress)
    eku = edge.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not edge.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    life = edge.not_valid_after_utc - edge.not_valid_before_utc
    assert dt.timedelta(days=364) < life < dt.timedelta(days=366)
    iam = _cert(pki, "iam")
    assert _sans(iam).get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://dsec/iam/iam"
    ]


def test_idempotent_keeps_valid_certs(tmp_path: Path) -> None:
    ids = default_identities("ab12")
    ensure_pki(tmp_path, ids)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ensure_pki(tmp_path, ids)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert before == after


def test_reissues_leaf_that_expires_soon(tmp_path: Path) -> None:
    ident = Identity.singleton("iam")
    ensure_pki(tmp_path, [ident], leaf_lifetime=dt.timedelta(days=10))
    serial = _cert(tmp_path, "iam").serial_number
    ca_before = (tmp_path / "ca.crt").read_bytes()
    ensure_pki(tmp_path, [ident])  # renew_before is 30 days > 10 days left
    renewed = _cert(tmp_path, "iam")
    assert renewed.serial_number != serial
    assert renewed.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=300)
    assert (tmp_path / "ca.crt").read_bytes() == ca_before


def test_reissues_leaf_missing_a_san_or_from_another_ca(tmp_path: Path) -> None:
    ensure_pki(tmp_path, [Identity.edge("ab12")])
    serial = _cert(tmp_path, "ab12").serial_number
    ensure_pki(tmp_path, [Identity.edge("ab12", ["node7.example"])])
    cert = _cert(tmp_path, "ab12")
    assert cert.serial_number != serial
    assert "node7.example" in _sans(cert).get_values_for_type(x509.DNSName)
    # A later caller that asks for fewer SANs keeps the richer certificate.
    ensure_pki(tmp_path, [Identity.edge("ab12")])
    assert _cert(tmp_path, "ab12").serial_number == cert.serial_number

    # A new CA (the old one was deleted) means every leaf is re-issued under it.
    (tmp_path / "ca.key").unlink()
    ensure_pki(tmp_path, [Identity.edge("ab12")])
    _cert(tmp_path, "ab12").verify_directly_issued_by(_cert(tmp_path, "ca"))


def test_damaged_key_is_replaced(tmp_path: Path) -> None:
    ensure_pki(tmp_path, [Identity.singleton("admin")])
    (tmp_path / "admin.key").write_text("garbage")
    ensure_pki(tmp_path, [Identity.singleton("admin")])
    _, key, cert = read_pki(tmp_path, "admin")
    assert b"PRIVATE KEY" in key
    assert b"CERTIFICATE" in cert


def test_concurrent_callers_agree(tmp_path: Path) -> None:
    ids = default_identities("zz99")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ensure_pki(tmp_path, ids)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ca = _cert(tmp_path, "ca")
    for ident in ids:
        _cert(tmp_path, ident.name).verify_directly_issued_by(ca)


def test_read_pki_missing_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="no certificate 'iam'"):
        read_pki(tmp_path, "iam")


def test_identity_validation_and_spiffe_parsing() -> None:
    with pytest.raises(InvalidArgument):
        Identity("root", "x")
    with pytest.raises(InvalidArgument):
        Identity("iam", "Bad_Name")
    with pytest.raises(InvalidArgument):
        Identity("admin", "ca")
    with pytest.raises(InvalidArgument):
        Identity.edge("toolong")
    assert parse_spiffe_id("spiffe://dsec/edge/ab12") == Identity("edge", "ab12")
    for bad in ("spiffe://other/edge/ab12", "spiffe://dsec/edge", "spiffe://dsec/x/y/z"):
        with pytest.raises(InvalidArgument):
            parse_spiffe_id(bad)


def test_names_must_be_unique_across_roles(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="two identities"):
        ensure_pki(tmp_path, [Identity("admin", "ops"), Identity("apiserver", "ops")])


def test_edge_id_created_once(tmp_path: Path) -> None:
    first = ensure_edge_id(tmp_path / "home")
    assert len(first) == 4
    assert first.isalnum()
    assert first == first.lower()
    assert ensure_edge_id(tmp_path / "home") == first
    assert (tmp_path / "home" / "edge.id").read_text().strip() == first
    (tmp_path / "home" / "edge.id").write_text("NOPE\n")
    with pytest.raises(InvalidArgument):
        ensure_edge_id(tmp_path / "home")


def test_node_pki(tmp_path: Path) -> None:
    edge_id = ensure_node_pki(tmp_path)
    assert (tmp_path / "pki" / f"{edge_id}.crt").exists()
    assert (tmp_path / "pki" / "apiserver.crt").exists()
