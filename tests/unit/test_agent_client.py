"""The edge's agent client against scripted fake agents on a unix socket."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.agent import protocol
from dsec.agent.protocol import KIND_CLOSE, KIND_ERR, KIND_IN, KIND_JSON, KIND_OUT, ProtocolError
from dsec.core.errors import DeadlineExceeded, Internal, NotFound
from dsec.edge import agent_client

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsac-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes] | None:
    """The fake agent's side: the next client frame, or None at a clean end of stream."""
    try:
        head = await reader.readexactly(protocol.HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    length, kind = protocol.parse_header(head)
    return kind, await reader.readexactly(length) if length else b""


async def _serve(path: Path, script: Script) -> asyncio.Server:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await script(r, w)
        finally:
            w.close()

    return await asyncio.start_unix_server(handler, str(path))


async def _frames_until_close(
    r: asyncio.StreamReader,
) -> tuple[dict[str, Any], list[tuple[int, bytes]]]:
    frame = await read_frame(r)
    assert frame is not None
    req = protocol.decode_json(frame[1])
    got = []
    while (f := await read_frame(r)) is not None:
        got.append(f)
        if f[0] == KIND_CLOSE:
            break
    return req, got


@pytest.mark.asyncio
async def test_call_aggregates_output_events_and_stdin(sock_dir: Path):
    seen: dict[str, object] = {}

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        req, frames = await _frames_until_close(r)
        seen["req"], seen["frames"] = req, frames
        w.write(protocol.event("started", pid=7))
        w.write(protocol.encode(KIND_OUT, b"out1"))
        w.write(protocol.encode(KIND_ERR, b"err"))
        w.write(protocol.encode(KIND_OUT, b"out2"))
        w.write(protocol.result({"exit_code": 0}))
        await w.drain()

    server = await _serve(sock_dir / "a.sock", script)
    async with server:
        res = await agent_client.call(
            sock_dir / "a.sock", {"op": "exec", "stdin": True}, b"x" * 300_000
        )
    assert res.final == {"result": {"exit_code": 0}}
    assert res.result == {"exit_code": 0}
    assert (res.stdout, res.stderr, res.truncated) == (b"out1out2", b"err", False)
    assert res.events == ({"event": "started", "pid": 7},)
    assert seen["req"] == {"op": "exec", "stdin": True}
    frames = seen["frames"]
    assert isinstance(frames, list)
    assert b"".join(p for k, p in frames if k == KIND_IN) == b"x" * 300_000
    assert frames[-1] == (KIND_CLOSE, b"")


@pytest.mark.asyncio
async def test_call_truncates_beyond_limit_but_reads_to_the_end(sock_dir: Path):
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        for _ in range(10):
            w.write(protocol.encode(KIND_OUT, b"y" * 1000))
        w.write(protocol.result({"size": 10_000}))
        await w.drain()

    async with await _serve(sock_dir / "a.sock", script):
        res = await agent_client.call(sock_dir / "a.sock", {"op": "files.read"}, limit=3500)
    assert res.truncated
    assert res.stdout == b"y" * 3000
    assert res.result == {"size": 10_000}


@pytest.mark.asyncio
async def test_error_final_is_returned_and_raised_only_on_request(sock_dir: Path):
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.error("not_found", "/x: No such file"))
        await w.drain()

    async with await _serve(sock_dir / "a.sock", script):
        res = await agent_client.call(sock_dir / "a.sock", {"op": "files.stat", "path": "/x"})
    assert res.final["error"]["code"] == "not_found"
    with pytest.raises(NotFound, match="No such file"):
        agent_client.raise_for_final(res.final)
    with pytest.raises(Internal):
        agent_client.raise_for_final({"neither": 1})


