"""API key material: generation, hashing at rest and constant-time verification.

A key is ``dsk_<id>_<secret>`` (see :func:`dsec.core.ids.format_api_key`): a 12-character
lowercase id that is stored in clear and names the key, and a 43-character url-safe secret
(``secrets.token_urlsafe(32)``, 256 bits) of which only the SHA-256 is stored. A fast hash is
enough because the secret is random and long, not a password.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

from dsec.core.ids import format_api_key

KEY_ID_LEN = 12
_ID_ALPHABET = string.ascii_lowercase + string.digits
# Compared against when the key id is unknown, so a miss costs the same as a wrong secret.
_DUMMY_HASH = hashlib.sha256(b"dsec: no such key").hexdigest()


def new_key_id() -> str:
    """A fresh random key id: 12 characters of ``[a-z0-9]``."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(KEY_ID_LEN))


def new_api_key() -> tuple[str, str, str]:
    """Generate a key; returns (key id, secret hash to store, full key to hand out once)."""
    key_id = new_key_id()
    secret = secrets.token_urlsafe(32)
    return key_id, hash_secret(secret), format_api_key(key_id, secret)


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a key's secret: the only form in which it is stored."""
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(stored_hash: str | None, secret: str) -> bool:
    """Compare ``secret`` with a stored hash in constant time; ``None`` (no such key) never
    matches but takes as long as a real comparison."""
    expected = _DUMMY_HASH if stored_hash is None else stored_hash
    ok = hmac.compare_digest(expected.encode(), hash_secret(secret).encode())
    return ok and stored_hash is not None
