"""The apiserver's cache of trajectory bindings with two apiservers: a sandbox one of them
has seen unbound is bound through the other, and the first still records its calls (the
edge refuses a call sent as for an unbound sandbox once the sandbox is marked bound)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform
from dsec.testing.ports import free_port


@pytest.fixture
def second_apiserver(platform: RunningPlatform, tmp_path: Path) -> Iterator[str]:
    """Another apiserver of the same platform (same home, iam, watcher and log)."""
    addr = f"127.0.0.1:{free_port()}"
    lay = platform.layout
    argv = [sys.executable, "-m", "dsec.apiserver", "--home", str(platform.paths.home)]
    argv += ["--listen", addr, "--iam", lay.iam, "--watcher", lay.watcher]
    with open(tmp_path / "apiserver2.log", "ab") as logf:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=platform.env()
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "apiserver2.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://{addr}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the second apiserver did not start"
            time.sleep(0.1)
        yield f"http://{addr}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metric(api_url: str, name: str) -> float:
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"dsec_apiserver_{name}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(300)
def test_binding_through_another_apiserver_is_recorded(
    platform: RunningPlatform, api: Client, second_apiserver: str
) -> None:
    other = Client(api_url=second_apiserver, api_key=platform.admin_key)
    sbx = Sandbox.create(memory_mb=256, timeout=300, client=api)
    try:
        sbx.exec("true")  # the first apiserver looks the binding up: none (cached)
        sbx.exec("true")  # from the cache: no store read
        refused = _metric(platform.api_url, "trajectory_binding_cache_refused")
        name = f"two-apis/{uuid.uuid4().hex[:8]}"
        Sandbox.connect(sbx.id, client=other).bind_trajectory(name)
        out = sbx.exec("echo recorded")  # through the first apiserver again
        assert out.stdout == "recorded\n"
        status = sbx.trajectory_status()
        assert status["name"] == name
        assert status["steps"] == 1, "a call after the binding ran unrecorded"
        assert _metric(platform.api_url, "trajectory_binding_cache_refused") == refused + 1
        sbx.exec("echo again")  # the first apiserver now knows: no refusal
        assert sbx.trajectory_status()["steps"] == 2
        assert _metric(platform.api_url, "trajectory_binding_cache_refused") == refused + 1
        for t in api.list_trajectories(name=name):
            api.remove_trajectory(t["id"])
        sbx.exec("true")  # unbound again (the edge's mark is gone too): runs, not refused
        assert _metric(platform.api_url, "trajectory_binding_cache_refused") == refused + 1
    finally:
        sbx.kill()
        other.close()


@pytest.mark.timeout(300)
def test_a_trajectory_reopened_through_another_apiserver_is_replayed(
    platform: RunningPlatform, api: Client, second_apiserver: str
) -> None:
    """The first apiserver records from its cached record (no store read); the task restarts
    through the second, which re-opens the trajectory: the first must replay, not run."""
    other = Client(api_url=second_apiserver, api_key=platform.admin_key)
    name = f"two-apis/{uuid.uuid4().hex[:8]}"
    cmd = "echo x >> /tmp/f && wc -l < /tmp/f"
    sbx = Sandbox.create(memory_mb=256, timeout=300, trajectory=name, client=api)
    try:
        outs = [sbx.exec(cmd).stdout for _ in range(3)]  # the 2nd and 3rd from the cache
        assert outs == ["1\n", "2\n", "3\n"]
        refused = _metric(platform.api_url, "trajectory_record_cache_refused")
        again = Sandbox.create(memory_mb=256, timeout=300, trajectory=name, client=other)
        assert again.id == sbx.id  # re-attached; replay from step 0
        assert sbx.exec(cmd).stdout == "1\n", "a call the log holds ran again"
        assert _metric(platform.api_url, "trajectory_record_cache_refused") == refused + 1
        status = sbx.trajectory_status()
        assert (status["mode"], status["cursor"], status["replayed"]) == ("replay", 1, 1)
        assert [sbx.exec(cmd).stdout for _ in range(3)] == ["2\n", "3\n", "4\n"]  # 4: real
        assert sbx.trajectory_status()["steps"] == 4
        for t in other.list_trajectories(name=name):
            other.remove_trajectory(t["id"])
        assert sbx.exec(cmd).stdout == "5\n"  # removed elsewhere: runs, unrecorded
        assert _metric(platform.api_url, "trajectory_record_cache_refused") == refused + 2
    finally:
        sbx.kill()
        other.close()