@pytest.mark.asyncio
async def test_untrusted_peer_is_bounded(sock_dir: Path):
    async def oversize(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(b"\x7f\xff\xff\xffO")
        await w.drain()

    async def hangs_up(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.encode(KIND_OUT, b"partial"))
        await w.drain()

    async def bad_json(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.encode(KIND_JSON, b"[1, 2]"))
        await w.drain()

    for name, script in (("o", oversize), ("h", hangs_up), ("b", bad_json)):
        async with await _serve(sock_dir / f"{name}.sock", script):
            with pytest.raises(ProtocolError):
                await agent_client.call(sock_dir / f"{name}.sock", {"op": "ping"})


@pytest.mark.asyncio
async def test_timeout_is_deadline_exceeded(sock_dir: Path):
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        await asyncio.sleep(5)

    async with await _serve(sock_dir / "a.sock", silent):
        with pytest.raises(DeadlineExceeded):
            await agent_client.call(sock_dir / "a.sock", {"op": "ping"}, timeout=0.2)


@pytest.mark.asyncio
async def test_connect_retries_until_the_socket_appears(sock_dir: Path):
    async def pong(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.result({"pid": 1}))
        await w.drain()

    path = sock_dir / "late.sock"

    async def appear_later() -> asyncio.Server:
        await asyncio.sleep(0.2)
        return await _serve(path, pong)

    starter = asyncio.ensure_future(appear_later())
    res = await agent_client.call(path, {"op": "ping"}, timeout=5)
    server = await starter
    server.close()
    await server.wait_closed()
    assert res.result == {"pid": 1}
    with pytest.raises(FileNotFoundError):
        await agent_client.open_stream(sock_dir / "never.sock", {"op": "ping"}, connect_retry_s=0.1)


@pytest.mark.asyncio
async def test_stream_is_bidirectional(sock_dir: Path):
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        while (f := await read_frame(r)) is not None:
            if f[0] == KIND_IN:
                w.write(protocol.encode(KIND_OUT, f[1].upper()))
            elif f[0] == KIND_JSON:
                w.write(protocol.event("ctl", **json.loads(f[1])))
            else:
                w.write(protocol.result({"exit_code": 0}))
                w.write(protocol.encode(KIND_OUT, b"after the final frame: ignored"))
            await w.drain()

    async with await _serve(sock_dir / "a.sock", echo):
        stream = await agent_client.open_stream(sock_dir / "a.sock", {"op": "process.connect"})
        try:
            await stream.send(KIND_IN, b"abc")
            assert await stream.recv() == (KIND_OUT, b"ABC")
            await stream.send_json({"resize": [80, 24]})
            kind, payload = await stream.recv() or (0, b"")
            assert kind == KIND_JSON
            assert json.loads(payload) == {"event": "ctl", "resize": [80, 24]}
            await stream.send(KIND_CLOSE)
            frames = [f async for f in stream]
            assert stream.final == {"result": {"exit_code": 0}}
            assert len(frames) == 1
            with pytest.raises(ProtocolError):
                await stream.send(KIND_OUT, b"clients cannot send output")
        finally:
            await stream.aclose()


@pytest.mark.asyncio
async def test_stream_input_after_the_agent_answered_and_closed_keeps_the_answer(
    sock_dir: Path,
):
    """aether answers ``unavailable`` and closes without reading the input: the next write
    fails (EPIPE), and the answer already in the socket must still be read."""
    closed = asyncio.Event()

    async def refuse(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.error("unavailable", "cannot connect to port 7: refused"))
        await w.drain()
        w.close()
        await w.wait_closed()
        closed.set()

    async with await _serve(sock_dir / "a.sock", refuse):
        stream = await agent_client.open_stream(sock_dir / "a.sock", {"op": "tcp", "port": 7})
        try:
            await closed.wait()  # the input surely arrives after aether closed
            await stream.send(KIND_IN, b"x" * 100_000)
            await stream.send(KIND_CLOSE)
            assert stream.input_refused
            frames = [f async for f in stream]
        finally:
            await stream.aclose()
    assert len(frames) == 1
    final = stream.final or {}
    assert final["error"]["code"] == "unavailable"


@pytest.mark.asyncio
async def test_until_closed_waits_for_the_agent_to_close_after_its_answer(sock_dir: Path) -> None:
    closed_at: list[float] = []

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_frame(r)
        w.write(protocol.result({}))
        await w.drain()
        await asyncio.sleep(0.3)  # the agent's thread is still ending its call
        w.write(b"late bytes")
        closed_at.append(asyncio.get_running_loop().time())

    server = await _serve(sock_dir / "a.sock", script)
    try:
        stream = await agent_client.open_stream(sock_dir / "a.sock", {"op": "sync"})
        frames = [f async for f in stream]
        assert stream.final == {"result": {}}
        assert len(frames) == 1
        await stream.until_closed()
        assert closed_at
        assert asyncio.get_running_loop().time() >= closed_at[0]
        await stream.aclose()
    finally:
        server.close()
