"""envd's ``process.Process`` service on OpenDsec's runtime API.

A command is an OpenDsec background process, started and followed in one runtime
WebSocket call (``process.start`` with ``follow``; ``process.connect`` re-attaches), so, as
on E2B, a client that disconnects leaves it
running, ``Connect`` re-attaches (with the buffered output), and ``List``/``SendInput``/
``SendSignal`` reach it by pid. A ``Connect-Timeout-Ms`` deadline kills the process (as
envd does) and ends the stream with ``deadline_exceeded``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dsec.core.errors import (
    BackendUnavailable,
    DsecError,
    Internal,
    InvalidArgument,
    InvalidState,
    ProcessNotFound,
)
from dsec.gateway.connect import ConnectError, ServerStream, connect_error
from dsec.sdk import runtime_calls as rc
from dsec.sdk import streams
from dsec.sdk.async_io import AsyncRuntimeSocket
from dsec.sdk.async_sandbox import AsyncClient
from dsec.sdk.models import ExecEvent, ProcessInfo
from dsec.sdk.wire import compact

# A command started without stdin reads /dev/null, as under envd (its pipe is never open).
NO_STDIN = ["/bin/sh", "-c", 'exec "$@" </dev/null', "sh"]
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
TICK_S = 1.0


@dataclass(frozen=True)
class Call:
    """One envd call: its sandbox, the caller's client, the Unix user and its deadline."""

    sandbox_id: str
    client: AsyncClient
    user: str | None
    timeout_s: float | None
    keepalive_s: float
    background: Callable[[Awaitable[Any]], None]  # Gateway.background: run detached


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(f"'{what}' must be base64 bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"'{what}' is not valid base64") from None


def _pid(value: Any) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"invalid pid {value!r}")
    return value


async def _select(c: Call, selector: Any) -> int:
    """The pid a ``ProcessSelector`` (``{"pid": n}`` or ``{"tag": s}``) names."""
    if not isinstance(selector, dict):
        raise InvalidArgument("'process' must select a pid or a tag")
    if "pid" in selector:
        return _pid(selector["pid"])
    tag = selector.get("tag")
    if not isinstance(tag, str):
        raise InvalidArgument("'process' must select a pid or a tag")
    for p in await c.client.transport.call(rc.list_processes(c.sandbox_id)):
        if p.tag == tag and p.running:
            return p.pid
    raise ProcessNotFound(f"no running process is tagged {tag!r}")


def _end_event(ev: ExecEvent) -> dict[str, Any]:
    if ev.signal:
        try:
            name = signal.strsignal(ev.signal) or f"signal {ev.signal}"
        except ValueError:
            name = f"signal {ev.signal}"
        return {"exitCode": -1, "exited": False, "status": f"signal: {name.lower()}"}
    code = ev.exit_code if ev.exit_code is not None else -1
    return {"exitCode": code, "exited": True, "status": f"exit status {code}"}


async def _kill_at(c: Call, pid: int, delay: float) -> None:
    await asyncio.sleep(delay)
    with contextlib.suppress(DsecError):
        await c.client.transport.call(rc.signal_process(c.sandbox_id, pid, 9))


async def _pump(sock: AsyncRuntimeSocket, queue: asyncio.Queue[ExecEvent | BaseException]) -> None:
    try:
        async for ev in sock:
            await queue.put(ev)
    except Exception as exc:
        await queue.put(exc)


async def follow(
    c: Call,
    stream: ServerStream,
    pid: int,
    *,
    pty: bool,
    killer: asyncio.Task[None] | None = None,
    sock: AsyncRuntimeSocket | None = None,
) -> None:
    """Relay the process's output and exit to ``stream`` (detach if the client goes).

    ``sock`` is a runtime call already following the process, else one is opened."""
    deadline = time.monotonic() + c.timeout_s if c.timeout_s else None
    if sock is None:
        sock = await c.client.transport.open_runtime(c.sandbox_id, streams.connect_request(pid))
    queue: asyncio.Queue[ExecEvent | BaseException] = asyncio.Queue()
    pump = asyncio.ensure_future(_pump(sock, queue))
    last_sent = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                await stream.end(ConnectError("deadline_exceeded", "the command timed out"))
                return
            wait = TICK_S if deadline is None else min(TICK_S, deadline - now)
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if stream.client_gone:
                    return
                if c.keepalive_s and time.monotonic() - last_sent >= c.keepalive_s:
                    await stream.send({"event": {"keepalive": {}}})
                    last_sent = time.monotonic()
                continue
            if isinstance(item, BaseException):
                await stream.end(connect_error(item))
                return
            if item.kind == "exit":
                if killer is not None:
                    killer.cancel()
                await stream.send({"event": {"end": _end_event(item)}})
                await stream.end()
                return
            field = "pty" if pty else item.kind
            await stream.send({"event": {"data": {field: b64(item.data)}}})
            last_sent = time.monotonic()
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        with contextlib.suppress(Exception):
            await sock.close()


