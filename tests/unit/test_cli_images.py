"""``dsec image ...`` and ``dsec registry ...`` against a scripted API."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from dsec.cli.main import cli
from dsec.cli.output import CliState

IMAGE = {
    "name": "127.0.0.1:5000/team/env:v1",
    "edge_id": "e0a1",
    "layers": ["a" * 64, "b" * 64],
    "env": ["A=1"],
    "cmd": [],
    "entrypoint": [],
    "workdir": "/work",
    "user": "",
    "created": "2026-11-30T00:00:00Z",
    "source": "127.0.0.1:5000/team/env:v1",
}


VM_IMAGE = {
    **IMAGE,
    "name": "deb",
    "layers": [],
    "backend": "vm",
    "source": "Debian 12, kernel 6.1",
}


class Api:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.fail = False
        self.uploaded = b""

    def handler(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        if req.url.path == "/v1/images/pull":
            lines = [
                {
                    "edge_id": "e0a1",
                    "progress": {
                        "digest": "sha256:1",
                        "status": "downloading",
                        "done": 5,
                        "total": 10,
                    },
                },
                {"error": {"code": "unauthenticated", "message": "authentication required"}}
                if self.fail
                else {"images": [IMAGE]},
            ]
            body = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
            return httpx.Response(200, content=body)
        if req.url.path == "/v1/images/load":
            self.uploaded = req.read()
            lines = [
                {"edge_id": "e0a1", "progress": {"digest": "vm:deb", "status": "converting to raw",
                                                 "done": 50, "total": 100}},
                {"images": [VM_IMAGE]},
            ]  # fmt: skip
            return httpx.Response(
                200, content=b"".join(json.dumps(x).encode() + b"\n" for x in lines)
            )
        if req.url.path == "/v1/images" and req.method == "GET":
            return httpx.Response(200, json={"images": [IMAGE]})
        if req.url.path == "/v1/images" and req.method == "DELETE":
            return httpx.Response(200, json={"removed": 1})
        if req.url.path == "/v1/images/gc":
            return httpx.Response(
                200,
                json={
                    "edges": [{"edge_id": "e0a1", "layers": 2, "blobs": 3, "bytes_freed": 3 << 20}]
                },
            )
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Api:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    return Api()


def run(api: Api, *args: str) -> Result:
    state = CliState(
        api_url="http://127.0.0.1:9",
        api_key="k",
        environ={},
        http_transport=httpx.MockTransport(api.handler),
    )
    return CliRunner().invoke(cli, list(args), obj=state)


def test_login_then_pull_sends_the_stored_credentials(api: Api, tmp_path: Path) -> None:
    res = run(api, "registry", "login", "127.0.0.1:5000", "-u", "amy", "-p", "pw", "--insecure")
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE((tmp_path / "registries.json").stat().st_mode) == 0o600
    res = run(api, "image", "pull", "127.0.0.1:5000/team/env:v1")
    assert res.exit_code == 0, res.output
    assert res.stdout == "e0a1: 127.0.0.1:5000/team/env:v1 (2 layers)\n"
    body = json.loads(api.requests[-1].content)
    assert body == {
        "reference": "127.0.0.1:5000/team/env:v1",
        "stream": True,
        "username": "amy",
        "password": "pw",
        "insecure": True,
    }
    res = run(api, "registry", "logout", "127.0.0.1:5000")
    assert res.stdout == "removed 127.0.0.1:5000\n"


def test_pull_error_line_and_bad_reference(api: Api) -> None:
    api.fail = True
    res = run(api, "image", "pull", "--json", "127.0.0.1:5000/team/env:v1")
    assert res.exit_code == 2
    assert "authentication required [unauthenticated]" in res.stderr
    res = run(api, "image", "pull", "Not A Ref")
    assert res.exit_code == 2
    assert "invalid image reference" in res.stderr


def test_ls_rm_gc(api: Api) -> None:
    assert "127.0.0.1:5000/team/env:v1" in run(api, "image", "ls").stdout
    assert json.loads(run(api, "image", "ls", "--json").stdout) == [IMAGE]
    res = run(api, "image", "rm", "127.0.0.1:5000/team/env:v1")
    assert res.stdout == "removed 127.0.0.1:5000/team/env:v1 from 1 edge(s)\n"
    assert api.requests[-1].url.params["name"] == "127.0.0.1:5000/team/env:v1"
    assert run(api, "image", "gc").stdout == "e0a1: 2 layers, 3 blobs, 3.0 MiB\n"


def test_import_vm_streams_the_disk_with_its_name(api: Api, tmp_path: Path) -> None:
    disk = tmp_path / "disk.qcow2"
    disk.write_bytes(b"QFI\xfb" + bytes(3 << 20))
    res = run(api, "image", "import-vm", "deb", str(disk), "--edge", "e0a1")
    assert res.exit_code == 0, res.output
    assert res.stdout == "imported deb on e0a1: Debian 12, kernel 6.1\n"
    req = api.requests[-1]
    assert dict(req.url.params) == {"name": "deb", "kind": "vm", "edge_id": "e0a1"}
    assert req.headers["content-type"] == "application/octet-stream"
    assert api.uploaded == disk.read_bytes()
    assert json.loads(run(api, "image", "import-vm", "--json", "deb", str(disk)).stdout) == VM_IMAGE
    res = run(api, "image", "import-vm", "deb", str(tmp_path / "missing.img"))
    assert res.exit_code == 2
    assert "does not exist" in res.output
