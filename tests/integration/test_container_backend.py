"""The container backend against real crun, overlayfs and cgroups (root only).

Each test creates sandboxes with the fake agent bundle (a shell init that sleeps) and looks
inside with ``crun exec``; every test ends by checking nothing was leaked.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from dsec.core.errors import ImageNotFound, InvalidArgument, SandboxFailed
from dsec.core.spec import SandboxSpec
from dsec.edge.backends.api import RuntimeState, SandboxPaths
from dsec.edge.backends.container import cgroups, ocispec, overlay, testkit
from dsec.edge.backends.container.backend import ContainerBackend
from dsec.edge.backends.container.testkit import ContainerTestEnv

pytestmark = pytest.mark.root


async def sh(backend: ContainerBackend, sid: str, script: str, limit: float = 30) -> str:
    res = await backend.crun.exec(sid, ["/bin/sh", "-c", script], time_limit=limit)
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode()


async def destroy_and_check(backend: ContainerBackend, sid: str, paths: SandboxPaths) -> None:
    await backend.destroy(sid, paths)
    assert await asyncio.to_thread(backend.leaked, sid, paths) == []
    assert await backend.state(sid) == (RuntimeState.MISSING, 0)


@pytest.mark.asyncio
async def test_availability_names_the_cgroup_mode(backend: ContainerBackend) -> None:
    av = backend.availability()
    assert av.available, av.reason
    layout = cgroups.detect()
    assert layout.mode.value in av.reason
    if layout.crun_needs_private_ns:
        assert "private mntns" in av.reason


@pytest.mark.asyncio
async def test_isolation(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    sid, paths = cenv.sandbox()
    started = await backend.create(sid, SandboxSpec(env={"FOO": "bar"}), paths)
    try:
        assert await backend.state(sid) == (RuntimeState.RUNNING, started.pid)
        assert (await sh(backend, sid, "hostname")).strip() == sid
        assert (await sh(backend, sid, "ls /sys/class/net")).split() == ["lo"]
        cmdline = await sh(backend, sid, "tr '\\0' ' ' < /proc/1/cmdline")
        assert cmdline.split() == ["/bin/sh", "/.dsec/init"]
        env = (await sh(backend, sid, "tr '\\0' '\\n' < /proc/1/environ")).splitlines()
        assert f"DSEC_SANDBOX_ID={sid}" in env
        assert "FOO=bar" in env
        assert "LANG=C.UTF-8" in env
        # fd 3 of init is the agent socket; nothing else is passed in (the shell running
        # the init script holds the script itself open on a high fd).
        fds = (await sh(backend, sid, "ls /proc/1/fd")).split()
        assert {"0", "1", "2", "3"} <= set(fds)
        for fd in set(fds) - {"0", "1", "2", "3"}:
            assert (await sh(backend, sid, f"readlink /proc/1/fd/{fd}")).strip() == "/.dsec/init"
        assert (await sh(backend, sid, "readlink /proc/1/fd/3")).startswith("socket:")
        assert (await sh(backend, sid, "readlink /proc/1/fd/0")).strip() == "/dev/null"
        status = await sh(backend, sid, "cat /proc/1/status")
        cap_eff = next(ln for ln in status.splitlines() if ln.startswith("CapEff:"))
        assert int(cap_eff.split()[1], 16) == ocispec.capability_mask()
        assert "Seccomp:\t2" in status
        assert "NoNewPrivs:\t0" in status
        # /.dsec is read-only, /.dsec/run is a writable tmpfs.
        res = await backend.crun.exec(sid, ["touch", "/.dsec/x"])
        assert res.returncode != 0
        assert b"Read-only file system" in res.stderr
        await sh(backend, sid, "touch /.dsec/run/ok")
        # Users can be switched, and setuid binaries work (no_new_privileges is off).
        assert (await sh(backend, sid, "su -s /bin/sh -c 'id -u' nobody")).strip() == "65534"
        setuid = "cp /usr/bin/id /usr/local/bin/sid && chmod 4755 /usr/local/bin/sid && "
        setuid += "su -s /bin/sh -c '/usr/local/bin/sid -u' nobody"
        assert (await sh(backend, sid, setuid)).strip() == "0"
        # pid namespace: only the sandbox's processes are visible.
        pids = [p for p in (await sh(backend, sid, "ls /proc")).split() if p.isdigit()]
        assert len(pids) < 10
        # The host sees the pid crun reported, in the sandbox's cgroup.
        host_cg = Path(f"/proc/{started.pid}/cgroup").read_text()
        assert f"/{cenv.cgroup_parent}/{sid}" in host_cg
    finally:
        await destroy_and_check(backend, sid, paths)


@pytest.mark.asyncio
async def test_seccomp_blocks_mount_unshare_and_namespace_clone(
    cenv: ContainerTestEnv, backend: ContainerBackend
) -> None:
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(), paths)
    try:
        # unshare(CLONE_NEWUSER) needs no capability: only the filter can refuse it.
        res = await backend.crun.exec(sid, ["unshare", "-U", "true"])
        assert res.returncode != 0
        assert b"Operation not permitted" in res.stderr
        probe = (
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def call(*args):\n"
            "    r = libc.syscall(*args)\n"
            "    if r == 0:\n"
            "        os._exit(0)\n"  # a clone that was let through: the child leaves
            "    return r, ctypes.get_errno()\n"
            "print(libc.mount(b'none', b'/mnt', b'tmpfs', 0, None), ctypes.get_errno())\n"
            "print(*call(272, 0x10000000))\n"  # unshare(CLONE_NEWUSER)
            "print(*call(56, 0x10000000 | 17, 0, 0, 0, 0))\n"  # clone(CLONE_NEWUSER|SIGCHLD)
            "print(*call(56, 0x40000000 | 17, 0, 0, 0, 0))\n"  # clone(CLONE_NEWNET|SIGCHLD)
            "print(*call(250, 0, -3, 0))\n"  # keyctl(GET_KEYRING_ID, session): no cap needed
            "print(*call(425, 1, 0))\n"  # io_uring_setup: EFAULT without the filter
            "print(*call(435, 0, 0))\n"  # clone3: ENOSYS, so libc falls back to clone
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(7)\n"
            "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        )
        out = (await sh(backend, sid, f'python3 -c "{probe}"')).split("\n")
        assert out[:6] == ["-1 1"] * 6
        assert out[6] == "-1 38"
        assert out[7] == "7"  # ordinary fork still works
        # Threads use clone3, which answers ENOSYS so libc falls back to clone.
        threads = "import threading; t = threading.Thread(target=print, args=('ok',)); "
        threads += "t.start(); t.join()"
        assert (await sh(backend, sid, f'python3 -c "{threads}"')).strip() == "ok"
    finally:
        await destroy_and_check(backend, sid, paths)


@pytest.mark.asyncio
async def test_agent_socket_reaches_init(cenv: ContainerTestEnv, tmp_path: Path) -> None:
    """The edge connects to the host-side socket; init accepts it on fd 3."""
    echo_init = (
        "#!/usr/bin/python3\n"
        "import os, socket\n"
        "s = socket.socket(fileno=3)\n"
        "while True:\n"
        "    c, _ = s.accept()\n"
        "    c.sendall(f'hello from {os.uname().nodename} pid {os.getpid()}'.encode())\n"
        "    c.close()\n"
    )
    bundle = testkit.make_fake_agent_bundle(tmp_path / "agent", echo_init)
    paths_ = cenv.paths.__class__(home=cenv.paths.home, data=tmp_path, run=cenv.paths.run)
    assert paths_.agent_bundle == bundle
    backend = ContainerBackend(
        paths_, "e0a1", image_store=cenv.store, cgroup_parent=cenv.cgroup_parent
    )
    sid, paths = cenv.sandbox()
    await backend.create(sid, SandboxSpec(), paths)
    try:
        assert paths.agent_socket.is_socket()
        assert (paths.agent_socket.stat().st_mode & 0o777) == 0o600

        def talk() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(20)
                c.connect(str(paths.agent_socket))  # queued even before init listens
                return c.recv(200)

        assert await asyncio.to_thread(talk) == f"hello from {sid} pid 1".encode()
    finally:
        await destroy_and_check(backend, sid, paths)


@pytest.mark.asyncio
async def test_pause_resume_and_idempotency(
    cenv: ContainerTestEnv, backend: ContainerBackend
) -> None:
    sid, paths = cenv.sandbox()
    started = await backend.create(sid, SandboxSpec(), paths)
    try:
        again = await backend.create(sid, SandboxSpec(), paths)  # repeated after a crash
        assert again == started
        await backend.pause(sid)
        await backend.pause(sid)
        assert await backend.state(sid) == (RuntimeState.PAUSED, started.pid)
        usage = await backend.usage(sid)
        assert usage["pids"] >= 1
        await backend.resume(sid)
        await backend.resume(sid)
        assert await backend.state(sid) == (RuntimeState.RUNNING, started.pid)
        await backend.pause(sid)  # destroy must cope with a frozen sandbox
    finally:
        await destroy_and_check(backend, sid, paths)
    await destroy_and_check(backend, sid, paths)  # twice is fine
    with pytest.raises(InvalidArgument):
        await backend.destroy("../etc", paths)


@pytest.mark.asyncio
async def test_stopped_when_init_dies(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    sid, paths = cenv.sandbox()
    started = await backend.create(sid, SandboxSpec(), paths)
    try:
        os.kill(started.pid, 9)  # the container's init, started by this test
        deadline = time.monotonic() + 10
        while (await backend.state(sid))[0] is RuntimeState.RUNNING:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await backend.state(sid) == (RuntimeState.STOPPED, 0)
    finally:
        await destroy_and_check(backend, sid, paths)


@pytest.mark.asyncio
async def test_failed_creates_leave_nothing(
    cenv: ContainerTestEnv, backend: ContainerBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid, paths = cenv.sandbox()
    with pytest.raises(ImageNotFound, match="not on this edge"):
        await backend.create(sid, SandboxSpec(image="no-such-image"), paths)
    assert backend.leaked(sid, paths) == []

    missing = ContainerBackend(
        cenv.paths.__class__(home=cenv.paths.home, data=cenv.root / "nodata", run=cenv.paths.run),
        "e0a1",
        image_store=cenv.store,
        cgroup_parent=cenv.cgroup_parent,
    )
    with pytest.raises(SandboxFailed, match="agent bundle"):
        await missing.create(sid, SandboxSpec(), paths)
    assert backend.leaked(sid, paths) == []

    # crun itself fails after the mount, socket and cgroups exist: all rolled back.
    real = ocispec.build_config

    def broken(**kw: Any) -> dict[str, Any]:
        cfg = real(**kw)
        cfg["process"]["args"] = ["/.dsec/does-not-exist"]
        return cfg

    monkeypatch.setattr(ocispec, "build_config", broken)
    with pytest.raises(SandboxFailed, match="does-not-exist"):
        await backend.create(sid, SandboxSpec(), paths)
    assert backend.leaked(sid, paths) == []
    assert not paths.state_dir.exists()
    assert not paths.agent_socket.exists()


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_twenty_concurrent_creates(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    boxes = [cenv.sandbox() for _ in range(20)]
    spec = SandboxSpec(memory_mb=128, pids=64, cpu=0.5)
    results = await asyncio.gather(
        *(backend.create(sid, spec, p) for sid, p in boxes), return_exceptions=True
    )
    try:
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors == []
        pids = {r.pid for r in results if not isinstance(r, BaseException)}
        assert len(pids) == 20
        for sid, _ in boxes:
            assert (await backend.state(sid))[0] is RuntimeState.RUNNING
        assert (await sh(backend, boxes[7][0], "hostname")).strip() == boxes[7][0]
    finally:
        await asyncio.gather(*(backend.destroy(sid, p) for sid, p in boxes))
    for sid, p in boxes:
        assert backend.leaked(sid, p) == []
    assert cgroups.list_children(cgroups.detect(), cenv.cgroup_parent) == []


@pytest.mark.asyncio
async def test_crun_create_then_start(cenv: ContainerTestEnv, backend: ContainerBackend) -> None:
    """The two-step crun path (create, start) works with the same launcher and fd 3."""
    sid, paths = cenv.sandbox()
    image = cenv.store.resolve("base")
    dirs = overlay.RootfsDirs.in_state_dir(paths.state_dir)
    await backend._setup()  # before the mount: it may bind the sandboxes dir
    paths.state_dir.mkdir(parents=True)
    dirs.make()
    overlay.mount_rootfs(dirs, image.layer_dirs)
    try:
        config = ocispec.build_config(
            sandbox_id=sid,
            spec=SandboxSpec(),
            image=image,
            rootfs=dirs.rootfs,
            agent_bundle=cenv.paths.agent_bundle,
            cgroups_path=backend.cgroup_path(sid),
        )
        ocispec.write_config(paths.state_dir, config)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            await backend.crun.run_detached(
                sid,
                paths.state_dir,
                listen_fd=s.fileno(),
                console=paths.state_dir / "console.log",
                log=paths.state_dir / "crun.log",
                pid_file=paths.state_dir / "init.pid",
                prefix=backend._launcher(dirs.rootfs).prefix,
                start=False,
            )
        st = await backend.crun.state(sid)
        assert st is not None
        assert st.status == "created"
        assert await backend.state(sid) == (RuntimeState.STOPPED, 0)
        await backend.crun.start(sid)
        assert (await backend.state(sid))[0] is RuntimeState.RUNNING
        assert (await sh(backend, sid, "readlink /proc/1/fd/3")).startswith("socket:")
    finally:
        await destroy_and_check(backend, sid, paths)


def test_parent_cgroup_is_removed_only_when_empty() -> None:
    if reason := testkit.skip_reason():
        pytest.skip(reason)

    from dsec.edge.backends.container import cgroups

    layout = cgroups.detect()
    parent = f"/dsectest-parent-{os.urandom(3).hex()}"
    made = []
    for d in cgroups.sandbox_cgroups(layout, "/"):  # the hierarchy roots
        child = d / parent.strip("/") / "child"
        child.mkdir(parents=True)
        made.append(child)
    try:
        assert cgroups.remove_if_empty(layout, parent) is False
        assert all(c.exists() for c in made)  # nothing under a busy parent is touched
        for c in made:
            c.rmdir()
        assert cgroups.remove_if_empty(layout, parent) is True
        assert cgroups.sandbox_cgroups(layout, parent) == []
    finally:
        for c in made:
            if c.exists():
                c.rmdir()
            if c.parent.exists():
                c.parent.rmdir()
