"""The records the SDK hands to its users, each parsed from the JSON the HTTP API answers.

Parsers accept unknown fields (the server may grow) but reject answers missing the fields
a record cannot exist without, as :class:`~dsec.core.errors.Internal`.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple

from dsec.core.errors import DsecError, Internal, error_from_wire

JSON = dict[str, Any]


def _req(obj: Mapping[str, Any], key: str, what: str) -> Any:
    try:
        return obj[key]
    except (KeyError, TypeError):
        raise Internal(f"malformed {what} from the server: missing {key!r}") from None


def _time(value: Any) -> datetime | None:
    """Accept epoch seconds or ISO 8601 strings; 0 (an unset proto field) and junk are None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC) if value > 0 else None
    if isinstance(value, str) and value:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any, encoding: str | None) -> str:
    if value is None:
        return ""
    if encoding == "base64" and isinstance(value, str):
        return base64.b64decode(value).decode("utf-8", "replace")
    return str(value)


def to_jsonable(record: Any) -> Any:
    """Turn a record (or list of records) into JSON-ready data; datetimes become ISO text."""
    if isinstance(record, list | tuple) and not hasattr(record, "_fields"):
        return [to_jsonable(r) for r in record]
    if isinstance(record, DsecError):
        return record.to_wire()
    if hasattr(record, "__dataclass_fields__"):
        return to_jsonable(asdict(record))
    if isinstance(record, dict):
        return {k: to_jsonable(v) for k, v in record.items()}
    if isinstance(record, datetime):
        return record.isoformat()
    if isinstance(record, bytes):
        return record.decode("utf-8", "replace")
    return record


