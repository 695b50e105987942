"""The SDK's sans-I/O core: request building, answer parsing, error mapping, stream frames."""

from __future__ import annotations

import base64
import json

import pytest

from dsec.agent.protocol import CHUNK
from dsec.core import errors
from dsec.sdk import runtime_calls as rc
from dsec.sdk import streams, wire
from dsec.sdk.errors import CommandTimeout
from dsec.sdk.models import ExecEvent, SandboxInfo, to_jsonable

SID = "sbx-e0a1-abcdefghijklmnopqrst"


def _body(req: wire.Request) -> dict[str, object]:
    assert req.body is not None
    obj = json.loads(req.body)
    assert isinstance(obj, dict)
    return obj


def test_create_sends_only_given_fields() -> None:
    call = wire.create_sandbox(
        backend="container", image="base", cpu=0.5, memory_mb=256, pids=None,
        timeout_s=60, env={"A": "1"}, metadata=None,
    )  # fmt: skip
    req = call.request
    assert (req.method, req.path) == ("POST", "/v1/sandboxes")
    assert _body(req) == {"backend": "container", "image": "base", "cpu": 0.5,
                          "memory_mb": 256, "timeout_s": 60, "env": {"A": "1"}}  # fmt: skip
    assert ("Content-Type", "application/json") in req.headers
    assert req.timeout == wire.CREATE_TIMEOUT_S


def test_list_and_lifecycle_paths() -> None:
    assert wire.list_sandboxes().request.params == ()
    assert wire.list_sandboxes(all=True).request.params == (("all", "1"),)
    assert wire.kill_sandbox(SID).request.method == "DELETE"
    req = wire.set_timeout(SID, 120).request
    assert (req.path, _body(req)) == (f"/v1/sandboxes/{SID}/timeout", {"timeout_s": 120})
    with pytest.raises(errors.InvalidArgument):
        wire.set_timeout(SID, 0)
    with pytest.raises(errors.InvalidArgument):
        wire.get_sandbox("../keys")


def test_sandbox_info_parses_epoch_and_iso_times_and_tolerates_new_fields() -> None:
    info = SandboxInfo.from_wire({
        "id": SID, "state": "running", "created_at": 1, "started_at": 0.0,
        "expires_at": "2030-01-01T00:00:00Z",
        "error": {"code": "sandbox_failed", "message": "boom"}, "brand_new": 1,
        "spec": {"backend": "vm", "image": "base", "cpu": 2, "memory_mb": 1024,
                 "timeout_s": 10, "pids": None},
    })  # fmt: skip
    assert info.created_at is not None
    assert info.created_at.year == 1970
    assert info.started_at is None  # 0 is an unset field
    assert info.expires_at is not None
    assert info.expires_at.year == 2030
    assert info.error == "sandbox_failed: boom"
    assert info.spec is not None
    assert info.spec.cpu == 2.0
    assert info.spec.pids is None
    assert to_jsonable(info)["expires_at"] == "2030-01-01T00:00:00+00:00"
    assert info.moved_to is None  # "" or absent: not moved
    moved = SandboxInfo.from_wire({"id": SID, "state": "stopped", "moved_to": "sbx-ffff-x"})
    assert moved.moved_to == "sbx-ffff-x"
    with pytest.raises(errors.Internal, match="state"):
        SandboxInfo.from_wire({"id": SID})


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (404, {"error": {"code": "sandbox_not_found", "message": "gone"}}, errors.SandboxNotFound),
        (429, {"error": {"code": "quota_exceeded", "message": "full"}}, errors.QuotaExceeded),
        (500, {"error": {"code": "made_up", "message": "x"}}, errors.Internal),
        (401, None, errors.Unauthenticated),
        (502, None, errors.Unavailable),
        (418, None, errors.ClientError),
        (500, None, errors.Internal),
    ],
)
def test_errors_map_to_the_core_tree(status: int, body: object, cls: type) -> None:
    content = json.dumps(body).encode() if body is not None else b"<html>teapot</html>"
    with pytest.raises(cls) as info:
        wire.finish(wire.whoami(), status, content)
    assert type(info.value) is cls
    if body is None:
        assert f"HTTP {status}" in str(info.value)


def test_success_with_bad_json_is_internal() -> None:
    with pytest.raises(errors.Internal, match="invalid JSON"):
        wire.finish(wire.whoami(), 200, b"not json")


