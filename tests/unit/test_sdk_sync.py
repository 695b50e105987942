"""The blocking SDK against the in-memory fake API (httpx.MockTransport) and a loopback
fake of the runtime WebSocket."""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.core import errors
from dsec.sdk import Client, CommandTimeout, Sandbox
from dsec.sdk.config import ClientConfig
from dsec.testing.fake_api import FAKE_KEY, FakeApi
from dsec.testing.fake_runtime import FakeRuntimeServer


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def runtime(api: FakeApi) -> Iterator[FakeRuntimeServer]:
    with FakeRuntimeServer(api) as server:
        yield server


@pytest.fixture
def client(api: FakeApi, runtime: FakeRuntimeServer) -> Iterator[Client]:
    cfg = ClientConfig(runtime.api_url, FAKE_KEY)
    with Client(config=cfg, http_transport=httpx.MockTransport(api.handler)) as c:
        yield c


@pytest.fixture
def sbx(client: Client) -> Sandbox:
    return Sandbox.create(client=client)


def test_create_info_list_timeout_kill(api: FakeApi, client: Client) -> None:
    sbx = Sandbox.create(image="base", cpu=0.5, env={"A": "1"}, client=client)
    assert sbx.id in api.sandboxes
    assert api.sandboxes[sbx.id].info["spec"]["env"] == {"A": "1"}
    assert sbx.info().state == "running"
    assert [s.id for s in Sandbox.list(client=client)] == [sbx.id]
    info = sbx.set_timeout(600)
    assert info.expires_at is not None
    assert info.expires_at.timestamp() == 1_700_000_600
    assert sbx.kill().state == "stopped"
    assert Sandbox.list(client=client) == []
    assert len(Sandbox.list(all=True, client=client)) == 1
    auth = {r.headers["authorization"] for r in api.requests}
    assert auth == {f"Bearer {FAKE_KEY}"}


def test_context_manager_kills_but_shared_client_stays_open(api: FakeApi, client: Client) -> None:
    with Sandbox.create(client=client) as sbx:
        sid = sbx.id
    assert api.sandboxes[sid].info["state"] == "stopped"
    assert client.whoami().subject == "alice"  # the shared client was not closed


def test_connect_checks_existence(client: Client, sbx: Sandbox) -> None:
    assert Sandbox.connect(sbx.id, client=client).id == sbx.id
    with pytest.raises(errors.SandboxNotFound):
        Sandbox.connect("sbx-e0a1-zzzzzzzzzzzzzzzzzzzz", client=client)


def test_exec_results_and_timeout(sbx: Sandbox) -> None:
    r = sbx.exec("echo hi; err oops; exit 3", env={"X": "1"}, timeout=5)
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("hi\n", "oops\n", 3, False)
    assert sbx.exec(["cat"], stdin=b"piped").stdout == "piped"
    with pytest.raises(CommandTimeout) as info:
        sbx.exec("echo partial; sleep 100", timeout=1)
    assert info.value.result.stdout == "partial\n"
    assert info.value.result.signal == 9


def test_exec_stream_with_stdin_bytes_and_iterables(sbx: Sandbox) -> None:
    events = list(sbx.exec_stream("echo a; cat; err e; exit 4", stdin=b"in\n"))
    assert [(e.kind, e.data) for e in events[:-1]] == [
        ("stdout", b"a\n"), ("stdout", b"in\n"), ("stderr", b"e\n")]  # fmt: skip
    assert events[-1].kind == "exit"
    assert events[-1].exit_code == 4
    big = [b"x" * 300_000, b"y" * 5]  # more than one chunk: sent from a thread
    out = b"".join(e.data for e in sbx.exec_stream("cat", stdin=iter(big)) if e.kind == "stdout")
    assert out == b"".join(big)
    last = list(sbx.exec_stream("kill 15"))[-1]
    assert (last.exit_code, last.signal, last.returncode) == (None, 15, -15)


