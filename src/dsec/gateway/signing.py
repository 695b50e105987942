"""Signed ``/files`` URLs (E2B's ``download_url``/``upload_url``).

The SDK signs a URL with the sandbox's ``envdAccessToken``:
``"v1_" + base64-without-padding(sha256("<path>:<read|write>:<username>:<token>[:<expiration>]"))``.
Checking one needs the token, and the URL carries no credential: in ``E2B_SANDBOX_URL`` mode
it does not even name the sandbox. So the token a sandbox gets is per sandbox,
``<sandbox id>~<caller's API key>`` (the key part is what the gateway calls OpenDsec with),
and the gateway remembers the tokens it handed out or was sent (:class:`Tokens`, bounded,
in memory). A signed URL is served for the token whose signature it carries; after a
gateway restart, a sandbox's URLs work again once the SDK has made any call for it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections import OrderedDict

from aiohttp import web

from dsec.core.errors import Unauthenticated
from dsec.core.ids import is_sandbox_id

SEPARATOR = "~"
MAX_TOKENS = 16384


def sandbox_token(sandbox_id: str, key: str) -> str:
    """The ``envdAccessToken`` of a sandbox for the caller with API key ``key``."""
    return f"{sandbox_id}{SEPARATOR}{key}"


def key_of(token: str) -> str:
    """The API key inside a sandbox token (a bare key is its own key)."""
    sid, sep, key = token.partition(SEPARATOR)
    return key if sep and key and is_sandbox_id(sid) else token


def sandbox_of(token: str) -> str | None:
    sid, sep, key = token.partition(SEPARATOR)
    return sid if sep and key and is_sandbox_id(sid) else None


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


class Tokens:
    """Sandbox tokens seen (handed out or sent), least recently seen dropped past a bound."""

    def __init__(self, limit: int = MAX_TOKENS) -> None:
        self._limit = limit
        self._tokens: OrderedDict[str, None] = OrderedDict()

    def add(self, token: str) -> None:
        if sandbox_of(token) is None:
            return
        self._tokens[token] = None
        self._tokens.move_to_end(token)
        while len(self._tokens) > self._limit:
            self._tokens.popitem(last=False)

    def verify(self, request: web.Request, sandbox_id: str | None) -> tuple[str, str]:
        """``(sandbox id, API key)`` a signed ``/files`` request is for.

        ``sandbox_id`` is the sandbox the request names (its Host), or None (then any
        remembered sandbox whose token made the signature).

        Raises:
            Unauthenticated: no signature, no token made it, or it has expired.
        """
        q = request.query
        sig = q.get("signature", "")
        if not sig:
            raise Unauthenticated("missing X-Access-Token or signature")
        raw_exp = q.get("signature_expiration", "")
        expiration = None
        if raw_exp:
            try:
                expiration = int(raw_exp)
            except ValueError:
                raise Unauthenticated("invalid signature_expiration") from None
        op = "write" if request.method == "POST" else "read"
        path, user = q.get("path", ""), q.get("username", "")
        for token in reversed(self._tokens):
            sid = sandbox_of(token)
            if sid is None or (sandbox_id is not None and sid != sandbox_id):
                continue
            expected = signature(path, op, user, token, expiration).encode()
            if hmac.compare_digest(expected, sig.encode("utf-8", "surrogatepass")):
                if expiration is not None and expiration < time.time():
                    raise Unauthenticated("signature is already expired")
                self.add(token)
                return sid, key_of(token)
        raise Unauthenticated("invalid signature")
