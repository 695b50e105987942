"""Authentication and authorization of public API requests.

An API key (``Authorization: Bearer dsk_...``) is checked by iam; the answer is cached for
a few seconds so the hot path (exec) costs no extra round trip. Roles: ``viewer`` reads,
``member`` also creates and drives sandboxes of its project, ``admin`` does everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from dsec.apiserver.upstream import Upstream, rpc
from dsec.core.errors import PermissionDenied, Unauthenticated
from dsec.rpc._gen import dsec_pb2 as pb

CACHE_TTL_S = 5.0
_ROLES = {"viewer": 0, "member": 1, "admin": 2}


@dataclass(frozen=True, slots=True)
class Principal:
    subject: str
    project: str
    role: str
    key_id: str

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


class Authenticator:
    def __init__(self, upstream: Upstream) -> None:
        self._up = upstream
        self._cache: dict[str, tuple[Principal, float]] = {}

    async def principal(self, request: web.Request) -> Principal:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        token = token.strip()
        now = time.monotonic()
        hit = self._cache.get(token)
        if hit is not None and hit[1] > now:
            return hit[0]
        reply = await rpc(
            "iam", self._up.iam.Authenticate(pb.AuthenticateRequest(api_key=token), timeout=5)
        )
        p = Principal(reply.subject, reply.project, reply.role, reply.key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[token] = (p, now + CACHE_TTL_S)
        return p

    def forget(self) -> None:
        self._cache.clear()