def test_exec_stream_rejects_bad_key_and_unknown_sandbox(
    api: FakeApi, runtime: FakeRuntimeServer
) -> None:
    sid = api.add_sandbox()
    bad = Client(
        config=ClientConfig(runtime.api_url, "wrong"),
        http_transport=httpx.MockTransport(api.handler),
    )
    with bad, pytest.raises(errors.Unauthenticated):
        list(bad.sandbox(sid).exec_stream("echo x"))
    good = Client(
        config=ClientConfig(runtime.api_url, FAKE_KEY),
        http_transport=httpx.MockTransport(api.handler),
    )
    with good, pytest.raises(errors.SandboxNotFound):
        list(good.sandbox("sbx-e0a1-zzzzzzzzzzzzzzzzzzzz").exec_stream("echo x"))


def test_files_round_trip(sbx: Sandbox, tmp_path: Path) -> None:
    f = sbx.files
    assert f.write("/root/a.txt", "hello").size == 5
    assert f.read_text("/root/a.txt") == "hello"
    f.write("/root/b.bin", io.BytesIO(b"\x00\x01" * 200_000))
    assert f.read("/root/b.bin") == b"\x00\x01" * 200_000
    assert b"".join(f.read_stream("/root/a.txt")) == b"hello"
    assert [e.name for e in f.list("/root")] == ["a.txt", "b.bin"]
    assert f.stat("/root").is_dir
    assert f.exists("/root/a.txt")
    assert not f.exists("/nope")
    assert f.mkdir("/root/d").type == "dir"
    assert f.rename("/root/a.txt", "/root/c.txt").path == "/root/c.txt"
    f.remove("/root/c.txt")
    assert not f.exists("/root/c.txt")
    with pytest.raises(errors.NotFound):
        f.read("/root/c.txt")
    with pytest.raises(errors.InvalidArgument, match="directory"):
        f.read("/root")


def test_upload_and_download_stream(api: FakeApi, sbx: Sandbox, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4000)  # ~1 MiB: several chunks
    assert sbx.files.upload(src, "/root/up.bin").size == src.stat().st_size
    put = [r for r in api.requests if r.method == "PUT"][-1]
    assert put.headers.get("transfer-encoding") == "chunked"  # streamed, not buffered
    dest = tmp_path / "out" / "down.bin"
    dest.parent.mkdir()
    assert sbx.files.download("/root/up.bin", dest) == src.stat().st_size
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o644
    with pytest.raises(errors.NotFound):
        sbx.files.download("/missing", tmp_path / "out" / "x")
    assert sorted(p.name for p in dest.parent.iterdir()) == ["down.bin"]  # no temp files left
    with pytest.raises(errors.InvalidArgument, match="cannot read"):
        sbx.files.upload(tmp_path / "nope", "/x")


def test_processes(api: FakeApi, sbx: Sandbox) -> None:
    p = sbx.processes.start("server --port 1", tag="srv")
    assert p.tag == "srv"
    assert p.running
    assert [q.pid for q in sbx.processes.list()] == [p.pid]
    sbx.processes.send_input(p.pid, "hello")
    assert api.sandboxes[sbx.id].processes[p.pid]["input"] == b"hello"
    sbx.processes.signal(p.pid, 15)
    assert api.sandboxes[sbx.id].processes[p.pid]["signal"] == 15
    with pytest.raises(errors.ProcessNotFound):
        sbx.processes.kill(999)
    pid = api.start_process(sbx.id, "x")
    events = sbx.processes.connect(pid)
    assert next(events).data == b"$ "
    events.close()  # detaching early closes the socket


def test_pty_send_resize_iterate_wait(api: FakeApi, sbx: Sandbox) -> None:
    pty = sbx.pty.create(cols=100, rows=30)
    proc = api.sandboxes[sbx.id].processes[pty.pid]
    assert proc["pty"]
    assert proc["size"] == {"cols": 100, "rows": 30}
    pty.resize(120, 40)
    pty.send("ls\n")
    pty.send(b"exit\n")
    assert b"".join(pty) == b"$ ls\nexit\n"
    assert pty.wait() == 0
    assert proc["size"] == {"cols": 120, "rows": 40}
    pty.close()
    other = sbx.pty.create()
    other.kill()
    assert api.sandboxes[sbx.id].processes[other.pid]["signal"] == 9


