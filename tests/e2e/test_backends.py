"""One switch, four substrates: the same user-level tests on every backend of the edge.

Each test runs once per backend (``function``, ``container``, ``microvm``, ``vm``). A
backend the edge cannot run here is skipped with the edge's own reason; a test needing
something a backend cannot do (persistent processes, pause, PTYs...) is skipped with the
capability it lacks, read from ``client.backends()``, so a new backend joins the suite by
reporting its capabilities, and a behaviour difference between backends fails here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.core import errors
from dsec.core.spec import BACKENDS
from dsec.sdk import Client, CommandTimeout, Sandbox
from dsec.testing.platform import RunningPlatform
from tests.e2e.leakcheck import leaks

# A sandbox per test, except where a boot costs minutes: the vm backend (a systemd boot under
# TCG takes 40-170 s here) runs its tests on one sandbox, which the CLI creates.
SHARED = ("vm",)
SHARED_MEMORY_MB = 256


def _cli(platform: RunningPlatform, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", *args],
        env=platform.env(),
        text=True,
        capture_output=True,
        timeout=540,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, f"dsec {' '.join(args)}: exit {r.returncode}\n{r.stderr}"
    return r.stdout


def _backend_info(api: Client, name: str) -> dict[str, Any]:
    for edge in api.backends():
        for b in edge.get("backends", []):
            if b["name"] == name:
                return dict(b)
    return {"name": name, "available": False, "reason": "no edge reports it", "capabilities": {}}


# The first test of a SHARED backend also waits for its boot (minutes on a loaded host).
PARAMS = [
    pytest.param(b, marks=pytest.mark.timeout(900))
    if b in SHARED
    else pytest.param(b, marks=pytest.mark.guest_kernel)
    if b == "microvm"
    else b
    for b in BACKENDS
]


@pytest.fixture(scope="module", params=PARAMS)
def backend(request: pytest.FixtureRequest, platform: RunningPlatform) -> dict[str, Any]:
    """Module-scoped, so a backend's tests run together and its shared sandbox ends after."""
    with Client(api_url=platform.api_url, api_key=platform.admin_key) as api:
        info = _backend_info(api, request.param)
    if not info["available"]:
        pytest.skip(f"backend {request.param} is not available here: {info['reason']}")
    return info


def _kill(platform: RunningPlatform, s: Sandbox) -> None:
    try:
        s.kill()
    finally:
        s.close()
    assert leaks(platform, s.id) == []  # every backend cleans up after itself


@pytest.fixture(scope="module")
def shared_box(platform: RunningPlatform, backend: dict[str, Any]) -> Iterator[Sandbox | None]:
    """The one sandbox of a SHARED backend (None for the others), made by `dsec sandbox create`."""
    if backend["name"] not in SHARED:
        yield None
        return
    sid = _cli(
        platform,
        *("sandbox", "create", "--backend", backend["name"]),
        *("--memory", str(SHARED_MEMORY_MB), "--timeout", "1800"),
    ).strip()
    client = Client(api_url=platform.api_url, api_key=platform.admin_key)
    s = Sandbox.connect(sid, client=client)
    try:
        yield s
    finally:
        try:
            _kill(platform, s)
        finally:
            client.close()


@pytest.fixture
def box(platform: RunningPlatform, backend: dict[str, Any], shared_box: Sandbox | None,
        api: Client) -> Iterator[Sandbox]:  # fmt: skip
    if shared_box is not None:
        yield shared_box
        return
    s = Sandbox.create(backend=backend["name"], memory_mb=256, timeout=300)
    try:
        yield s
    finally:
        _kill(platform, s)


def need(backend: dict[str, Any], capability: str) -> None:
    if not backend["capabilities"].get(capability):
        pytest.skip(f"backend {backend['name']} has no {capability.replace('_', ' ')}")


# ---- what every backend does ------------------------------------------------------------


