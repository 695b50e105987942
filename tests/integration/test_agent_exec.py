"""aether on this host (no container): exec, files and http ops end to end over its socket."""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.agent.local import LocalAgent, local_agent
from dsec.agent.protocol import CHUNK, KIND_CLOSE, KIND_IN, KIND_JSON, KIND_OUT

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux pidfds")


@pytest.fixture
def agent() -> Iterator[LocalAgent]:
    with local_agent() as a:
        yield a


def private_dirty_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise AssertionError("no Private_Dirty line")


# -- exec -----------------------------------------------------------------------------------


def test_ping(agent: LocalAgent):
    res = agent.call({"op": "ping"}).result
    assert res["pid"] == agent.proc.pid if agent.proc else False
    assert res["version"] == 1


def thread_ids(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def test_calls_one_after_another_reuse_waiting_threads(agent: LocalAgent):
    from dsec.agent.server import IDLE_WORKERS

    seen: set[int] = set()  # aether's threads alive during each call (the serving one too)
    for _ in range(20):
        reply = agent.call({"op": "exec", "cmd": "ls /proc/$PPID/task"})
        seen |= {int(t) for t in reply.stdout.split()}
    # one thread per call would show 20 serving threads; reused ones are a handful
    assert len(seen) <= 1 + IDLE_WORKERS + 1, seen


def test_concurrent_calls_each_get_a_thread_and_few_stay(agent: LocalAgent):
    from dsec.agent.server import IDLE_WORKERS

    assert agent.proc is not None
    n = IDLE_WORKERS + 4
    cmd = "date +%s.%N; sleep 2; date +%s.%N"
    streams = [agent.stream({"op": "exec", "cmd": cmd}) for _ in range(n)]
    replies = [s.collect() for s in streams]
    for s in streams:
        s.close()
    spans = [[float(x) for x in r.stdout.split()] for r in replies]
    assert all(len(s) == 2 for s in spans), replies
    assert max(s[0] for s in spans) < min(s[1] for s in spans)  # all ran at once
    deadline = time.monotonic() + 5
    while len(thread_ids(agent.proc.pid)) > 1 + IDLE_WORKERS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(thread_ids(agent.proc.pid)) <= 1 + IDLE_WORKERS  # the rest exited
    assert agent.call({"op": "ping"}).result["version"] == 1


def test_sync_writes_out_and_answers(agent: LocalAgent):
    assert agent.call({"op": "sync"}).result == {}


def test_exec_output_and_exit_code(agent: LocalAgent):
    reply = agent.call({"op": "exec", "cmd": "printf out; printf err >&2; exit 3"})
    assert reply.result["exit_code"] == 3
    assert reply.result["signal"] is None
    assert reply.result["timed_out"] is False
    assert (reply.stdout, reply.stderr) == (b"out", b"err")
    assert reply.events[0]["event"] == "started"
    assert reply.events[0]["pid"] > 0


def test_exec_argv_env_cwd(agent: LocalAgent, tmp_path: Path):
    reply = agent.call(
        {"op": "exec", "cmd": ["sh", "-c", 'echo "$FOO|$(pwd)|$PYTHONHOME"'],
         "env": {"FOO": "bar baz"}, "cwd": str(tmp_path)}
    )  # fmt: skip
    assert reply.stdout.decode() == f"bar baz|{tmp_path}|\n"


def test_exec_stdin(agent: LocalAgent):
    data = os.urandom(3 * CHUNK + 17)
    reply = agent.call({"op": "exec", "cmd": ["sha256sum"], "stdin": True}, stdin=data)
    assert reply.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert reply.result["exit_code"] == 0


def test_exec_stdin_not_read_does_not_block(agent: LocalAgent):
    reply = agent.call(
        {"op": "exec", "cmd": "echo done", "stdin": True}, stdin=b"x" * (4 * 1024 * 1024)
    )
    assert reply.stdout == b"done\n"


def test_exec_timeout_kills_the_group(agent: LocalAgent):
    start = time.monotonic()
    reply = agent.call({"op": "exec", "cmd": "sleep 30 & sleep 30; echo never", "timeout": 0.3})
    assert time.monotonic() - start < 5
    res = reply.result
    assert res["timed_out"] is True
    assert (res["exit_code"], res["signal"]) == (137, 9)
    assert reply.stdout == b""


def test_exec_signal_control(agent: LocalAgent):
    with agent.stream({"op": "exec", "cmd": ["sleep", "30"]}) as stream:
        frame = stream.recv()
        assert frame is not None
        assert frame[0] == KIND_JSON
        stream.send_json({"signal": "TERM"})
        res = stream.collect().result
    assert (res["exit_code"], res["signal"]) == (143, 15)


def test_exec_missing_program_and_cwd(agent: LocalAgent):
    reply = agent.call({"op": "exec", "cmd": ["/no/such/program"]})
    assert reply.result["exit_code"] == 127
    assert b"/no/such/program" in reply.stderr
    assert agent.call({"op": "exec", "cmd": "true", "cwd": "/no/such/dir"}).error_code == (
        "not_found"
    )
    assert agent.call({"op": "exec", "cmd": ""}).error_code == "invalid_argument"
    assert agent.call({"op": "nope"}).error_code == "invalid_argument"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_exec_as_another_user(agent: LocalAgent):
    reply = agent.call({"op": "exec", "cmd": "id -u; id -g; echo $HOME", "user": 65534})
    lines = reply.stdout.decode().split()
    assert lines[0] == "65534"
    res = agent.call({"op": "exec", "cmd": ["id", "-un"], "user": "root"})
    assert res.stdout == b"root\n"
    assert agent.call({"op": "exec", "cmd": "true", "user": "no-such-user"}).error_code == (
        "invalid_argument"
    )


def test_client_hangup_kills_the_command(agent: LocalAgent, tmp_path: Path):
    marker = tmp_path / "alive"
    stream = agent.stream({"op": "exec", "cmd": f"while :; do touch {marker}; sleep 0.05; done"})
    frame = stream.recv()
    assert frame is not None
    pid = __import__("json").loads(frame[1])["pid"]
    stream.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")


# -- files ----------------------------------------------------------------------------------


def test_files_round_trip_50_mib_with_low_memory(agent: LocalAgent, tmp_path: Path):
    assert agent.proc is not None
    pid = agent.proc.pid
    agent.call({"op": "ping"})
    before = private_dirty_kib(pid)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(private_dirty_kib(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    path = tmp_path / "sub" / "big.bin"
    block = os.urandom(1024 * 1024)
    digest = hashlib.sha256()
    try:
        with agent.stream({"op": "files.write", "path": str(path), "parents": True}) as s:
            for i in range(50):
                piece = block[i:] + block[:i]
                digest.update(piece)
                s.send(KIND_IN, piece)
            s.send(KIND_CLOSE)
            res = s.collect().result
        assert res == {"path": str(path), "size": 50 * 1024 * 1024}
        assert path.stat().st_size == 50 * 1024 * 1024
        back = hashlib.sha256()
        with agent.stream({"op": "files.read", "path": str(path)}) as s:
            n = 0
            while (frame := s.recv()) is not None:
                if frame[0] == KIND_OUT:
                    back.update(frame[1])
                    n += 1
            assert s.final == {"result": {"size": 50 * 1024 * 1024}}
        assert n >= 200  # 256 KiB chunks
        assert back.hexdigest() == digest.hexdigest()
    finally:
        stop.set()
        sampler.join()
    growth_mib = (max(peak) - before) / 1024
    print(f"\naether Private_Dirty {before} KiB idle, +{growth_mib:.1f} MiB peak over 50 MiB")
    assert growth_mib < 12


def test_files_write_is_atomic_and_keeps_mode(agent: LocalAgent, tmp_path: Path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    path.chmod(0o600)
    with agent.stream({"op": "files.write", "path": str(path)}) as s:
        s.send(KIND_IN, b"new content")
        s.close()  # hang up before C: the old file must stay intact
    time.sleep(0.2)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]  # no temp file left behind
    agent.call({"op": "files.write", "path": str(path)}, stdin=b"new")
    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o600
    agent.call({"op": "files.write", "path": str(path), "append": True}, stdin=b"+more")
    assert path.read_text() == "new+more"
    agent.call({"op": "files.write", "path": str(path), "mode": 0o755}, stdin=b"")
    assert path.stat().st_mode & 0o777 == 0o755
    assert path.read_bytes() == b""


def _open_files_under(pid: int, directory: Path) -> list[str]:
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{directory}/"):
            found.append(target)
    return found


def test_files_write_shows_no_temporary_name_while_the_data_arrives(
    agent: LocalAgent, tmp_path: Path
):
    assert agent.proc is not None
    (tmp_path / "old.txt").write_text("old")
    for target in ("new.txt", "old.txt"):
        with agent.stream({"op": "files.write", "path": str(tmp_path / target)}) as s:
            s.send(KIND_IN, b"part one, ")
            deadline = time.monotonic() + 10
            while not _open_files_under(agent.proc.pid, tmp_path):  # aether is writing
                assert time.monotonic() < deadline, "aether never opened the new file"
                time.sleep(0.01)
            before = {"old.txt"} if target == "new.txt" else {"new.txt", "old.txt"}
            assert set(os.listdir(tmp_path)) == before  # a watcher sees nothing yet
            s.send(KIND_IN, b"part two")
            s.send(KIND_CLOSE)
            assert s.collect().result == {"path": str(tmp_path / target), "size": 18}
        assert (tmp_path / target).read_text() == "part one, part two"
    assert sorted(os.listdir(tmp_path)) == ["new.txt", "old.txt"]


def test_files_read_range_and_stat_event(agent: LocalAgent, tmp_path: Path):
    path = tmp_path / "r.bin"
    path.write_bytes(bytes(range(256)) * 4)
    reply = agent.call({"op": "files.read", "path": str(path), "offset": 10, "length": 20})
    assert reply.stdout == (bytes(range(256)) * 4)[10:30]
    assert reply.result == {"size": 20}
    stat = reply.events[0]
    fields = (stat["event"], stat["type"], stat["size"], stat["name"])
    assert fields == ("stat", "file", 1024, "r.bin")


def test_files_metadata_ops(agent: LocalAgent, tmp_path: Path):
    d = tmp_path / "a" / "b"
    entry = agent.call({"op": "files.mkdir", "path": str(d), "parents": True}).result
    assert (entry["type"], entry["path"], entry["mode"]) == ("dir", str(d), 0o755)
    assert agent.call({"op": "files.mkdir", "path": str(d)}).error_code == "already_exists"
    (d / "f").write_text("x")
    os.symlink("f", d / "link")
    entries = agent.call({"op": "files.list", "path": str(tmp_path / "a"), "depth": 2}).result
    names = {e["path"]: e for e in entries["entries"]}
    assert set(names) == {str(d), str(d / "f"), str(d / "link")}
    assert names[str(d / "link")]["type"] == "symlink"
    assert names[str(d / "link")]["target"] == "f"
    one = agent.call({"op": "files.list", "path": str(tmp_path / "a")}).result["entries"]
    assert [e["name"] for e in one] == ["b"]
    moved = agent.call({"op": "files.rename", "src": str(d / "f"), "dst": str(d / "g")}).result
    assert moved["name"] == "g"
    assert agent.call({"op": "files.stat", "path": str(d / "g")}).result["size"] == 1
    assert agent.call({"op": "files.remove", "path": str(tmp_path / "a")}).error_code == (
        "invalid_argument"
    )
    rm = {"op": "files.remove", "path": str(tmp_path / "a"), "recursive": True}
    assert agent.call(rm).result == {}
    assert not (tmp_path / "a").exists()


def test_files_errors(agent: LocalAgent, tmp_path: Path):
    missing = str(tmp_path / "missing")
    assert agent.call({"op": "files.read", "path": missing}).error_code == "not_found"
    assert agent.call({"op": "files.stat", "path": missing}).error_code == "not_found"
    assert agent.call({"op": "files.remove", "path": missing}).error_code == "not_found"
    assert agent.call({"op": "files.read", "path": str(tmp_path)}).error_code == "invalid_argument"
    assert agent.call({"op": "files.list", "path": __file__}).error_code == "invalid_argument"
    assert agent.call({"op": "files.stat", "path": "a\x00b"}).error_code == "invalid_argument"
    assert agent.call({"op": "files.stat", "path": "bad\udcff"}).error_code == "invalid_argument"
    assert agent.call({"op": "files.stat", "path": ""}).error_code == "invalid_argument"
    reply = agent.call(
        {"op": "files.write", "path": str(tmp_path / "x" / "y")}, stdin=b"data"
    )  # no parents
    assert reply.error_code == "not_found"


# -- http -----------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return body
                body += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_POST(self) -> None:
        body = self._body()
        reply = f"{self.command} {self.path} {self.headers.get('X-Test')} ".encode() + body
        self.send_response(201)
        self.send_header("Content-Length", str(len(reply)))
        self.send_header("X-Reply", "yes")
        self.end_headers()
        self.wfile.write(reply)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (b"hello ", b"chunked ", b"world"):
            self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_http_post_with_streamed_body(agent: LocalAgent, http_port: int):
    req = {"op": "http", "port": http_port, "method": "POST", "path": "/echo?q=1",
           "headers": [["X-Test", "t1"], ["Connection", "keep-alive"]]}  # fmt: skip
    reply = agent.call(req, stdin=b"a" * 300_000)
    assert reply.result == {}
    event = reply.events[0]
    assert (event["event"], event["status"]) == ("response", 201)
    assert ["X-Reply", "yes"] in event["headers"]
    assert reply.stdout == b"POST /echo?q=1 t1 " + b"a" * 300_000


def test_http_get_chunked_response(agent: LocalAgent, http_port: int):
    req = {"op": "http", "port": http_port, "method": "GET", "path": "/", "headers": []}
    reply = agent.call(req, stdin=b"")
    assert reply.events[0]["status"] == 200
    assert reply.stdout == b"hello chunked world"


def test_http_errors(agent: LocalAgent):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    req = {"op": "http", "port": free_port, "method": "GET", "path": "/"}
    assert agent.call(req, stdin=b"").error_code == "unavailable"
    bad = {"op": "http", "port": 80, "method": "GET", "path": "/\r\nX: y"}
    assert agent.call(bad, stdin=b"").error_code == "invalid_argument"
    bad_header = {**req, "headers": [["X", "a\nb"]]}
    assert agent.call(bad_header, stdin=b"").error_code == "invalid_argument"


def test_http_gives_up_on_a_silent_server(agent: LocalAgent):
    import socket
    import time

    with socket.socket() as listener:  # accepts (the kernel's backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        req = {"op": "http", "port": listener.getsockname()[1], "method": "GET", "path": "/",
               "read_timeout": 0.5}  # fmt: skip
        t0 = time.monotonic()
        reply = agent.call(req, stdin=b"")
        assert reply.error_code == "deadline_exceeded"
        assert 0.4 < time.monotonic() - t0 < 10
        assert agent.call({**req, "read_timeout": -1}, stdin=b"").error_code == "invalid_argument"
