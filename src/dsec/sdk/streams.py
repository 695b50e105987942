"""Sans-I/O side of the runtime WebSocket (``GET /v1/sandboxes/{id}/runtime``).

Every binary WebSocket message is one runtime frame: a kind byte (``J I C O E``) and its
payload. The client sends the ``J`` request, then ``I`` data, ``C`` (end of input) and ``J``
controls; the server sends ``J`` events, ``O``/``E`` output and one final ``J`` result or
error. :class:`RuntimeStream` turns server messages into :class:`~dsec.sdk.models.ExecEvent`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from dsec.agent.protocol import CHUNK, KIND_CLOSE, KIND_ERR, KIND_IN, KIND_JSON, KIND_OUT
from dsec.core.errors import DsecError, Internal, Unavailable, error_from_wire
from dsec.sdk.models import JSON, ExecEvent
from dsec.sdk.runtime_calls import Command, check_cmd, check_size, check_timeout
from dsec.sdk.wire import compact, sandbox_path

CLOSE_MESSAGE = bytes([KIND_CLOSE])


def runtime_url(api_url: str, sandbox_id: str) -> str:
    """The WebSocket URL of a sandbox's runtime stream for an ``http(s)://`` API URL."""
    if api_url.startswith("https://"):
        base = "wss://" + api_url[len("https://") :]
    elif api_url.startswith("http://"):
        base = "ws://" + api_url[len("http://") :]
    else:
        base = api_url
    return base.rstrip("/") + sandbox_path(sandbox_id) + "/runtime"


def json_message(obj: Mapping[str, Any]) -> bytes:
    return bytes([KIND_JSON]) + json.dumps(obj, separators=(",", ":")).encode()


def input_messages(data: bytes | bytearray | memoryview) -> Iterator[bytes]:
    """``I`` messages carrying ``data`` in protocol-sized chunks (none for empty data)."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        yield bytes([KIND_IN]) + view[start : start + CHUNK].tobytes()


def resize_message(cols: int, rows: int) -> bytes:
    cols, rows = check_size(cols, rows)
    return json_message({"resize": [cols, rows]})


def signal_message(sig: int) -> bytes:
    return json_message({"signal": int(sig)})


def exec_request(
    cmd: Command,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    timeout: float | None = 60,
    stdin: bool = False,
) -> bytes:
    """The first message of a streamed ``exec``; ``stdin`` says input frames will follow."""
    args = compact(
        op="exec",
        cmd=check_cmd(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        user=user,
        timeout=check_timeout(timeout),
    )
    args["stdin"] = stdin
    return json_message(args)


def connect_request(pid: int) -> bytes:
    """The first message of ``process.connect`` (reattach to a process's output)."""
    return json_message({"op": "process.connect", "pid": int(pid)})


class RuntimeStream:
    """Decodes the server's messages of one runtime call into events.

    ``feed`` returns an event for output and for the final result (``kind="exit"``),
    ``None`` for informational events (recorded in ``events``), and raises the error of a
    final error frame. After the final frame ``done`` is true.
    """

    def __init__(self) -> None:
        self.done = False
        self.pid: int | None = None
        self.events: list[JSON] = []
        self.result: JSON | None = None

    def feed(self, message: bytes | str) -> ExecEvent | None:
        if self.done:
            raise Internal("the runtime stream sent a message after its final frame")
        if isinstance(message, str) or not message:
            raise Internal("the runtime stream sent a message that is not a binary frame")
        kind, payload = message[0], message[1:]
        if kind == KIND_OUT:
            return ExecEvent("stdout", payload)
        if kind == KIND_ERR:
            return ExecEvent("stderr", payload)
        if kind != KIND_JSON:
            raise Internal(f"the runtime stream sent an unexpected frame kind {kind:#x}")
        try:
            obj = json.loads(payload)
        except ValueError:
            raise Internal("the runtime stream sent invalid JSON") from None
        if not isinstance(obj, dict):
            raise Internal("the runtime stream sent JSON that is not an object")
        return self._json(obj)

    def _json(self, obj: JSON) -> ExecEvent | None:
        if "event" in obj:
            self.events.append(obj)
            if obj["event"] == "started" and isinstance(obj.get("pid"), int):
                self.pid = obj["pid"]
            return None
        if "error" in obj:
            self.done = True
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            raise error_from_wire(str(err.get("code", "internal")), str(err.get("message", "")))
        if "result" in obj:
            self.done = True
            res = obj["result"] if isinstance(obj["result"], dict) else {}
            self.result = res
            code, sig = res.get("exit_code"), res.get("signal")
            ms = res.get("duration_ms")
            return ExecEvent(
                "exit",
                exit_code=code if isinstance(code, int) else None,
                signal=sig if isinstance(sig, int) else None,
                timed_out=bool(res.get("timed_out", False)),
                duration_ms=float(ms) if isinstance(ms, int | float) else None,
            )
        raise Internal(f"the runtime stream sent an unknown JSON frame: {sorted(obj)}")

    def closed_early(self, reason: str = "") -> DsecError:
        """The error for a stream that ended before its final frame."""
        why = f" ({reason})" if reason else ""
        return Unavailable(f"the runtime stream closed before the call finished{why}")
