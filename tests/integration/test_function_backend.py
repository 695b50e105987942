"""The function backend on this host: isolation, limits, statelessness, cleanup (root only).

Each test starts its own pool (a real process forking real workers) on a throw-away node
and checks from outside that nothing is left once the sandbox and the pool are gone.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from dsec.agent import protocol
from dsec.core.errors import BackendUnavailable, InvalidArgument
from dsec.core.netpolicy import NetworkPolicy
from dsec.core.spec import SandboxSpec
from dsec.edge import agent_client
from dsec.edge.backends.api import RuntimeState, SandboxPaths
from dsec.edge.backends.container import cgroups
from dsec.edge.backends.container.testkit import ContainerTestEnv
from dsec.edge.backends.function.backend import FunctionBackend
from tests.waits import auntil

pytestmark = pytest.mark.root


class Fn:
    """One function sandbox on its own pool."""

    def __init__(self, backend: FunctionBackend, sid: str, paths: SandboxPaths) -> None:
        self.backend = backend
        self.sid = sid
        self.paths = paths

    async def call(self, req: dict[str, Any], stdin: bytes | None = None) -> Any:
        return await agent_client.call(self.paths.agent_socket, req, stdin, timeout=60)

    async def run(self, cmd: str | list[str], **args: Any) -> Any:
        res = await self.call({"op": "exec", "cmd": cmd, **args})
        return res, res.result


@pytest_asyncio.fixture
async def fn(cenv: ContainerTestEnv) -> AsyncIterator[Fn]:
    async for f in _fn(cenv):
        yield f


@pytest_asyncio.fixture
async def fn_one_worker(
    cenv: ContainerTestEnv, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Fn]:
    """A pool that keeps exactly one worker, so consecutive calls share it."""
    monkeypatch.setenv("DSEC_FUNCTION_WARM", "1")
    monkeypatch.setenv("DSEC_FUNCTION_MAX_WORKERS", "1")
    async for f in _fn(cenv):
        yield f


async def _fn(cenv: ContainerTestEnv) -> AsyncIterator[Fn]:
    backend = FunctionBackend(
        cenv.paths, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
    )
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(backend="function", memory_mb=128, pids=64), paths)
    pool_pid = backend.pool_pid()
    try:
        yield Fn(backend, sid, paths)
    finally:
        await backend.destroy(sid, paths)
        assert backend.leaked(sid, paths) == []
        workers = [w["pid"] for w in (await backend.stats())["workers"]]
        await backend.close()
        backend.release_host_setup()
    assert backend.leaked(sid, paths) == []
    assert not os.path.exists(f"/proc/{pool_pid}/status") or _zombie(pool_pid)
    assert [p for p in workers if os.path.exists(f"/proc/{p}") and not _zombie(p)] == []
    layout = cgroups.detect()
    assert cgroups.sandbox_cgroups(layout, "/" + backend.cgroup) == []


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.asyncio
async def test_exec_runs_unprivileged_in_fresh_namespaces(fn: Fn) -> None:
    res, out = await fn.run(
        "id -u; hostname; pwd; readlink /proc/self/ns/net /proc/self/ns/mnt /proc/self/ns/pid;"
        " grep Seccomp: /proc/self/status; ls /proc | grep -c '^[0-9]';"
        " grep NoNewPrivs: /proc/self/status; cut -d' ' -f1,5,6 /proc/$$/stat"
    )
    assert out["exit_code"] == 0, res.stderr
    lines = res.stdout.decode().split()
    assert lines[0] == "65534"
    assert lines[1] == "function"
    assert lines[2] == "/tmp"
    for ns, theirs in zip(("net", "mnt", "pid"), lines[3:6], strict=True):
        assert theirs != os.readlink(f"/proc/self/ns/{ns}"), ns
    assert lines[6:8] == ["Seccomp:", "2"]
    assert int(lines[8]) <= 5  # pid 1, the shell, ls, grep: nothing of the host
    assert lines[9:11] == ["NoNewPrivs:", "1"]
    pid, pgrp, session = lines[11:14]
    assert pid == pgrp == session == "2", lines  # its own session, under the call's init


# Call 1 leaves a file in /tmp and /dev/shm, a SysV shared memory segment and a background
# process; call 2, served by the same worker, must see none of them.
SHMGET = "import ctypes; print(ctypes.CDLL(None).shmget(0x5eed, 4096, {flags}))"


@pytest.mark.asyncio
async def test_state_does_not_leak_between_calls(fn_one_worker: Fn) -> None:
    fn = fn_one_worker
    leave = (
        "echo secret > /tmp/left; echo secret > /dev/shm/left; "
        f"python3 -c '{SHMGET.format(flags=0o1600)}'; "
        "setsid sleep 300 < /dev/null > /dev/null 2>&1 & echo started"
    )
    res, out = await fn.run(leave)
    assert out["exit_code"] == 0, res.stderr
    shmid, started = res.stdout.decode().split()
    assert int(shmid) >= 0
    assert started == "started"
    (first,) = (await fn.backend.stats())["workers"]
    look = (
        "cat /tmp/left /dev/shm/left; pgrep -c sleep; ls -A /tmp /dev/shm | wc -l; "
        f"python3 -c '{SHMGET.format(flags=0)}'; ls /proc | grep -c '^[0-9]'"
    )
    res, out = await fn.run(look)
    sleeps, entries, shmid, procs = res.stdout.decode().split()
    assert (sleeps, entries, shmid) == ("0", "3", "-1"), res.stderr  # 3: two headers, a gap
    assert int(procs) <= 4  # pid 1, the shell, ls, grep
    assert res.stderr.count(b"No such file") == 2
    (worker,) = (await fn.backend.stats())["workers"]
    assert worker["pid"] == first["pid"]  # the same worker served both calls


@pytest.mark.asyncio
async def test_a_calls_files_never_change_who_runs_it_or_the_next_call(fn_one_worker: Fn) -> None:
    """Users are looked up in the image's /etc/passwd and /etc/group (once per worker): a
    call that brings its own /etc/group gets no extra group, nor does the next call."""
    fn = fn_one_worker
    group = b"root:x:0:\nnogroup:x:65534:\nextra:x:4242:nobody\n"
    files = [{"path": "/etc/group", "data": base64.b64encode(group).decode()}]
    res, out = await fn.run("id -G; grep -c 4242 /etc/group", files=files)
    assert out["exit_code"] == 0, res.stderr
    groups, written = res.stdout.decode().split("\n")[:2]
    assert written == "1"  # the call's file is there, and read as its own
    assert "4242" not in groups.split()
    res, out = await fn.run("id -G; grep -c 4242 /etc/group")
    groups, written = res.stdout.decode().split("\n")[:2]
    assert written == "0"
    assert "4242" not in groups.split()


@pytest.mark.asyncio
async def test_stdin_env_cwd_and_files_in_and_out(fn: Fn) -> None:
    data = base64.b64encode(b"print(input() + ' ' + open('in.txt').read())").decode()
    res = await fn.call(
        {
            "op": "exec",
            "cmd": "mkdir -p out && python3 /app/main.py > out/r.txt; echo $GREETING",
            "stdin": True,
            "env": {"GREETING": "hello"},
            "cwd": "/tmp",
            "files": [
                {"path": "/app/main.py", "data": data},
                {"path": "in.txt", "data": base64.b64encode(b"world").decode()},
            ],
            "outputs": ["/tmp/out/r.txt", "/tmp/missing", "/proc/1/environ"],
        },
        stdin=b"hi\n",
    )
    out = res.result
    assert out["exit_code"] == 0, res.stderr
    assert res.stdout == b"hello\n"
    assert [f["path"] for f in out["files"]] == ["/tmp/out/r.txt"]
    assert base64.b64decode(out["files"][0]["data"]) == b"hi world\n"


@pytest.mark.asyncio
async def test_calls_that_fail_before_their_command_runs_leave_the_worker_usable(
    fn_one_worker: Fn,
) -> None:
    fn = fn_one_worker  # one worker: each failure must leave its zygote in step
    res, out = await fn.run(["/no/such/program"])
    assert out["exit_code"] == 127
    assert b"/no/such/program" in res.stderr
    res, out = await fn.run(["/etc/passwd"])  # not executable
    assert out["exit_code"] == 126
    with pytest.raises(Exception, match="working directory"):
        await fn.run(["true"], cwd="/no/such/dir")
    with pytest.raises(Exception, match="unprivileged"):
        await fn.run(["true"], user=0)
    res, out = await fn.run("echo ok")
    assert out["exit_code"] == 0
    assert res.stdout == b"ok\n"


@pytest.mark.asyncio
async def test_call_over_its_time_limit_is_killed(fn: Fn) -> None:
    t0 = time.monotonic()
    _, out = await fn.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10
    assert out["timed_out"] is True
    assert out["exit_code"] == 137


@pytest.mark.asyncio
async def test_a_signal_reaches_a_command_without_a_handler(fn: Fn) -> None:
    """The call's init (pid 1) forwards SIGTERM: a command that is not pid 1 dies of it."""
    req = {"op": "exec", "cmd": "echo $$; exec sleep 30", "timeout": 60}
    stream = await agent_client.open_stream(fn.paths.agent_socket, req)
    t0 = time.monotonic()
    try:
        started = False
        async for kind, payload in stream:
            if kind == protocol.KIND_JSON and b'"started"' in payload and not started:
                started = True
            elif kind == protocol.KIND_OUT:
                assert payload.strip() == b"2"  # the command is pid 2, its init pid 1
                await stream.send_json({"signal": 15})
    finally:
        await stream.aclose()
    assert started
    assert stream.final is not None
    out = stream.final["result"]
    assert (out["signal"], out["exit_code"], out["timed_out"]) == (15, 143, False)
    assert time.monotonic() - t0 < 20