def test_shells_and_http(sbx: Sandbox) -> None:
    sh = sbx.shell("work")
    assert sh.run("echo s").stdout == "s\n"
    assert [s.name for s in sbx.shells()] == ["work"]
    with pytest.raises(CommandTimeout):
        sh.run("sleep 5", timeout=1)
    sh.close()
    assert sbx.shells() == []
    status, headers, body = sbx.http(8080, "POST", "/api?q=1", {"X-T": "1"}, b"data")
    assert (status, headers["x-app"]) == (201, "yes")
    assert b'"path":"/api"' in body
    assert b'"query":"q=1"' in body
    assert b'"body":"data"' in body
    with pytest.raises(errors.Unavailable, match="port 9"):
        sbx.http(9)


def test_keys_and_whoami(client: Client) -> None:
    assert client.whoami().role == "admin"
    new = client.create_key("bob", "p", "user", "ci")
    assert new.api_key.startswith("dsk_")
    assert [k.key_id for k in client.list_keys()] == [new.key_id]
    client.revoke_key(new.key_id)
    assert client.list_keys() == []
    with pytest.raises(errors.NotFound):
        client.revoke_key(new.key_id)


def test_unreachable_apiserver_is_unavailable_with_url() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with Client(config=ClientConfig(url, "k")) as c, pytest.raises(errors.Unavailable) as info:
        c.whoami()
    assert url in str(info.value)
    with Client(config=ClientConfig(url, "k")) as c, pytest.raises(errors.Unavailable) as info:
        list(c.sandbox("sbx-e0a1-abcdefghijklmnopqrst").exec_stream("x"))
    assert "127.0.0.1" in str(info.value)


def test_one_keep_alive_client_for_every_call(api: FakeApi, sbx: Sandbox) -> None:
    seen: list[int] = []
    transport = sbx.client.transport
    for _ in range(3):
        sbx.exec("echo x")
        seen.append(id(transport._http))
    assert len(set(seen)) == 1


def test_api_url_with_a_path_prefix_and_query_params() -> None:
    urls: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        return httpx.Response(200, json={"sandboxes": [], "entries": []})

    cfg = ClientConfig("http://10.0.0.1:8/api", "k")
    with Client(config=cfg, http_transport=httpx.MockTransport(record)) as c:
        c.list_sandboxes(all=True)
        c.list_sandboxes(all=True)  # the second call uses the cached URL
        c.sandbox("sbx-e0a1-abcdefghijklmnopqrst").files.list("/a b&c")
    assert urls[0] == urls[1] == "http://10.0.0.1:8/api/v1/sandboxes?all=1"
    assert urls[2].endswith(
        "/api/v1/sandboxes/sbx-e0a1-abcdefghijklmnopqrst/files/list?path=%2Fa+b%26c&depth=1"
    )


def test_batch_sandboxes_one_result_each() -> None:
    api = FakeApi()
    sid = api.add_sandbox()
    client = Client("http://fake", FAKE_KEY, http_transport=httpx.MockTransport(api.handler))
    missing = "sbx-e0a1-zzzzzzzzzzzzzzzzzzzz"
    results = client.batch_sandboxes("kill", ids=[sid, missing])
    assert [(r.id, r.ok) for r in results] == [(sid, True), (missing, False)]
    assert results[0].sandbox is not None
    assert results[0].sandbox.state == "stopped"
    assert isinstance(results[1].error, errors.SandboxNotFound)
    with pytest.raises(errors.InvalidArgument, match="one of"):
        client.batch_sandboxes("explode", ids=[sid])
    with pytest.raises(errors.InvalidArgument, match="exactly one of"):
        client.batch_sandboxes("kill")
    with pytest.raises(errors.InvalidArgument, match="not one string"):
        client.batch_sandboxes("kill", ids=sid)


def test_resume_on_another_edge_takes_the_new_id(api: FakeApi, client: Client) -> None:
    old = api.add_sandbox(state="paused", backend="microvm")
    sbx = client.sandbox(old)
    info = sbx.resume(edge="f00d")
    assert info.edge_id == "f00d"
    assert sbx.id == info.id != old
    sbx.files.write("/a.txt", b"x")  # the runtime objects follow the new id
    assert [r.url.path for r in api.requests][-1].startswith(f"/v1/sandboxes/{info.id}/")
    assert sbx.info().id == info.id
