"""The registry client against a scripted transport: bearer tokens, error codes, digests."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import httpx
import pytest

from dsec.core.errors import (
    ImageNotFound,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
)
from dsec.edge.images.credentials import RegistrySettings
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.registry import OCI_MANIFEST, RegistryClient

MANIFEST = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": []}).encode()
DIGEST = "sha256:" + hashlib.sha256(MANIFEST).hexdigest()
BLOB = b"blob-content" * 1000
BLOB_DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()


def client_for(handler: object, settings: RegistrySettings | None = None) -> RegistryClient:
    c = RegistryClient(parse_reference("reg.test/team/app:v1"), settings or RegistrySettings())
    c._http = httpx.Client(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]
    return c


def test_bearer_token_flow_with_basic_credentials() -> None:
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(f"{req.method} {req.url.path}")
        if req.url.host == "auth.test":
            assert req.url.params["scope"] == "repository:team/app:pull"
            assert req.url.params["service"] == "reg"
            expected = "Basic " + base64.b64encode(b"amy:pw").decode()
            assert req.headers["authorization"] == expected
            return httpx.Response(200, json={"token": "T0K"})
        if req.headers.get("authorization") != "Bearer T0K":
            challenge = 'Bearer realm="https://auth.test/token",service="reg"'
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        return httpx.Response(
            200,
            content=MANIFEST,
            headers={"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": DIGEST},
        )

    with client_for(handler, RegistrySettings("amy", "pw")) as c:
        m = c.get_manifest("v1")
        assert m.digest == DIGEST
        c.get_manifest(DIGEST)  # the cached token is reused
    assert seen == [
        "GET /v2/team/app/manifests/v1",
        "GET /token",
        "GET /v2/team/app/manifests/v1",
        f"GET /v2/team/app/manifests/{DIGEST}",
    ]


@pytest.mark.parametrize(
    ("status", "error", "text"),
    [
        (401, Unauthenticated, "dsec registry login"),
        (403, PermissionDenied, "access denied"),
        (404, ImageNotFound, "MANIFEST_UNKNOWN"),
        (429, QuotaExceeded, "rate limited"),
    ],
)
def test_status_codes_map_to_errors(status: int, error: type[Exception], text: str) -> None:
    body = {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "nope"}]}

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    with client_for(handler) as c, pytest.raises(error, match=text):
        c.get_manifest("v1")


def test_manifest_digest_mismatch() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=MANIFEST, headers={"Content-Type": OCI_MANIFEST})

    with client_for(handler) as c, pytest.raises(InvalidArgument, match="expected"):
        c.get_manifest("sha256:" + "0" * 64)


def test_resume_with_range_and_server_ignoring_range(tmp_path: Path) -> None:
    ranges: list[str] = []
    honour = {"on": True}

    def handler(req: httpx.Request) -> httpx.Response:
        rng = req.headers.get("range", "")
        ranges.append(rng)
        if rng and honour["on"]:
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            return httpx.Response(206, content=BLOB[start:])
        return httpx.Response(200, content=BLOB)

    dest = tmp_path / "blob"
    part = tmp_path / "blob.part"
    with client_for(handler) as c:
        part.write_bytes(BLOB[:5000])
        c.download_blob(BLOB_DIGEST, dest, size=len(BLOB))
        assert dest.read_bytes() == BLOB
        honour["on"] = False
        dest.unlink()
        part.write_bytes(BLOB[:7000])
        c.download_blob(BLOB_DIGEST, dest, size=len(BLOB))
        assert dest.read_bytes() == BLOB
        dest.unlink()
        honour["on"] = True
        part.write_bytes(b"garbage")  # a bad kept prefix: the whole blob fails its digest
        with pytest.raises(InvalidArgument, match="nothing was stored"):
            c.download_blob(BLOB_DIGEST, dest, size=len(BLOB))
        assert not part.exists()
        assert not dest.exists()
    assert ranges[:2] == ["bytes=5000-", "bytes=7000-"]
