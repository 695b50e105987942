"""The unmodified E2B SDK (asyncio client) against OpenDsec through the gateway."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest

from dsec.testing.platform import RunningPlatform
from tests.waits import auntil

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")

from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    SandboxQuery,
    TimeoutException,
)

pytestmark = [pytest.mark.platform, pytest.mark.asyncio]


@pytest.fixture
def e2b_env(platform: RunningPlatform, monkeypatch: pytest.MonkeyPatch) -> str:
    gateway = f"http://{platform.layout.gateway}"
    monkeypatch.setenv("E2B_API_URL", gateway)
    monkeypatch.setenv("E2B_SANDBOX_URL", gateway)
    monkeypatch.setenv("E2B_API_KEY", platform.admin_key)
    return gateway


async def test_async_lifecycle_and_commands(e2b_env: str) -> None:
    tag = uuid.uuid4().hex[:8]
    sbx = await AsyncSandbox.create(timeout=120, metadata={"async": tag}, envs={"A": "1"})
    try:
        r = await sbx.commands.run("echo $A $B; echo e >&2", envs={"B": "2"}, cwd="/tmp")
        assert (r.stdout, r.stderr, r.exit_code) == ("1 2\n", "e\n", 0)
        with pytest.raises(CommandExitException) as ei:
            await sbx.commands.run("exit 7")
        assert ei.value.exit_code == 7
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 30", timeout=1)

        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"async": tag})).next_items()
        assert [i.sandbox_id for i in listed] == [sbx.sandbox_id]
        await sbx.set_timeout(300)
        info = await sbx.get_info()
        assert info.metadata == {"async": tag}
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.commands.run("echo hi")).stdout == "hi\n"
    finally:
        assert await sbx.kill() is True
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)


async def test_async_background_stdin_files_pty(e2b_env: str) -> None:
    sbx = await AsyncSandbox.create(timeout=120)
    try:
        h = await sbx.commands.run("sleep 60", background=True)
        assert h.pid in [p.pid for p in await sbx.commands.list()]
        assert await sbx.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException):
            await h.wait()

        cat = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(cat.pid, "in-async\n")
        await sbx.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "in-async\n"

        await sbx.files.write("/tmp/as/x.txt", "text")
        await sbx.files.write("/tmp/as/y.bin", b"\x00\xff")
        assert await sbx.files.read("/tmp/as/x.txt") == "text"
        assert bytes(await sbx.files.read("/tmp/as/y.bin", format="bytes")) == b"\x00\xff"
        assert sorted(e.name for e in await sbx.files.list("/tmp/as")) == ["x.txt", "y.bin"]
        assert (await sbx.files.get_info("/tmp/as")).type == FileType.DIR
        assert await sbx.files.make_dir("/tmp/as/sub") is True
        await sbx.files.rename("/tmp/as/x.txt", "/tmp/as/sub/x.txt")
        await sbx.files.remove("/tmp/as/y.bin")
        assert not await sbx.files.exists("/tmp/as/y.bin")
        assert await sbx.files.exists("/tmp/as/sub/x.txt")

        chunks: list[bytes] = []
        term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=chunks.append)
        await sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
        await sbx.pty.send_stdin(term.pid, b"stty size; exit\n")
        await asyncio.wait_for(term.wait(), 30)
        assert "40 120" in b"".join(chunks).decode(errors="replace")
    finally:
        await sbx.kill()


async def test_async_bad_key(e2b_env: str) -> None:
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(api_key="not-a-key")


async def test_async_watch_dir_reports_create_write_remove(e2b_env: str) -> None:
    from e2b import FilesystemEvent, FilesystemEventType

    sbx = await AsyncSandbox.create(timeout=120)
    try:
        await sbx.files.make_dir("/tmp/w")
        seen: list[FilesystemEvent] = []
        handle = await sbx.files.watch_dir("/tmp/w", on_event=seen.append)

        def saw(kind: FilesystemEventType) -> Callable[[], bool]:  # (the watch polls)
            return lambda: ("f.txt", kind) in [(e.name, e.type) for e in seen]

        await sbx.files.write("/tmp/w/f.txt", "1")
        await auntil(saw(FilesystemEventType.CREATE), "a create event")
        await sbx.files.write("/tmp/w/f.txt", "22")
        await auntil(saw(FilesystemEventType.WRITE), "a write event")
        await sbx.files.remove("/tmp/w/f.txt")
        await auntil(saw(FilesystemEventType.REMOVE), "a remove event")
        await handle.stop()  # type: ignore[no-untyped-call]
        kinds = [(e.name, e.type) for e in seen]
        assert ("f.txt", FilesystemEventType.CREATE) in kinds
        assert ("f.txt", FilesystemEventType.WRITE) in kinds
        assert ("f.txt", FilesystemEventType.REMOVE) in kinds
        assert all(name == "f.txt" for name, _ in kinds), kinds  # no write temporaries
    finally:
        await sbx.kill()


async def test_async_list_pages_states_metrics_pause_resume(e2b_env: str) -> None:
    from e2b import SandboxState

    tag = uuid.uuid4().hex[:8]
    made = [await AsyncSandbox.create(timeout=120, metadata={"ap": tag}) for _ in range(3)]
    try:
        pager = AsyncSandbox.list(query=SandboxQuery(metadata={"ap": tag}), limit=2)
        first = await pager.next_items()
        assert len(first) == 2
        assert pager.has_next
        rest = await pager.next_items()
        assert len(rest) == 1
        assert not pager.has_next
        assert {i.sandbox_id for i in first + rest} == {m.sandbox_id for m in made}

        [m] = await made[0].get_metrics()
        assert m.cpu_count == 1
        assert 0 < m.mem_used <= m.mem_total

        await made[1].files.write("/tmp/kept", "before pause")
        assert await made[1].pause() is True
        assert await AsyncSandbox.pause(made[1].sandbox_id) is False
        paused = SandboxQuery(metadata={"ap": tag}, state=[SandboxState.PAUSED])
        listed = await AsyncSandbox.list(query=paused).next_items()
        assert [i.sandbox_id for i in listed] == [made[1].sandbox_id]
        again = await AsyncSandbox.connect(made[1].sandbox_id)  # resumes it
        assert (await again.get_info()).state == SandboxState.RUNNING
        assert await again.files.read("/tmp/kept") == "before pause"
    finally:
        for s in made:
            await s.kill()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_info(made[0].sandbox_id)
    with pytest.raises(NotFoundException):
        await AsyncSandbox.get_metrics(made[0].sandbox_id)


async def test_async_connect_to_a_running_command_and_hang_up(e2b_env: str) -> None:
    sbx = await AsyncSandbox.create(timeout=120)
    try:
        slow = await sbx.commands.run(
            "for i in 1 2 3; do echo $i; sleep 0.3; done", background=True
        )
        await slow.disconnect()
        seen: list[str] = []
        again = await sbx.commands.connect(slow.pid, on_stdout=seen.append)
        assert (await again.wait()).stdout == "1\n2\n3\n"

        # the client goes away in the middle of a foreground command: the command ends at
        # its timeout (sent as the call's deadline) and nothing is left running
        task = asyncio.create_task(sbx.commands.run("sleep 60 # async-hangup", timeout=6))

        async def running() -> bool:
            return any("async-hangup" in " ".join(p.args) for p in await sbx.commands.list())

        await auntil(running, "the command started", 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not any("async-hangup" in " ".join(p.args) for p in await sbx.commands.list()):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the abandoned command is still running")
    finally:
        await sbx.kill()


async def test_async_wrong_access_token_and_unknown_sandbox(e2b_env: str) -> None:
    import httpx

    sbx = await AsyncSandbox.create(timeout=60)
    try:
        headers = {
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": "not-a-key",
        }
        async with httpx.AsyncClient(base_url=e2b_env, timeout=30) as h:
            r = await h.post("/process.Process/List", headers=headers, json={})
            assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")
            r = await h.get("/files", params={"path": "/etc/hostname"}, headers=headers)
            assert r.status_code == 401
    finally:
        await sbx.kill()
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect("sbx-none-aaaaaaaaaaaaaaaaaaaa")
    assert await AsyncSandbox.kill("sbx-none-aaaaaaaaaaaaaaaaaaaa") is False
