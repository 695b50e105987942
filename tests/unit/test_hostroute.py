"""Host-style routing: parsing ``<port>-<sandbox id>.<domain>`` and the web certificate."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from dsec.apiserver.hostroute import parse_host
from dsec.core.errors import InvalidArgument
from dsec.rpc.tls import Identity, ensure_pki, ensure_web_cert, web_ssl_context

SID = "sbx-ab12-abcdefghijklmnopqrst"


def test_parse_host() -> None:
    assert parse_host(f"8080-{SID}.dsec.test", "dsec.test") == (SID, 8080)
    assert parse_host(f"1-{SID}.DSEC.test:8443", "dsec.test") == (SID, 1)
    for other in ("dsec.test", "api.dsec.test", f"8080-{SID}.other.test", "127.0.0.1:80", "[::1]"):
        assert parse_host(other, "dsec.test") is None
    for bad in (f"0-{SID}.dsec.test", f"70000-{SID}.dsec.test", "80-nosuchid.dsec.test"):
        with pytest.raises(InvalidArgument):
            parse_host(bad, "dsec.test")


def _sans(path: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return sorted(ext.get_values_for_type(x509.DNSName))


def test_web_cert_is_issued_kept_and_reissued(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    with pytest.raises(Exception, match="no cluster CA"):
        ensure_web_cert(pki, "dsec.test")
    ensure_pki(pki, [Identity.singleton("apiserver")])
    cert, key = ensure_web_cert(pki, "dsec.test")
    assert _sans(cert) == ["*.dsec.test", "dsec.test"]
    assert key.stat().st_mode & 0o777 == 0o600
    first = cert.read_bytes()
    assert ensure_web_cert(pki, "dsec.test")[0].read_bytes() == first  # kept
    ensure_web_cert(pki, "other.example")
    assert _sans(cert) == ["*.other.example", "other.example"]  # re-issued
    parsed = x509.load_pem_x509_certificate(cert.read_bytes())
    sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert not sans.get_values_for_type(x509.UniformResourceIdentifier)  # never a mesh identity
    for bad in ("localhost", "test", "bad_name.test", "-x.test", ""):
        with pytest.raises(InvalidArgument):
            ensure_web_cert(pki, bad)


def test_tls_handshake_for_a_sandbox_host(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    ensure_pki(pki, [Identity.singleton("apiserver")])
    server_ctx = web_ssl_context(pki, "dsec.test")
    client_ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))

    async def main() -> None:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"ok")
            await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        async with server:
            r, w = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname=f"8000-{SID}.dsec.test"
            )
            assert await r.read() == b"ok"
            w.close()
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.open_connection(
                    "127.0.0.1", port, ssl=client_ctx, server_hostname="8000-x.elsewhere.test"
                )

    asyncio.run(main())
