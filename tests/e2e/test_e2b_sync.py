"""The unmodified E2B SDK (sync client) against OpenDsec through the gateway.

Written as E2B user code: only the three E2B variables point it at the platform
(``E2B_API_URL`` and ``E2B_SANDBOX_URL`` = the gateway, ``E2B_API_KEY`` = an OpenDsec key).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from dsec.testing.platform import RunningPlatform
from tests.e2e.leakcheck import leaks

e2b = pytest.importorskip("e2b", reason="the e2b SDK is a dev dependency (pip install -e .[dev])")

from e2b import (  # noqa: E402
    AuthenticationException,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    TimeoutException,
)

pytestmark = pytest.mark.platform


@pytest.fixture(scope="module")
def e2b_env(platform: RunningPlatform) -> Iterator[str]:
    gateway = f"http://{platform.layout.gateway}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", gateway)
        mp.setenv("E2B_SANDBOX_URL", gateway)
        mp.setenv("E2B_API_KEY", platform.admin_key)
        yield gateway


@pytest.fixture(scope="module")
def sbx(e2b_env: str) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=300, envs={"FROM_CREATE": "c1"})
    yield s
    s.kill()


def test_lifecycle_create_info_timeout_list_connect_kill(
    e2b_env: str, platform: RunningPlatform
) -> None:
    tag = uuid.uuid4().hex[:8]
    s = Sandbox.create(timeout=60, metadata={"suite": tag})
    try:
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": tag}
        assert info.state.value == "running"
        before = info.end_at
        s.set_timeout(600)
        assert s.get_info().end_at > before
        assert s.is_running()

        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert [i.sandbox_id for i in found] == [s.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"suite": "other"})).next_items() == []

        again = Sandbox.connect(s.sandbox_id)
        assert again.commands.run("echo connected").stdout == "connected\n"
    finally:
        assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)
    assert not s.is_running()
    deadline = time.monotonic() + 10
    while (left := leaks(platform, s.sandbox_id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def test_list_pages_through_every_sandbox(e2b_env: str) -> None:
    tag = uuid.uuid4().hex[:8]
    made = [Sandbox.create(timeout=60, metadata={"page": tag}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2)
        first = pager.next_items()
        assert len(first) == 2
        assert pager.has_next
        rest = pager.next_items()
        assert len(rest) == 1
        assert not pager.has_next
        assert {i.sandbox_id for i in first + rest} == {m.sandbox_id for m in made}
    finally:
        for m in made:
            m.kill()


def test_unknown_sandbox_and_bad_key(e2b_env: str) -> None:
    with pytest.raises(NotFoundException):
        Sandbox.connect("sbx-none-aaaaaaaaaaaaaaaaaaaa")
    with pytest.raises(NotFoundException):
        Sandbox.get_info("sbx-none-aaaaaaaaaaaaaaaaaaaa")
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="not-a-key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-a-key").next_items()


def test_run_output_exit_code_env_cwd_user(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo partial; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "partial\n"
    assert sbx.commands.run("echo $FROM_CREATE $MINE", envs={"MINE": "m"}).stdout == "c1 m\n"
    assert sbx.commands.run("echo ${MINE:-unset}").stdout == "unset\n"  # per-call envs don't leak
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    seen: list[str] = []
    sbx.commands.run("echo a; echo b", on_stdout=seen.append)
    assert "".join(seen) == "a\nb\n"


def test_timeout_raises_and_kills_the_command(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo never", timeout=1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not any("sleep 30" in " ".join(p.args) for p in sbx.commands.list()):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the timed-out command is still running")


def test_background_list_kill_and_connect(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is False

    slow = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done", background=True)
    slow.disconnect()
    again = sbx.commands.connect(slow.pid)
    assert again.wait().stdout == "1\n2\n3\n"


def test_stdin_send_stream_and_close(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    sbx.commands.stream_input(h.pid, iter(["stream", "ed\n"]))
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello streamed\n"
    # without stdin=True the command reads end-of-file at once
    assert sbx.commands.run("cat; echo done", timeout=10).stdout == "done\n"


def test_files_read_write_list_info_dirs(sbx: Sandbox) -> None:
    base = f"/tmp/e2b-{uuid.uuid4().hex[:6]}"
    info = sbx.files.write(f"{base}/a.txt", "hello")
    assert info.path == f"{base}/a.txt"
    assert sbx.files.read(f"{base}/a.txt") == "hello"
    blob = bytes(range(256)) * 1000
    sbx.files.write(f"{base}/b.bin", blob)
    assert bytes(sbx.files.read(f"{base}/b.bin", format="bytes")) == blob
    sbx.files.write_files(
        [{"path": f"{base}/m1", "data": "1"}, {"path": f"{base}/m2", "data": b"2"}]
    )
    assert sbx.files.read(f"{base}/m2") == "2"

    assert sbx.files.exists(f"{base}/a.txt")
    assert not sbx.files.exists(f"{base}/nope")
    st = sbx.files.get_info(f"{base}/b.bin")
    assert (st.type, st.size, st.name) == (FileType.FILE, len(blob), "b.bin")
    assert sbx.files.make_dir(f"{base}/d/e") is True
    assert sbx.files.make_dir(f"{base}/d/e") is False
    assert sbx.files.get_info(f"{base}/d").type == FileType.DIR
    names = sorted(e.name for e in sbx.files.list(base))
    assert names == ["a.txt", "b.bin", "d", "m1", "m2"]
    deep = {e.path for e in sbx.files.list(base, depth=2)}
    assert f"{base}/d/e" in deep

    moved = sbx.files.rename(f"{base}/a.txt", f"{base}/d/a2.txt")
    assert moved.path == f"{base}/d/a2.txt"
    assert sbx.files.read(f"{base}/d/a2.txt") == "hello"
    sbx.files.remove(f"{base}/d")
    assert not sbx.files.exists(f"{base}/d")
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{base}/missing")
    # what commands see is what files wrote
    assert sbx.commands.run(f"cat {base}/m1").stdout == "1"


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    out: list[bytes] = []
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; echo mark-$((6*7))\n")
    sbx.pty.send_stdin(term.pid, b"exit\n")
    term.wait(on_pty=out.append)
    text = b"".join(out).decode(errors="replace")
    assert "30 100" in text
    assert "mark-42" in text

    other = sbx.pty.create(PtySize(rows=24, cols=80))
    assert sbx.pty.kill(other.pid) is True
    with pytest.raises(CommandExitException):
        other.wait()


def test_wrong_access_token_and_disconnect_mid_stream(e2b_env: str, sbx: Sandbox) -> None:
    import struct

    import httpx

    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": "not-a-key",
        "Content-Type": "application/json",
    }
    with httpx.Client(base_url=e2b_env, timeout=30) as h:
        r = h.post("/process.Process/List", headers=headers, json={})
        assert (r.status_code, r.json()["code"]) == (401, "unauthenticated")

        # start a command, read its start event, then hang up: it keeps running (as on
        # E2B) until its Connect-Timeout-Ms deadline, when the gateway kills it
        start = {
            "process": {"cmd": "/bin/bash", "args": ["-c", "sleep 60 # e2b-disconnect"]},
            "stdin": False,
        }
        body = json_envelope(start)
        stream_headers = {
            **headers,
            "X-Access-Token": sbx._envd_access_token or "",
            "Content-Type": "application/connect+json",
            "Connect-Timeout-Ms": "3000",
        }
        with h.stream("POST", "/process.Process/Start", headers=stream_headers, content=body) as r:
            head = r.iter_bytes(5).__next__()
            assert struct.unpack(">BI", head[:5])[0] == 0

    def running() -> bool:
        return any("e2b-disconnect" in " ".join(p.args) for p in sbx.commands.list())

    assert running()
    deadline = time.monotonic() + 15
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running()


def json_envelope(obj: dict[str, object]) -> bytes:
    import json
    import struct

    data = json.dumps(obj).encode()
    return struct.pack(">BI", 0, len(data)) + data


def test_large_streamed_and_gzip_uploads(sbx: Sandbox) -> None:
    import hashlib
    import io

    big = bytes(range(256)) * (32 * 1024)  # 8 MiB
    sbx.files.write("/tmp/big.bin", io.BytesIO(big))  # file-like: streamed octet-stream
    digest = sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0]
    assert digest == hashlib.sha256(big).hexdigest()
    assert bytes(sbx.files.read("/tmp/big.bin", format="bytes")) == big
    sbx.files.write("/tmp/z.txt", "zipped " * 1000, gzip=True)
    assert sbx.files.read("/tmp/z.txt") == "zipped " * 1000
    sbx.files.write("/tmp/o.txt", b"octets", use_octet_stream=True)
    assert sbx.files.read("/tmp/o.txt") == "octets"


def test_sandbox_killed_during_a_command(e2b_env: str) -> None:
    from e2b import SandboxNotRunningException

    s = Sandbox.create(timeout=60)
    h = s.commands.run("sleep 30", background=True)
    assert Sandbox.kill(s.sandbox_id) is True
    with pytest.raises(SandboxNotRunningException):
        h.wait()
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("echo too late")


def test_sandbox_ports_by_header_and_host(e2b_env: str, sbx: Sandbox) -> None:
    import httpx

    sbx.files.write("/tmp/www/hello.txt", "served")
    server = sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8123", background=True)
    try:
        token = sbx._envd_access_token or ""
        by_header = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8123"}
        by_host = {"Host": f"8123-{sbx.sandbox_id}.localhost"}
        with httpx.Client(base_url=e2b_env, timeout=30) as h:
            deadline = time.monotonic() + 15
            while True:
                r = h.get("/hello.txt", headers={**by_header, "X-Access-Token": token})
                if r.status_code != 502 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert (r.status_code, r.text) == (200, "served")
            r = h.get("/hello.txt", headers={**by_host, "X-Access-Token": token})
            assert (r.status_code, r.text) == (200, "served")
            r = h.get("/hello.txt", headers=by_header)
            assert r.status_code == 401
    finally:
        server.kill()


def test_watch_dir_sync(sbx: Sandbox) -> None:
    from e2b import FilesystemEventType

    base = f"/tmp/watch-{uuid.uuid4().hex[:6]}"
    sbx.files.make_dir(base)
    handle = sbx.files.watch_dir(base, recursive=True)
    sbx.files.write(f"{base}/new.txt", "1")
    sbx.files.write(f"{base}/sub/deep.txt", "2")
    events = {(e.name, e.type) for e in handle.get_new_events()}
    assert ("new.txt", FilesystemEventType.CREATE) in events
    assert ("sub/deep.txt", FilesystemEventType.CREATE) in events
    sbx.files.remove(f"{base}/new.txt")
    assert ("new.txt", FilesystemEventType.REMOVE) in {
        (e.name, e.type) for e in handle.get_new_events()
    }
    handle.stop()
    assert not any(".e2b-watchers" in e.name for e in sbx.files.list("/tmp"))


def test_pause_and_resume_on_connect(e2b_env: str) -> None:
    s = Sandbox.create(timeout=120)
    try:
        s.commands.run("echo 1 > /tmp/state")
        assert s.pause() is True
        assert Sandbox.pause(s.sandbox_id) is False  # already paused
        assert s.get_info().state == "paused"
        again = Sandbox.connect(s.sandbox_id)  # resumes it
        assert again.get_info().state == "running"
        assert again.commands.run("cat /tmp/state").stdout == "1\n"
    finally:
        s.kill()


def test_template_function_picks_the_function_backend(
    e2b_env: str, platform: RunningPlatform
) -> None:
    from dsec.sdk import Client

    s = Sandbox.create(template="function", timeout=60)
    try:
        with Client(api_url=platform.api_url, api_key=platform.admin_key) as client:
            spec = client.get_sandbox(s.sandbox_id).spec
        assert spec is not None
        assert spec.backend == "function"
        r = s.commands.run("echo $((6*7)); id -u")
        assert r.stdout == "42\n65534\n"
        with pytest.raises(CommandExitException) as info:
            s.commands.run("echo left > /tmp/f; exit 3")
        assert info.value.exit_code == 3
        assert s.commands.run("cat /tmp/f || echo gone").stdout.endswith("gone\n")
    finally:
        s.kill()


def test_list_filters_by_state_template_and_start_time(e2b_env: str) -> None:
    from datetime import UTC, datetime, timedelta

    from e2b import SandboxState

    tag = uuid.uuid4().hex[:8]
    t0 = datetime.now(UTC) - timedelta(seconds=1)
    a = Sandbox.create(timeout=60, metadata={"f": tag})
    b = Sandbox.create(timeout=60, metadata={"f": tag})
    try:
        assert b.pause() is True
        mine = SandboxQuery(metadata={"f": tag})

        def ids(query: SandboxQuery) -> list[str]:
            return [i.sandbox_id for i in Sandbox.list(query=query).next_items()]

        assert sorted(ids(mine)) == sorted([a.sandbox_id, b.sandbox_id])
        running = SandboxQuery(metadata={"f": tag}, state=[SandboxState.RUNNING])
        assert ids(running) == [a.sandbox_id]
        paused = SandboxQuery(metadata={"f": tag}, state=[SandboxState.PAUSED])
        assert ids(paused) == [b.sandbox_id]
        assert ids(SandboxQuery(metadata={"f": tag}, template="base")) != []
        assert ids(SandboxQuery(metadata={"f": tag}, template="no-such-template")) == []
        later = datetime.now(UTC) + timedelta(minutes=1)
        assert ids(SandboxQuery(metadata={"f": tag}, started_after=t0)) != []
        assert ids(SandboxQuery(metadata={"f": tag}, started_after=later)) == []
    finally:
        a.kill()
        b.kill()


def test_metrics_are_one_sample_of_the_sandbox(e2b_env: str, sbx: Sandbox) -> None:
    sbx.commands.run("head -c 50000000 /dev/zero > /tmp/metrics-fill")
    [m] = sbx.get_metrics()
    assert m.cpu_count == 1
    assert m.mem_total == 512 * 1024 * 1024
    assert 0 < m.mem_used <= m.mem_total
    assert 0 < m.disk_used <= m.disk_total
    assert 0.0 <= m.cpu_used_pct <= 100.0
    assert abs(m.timestamp.timestamp() - time.time()) < 60
    with pytest.raises(NotFoundException):
        Sandbox.get_metrics("sbx-none-aaaaaaaaaaaaaaaaaaaa")


def test_unsupported_options_are_refused_and_leave_nothing(e2b_env: str) -> None:
    from e2b import SandboxException

    tag = uuid.uuid4().hex[:8]
    # function sandboxes cannot pause, so they cannot pause at their timeout either
    with pytest.raises(SandboxException, match="cannot pause"):
        Sandbox.create("function", metadata={"ap": tag}, lifecycle={"on_timeout": "pause"})
    with pytest.raises(SandboxException, match="filesystem"):
        Sandbox.create(
            timeout=60,
            metadata={"ap": tag},
            lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}},
        )
    with pytest.raises(SandboxException, match="allowPublicTraffic"):
        Sandbox.create(timeout=60, metadata={"ap": tag}, network={"allow_public_traffic": True})
    with pytest.raises(SandboxException, match="reopens"):
        Sandbox.create(
            timeout=60,
            metadata={"ap": tag},
            network={"deny_out": ["10.0.0.0/8"], "allow_out": ["10.1.2.3"]},
        )
    assert Sandbox.list(query=SandboxQuery(metadata={"ap": tag})).next_items() == []
    # an explicit on_timeout="kill" is what OpenDsec does anyway
    s = Sandbox.create(timeout=60, metadata={"ap": tag}, lifecycle={"on_timeout": "kill"})
    assert s.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}
    s.kill()


def _wait_paused(sandbox_id: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while Sandbox.get_info(sandbox_id).state != "paused":
        assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
        time.sleep(0.5)


def test_auto_pause_at_the_timeout_keeps_state_and_connect_resumes(e2b_env: str) -> None:
    s = Sandbox.create(timeout=8, lifecycle={"on_timeout": "pause"})
    try:
        s.files.write("/tmp/kept.txt", "kept")
        sleeper = s.commands.run("sleep 600", background=True)
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        _wait_paused(s.sandbox_id)  # paused, not killed, when its 8 s are up
        time.sleep(2)
        assert Sandbox.get_info(s.sandbox_id).state == "paused"  # and kept paused
        again = Sandbox.connect(s.sandbox_id, timeout=120)  # resumes it, as on E2B
        info = again.get_info()
        assert info.state == "running"
        assert info.end_at.timestamp() > time.time() + 60  # a new timeout
        assert again.files.read("/tmp/kept.txt") == "kept"
        assert sleeper.pid in [p.pid for p in again.commands.list()]  # processes survived
    finally:
        s.kill()


def test_auto_resume_on_sandbox_calls(e2b_env: str) -> None:
    s = Sandbox.create(timeout=8, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        assert s.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        assert s.get_info().metadata == {}  # the gateway's flag is not the user's metadata
        _wait_paused(s.sandbox_id)
        assert s.commands.run("echo back").stdout == "back\n"  # resumed by the call
        assert s.get_info().state == "running"
        assert s.pause() is True
        s.files.write("/tmp/w.txt", "written while paused")  # an upload resumes it too
        assert s.get_info().state == "running"
        assert s.pause() is True
        assert s.files.read("/tmp/w.txt") == "written while paused"
    finally:
        s.kill()


def test_malformed_connect_frames_get_errors_and_start_nothing(e2b_env: str, sbx: Sandbox) -> None:
    import json
    import struct

    import httpx

    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sbx._envd_access_token or "",
        "Content-Type": "application/connect+json",
    }
    start = json.dumps(
        {"process": {"cmd": "/bin/bash", "args": ["-c", "sleep 60 # e2b-malformed"]}}
    ).encode()
    bad_bodies = {
        "truncated envelope": struct.pack(">BI", 0, len(start) + 10) + start,
        "short header": b"\x00\x00",
        "not JSON": struct.pack(">BI", 0, 5) + b"{nope",
        "compressed flag": struct.pack(">BI", 1, len(start)) + start,
        "JSON array": struct.pack(">BI", 0, 2) + b"[]",
    }
    with httpx.Client(base_url=e2b_env, timeout=30) as h:
        for what, body in bad_bodies.items():
            r = h.post("/process.Process/Start", headers=headers, content=body)
            # a streaming call's error comes in the end-of-stream frame (flag 2)
            raw = r.content
            assert r.status_code in (200, 400), what
            if r.status_code == 200:
                flag, size = struct.unpack(">BI", raw[:5])
                assert flag == 2, what
                err = json.loads(raw[5 : 5 + size])["error"]
            else:
                err = r.json()
            assert err["code"] in ("invalid_argument", "unimplemented"), (what, err)
            assert err["message"], what
        # unary calls answer plain JSON errors
        r = h.post(
            "/process.Process/List",
            headers={**headers, "Content-Type": "application/json"},
            content=b"{nope",
        )
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument")
    assert not any("e2b-malformed" in " ".join(p.args) for p in sbx.commands.list())


def test_signed_download_and_upload_urls(sbx: Sandbox) -> None:
    import urllib.parse

    import httpx

    sbx.files.write("/tmp/url.txt", "signed content")
    # plain HTTP, no headers: the signature is the only credential
    r = httpx.get(sbx.download_url("/tmp/url.txt"), timeout=30)
    assert (r.status_code, r.content) == (200, b"signed content")
    r = httpx.get(sbx.download_url("/tmp/url.txt", use_signature_expiration=120), timeout=30)
    assert (r.status_code, r.content) == (200, b"signed content")
    up = sbx.upload_url("/tmp/up.txt")
    r = httpx.post(up, files={"file": ("up.txt", b"uploaded")}, timeout=30)
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/up.txt") == "uploaded"

    good = sbx.download_url("/tmp/url.txt")
    tampered = good.replace(urllib.parse.quote("/tmp/url.txt", safe=""), "%2Fetc%2Fpasswd")
    tampered = tampered.replace("/tmp/url.txt", "/etc/passwd")
    assert tampered != good
    for bad in (
        tampered,  # another path under the same signature
        good[:-3] + ("AAA" if not good.endswith("AAA") else "BBB"),  # another signature
    ):
        r = httpx.get(bad, timeout=30)
        assert r.status_code == 401, bad
    r = httpx.post(good, files={"file": ("x", b"x")}, timeout=30)  # a read URL cannot write
    assert r.status_code == 401
    expired = sbx.download_url("/tmp/url.txt", use_signature_expiration=-10)
    r = httpx.get(expired, timeout=30)
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "signature is already expired"}
    assert sbx.files.read("/tmp/url.txt") == "signed content"
