"""Runtime routes: exec, files, processes, PTYs, shells and sandbox ports.

Each route is a thin translation to one runtime op (``docs/runtime-api.md``); large
payloads (file transfers, port traffic) stream frame by frame and are never held whole.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web

from dsec.agent import protocol
from dsec.apiserver import ports, relay
from dsec.apiserver import trajectory_calls as traj
from dsec.apiserver import trajectory_sandbox as traj_io
from dsec.apiserver.context import ctx, flag, json_body, ok, principal, query, sandbox_id
from dsec.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PayloadTooLarge,
)

MAX_UPLOAD_BYTES = 4 * 1024**3
DEFAULT_EXEC_TIMEOUT_S = 60


def _command(body: dict[str, Any]) -> str | list[str]:
    cmd = body.get("cmd")
    if isinstance(cmd, str) and cmd.strip():
        return cmd
    if isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd):
        return cmd
    raise InvalidArgument("'cmd' must be a non-empty string or list of strings")


def _timeout(body: dict[str, Any], default: float = DEFAULT_EXEC_TIMEOUT_S) -> float:
    t = body.get("timeout", default)
    if not isinstance(t, int | float) or isinstance(t, bool) or not (0 < t <= 7 * 86400):
        raise InvalidArgument("'timeout' must be a number of seconds between 0 and 604800")
    return float(t)


def _proc_args(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("env", "cwd", "user"):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def _text(data: bytes, encoding: str) -> str:
    if encoding == "base64":
        return base64.b64encode(data).decode()
    return data.decode("utf-8", errors="replace")


def _output(reply: relay.Reply, encoding: str) -> dict[str, Any]:
    return {
        **reply.result,
        "stdout": _text(reply.stdout, encoding),
        "stderr": _text(reply.stderr, encoding),
        "truncated": reply.truncated,
    }


def _finish(result: dict[str, Any]) -> web.Response:
    if result.get("timed_out"):
        err = DeadlineExceeded("the command timed out and was killed")
        return ok({"error": err.to_wire(), "result": result}, status=err.http_status)
    return ok(result)


async def exec_(request: web.Request) -> web.Response:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    encoding = body.get("encoding", "utf-8")
    if encoding not in ("utf-8", "base64"):
        raise InvalidArgument("'encoding' must be 'utf-8' or 'base64'")
    timeout = _timeout(body)
    stdin: bytes | None = None
    if body.get("stdin") is not None:
        if not isinstance(body["stdin"], str):
            raise InvalidArgument("'stdin' must be a string")
        try:
            stdin = (
                base64.b64decode(body["stdin"], validate=True)
                if encoding == "base64"
                else body["stdin"].encode()
            )
        except binascii.Error:
            raise InvalidArgument("'stdin' is not valid base64") from None
    req = {
        "op": "exec",
        "cmd": _command(body),
        "timeout": timeout,
        "stdin": stdin is not None,
        **_proc_args(body),
        **_call_args(body),
    }
    reply = await traj.call(request, c, p, sid, req, stdin, deadline_s=timeout + 30)
    return _finish(_output(reply, encoding))


def _call_args(body: dict[str, Any]) -> dict[str, Any]:
    """``files`` in, ``outputs`` back and a per-call ``memory_mb`` (function backend)."""
    out: dict[str, Any] = {}
    files = body.get("files")
    if files is not None:
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) for f in files
        ):
            raise InvalidArgument("'files' must be a list of {path, data (base64), mode?}")
        out["files"] = files
    outputs = body.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list) or not all(isinstance(x, str) for x in outputs):
            raise InvalidArgument("'outputs' must be a list of paths")
        out["outputs"] = outputs
    mem = body.get("memory_mb")
    if mem is not None:
        if not isinstance(mem, int) or isinstance(mem, bool) or mem <= 0:
            raise InvalidArgument("'memory_mb' must be a positive integer")
        out["memory_mb"] = mem
    return out


async def shell_run(request: web.Request) -> web.Response:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    body = await json_body(request)
    timeout = _timeout(body)
    req = {
        "op": "shell.run",
        "session": request.match_info["name"],
        "cmd": _command(body),
        "timeout": timeout,
        **_proc_args(body),
    }
    reply = await traj.call(request, c, p, sid, req, deadline_s=timeout + 30)
    return _finish(_output(reply, "utf-8"))


async def _unary(
    request: web.Request, role: str, req: dict[str, Any], stdin: bytes | None = None
) -> web.Response:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require(role)
    reply = await traj.call(request, c, p, sid, req, stdin, deadline_s=60)
    return ok(reply.result)


async def shells_list(request: web.Request) -> web.Response:
    return await _unary(request, "viewer", {"op": "shell.list"})


async def shell_close(request: web.Request) -> web.Response:
    return await _unary(
        request, "member", {"op": "shell.close", "session": request.match_info["name"]}
    )


async def files_stat(request: web.Request) -> web.Response:
    return await _unary(request, "viewer", {"op": "files.stat", "path": query(request, "path")})


async def files_list(request: web.Request) -> web.Response:
    depth = query(request, "depth", required=False, default="1")
    if not depth.isdigit() or not 1 <= int(depth) <= 32:
        raise InvalidArgument("'depth' must be an integer from 1 to 32")
    return await _unary(
        request, "viewer", {"op": "files.list", "path": query(request, "path"), "depth": int(depth)}
    )


async def files_mkdir(request: web.Request) -> web.Response:
    body = await json_body(request)
    return await _unary(
        request,
        "member",
        {"op": "files.mkdir", "path": body.get("path"), "parents": bool(body.get("parents", True))},
    )


async def files_remove(request: web.Request) -> web.Response:
    body = await json_body(request)
    return await _unary(
        request,
        "member",
        {
            "op": "files.remove",
            "path": body.get("path"),
            "recursive": bool(body.get("recursive", False)),
        },
    )


async def files_rename(request: web.Request) -> web.Response:
    body = await json_body(request)
    return await _unary(
        request, "member", {"op": "files.rename", "src": body.get("src"), "dst": body.get("dst")}
    )


async def processes_start(request: web.Request) -> web.Response:
    body = await json_body(request)
    req: dict[str, Any] = {"op": "process.start", "cmd": _command(body), **_proc_args(body)}
    if body.get("tag") is not None:
        req["tag"] = body["tag"]
    if body.get("pty") is not None:
        req["pty"] = body["pty"]
    return await _unary(request, "member", req)


async def processes_list(request: web.Request) -> web.Response:
    return await _unary(request, "viewer", {"op": "process.list"})


def _pid(request: web.Request) -> int:
    raw = request.match_info["pid"]
    if not raw.isdigit():
        raise InvalidArgument(f"invalid pid {raw!r}")
    return int(raw)


async def process_signal(request: web.Request) -> web.Response:
    body = await json_body(request)
    return await _unary(
        request,
        "member",
        {"op": "process.signal", "pid": _pid(request), "signal": body.get("signal", 15)},
    )


async def process_input(request: web.Request) -> web.Response:
    data = await request.read()
    return await _unary(request, "member", {"op": "process.input", "pid": _pid(request)}, data)


async def process_resize(request: web.Request) -> web.Response:
    body = await json_body(request)
    return await _unary(
        request,
        "member",
        {
            "op": "pty.resize",
            "pid": _pid(request),
            "cols": body.get("cols"),
            "rows": body.get("rows"),
        },
    )


async def files_read(request: web.Request) -> web.StreamResponse:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("viewer")
    req = {"op": "files.read", "path": query(request, "path")}
    t = await traj.bound(c, sid)
    if t is not None:

        async def run() -> tuple[dict[str, Any], bytes | None]:
            data = await traj_io.read_file(c, p, sid, req)
            return {"size": len(data)}, data

        _, data = await traj.transfer(request, c, p, t, sid, req, None, run)
        return web.Response(body=data or b"", content_type="application/octet-stream")
    stream = await relay.EdgeStream.open(c, p, sid, req)
    resp: web.StreamResponse | None = None
    try:
        await stream.done_writing()
        while (frame := await stream.read()) is not None:
            kind, data = frame
            if kind == protocol.KIND_OUT:
                if resp is None:
                    resp = await _start_download(request, None)
                await resp.write(data)
            elif kind == protocol.KIND_JSON:
                msg = protocol.decode_json(data)
                if msg.get("event") == "stat" and resp is None:
                    size = msg.get("size")
                    resp = await _start_download(request, size if isinstance(size, int) else None)
                elif protocol.is_final(msg):
                    relay.raise_for_final(msg)
                    if resp is None:
                        resp = await _start_download(request, 0)
                    await resp.write_eof()
                    return resp
        raise DeadlineExceeded("file download ended without a result")
    finally:
        stream.cancel()


async def _start_download(request: web.Request, size: int | None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    if size is not None:
        resp.content_length = size
    await resp.prepare(request)
    return resp


async def files_write(request: web.Request) -> web.Response:
    c, p, sid = ctx(request), principal(request), sandbox_id(request)
    p.require("member")
    if request.content_length is not None and request.content_length > MAX_UPLOAD_BYTES:
        raise PayloadTooLarge(
            f"upload of {request.content_length} bytes exceeds the limit of {MAX_UPLOAD_BYTES}"
        )
    req: dict[str, Any] = {
        "op": "files.write",
        "path": query(request, "path"),
        "append": flag(request, "append"),
        "parents": flag(request, "parents"),
    }
    if "mode" in request.query:
        try:
            req["mode"] = int(request.query["mode"], 8)
        except ValueError:
            raise InvalidArgument("'mode' must be octal, e.g. 644") from None
    t = await traj.bound(c, sid)
    if t is not None:
        body = await traj_io.read_body(request)

        async def run() -> tuple[dict[str, Any], bytes | None]:
            return await traj_io.write_file(c, p, sid, req, body), None

        result, _ = await traj.transfer(request, c, p, t, sid, req, body, run)
        return ok(result)
    stream = await relay.EdgeStream.open(c, p, sid, req)
    try:
        sent = 0
        async for chunk in request.content.iter_chunked(protocol.CHUNK):
            sent += len(chunk)
            if sent > MAX_UPLOAD_BYTES:
                raise PayloadTooLarge(f"upload exceeds the limit of {MAX_UPLOAD_BYTES} bytes")
            await stream.send(protocol.KIND_IN, chunk)
        await stream.send(protocol.KIND_CLOSE)
        await stream.done_writing()
        return ok(await relay.read_final(stream))
    finally:
        stream.cancel()


async def port_proxy(request: web.Request) -> web.StreamResponse:
    port_raw = request.match_info["port"]
    if not port_raw.isdigit() or not 1 <= int(port_raw) <= 65535:
        raise InvalidArgument(f"invalid port {port_raw!r}")
    path = "/" + request.match_info.get("path", "")
    return await ports.forward(request, sandbox_id(request), int(port_raw), path)


_S = "/v1/sandboxes/{sandbox_id}"
ROUTES: list[tuple[str, str, Any]] = [
    ("POST", f"{_S}/exec", exec_),
    ("GET", f"{_S}/files", files_read),
    ("PUT", f"{_S}/files", files_write),
    ("GET", f"{_S}/files/stat", files_stat),
    ("GET", f"{_S}/files/list", files_list),
    ("POST", f"{_S}/files/mkdir", files_mkdir),
    ("POST", f"{_S}/files/remove", files_remove),
    ("POST", f"{_S}/files/rename", files_rename),
    ("POST", f"{_S}/processes", processes_start),
    ("GET", f"{_S}/processes", processes_list),
    ("POST", f"{_S}/processes/{{pid}}/signal", process_signal),
    ("POST", f"{_S}/processes/{{pid}}/input", process_input),
    ("POST", f"{_S}/processes/{{pid}}/resize", process_resize),
    ("POST", f"{_S}/shells/{{name}}/run", shell_run),
    ("GET", f"{_S}/shells", shells_list),
    ("DELETE", f"{_S}/shells/{{name}}", shell_close),
    ("*", f"{_S}/ports/{{port}}/{{path:.*}}", port_proxy),
]
