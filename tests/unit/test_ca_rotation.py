"""CA rotation on disk: the bundle, the signing CA, member checks, reloads and trust checks."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from dsec.core.errors import InvalidState, Unavailable
from dsec.iam.ca_rpcs import extra_sans
from dsec.rpc import reload, trust
from dsec.rpc.join import new_csr, sign_csr
from dsec.rpc.tls import (
    Identity,
    default_identities,
    ensure_pki,
    load_bundle,
    load_ca,
    web_ssl_context,
    write_leaf,
)


def _fp(path: Path) -> str:
    return trust.fingerprint(x509.load_pem_x509_certificate(path.read_bytes()))


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    d = tmp_path / "pki"
    ensure_pki(d, default_identities("ab12", ["edge1.example"]))
    return d


def _member(pki: Path, home: Path, name: str) -> Path:
    """A member's directory: the bundle and one leaf, no CA key (as after a join)."""
    d = home / "pki"
    write_leaf(
        d,
        name,
        (pki / f"{name}.key").read_bytes(),
        (pki / f"{name}.crt").read_bytes(),
        (pki / "ca.crt").read_bytes(),
    )
    return d


def test_rotation_trusts_both_then_only_the_new_ca(pki: Path) -> None:
    old = _fp(pki / "ca.crt")
    state = trust.begin_rotation(pki)
    assert state.rotating
    assert state.old_fingerprints == [old]
    bundle = load_bundle(pki / "ca.crt")
    assert [trust.fingerprint(c) for c in bundle] == [state.signing_fingerprint, old]
    assert trust.fingerprint(load_ca(pki)[1]) == state.signing_fingerprint != old
    with pytest.raises(InvalidState, match="already in progress"):
        trust.begin_rotation(pki)
    done = trust.finish_rotation(pki)
    assert not done.rotating
    assert [trust.fingerprint(c) for c in load_bundle(pki / "ca.crt")] == [done.signing_fingerprint]
    with pytest.raises(InvalidState, match="no CA rotation"):
        trust.finish_rotation(pki)


def test_a_member_without_a_ca_key_cannot_rotate(pki: Path, tmp_path: Path) -> None:
    member = _member(pki, tmp_path / "w", "watcher")
    with pytest.raises(Unavailable, match="no valid CA"):
        trust.begin_rotation(member)


def test_members_accept_either_ca_during_rotation_and_only_the_new_after(
    pki: Path, tmp_path: Path
) -> None:
    member = _member(pki, tmp_path / "w", "watcher")
    trust.begin_rotation(pki)
    shutil.copy2(pki / "ca.crt", member / "ca.crt")  # the bundle reached the member
    ensure_pki(member, [Identity.singleton("watcher")])  # old leaf, two-CA bundle: fine
    trust.finish_rotation(pki)
    shutil.copy2(pki / "ca.crt", member / "ca.crt")
    with pytest.raises(Unavailable, match="no valid certificate 'watcher'"):
        ensure_pki(member, [Identity.singleton("watcher")])


def test_ensure_pki_keeps_signing_with_the_key_it_has(pki: Path) -> None:
    """A crash after the bundle was written but before the key moved: the old CA still signs."""
    old_key = (pki / "ca.key").read_bytes()
    old = _fp(pki / "ca.crt")
    trust.begin_rotation(pki)
    (pki / "ca.key").write_bytes(old_key)
    assert trust.fingerprint(load_ca(pki)[1]) == old
    ensure_pki(pki, [Identity.singleton("iam")])  # no new CA is made from scratch
    assert old in [trust.fingerprint(c) for c in load_bundle(pki / "ca.crt")]
    assert len(load_bundle(pki / "ca.crt")) == 2


def test_an_interrupted_rotation_is_completed_by_running_it_again(pki: Path) -> None:
    trust.begin_rotation(pki)
    new_key = (pki / "ca.key").read_bytes()
    (pki / "ca.key.next").write_bytes(new_key)  # as if the final rename had not happened
    state = trust.begin_rotation(pki)
    assert not (pki / "ca.key.next").exists()
    assert (pki / "ca.key").read_bytes() == new_key
    assert state.rotating


