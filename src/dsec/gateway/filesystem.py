"""envd's ``filesystem.Filesystem`` service on OpenDsec's file API.

``WatchDir`` is served by polling the directory (every :data:`WATCH_POLL_S`) and diffing:
it reports creations, writes (size or mtime changed) and removals; a rename shows as a
removal plus a creation. The sync SDK's watchers (``CreateWatcher``, ``GetWatcherEvents``,
``RemoveWatcher``) diff the same way between two polls; their last snapshot is kept as a
file inside the sandbox (under :data:`WATCHER_DIR`), so the gateway still keeps no state.

Entries are translated to envd's ``EntryInfo`` (proto3 JSON: camelCase, int64 as a
string, enums by name, RFC 3339 time, Go-style mode bits and permission string).
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import re
import secrets
import stat
import time
from datetime import UTC
from typing import Any

from dsec.core.errors import AlreadyExists, InvalidArgument, NotFound
from dsec.gateway.connect import ConnectError, ServerStream
from dsec.gateway.process import Call
from dsec.sdk import runtime_calls as rc
from dsec.sdk.models import FileEntry

# Go's os.FileMode type bits, which envd reports in ``mode``.
_GO_DIR = 1 << 31
_GO_SYMLINK = 1 << 27
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
MAX_DEPTH = 32


def _owner(uid: int) -> str:
    return "root" if uid == 0 else str(uid)


def entry_json(e: FileEntry) -> dict[str, Any]:
    perm = e.mode & 0o7777
    go_mode = perm | (_GO_DIR if e.type == "dir" else _GO_SYMLINK if e.type == "symlink" else 0)
    kind = (
        stat.S_IFDIR if e.type == "dir" else stat.S_IFLNK if e.type == "symlink" else stat.S_IFREG
    )
    out: dict[str, Any] = {
        "name": e.name,
        "type": _TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"),
        "path": e.path,
        "size": str(e.size),
        "mode": go_mode,
        "permissions": stat.filemode(kind | perm),
        "owner": _owner(e.uid),
        "group": _owner(e.gid),
    }
    if e.mtime is not None:
        out["modifiedTime"] = e.mtime.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if e.target is not None:
        out["symlinkTarget"] = e.target
    return out


def _path(msg: dict[str, Any], key: str = "path") -> str:
    p = msg.get(key)
    if not isinstance(p, str) or not p:
        raise InvalidArgument(f"'{key}' is required")
    return p


async def stat_(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    e = await c.client.transport.call(rc.stat_file(c.sandbox_id, _path(msg)))
    return {"entry": entry_json(e)}


async def list_dir(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    depth = msg.get("depth") or 1
    if isinstance(depth, str) and depth.isdigit():
        depth = int(depth)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InvalidArgument(f"invalid depth {depth!r}")
    path = _path(msg)
    info = await c.client.transport.call(rc.stat_file(c.sandbox_id, path))
    if info.type != "dir":
        raise InvalidArgument(f"path {path} is not a directory")
    entries = await c.client.transport.call(
        rc.list_files(c.sandbox_id, path, min(depth, MAX_DEPTH))
    )
    return {"entries": [entry_json(e) for e in entries]}


async def make_dir(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    path = _path(msg)
    try:
        e = await c.client.transport.call(rc.make_dir(c.sandbox_id, path, parents=False))
    except AlreadyExists:
        raise AlreadyExists(f"directory {path} already exists") from None
    except NotFound:  # a missing parent: create the whole chain, as envd does
        e = await c.client.transport.call(rc.make_dir(c.sandbox_id, path, parents=True))
    return {"entry": entry_json(e)}


async def move(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    call = rc.rename_file(c.sandbox_id, _path(msg, "source"), _path(msg, "destination"))
    e = await c.client.transport.call(call)
    return {"entry": entry_json(e)}


async def remove(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    try:
        await c.client.transport.call(rc.remove_file(c.sandbox_id, _path(msg), recursive=True))
    except NotFound:
        pass  # envd removes like `rm -rf`: a missing path is not an error
    return {}


WATCH_POLL_S = 0.2
Snapshot = dict[str, tuple[str, int, float]]


WATCHER_DIR = "/tmp/.e2b-watchers"


async def _snapshot(c: Call, path: str, depth: int) -> Snapshot:
    entries = await c.client.transport.call(rc.list_files(c.sandbox_id, path, depth))
    out: Snapshot = {}
    for e in entries:
        if e.path == WATCHER_DIR or e.path.startswith(WATCHER_DIR + "/"):
            continue
        mtime = e.mtime.timestamp() if e.mtime else 0.0
        out[posixpath.relpath(e.path, path)] = (e.type, e.size, mtime)
    return out


def _events(old: Snapshot, new: Snapshot) -> list[dict[str, Any]]:
    created = sorted(new.keys() - old.keys())
    written = [
        n for n in sorted(new.keys() & old.keys()) if new[n] != old[n] and new[n][0] != "dir"
    ]
    removed = sorted(old.keys() - new.keys())
    return [
        *({"name": n, "type": "EVENT_TYPE_CREATE"} for n in created),
        *({"name": n, "type": "EVENT_TYPE_WRITE"} for n in written),
        *({"name": n, "type": "EVENT_TYPE_REMOVE"} for n in removed),
    ]


async def watch_dir(c: Call, msg: dict[str, Any], stream: ServerStream) -> None:
    path = _path(msg)
    info = await c.client.transport.call(rc.stat_file(c.sandbox_id, path))
    if info.type != "dir":
        raise InvalidArgument(f"path {path} is not a directory")
    depth = MAX_DEPTH if msg.get("recursive") else 1
    old = await _snapshot(c, info.path, depth)
    await stream.send({"start": {}})
    deadline = time.monotonic() + c.timeout_s if c.timeout_s else None
    last_sent = time.monotonic()
    while True:
        await asyncio.sleep(WATCH_POLL_S)
        if stream.client_gone:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise ConnectError("deadline_exceeded", "the watch reached its timeout")
        try:
            new = await _snapshot(c, info.path, depth)
        except NotFound:
            raise ConnectError("not_found", f"the watched directory {path} was removed") from None
        for event in _events(old, new):
            await stream.send({"filesystem": event})
            last_sent = time.monotonic()
        old = new
        if c.keepalive_s and time.monotonic() - last_sent >= c.keepalive_s:
            await stream.send({"keepalive": {}})
            last_sent = time.monotonic()


def _watcher_file(msg: dict[str, Any]) -> str:
    wid = msg.get("watcherId", msg.get("watcher_id"))
    if not isinstance(wid, str) or not re.fullmatch(r"[0-9a-f]{32}", wid):
        raise NotFound(f"watcher {wid!r} not found")
    return f"{WATCHER_DIR}/{wid}.json"


async def _save_watcher(c: Call, file: str, path: str, depth: int, snap: Snapshot) -> None:
    state = json.dumps({"path": path, "depth": depth, "snap": snap}).encode()
    await c.client.transport.call(rc.write_file(c.sandbox_id, file, mode=0o600), state)


async def create_watcher(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    path = _path(msg)
    info = await c.client.transport.call(rc.stat_file(c.sandbox_id, path))
    if info.type != "dir":
        raise InvalidArgument(f"path {path} is not a directory")
    depth = MAX_DEPTH if msg.get("recursive") else 1
    wid = secrets.token_hex(16)
    snap = await _snapshot(c, info.path, depth)
    await _save_watcher(c, f"{WATCHER_DIR}/{wid}.json", info.path, depth, snap)
    return {"watcherId": wid}


async def get_watcher_events(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    file = _watcher_file(msg)
    try:
        raw = await c.client.transport.fetch(rc.read_file(c.sandbox_id, file))
        state = json.loads(raw)
        path, depth = str(state["path"]), int(state["depth"])
        old = {k: (str(v[0]), int(v[1]), float(v[2])) for k, v in state["snap"].items()}
    except NotFound:
        raise NotFound(f"watcher {file} not found") from None
    except (ValueError, KeyError, TypeError, IndexError):
        raise InvalidArgument("the watcher's state in the sandbox is corrupt") from None
    new = await _snapshot(c, path, depth)
    await _save_watcher(c, file, path, depth, new)
    return {"events": _events(old, new)}


async def remove_watcher(c: Call, msg: dict[str, Any]) -> dict[str, Any]:
    try:
        await c.client.transport.call(rc.remove_file(c.sandbox_id, _watcher_file(msg)))
        # the directory goes with the last watcher (not empty: another watcher still runs)
        await c.client.transport.call(rc.remove_file(c.sandbox_id, WATCHER_DIR))
    except (NotFound, InvalidArgument):
        pass
    return {}


SERVER_STREAM = {"WatchDir": watch_dir}
UNARY = {
    "Stat": stat_,
    "ListDir": list_dir,
    "MakeDir": make_dir,
    "Move": move,
    "Remove": remove,
    "CreateWatcher": create_watcher,
    "GetWatcherEvents": get_watcher_events,
    "RemoveWatcher": remove_watcher,
}
