"""The ``dsec`` CLI through click's CliRunner, with the SDK talking to the in-memory fake API
(httpx.MockTransport) and the loopback fake runtime WebSocket."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result

from dsec.cli.main import cli
from dsec.cli.output import CliState
from dsec.testing.fake_api import FAKE_KEY, FakeApi
from dsec.testing.fake_runtime import FakeRuntimeServer

MISSING = "sbx-e0a1-zzzzzzzzzzzzzzzzzzzz"


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


@pytest.fixture
def runtime(api: FakeApi) -> Iterator[FakeRuntimeServer]:
    with FakeRuntimeServer(api) as server:
        yield server


class Dsec:
    """Runs ``dsec`` with the SDK wired to the fakes."""

    def __init__(self, api: FakeApi, runtime: FakeRuntimeServer, home: Path) -> None:
        self.api, self.runtime, self.home = api, runtime, home

    def __call__(self, *args: str, input: str | bytes | None = None) -> Result:
        state = CliState(
            api_url=self.runtime.api_url,
            api_key=FAKE_KEY,
            environ={"DSEC_HOME": str(self.home)},
            http_transport=httpx.MockTransport(self.api.handler),
        )
        return CliRunner().invoke(cli, list(args), obj=state, input=input)


@pytest.fixture
def dsec(api: FakeApi, runtime: FakeRuntimeServer, tmp_path: Path) -> Dsec:
    return Dsec(api, runtime, tmp_path)


def test_no_subcommand_prints_help(dsec: Dsec) -> None:
    res = dsec()
    assert res.exit_code == 0
    assert "sandbox" in res.stdout
    assert "Usage:" in res.stdout


def test_create_prints_the_id_and_passes_options(api: FakeApi, dsec: Dsec) -> None:
    res = dsec("sandbox", "create", "--cpu", "0.5", "--memory", "256", "--env", "A=1=2",
               "--meta", "team=rl", "--timeout", "60")  # fmt: skip
    assert res.exit_code == 0, res.output
    sid = res.stdout.strip()
    assert sid in api.sandboxes
    spec = api.sandboxes[sid].info["spec"]
    assert (spec["cpu"], spec["memory_mb"], spec["timeout_s"]) == (0.5, 256, 60)
    assert (spec["env"], spec["metadata"]) == ({"A": "1=2"}, {"team": "rl"})


def test_create_json_and_bad_pairs(dsec: Dsec) -> None:
    res = dsec("sandbox", "create", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["state"] == "running"
    bad = dsec("sandbox", "create", "--env", "novalue")
    assert bad.exit_code == 2
    assert "KEY=VALUE" in bad.stderr


def test_ls_info_and_json(api: FakeApi, dsec: Dsec) -> None:
    assert "no sandboxes" in dsec("sandbox", "ls").stderr
    sid = api.add_sandbox(image="python")
    table = dsec("sandbox", "ls").stdout
    assert sid in table
    assert "python" in table
    assert "running" in table
    rows = json.loads(dsec("sandbox", "ls", "--json").stdout)
    assert [r["id"] for r in rows] == [sid]
    assert rows[0]["created_at"].startswith("2023-11-14T22:13:20")
    assert "memory" in dsec("sandbox", "info", sid).stdout
    assert json.loads(dsec("sandbox", "info", sid, "--json").stdout)["spec"]["image"] == "python"


def test_kill_reports_each_failure_and_exits_2(api: FakeApi, dsec: Dsec) -> None:
    sid = api.add_sandbox()
    res = dsec("sandbox", "kill", sid, MISSING)
    assert res.exit_code == 2
    assert f"killed {sid}" in res.stdout
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1
    assert errors[0].startswith("dsec: error:")
    assert "[sandbox_not_found]" in errors[0]
    assert api.sandboxes[sid].info["state"] == "stopped"
    assert "stopped" in dsec("sandbox", "ls", "--all").stdout


def test_timeout_command(api: FakeApi, dsec: Dsec) -> None:
    sid = api.add_sandbox()
    res = dsec("sandbox", "timeout", sid, "100", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["expires_at"].startswith("2023-11-14T22:15:00")
    assert dsec("sandbox", "timeout", sid, "0").exit_code == 2


def test_exec_streams_and_exits_with_the_command_status(api: FakeApi, dsec: Dsec) -> None:
    sid = api.add_sandbox()
    res = dsec("sandbox", "exec", sid, "--", "echo out; err bad; exit 3")
    assert res.exit_code == 3
    assert (res.stdout, res.stderr) == ("out\n", "bad\n")
    piped = dsec("sandbox", "exec", sid, "--", "cat", input="from stdin")
    assert (piped.exit_code, piped.stdout) == (0, "from stdin")
    killed = dsec("sandbox", "exec", sid, "--", "kill 9")
    assert killed.exit_code == 128 + 9


def test_exec_argv_options_and_timeout(api: FakeApi, dsec: Dsec) -> None:
    sid = api.add_sandbox()
    res = dsec("sandbox", "exec", "--timeout", "1", sid, "--", "echo", "x;", "sleep", "5")
    assert res.exit_code == 124
    assert "timed out" in res.stderr
    as_json = dsec("sandbox", "exec", "--json", "--env", "A=1", sid, "--", "echo j; exit 4")
    assert as_json.exit_code == 4
    assert json.loads(as_json.stdout)["stdout"] == "j\n"
    late = dsec("sandbox", "exec", "--json", "--timeout", "1", sid, "--", "echo p; sleep 9")
    assert late.exit_code == 124
    assert json.loads(late.stdout)["timed_out"] is True
    assert dsec("sandbox", "exec", sid).exit_code == 2  # no command


def test_errors_are_one_line_with_client_and_server_exit_codes(dsec: Dsec) -> None:
    res = dsec("sandbox", "info", MISSING)
    assert res.exit_code == 2
    assert res.stderr.count("\n") == 1
    assert "[sandbox_not_found]" in res.stderr
    assert "Traceback" not in res.output
    port9 = dsec("sandbox", "exec", MISSING, "--", "true")  # unknown over the WebSocket
    assert port9.exit_code == 2


def test_server_errors_exit_1(tmp_path: Path) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"code": "node_full", "message": "full"}})

    state = CliState(
        api_url="http://127.0.0.1:9", api_key="k", http_transport=httpx.MockTransport(broken)
    )
    res = CliRunner().invoke(cli, ["sandbox", "create"], obj=state)
    assert res.exit_code == 1
    assert "dsec: error: full [node_full]" in res.stderr


def test_missing_configuration_says_what_to_set(tmp_path: Path) -> None:
    state = CliState(environ={"DSEC_HOME": str(tmp_path)})
    res = CliRunner().invoke(cli, ["sandbox", "ls"], obj=state)
    assert res.exit_code == 2
    assert "DSEC_API_KEY" in res.stderr
    assert "--api-key" in res.stderr


def test_global_flags_reach_the_resolver(tmp_path: Path) -> None:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host}:{request.url.port} {request.headers['authorization']}")
        return httpx.Response(200, json={"sandboxes": []})

    state = CliState(
        environ={"DSEC_HOME": str(tmp_path)}, http_transport=httpx.MockTransport(record)
    )
    args = ["--api-url", "http://10.1.2.3:99", "--api-key", "flagkey", "sandbox", "ls", "--json"]
    res = CliRunner().invoke(cli, args, obj=state)
    assert res.exit_code == 0
    assert seen == ["10.1.2.3:99 Bearer flagkey"]


def test_shell_with_piped_stdin(api: FakeApi, dsec: Dsec) -> None:
    sid = api.add_sandbox()
    res = dsec("sandbox", "shell", sid, input="ls\nexit\n")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("$ ls\nexit\n")
    (proc,) = api.sandboxes[sid].processes.values()
    assert proc["pty"]
    assert proc["cmd"].startswith("if command -v bash")


def test_ctrl_c_exits_130(tmp_path: Path) -> None:
    def interrupted(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt

    state = CliState(
        api_url="http://127.0.0.1:9", api_key="k", http_transport=httpx.MockTransport(interrupted)
    )
    res = CliRunner().invoke(cli, ["sandbox", "ls"], obj=state)
    assert res.exit_code == 130
    assert "interrupted" in res.stderr


def test_pause_resume_kill_many_in_one_call(api: FakeApi, dsec: Dsec) -> None:
    a, b = api.add_sandbox(), api.add_sandbox()
    res = dsec("sandbox", "pause", a, b)
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [f"paused {a}", f"paused {b}"]
    assert [api.sandboxes[s].info["state"] for s in (a, b)] == ["paused", "paused"]
    assert [r.url.path for r in api.requests] == ["/v1/sandboxes:batch"]
    assert json.loads(api.requests[0].content) == {"action": "pause", "ids": [a, b]}
    res = dsec("sandbox", "resume", a, MISSING, "--json")
    assert res.exit_code == 2
    assert [(r["id"], r["state"]) for r in json.loads(res.stdout)] == [(a, "running")]
    assert "[sandbox_not_found]" in res.stderr
    one = dsec("sandbox", "pause", b, "--json")  # one id: the object, as before batches
    assert json.loads(one.stdout)["state"] == "paused"


def test_kill_a_whole_project(api: FakeApi, dsec: Dsec) -> None:
    a, b = api.add_sandbox(), api.add_sandbox()
    res = dsec("sandbox", "kill", "--project", "p")
    assert res.exit_code == 0, res.output
    assert sorted(res.stdout.splitlines()) == sorted([f"killed {a}", f"killed {b}"])
    assert json.loads(api.requests[-1].content) == {"action": "kill", "project": "p"}
    assert "no live sandboxes" in dsec("sandbox", "kill", "--project", "p").stderr
    both = dsec("sandbox", "kill", a, "--project", "p")
    assert both.exit_code == 2
    assert "not both" in both.stderr
    assert dsec("sandbox", "pause").exit_code == 2


def test_resume_on_another_edge_prints_the_new_id(api: FakeApi, dsec: Dsec) -> None:
    a = api.add_sandbox(state="paused", backend="microvm")
    res = dsec("sandbox", "resume", a, "--edge", "f00d")
    assert res.exit_code == 0, res.output
    [new] = api.sandboxes
    assert res.stdout.strip() == f"resumed {a} on edge f00d as {new}"
    assert json.loads(api.requests[-1].content) == {"edge": "f00d"}
    assert dsec("sandbox", "resume", a, new, "--edge", "f00d").exit_code == 2  # one id only
