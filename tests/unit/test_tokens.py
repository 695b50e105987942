"""Access tokens: signing, verification and revocation (pure)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dsec.core import tokens
from dsec.core.errors import InvalidArgument, Unauthenticated

KEY = Ed25519PrivateKey.generate()
KEYS = {"k1": KEY.public_key()}


def _claims(**over: object) -> tokens.Claims:
    base: dict[str, object] = {
        "subject": "alice",
        "project": "p",
        "role": "member",
        "key_id": "key1",
        "token_id": "t1",
        "issued_at": 1000.0,
        "expires_at": 1600.0,
    }
    base.update(over)
    return tokens.Claims(**base)  # type: ignore[arg-type]


def _tamper(token: str, **payload: object) -> str:
    h, p, s = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)))
    body.update(payload)
    raw = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    return f"{h}.{raw}.{s}"


def test_round_trip() -> None:
    tok = tokens.issue(_claims(), KEY, "k1")
    assert tokens.looks_like_token(tok)
    assert not tokens.looks_like_token("dsk_abc_def")
    assert tokens.verify(tok, KEYS, now=1100.0) == _claims()


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda t: _tamper(t, role="admin"), "signature"),
        (lambda t: _tamper(t, exp=99999.0), "signature"),
        (lambda t: t[:-4] + "AAAA", "signature"),
        (lambda t: "x.y", "malformed"),
        (lambda t: "!!!.???.###", "malformed"),
    ],
)
def test_forged_tokens_are_refused(mutate, why: str) -> None:
    with pytest.raises(Unauthenticated, match=why):
        tokens.verify(mutate(tokens.issue(_claims(), KEY, "k1")), KEYS, now=1100.0)


def test_wrong_key_algorithm_audience_and_time() -> None:
    other = Ed25519PrivateKey.generate()
    with pytest.raises(Unauthenticated, match="signature"):
        tokens.verify(tokens.issue(_claims(), other, "k1"), KEYS, now=1100.0)
    with pytest.raises(Unauthenticated, match="unknown key"):
        tokens.verify(tokens.issue(_claims(), KEY, "k2"), KEYS, now=1100.0)
    tok = tokens.issue(_claims(audience="someone-else"), KEY, "k1")
    with pytest.raises(Unauthenticated, match="audience"):
        tokens.verify(tok, KEYS, now=1100.0)
    tok = tokens.issue(_claims(), KEY, "k1")
    with pytest.raises(Unauthenticated, match="expired"):
        tokens.verify(tok, KEYS, now=1700.0)
    with pytest.raises(Unauthenticated, match="not valid yet"):
        tokens.verify(tok, KEYS, now=900.0)
    _h, p, _s = tok.split(".")
    none_header = base64.urlsafe_b64encode(b'{"alg":"none","kid":"k1"}').rstrip(b"=").decode()
    with pytest.raises(Unauthenticated, match="algorithm"):
        tokens.verify(f"{none_header}.{p}.", KEYS, now=1100.0)
    with pytest.raises(InvalidArgument):
        _claims(expires_at=1000.0 + 10 * tokens.MAX_TTL_S)


def test_revocation_set_and_staleness() -> None:
    rs = tokens.RevocationSet(confirmed_at=100.0)
    c = _claims()
    rs.check(c, now_monotonic=101.0, max_staleness_s=5)
    with pytest.raises(Unauthenticated, match="stale"):
        rs.check(c, now_monotonic=106.0, max_staleness_s=5)
    for kind, value, at in (
        ("token", "t1", 0.0),
        ("key", "key1", 0.0),
        ("subject", "alice", 1000.0),
    ):
        one = tokens.RevocationSet(confirmed_at=100.0)
        one.add(kind, value, at)
        with pytest.raises(Unauthenticated, match="revoked"):
            one.check(c, now_monotonic=101.0, max_staleness_s=5)
    later = tokens.RevocationSet(confirmed_at=100.0)
    later.add("subject", "alice", 999.0)  # revoked before this token was issued
    later.check(c, now_monotonic=101.0, max_staleness_s=5)


def test_verified_tokens_remember_until_expiry_and_forget_on_clear() -> None:
    cache = tokens.VerifiedTokens(max_entries=2)
    token = tokens.issue(_claims(), KEY, "k1")
    assert cache.verify(token, KEYS, now=1100.0) == _claims()
    assert cache.verify(token, {}, now=1200.0) == _claims()  # remembered: no key needed
    with pytest.raises(Unauthenticated, match="unknown key"):  # expired: checked afresh
        cache.verify(token, {}, now=1600.0 + tokens.LEEWAY_S + 1)
    with pytest.raises(Unauthenticated, match="expired"):
        cache.verify(token, KEYS, now=1600.0 + tokens.LEEWAY_S + 1)
    cache.verify(token, KEYS, now=1100.0)
    cache.clear()
    with pytest.raises(Unauthenticated, match="unknown key"):
        cache.verify(token, {}, now=1100.0)
    with pytest.raises(Unauthenticated, match="signature"):
        cache.verify(_tamper(token, role="admin"), KEYS, now=1100.0)
    others = [tokens.issue(_claims(token_id=f"t{i}"), KEY, "k1") for i in range(3)]
    for t in others:
        cache.verify(t, KEYS, now=1100.0)
    assert len(cache._claims) <= 2
