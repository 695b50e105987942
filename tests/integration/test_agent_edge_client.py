"""The edge's asyncio client against a real aether (on this host, no container)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from dsec.agent.local import LocalAgent, local_agent
from dsec.agent.protocol import KIND_CLOSE, KIND_IN, KIND_OUT
from dsec.core.errors import InvalidArgument, NotFound
from dsec.edge import agent_client


@pytest.fixture
def agent() -> Iterator[LocalAgent]:
    with local_agent() as a:
        yield a


@pytest.mark.asyncio
async def test_call_exec_with_stdin_and_limit(agent: LocalAgent):
    res = await agent_client.call(
        agent.socket_path, {"op": "exec", "cmd": ["cat"], "stdin": True}, b"z" * 1_000_000,
        limit=100_000, timeout=30,
    )  # fmt: skip
    assert res.truncated
    assert len(res.stdout) <= 100_000
    assert res.result["exit_code"] == 0
    assert res.events[0]["event"] == "started"


@pytest.mark.asyncio
async def test_errors_map_to_core_errors(agent: LocalAgent):
    res = await agent_client.call(agent.socket_path, {"op": "files.stat", "path": "/nope/x"})
    with pytest.raises(NotFound):
        agent_client.raise_for_final(res.final)
    res = await agent_client.call(agent.socket_path, {"op": "files.stat", "path": "a\x00"})
    with pytest.raises(InvalidArgument):
        _ = res.result


@pytest.mark.asyncio
async def test_stream_process_connect(agent: LocalAgent):
    started = await agent_client.call(agent.socket_path, {"op": "process.start", "cmd": ["cat"]})
    pid = started.result["pid"]
    stream = await agent_client.open_stream(
        agent.socket_path, {"op": "process.connect", "pid": pid}
    )
    try:
        await stream.send(KIND_IN, b"ping\n")
        kind, payload = await stream.recv() or (0, b"")
        assert (kind, payload) == (KIND_OUT, b"ping\n")
        await stream.send(KIND_CLOSE)
        rest = [frame async for frame in stream]
        assert rest[-1][0] == ord("J")
        assert stream.final == {"result": {"exit_code": 0, "signal": None}}
    finally:
        await stream.aclose()


def _refusing_port() -> tuple[socket.socket, int]:
    """A port that refuses connections (bound, never listening) while the socket is open."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


# More input than the unix socket buffers hold: aether reads none of it before answering,
# so the client is still writing when aether answers and closes (the race, every time).
BIG_INPUT = b"i" * (4 * 1024 * 1024)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("op", "code"),
    [
        ({"op": "tcp"}, "unavailable"),
        ({"op": "files.write", "path": "/nonexistent-dir/sub/f"}, "not_found"),
        ({"op": "exec", "cmd": ["true"], "stdin": True}, None),
    ],
    ids=["tcp", "files.write", "exec-stdin"],
)
async def test_stream_answer_survives_input_aether_never_reads(
    agent: LocalAgent, op: dict[str, object], code: str | None
):
    refusing, port = _refusing_port()
    stream = await agent_client.open_stream(agent.socket_path, {**op, "port": port})
    try:

        async def pump_in() -> None:  # as the edge's Stream does
            await stream.send(KIND_IN, BIG_INPUT)
            await stream.send(KIND_CLOSE)

        pump = asyncio.ensure_future(pump_in())
        frames = [frame async for frame in stream]
        await pump  # the input aether did not take is dropped, not an error
    finally:
        await stream.aclose()
        refusing.close()
    assert frames, "no frames"
    final = stream.final
    assert final is not None
    if code is None:
        assert final.get("result", {}).get("exit_code") == 0, final
    else:
        assert final.get("error", {}).get("code") == code, final


@pytest.mark.asyncio
async def test_pty_input_to_a_process_that_exited_keeps_its_answer(agent: LocalAgent):
    started = await agent_client.call(
        agent.socket_path, {"op": "process.start", "cmd": ["true"], "pty": {"cols": 80, "rows": 24}}
    )
    pid = started.result["pid"]
    for _ in range(200):
        listed = await agent_client.call(agent.socket_path, {"op": "process.list"})
        if not next(p for p in listed.result["processes"] if p["pid"] == pid)["running"]:
            break
        await asyncio.sleep(0.05)
    stream = await agent_client.open_stream(
        agent.socket_path, {"op": "process.connect", "pid": pid}
    )
    try:
        pump = asyncio.ensure_future(stream.send(KIND_IN, BIG_INPUT))
        frames = [frame async for frame in stream]
        await pump
    finally:
        await stream.aclose()
    assert frames
    assert stream.final == {"result": {"exit_code": 0, "signal": None}}


@pytest.mark.asyncio
async def test_tcp_server_that_answers_and_closes_mid_input(agent: LocalAgent):
    """The sandbox's server reads a little, answers and closes while input still streams:
    its answer arrives and the call ends with a result, not a lost connection."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve() -> None:
        c, _ = server.accept()
        c.recv(1000)  # the input is streaming
        c.sendall(b"bye")
        c.close()  # unread input: the kernel resets the connection

    loop = asyncio.get_running_loop()
    served = loop.run_in_executor(None, serve)
    stream = await agent_client.open_stream(agent.socket_path, {"op": "tcp", "port": port})
    try:
        pump = asyncio.ensure_future(stream.send(KIND_IN, BIG_INPUT))
        frames = [frame async for frame in stream]
        await pump
        await served
    finally:
        await stream.aclose()
        server.close()
    assert b"".join(p for k, p in frames if k == KIND_OUT) == b"bye"
    final = stream.final or {}
    assert final.get("result", {}).get("received") == 3, final
    assert 0 < final["result"]["sent"] < len(BIG_INPUT)
