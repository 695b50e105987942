"""The E2B gateway without a platform: Connect framing, translations, and the control plane
driven by the real async ``e2b`` SDK against an in-memory apiserver (``FakeApi``)."""

from __future__ import annotations

import base64
import struct
import urllib.parse
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from dsec.gateway.app import make_app
from dsec.gateway.connect import FLAG_END, ConnectError, envelope
from dsec.gateway.control import Gateway, _metadata_filter, _page_token
from dsec.gateway.filesystem import entry_json
from dsec.gateway.upstream import Clients
from dsec.sdk.models import FileEntry
from dsec.testing.fake_api import FAKE_KEY, FakeApi

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")


def test_envelope_layout() -> None:
    env = envelope({"a": 1}, FLAG_END)
    flags, length = struct.unpack(">BI", env[:5])
    assert (flags, length, env[5:]) == (FLAG_END, len(b'{"a":1}'), b'{"a":1}')


def test_metadata_filter_decodes_the_sdks_double_encoding() -> None:
    meta = {"k y": "v&1", "plain": "x/y"}
    quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in meta.items()}
    sent = urllib.parse.urlencode(quoted)  # what the SDK passes as the query value
    assert _metadata_filter(sent) == meta


def test_page_tokens_round_trip_and_reject_garbage() -> None:
    assert _page_token("") == 0
    assert _page_token(base64.urlsafe_b64encode(b"40").decode()) == 40
    with pytest.raises(Exception, match="nextToken"):
        _page_token("%%%")


def test_entry_json_is_envd_shaped() -> None:
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    d = entry_json(FileEntry("d", "/tmp/d", "dir", 4096, 0o755, when, 0, 0))
    assert d["type"] == "FILE_TYPE_DIRECTORY"
    assert d["permissions"] == "drwxr-xr-x"
    assert d["mode"] == (1 << 31) | 0o755
    assert (d["size"], d["owner"], d["modifiedTime"]) == ("4096", "root", "2026-01-02T03:04:05Z")
    f = entry_json(FileEntry("f", "/f", "file", 3, 0o600, None, 1000, 1000))
    assert (f["type"], f["permissions"], f["owner"]) == ("FILE_TYPE_FILE", "-rw-------", "1000")


@pytest_asyncio.fixture
async def gateway(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, FakeApi]]:
    fake = FakeApi()
    gw = Gateway(
        Clients("http://fake-api", http_transport=httpx.MockTransport(fake.async_handler)),
        domain="sbx.test",
    )
    server = TestServer(make_app(gw), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", FAKE_KEY)
    try:
        yield url, fake
    finally:
        await server.close()
        await gw.aclose()


@pytest.mark.asyncio
async def test_control_plane_through_the_e2b_sdk(gateway: tuple[str, FakeApi]) -> None:
    from e2b import AsyncSandbox, NotFoundException, SandboxQuery

    _, fake = gateway
    sbx = await AsyncSandbox.create(timeout=77, metadata={"m": "1"}, envs={"E": "v"})
    spec = fake.sandboxes[sbx.sandbox_id].info["spec"]
    assert (spec["image"], spec["timeout_s"], spec["env"], spec["metadata"]) == (
        "base",
        77,
        {"E": "v"},
        {"m": "1"},
    )
    info = await sbx.get_info()
    assert (info.template_id, info.metadata, info.sandbox_domain) == (
        "base",
        {"m": "1"},
        "sbx.test",
    )
    found = await AsyncSandbox.list(query=SandboxQuery(metadata={"m": "1"})).next_items()
    assert [i.sandbox_id for i in found] == [sbx.sandbox_id]
    await sbx.set_timeout(500)
    assert fake.sandboxes[sbx.sandbox_id].info["expires_at"] == 1_700_000_500.0
    assert await sbx.kill() is True
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)


@pytest.mark.asyncio
async def test_errors_are_json_with_e2b_status_codes(gateway: tuple[str, FakeApi]) -> None:
    url, fake = gateway
    sid = fake.add_sandbox()
    async with httpx.AsyncClient(base_url=url) as h:
        r = await h.get(f"/sandboxes/{sid}", headers={"X-API-Key": "wrong"})
        assert r.status_code == 401
        assert r.json()["code"] == 401
        r = await h.post("/v2/sandboxes", json={"timeout": -1}, headers={"X-API-Key": FAKE_KEY})
        assert r.status_code == 400
        assert r.headers["Should-Retry"] == "false"


