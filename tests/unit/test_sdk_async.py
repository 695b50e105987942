"""The asyncio SDK against the same fakes as the blocking one: same calls, same answers."""

from __future__ import annotations

import io
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from dsec.core import errors
from dsec.sdk import AsyncClient, AsyncSandbox, CommandTimeout
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


@pytest_asyncio.fixture
async def client(api: FakeApi, runtime: FakeRuntimeServer) -> AsyncIterator[AsyncClient]:
    cfg = ClientConfig(runtime.api_url, FAKE_KEY)
    async with AsyncClient(config=cfg, http_transport=httpx.MockTransport(api.async_handler)) as c:
        yield c


@pytest_asyncio.fixture
async def sbx(client: AsyncClient) -> AsyncSandbox:
    return await AsyncSandbox.create(client=client)


@pytest.mark.asyncio
async def test_lifecycle(api: FakeApi, client: AsyncClient) -> None:
    async with await AsyncSandbox.create(memory_mb=256, client=client) as sbx:
        sid = sbx.id
        assert (await sbx.info()).spec is not None
        assert [s.id for s in await AsyncSandbox.list(client=client)] == [sid]
        assert (await AsyncSandbox.connect(sid, client=client)).id == sid
        await sbx.set_timeout(10)
    assert api.sandboxes[sid].info["state"] == "stopped"
    assert api.sandboxes[sid].info["spec"]["memory_mb"] == 256
    assert (await client.whoami()).subject == "alice"


@pytest.mark.asyncio
async def test_exec_and_timeout(sbx: AsyncSandbox) -> None:
    r = await sbx.exec("echo hi; exit 2")
    assert (r.stdout, r.exit_code) == ("hi\n", 2)
    with pytest.raises(CommandTimeout) as info:
        await sbx.exec("echo p; sleep 9", timeout=1)
    assert info.value.result.stdout == "p\n"


async def _agen(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


@pytest.mark.asyncio
async def test_exec_stream_stdin_kinds(sbx: AsyncSandbox) -> None:
    events = [e async for e in sbx.exec_stream("echo a; cat; exit 5", stdin=b"x")]
    assert [e.data for e in events[:-1]] == [b"a\n", b"x"]
    assert events[-1].exit_code == 5
    for stdin in (_agen(b"p" * 300_000, b"q"), [b"p" * 300_000, b"q"]):
        out = b"".join([e.data async for e in sbx.exec_stream("cat", stdin=stdin)])
        assert out == b"p" * 300_000 + b"q"


@pytest.mark.asyncio
async def test_files(sbx: AsyncSandbox, tmp_path: Path) -> None:
    f = sbx.files
    await f.write("/root/a", "text")
    await f.write("/root/b", io.BytesIO(b"z" * 600_000))
    assert await f.read_text("/root/a") == "text"
    assert b"".join([c async for c in f.read_stream("/root/b")]) == b"z" * 600_000
    assert [e.name for e in await f.list("/root")] == ["a", "b"]
    assert await f.exists("/root/a")
    assert not await f.exists("/root/x")
    await f.mkdir("/root/d")
    await f.rename("/root/a", "/root/c")
    await f.remove("/root/c")
    assert (await f.stat("/root/d")).is_dir
    src = tmp_path / "up"
    src.write_bytes(b"u" * 700_000)
    assert (await f.upload(src, "/root/up")).size == 700_000
    assert await f.download("/root/up", tmp_path / "down") == 700_000
    assert (tmp_path / "down").read_bytes() == src.read_bytes()
    with pytest.raises(errors.NotFound):
        await f.download("/missing", tmp_path / "never")
    assert not any(p.name.startswith(".never") for p in tmp_path.iterdir())


@pytest.mark.asyncio
async def test_processes_pty_shell_http(api: FakeApi, sbx: AsyncSandbox) -> None:
    p = await sbx.processes.start(["srv"], tag="t")
    assert [q.tag for q in await sbx.processes.list()] == ["t"]
    await sbx.processes.send_input(p.pid, b"in")
    await sbx.processes.kill(p.pid)
    assert api.sandboxes[sbx.id].processes[p.pid]["signal"] == 9
    events = sbx.processes.connect(api.start_process(sbx.id, "x"))
    assert (await anext(events)).data == b"$ "  # replayed output first
    await events.aclose()  # detach before the process ends

    async with await sbx.pty.create(cols=90) as pty:
        await pty.resize(91, 25)
        await pty.send("exit\n")
        assert b"".join([c async for c in pty]) == b"$ exit\n"
        assert await pty.wait() == 0
    assert api.sandboxes[sbx.id].processes[pty.pid]["size"] == {"cols": 91, "rows": 25}

    sh = sbx.shell()
    assert (await sh.run("echo z")).stdout == "z\n"
    await sh.close()
    assert await sbx.shells() == []
    status, headers, _ = await sbx.http(8000, path="/x")
    assert status == 201
    assert headers["x-app"] == "yes"


@pytest.mark.asyncio
async def test_unreachable_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with AsyncClient(config=ClientConfig(url, "k")) as c:
        with pytest.raises(errors.Unavailable, match=r"127\.0\.0\.1"):
            await c.list_sandboxes()
        with pytest.raises(errors.Unavailable):
            [e async for e in c.sandbox("sbx-e0a1-abcdefghijklmnopqrst").exec_stream("x")]


@pytest.mark.asyncio
async def test_async_batch_sandboxes_by_project() -> None:
    api = FakeApi()
    a, b = api.add_sandbox(), api.add_sandbox()
    transport = httpx.MockTransport(api.async_handler)
    async with AsyncClient("http://fake", FAKE_KEY, http_transport=transport) as client:
        results = await client.batch_sandboxes("pause", project="p")
    assert sorted((r.id, r.ok) for r in results) == sorted([(a, True), (b, True)])
    assert {api.sandboxes[s].info["state"] for s in (a, b)} == {"paused"}
