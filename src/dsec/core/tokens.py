"""Short-lived signed access tokens, verified locally by every apiserver.

An API key (long-lived, stored hashed by the iam) is exchanged for an access token: a JWT
(``header.payload.signature``, base64url) signed with the iam's Ed25519 key (``EdDSA``).
Verification needs only the iam's public key, so the hot path has no round trip. Tokens are
revocable: the iam publishes a revocation feed (a token id, a whole API key, or everything a
subject was issued before a time) that apiservers follow; one that cannot confirm its copy
of the feed is current refuses tokens rather than trust them (see
:class:`RevocationSet`). Pure: keys, time and the revocation set come in as arguments.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dsec.core.errors import InvalidArgument, Unauthenticated

AUDIENCE = "dsec-api"
ISSUER = "dsec-iam"
MAX_TTL_S = 3600
DEFAULT_TTL_S = 600
_HEADER_FIELDS = ("alg", "typ", "kid")
LEEWAY_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Claims:
    subject: str
    project: str
    role: str
    key_id: str  # the API key the token was exchanged for
    token_id: str  # jti
    issued_at: float
    expires_at: float
    audience: str = AUDIENCE

    def __post_init__(self) -> None:
        if self.expires_at <= self.issued_at:
            raise InvalidArgument("a token must expire after it is issued")
        if self.expires_at - self.issued_at > MAX_TTL_S + 1:
            raise InvalidArgument(f"tokens live at most {MAX_TTL_S} s")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        raise Unauthenticated("malformed access token") from None


def issue(claims: Claims, key: Ed25519PrivateKey, kid: str) -> str:
    header = {"alg": "EdDSA", "typ": "JWT", "kid": kid}
    payload = {
        "iss": ISSUER, "aud": claims.audience, "sub": claims.subject, "prj": claims.project,
        "role": claims.role, "kid": claims.key_id, "jti": claims.token_id,
        "iat": claims.issued_at, "exp": claims.expires_at,
    }  # fmt: skip
    signing_input = ".".join(
        _b64(json.dumps(part, separators=(",", ":"), sort_keys=True).encode())
        for part in (header, payload)
    )
    return f"{signing_input}.{_b64(key.sign(signing_input.encode()))}"


def looks_like_token(value: str) -> bool:
    return value.count(".") == 2 and not value.startswith("dsk_")


def verify(
    token: str, keys: dict[str, Ed25519PublicKey], *, now: float, audience: str = AUDIENCE,
    leeway_s: float = LEEWAY_S,
) -> Claims:  # fmt: skip
    """Check signature, issuer, audience and lifetime; raise Unauthenticated saying why."""
    parts = token.split(".")
    if len(parts) != 3:
        raise Unauthenticated("malformed access token")
    try:
        header = json.loads(_unb64(parts[0]))
        payload = json.loads(_unb64(parts[1]))
    except ValueError:
        raise Unauthenticated("malformed access token") from None
    if not isinstance(header, dict) or not isinstance(payload, dict):
        raise Unauthenticated("malformed access token")
    if header.get("alg") != "EdDSA":  # pinned: never "none", never an HMAC confusion
        raise Unauthenticated("access token uses an unsupported algorithm")
    key = keys.get(str(header.get("kid", "")))
    if key is None:
        raise Unauthenticated("access token signed by an unknown key")
    try:
        key.verify(_unb64(parts[2]), f"{parts[0]}.{parts[1]}".encode())
    except InvalidSignature:
        raise Unauthenticated("access token signature is invalid") from None
    if payload.get("iss") != ISSUER or payload.get("aud") != audience:
        raise Unauthenticated("access token is for another audience")
    try:
        claims = Claims(
            subject=str(payload["sub"]), project=str(payload["prj"]), role=str(payload["role"]),
            key_id=str(payload["kid"]), token_id=str(payload["jti"]),
            issued_at=float(payload["iat"]), expires_at=float(payload["exp"]),
            audience=str(payload["aud"]),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, InvalidArgument):
        raise Unauthenticated("malformed access token claims") from None
    if now > claims.expires_at + leeway_s:
        raise Unauthenticated("access token expired")
    if now + leeway_s < claims.issued_at:
        raise Unauthenticated("access token is not valid yet")
    return claims


class VerifiedTokens:
    """:func:`verify` with its answers remembered until each token expires: a client sends
    the same token with every request, and its signature, which cannot change, costs the
    most to check. Revocation is not cached: check every use against a
    :class:`RevocationSet`. Forget everything (:meth:`clear`) when the keys change."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._claims: dict[str, Claims] = {}
        self._max = max_entries

    def verify(self, token: str, keys: dict[str, Ed25519PublicKey], *, now: float) -> Claims:
        claims = self._claims.get(token)
        if claims is not None and now <= claims.expires_at + LEEWAY_S:
            return claims
        self._claims.pop(token, None)
        claims = verify(token, keys, now=now)
        if len(self._claims) >= self._max:
            self._claims.clear()
        self._claims[token] = claims
        return claims

    def clear(self) -> None:
        self._claims.clear()


@dataclass
class RevocationSet:
    """What the revocation feed said, and when that was last confirmed current."""

    tokens: set[str] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    subjects: dict[str, float] = field(default_factory=dict)  # revoked if issued before
    last_seq: int = 0
    confirmed_at: float = 0.0  # local monotonic time of the last successful poll

    def add(self, kind: str, value: str, at: float) -> None:
        if kind == "token":
            self.tokens.add(value)
        elif kind == "key":
            self.keys.add(value)
        elif kind == "subject":
            self.subjects[value] = max(at, self.subjects.get(value, 0.0))

    def check(self, claims: Claims, *, now_monotonic: float, max_staleness_s: float) -> None:
        """Raise Unauthenticated if revoked, or if the feed is too stale to tell."""
        if now_monotonic - self.confirmed_at > max_staleness_s:
            raise Unauthenticated(
                "cannot confirm the token was not revoked (revocation feed is stale); "
                "retry, or use an API key"
            )
        if claims.token_id in self.tokens or claims.key_id in self.keys:
            raise Unauthenticated("access token was revoked")
        if claims.issued_at <= self.subjects.get(claims.subject, -1.0):
            raise Unauthenticated("access token was revoked (all of its subject's tokens)")