def test_exec_output_and_exit_code(box: Sandbox) -> None:
    r = box.exec("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = box.exec(["python3", "-c", "print(6 * 7)"])
    assert r.stdout == "42\n"
    assert r.ok


def test_exec_stdin_env_and_cwd(box: Sandbox) -> None:
    r = box.exec("cat; echo $GREETING; pwd", stdin="in\n", env={"GREETING": "hi"}, cwd="/tmp")
    assert r.stdout == "in\nhi\n/tmp\n"


def test_exec_files_in_and_out(box: Sandbox) -> None:
    r = box.exec(
        "python3 /tmp/job/main.py < /tmp/job/data.txt > /tmp/job/out.txt",
        files={
            "/tmp/job/main.py": "import sys; print(sys.stdin.read().upper())",
            "/tmp/job/data.txt": "abc",
        },
        outputs=["/tmp/job/out.txt", "/tmp/job/none"],
    )
    assert r.ok, r.stderr
    assert r.files == {"/tmp/job/out.txt": b"ABC\n"}


def test_exec_timeout_kills_the_command(box: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        box.exec("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 15
    assert info.value.result.timed_out
    assert info.value.result.exit_code == 137


def test_missing_program_answers_like_a_shell(box: Sandbox) -> None:
    r = box.exec(["no-such-program-here"])
    assert r.exit_code == 127


# ---- what only some backends do ------------------------------------------------------------


def test_filesystem_persists_between_calls(backend: dict[str, Any], box: Sandbox) -> None:
    need(backend, "persistent_filesystem")
    box.exec("echo kept > /tmp/state")
    assert box.exec("cat /tmp/state").stdout == "kept\n"
    assert box.files.read_text("/tmp/state") == "kept\n"


def test_background_processes_and_shells(backend: dict[str, Any], box: Sandbox) -> None:
    need(backend, "persistent_processes")
    p = box.processes.start("sleep 30", tag="bg")
    assert any(x.pid == p.pid and x.running for x in box.processes.list())
    sh = box.shell("work")
    sh.run("cd /tmp && export X=1")
    assert sh.run("echo $X $PWD").stdout == "1 /tmp\n"


def test_pause_and_resume(backend: dict[str, Any], box: Sandbox) -> None:
    need(backend, "pause")
    assert box.pause().state == "paused"
    assert box.resume().state == "running"
    assert box.exec("echo back").stdout == "back\n"


def test_pty(backend: dict[str, Any], box: Sandbox) -> None:
    need(backend, "pty")
    pty = box.pty.create(cols=77, rows=11)
    pty.send("stty size; echo pty-$((6*7)); exit\n")
    out = b"".join(pty)
    assert b"11 77" in out
    assert b"pty-42" in out


# ---- a stateless backend says so, clearly -----------------------------------------------


def test_stateless_backend_refuses_stateful_calls(backend: dict[str, Any], box: Sandbox) -> None:
    if backend["capabilities"].get("persistent_processes"):
        pytest.skip(f"backend {backend['name']} has persistent processes")
    with pytest.raises(errors.BackendUnavailable, match="use backend="):
        box.processes.start("sleep 30")
    with pytest.raises(errors.BackendUnavailable, match="use backend="):
        box.shell("s").run("true")
    if not backend["capabilities"].get("pause"):
        with pytest.raises(errors.BackendUnavailable, match="pause"):
            box.pause()


def test_stateless_backend_forgets_between_calls(backend: dict[str, Any], box: Sandbox) -> None:
    if backend["capabilities"].get("persistent_filesystem"):
        pytest.skip(f"backend {backend['name']} keeps its filesystem between calls")
    box.exec("echo gone > /tmp/state; sleep 100 &")
    r = box.exec("cat /tmp/state; pgrep -c sleep")
    assert r.stdout == "0\n"
    assert r.exit_code != 0


def test_stateless_backend_limits_memory_per_call(backend: dict[str, Any], box: Sandbox) -> None:
    if backend["capabilities"].get("persistent_processes"):
        pytest.skip(f"backend {backend['name']}: per-call memory limits are a function feature")
    r = box.exec(["python3", "-c", "x = bytearray(300 * 2**20)"], memory_mb=64)
    assert r.oom_killed
    assert r.exit_code == 137


# ---- the switch from the CLI ---------------------------------------------------------------


def test_cli_backends_and_create_switch(
    platform: RunningPlatform, backend: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    table = _cli(platform, "backends")
    assert backend["name"] in table
    if backend["name"] in SHARED:  # its one sandbox came from `dsec sandbox create --backend`
        sid = request.getfixturevalue("shared_box").id
    else:
        sid = _cli(platform, "sandbox", "create", "--backend", backend["name"], "--memory", "128")
        sid = sid.strip()
    try:
        out = _cli(platform, "sandbox", "exec", sid, "--", "echo", "via-cli")
        assert "via-cli" in out
        with Client(api_url=platform.api_url, api_key=platform.admin_key) as api:
            spec = api.get_sandbox(sid).spec
        assert spec is not None
        assert spec.backend == backend["name"]
    finally:
        if backend["name"] not in SHARED:
            _cli(platform, "sandbox", "kill", sid)
