"""Authentication and authorization of public API requests.

A request carries ``Authorization: Bearer <credential>``, either an API key (``dsk_...``,
checked by the iam, the answer cached for a few seconds) or an access token (a JWT signed
by the iam, checked here with the iam's public key: no round trip). Both are subject to the
iam's revocation feed, which this apiserver follows every second; when it cannot confirm
its copy is current it refuses tokens instead of trusting them, and drops cached keys.
Roles: ``viewer`` reads, ``member`` also creates and drives sandboxes of its project,
``admin`` does everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dsec.apiserver.upstream import Upstream, rpc
from dsec.core import tokens
from dsec.core.errors import DsecError, PermissionDenied, Unauthenticated
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb

_log = logging.getLogger("dsec.apiserver")

CACHE_TTL_S = 5.0
POLL_S = 1.0
MAX_STALENESS_S = 5.0
_ROLES = {"viewer": 0, "member": 1, "admin": 2}


@dataclass(frozen=True, slots=True)
class Principal:
    subject: str
    project: str
    role: str
    key_id: str
    token_id: str = ""  # set when the caller used an access token

    def require(self, role: str) -> None:
        if _ROLES.get(self.role, -1) < _ROLES[role]:
            raise PermissionDenied(f"this needs the {role} role; the key has {self.role}")

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            ("x-dsec-project", self.project),
            ("x-dsec-subject", self.subject),
            ("x-dsec-role", self.role),
        )


def bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("missing credentials: send 'Authorization: Bearer <key or token>'")
    return token.strip()


class Authenticator:
    def __init__(self, upstream: Upstream, *, max_staleness_s: float = MAX_STALENESS_S) -> None:
        self._up = upstream
        self._cache: dict[str, tuple[Principal, float]] = {}
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._revoked = tokens.RevocationSet()
        self._max_staleness = max_staleness_s
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._follow_revocations())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    async def principal(self, request: web.Request) -> Principal:
        # host-style routing may have found it in a cookie or query parameter (hostroute.py)
        credential = request.get("credential") or bearer(request)
        if tokens.looks_like_token(credential):
            return await self._from_token(credential)
        return await self._from_key(credential)

    async def _from_token(self, token: str) -> Principal:
        try:
            claims = tokens.verify(token, self._keys, now=time.time())
        except Unauthenticated as exc:
            if "unknown key" not in exc.message:
                raise
            await self._load_keys()  # the iam may have a key we have not fetched yet
            claims = tokens.verify(token, self._keys, now=time.time())
        self._revoked.check(claims, now_monotonic=time.monotonic(),
                            max_staleness_s=self._max_staleness)  # fmt: skip
        return Principal(claims.subject, claims.project, claims.role, claims.key_id,
                         claims.token_id)  # fmt: skip

    async def _from_key(self, api_key: str) -> Principal:
        now = time.monotonic()
        hit = self._cache.get(api_key)
        if hit is not None and hit[1] > now and now - self._revoked.confirmed_at < CACHE_TTL_S:
            return hit[0]
        req = pb.AuthenticateRequest(api_key=api_key)
        reply = await rpc("iam", self._up.iam.Authenticate(req, timeout=5))
        p = Principal(reply.subject, reply.project, reply.role, reply.key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[api_key] = (p, now + CACHE_TTL_S)
        return p

    def forget(self) -> None:
        self._cache.clear()

    async def _load_keys(self) -> None:
        reply = await rpc("iam", self._up.iam.TokenKeys(pb.Empty(), timeout=5))
        self._keys = {k.kid: Ed25519PublicKey.from_public_bytes(k.public_key) for k in reply.keys}

    async def poll_revocations(self) -> None:
        """Fetch the feed after what we know; on success the copy counts as current."""
        started = time.monotonic()
        req = pb.RevocationsRequest(after_seq=self._revoked.last_seq)
        reply = await rpc("iam", self._up.iam.Revocations(req, timeout=5))
        for e in reply.entries:
            self._revoked.add(e.kind, e.value, e.at)
            self._revoked.last_seq = max(self._revoked.last_seq, e.seq)
            if e.kind in ("key", "subject"):
                attr = "key_id" if e.kind == "key" else "subject"
                self._cache = {
                    k: v for k, v in self._cache.items() if getattr(v[0], attr) != e.value
                }
        self._revoked.confirmed_at = started

    async def _follow_revocations(self) -> None:
        while True:
            try:
                if not self._keys:
                    await self._load_keys()
                await self.poll_revocations()
            except DsecError as exc:
                log(_log, "revocation feed unavailable", logging.WARNING, error=exc.message)
            await asyncio.sleep(POLL_S)
