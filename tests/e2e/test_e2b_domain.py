"""The unmodified E2B SDK in ``E2B_DOMAIN`` mode: ``https://api.<domain>`` for the control
plane, ``https://<port>-<sandbox id>.<domain>`` for envd and for ``sbx.get_host(port)``.

Written as E2B user code. The environment only sets ``E2B_DOMAIN``, ``E2B_API_KEY`` and
``SSL_CERT_FILE`` (the cluster CA). Because this machine has no DNS for the test domain,
every client is given ``proxy=``: a test proxy that sends ``*.dsec.test:443`` to the
gateway's TLS port (see ``hostnet.py``), so no client ever resolves the name itself and
nothing on the machine is changed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from dsec.testing.platform import RunningPlatform
from tests.e2e.hostnet import DOMAIN, ConnectProxy, domain_gateway
from tests.e2e.test_ports import WS_PORT, WS_SERVER

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")

from e2b import AsyncSandbox, Sandbox  # noqa: E402

pytestmark = pytest.mark.platform


@pytest.fixture(scope="module")
def proxy(platform: RunningPlatform) -> Iterator[ConnectProxy]:
    with domain_gateway(platform, platform.api_url) as (_, tls_port):
        p = ConnectProxy(tls_port)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("E2B_API_URL", raising=False)
            mp.delenv("E2B_SANDBOX_URL", raising=False)
            mp.setenv("E2B_DOMAIN", DOMAIN)
            mp.setenv("E2B_API_KEY", platform.admin_key)
            mp.setenv("SSL_CERT_FILE", str(platform.paths.home / "pki" / "ca.crt"))
            yield p
        p.close()


def _get_until_up(url: str, headers: dict[str, str], proxy: str) -> httpx.Response:
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(url, headers=headers, proxy=proxy)
        if r.status_code != 502 or time.monotonic() > deadline:  # 502: port not open yet
            return r
        time.sleep(0.2)


def test_sandbox_and_its_ports_by_domain(proxy: ConnectProxy) -> None:
    sbx = Sandbox.create(timeout=120, proxy=proxy.url)
    try:
        assert sbx.commands.run("echo over tls").stdout == "over tls\n"
        assert f"49983-{sbx.sandbox_id}.{DOMAIN}" in proxy.hosts  # envd by host
        assert f"api.{DOMAIN}" in proxy.hosts

        sbx.files.write("/root/www/index.html", "served from an e2b sandbox")
        sbx.commands.run(
            "python3 -m http.server 8000 --bind 127.0.0.1", cwd="/root/www", background=True
        )
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
        token = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
        r = _get_until_up(f"https://{host}/index.html", token, proxy.url)
        assert r.status_code == 200
        assert r.text == "served from an e2b sandbox"
        assert httpx.get(f"https://{host}/index.html", proxy=proxy.url).status_code == 401

        sbx.files.write("/root/ws_server.py", WS_SERVER)
        sbx.commands.run(f"python3 /root/ws_server.py {WS_PORT}", background=True)
        ws_url = f"wss://{sbx.get_host(WS_PORT)}/live?x=1"
        deadline = time.monotonic() + 20
        while True:
            try:
                ws = ws_connect(ws_url, additional_headers=token, proxy=proxy.url)
                break
            except InvalidStatus as exc:
                if exc.response.status_code not in (502, 503) or time.monotonic() > deadline:
                    raise  # 502/503: not listening yet
                time.sleep(0.2)
        with ws:
            assert ws.recv() == "hello /live?x=1 auth=False"
            ws.send(b"\x00\x01binary")
            assert ws.recv() == b"yranib\x01\x00"
        with pytest.raises(InvalidStatus) as anonymous:
            ws_connect(ws_url, proxy=proxy.url)
        assert anonymous.value.response.status_code == 401
    finally:
        sbx.kill()


def test_async_client_by_domain(proxy: ConnectProxy) -> None:
    async def main() -> tuple[str, str]:
        sbx = await AsyncSandbox.create(timeout=60, proxy=proxy.url)
        try:
            return sbx.sandbox_id, (await sbx.commands.run("echo async")).stdout
        finally:
            await sbx.kill()

    sandbox_id, out = asyncio.run(main())
    assert out == "async\n"
    assert f"49983-{sandbox_id}.{DOMAIN}" in proxy.hosts


def test_files_pty_commands_and_errors_by_domain(proxy: ConnectProxy) -> None:
    from e2b import CommandExitException, NotFoundException, PtySize

    sbx = Sandbox.create(timeout=120, proxy=proxy.url)
    try:
        sbx.files.write("/tmp/d/a.txt", "by host")
        sbx.files.write("/tmp/d/b.bin", b"\x00\x01" * 100_000)
        assert sbx.files.read("/tmp/d/a.txt") == "by host"
        assert sorted(e.name for e in sbx.files.list("/tmp/d")) == ["a.txt", "b.bin"]
        assert sbx.files.get_info("/tmp/d/b.bin").size == 200_000

        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "piped\n")
        sbx.commands.close_stdin(h.pid)
        assert sbx.commands.connect(h.pid).wait().stdout == "piped\n"
        with pytest.raises(CommandExitException):
            sbx.commands.run("exit 5")

        out: list[bytes] = []
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.resize(term.pid, PtySize(rows=33, cols=99))
        sbx.pty.send_stdin(term.pid, b"stty size; exit\n")
        term.wait(on_pty=out.append)
        assert "33 99" in b"".join(out).decode(errors="replace")

        [m] = sbx.get_metrics()
        assert m.mem_total > 0

        envd = f"https://49983-{sbx.sandbox_id}.{DOMAIN}"
        r = httpx.post(
            f"{envd}/process.Process/List",
            json={},
            headers={"X-Access-Token": "not-a-key"},
            proxy=proxy.url,
        )
        assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")
        # a signed URL names its sandbox by host; no headers needed
        r = httpx.get(sbx.download_url("/tmp/d/a.txt"), proxy=proxy.url)
        assert (r.status_code, r.text) == (200, "by host")
        r = httpx.get(
            sbx.download_url("/tmp/d/a.txt", use_signature_expiration=-1), proxy=proxy.url
        )
        assert (r.status_code, r.json()["message"]) == (401, "signature is already expired")
    finally:
        sbx.kill()
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id, proxy=proxy.url)


def test_async_files_and_pause_resume_by_domain(proxy: ConnectProxy) -> None:
    async def main() -> str:
        sbx = await AsyncSandbox.create(timeout=120, proxy=proxy.url)
        try:
            await sbx.files.write("/tmp/p.txt", "kept")
            assert await sbx.pause() is True
            again = await AsyncSandbox.connect(sbx.sandbox_id, proxy=proxy.url)
            return str(await again.files.read("/tmp/p.txt"))
        finally:
            await sbx.kill()

    assert asyncio.run(main()) == "kept"
