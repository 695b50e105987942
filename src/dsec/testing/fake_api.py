"""An in-memory fake of the public HTTP API, for SDK and CLI tests.

:class:`FakeApi` answers like the apiserver (``docs/http-api.md``) from dicts, as an
``httpx.MockTransport`` handler (sync and async); ``fake_runtime.FakeRuntimeServer`` serves
the runtime WebSocket of the same sandboxes. Nothing runs: commands go to a tiny interpreter,
one ``;``-separated step at a time (``tests/e2e`` runs the same SDK calls against the real
platform, so the fake is checked against the real thing)::

    echo TEXT   stdout "TEXT\\n"          err TEXT   stderr "TEXT\\n"
    cat         stdout = stdin              exit N     stop with exit code N
    sleep S     times out if S > timeout (partial output kept), else nothing
    kill N      stop as killed by signal N
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx

JSON = dict[str, Any]
FAKE_KEY = "dsk_fakefakefake_" + "k" * 43
ERROR_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "not_found": 404,
    "sandbox_not_found": 404,
    "process_not_found": 404,
    "deadline_exceeded": 504,
    "permission_denied": 403,
    "unavailable": 503,
}


class FakeError(Exception):
    def __init__(self, code: str, message: str, extra: JSON | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra or {}


@dataclass
class Outcome:
    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int | None = 0
    signal: int | None = None
    timed_out: bool = False

    def wire(self) -> JSON:
        return {
            "exit_code": self.exit_code,
            "signal": self.signal,
            "timed_out": self.timed_out,
            "duration_ms": 1.5,
            "stdout": self.stdout.decode(errors="replace"),
            "stderr": self.stderr.decode(errors="replace"),
            "truncated": False,
        }


def interpret(cmd: str | list[str], stdin: bytes = b"", timeout: float | None = None) -> Outcome:
    """Run the fake command language (see the module docstring)."""
    text = cmd if isinstance(cmd, str) else " ".join(cmd)
    out = Outcome()
    for step in (s.strip() for s in text.split(";")):
        word, _, arg = step.partition(" ")
        if word == "echo":
            out.stdout += arg.encode() + b"\n"
        elif word == "err":
            out.stderr += arg.encode() + b"\n"
        elif word == "cat":
            out.stdout += stdin
        elif word == "exit":
            out.exit_code = int(arg)
            break
        elif word == "kill":
            out.exit_code, out.signal = None, int(arg)
            break
        elif word == "sleep" and timeout is not None and float(arg) > timeout:
            out.exit_code, out.signal, out.timed_out = None, 9, True
            break
    return out


@dataclass
class FakeSandbox:
    info: JSON
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/root"})
    processes: dict[int, JSON] = field(default_factory=dict)
    shells: dict[str, JSON] = field(default_factory=dict)


class FakeApi:
    """The apiserver's HTTP answers from memory; ``requests`` records what it was sent."""

    def __init__(self, api_key: str = FAKE_KEY) -> None:
        self.api_key = api_key
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.requests: list[httpx.Request] = []
        self.keys: dict[str, JSON] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add_sandbox(self, state: str = "running", **spec: Any) -> str:
        sid = f"sbx-e0a1-{next(self._ids):020d}".replace("0", "a")
        spec = {
            "backend": "container",
            "image": "base",
            "cpu": 1.0,
            "memory_mb": 512,
            "pids": 1024,
            "timeout_s": 300,
            "env": {},
            "metadata": {},
            **spec,
        }
        self.sandboxes[sid] = FakeSandbox(
            {
                "id": sid,
                "project": "p",
                "owner": "alice",
                "state": state,
                "edge_id": "e0a1",
                "created_at": 1_700_000_000.0,
                "started_at": 1_700_000_001.0,
                "expires_at": 1_700_000_300.0,
                "error": None,
                "spec": spec,
            }
        )
        return sid

    def sandbox(self, sid: str) -> FakeSandbox:
        sbx = self.sandboxes.get(sid)
        if sbx is None:
            raise FakeError("sandbox_not_found", f"no sandbox {sid!r}")
        return sbx

    def start_process(self, sid: str, cmd: Any, pty: JSON | None = None, tag: Any = None) -> int:
        sbx = self.sandbox(sid)
        pid = 100 + len(sbx.processes)
        sbx.processes[pid] = {
            "pid": pid,
            "cmd": cmd,
            "tag": tag,
            "pty": pty is not None,
            "running": True,
            "exit_code": None,
            "started_at": 1.7e9,
            "output": b"$ ",
            "size": pty,
            "input": b"",
        }
        return pid

    # -- httpx.MockTransport handlers --------------------------------------------------------

    def handler(self, request: httpx.Request) -> httpx.Response:
        request.read()
        with self._lock:
            self.requests.append(request)
            try:
                if request.headers.get("authorization") != f"Bearer {self.api_key}":
                    raise FakeError("unauthenticated", "missing or invalid API key")
                return self._route(request)
            except FakeError as exc:
                body = {"error": {"code": exc.code, "message": exc.message}, **exc.extra}
                return httpx.Response(ERROR_STATUS.get(exc.code, 500), json=body)

    async def async_handler(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return self.handler(request)

    def _route(self, req: httpx.Request) -> httpx.Response:
        parts = [unquote(p) for p in req.url.path.split("/")[2:]]  # after /v1
        m, q = req.method, req.url.params
        body: JSON = (
            json.loads(req.content) if req.headers.get("content-type") == "application/json" else {}
        )
        if parts == ["whoami"]:
            return _ok({"subject": "alice", "project": "p", "role": "admin", "key_id": "k1"})
        if parts[0] == "keys":
            return self._keys(m, parts, body)
        if parts == ["sandboxes"]:
            if m == "POST":
                sid = self.add_sandbox(**body)
                return _ok(self.sandboxes[sid].info, 201)
            rows = [
                s.info
                for s in self.sandboxes.values()
                if q.get("all") == "1" or s.info["state"] == "running"
            ]
            return _ok({"sandboxes": rows})
        if parts == ["sandboxes:batch"]:
            return _ok({"results": self._batch(body)})
        sbx = self.sandbox(parts[1])
        rest, info = parts[2:], sbx.info
        if not rest:
            if m == "DELETE":
                info["state"] = "stopped"
            return _ok(info)
        if rest == ["resume"] and body.get("edge"):  # a move: the same sandbox, a new id
            new = self.add_sandbox(**info["spec"])
            self.sandboxes[new].info["edge_id"] = body["edge"]
            del self.sandboxes[parts[1]]
            return _ok(self.sandboxes[new].info)
        if rest == ["timeout"]:
            info["expires_at"] = 1_700_000_000.0 + body["timeout_s"]
            return _ok(info)
        if rest == ["exec"]:
            stdin = body.get("stdin", "").encode()
            out = interpret(body["cmd"], stdin, body.get("timeout"))
            if out.timed_out:
                raise FakeError("deadline_exceeded", "command timed out", {"result": out.wire()})
            return _ok(out.wire())
        if rest[0] == "files":
            return self._files(sbx, m, rest[1:], q.get("path", ""), body, req.content)
        if rest[0] == "processes":
            return self._processes(sbx, parts[1], m, rest[1:], body, req.content)
        if rest[0] == "shells":
            return self._shells(sbx, m, rest[1:], body)
        if rest[0] == "ports":
            if rest[1] == "9":
                raise FakeError("unavailable", "nothing listens on port 9")
            echo = {
                "method": m,
                "path": "/" + "/".join(rest[2:]),
                "query": req.url.query.decode(),
                "body": req.content.decode(),
            }
            return httpx.Response(201, json=echo, headers={"x-app": "yes"})
        raise FakeError("not_found", f"no route {req.url.path}")

    def _batch(self, body: JSON) -> list[JSON]:
        after = {"kill": "stopped", "pause": "paused", "resume": "running"}[body["action"]]
        ids = body.get("ids")
        if ids is None:
            live = [s.info for s in self.sandboxes.values() if s.info["state"] != "stopped"]
            ids = [i["id"] for i in live if i["project"] == body["project"]]
        results: list[JSON] = []
        for sid in ids:
            try:
                info = self.sandbox(sid).info
            except FakeError as exc:
                results.append(
                    {"id": sid, "ok": False, "error": {"code": exc.code, "message": exc.message}}
                )
                continue
            info["state"] = after
            results.append({"id": sid, "ok": True, "sandbox": info})
        return results

    def _keys(self, m: str, parts: list[str], body: JSON) -> httpx.Response:
        if m == "POST":
            kid = f"key{len(self.keys) + 1}"
            self.keys[kid] = {"key_id": kid, **body}
            return _ok({"api_key": f"dsk_{kid}_secret", "key_id": kid}, 201)
        if m == "DELETE":
            if self.keys.pop(parts[1], None) is None:
                raise FakeError("not_found", f"no key {parts[1]!r}")
            return _ok({})
        return _ok({"keys": list(self.keys.values())})

    def _entry(self, sbx: FakeSandbox, path: str) -> JSON:
        if path in sbx.dirs:
            kind, size = "dir", 0
        elif path in sbx.files:
            kind, size = "file", len(sbx.files[path])
        else:
            raise FakeError("not_found", f"{path}: no such file or directory")
        return {
            "name": path.rsplit("/", 1)[-1] or "/",
            "path": path,
            "type": kind,
            "size": size,
            "mode": 0o644,
            "mtime": 1.7e9,
            "uid": 0,
            "gid": 0,
        }

    def _files(
        self, sbx: FakeSandbox, m: str, rest: list[str], path: str, body: JSON, raw: bytes
    ) -> httpx.Response:
        if not rest and m == "GET":
            if path in sbx.dirs:
                raise FakeError("invalid_argument", f"{path} is a directory")
            self._entry(sbx, path)
            return httpx.Response(200, content=sbx.files[path])
        if not rest and m == "PUT":
            sbx.files[path] = raw
            return _ok({"path": path, "size": len(raw)})
        op = rest[0]
        if op == "stat":
            return _ok(self._entry(sbx, path))
        if op == "list":
            self._entry(sbx, path)
            prefix = path.rstrip("/") + "/"
            names = {p for p in [*sbx.files, *sbx.dirs] if p.startswith(prefix) and p != prefix}
            kids = sorted(p for p in names if "/" not in p[len(prefix) :])
            return _ok({"entries": [self._entry(sbx, p) for p in kids]})
        if op == "mkdir":
            sbx.dirs.add(body["path"])
            return _ok(self._entry(sbx, body["path"]))
        if op == "remove":
            self._entry(sbx, body["path"])
            sbx.files.pop(body["path"], None)
            sbx.dirs.discard(body["path"])
            return _ok({})
        if op == "rename":
            sbx.files[body["dst"]] = sbx.files.pop(body["src"])
            return _ok(self._entry(sbx, body["dst"]))
        raise FakeError("not_found", f"no files op {op!r}")

    def _processes(
        self, sbx: FakeSandbox, sid: str, m: str, rest: list[str], body: JSON, raw: bytes
    ) -> httpx.Response:
        if not rest:
            if m == "POST":
                return _ok(
                    {"pid": self.start_process(sid, body["cmd"], body.get("pty"), body.get("tag"))}
                )
            rows = [
                {k: v for k, v in p.items() if k not in ("output", "size", "input")}
                for p in sbx.processes.values()
            ]
            return _ok({"processes": rows})
        proc = sbx.processes.get(int(rest[0]))
        if proc is None:
            raise FakeError("process_not_found", f"no process {rest[0]}")
        if rest[1] == "signal":
            proc.update(running=False, signal=body["signal"])
        elif rest[1] == "input":
            proc["input"] += raw
        elif rest[1] == "resize":
            proc["size"] = {"cols": body["cols"], "rows": body["rows"]}
        return _ok({})

    def _shells(self, sbx: FakeSandbox, m: str, rest: list[str], body: JSON) -> httpx.Response:
        if not rest:
            return _ok({"sessions": list(sbx.shells.values())})
        name = rest[0]
        if m == "DELETE":
            if sbx.shells.pop(name, None) is None:
                raise FakeError("not_found", f"no shell session {name!r}")
            return _ok({})
        sbx.shells.setdefault(name, {"name": name, "pid": 50, "cwd": "/root", "busy": False})
        out = interpret(body["cmd"], b"", body.get("timeout"))
        wire = out.wire()
        return _ok({k: wire[k] for k in ("exit_code", "timed_out", "stdout", "stderr")})


def _ok(obj: JSON, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=obj)
