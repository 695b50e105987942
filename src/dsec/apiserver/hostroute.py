"""Host-style routing: ``<port>-<sandbox id>.<domain>`` reaches ``port`` in that sandbox.

With ``--domain`` set, a request whose Host names a sandbox port is forwarded there whatever
its path (HTTP and WebSocket alike, see ``ports.py``); every other Host gets the API.
Authentication is the API's, with two additions for browser-style clients that cannot set
an ``Authorization`` header:

* ``?dsec_token=<access token>`` (a short-lived token from ``POST /v1/tokens``, never an API
  key, which would end up in browser history and logs). On a GET the apiserver answers
  with a redirect to the same URL without it and sets the token as an HttpOnly cookie for
  that host, so the page's later requests (assets, XHR, WebSockets) carry it; a WebSocket
  handshake may use the parameter directly.
* the ``dsec_token`` cookie set that way.

Neither the parameter, the cookie nor ``Authorization`` is passed to the sandbox's server.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie

from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from dsec.apiserver import ports, upgrade
from dsec.apiserver.context import ctx
from dsec.core import tokens
from dsec.core.errors import InvalidArgument, Unauthenticated
from dsec.core.ids import is_sandbox_id

TOKEN_PARAM = "dsec_token"
COOKIE = "dsec_token"
CREDENTIAL = "credential"  # request key: the credential found here, used by the authenticator
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9-]{1,63})$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_host(host: str, domain: str) -> tuple[str, int] | None:
    """``(sandbox id, port)`` if ``host`` (port suffix allowed) is ``<port>-<id>.<domain>``."""
    name = host.lower().rsplit(":", 1)[0] if not host.startswith("[") else ""
    suffix = "." + domain.lower()
    if not name.endswith(suffix):
        return None
    m = _HOST_RE.match(name[: -len(suffix)])
    if m is None:
        return None
    port, sid = int(m.group(1)), m.group(2)
    if not 1 <= port <= 65535 or not is_sandbox_id(sid):
        raise InvalidArgument(f"{name!r} does not name a sandbox port (<port>-<sandbox id>)")
    return sid, port


def _cookie_token(request: web.Request) -> str:
    raw = request.headers.get("Cookie", "")
    if COOKIE not in raw:
        return ""
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:
        return ""
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else ""


def _without_ours(request: web.Request) -> web.Request:
    """The request minus our query parameter and cookie (the server must not see them)."""
    headers = CIMultiDict(request.headers)
    if COOKIE in headers.get("Cookie", ""):
        kept = [
            c.strip()
            for c in headers.getone("Cookie").split(";")
            if c.strip() and not c.strip().startswith(COOKIE + "=")
        ]
        del headers["Cookie"]
        if kept:
            headers["Cookie"] = "; ".join(kept)
    rel = request.rel_url
    if TOKEN_PARAM in rel.query:
        rel = rel.without_query_params(TOKEN_PARAM)
    return request.clone(headers=headers, rel_url=rel)


def credential(request: web.Request) -> tuple[str, bool]:
    """The caller's credential and whether it came from the query (needs the redirect)."""
    auth = request.headers.get("Authorization", "")
    if auth:
        return "", False  # the authenticator reads the header itself
    from_query = request.query.get(TOKEN_PARAM, "")
    if from_query:
        if not tokens.looks_like_token(from_query):
            raise Unauthenticated(
                f"?{TOKEN_PARAM}= takes an access token (POST /v1/tokens), not an API key"
            )
        return from_query, True
    return _cookie_token(request), False


def middleware(domain: str, inner: Middleware) -> Middleware:
    """The outermost middleware: host-routed requests skip the router, then ``inner``
    (authentication, audit, errors) runs around the forward as for any API call."""

    @web.middleware
    async def host_routing(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            target = parse_host(request.host, domain)
            if target is None:
                return await handler(request)
            cred, from_query = credential(request)
        except (InvalidArgument, Unauthenticated) as exc:
            return web.json_response({"error": exc.to_wire()}, status=exc.http_status)
        sid, port = target
        clean = _without_ours(request)
        if cred:
            clean[CREDENTIAL] = cred

        async def forward(req: web.Request) -> web.StreamResponse:
            if from_query and req.method in ("GET", "HEAD") and not upgrade.is_upgrade(req):
                # authenticated: trade the token in the URL for a cookie on this host
                resp = web.Response(status=303, headers={"Location": str(clean.rel_url)})
                resp.set_cookie(
                    COOKIE, cred, httponly=True, secure=request.secure, samesite="Lax", path="/"
                )
                return resp
            if "principal" not in req:  # a path the API serves without a key: not here
                req["principal"] = await ctx(req).auth.principal(req)
            return await ports.forward(req, sid, port, req.path)

        return await inner(clean, forward)

    return host_routing
