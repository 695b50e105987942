"""``dsec sandbox files ...``, ``dsec keys ...`` and ``dsec whoami`` against the fake API."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from dsec.cli.main import cli
from dsec.cli.output import CliState
from dsec.testing.fake_api import FAKE_KEY, FakeApi


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def run(api: FakeApi, *args: str, input: bytes | str | None = None) -> Result:
    state = CliState(
        api_url="http://127.0.0.1:9",  # never dialled: HTTP goes to the mock transport
        api_key=FAKE_KEY,
        environ={},
        http_transport=httpx.MockTransport(api.handler),
    )
    return CliRunner().invoke(cli, list(args), obj=state, input=input)


def test_put_cat_get_ls(api: FakeApi, tmp_path: Path) -> None:
    sid = api.add_sandbox()
    src = tmp_path / "data.bin"
    src.write_bytes(b"\x00\xffbinary" * 50_000)
    res = run(api, "sandbox", "files", "put", sid, str(src), "/root/data.bin", "--mode", "600")
    assert res.exit_code == 0, res.output
    assert res.stdout == f"/root/data.bin: {src.stat().st_size} bytes\n"
    put = next(r for r in api.requests if r.method == "PUT")
    assert put.url.params["mode"] == "600"
    assert api.sandboxes[sid].files["/root/data.bin"] == src.read_bytes()

    assert (
        run(api, "sandbox", "files", "cat", sid, "/root/data.bin").stdout_bytes == src.read_bytes()
    )
    dest = tmp_path / "copy.bin"
    got = run(api, "sandbox", "files", "get", sid, "/root/data.bin", str(dest), "--json")
    assert json.loads(got.stdout) == {"path": str(dest), "size": src.stat().st_size}
    assert dest.read_bytes() == src.read_bytes()
    assert run(api, "sandbox", "files", "get", sid, "/root/data.bin", "-").stdout_bytes == (
        src.read_bytes()
    )

    listing = run(api, "sandbox", "files", "ls", sid, "/root")
    assert "/root/data.bin" in listing.stdout
    assert "-rw-r--r--" in listing.stdout
    entries = json.loads(run(api, "sandbox", "files", "ls", sid, "/root", "--json").stdout)
    assert [e["name"] for e in entries] == ["data.bin"]


def test_put_from_stdin_mkdir_rm_and_errors(api: FakeApi) -> None:
    sid = api.add_sandbox()
    res = run(api, "sandbox", "files", "put", sid, "-", "/root/in.txt", input=b"piped bytes")
    assert res.exit_code == 0
    assert api.sandboxes[sid].files["/root/in.txt"] == b"piped bytes"
    assert run(api, "sandbox", "files", "mkdir", sid, "/root/d").exit_code == 0
    assert run(api, "sandbox", "files", "rm", sid, "/root/in.txt").exit_code == 0
    missing = run(api, "sandbox", "files", "cat", sid, "/root/in.txt")
    assert missing.exit_code == 2
    assert "[not_found]" in missing.stderr
    bad_mode = run(api, "sandbox", "files", "put", sid, "-", "/x", "--mode", "9z", input=b"")
    assert bad_mode.exit_code == 2
    assert "octal" in bad_mode.stderr


def test_keys_and_whoami(api: FakeApi) -> None:
    created = run(api, "keys", "create", "--subject", "bob", "--project", "p", "--name", "ci")
    assert created.exit_code == 0
    key = created.stdout.strip()
    assert key.startswith("dsk_")
    assert "not shown again" in created.stderr
    listing = run(api, "keys", "ls")
    assert "bob" in listing.stdout
    assert "member" in listing.stdout
    (row,) = json.loads(run(api, "keys", "ls", "--json").stdout)
    assert (row["subject"], row["role"], row["name"]) == ("bob", "member", "ci")
    assert run(api, "keys", "revoke", row["key_id"]).stdout == f"revoked {row['key_id']}\n"
    again = run(api, "keys", "revoke", row["key_id"])
    assert again.exit_code == 2
    assert json.loads(run(api, "whoami", "--json").stdout)["role"] == "admin"
    assert run(api, "whoami").stdout == "alice in project p as admin (key k1)\n"
    role = run(api, "keys", "create", "--subject", "x", "--project", "p", "--role", "root")
    assert role.exit_code == 2
