"""Host-style routing on the apiserver: ``https://<port>-<sandbox id>.dsec.test`` reaches a
server in the sandbox (HTTP and WebSocket), over TLS with a certificate of the cluster CA,
with the API's authentication (header, or an access token in the URL traded for a cookie)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as ws_connect

from dsec.apiserver.ports import CONNECT_TIMEOUT_S
from dsec.apiserver.upgrade import ANSWER_TIMEOUT_S
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform
from tests.e2e.hostnet import DOMAIN, domain_apiserver, resolve_domain_locally
from tests.e2e.test_ports import HTTP_PORT, WS_PORT, start_servers, start_ws_server


@pytest.fixture(scope="module")
def domain_api(platform: RunningPlatform) -> Iterator[tuple[str, int]]:
    with domain_apiserver(platform) as where:
        yield where


@pytest.fixture
def served(sbx: Sandbox) -> Sandbox:
    return start_ws_server(start_servers(sbx))


@pytest.fixture
def tls(platform: RunningPlatform, monkeypatch: pytest.MonkeyPatch) -> Iterator[ssl.SSLContext]:
    ctx = ssl.create_default_context(cafile=str(platform.paths.home / "pki" / "ca.crt"))
    with resolve_domain_locally(monkeypatch):
        yield ctx


def _url(sbx: Sandbox, port: int, tls_port: int, path: str = "/") -> str:
    return f"https://{port}-{sbx.id}.{DOMAIN}:{tls_port}{path}"


# Longer than the apiserver's own bounds on reaching the port and on the server's answer:
# a server that does not answer fails the test with the apiserver's 504 and its reason.
# (A shorter client timeout fails no sooner: websockets' client cannot close a TLS
# connection whose handshake timed out until the apiserver answers or gives up.)
OPEN_TIMEOUT_S = CONNECT_TIMEOUT_S + ANSWER_TIMEOUT_S + 10


def _open_ws(url: str, tls: ssl.SSLContext, **kwargs: Any) -> ClientConnection:
    try:
        ws: ClientConnection = ws_connect(
            url, ssl=tls, open_timeout=OPEN_TIMEOUT_S, close_timeout=5, **kwargs
        )
        return ws
    except InvalidStatus as exc:
        r = exc.response
        pytest.fail(f"the WebSocket handshake to {url} was answered {r.status_code}: {r.body!r}")


def test_https_to_a_sandbox_port_by_host(
    served: Sandbox,
    domain_api: tuple[str, int],
    tls: ssl.SSLContext,
    platform: RunningPlatform,
) -> None:
    _, tls_port = domain_api
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    url = _url(served, HTTP_PORT, tls_port, "/hello.txt")
    r = httpx.get(url, headers=auth, verify=tls)
    assert r.status_code == 200
    assert r.text == "hello from the sandbox\n"
    assert httpx.get(url, verify=tls).status_code == 401  # same auth as the API
    # paths the API serves without a key are no exception on a sandbox host
    assert httpx.get(_url(served, HTTP_PORT, tls_port, "/healthz"), verify=tls).status_code == 401
    # the API itself on the TLS listener, by any other name
    info = f"https://{DOMAIN}:{tls_port}/v1/sandboxes/{served.id}"
    assert httpx.get(info, headers=auth, verify=tls).json()["id"] == served.id
    bad = httpx.get(f"https://80-nosuchsandbox.{DOMAIN}:{tls_port}/", headers=auth, verify=tls)
    assert bad.status_code == 400
    with pytest.raises(httpx.ConnectError):  # the certificate is not trusted without the CA
        httpx.get(url, headers=auth)


def test_browser_style_access_token_in_the_url_becomes_a_cookie(
    served: Sandbox,
    domain_api: tuple[str, int],
    tls: ssl.SSLContext,
    api: Client,
) -> None:
    _, tls_port = domain_api
    token = api.create_token(ttl_s=300).token
    with httpx.Client(verify=tls) as browser:
        first = browser.get(_url(served, HTTP_PORT, tls_port, f"/hello.txt?dsec_token={token}"))
        assert first.status_code == 303
        assert first.headers["Location"] == "/hello.txt"  # the token leaves the URL
        cookie = first.headers["Set-Cookie"]
        assert "HttpOnly" in cookie
        assert "Secure" in cookie
        page = browser.get(_url(served, HTTP_PORT, tls_port, "/hello.txt"))  # cookie only
        assert page.status_code == 200
        assert page.text == "hello from the sandbox\n"
    key_in_url = httpx.get(
        _url(served, HTTP_PORT, tls_port, f"/?dsec_token={api.config.api_key}"), verify=tls
    )
    assert key_in_url.status_code == 401  # API keys never go in URLs


def test_websocket_by_host(
    served: Sandbox,
    domain_api: tuple[str, int],
    tls: ssl.SSLContext,
    api: Client,
    platform: RunningPlatform,
) -> None:
    _, tls_port = domain_api
    base = f"wss://{WS_PORT}-{served.id}.{DOMAIN}:{tls_port}"
    auth = {"Authorization": f"Bearer {platform.admin_key}"}
    with _open_ws(f"{base}/feed", tls, additional_headers=auth) as ws:
        assert ws.recv(timeout=20) == "hello /feed auth=False"
        ws.send("over tls")
        assert ws.recv(timeout=20) == "OVER TLS"
    token = api.create_token(ttl_s=300).token
    with _open_ws(f"{base}/q?a=1&dsec_token={token}", tls) as ws:
        assert ws.recv(timeout=20) == "hello /q?a=1 auth=False"  # the token is not passed on
    with pytest.raises(InvalidStatus) as anonymous:
        ws_connect(f"{base}/", ssl=tls)
    assert anonymous.value.response.status_code == 401