def test_reissue_local_moves_only_the_named_leaves_to_the_signing_ca(pki: Path) -> None:
    before = {n: (pki / f"{n}.crt").read_bytes() for n in ("iam", "admin", "watcher")}
    state = trust.begin_rotation(pki)
    done = trust.reissue_local(pki, [Identity.singleton("iam"), Identity.singleton("admin")])
    assert sorted(done) == ["admin", "iam"]
    for name in ("iam", "admin"):
        pem = (pki / f"{name}.crt").read_bytes()
        assert pem != before[name]
        assert trust.issuer_fingerprint(pem, state.trusted) == state.signing_fingerprint
    assert (pki / "watcher.crt").read_bytes() == before["watcher"]
    assert trust.reissue_local(pki, [Identity.singleton("iam")]) == []  # idempotent


def test_renewal_keeps_the_edges_extra_sans(pki: Path) -> None:
    ident = Identity.edge("ab12", ["edge1.example", "10.0.0.7"])
    cert = x509.load_pem_x509_certificate((pki / "ab12.crt").read_bytes())
    assert extra_sans(cert, Identity.edge("ab12")) == ("edge1.example",)
    _, csr = new_csr("ab12")
    renewed, _ = sign_csr(pki, csr, ident)
    again = x509.load_pem_x509_certificate(renewed)
    assert set(extra_sans(again, Identity.edge("ab12"))) == {"edge1.example", "10.0.0.7"}


def test_local_view_names_trusted_cas_and_the_leaf_issuer(pki: Path, tmp_path: Path) -> None:
    member = _member(pki, tmp_path / "e", "ab12")
    old = _fp(pki / "ca.crt")
    assert trust.local_view(member, "ab12") == trust.LocalView((old,), old)
    state = trust.begin_rotation(pki)
    shutil.copy2(pki / "ca.crt", member / "ca.crt")
    assert trust.local_view(member, "ab12").trusted == (state.signing_fingerprint, old)
    trust.finish_rotation(pki)
    shutil.copy2(pki / "ca.crt", member / "ca.crt")
    assert trust.local_view(member, "ab12").leaf_issuer == ""  # issued by no trusted CA


def test_pki_files_skip_a_half_written_pair(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reload, "CHECK_EVERY_S", 0.0)
    member = _member(pki, tmp_path / "e", "ab12")
    files = reload.PkiFiles(member, "ab12")
    assert not files.changed()
    key_pem, csr = new_csr("ab12")
    cert_pem, _ = sign_csr(pki, csr, Identity.edge("ab12"))
    (member / "ab12.key").write_bytes(key_pem)  # the key is new, the certificate not yet
    assert not files.changed()
    (member / "ab12.crt").write_bytes(cert_pem)
    assert files.changed()
    assert (files.key, files.cert) == (key_pem, cert_pem)


def test_server_refuses_a_dropped_ca_on_existing_connections(
    pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reload, "CHECK_EVERY_S", 0.0)
    server = reload.ServerPki(pki, "iam")
    old_leaf = (pki / "ab12.crt").read_bytes()
    assert server.accepts(old_leaf)
    trust.begin_rotation(pki)
    trust.reissue_local(pki, [Identity.singleton("iam")])
    assert server.accepts(old_leaf)  # both CAs are trusted during the rotation
    assert server._fetch() is not None  # gRPC gets the new files although accepts() saw them
    assert server._fetch() is None
    _, csr = new_csr("ab12")
    new_leaf, _ = sign_csr(pki, csr, Identity.edge("ab12"))
    trust.finish_rotation(pki)
    assert server.accepts(new_leaf)
    assert not server.accepts(old_leaf)
    assert not server.accepts(b"not a certificate")


def test_the_web_certificate_follows_a_rotation_without_restart(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    ensure_pki(pki, [Identity.singleton("apiserver")])
    server_ctx = web_ssl_context(pki, "dsec.test")

    async def issuer(port: int) -> str:
        client = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        _, w = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="api.dsec.test"
        )
        der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
        w.close()
        cert = x509.load_der_x509_certificate(der)
        ca = trust.issuer_of(cert, load_bundle(pki / "ca.crt"))
        return trust.fingerprint(ca) if ca is not None else ""

    async def main() -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        async with server:
            old = _fp(pki / "ca.crt")
            assert await issuer(port) == old
            state = trust.begin_rotation(pki)
            await asyncio.sleep(1.1)  # the files are checked at most once a second
            assert await issuer(port) == state.signing_fingerprint

    asyncio.run(main())
