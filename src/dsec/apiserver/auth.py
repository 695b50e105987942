"""Authentication and authorization of public API requests.

A request carries ``Authorization: Bearer <credential>``, either an API key (``dsk_...``,
checked by the iam, the answer cached for a few seconds) or an access token (a JWT signed
by the iam, checked here with the iam's public key: no round trip; its verified claims are
remembered until it expires, its revocation checked on every request). Both are subject to the
iam's revocation feed, which this apiserver follows every second; when it cannot confirm
its copy is current it refuses tokens instead of trusting them, and drops cached keys.
Roles are per project and inherited downward: ``viewer`` reads, ``member`` also creates
and drives sandboxes, ``admin`` also manages the quotas, keys and members of its subtree.
A request's roles are its key's (its project, its role) plus every grant of its subject
(:meth:`Iam.ListGrants`, cached for :data:`GRANTS_TTL_S`); a grant on ``*`` covers every
project (the bootstrap admin has admin there). Each route says which role it needs on
which project (:meth:`Principal.require_on`); for calls on a sandbox, whose project only
its edge knows, the apiserver forwards the projects on which the caller holds the needed
role (``x-dsec-scopes``) and those it may see (``x-dsec-visible``), and the edge decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dsec.apiserver.upstream import Upstream, rpc
from dsec.core import projects, tokens
from dsec.core.errors import DsecError, PermissionDenied, Unauthenticated
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb

_log = logging.getLogger("dsec.apiserver")

CACHE_TTL_S = 5.0
POLL_S = 1.0
MAX_STALENESS_S = 5.0
GRANTS_TTL_S = 2.0
_ROLES = {"viewer": 0, "member": 1, "admin": 2}
PLATFORM = "*"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, with every (project, role) they hold.

    One instance per request: :meth:`require` and :meth:`require_on` remember the highest
    role the route asked for, and :meth:`metadata` forwards the projects where the caller
    holds it.
    """

    subject: str
    project: str
    role: str
    key_id: str
    token_id: str = ""  # set when the caller used an access token
    grants: tuple[tuple[str, str], ...] = ()  # (project or "*", role), besides the key's own
    _needed: list[int] = field(default_factory=list, compare=False, repr=False)

    def _all(self) -> tuple[tuple[str, int], ...]:
        return _ranked(self.project, self.role, self.grants)

    def rank_on(self, project: str) -> int:
        """The caller's role on ``project`` (inherited from above) as 0-2, -1 for none."""
        return max(
            (r for p, r in self._all() if p == PLATFORM or projects.contains(p, project)),
            default=-1,
        )

    def scopes(self, role: str) -> list[str]:
        """The projects (roots of subtrees; ``*``: all) on which the caller has ``role``."""
        return list(_scopes(self._all(), _ROLES[role]))

    def require(self, role: str) -> None:
        """The caller must hold ``role`` somewhere (the edge checks where)."""
        if not self.scopes(role):
            raise PermissionDenied(f"this needs the {role} role; the key has {self.role}")
        self._needed.append(_ROLES[role])

    def require_on(self, project: str, role: str) -> None:
        """The caller must hold ``role`` on ``project`` (or above it)."""
        if self.rank_on(project) < _ROLES[role]:
            raise PermissionDenied(f"this needs the {role} role on project {project!r}")
        self._needed.append(_ROLES[role])

    @property
    def admin(self) -> bool:
        """A platform admin (admin on every project)."""
        return self.rank_on_platform() >= _ROLES["admin"]

    def rank_on_platform(self) -> int:
        return max((r for p, r in self._all() if p == PLATFORM), default=-1)

    def sees(self, project: str) -> bool:
        return self.rank_on(project) >= 0

    def for_request(self, grants: tuple[tuple[str, str], ...]) -> Principal:
        return Principal(self.subject, self.project, self.role, self.key_id, self.token_id,
                         grants)  # fmt: skip

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return _metadata(self.project, self.subject, self._all(), max(self._needed, default=0))


# A request's roles and the metadata they forward are worked out once per distinct caller
# (the same key, grants and needed role give the same answer), not on every request.
@functools.lru_cache(maxsize=4096)
def _ranked(
    project: str, role: str, grants: tuple[tuple[str, str], ...]
) -> tuple[tuple[str, int], ...]:
    return tuple((p, _ROLES[r]) for p, r in ((project, role), *grants) if r in _ROLES)


@functools.lru_cache(maxsize=4096)
def _scopes(ranked: tuple[tuple[str, int], ...], rank: int) -> tuple[str, ...]:
    return tuple(sorted({p for p, r in ranked if r >= rank}))


@functools.lru_cache(maxsize=4096)
def _metadata(
    project: str, subject: str, ranked: tuple[tuple[str, int], ...], needed: int
) -> tuple[tuple[str, str], ...]:
    scopes = _scopes(ranked, needed)
    return (
        ("x-dsec-project", project),
        ("x-dsec-subject", subject),
        ("x-dsec-role", "admin" if PLATFORM in scopes else "scoped"),
        ("x-dsec-scopes", ",".join(scopes)),
        ("x-dsec-visible", ",".join(_scopes(ranked, 0))),
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
        self._grants: dict[str, tuple[tuple[tuple[str, str], ...], float]] = {}
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._verified = tokens.VerifiedTokens()
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
            p = await self._from_token(credential)
        else:
            p = await self._from_key(credential)
        return p.for_request(await self._grants_of(p.subject))

    async def _grants_of(self, subject: str) -> tuple[tuple[str, str], ...]:
        now = time.monotonic()
        hit = self._grants.get(subject)
        if hit is not None and hit[1] > now:
            return hit[0]
        req = pb.ListGrantsRequest(subject=subject)
        reply = await rpc("iam", self._up.iam.ListGrants(req, timeout=5))
        grants = tuple((g.project, g.role) for g in reply.grants)
        if len(self._grants) > 10_000:
            self._grants.clear()
        self._grants[subject] = (grants, now + GRANTS_TTL_S)
        return grants

    async def _from_token(self, token: str) -> Principal:
        try:
            claims = self._verified.verify(token, self._keys, now=time.time())
        except Unauthenticated as exc:
            if "unknown key" not in exc.message:
                raise
            await self._load_keys()  # the iam may have a key we have not fetched yet
            claims = self._verified.verify(token, self._keys, now=time.time())
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

    def forget_grants(self, subject: str) -> None:
        """This apiserver sees a grant change at once; others within GRANTS_TTL_S."""
        self._grants.pop(subject, None)

    async def _load_keys(self) -> None:
        reply = await rpc("iam", self._up.iam.TokenKeys(pb.Empty(), timeout=5))
        self._keys = {k.kid: Ed25519PublicKey.from_public_bytes(k.public_key) for k in reply.keys}
        self._verified.clear()  # a key may have gone

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