def test_connection_error_names_the_url() -> None:
    exc = wire.connection_error("http://127.0.0.1:1", ConnectionRefusedError("refused"))
    assert isinstance(exc, errors.Unavailable)
    assert "http://127.0.0.1:1" in str(exc)


def test_exec_request_and_stdin_encodings() -> None:
    call = rc.exec_command(SID, ["ls", "-l"], env={"X": "1"}, cwd="/tmp", timeout=5)
    req = call.request
    assert req.path == f"/v1/sandboxes/{SID}/exec"
    assert _body(req) == {"cmd": ["ls", "-l"], "env": {"X": "1"}, "cwd": "/tmp", "timeout": 5}
    assert req.timeout == 5 + wire.EXEC_MARGIN_S
    assert _body(rc.exec_command(SID, "cat", stdin=b"hi").request)["stdin"] == "hi"
    call = rc.exec_command(SID, "cat", stdin=b"\xff\x00")
    binary = _body(call.request)
    assert binary["encoding"] == "base64"
    # ... and then the answer's output is base64 too
    answer = {"stdout": base64.b64encode(b"out").decode(), "stderr": "", "exit_code": 0}
    assert wire.finish(call, 200, json.dumps(answer).encode()).stdout == "out"
    assert base64.b64decode(str(binary["stdin"])) == b"\xff\x00"
    assert rc.exec_command(SID, "sleep 1", timeout=None).request.timeout is None
    bad: str | list[str]
    for bad in ("", "  ", []):
        with pytest.raises(errors.InvalidArgument):
            rc.exec_command(SID, bad)
    with pytest.raises(errors.InvalidArgument):
        rc.exec_command(SID, "ls", timeout=-1)


def test_exec_timeout_becomes_command_timeout_with_partial_result() -> None:
    call = rc.exec_command(SID, "sleep 9", timeout=1)
    partial = {"stdout": "partial", "stderr": "", "exit_code": None, "signal": 9}
    body = {"error": {"code": "deadline_exceeded", "message": "1 s"}, "result": partial}
    with pytest.raises(CommandTimeout) as info:
        wire.finish(call, 504, json.dumps(body).encode())
    assert isinstance(info.value, errors.DeadlineExceeded)
    assert info.value.result.stdout == "partial"
    assert info.value.result.timed_out
    assert not info.value.result.ok
    # a 200 answer that says timed_out (as shell.run answers) raises the same way
    with pytest.raises(CommandTimeout):
        wire.finish(call, 200, json.dumps({"timed_out": True, "exit_code": None}).encode())
    # a 504 without a result stays a plain DeadlineExceeded
    plain = {"error": {"code": "deadline_exceeded", "message": "edge slow"}}
    with pytest.raises(errors.DeadlineExceeded) as info2:
        wire.finish(call, 504, json.dumps(plain).encode())
    assert not isinstance(info2.value, CommandTimeout)


def test_exec_result_decodes_base64_output() -> None:
    ok = {"stdout": base64.b64encode(b"hi").decode(), "stderr": "", "exit_code": 0,
          "encoding": "base64"}  # fmt: skip
    result = wire.finish(rc.exec_command(SID, "x"), 200, json.dumps(ok).encode())
    assert result.stdout == "hi"
    assert result.ok


def test_file_requests() -> None:
    req = rc.write_file(SID, "/a b", mode=0o755).request
    assert (req.method, req.params) == (
        "PUT",
        (("path", "/a b"), ("mode", "755"), ("parents", "1")),
    )
    assert req.timeout is None  # uploads may take as long as they take
    assert rc.read_file(SID, "x").params == (("path", "x"),)
    assert rc.list_files(SID, "/", 3).request.params == (("path", "/"), ("depth", "3"))
    assert _body(rc.rename_file(SID, "a", "b").request) == {"src": "a", "dst": "b"}
    assert _body(rc.remove_file(SID, "a", True).request) == {"path": "a", "recursive": True}
    with pytest.raises(errors.InvalidArgument):
        rc.read_file(SID, "a\0b")
    with pytest.raises(errors.InvalidArgument):
        rc.write_file(SID, "a", mode=0o17777)