@dataclass(frozen=True, slots=True)
class SpecInfo:
    """The resources and image a sandbox was created with."""

    backend: str
    image: str
    cpu: float
    memory_mb: int
    pids: int | None
    timeout_s: int
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    network: dict[str, list[str]] = field(default_factory=dict)  # {"allow": [...], "deny": [...]}
    on_timeout: str = "kill"  # or "pause": what the edge does when the timeout passes

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> SpecInfo:
        return cls(
            backend=str(obj.get("backend", "")),
            image=str(obj.get("image", "")),
            cpu=float(obj.get("cpu") or 0.0),
            memory_mb=int(obj.get("memory_mb") or 0),
            pids=_opt_int(obj.get("pids")),
            timeout_s=int(obj.get("timeout_s") or 0),
            env=dict(obj.get("env") or {}),
            metadata=dict(obj.get("metadata") or {}),
            network={k: list(v) for k, v in dict(obj.get("network") or {}).items()},
            on_timeout=str(obj.get("on_timeout") or "kill"),
        )


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    """What the platform knows about one sandbox."""

    id: str
    state: str
    project: str = ""
    owner: str = ""
    edge_id: str = ""
    created_at: datetime | None = None
    started_at: datetime | None = None
    expires_at: datetime | None = None
    error: str | None = None
    spec: SpecInfo | None = None
    network_stats: dict[str, int] = field(default_factory=dict)  # allowed/denied traffic
    moved_to: str | None = None  # ended by resuming on another edge: the id it runs as there

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> SandboxInfo:
        err = obj.get("error")
        if isinstance(err, Mapping):
            err = f"{err.get('code', 'error')}: {err.get('message', '')}"
        spec = obj.get("spec")
        return cls(
            id=str(_req(obj, "id", "sandbox")),
            state=str(_req(obj, "state", "sandbox")),
            project=str(obj.get("project") or ""),
            owner=str(obj.get("owner") or ""),
            edge_id=str(obj.get("edge_id") or ""),
            created_at=_time(obj.get("created_at")),
            started_at=_time(obj.get("started_at")),
            expires_at=_time(obj.get("expires_at")),
            error=str(err) if err else None,
            spec=SpecInfo.from_wire(spec) if isinstance(spec, Mapping) else None,
            network_stats={k: int(v) for k, v in dict(obj.get("network_stats") or {}).items()},
            moved_to=str(obj.get("moved_to") or "") or None,
        )


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A named snapshot of a sandbox: ``mode`` ``full`` (memory, processes and disk;
    microvm) or ``filesystem`` (the files only; container)."""

    id: str
    name: str = ""
    project: str = ""
    owner: str = ""
    source_sandbox: str = ""
    backend: str = ""
    mode: str = ""
    size_bytes: int = 0
    edge_id: str = ""
    created_at: datetime | None = None
    spec: SpecInfo | None = None

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> SnapshotInfo:
        spec = obj.get("spec")
        return cls(
            id=str(_req(obj, "id", "snapshot")),
            name=str(obj.get("name") or ""),
            project=str(obj.get("project") or ""),
            owner=str(obj.get("owner") or ""),
            source_sandbox=str(obj.get("source_sandbox") or ""),
            backend=str(obj.get("backend") or ""),
            mode=str(obj.get("mode") or ""),
            size_bytes=int(obj.get("size_bytes") or 0),
            edge_id=str(obj.get("edge_id") or ""),
            created_at=_time(obj.get("created_at")),
            spec=SpecInfo.from_wire(spec) if isinstance(spec, Mapping) else None,
        )


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of a finished command; ``ok`` is true for exit code 0 in time."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None = None
    duration_ms: float = 0.0
    truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False  # killed for exceeding the call's memory limit (function)
    files: dict[str, bytes] = field(default_factory=dict)  # the ``outputs`` asked for

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> ExecResult:
        encoding = obj.get("encoding")
        return cls(
            stdout=_text(obj.get("stdout"), encoding),
            stderr=_text(obj.get("stderr"), encoding),
            exit_code=_opt_int(obj.get("exit_code")),
            signal=_opt_int(obj.get("signal")),
            duration_ms=float(obj.get("duration_ms") or 0.0),
            truncated=bool(obj.get("truncated", False)),
            timed_out=bool(obj.get("timed_out", False)),
            oom_killed=bool(obj.get("oom_killed", False)),
            files={
                str(f["path"]): base64.b64decode(str(f.get("data") or ""))
                for f in obj.get("files") or []
                if isinstance(f, Mapping) and "path" in f
            },
        )


@dataclass(frozen=True, slots=True)
class ExecEvent:
    """One piece of a streamed command: an output chunk, or the final ``exit``.

    ``kind`` is ``stdout`` or ``stderr`` (``data`` holds the bytes) or ``exit`` (the last
    event: ``exit_code``, ``signal``, ``timed_out`` are set).
    """

    kind: Literal["stdout", "stderr", "exit"]
    data: bytes = b""
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    duration_ms: float | None = None

    @property
    def returncode(self) -> int:
        """The exit code, or minus the signal number like ``subprocess`` (exit events)."""
        if self.exit_code is not None:
            return self.exit_code
        return -self.signal if self.signal else -1


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file, directory or link inside the sandbox."""

    name: str
    path: str
    type: str
    size: int = 0
    mode: int = 0
    mtime: datetime | None = None
    uid: int = 0
    gid: int = 0
    target: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> FileEntry:
        target = obj.get("target")
        return cls(
            name=str(_req(obj, "name", "file entry")),
            path=str(_req(obj, "path", "file entry")),
            type=str(_req(obj, "type", "file entry")),
            size=int(obj.get("size") or 0),
            mode=int(obj.get("mode") or 0),
            mtime=_time(obj.get("mtime")),
            uid=int(obj.get("uid") or 0),
            gid=int(obj.get("gid") or 0),
            target=str(target) if target is not None else None,
        )


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A background process (or PTY) kept by the sandbox's process keeper."""

    pid: int
    cmd: str | list[str] = ""
    tag: str | None = None
    pty: bool = False
    running: bool = True
    exit_code: int | None = None
    started_at: datetime | None = None

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> ProcessInfo:
        cmd = obj.get("cmd", "")
        tag = obj.get("tag")
        return cls(
            pid=int(_req(obj, "pid", "process")),
            cmd=[str(c) for c in cmd] if isinstance(cmd, list) else str(cmd),
            tag=str(tag) if tag is not None else None,
            pty=bool(obj.get("pty")),
            running=bool(obj.get("running", True)),
            exit_code=_opt_int(obj.get("exit_code")),
            started_at=_time(obj.get("started_at")),
        )


