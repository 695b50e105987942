"""kill -9 of the edge (and of aether) loses nothing; kill leaves nothing behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform, running_platform
from tests.e2e.conftest import pids_alive
from tests.e2e.leakcheck import leaks


@pytest.fixture(scope="module")
def own_platform() -> Iterator[RunningPlatform]:
    with running_platform() as p:
        yield p


def _mounts_naming(text: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if text in line]


@pytest.mark.timeout(300)
def test_edge_kill_9_readopts_every_sandbox_with_processes_and_shells(
    own_platform: RunningPlatform,
) -> None:
    p = own_platform
    client = Client(api_url=p.api_url, api_key=p.admin_key)
    sbxs = [Sandbox.create(memory_mb=64, timeout=600, client=client) for _ in range(3)]
    before: dict[str, list[int]] = {}
    bg: dict[str, int] = {}
    for s in sbxs:
        s.shell("keep").run("cd /tmp; export KEEP=kept; sleep 1000 &")
        bg[s.id] = s.processes.start(["sleep", "1000"], tag="bg").pid
        before[s.id] = p.sandbox_pids(s.id)
        assert len(before[s.id]) >= 5  # init, aether, chronus, bash, sleeps

    edge_pid = p.pid("edge")
    os.kill(edge_pid, signal.SIGKILL)
    new_pid = p.wait_component("edge", not_pid=edge_pid)
    assert new_pid != edge_pid

    listed = {i.id: i.state for i in client.list_sandboxes()}
    for s in sbxs:
        assert listed[s.id] == "running"
        assert pids_alive(before[s.id]) == before[s.id], "a sandbox process died"
        assert p.sandbox_pids(s.id) == before[s.id]
        r = s.shell("keep").run("echo $KEEP $PWD; jobs | wc -l")
        assert r.stdout.split() == ["kept", "/tmp", "1"]
        assert any(x.pid == bg[s.id] and x.running for x in s.processes.list())
        assert s.exec("echo ok").stdout == "ok\n"

    # aether itself crashing loses nothing either: init restarts it, chronus keeps state.
    s = sbxs[0]
    aether = s.exec("cat /proc/self/status | grep PPid").stdout.split()[1]
    s.exec(f"kill -9 {aether}")
    deadline = time.monotonic() + 20
    while True:
        try:
            r = s.shell("keep").run("echo $KEEP")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert r.stdout == "kept\n"

    # Killing them leaves nothing: no process, mount, cgroup, socket or state.
    for s in sbxs:
        all_pids = p.sandbox_pids(s.id)
        s.kill()
        assert pids_alive(all_pids) == []
        assert leaks(p, s.id) == []
        assert _mounts_naming(s.id) == []
    client.close()


def test_platform_shutdown_leaves_no_mounts_or_namespaces() -> None:
    with running_platform() as p:
        client = Client(api_url=p.api_url, api_key=p.admin_key)
        s = Sandbox.create(memory_mb=64, timeout=600, client=client)
        pids = p.sandbox_pids(s.id)
        run_dir = str(p.paths.run)
        home = str(p.paths.home)
        client.close()
    # `dsec down` semantics: the edge stopped its sandboxes and released its host setup.
    assert pids_alive(pids) == []
    assert _mounts_naming(run_dir) == []
    assert _mounts_naming(home) == []
    assert not Path(home).exists()
