"""The trajectory log end to end on the real platform: preemption (SIGKILL of the client at
random steps, then a rerun from the top), mismatch policies, restore from a checkpoint."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from dsec.core import errors
from dsec.sdk import Client, Sandbox
from dsec.testing.platform import RunningPlatform

AGENT = Path(__file__).with_name("trajectory_agent.py")
ROUNDS = 6


def _agent(platform: RunningPlatform, trajectory: str) -> subprocess.Popen[str]:
    env = {**platform.env(), "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    return subprocess.Popen(
        [sys.executable, str(AGENT), trajectory, str(ROUNDS)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_to_end(platform: RunningPlatform, trajectory: str) -> list[dict[str, object]]:
    proc = _agent(platform, trajectory)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return [json.loads(line) for line in out.splitlines()]


def _run_and_kill(
    platform: RunningPlatform, trajectory: str, after: int, rng: random.Random
) -> int:
    """Start the agent, SIGKILL it once it printed ``after`` rounds (plus a random few ms,
    so the kill may land inside a call); the rounds it printed."""
    proc = _agent(platform, trajectory)
    assert proc.stdout is not None
    seen = 0
    try:
        while seen < after:
            line = proc.stdout.readline()
            assert line, f"the agent ended early: {proc.stderr.read() if proc.stderr else ''}"
            seen += 1
        time.sleep(rng.uniform(0, 0.3))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return seen


def _state(sbx: Sandbox) -> dict[str, str]:
    return {
        "notes": sbx.files.read("/repo/notes.txt").decode(),
        "commits": sbx.files.read("/repo/.minigit/log").decode(),
        "counter": sbx.files.read("/srv/counter.log").decode(),
    }


@pytest.mark.timeout(900)
def test_preempted_agent_resumes_and_every_step_runs_once(
    platform: RunningPlatform, api: Client
) -> None:
    tag = uuid.uuid4().hex[:8]
    reference = _run_to_end(platform, f"ref/{tag}")
    assert reference[-1]["replayed"] == 0
    rng = random.Random(int(tag, 16))
    trajectory = f"preempt/{tag}"
    for after in sorted(rng.sample(range(1, ROUNDS), 2)):
        _run_and_kill(platform, trajectory, after, rng)
    rerun = _run_to_end(platform, trajectory)
    # The rerun printed exactly what the uninterrupted run printed.
    assert rerun[:-1] == reference[:-1]
    assert int(str(rerun[-1]["replayed"])) > 0, "the rerun replayed recorded steps"
    # And the sandbox state shows every step executed exactly once.
    want_counter = "".join(f"{i}\n" for i in range(1, ROUNDS + 1))
    want_notes = "".join(f"round-{i}\n" for i in range(ROUNDS))
    ref_sbx = Sandbox.connect(str(reference[-1]["done"]), client=api)
    sbx = Sandbox.connect(str(rerun[-1]["done"]), client=api)
    try:
        got, want = _state(sbx), _state(ref_sbx)
        assert got == want
        assert got["counter"] == want_counter
        assert got["notes"] == want_notes
        assert len(got["commits"].splitlines()) == ROUNDS
        (t,) = api.list_trajectories(name=trajectory)
        assert t["sandbox_id"] == sbx.id
        assert t["mode"] == "record"
        steps = api.export_trajectory(t["id"])
        assert [s["n"] for s in steps] == list(range(len(steps)))
        calls = [
            s for s in steps if s["op"] == "exec" and "call_counter" in json.dumps(s["request"])
        ]
        assert len(calls) == ROUNDS
        assert [c["result"]["stdout"] for c in calls] == [
            base64.b64encode(f"{i}\n".encode()).decode() for i in range(1, ROUNDS + 1)
        ]
    finally:
        for s in (sbx, ref_sbx):
            s.kill()
        for name in (trajectory, f"ref/{tag}"):
            for t in api.list_trajectories(name=name):
                api.remove_trajectory(t["id"])


@pytest.mark.timeout(300)
def test_mismatch_policies(platform: RunningPlatform, api: Client) -> None:
    name = f"mismatch/{uuid.uuid4().hex[:8]}"
    sbx = Sandbox.create(memory_mb=256, trajectory=name, client=api)
    try:
        assert sbx.exec("echo one").stdout == "one\n"
        assert sbx.exec("echo two").stdout == "two\n"
        again = Sandbox.create(memory_mb=256, trajectory=name, on_mismatch="fail", client=api)
        assert again.id == sbx.id, "the live sandbox is re-attached"
        assert again.exec("echo one").stdout == "one\n"
        with pytest.raises(errors.TrajectoryMismatch) as exc_info:
            again.exec("echo TWO")
        assert "step 1" in str(exc_info.value)
        status = again.trajectory_status()
        assert status["divergence"]["step"] == 1
        assert status["divergence"]["field"] == "cmd"
        assert status["divergence"]["recorded"] == "echo two"
        # Headers say what happened to each call.
        h = httpx.post(
            f"{platform.api_url}/v1/sandboxes/{sbx.id}/exec",
            json={"cmd": "echo two"},
            headers={"Authorization": f"Bearer {platform.admin_key}"},
            timeout=60,
        )
        assert h.headers["X-Dsec-Trajectory-Mode"] == "replayed"
        assert h.headers["X-Dsec-Trajectory-Step"] == "1"
        third = Sandbox.create(memory_mb=256, trajectory=name, client=api)  # diverge
        third.exec("echo one")
        assert third.exec("echo 2").stdout == "2\n"  # runs for real
        st = third.trajectory_status()
        assert st["divergence"]["step"] == 1
        assert st["steps"] == 2
        assert st["mode"] == "record"
    finally:
        sbx.kill()
        for t in api.list_trajectories(name=name):
            api.remove_trajectory(t["id"])


@pytest.mark.timeout(600)
def test_lost_sandbox_is_restored_from_its_checkpoint(api: Client) -> None:
    name = f"restore/{uuid.uuid4().hex[:8]}"
    sbx = Sandbox.create(memory_mb=256, trajectory=name, client=api)
    try:
        sbx.exec("echo a > /f")  # not idempotent, but before the checkpoint
        ckpt = sbx.checkpoint()
        assert ckpt["step"] == 1
        sbx.exec("echo b >> /f", idempotent=True)
        sbx.files.write("/g", "g", idempotent=True)
        sbx.kill()
        again = Sandbox.create(memory_mb=256, trajectory=name, client=api)
        assert again.id != sbx.id
        assert again.exec("echo a > /f").exit_code == 0  # replayed
        again.exec("echo b >> /f", idempotent=True)
        again.files.write("/g", "g", idempotent=True)
        assert again.trajectory_status()["replayed"] == 3
        assert again.exec("cat /f /g", idempotent=True).stdout == "a\nb\ng"  # beyond the log
        again.exec("echo c >> /f")  # not idempotent, after the checkpoint
        again.kill()
        with pytest.raises(errors.NotRestorable) as exc_info:
            Sandbox.create(memory_mb=256, trajectory=name, client=api)
        assert "step 4" in str(exc_info.value)
        assert "echo c >> /f" in str(exc_info.value)
    finally:
        for t in api.list_trajectories(name=name):
            api.remove_trajectory(t["id"])


def _cli(platform: RunningPlatform, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", *args],
        env=platform.env(),
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(300)
def test_cli_bind_checkpoint_policy_and_quota(platform: RunningPlatform, api: Client) -> None:
    name = f"cli/{uuid.uuid4().hex[:8]}"
    out = _cli(platform, "sandbox", "create", "--memory", "256", "--trajectory", name)
    assert out.returncode == 0, out.stderr
    sid = out.stdout.strip()
    sbx = Sandbox.connect(sid, client=api)
    other = Sandbox.create(memory_mb=256, client=api)
    try:
        sbx.exec("echo hi > /x")
        sbx.files.write("/big", b"z" * 200_000)  # over 64 KiB: kept as a blob
        assert sbx.files.read("/big") == b"z" * 200_000
        list(sbx.exec_stream("echo streamed"))  # the runtime WebSocket: not recorded
        assert sbx.trajectory_status()["steps"] == 3
        ls = _cli(platform, "trajectory", "ls", "--json")
        assert name in [t["name"] for t in json.loads(ls.stdout)]
        show = _cli(platform, "trajectory", "show", name)
        assert "steps        3" in show.stdout, show.stdout
        lines = _cli(platform, "trajectory", "export", name).stdout.splitlines()
        assert [json.loads(line)["op"] for line in lines] == ["exec", "files.write", "files.read"]
        # An existing sandbox bound later, with a checkpoint every 2 steps.
        other.bind_trajectory(f"{name}-b", checkpoint_every=2)
        other.exec("true")
        assert other.trajectory_status()["checkpoints"] == []
        other.exec("true")
        (ckpt,) = other.trajectory_status()["checkpoints"]
        assert ckpt["step"] == 2
        for _ in range(6):
            other.exec("true")
        kept = [k["step"] for k in other.trajectory_status()["checkpoints"]]
        assert kept == [4, 6, 8], "the latest three checkpoints are kept"
        images = {i["name"] for i in api.list_images()}
        assert ckpt["image"] not in images
        assert other.trajectory_status()["checkpoints"][-1]["image"] in images
        # The project's quota on log bytes.
        project = api.whoami().project
        before = api.trajectory_quota(project)
        assert before["used_bytes"] > 200_000
        api.set_trajectory_quota(project, 1)
        try:
            with pytest.raises(errors.QuotaExceeded) as exc_info:
                sbx.exec("echo refused")
            assert "quota" in str(exc_info.value)
        finally:
            api.set_trajectory_quota(project, before["limit_bytes"])
        rm = _cli(platform, "trajectory", "rm", name, f"{name}-b")
        assert rm.returncode == 0, rm.stderr
        assert api.list_trajectories(name=name) == []
        gone = _cli(platform, "trajectory", "show", name)
        assert gone.returncode == 2
        assert "no trajectory" in gone.stderr
    finally:
        sbx.kill()
        other.kill()