ZOMBIES = """
import glob, os, time
if os.fork() == 0:
    if os.fork() == 0:
        os._exit(0)  # an orphan once its parent is gone
    os._exit(0)
os.wait()
for _ in range(100):  # until init reaped it, or 10 s
    stats = [open(f).read() for f in glob.glob("/proc/[0-9]*/stat")]
    zombies = sum(s.rsplit(")", 1)[1].split()[0] == "Z" for s in stats)
    if not zombies:
        break
    time.sleep(0.1)
print(zombies)
"""


@pytest.mark.asyncio
async def test_orphans_are_reaped_while_the_command_runs(fn: Fn) -> None:
    """An orphan goes to the call's init, which reaps it (the command does not)."""
    res, out = await fn.run(["python3", "-c", ZOMBIES])
    assert out["exit_code"] == 0, res.stderr
    assert res.stdout.strip() == b"0"


@pytest.mark.asyncio
async def test_call_over_its_memory_limit_is_oom_killed(fn: Fn) -> None:
    hog = ["python3", "-c", "x = bytearray(200 * 2**20); print('survived')"]
    res, out = await fn.run(hog, memory_mb=48)
    assert out["oom_killed"] is True, (out, res.stderr)
    assert out["exit_code"] == 137
    assert out["signal"] == 9
    assert b"survived" not in res.stdout
    _, out = await fn.run(["python3", "-c", "x = bytearray(20 * 2**20)"], memory_mb=64)
    assert out["exit_code"] == 0
    assert "oom_killed" not in out


