"""The platform end to end through the SDK, the HTTP API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsec.core import errors
from dsec.sdk import Client, CommandTimeout, Sandbox
from dsec.testing.platform import RunningPlatform
from tests.e2e.leakcheck import leaks
from tests.waits import until


def _cli(
    platform: RunningPlatform, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", *args],
        env=platform.env(),
        text=True,
        capture_output=True,
        timeout=120,
        check=check,
        stdin=subprocess.DEVNULL,
    )


def test_status_json_lists_every_component_healthy(platform: RunningPlatform) -> None:
    out = _cli(platform, "status", "--json")
    st = json.loads(out.stdout)
    assert st["healthy"] is True
    assert set(st["components"]) == {"iam", "watcher", "edge", "apiserver", "gateway"}
    for comp in st["components"].values():
        assert comp["healthy"]
        assert comp["address"].startswith("127.0.0.1:")


def test_status_exits_nonzero_when_platform_is_down(tmp_path) -> None:
    env = {"DSEC_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "-m", "dsec.cli.main", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1
    assert json.loads(res.stdout)["running"] is False


def test_requests_without_a_valid_key_get_401(platform: RunningPlatform) -> None:
    with httpx.Client(base_url=platform.api_url) as h:
        assert h.get("/healthz").status_code == 200
        r = h.get("/v1/sandboxes")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthenticated"
        bad = "dsk_aaaaaaaaaaaa_" + "b" * 43
        assert h.get("/v1/sandboxes", headers={"Authorization": f"Bearer {bad}"}).status_code == 401
        assert (
            h.get("/v1/sandboxes", headers={"Authorization": "Bearer nonsense"}).status_code == 401
        )
        doc = h.get("/openapi.json").json()
        assert "/v1/sandboxes/{sandbox_id}/exec" in doc["paths"]


def test_create_exec_python_and_kill(api: Client) -> None:
    with Sandbox.create(memory_mb=256, timeout=120) as sbx:
        info = sbx.info()
        assert info.state == "running"
        r = sbx.exec(["python3", "-c", "import socket; print(socket.gethostname()); print(6*7)"])
        assert r.exit_code == 0
        assert r.stdout.split() == [sbx.id, "42"]
        r = sbx.exec("echo out; echo err >&2; exit 3")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
        r = sbx.exec("cat; echo $FOO; pwd", stdin="in\n", env={"FOO": "bar"}, cwd="/tmp")
        assert r.stdout == "in\nbar\n/tmp\n"
        r = sbx.exec(["printf", "\\xff\\xfe"])
        assert r.stdout == "\ufffd\ufffd"  # invalid UTF-8 is replaced, not an error
        sid = sbx.id
    # The context manager killed it.
    assert api.get_sandbox(sid).state == "stopped"
    with pytest.raises(errors.InvalidState):
        Sandbox.connect(sid).exec("true")


def test_commands_that_never_end_time_out_with_partial_output(sbx: Sandbox) -> None:
    start = time.monotonic()
    with pytest.raises(CommandTimeout) as exc:
        sbx.exec("echo started; sleep 600", timeout=1)
    assert time.monotonic() - start < 15
    assert exc.value.result is not None
    assert exc.value.result.stdout == "started\n"
    assert sbx.exec("echo still-alive").stdout == "still-alive\n"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"image": "no-such-image"}, "image_not_found"),
        ({"memory_mb": 10**8}, "invalid_argument"),
        ({"cpu": -1}, "invalid_argument"),
        ({"backend": "teleport"}, "invalid_argument"),
        ({"memory_mb": "lots"}, "invalid_argument"),
        ({"bogus": 1}, "invalid_argument"),
    ],
)
def test_bad_create_requests_fail_cleanly(
    platform: RunningPlatform, api: Client, body: dict[str, object], code: str
) -> None:
    before = {s.id for s in api.list_sandboxes(all=True)}
    with httpx.Client(
        base_url=platform.api_url, headers={"Authorization": f"Bearer {platform.admin_key}"}
    ) as h:
        r = h.post("/v1/sandboxes", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["code"] == code
    new = [s for s in api.list_sandboxes(all=True) if s.id not in before]
    assert all(s.state == "failed" for s in new)
    for s in new:
        assert leaks(platform, s.id) == []


def test_unknown_sandbox_and_malformed_ids(api: Client, platform: RunningPlatform) -> None:
    with pytest.raises(errors.SandboxNotFound):
        api.get_sandbox("sbx-zzzz-aaaaaaaaaaaaaaaaaaaa")
    with pytest.raises(errors.SandboxNotFound):
        api.get_sandbox("sbx-not-an-id")
    with pytest.raises(errors.InvalidArgument):
        api.get_sandbox("../../etc")  # refused by the SDK before any request
    edge = platform.layout.edge_id
    with pytest.raises(errors.SandboxNotFound):
        Sandbox.connect(f"sbx-{edge}-aaaaaaaaaaaaaaaaaaaa").exec("true")


def test_bad_runtime_input(sbx: Sandbox, platform: RunningPlatform) -> None:
    with pytest.raises(errors.NotFound):
        sbx.files.read("/no/such/file")
    with pytest.raises(errors.InvalidArgument):
        sbx.files.read("/etc/\x00passwd")
    with pytest.raises(errors.InvalidArgument):
        sbx.exec("")
    with httpx.Client(
        base_url=platform.api_url, headers={"Authorization": f"Bearer {platform.admin_key}"}
    ) as h:
        r = h.post(f"/v1/sandboxes/{sbx.id}/exec", content=b"{not json")
        assert r.status_code == 400
        r = h.post(f"/v1/sandboxes/{sbx.id}/exec", content=b"x" * (65 * 1024 * 1024))
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
    assert sbx.exec("true").exit_code == 0


def test_paths_cannot_escape_the_sandbox(sbx: Sandbox) -> None:
    assert sbx.files.read_text("../../../../../etc/hostname").strip() == sbx.id
    sbx.exec("ln -s / /tmp/hostroot && ln -s /etc/hostname /tmp/hn")
    assert sbx.files.read_text("/tmp/hostroot/etc/hostname").strip() == sbx.id
    assert sbx.files.read_text("/tmp/hn").strip() == sbx.id
    assert sbx.exec("getent hosts $(hostname)").stdout.split()[-1] == sbx.id
    sbx.files.write("/tmp/hostroot/tmp/written-through-link", b"x")
    assert sbx.exec("cat /tmp/written-through-link").stdout == "x"


def test_files_round_trip_large_and_binary(sbx: Sandbox, tmp_path) -> None:
    blob = bytes(range(256)) * (20 * 4096)  # 20 MiB
    sbx.files.write("/root/blob.bin", blob)
    assert (
        sbx.exec("sha256sum /root/blob.bin").stdout.split()[0]
        == __import__("hashlib").sha256(blob).hexdigest()
    )
    assert sbx.files.read("/root/blob.bin") == blob
    local = tmp_path / "down.bin"
    assert sbx.files.download("/root/blob.bin", local) == len(blob)
    assert local.read_bytes() == blob
    sbx.files.mkdir("/root/d/e")
    sbx.files.rename("/root/blob.bin", "/root/d/e/b.bin")
    names = {e.name for e in sbx.files.list("/root/d", depth=2)}
    assert {"e", "b.bin"} <= names
    sbx.files.remove("/root/d", recursive=True)
    assert not sbx.files.exists("/root/d")


def test_shell_sessions_processes_and_pty(sbx: Sandbox) -> None:
    sh = sbx.shell("work")
    sh.run("cd /tmp; export GREETING=hello; sleep 300 &")
    r = sh.run("echo $GREETING; pwd; jobs | wc -l")
    assert r.stdout.split() == ["hello", "/tmp", "1"]
    p = sbx.processes.start(["sh", "-c", "echo from-bg; sleep 300"], tag="bg")
    assert any(x.pid == p.pid and x.running for x in sbx.processes.list())
    events = sbx.processes.connect(p.pid)
    first = next(events)
    assert b"from-bg" in (first.data or b"")
    sbx.processes.kill(p.pid)
    pty = sbx.pty.create(cols=77, rows=11)
    pty.send("stty size; exit\n")
    out = b"".join(pty)
    assert b"11 77" in out


def test_sandbox_lifetime_expires(api: Client, platform: RunningPlatform) -> None:
    s = Sandbox.create(memory_mb=64, timeout=2)
    deadline = time.monotonic() + 20
    while api.get_sandbox(s.id).state != "stopped" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert api.get_sandbox(s.id).state == "stopped"
    assert leaks(platform, s.id) == []


def test_killing_a_sandbox_mid_stream_ends_the_stream_with_an_error(api: Client) -> None:
    s = Sandbox.create(memory_mb=64, timeout=60)
    got: list[object] = []

    def consume() -> None:
        try:
            for ev in s.exec_stream("echo go; sleep 60"):
                got.append(ev)  # noqa: PERF402 - the test watches it fill up
        except errors.DsecError as exc:
            got.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    s.kill()
    t.join(timeout=30)
    assert not t.is_alive()
    assert isinstance(got[-1], errors.DsecError), got


def test_input_racing_the_end_of_a_call_keeps_its_result(sbx: Sandbox) -> None:
    # The command exits without reading its stdin, so the input races the call's end on
    # every hop: the SDK's WebSocket (the server may have closed it) and the apiserver's
    # gRPC stream to the edge (a write racing the server's status turned the whole call
    # into INTERNAL). Each call must still report its own exit, never a transport error.
    codes = [
        [ev.exit_code for ev in sbx.exec_stream(["false"], stdin=b"x" * 100)] for _ in range(400)
    ]
    assert codes == [[1]] * 400


def test_huge_and_aborted_uploads_leave_nothing(sbx: Sandbox, platform: RunningPlatform) -> None:
    import socket as socketlib
    from urllib.parse import urlsplit

    url = urlsplit(platform.api_url)
    head = (
        f"PUT /v1/sandboxes/{sbx.id}/files?path=/root/huge HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\nAuthorization: Bearer {platform.admin_key}\r\n"
        f"Content-Length: {10**13}\r\n\r\n"
    )
    with socketlib.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(head.encode())
        reply = s.recv(4096).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]

    def body() -> Iterator[bytes]:
        yield b"x" * (1 << 20)
        raise RuntimeError("client gave up")

    with (
        httpx.Client(
            base_url=platform.api_url, headers={"Authorization": f"Bearer {platform.admin_key}"}
        ) as h,
        pytest.raises(RuntimeError),
    ):
        h.put(f"/v1/sandboxes/{sbx.id}/files", params={"path": "/root/partial"}, content=body())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = sbx.exec("ls -A /root").stdout.split()
        if not [n for n in left if "partial" in n or n.startswith(".dsec")]:
            break
        time.sleep(0.2)
    assert [n for n in left if "partial" in n] == []
    assert not sbx.files.exists("/root/huge")


def test_pause_freezes_and_resume_thaws(sbx: Sandbox, platform: RunningPlatform) -> None:
    sbx.processes.start(
        # a rename, so a read never sees the file between its truncation and the write
        ["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/m; mv /tmp/m /tmp/n; "
         "sleep 0.05; done"]
    )  # fmt: skip
    _until_counted(sbx, 0)
    assert sbx.pause().state == "paused"
    with pytest.raises(errors.InvalidState, match="paused"):
        sbx.exec("true")
    frozen = sbx.client.get_sandbox(sbx.id)
    assert frozen.state == "paused"
    time.sleep(0.5)
    assert sbx.resume().state == "running"
    _until_counted(sbx, int(sbx.files.read_text("/tmp/n")))  # it counts again
    res = _cli(platform, "sandbox", "pause", sbx.id, "--json")
    assert json.loads(res.stdout)["state"] == "paused"
    _cli(platform, "sandbox", "resume", sbx.id)
    assert sbx.exec("echo back").stdout == "back\n"


def _until_counted(sbx: Sandbox, beyond: int) -> None:
    def past() -> bool:
        return sbx.files.exists("/tmp/n") and int(sbx.files.read_text("/tmp/n")) > beyond

    until(past, f"the counter in /tmp/n past {beyond}")


def test_sandboxes_get_a_generous_open_files_limit(sbx: Sandbox) -> None:
    import resource

    # 65536, unless the host does not let even root (the edge) go that high.
    ceiling = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    can_raise = True
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, ceiling + 1))
    except (ValueError, OSError):
        can_raise = False
    expected = 65536 if can_raise else min(65536, ceiling)
    assert int(sbx.exec("ulimit -n").stdout) == expected


def test_audit_log_records_and_detects_tampering(platform: RunningPlatform, api: Client) -> None:
    import sqlite3

    key = api.create_key("auditor", "default", "viewer", "audit test")
    s = Sandbox.create(memory_mb=64, timeout=60)
    s.pause()
    s.resume()
    s.kill()
    api.revoke_key(key.key_id)
    with pytest.raises(errors.ImageNotFound):
        Sandbox.create(image="no-such-image")
    entries = api.audit(since="10m")
    mine = [(e.action, e.result) for e in entries if e.target in (s.id, key.key_id)]
    assert mine == [
        ("key.create", "ok"),
        ("sandbox.create", "ok"),
        ("sandbox.pause", "ok"),
        ("sandbox.resume", "ok"),
        ("sandbox.kill", "ok"),
        ("key.revoke", "ok"),
    ]
    assert any(e.action == "sandbox.create" and e.result == "image_not_found" for e in entries)
    assert all(e.actor.startswith("admin") for e in entries if e.target == s.id)
    only_kills = api.audit(action="sandbox.kill", since="10m")
    assert only_kills
    assert {e.action for e in only_kills} == {"sandbox.kill"}
    out = _cli(platform, "audit", "--action", "sandbox.", "--since", "10m", "--json")
    assert {e["action"] for e in json.loads(out.stdout)} <= {
        "sandbox.create",
        "sandbox.pause",
        "sandbox.resume",
        "sandbox.kill",
        "sandbox.set_timeout",
        "sandbox.fork",
    }
    assert api.verify_audit()["intact"] is True
    assert _cli(platform, "audit", "verify").returncode == 0

    # The table refuses edits; someone who drops the guard and edits a row is caught.
    db = sqlite3.connect(platform.paths.home / "iam.db")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("UPDATE audit SET actor = 'mallory' WHERE seq = 2")
    db.execute("DROP TRIGGER audit_no_update")
    db.execute("UPDATE audit SET actor = 'mallory' WHERE seq = 2")
    db.commit()
    db.close()
    verdict = api.verify_audit()
    assert verdict["intact"] is False
    assert verdict["broken_at"] == 2
    assert _cli(platform, "audit", "verify", check=False).returncode == 1


def test_raw_tcp_to_a_sandbox_port_over_the_runtime_websocket(
    sbx: Sandbox, platform: RunningPlatform
) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', 7007)); s.listen()\n"
        "c, _ = s.accept()\n"
        "data = b''\n"
        "while chunk := c.recv(65536):\n"
        "    data += chunk\n"
        "c.sendall(data.upper()); c.close()\n"
    )
    sbx.files.write("/root/echo.py", server)
    sbx.processes.start(["python3", "/root/echo.py"])
    ws_url = platform.api_url.replace("http://", "ws://") + f"/v1/sandboxes/{sbx.id}/runtime"
    headers = {"Authorization": f"Bearer {platform.admin_key}"}
    payload = b"hello over tcp \x00\xff" * 1000

    def stream(port: int, data: bytes) -> tuple[bytes, dict[str, Any]]:
        with connect(ws_url, additional_headers=headers) as ws:
            ws.send(b"J" + json.dumps({"op": "tcp", "port": port}).encode())

            def send_input() -> None:
                try:
                    for i in range(0, len(data), 4096):
                        ws.send(b"I" + data[i : i + 4096])
                    ws.send(b"C")
                except ConnectionClosed:
                    pass  # answered (and closed) before taking all input

            sender = threading.Thread(target=send_input)
            sender.start()
            got, final = b"", {}
            for msg in ws:
                assert isinstance(msg, bytes)
                if msg[:1] == b"O":
                    got += msg[1:]
                elif msg[:1] == b"J":
                    final = json.loads(msg[1:])
                    if "result" in final or "error" in final:
                        break
        sender.join()
        return got, final

    # input streamed to a port nobody listens on is answered "unavailable", however the
    # input and the answer cross (not as a lost connection to the agent)
    got, final = stream(7008, b"x" * (4 << 20))
    assert (got, final.get("error", {}).get("code")) == (b"", "unavailable"), final
    deadline = time.monotonic() + 10
    while True:
        got, final = stream(7007, payload)
        if "error" in final and final["error"]["code"] == "unavailable":
            assert time.monotonic() < deadline, final  # the server is not listening yet
            time.sleep(0.2)
            continue
        break
    assert "result" in final, final
    assert final["result"] == {"sent": len(payload), "received": len(payload)}
    assert got == payload.upper()
