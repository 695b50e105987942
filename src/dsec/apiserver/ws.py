"""The runtime WebSocket: one binary message per runtime frame (kind byte + payload),
relayed to and from the sandbox's edge. Streaming exec, PTYs and process reattach use it."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

from dsec.agent import protocol
from dsec.apiserver import relay, trajectory_calls
from dsec.apiserver.context import ctx, principal, sandbox_id
from dsec.core.errors import DsecError, InvalidArgument

MAX_MESSAGE = protocol.MAX_FRAME + 1
_WRITE_OPS = frozenset(
    {"files.read", "files.stat", "files.list", "process.list", "shell.list", "ping"}
)


async def runtime_ws(request: web.Request) -> web.WebSocketResponse:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    ws = web.WebSocketResponse(heartbeat=30, max_msg_size=MAX_MESSAGE)
    await trajectory_calls.mark_unrecorded(request, c, sid)
    await ws.prepare(request)
    try:
        first = await ws.receive(timeout=30)
        req = _first_request(first)
        p.require("viewer" if req.get("op") in _WRITE_OPS else "member")
        stream = await relay.EdgeStream.open(c, p, sid, req)
    except (DsecError, TimeoutError) as exc:
        err = exc if isinstance(exc, DsecError) else InvalidArgument("no request within 30 s")
        await ws.send_bytes(protocol.error(err.code, err.message)[4:])
        await ws.close()
        return ws

    async def pump_in() -> None:
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.BINARY and msg.data:
                await stream.send(msg.data[0], bytes(msg.data[1:]))
            elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR):
                break
        stream.cancel()

    pump = asyncio.ensure_future(pump_in())
    try:
        while (frame := await stream.read()) is not None:
            kind, data = frame
            await ws.send_bytes(bytes([kind]) + data)
            if kind == protocol.KIND_JSON:
                with contextlib.suppress(protocol.ProtocolError):
                    if protocol.is_final(protocol.decode_json(data)):
                        break  # the call is over; the edge waits for us to let go of it
    except DsecError as exc:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(protocol.error(exc.code, exc.message)[4:])
    except (ConnectionError, RuntimeError):
        pass  # the client went away
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        stream.cancel()
        await ws.close()
    return ws


def _first_request(msg: aiohttp.WSMessage) -> dict[str, Any]:
    if msg.type is not aiohttp.WSMsgType.BINARY or not msg.data:
        raise InvalidArgument("the first message must be a binary J frame with the request")
    data: bytes = msg.data
    if data[0] != protocol.KIND_JSON:
        raise InvalidArgument("the first frame must be the JSON request (kind J)")
    try:
        req = protocol.decode_json(data[1:])
    except protocol.ProtocolError as exc:
        raise InvalidArgument(str(exc)) from None
    if not isinstance(req.get("op"), str):
        raise InvalidArgument("the request needs an 'op'")
    return req
