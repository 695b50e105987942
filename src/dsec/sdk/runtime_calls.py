"""Sans-I/O builders for the runtime calls of one sandbox: exec, files, processes, shells, ports.

Each function validates its arguments and returns a :class:`~dsec.sdk.wire.Call` (or, for
streamed bodies, a :class:`~dsec.sdk.wire.Request`); the sync and async shells send them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import quote

from dsec.core.errors import DeadlineExceeded, DsecError, InvalidArgument, error_from_wire
from dsec.sdk.errors import CommandTimeout
from dsec.sdk.models import (
    JSON,
    ExecResult,
    FileEntry,
    HttpResponse,
    ProcessInfo,
    ShellSession,
    WriteResult,
)
from dsec.sdk.wire import (
    DEFAULT_TIMEOUT_S,
    EXEC_MARGIN_S,
    Call,
    Request,
    compact,
    ignore_body,
    json_request,
    sandbox_path,
)

Command = str | Sequence[str]

SIGKILL = 9
DEFAULT_TERM = "xterm-256color"
# A login shell: bash when the image has it, else sh.
DEFAULT_PTY_CMD = "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi"


def check_cmd(cmd: Command) -> str | list[str]:
    """A command is a non-empty string (run by ``/bin/sh -c``) or a non-empty argv list."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("command must not be empty")
        return cmd
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise InvalidArgument("command must be a string or a non-empty list of strings")
    return argv


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise InvalidArgument(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timeout


def read_timeout(timeout: float | None) -> float | None:
    """How long to wait for the answer of a command that may run ``timeout`` seconds."""
    return None if timeout is None else timeout + EXEC_MARGIN_S


def _command_parser(
    timeout: float | None, encoding: str | None = None
) -> Callable[[JSON], ExecResult]:
    def parse(obj: JSON) -> ExecResult:
        result = ExecResult.from_wire({**obj, "encoding": encoding} if encoding else obj)
        if result.timed_out:
            after = f" after {timeout:g} s" if timeout else ""
            raise CommandTimeout(f"command timed out{after}", result)
        return result

    return parse


def _timeout_refiner(
    encoding: str | None = None,
) -> Callable[[DsecError, JSON], DsecError]:
    def refine(exc: DsecError, body: JSON) -> DsecError:
        partial = body.get("result")
        if isinstance(exc, DeadlineExceeded) and isinstance(partial, dict):
            fields = {**partial, "timed_out": True}
            if encoding:
                fields["encoding"] = encoding
            return CommandTimeout(exc.message, ExecResult.from_wire(fields))
        return exc

    return refine


def _path(sandbox_id: str, tail: str) -> str:
    return f"{sandbox_path(sandbox_id)}/{tail}"


# -- exec -----------------------------------------------------------------------------------


def exec_command(
    sandbox_id: str,
    cmd: Command,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    timeout: float | None = 60,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    outputs: Sequence[str] | None = None,
    memory_mb: int | None = None,
) -> Call[ExecResult]:
    """``POST .../exec``: run a command to completion and collect its output."""
    timeout = check_timeout(timeout)
    body = compact(
        cmd=check_cmd(cmd),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        user=user,
        timeout=timeout,
        files=_files_in(files) if files is not None else None,
        outputs=list(outputs) if outputs is not None else None,
        memory_mb=memory_mb,
    )
    encoding = None
    if isinstance(stdin, bytes | bytearray | memoryview):
        raw = bytes(stdin)
        try:
            body["stdin"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            # Binary stdin: the API then also answers stdout/stderr in base64.
            body["stdin"] = base64.b64encode(raw).decode()
            body["encoding"] = encoding = "base64"
    elif stdin is not None:
        body["stdin"] = str(stdin)
    req = json_request("POST", _path(sandbox_id, "exec"), body, timeout=read_timeout(timeout))
    return Call(req, _command_parser(timeout, encoding), _timeout_refiner(encoding))


def _files_in(files: Mapping[str, str | bytes]) -> list[dict[str, str]]:
    out = []
    for path, data in files.items():
        raw = data.encode() if isinstance(data, str) else bytes(data)
        out.append({"path": _check_path(path), "data": base64.b64encode(raw).decode()})
    return out


# -- files ----------------------------------------------------------------------------------


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidArgument(f"invalid path {path!r}")
    return path


def read_file(sandbox_id: str, path: str) -> Request:
    """``GET .../files``: the body is the file's bytes (send it streamed)."""
    params = (("path", _check_path(path)),)
    return Request("GET", _path(sandbox_id, "files"), params, timeout=DEFAULT_TIMEOUT_S)


def write_file(
    sandbox_id: str,
    path: str,
    *,
    mode: int | None = None,
    parents: bool = True,
    append: bool = False,
) -> Call[WriteResult]:
    """``PUT .../files``: the shell supplies the (streamed) body; ``mode`` goes as octal."""
    params: list[tuple[str, str]] = [("path", _check_path(path))]
    if mode is not None:
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"mode must be an integer permission such as 0o644, got {mode!r}")
        params.append(("mode", format(mode, "o")))
    if parents:
        params.append(("parents", "1"))
    if append:
        params.append(("append", "1"))
    headers = (("Content-Type", "application/octet-stream"),)
    req = Request("PUT", _path(sandbox_id, "files"), tuple(params), None, headers, None)
    return Call(req, lambda o: WriteResult(str(o.get("path", path)), int(o.get("size") or 0)))


def stat_file(sandbox_id: str, path: str) -> Call[FileEntry]:
    params = (("path", _check_path(path)),)
    return Call(
        json_request("GET", _path(sandbox_id, "files/stat"), params=params), FileEntry.from_wire
    )


def _entries(obj: JSON) -> list[FileEntry]:
    return [FileEntry.from_wire(e) for e in obj.get("entries") or []]


def list_files(sandbox_id: str, path: str, depth: int = 1) -> Call[list[FileEntry]]:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InvalidArgument(f"depth must be an integer >= 1, got {depth!r}")
    params = (("path", _check_path(path)), ("depth", str(depth)))
    return Call(json_request("GET", _path(sandbox_id, "files/list"), params=params), _entries)


def make_dir(sandbox_id: str, path: str, parents: bool = True) -> Call[FileEntry]:
    body = {"path": _check_path(path), "parents": parents}
    return Call(json_request("POST", _path(sandbox_id, "files/mkdir"), body), FileEntry.from_wire)


def remove_file(sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
    body = {"path": _check_path(path), "recursive": recursive}
    return Call(json_request("POST", _path(sandbox_id, "files/remove"), body), ignore_body)


def rename_file(sandbox_id: str, src: str, dst: str) -> Call[FileEntry]:
    body = {"src": _check_path(src), "dst": _check_path(dst)}
    return Call(json_request("POST", _path(sandbox_id, "files/rename"), body), FileEntry.from_wire)


# -- processes and PTYs ---------------------------------------------------------------------


def _check_pid(pid: int) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgument(f"pid must be a positive integer, got {pid!r}")
    return pid


def start_process(
    sandbox_id: str,
    cmd: Command,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
    tag: str | None = None,
    pty: tuple[int, int] | None = None,
) -> Call[ProcessInfo]:
    """``POST .../processes``: start a background process (a PTY when ``pty=(cols, rows)``)."""
    argv = check_cmd(cmd)
    size = None
    if pty is not None:
        cols, rows = check_size(*pty)
        size = {"cols": cols, "rows": rows}
    body = compact(
        cmd=argv, env=dict(env) if env is not None else None, cwd=cwd, user=user, tag=tag, pty=size
    )

    def parse(obj: JSON) -> ProcessInfo:
        return ProcessInfo(pid=int(obj["pid"]), cmd=argv, tag=tag, pty=size is not None)

    return Call(json_request("POST", _path(sandbox_id, "processes"), body), parse)


def _processes(obj: JSON) -> list[ProcessInfo]:
    return [ProcessInfo.from_wire(p) for p in obj.get("processes") or []]


def list_processes(sandbox_id: str) -> Call[list[ProcessInfo]]:
    return Call(json_request("GET", _path(sandbox_id, "processes")), _processes)


def signal_process(sandbox_id: str, pid: int, sig: int) -> Call[None]:
    num = int(sig)
    if not 1 <= num <= 64:
        raise InvalidArgument(f"signal must be between 1 and 64, got {sig!r}")
    path = _path(sandbox_id, f"processes/{_check_pid(pid)}/signal")
    return Call(json_request("POST", path, {"signal": num}), ignore_body)


def send_input(sandbox_id: str, pid: int, data: bytes | str) -> Call[None]:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    path = _path(sandbox_id, f"processes/{_check_pid(pid)}/input")
    headers = (("Content-Type", "application/octet-stream"),)
    return Call(Request("POST", path, (), raw, headers), ignore_body)


def check_size(cols: int, rows: int) -> tuple[int, int]:
    for name, v in (("cols", cols), ("rows", rows)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 10000:
            raise InvalidArgument(f"{name} must be an integer between 1 and 10000, got {v!r}")
    return cols, rows


def pty_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """A PTY's environment: ``TERM`` set unless the caller sets it."""
    return {"TERM": DEFAULT_TERM, **(env or {})}


def resize_pty(sandbox_id: str, pid: int, cols: int, rows: int) -> Call[None]:
    cols, rows = check_size(cols, rows)
    path = _path(sandbox_id, f"processes/{_check_pid(pid)}/resize")
    return Call(json_request("POST", path, {"cols": cols, "rows": rows}), ignore_body)


# -- persistent shells ----------------------------------------------------------------------


def check_shell_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 128 or "\0" in name:
        raise InvalidArgument(f"invalid shell session name {name!r}")
    return name


def _shell_path(sandbox_id: str, name: str) -> str:
    return _path(sandbox_id, f"shells/{quote(check_shell_name(name), safe='')}")


def run_in_shell(
    sandbox_id: str,
    name: str,
    cmd: str,
    *,
    timeout: float | None = 60,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | int | None = None,
) -> Call[ExecResult]:
    """``POST .../shells/{name}/run``: run ``cmd`` in the named persistent shell session."""
    if not isinstance(cmd, str):
        raise InvalidArgument("a shell command must be a string")
    timeout = check_timeout(timeout)
    body = compact(
        cmd=check_cmd(cmd),
        timeout=timeout,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        user=user,
    )
    path = _shell_path(sandbox_id, name) + "/run"
    req = json_request("POST", path, body, timeout=read_timeout(timeout))
    return Call(req, _command_parser(timeout), _timeout_refiner())


def _sessions(obj: JSON) -> list[ShellSession]:
    return [ShellSession.from_wire(s) for s in obj.get("sessions") or []]


def list_shells(sandbox_id: str) -> Call[list[ShellSession]]:
    return Call(json_request("GET", _path(sandbox_id, "shells")), _sessions)


def close_shell(sandbox_id: str, name: str) -> Call[None]:
    return Call(json_request("DELETE", _shell_path(sandbox_id, name)), ignore_body)


# -- ports ----------------------------------------------------------------------------------


def port_request(
    sandbox_id: str,
    port: int,
    method: str = "GET",
    path: str = "/",
    headers: Mapping[str, str] | None = None,
    body: bytes | str | None = None,
    timeout: float | None = 60,
) -> Request:
    """A request to a server listening on ``port`` inside the sandbox (query kept in ``path``)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgument(f"port must be between 1 and 65535, got {port!r}")
    if not method.isalpha():
        raise InvalidArgument(f"invalid HTTP method {method!r}")
    raw = body.encode() if isinstance(body, str) else body
    hdrs = tuple((str(k), str(v)) for k, v in (headers or {}).items())
    url = _path(sandbox_id, f"ports/{port}/{path.lstrip('/')}")
    return Request(method.upper(), url, (), raw, hdrs, check_timeout(timeout))


def port_response(status: int, headers: Sequence[tuple[str, str]], content: bytes) -> HttpResponse:
    """The sandbox server's answer, unless the platform itself refused the request.

    The platform's own errors are recognised by an ``X-Dsec-Error`` header, or (for the
    statuses it uses when it cannot forward) a body that is exactly a dsec error object.
    """
    merged: dict[str, str] = {}
    for k, v in headers:
        key = k.lower()
        merged[key] = f"{merged[key]}, {v}" if key in merged else v
    platform = "x-dsec-error" in merged
    if not platform and status in (401, 403, 404, 502, 503, 504):
        platform = _is_dsec_error(content)
    if platform:
        try:
            err = json.loads(content)["error"]
            raise error_from_wire(str(err["code"]), str(err.get("message", "")))
        except (ValueError, KeyError, TypeError):
            pass
    return HttpResponse(status, merged, content)


def _is_dsec_error(content: bytes) -> bool:
    try:
        obj = json.loads(content)
    except ValueError:
        return False
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return False
    err = obj["error"]
    return set(err) <= {"code", "message", "details"} and isinstance(err.get("code"), str)
