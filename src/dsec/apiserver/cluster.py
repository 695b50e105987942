"""Cluster membership: bootstrap tokens for joining nodes (platform admin)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM
from dsec.apiserver.context import ctx, json_body, ok, principal
from dsec.apiserver.roles import require_admin_on
from dsec.apiserver.upstream import rpc
from dsec.core.errors import InvalidArgument
from dsec.rpc._gen import dsec_pb2 as pb


async def create_join_token(request: web.Request) -> web.Response:
    """``POST /v1/cluster/tokens`` ``{"ttl_s"}``: a one-time token for ``dsec edge join``."""
    c, p = ctx(request), principal(request)
    require_admin_on(p, PLATFORM)
    body = await json_body(request)
    ttl = body.get("ttl_s", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
        raise InvalidArgument("'ttl_s' must be a whole number of seconds")
    md = (*p.metadata(), ("x-request-id", str(request.get("request_id", ""))))
    reply = await rpc("iam", c.upstream.iam.CreateJoinToken(
        pb.CreateJoinTokenRequest(ttl_s=ttl), metadata=md, timeout=10))  # fmt: skip
    return ok({"token": reply.token, "token_id": reply.token_id,
               "expires_at": reply.expires_at}, status=201)  # fmt: skip


ROUTES: list[tuple[str, str, Any]] = [("POST", "/v1/cluster/tokens", create_join_token)]
