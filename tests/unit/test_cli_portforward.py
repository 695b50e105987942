"""``dsec sandbox port-forward``'s address spec and the SDK's TCP request."""

from __future__ import annotations

import json

import pytest

from dsec.cli.portforward import parse_spec
from dsec.core.errors import InvalidArgument
from dsec.sdk.tcp import tcp_request


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("8080:80", ("127.0.0.1", 8080, 80)),
        ("0:7000", ("127.0.0.1", 0, 7000)),
        ("0.0.0.0:8080:80", ("0.0.0.0", 8080, 80)),
        ("[::1]:8080:80", ("::1", 8080, 80)),
    ],
)
def test_specs(spec: str, want: tuple[str, int, int]) -> None:
    assert parse_spec(spec) == want


@pytest.mark.parametrize("spec", ["80", "a:80", "80:b", "8080:0", "70000:80", "1:65536", ""])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_spec(spec)


def test_tcp_request() -> None:
    msg = tcp_request(5432)
    assert msg[:1] == b"J"
    assert json.loads(msg[1:]) == {"op": "tcp", "port": 5432}
    for bad in (0, 65536, True, "80"):
        with pytest.raises(InvalidArgument):
            tcp_request(bad)  # type: ignore[arg-type]