@pytest.mark.asyncio
async def test_memory_limit_above_the_sandbox_is_refused(fn: Fn) -> None:
    with pytest.raises(InvalidArgument, match="memory_mb"):
        await fn.run("true", memory_mb=4096)


@pytest.mark.asyncio
async def test_no_network(fn: Fn) -> None:
    probe = (
        "import socket\n"
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n"
        "s = socket.socket()\n"
        "s.settimeout(2)\n"
        "try:\n"
        "    s.connect(('10.255.255.1', 9))\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno)\n"
    )
    res, out = await fn.run(["python3", "-c", probe])
    assert out["exit_code"] == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0] == "['lo']"
    assert lines[1].endswith(" 101")  # ENETUNREACH: no route, nothing was sent


@pytest.mark.asyncio
async def test_stateful_ops_name_the_backend_to_use(fn: Fn) -> None:
    for req in (
        {"op": "files.read", "path": "/etc/hostname"},
        {"op": "process.start", "cmd": "sleep 1"},
        {"op": "shell.run", "cmd": "cd /"},
        {"op": "pty.resize", "pid": 1, "cols": 80, "rows": 24},
    ):
        with pytest.raises(BackendUnavailable, match="use backend='container'"):
            _ = (await fn.call(req)).result
    with pytest.raises(BackendUnavailable, match="pause"):
        await fn.backend.pause(fn.sid)


@pytest.mark.asyncio
async def test_root_is_refused(fn: Fn) -> None:
    with pytest.raises(Exception, match="unprivileged"):
        await fn.run("id", user="root")