def test_process_and_shell_requests() -> None:
    call = rc.start_process(SID, "top", tag="t", pty=(100, 30))
    assert _body(call.request) == {"cmd": "top", "tag": "t", "pty": {"cols": 100, "rows": 30}}
    info = call.parse({"pid": 42})
    assert (info.pid, info.pty, info.tag) == (42, True, "t")
    assert _body(rc.signal_process(SID, 42, 15).request) == {"signal": 15}
    assert rc.send_input(SID, 42, "ls\n").request.body == b"ls\n"
    with pytest.raises(errors.InvalidArgument):
        rc.signal_process(SID, 0, 9)
    with pytest.raises(errors.InvalidArgument):
        rc.resize_pty(SID, 1, 0, 24)
    req = rc.run_in_shell(SID, "my shell/1", "cd /tmp", timeout=3).request
    assert req.path == f"/v1/sandboxes/{SID}/shells/my%20shell%2F1/run"
    assert _body(req) == {"cmd": "cd /tmp", "timeout": 3}
    assert rc.pty_env({"TERM": "dumb"}) == {"TERM": "dumb"}
    assert rc.pty_env(None)["TERM"] == rc.DEFAULT_TERM


def test_port_requests_and_platform_errors() -> None:
    req = rc.port_request(SID, 8080, "post", "/api/x?q=1", {"X-A": "b"}, "body")
    assert (req.method, req.path) == ("POST", f"/v1/sandboxes/{SID}/ports/8080/api/x?q=1")
    assert (req.body, req.headers) == (b"body", (("X-A", "b"),))
    resp = rc.port_response(404, [("Set-Cookie", "a"), ("set-cookie", "b")], b"app 404")
    assert resp == (404, {"set-cookie": "a, b"}, b"app 404")
    status, _, body = rc.port_response(200, [], b'{"error": {"code": "x"}}')
    assert (status, body) == (200, b'{"error": {"code": "x"}}')  # the app's own JSON
    dsec_err = json.dumps({"error": {"code": "sandbox_not_found", "message": "no"}}).encode()
    with pytest.raises(errors.SandboxNotFound):
        rc.port_response(404, [], dsec_err)
    with pytest.raises(errors.Unavailable):
        rc.port_response(
            500, [("X-Dsec-Error", "1")], b'{"error":{"code":"unavailable","message":"m"}}'
        )
    with pytest.raises(errors.InvalidArgument):
        rc.port_request(SID, 70000)


def test_stream_messages() -> None:
    assert (
        streams.runtime_url("https://h:1/base/", SID)
        == f"wss://h:1/base/v1/sandboxes/{SID}/runtime"
    )
    assert streams.runtime_url("http://h", SID).startswith("ws://h/")
    first = streams.exec_request("ls", cwd="/", timeout=None, stdin=True)
    assert first[:1] == b"J"
    assert json.loads(first[1:]) == {"op": "exec", "cmd": "ls", "cwd": "/", "stdin": True}
    big = bytes(CHUNK + 10)
    msgs = list(streams.input_messages(big))
    assert [len(m) for m in msgs] == [CHUNK + 1, 11]
    assert all(m[:1] == b"I" for m in msgs)
    assert list(streams.input_messages(b"")) == []
    assert json.loads(streams.resize_message(120, 40)[1:]) == {"resize": [120, 40]}
    assert json.loads(streams.connect_request(7)[1:]) == {"op": "process.connect", "pid": 7}
    assert streams.CLOSE_MESSAGE == b"C"


def test_runtime_stream_decoding() -> None:
    s = streams.RuntimeStream()
    assert s.feed(b'J{"event":"started","pid":12}') is None
    assert s.pid == 12
    assert s.feed(b"Oout") == ExecEvent("stdout", b"out")
    assert s.feed(b"Eerr") == ExecEvent("stderr", b"err")
    final = s.feed(b'J{"result":{"exit_code":null,"signal":9,"timed_out":true}}')
    assert final is not None
    assert final.kind == "exit"
    assert final.timed_out
    assert final.returncode == -9
    assert s.done
    with pytest.raises(errors.Internal):
        s.feed(b"Omore")


def test_runtime_stream_errors() -> None:
    with pytest.raises(errors.ProcessNotFound, match="gone"):
        streams.RuntimeStream().feed(b'J{"error":{"code":"process_not_found","message":"gone"}}')
    for bad in (b"Zx", "text", b"J[1]", b"Jnope", b'J{"what":1}'):
        with pytest.raises(errors.Internal):
            streams.RuntimeStream().feed(bad)
    assert isinstance(streams.RuntimeStream().closed_early("eof"), errors.Unavailable)