@dataclass(frozen=True, slots=True)
class ShellSession:
    """A persistent shell session (its cwd, env and background jobs survive between runs)."""

    name: str
    pid: int | None = None
    cwd: str | None = None
    busy: bool = False

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> ShellSession:
        cwd = obj.get("cwd")
        return cls(
            name=str(_req(obj, "name", "shell session")),
            pid=_opt_int(obj.get("pid")),
            cwd=str(cwd) if cwd is not None else None,
            busy=bool(obj.get("busy", False)),
        )


class HttpResponse(NamedTuple):
    """The answer of a server inside the sandbox; unpacks as ``(status, headers, body)``."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Identity:
    """Who an API key belongs to."""

    subject: str
    project: str
    role: str
    key_id: str

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Identity:
        return cls(
            subject=str(obj.get("subject", "")),
            project=str(obj.get("project", "")),
            role=str(obj.get("role", "")),
            key_id=str(obj.get("key_id", "")),
        )


@dataclass(frozen=True, slots=True)
class NewKey:
    """A freshly created API key; ``api_key`` is shown only this once."""

    api_key: str
    key_id: str


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """An API key as listed (never includes the secret); ``extra`` holds other fields."""

    key_id: str
    subject: str = ""
    project: str = ""
    role: str = ""
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> KeyInfo:
        known = ("key_id", "subject", "project", "role", "name")
        return cls(
            key_id=str(_req(obj, "key_id", "key")),
            subject=str(obj.get("subject") or ""),
            project=str(obj.get("project") or ""),
            role=str(obj.get("role") or ""),
            name=str(obj.get("name") or ""),
            extra={k: v for k, v in obj.items() if k not in known},
        )


@dataclass(frozen=True, slots=True)
class AccessToken:
    """A short-lived access token; use it wherever an API key goes (``api_key=``)."""

    token: str
    token_id: str
    expires_at: float

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> AccessToken:
        return cls(str(obj["token"]), str(obj["token_id"]), float(obj["expires_at"]))


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One entry of the audit log (see ``dsec.core.audit`` for the hash chain)."""

    seq: int
    ts: float
    actor: str
    action: str
    project: str
    target: str
    result: str
    request_id: str
    details: str
    hash: str

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> AuditEntry:
        return cls(
            seq=int(obj["seq"]), ts=float(obj["ts"]), actor=str(obj.get("actor", "")),
            action=str(obj.get("action", "")), project=str(obj.get("project", "")),
            target=str(obj.get("target", "")), result=str(obj.get("result", "")),
            request_id=str(obj.get("request_id", "")), details=str(obj.get("details", "")),
            hash=str(obj.get("hash", "")),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class WriteResult:
    """Where a file was written and its size afterwards."""

    path: str
    size: int


@dataclass(frozen=True, slots=True)
class BatchResult:
    """The outcome of a batch action for one sandbox: ``sandbox`` when ``ok``, else
    ``error`` (the same error a single call would have raised)."""

    id: str
    ok: bool
    sandbox: SandboxInfo | None = None
    error: DsecError | None = None

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> BatchResult:
        err = obj.get("error")
        error = (
            error_from_wire(str(err.get("code", "")), str(err.get("message", "")))
            if isinstance(err, Mapping)
            else None
        )
        sbx = obj.get("sandbox")
        return cls(
            id=str(obj.get("id", "")),
            ok=bool(obj.get("ok")),
            sandbox=SandboxInfo.from_wire(sbx) if isinstance(sbx, Mapping) else None,
            error=error,
        )
