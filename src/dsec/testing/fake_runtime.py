"""A loopback fake of the runtime WebSocket (``/v1/sandboxes/{id}/runtime``) for SDK tests.

It serves the sandboxes of a :class:`~dsec.testing.fake_api.FakeApi` on ``127.0.0.1:<port>``
with the same fake command interpreter, frame for frame as ``docs/http-api.md`` describes.
"""

from __future__ import annotations

import json
import threading

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse
from websockets.sync.server import Server, ServerConnection, serve

from dsec.agent.protocol import KIND_CLOSE, KIND_ERR, KIND_IN, KIND_JSON, KIND_OUT
from dsec.testing.fake_api import JSON, FakeApi, interpret


def _frame(kind: int, payload: bytes = b"") -> bytes:
    return bytes([kind]) + payload


def _json_frame(obj: JSON) -> bytes:
    return _frame(KIND_JSON, json.dumps(obj).encode())


class FakeRuntimeServer:
    """The runtime WebSocket of :class:`FakeApi`'s sandboxes on ``127.0.0.1:<port>``.

    ``exec`` runs the fake interpreter (stdin from ``I`` frames); ``process.connect`` on a
    PTY replays its buffered output and echoes input back, records ``resize`` controls, and
    ends on input ``exit\\n`` (code 0), a ``signal`` control, or ``C``.
    """

    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self._server: Server = serve(
            self._handle, "127.0.0.1", 0, process_request=self._check, compression=None
        )
        self.port: int = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeRuntimeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, conn: ServerConnection, request: WsRequest) -> WsResponse | None:
        if request.headers.get("Authorization") != f"Bearer {self.api.api_key}":
            return _reject(conn, 401, "unauthenticated", "missing or invalid API key")
        parts = request.path.split("/")
        if len(parts) != 5 or parts[4] != "runtime" or parts[3] not in self.api.sandboxes:
            return _reject(conn, 404, "sandbox_not_found", f"no sandbox at {request.path}")
        return None

    def _handle(self, conn: ServerConnection) -> None:
        sid = conn.request.path.split("/")[3] if conn.request else ""
        try:
            req = json.loads(_expect(conn)[1:])
            if req["op"] == "exec":
                self._exec(conn, req)
            elif req["op"] == "process.connect":
                self._connect(conn, sid, req["pid"])
            else:
                conn.send(_json_frame({"error": {"code": "invalid_argument", "message": "op"}}))
        except ConnectionClosed:
            pass

    def _exec(self, conn: ServerConnection, req: JSON) -> None:
        stdin = b""
        if req.get("stdin"):
            while (msg := _expect(conn))[0] != KIND_CLOSE:
                stdin += msg[1:]
        out = interpret(req["cmd"], stdin, req.get("timeout"))
        conn.send(_json_frame({"event": "started", "pid": 7}))
        for line in out.stdout.splitlines(keepends=True):
            conn.send(_frame(KIND_OUT, line))
        if out.stderr:
            conn.send(_frame(KIND_ERR, out.stderr))
        wire = out.wire()
        result = {k: wire[k] for k in ("exit_code", "signal", "timed_out", "duration_ms")}
        conn.send(_json_frame({"result": result}))

    def _connect(self, conn: ServerConnection, sid: str, pid: int) -> None:
        proc = self.api.sandboxes[sid].processes.get(pid)
        if proc is None:
            conn.send(_json_frame({"error": {"code": "process_not_found", "message": "no"}}))
            return
        conn.send(_frame(KIND_OUT, proc["output"]))
        result: JSON = {"exit_code": 0, "signal": None}
        while True:
            msg = _expect(conn)
            if msg[0] == KIND_IN:
                proc["input"] += msg[1:]
                conn.send(_frame(KIND_OUT, msg[1:]))
                if proc["input"].endswith(b"exit\n"):
                    break
            elif msg[0] == KIND_JSON:
                ctl = json.loads(msg[1:])
                if "resize" in ctl:
                    proc["size"] = {"cols": ctl["resize"][0], "rows": ctl["resize"][1]}
                if "signal" in ctl:
                    result = {"exit_code": None, "signal": ctl["signal"]}
                    break
            else:
                break
        proc.update(running=False, exit_code=result["exit_code"])
        conn.send(_json_frame({"result": result}))


def _expect(conn: ServerConnection) -> bytes:
    msg = conn.recv()
    if not isinstance(msg, bytes) or not msg:
        raise ConnectionClosed(None, None)
    return msg


def _reject(conn: ServerConnection, status: int, code: str, message: str) -> WsResponse:
    return conn.respond(status, json.dumps({"error": {"code": code, "message": message}}))