@pytest.mark.asyncio
async def test_concurrent_calls_each_get_their_own_worker(fn: Fn) -> None:
    results = await asyncio.gather(
        *(fn.run(f"echo {i} > /tmp/me; sleep 0.2; cat /tmp/me") for i in range(8))
    )
    assert sorted(int(r.stdout) for r, _ in results) == list(range(8))


@pytest.mark.asyncio
async def test_destroy_kills_calls_in_flight(cenv: ContainerTestEnv) -> None:
    backend = FunctionBackend(
        cenv.paths, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
    )
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(backend="function"), paths)
    try:
        assert await backend.state(sid) == (RuntimeState.RUNNING, backend.pool_pid())
        call = asyncio.ensure_future(
            agent_client.call(paths.agent_socket, {"op": "exec", "cmd": "sleep 60"})
        )

        async def busy() -> list[dict[str, object]]:
            return [w for w in (await backend.stats())["workers"] if w["state"] == "busy"]

        await auntil(busy, "the call reached a worker")
        assert len(await busy()) == 1
        await backend.destroy(sid, paths)
        with pytest.raises(Exception):  # noqa: B017 (cut off: whichever transport error)
            await asyncio.wait_for(call, 10)
        assert backend.leaked(sid, paths) == []
        assert (await backend.state(sid))[0] is RuntimeState.MISSING
    finally:
        await backend.close()
        backend.release_host_setup()
    assert backend.leaked(sid, paths) == []


@pytest.mark.asyncio
async def test_the_next_sandbox_of_an_image_finds_its_workers_warm(
    cenv: ContainerTestEnv,
) -> None:
    """A removed sandbox's image keeps its workers (LINGER_S): create, call, kill, create."""
    backend = FunctionBackend(
        cenv.paths, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
    )
    spec = SandboxSpec(backend="function")
    first, first_paths = cenv.sandbox()
    second, second_paths = cenv.sandbox()
    try:
        await backend.create(first, spec, first_paths)
        res = await agent_client.call(first_paths.agent_socket, {"op": "exec", "cmd": "true"})
        assert res.result["exit_code"] == 0
        before = {w["pid"] for w in (await backend.stats())["workers"]}
        await backend.destroy(first, first_paths)
        assert backend.leaked(first, first_paths) == []
        await backend.create(second, spec, second_paths)
        # A worker prepares its next call's process after answering: under load it may
        # still be doing so now, so wait for it (the same pid) to be ready.
        ready: set[int] = set()
        for _ in range(200):
            workers = (await backend.stats())["workers"]
            ready = {w["pid"] for w in workers if w["state"] == "ready"}
            if ready:
                break
            await asyncio.sleep(0.05)
        assert ready
        assert ready <= before  # no new worker had to start
        res = await agent_client.call(second_paths.agent_socket, {"op": "exec", "cmd": "true"})
        assert res.result["exit_code"] == 0
        await backend.destroy(second, second_paths)
    finally:
        await backend.close()
        backend.release_host_setup()
    assert backend.leaked(second, second_paths) == []


@pytest.mark.asyncio
async def test_network_rules_are_refused(cenv: ContainerTestEnv) -> None:
    backend = FunctionBackend(
        cenv.paths, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
    )
    sid, paths = cenv.sandbox()
    policy = NetworkPolicy.from_dict({"allow": ["192.0.2.0/24"]})
    with pytest.raises(InvalidArgument, match="no network"):
        await backend.create(sid, SandboxSpec(backend="function", network=policy), paths)
    assert backend.leaked(sid, paths) == []
    assert backend.pool_pid() == 0


@pytest.mark.asyncio
async def test_a_restarted_edge_readopts_function_sandboxes(cenv: ContainerTestEnv) -> None:
    def make() -> FunctionBackend:
        return FunctionBackend(
            cenv.paths, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
        )

    first = make()
    sid, paths = cenv.sandbox()
    await first.create(sid, SandboxSpec(backend="function"), paths)
    old_pool = first.pool_pid()
    await first.close()  # the edge went away (its pool stops with it)
    second = make()
    try:
        state, pid = await second.state(sid)
        assert state is RuntimeState.RUNNING
        assert pid == second.pool_pid() != old_pool
        res = await agent_client.call(paths.agent_socket, {"op": "exec", "cmd": "echo back"})
        assert res.stdout == b"back\n"
        await second.destroy(sid, paths)
        assert (await second.state(sid))[0] is RuntimeState.MISSING
    finally:
        await second.close()
        second.release_host_setup()
    assert second.leaked(sid, paths) == []
