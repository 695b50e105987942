"""The code-interpreter HTTP service that runs inside the ``code-interpreter`` image.

It speaks what ``e2b_code_interpreter`` sends to port 49999 (see docs/images.md):

- ``POST /execute`` ``{code, context_id?, language?, env_vars?}`` answers NDJSON lines:
  ``stdout``/``stderr`` ``{text, timestamp}``, ``number_of_executions``, ``result`` (the
  MIME bundle as ``text``/``html``/``png``/... with ``is_main_result``), ``error``
  ``{name, value, traceback}``, then ``end_of_execution``;
- ``POST /contexts`` ``{language?, cwd?}``, ``GET /contexts``, ``DELETE /contexts/ID``,
  ``POST /contexts/ID/restart``; ``GET /health``.

Each context is one Jupyter kernel (``jupyter_client``, ipykernel's ``python3``); the
default Python context starts with the server. Only this file's standard-library imports
and ``jupyter_client`` are used; it runs under the image's own ``python3``.

    python3 server.py [--host 0.0.0.0] [--port 49999] [--cwd DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
LANGUAGES = ("python",)


class Context:
    """One kernel; executions in it run one at a time."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = uuid.uuid4().hex
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.km: Any = None
        self.kc: Any = None
        self.start()

    def start(self) -> None:
        # Imported here so that the port opens before the (slow) import.
        from jupyter_client.manager import KernelManager  # type: ignore[import-not-found]

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=self.cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def run(self, code: str, env: dict[str, str] | None, emit: Any) -> None:
        """Execute ``code``; call ``emit`` with every output line (dicts)."""
        with self.lock:
            if env:
                self._quiet(f"import os as _o; _o.environ.update({json.dumps(env)}); del _o")
            msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
            while True:
                try:
                    msg = self.kc.get_iopub_msg(timeout=3600)
                except queue.Empty:
                    emit({"type": "unexpected_end_of_execution"})
                    return
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    emit({"type": content["name"], "text": content["text"], "timestamp": _now()})
                elif kind == "execute_input":
                    count = content.get("execution_count")
                    emit({"type": "number_of_executions", "execution_count": count})
                elif kind in ("execute_result", "display_data"):
                    emit(_result(content.get("data", {}), kind == "execute_result"))
                elif kind == "error":
                    emit(
                        {
                            "type": "error",
                            "name": content.get("ename", ""),
                            "value": content.get("evalue", ""),
                            "traceback": "\n".join(content.get("traceback", [])),
                        }
                    )
                elif kind == "status" and content.get("execution_state") == "idle":
                    emit({"type": "end_of_execution"})
                    return

    def _quiet(self, code: str) -> None:
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        while True:
            msg = self.kc.get_iopub_msg(timeout=60)
            mine = msg["parent_header"].get("msg_id") == msg_id
            if mine and msg["content"].get("execution_state") == "idle":
                return


def _now() -> int:
    return time.time_ns()


def _result(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        key = MIME_KEYS.get(mime)
        if key is not None:
            out[key] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out


class Contexts:
    def __init__(self, cwd: str) -> None:
        self.cwd = cwd
        self.lock = threading.Lock()
        self.items: dict[str, Context] = {}
        self.defaults: dict[str, Context] = {}
        self.ready = threading.Event()

    def start_default(self) -> None:
        ctx = Context("python", self.cwd)
        with self.lock:
            self.items[ctx.id] = ctx
            self.defaults["python"] = ctx
        self.ready.set()

    def create(self, language: str, cwd: str) -> Context:
        ctx = Context(language, cwd or self.cwd)
        with self.lock:
            self.items[ctx.id] = ctx
        return ctx

    def get(self, context_id: str) -> Context | None:
        with self.lock:
            return self.items.get(context_id)

    def remove(self, context_id: str) -> bool:
        with self.lock:
            ctx = self.items.pop(context_id, None)
        if ctx is None:
            return False
        ctx.stop()
        return True


class Handler(BaseHTTPRequestHandler):
    server_version = "dsec-code-interpreter/1"
    contexts: Contexts

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": message})

    def _body(self) -> dict[str, Any]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = b""
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                raw += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers, then the blank line
                pass
        else:
            size = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(size) if size else b"{}"
        value = json.loads(raw or b"{}")
        return value if isinstance(value, dict) else {}

    def do_GET(self) -> None:
        if self.path == "/health":
            data = b'"OK"'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/contexts":
            with self.contexts.lock:
                items = [c.describe() for c in self.contexts.items.values()]
            self._json(200, items)
        else:
            self._error(404, f"no route {self.path}")

    def do_DELETE(self) -> None:
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts" and self.contexts.remove(parts[1]):
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._error(404, f"no context {self.path}")

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError:
            self._error(400, "the body is not JSON")
            return
        parts = self.path.strip("/").split("/")
        if parts == ["execute"]:
            self._execute(body)
        elif parts == ["contexts"]:
            language = body.get("language") or "python"
            if language not in LANGUAGES:
                self._error(400, f"language {language!r} is not supported (only python)")
                return
            self._json(200, self.contexts.create(language, body.get("cwd") or "").describe())
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            ctx = self.contexts.get(parts[1])
            if ctx is None:
                self._error(404, f"no context {parts[1]}")
                return
            with ctx.lock:
                ctx.km.restart_kernel(now=True)
                ctx.kc.wait_for_ready(timeout=120)
            self._json(200, ctx.describe())
        else:
            self._error(404, f"no route {self.path}")

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            self._error(400, "'code' must be a string")
            return
        self.contexts.ready.wait(timeout=180)
        context_id = body.get("context_id")
        if context_id:
            ctx = self.contexts.get(str(context_id))
            if ctx is None:
                self._error(404, f"context {context_id} not found")
                return
        else:
            language = body.get("language") or "python"
            found = self.contexts.defaults.get(language)
            if found is None:
                self._error(400, f"language {language!r} is not supported (only python)")
                return
            ctx = found
        env = body.get("env_vars")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Connection", "close")
        self.end_headers()

        def emit(obj: dict[str, Any]) -> None:
            self.wfile.write(json.dumps(obj).encode() + b"\n")
            self.wfile.flush()

        ctx.run(code, env if isinstance(env, dict) else None, emit)
        self.close_connection = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=49999)
    parser.add_argument("--cwd", default=os.environ.get("HOME", "/"))
    args = parser.parse_args()
    contexts = Contexts(args.cwd)
    Handler.contexts = contexts
    threading.Thread(target=contexts.start_default, daemon=True).start()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