@pytest.mark.asyncio
async def test_envd_rejects_bad_frames_tokens_and_methods(gateway: tuple[str, FakeApi]) -> None:
    url, fake = gateway
    sid = fake.add_sandbox()
    base = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": FAKE_KEY}
    stream = {**base, "Content-Type": "application/connect+json"}
    async with httpx.AsyncClient(base_url=url) as h:
        # a truncated envelope: the stream ends with a Connect error, not a hang or a 500
        r = await h.post("/process.Process/Start", headers=stream, content=b"\x00\x00\x00\x01")
        assert r.status_code == 200
        flags, length = struct.unpack(">BI", r.content[:5])
        assert flags == FLAG_END
        assert b"invalid_argument" in r.content[5 : 5 + length]
        # an envelope that is not JSON
        bad = struct.pack(">BI", 0, 3) + b"{{{"
        r = await h.post("/process.Process/Start", headers=stream, content=bad)
        assert b"invalid_argument" in r.content
        # unary with a wrong access token -> unauthenticated (401)
        r = await h.post(
            "/filesystem.Filesystem/Stat",
            headers={**base, "X-Access-Token": "nope", "Content-Type": "application/json"},
            json={"path": "/"},
        )
        assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")
        r = await h.post("/filesystem.Filesystem/Frobnicate", headers=base, json={})
        assert (r.status_code, r.json()["code"]) == (501, "unimplemented")
        # an unknown sandbox answers like E2B's proxy
        r = await h.post(
            "/filesystem.Filesystem/Stat",
            headers={**base, "E2b-Sandbox-Id": "sbx-none-aaaaaaaaaaaaaaaaaaaa"},
            json={"path": "/"},
        )
        assert r.status_code == 502
        assert "was not found" in r.json()["message"]
        # routing by Host (<port>-<sandbox id>.<domain>) when the headers are absent
        host = {"Host": f"49983-{sid}.sbx.test", "X-Access-Token": FAKE_KEY}
        assert (await h.get("/health", headers=host)).status_code == 204
        r = await h.get("/x?q=1", headers={**host, "Host": f"8080-{sid}.sbx.test"})
        assert (r.status_code, r.json()["path"], r.json()["query"]) == (201, "/x", "q=1")
        r = await h.get("/", headers={**host, "Host": f"9-{sid}.sbx.test"})
        assert r.status_code == 502
        assert "port is not open" in r.json()["message"]
        # internal envd routes are not served
        r = await h.post("/init", headers=base, json={})
        assert r.status_code == 404


def test_connect_error_type() -> None:
    err = ConnectError("not_found", "x")
    assert err.to_json() == {"code": "not_found", "message": "x"}


def test_cli_e2b_env_prints_exports(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:

    from click.testing import CliRunner

    from dsec.cli.main import cli
    from dsec.supervisor import Layout

    lay = Layout.from_port_base(9100)
    lay.save(tmp_path / "platform.json")
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    monkeypatch.setenv("DSEC_API_KEY", "dsk_test key")
    res = CliRunner().invoke(cli, ["e2b", "env"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == [
        "export E2B_API_URL=http://127.0.0.1:9107",
        "export E2B_SANDBOX_URL=http://127.0.0.1:9107",
        "export E2B_API_KEY='dsk_test key'",
    ]
    res = CliRunner().invoke(cli, ["e2b", "env", "--home", str(tmp_path / "none")])
    assert res.exit_code == 1
    assert "no E2B gateway" in res.output


def test_cli_e2b_env_domain_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from dsec.cli.main import cli

    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    monkeypatch.setenv("DSEC_API_KEY", "dsk_k")
    res = CliRunner().invoke(cli, ["e2b", "env", "--domain", "dsec.example"])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines() == [
        "export E2B_DOMAIN=dsec.example",
        "export E2B_API_KEY=dsk_k",
        f"export SSL_CERT_FILE={tmp_path}/pki/ca.crt",
    ]


def test_e2b_egress_becomes_a_dsec_policy() -> None:
    from dsec.core.errors import InvalidArgument
    from dsec.gateway.egress import policy

    everything = "0.0.0.0/0"
    assert policy(None, None) == {"allow": [everything], "deny": []}
    assert policy({}, False) == {"allow": [], "deny": []}
    closed = {"denyOut": [everything], "allowOut": ["1.2.3.4", "x.example"]}
    assert policy(closed, None) == {"allow": ["1.2.3.4", "x.example"], "deny": []}
    assert policy({"denyOut": ["10.0.0.0/8"], "allowOut": ["11.0.0.1"]}, None) == {
        "allow": [everything],
        "deny": ["10.0.0.0/8"],
    }
    with pytest.raises(InvalidArgument, match="reopens"):
        policy({"denyOut": ["10.0.0.0/8"], "allowOut": ["10.1.0.0/16"]}, None)
    with pytest.raises(InvalidArgument, match="egressProxy"):
        policy({"egressProxy": {"url": "http://p"}}, None)
    with pytest.raises(InvalidArgument, match="allowOut"):
        policy({"allowOut": "1.2.3.4"}, None)


def test_usage_sample_parses_the_scripts_output() -> None:
    import subprocess

    from dsec.gateway.usage import SCRIPT, parse

    out = "cpu0 1000000000 0\ncpu1 1100000000 200000000\nmem_used 5\nnoise x y\n"
    sample = parse(out)
    assert sample["mem_used"] == 5
    assert sample["cpu_core_pct"] == pytest.approx(50.0)
    # the script runs under a plain POSIX shell on this machine too
    real = parse(subprocess.run(["sh", "-c", SCRIPT], capture_output=True, text=True).stdout)
    assert real["mem_used"] > 0
    assert real["disk_total"] >= real["disk_used"] > 0
    assert "cpu_core_pct" in real
