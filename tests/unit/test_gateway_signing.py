"""Signed /files URLs: our check against the signatures the real e2b SDK makes."""

from __future__ import annotations

import urllib.parse
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from dsec.core.errors import Unauthenticated
from dsec.gateway import signing

e2b_signature = pytest.importorskip("e2b.sandbox.signature", reason="e2b is a dev dependency")

SID_A = "sbx-e0a1-" + "a" * 20
SID_B = "sbx-e0a1-" + "b" * 20


def _request(method: str, path: str, user: str | None, sig: Any) -> web.Request:
    query = {"path": path, "signature": sig["signature"]}
    if user:
        query["username"] = user
    if sig["expiration"]:
        query["signature_expiration"] = str(sig["expiration"])
    qs = urllib.parse.urlencode(query, quote_via=urllib.parse.quote)
    return make_mocked_request(method, f"/files?{qs}")


def test_tokens_name_their_sandbox_and_key() -> None:
    token = signing.sandbox_token(SID_A, "dsk_key.part")
    assert signing.key_of(token) == "dsk_key.part"
    assert signing.sandbox_of(token) == SID_A
    assert signing.key_of("dsk_plain") == "dsk_plain"  # a bare key is its own key
    assert signing.sandbox_of("not-a-sandbox~key") is None


def test_verify_finds_the_signing_sandbox_and_refuses_the_rest() -> None:
    tokens = signing.Tokens()
    ta, tb = signing.sandbox_token(SID_A, "ka"), signing.sandbox_token(SID_B, "kb")
    tokens.add(ta)
    tokens.add(tb)
    sig = e2b_signature.get_signature("/tmp/x y.txt", "read", None, tb)
    assert tokens.verify(_request("GET", "/tmp/x y.txt", None, sig), None) == (SID_B, "kb")
    assert tokens.verify(_request("GET", "/tmp/x y.txt", None, sig), SID_B) == (SID_B, "kb")
    with pytest.raises(Unauthenticated, match="invalid signature"):
        tokens.verify(_request("GET", "/tmp/x y.txt", None, sig), SID_A)  # another host
    with pytest.raises(Unauthenticated, match="invalid signature"):
        tokens.verify(_request("GET", "/etc/passwd", None, sig), None)  # another path
    with pytest.raises(Unauthenticated, match="invalid signature"):
        tokens.verify(_request("POST", "/tmp/x y.txt", None, sig), None)  # another operation
    with pytest.raises(Unauthenticated, match="invalid signature"):
        tokens.verify(_request("GET", "/tmp/x y.txt", "root", sig), None)  # another user
    up = e2b_signature.get_signature("/tmp/u", "write", "root", ta, 60)
    assert tokens.verify(_request("POST", "/tmp/u", "root", up), None) == (SID_A, "ka")
    old = e2b_signature.get_signature("/tmp/u", "read", None, ta, -5)
    with pytest.raises(Unauthenticated, match="signature is already expired"):
        tokens.verify(_request("GET", "/tmp/u", None, old), None)
    with pytest.raises(Unauthenticated, match="missing"):
        tokens.verify(make_mocked_request("GET", "/files?path=/tmp/u"), None)
    # a cut or edited URL can leave an escape that decodes to a non-ASCII character
    bad = make_mocked_request("GET", "/files?path=/tmp/u&signature=v1_%C3%A9%AAA")
    with pytest.raises(Unauthenticated, match="invalid signature"):
        tokens.verify(bad, None)


def test_tokens_are_bounded_and_bare_keys_are_not_kept() -> None:
    tokens = signing.Tokens(limit=2)
    tokens.add("dsk_bare")
    first = signing.sandbox_token(SID_A, "k1")
    tokens.add(first)
    tokens.add(signing.sandbox_token(SID_B, "k2"))
    tokens.add(signing.sandbox_token(SID_B, "k3"))
    sig = e2b_signature.get_signature("/f", "read", None, first)
    with pytest.raises(Unauthenticated):  # the oldest was dropped
        tokens.verify(_request("GET", "/f", None, sig), None)
