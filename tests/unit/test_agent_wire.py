"""Pure pieces of the agent: JSON codec, framing, errors, argument checks, users."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dsec.agent import args, protocol, users, wire
from dsec.agent.protocol import KIND_ERR, KIND_IN, KIND_OUT
from dsec.agent.wire import AgentError, Conn, ProtocolError


@pytest.mark.parametrize(
    "obj",
    [
        {"op": "exec", "cmd": ["a", "b"], "env": {"K": "v"}, "timeout": 1.5, "stdin": True},
        {"s": 'ünïcødé \u2603 \U0001f600 "quoted" \\ \n\t', "n": None, "neg": -3, "big": 10**20},
        {"nested": {"a": [1, [2, {"b": []}]], "f": 1e-9}},
        {},
    ],
)
def test_json_codec_matches_stdlib(obj):
    encoded = wire.dumps(obj)
    assert json.loads(encoded) == obj
    assert wire.loads(encoded) == obj
    assert wire.loads(json.dumps(obj, indent=2).encode()) == obj


@pytest.mark.parametrize(
    "raw",
    [b"", b"[1]", b'"x"', b"{", b'{"a":1} x', b"\xff\xfe", b'{"a":1}{"b":2}', b"nul"],
)
def test_json_codec_rejects(raw):
    with pytest.raises(ProtocolError):
        wire.loads(raw)


def test_json_lone_surrogate_survives_decoding():
    obj = wire.loads(b'{"path": "a\\udcffb"}')
    assert obj["path"] == "a\udcffb"
    with pytest.raises(AgentError) as exc:
        args.req_path(obj)
    assert exc.value.code == "invalid_argument"


def test_unencodable_raises_type_error():
    with pytest.raises(TypeError):
        wire.dumps({"x": object()})


@pytest.mark.parametrize(
    ("frame", "final"),
    [
        (protocol.result({"exit_code": 0}), True),
        (protocol.result(), True),
        (protocol.error("not_found", "gone"), True),
        (protocol.event("started", pid=7), False),
        (protocol.encode_json({"resize": [80, 24]}), False),
    ],
)
def test_is_final_names_the_last_frame(frame: bytes, final: bool):
    assert protocol.is_final(protocol.decode_json(frame[protocol.HEADER.size :])) is final


def _pair() -> tuple[Conn, socket.socket]:
    a, b = socket.socketpair()
    return Conn(a), b


def test_conn_frames_round_trip():
    conn, peer = _pair()
    try:
        peer.sendall(protocol.encode_json({"op": "x", "v": 1}) + protocol.encode(KIND_IN, b"abc"))
        assert conn.read_request() == {"op": "x", "v": 1}
        assert conn.read_frame() == (KIND_IN, bytearray(b"abc"))
        big = bytes(range(256)) * 1024
        conn.send(KIND_OUT, memoryview(big)[:1000])
        conn.send(KIND_ERR, b"")
        conn.event("stat", name="f", size=3)
        conn.result({"ok": True})
        assert conn.answered
        conn.close()
        data = b""
        while chunk := peer.recv(65536):
            data += chunk
    finally:
        peer.close()
    frames = []
    while data:
        length, kind = protocol.parse_header(data[:5])
        frames.append((kind, data[5 : 5 + length]))
        data = data[5 + length :]
    assert frames[0] == (KIND_OUT, big[:1000])
    assert frames[1] == (KIND_ERR, b"")
    assert json.loads(frames[2][1]) == {"event": "stat", "name": "f", "size": 3}
    assert json.loads(frames[3][1]) == {"result": {"ok": True}}


def test_conn_end_of_stream_and_truncation():
    conn, peer = _pair()
    peer.close()
    assert conn.read_frame() is None
    conn.close()
    conn, peer = _pair()
    peer.sendall(protocol.encode(KIND_IN, b"abcdef")[:7])
    peer.close()
    with pytest.raises(ProtocolError):
        conn.read_frame()
    conn.close()


@pytest.mark.parametrize(
    "frame",
    [
        protocol.encode(KIND_IN, b"data"),  # not JSON
        protocol.encode_json({"no_op": 1}),
        b"\x00\x00\x00\x00J",  # zero length
        b"\xff\xff\xff\xffJ",  # far too long
        b"\x00\x00\x00\x02Zx",  # unknown kind
    ],
)
def test_conn_rejects_bad_requests(frame):
    conn, peer = _pair()
    try:
        peer.sendall(frame)
        with pytest.raises(ProtocolError):
            conn.read_request()
    finally:
        conn.close()
        peer.close()


def test_result_too_large_is_payload_too_large():
    conn, peer = _pair()
    try:
        with pytest.raises(AgentError) as exc:
            conn.result({"x": "a" * (protocol.MAX_FRAME + 10)})
        assert exc.value.code == "payload_too_large"
    finally:
        conn.close()
        peer.close()


def test_close_wakes_a_blocked_reader():
    conn, peer = _pair()
    got: list[object] = []

    def read() -> None:
        try:
            got.append(conn.read_frame())
        except OSError as exc:
            got.append(exc)

    t = threading.Thread(target=read)
    t.start()
    for _ in range(500):  # until the reader waits in the socket's read
        assert t.native_id is not None
        if "read" in Path(f"/proc/self/task/{t.native_id}/wchan").read_text():
            break
        time.sleep(0.01)
    conn.close()
    t.join(5)
    assert not t.is_alive()
    assert got == [None]
    peer.close()


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (errno.ENOENT, "not_found"),
        (errno.EACCES, "permission_denied"),
        (errno.EEXIST, "already_exists"),
        (errno.EISDIR, "invalid_argument"),
        (errno.ENOSPC, "payload_too_large"),
        (errno.EIO, "internal"),
    ],
)
def test_from_oserror(err, code):
    exc = wire.from_oserror(OSError(err, "msg", "/some/path"))
    assert exc.code == code
    assert "/some/path" in exc.message


def test_args_validation():
    assert args.cmd({"cmd": "echo hi"}) == (["/bin/sh", "-c", "echo hi"], "echo hi")
    assert args.cmd({"cmd": ["ls", "-l"]})[0] == ["ls", "-l"]
    bads: list[dict[str, Any]] = [{"cmd": ""}, {"cmd": []}, {"cmd": [1]}, {"cmd": "a\x00b"}, {}]
    for bad in bads:
        with pytest.raises(AgentError):
            args.cmd(bad)
    assert args.env({"env": {"A": "1"}}) == {"A": "1"}
    for bad_env in ({"A=B": "1"}, {"A": 1}, {"": "x"}, {"A": "x\x00"}):
        with pytest.raises(AgentError):
            args.env({"env": bad_env})
    assert args.opt_timeout({"timeout": 2}) == 2.0
    for t in (0, -1, True, "1"):
        with pytest.raises(AgentError):
            args.opt_timeout({"timeout": t})
    assert args.signal_number("TERM") == 15
    assert args.signal_number("SIGKILL") == 9
    assert args.signal_number(2) == 2
    for s in ("NOPE", -1, 100, True, None):
        with pytest.raises(AgentError):
            args.signal_number(s)
    with pytest.raises(AgentError):
        args.req_path({"path": "a\x00b"})
    with pytest.raises(AgentError):
        args.user({"user": -1})


def test_users_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\n"
        "# comment\n"
        "broken line\n"
        "alice:x:1000:1000:Alice:/home/alice:/bin/sh\n"
    )
    (tmp_path / "group").write_text("alice:x:1000:\nwheel:x:10:alice,bob\naudio:x:29:bob\n")
    monkeypatch.setattr(users, "ETC", str(tmp_path))
    alice = users.resolve("alice")
    assert (alice.uid, alice.gid, alice.home, alice.groups) == (1000, 1000, "/home/alice", (10,))
    assert users.resolve(1000).name == "alice"
    assert users.resolve("1000").name == "alice"
    unknown = users.resolve(4242)
    assert (unknown.uid, unknown.gid, unknown.home) == (4242, 4242, "/")
    with pytest.raises(AgentError) as exc:
        users.resolve("mallory")
    assert exc.value.code == "invalid_argument"
    env = users.child_env(alice, {"X": "1"}, explicit_user=True)
    assert env["HOME"] == "/home/alice"
    assert env["USER"] == "alice"
    assert env["X"] == "1"
    assert "PATH" in env


def test_child_env_drops_agent_variables(monkeypatch: pytest.MonkeyPatch):
    for var in users.AGENT_VARS:
        monkeypatch.setenv(var, "x")
    monkeypatch.setenv("KEEP_ME", "1")
    env = users.base_env()
    assert not users.AGENT_VARS & env.keys()
    assert env["KEEP_ME"] == "1"