async def start(c: Call, msg: dict[str, Any], stream: ServerStream) -> None:
    proc = msg.get("process")
    if not isinstance(proc, dict) or not isinstance(proc.get("cmd"), str) or not proc["cmd"]:
        raise InvalidArgument("'process.cmd' is required")
    args = proc.get("args") or []
    envs = proc.get("envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InvalidArgument("'process.args' must be a list of strings")
    if not isinstance(envs, dict):
        raise InvalidArgument("'process.envs' must be an object")
    size = None
    pty = msg.get("pty")
    if isinstance(pty, dict):
        s = pty.get("size") or {}
        size = (int(s.get("cols") or 80), int(s.get("rows") or 24))
    tag = msg.get("tag") if isinstance(msg.get("tag"), str) else None
    argv = [proc["cmd"], *args]
    if msg.get("stdin", True) is False and size is None:
        argv = [*NO_STDIN, *argv]
    env = {str(k): str(v) for k, v in envs.items()} or None
    cwd = proc.get("cwd") or None
    try:
        pid, sock = await _start_following(c, argv, env, cwd, tag, size)
    except BackendUnavailable:
        if size is not None:
            raise
        # A stateless backend (function) keeps no processes: run it as one exec instead.
        await _exec_instead(c, stream, argv, env, cwd)
        return
    killer = None
    if c.timeout_s:
        killer = asyncio.ensure_future(_kill_at(c, pid, c.timeout_s))
        c.background(killer)
    await stream.send({"event": {"start": {"pid": pid}}})
    await follow(c, stream, pid, pty=size is not None, killer=killer, sock=sock)


async def _start_following(
    c: Call,
    argv: list[str],
    env: dict[str, str] | None,
    cwd: str | None,
    tag: str | None,
    size: tuple[int, int] | None,
) -> tuple[int, AsyncRuntimeSocket | None]:
    """Start a kept process and follow it in one runtime call (``process.start`` with
    ``follow``); the pid and that call. An agent without ``follow`` just answers the pid:
    then ``(pid, None)``, and the caller follows with ``process.connect``."""
    pty = None if size is None else {"cols": size[0], "rows": size[1]}
    first = streams.json_message(
        compact(
            op="process.start",
            cmd=rc.check_cmd(argv),
            env=env,
            cwd=cwd,
            user=c.user,
            tag=tag,
            pty=pty,
            follow=True,
        )
    )
    sock = await c.client.transport.open_runtime(c.sandbox_id, first)
    try:
        await sock.wait_event("started")
    except Internal:
        res = sock.stream.result
        with contextlib.suppress(Exception):
            await sock.close()
        if isinstance(res, dict) and isinstance(res.get("pid"), int):
            return res["pid"], None
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            await sock.close()
        raise
    if sock.stream.pid is None:
        raise Internal("the runtime's started event carried no pid")
    return sock.stream.pid, sock


async def _exec_instead(
    c: Call, stream: ServerStream, argv: list[str], env: dict[str, str] | None, cwd: str | None
) -> None:
    """Relay one streamed ``exec`` as a process that starts, prints and ends."""
    first = streams.exec_request(argv, env=env, cwd=cwd, timeout=c.timeout_s or None)
    sock = await c.client.transport.open_runtime(c.sandbox_id, first)
    try:
        await stream.send({"event": {"start": {"pid": 1}}})
        async for ev in sock:
            if ev.kind == "exit":
                if ev.timed_out:
                    await stream.end(ConnectError("deadline_exceeded", "the command timed out"))
                    return
                await stream.send({"event": {"end": _end_event(ev)}})
                await stream.end()
                return
            await stream.send({"event": {"data": {ev.kind: b64(ev.data)}}})
    except DsecError as exc:
        await stream.end(connect_error(exc))
    finally:
        with contextlib.suppress(Exception):
            await sock.close()


async def connect(c: Call, msg: dict[str, Any], stream: ServerStream) -> None:
    pid = await _select(c, msg.get("process"))
    procs = await c.client.transport.call(rc.list_processes(c.sandbox_id))
    found = next((p for p in procs if p.pid == pid), None)
    if found is None:
        raise ProcessNotFound(f"process {pid} not found")
    await stream.send({"event": {"start": {"pid": pid}}})
    await follow(c, stream, pid, pty=found.pty)


def _config(p: ProcessInfo) -> dict[str, Any]:
    argv = p.cmd if isinstance(p.cmd, list) else ["/bin/sh", "-c", p.cmd]
    if argv[: len(NO_STDIN)] == NO_STDIN:
        argv = argv[len(NO_STDIN) :]
    return {"cmd": argv[0] if argv else "", "args": argv[1:], "envs": {}}


async def list_(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    procs = await c.client.transport.call(rc.list_processes(c.sandbox_id))
    out = []
    for p in procs:
        if p.running:
            item: dict[str, Any] = {"config": _config(p), "pid": p.pid}
            if p.tag is not None:
                item["tag"] = p.tag
            out.append(item)
    return {"processes": out}


def _input(msg: Any) -> bytes:
    if not isinstance(msg, dict):
        raise InvalidArgument("'input' must hold 'stdin' or 'pty' bytes")
    for key in ("stdin", "pty"):
        if key in msg:
            return unb64(msg[key], f"input.{key}")
    return b""


async def send_input(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    pid = await _select(c, msg.get("process"))
    data = _input(msg.get("input"))
    if data:
        await c.client.transport.call(rc.send_input(c.sandbox_id, pid, data))
    return {}


async def _input_socket(c: Call, pid: int, close: bool) -> AsyncRuntimeSocket:
    first = streams.json_message({"op": "process.input", "pid": pid, "close": close})
    return await c.client.transport.open_runtime(c.sandbox_id, first)


async def _finish_input(sock: AsyncRuntimeSocket) -> None:
    try:
        await sock.close_input()
        while await sock.next_event() is not None:
            pass
    finally:
        await sock.close()


async def stream_input(c: Call, messages: Any, stream: ServerStream) -> None:
    sock: AsyncRuntimeSocket | None = None
    try:
        async for msg in messages:
            if "start" in msg:
                if sock is not None:
                    raise InvalidArgument("the input stream was already started")
                pid = await _select(c, (msg["start"] or {}).get("process"))
                sock = await _input_socket(c, pid, close=False)
            elif "data" in msg:
                if sock is None:
                    raise InvalidArgument("the input stream must start with a 'start' message")
                data = _input((msg["data"] or {}).get("input"))
                if data:
                    await sock.send_input(data)
        if sock is None:
            raise InvalidArgument("the input stream carried no 'start' message")
        s, sock = sock, None
        await _finish_input(s)
    finally:
        if sock is not None:
            await sock.close()
    await stream.send({})
    await stream.end()


async def close_stdin(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    pid = await _select(c, msg.get("process"))
    await _finish_input(await _input_socket(c, pid, close=True))
    return {}


async def send_signal(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    pid = await _select(c, msg.get("process"))
    sig = SIGNALS.get(msg.get("signal", "SIGNAL_UNSPECIFIED"))
    if sig is None:
        raise InvalidArgument(f"unsupported signal {msg.get('signal')!r}")
    try:
        await c.client.transport.call(rc.signal_process(c.sandbox_id, pid, sig))
    except InvalidState as exc:  # it has exited: envd forgets such processes
        raise ProcessNotFound(exc.message) from None
    return {}


async def update(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    pid = await _select(c, msg.get("process"))
    pty = msg.get("pty")
    if isinstance(pty, dict) and isinstance(pty.get("size"), dict):
        size = pty["size"]
        await c.client.transport.call(
            rc.resize_pty(c.sandbox_id, pid, int(size.get("cols") or 0), int(size.get("rows") or 0))
        )
    return {}


UNARY = {
    "List": list_,
    "SendInput": send_input,
    "SendSignal": send_signal,
    "CloseStdin": close_stdin,
    "Update": update,
}
SERVER_STREAM = {"Start": start, "Connect": connect}
CLIENT_STREAM = {"StreamInput": stream_input}
