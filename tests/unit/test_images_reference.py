"""Image references, platform selection and registry credentials (no network)."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument
from dsec.edge.images.credentials import RegistryCredentials, RegistrySettings
from dsec.edge.images.pull import select_platform
from dsec.edge.images.reference import parse_reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("python", "docker.io", "library/python", "latest", ""),
        ("python:3.12", "docker.io", "library/python", "3.12", ""),
        ("me/app:v1", "docker.io", "me/app", "v1", ""),
        ("ghcr.io/o/r/x:1.0", "ghcr.io", "o/r/x", "1.0", ""),
        ("127.0.0.1:5000/sbx/app", "127.0.0.1:5000", "sbx/app", "latest", ""),
        ("localhost/app:t", "localhost", "app", "t", ""),
        (f"reg.io:443/a@{DIGEST}", "reg.io:443", "a", "", DIGEST),
        (f"reg.io/a:t@{DIGEST}", "reg.io", "a", "t", DIGEST),
    ],
)
def test_parse_reference(text: str, registry: str, repo: str, tag: str, digest: str) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)
    assert ref.selector == (digest or tag)
    assert parse_reference(ref.name) == ref


def test_docker_hub_api_host() -> None:
    assert parse_reference("python").api_host == "registry-1.docker.io"
    assert parse_reference("reg.io/a").api_host == "reg.io"


@pytest.mark.parametrize(
    "text", ["", "UPPER/case", "a b", "reg.io/a@sha256:12", "a:bad tag", "reg.io/../x", "a//b"]
)
def test_bad_references(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_reference(text)


def test_select_platform() -> None:
    index = {
        "manifests": [
            {"digest": "sha256:1", "platform": {"os": "linux", "architecture": "amd64"}},
            {
                "digest": "sha256:2",
                "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"},
            },
            {"digest": "sha256:3", "platform": {"os": "unknown", "architecture": "unknown"}},
        ]
    }
    assert select_platform(index, "linux/amd64")["digest"] == "sha256:1"
    assert select_platform(index, "linux/arm64")["digest"] == "sha256:2"
    assert select_platform(index, "linux/arm64/v8")["digest"] == "sha256:2"
    with pytest.raises(ImageNotFound, match="available: linux/amd64, linux/arm64/v8"):
        select_platform(index, "linux/s390x")
    with pytest.raises(InvalidArgument):
        select_platform(index, "linux")


def test_credentials_file_and_docker_config(tmp_path: Path) -> None:
    own = tmp_path / "registries.json"
    docker = tmp_path / "config.json"
    auth = base64.b64encode(b"bob:pw:with:colons").decode()
    docker.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": auth},
                    "reg.io": {"auth": "!!notbase64"},
                }
            }
        )
    )
    creds = RegistryCredentials(own, [docker])
    assert creds.lookup("docker.io") == RegistrySettings("bob", "pw:with:colons")
    assert creds.lookup("reg.io") == RegistrySettings()
    creds.save("reg.io", RegistrySettings("amy", "x", insecure=True))
    assert stat.S_IMODE(own.stat().st_mode) == 0o600
    assert creds.lookup("reg.io") == RegistrySettings("amy", "x", insecure=True)
    assert creds.remove("reg.io")
    assert not creds.remove("reg.io")
    own.write_text("{not json")
    with pytest.raises(InvalidArgument, match="cannot read registry settings"):
        creds.lookup("reg.io")
