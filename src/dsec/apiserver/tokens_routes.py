"""Access tokens: exchange an API key for a short-lived token; revoke tokens, keys, users."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM, bearer
from dsec.apiserver.context import ctx, json_body, ok, principal
from dsec.apiserver.roles import require_admin_on, require_governs, require_key_admin
from dsec.core import tokens
from dsec.core.errors import InvalidArgument, PermissionDenied
from dsec.rpc._gen import dsec_pb2 as pb


async def create_token(request: web.Request) -> web.Response:
    """Exchange the API key of this request for a short-lived access token."""
    c, p = ctx(request), principal(request)
    if p.token_id:
        raise PermissionDenied("tokens are issued for API keys: authenticate with your key")
    body = await json_body(request)
    ttl = body.get("ttl_s", tokens.DEFAULT_TTL_S)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= tokens.MAX_TTL_S:
        raise InvalidArgument(f"ttl_s must be an integer from 1 to {tokens.MAX_TTL_S}")
    reply = await c.upstream.iam.IssueToken(
        pb.IssueTokenRequest(api_key=bearer(request), ttl_s=ttl), timeout=10
    )
    return ok({"token": reply.token, "token_id": reply.token_id,
               "expires_at": reply.expires_at}, status=201)  # fmt: skip


async def revoke(request: web.Request) -> web.Response:
    """Revoke a token (by id), an API key, or everything of a subject (admin)."""
    c, p = ctx(request), principal(request)
    body = await json_body(request)
    kind, value = body.get("kind"), body.get("value")
    if not isinstance(kind, str) or not isinstance(value, str):
        raise InvalidArgument("'kind' (token, key or subject) and 'value' must be strings")
    own_token = kind == "token" and value == p.token_id
    if kind == "key":
        await require_key_admin(c, p, value)
    elif kind == "subject":
        await require_governs(c, p, value)
    elif not own_token:
        require_admin_on(p, PLATFORM)
    md = (*p.metadata(), ("x-request-id", str(request.get("request_id", ""))))
    await c.upstream.iam.Revoke(pb.RevokeRequest(kind=kind, value=value), metadata=md,
                                timeout=10)  # fmt: skip
    await c.auth.poll_revocations()  # this apiserver applies it at once; others within ~1 s
    if kind != "token":
        c.auth.forget()
    return ok({})


ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/tokens", create_token),
    ("POST", "/v1/revocations", revoke),
]
