"""microVM sandboxes through the SDK and the whole platform (apiserver -> edge -> QEMU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec.edge.backends.microvm import kernel, qemu
from dsec.paths import Paths
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform

pytestmark = pytest.mark.guest_kernel


def _skip_reason() -> str | None:
    data = Paths.from_env().data
    if os.geteuid() != 0:
        return "needs root"
    if qemu.available():
        return qemu.available()
    if kernel.current_kernel(data) is None:
        return "no guest kernel: run `dsec setup`"
    if not (data / "agent" / ".stamp").exists():
        return "no agent bundle: run `dsec setup`"
    return None


def _qemu_count(home: Path) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if qemu.QEMU.encode() in cmd and str(home).encode() in cmd:
                n += 1
    return n


def test_microvm_sandbox_through_the_sdk(platform: RunningPlatform, api: Client) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    sbx = Sandbox.create(backend="microvm", memory_mb=256, timeout=300, client=api)
    children: list[Sandbox] = []
    try:
        r = sbx.exec("uname -r; hostname")
        assert r.exit_code == 0
        assert r.stdout.split()[1] == sbx.id
        sbx.files.write("/root/hello.txt", b"hi from the host")
        assert sbx.files.read("/root/hello.txt") == b"hi from the host"
        sh = sbx.shell("work")
        sh.run("cd /tmp && export X=42")
        assert sh.run("echo $X $(pwd)").stdout.strip() == "42 /tmp"

        sbx.pause()
        assert sbx.info().state == "paused"
        sbx.resume()
        assert sh.run("echo $X").stdout.strip() == "42"

        children = sbx.fork(count=2)
        assert len({c.id for c in children}) == 2
        for c in children:
            assert c.files.read("/root/hello.txt") == b"hi from the host"
            assert c.exec("hostname").stdout.strip() == c.id
    finally:
        for c in children:
            c.kill()
        sbx.kill()
    assert _qemu_count(platform.paths.home) == 0
