"""Files in and out of one ``exec`` call (its ``files`` and ``outputs`` arguments).

``files``: ``[{path, data (base64), mode?}]`` written before the command starts, owned by
the command's user; ``outputs``: paths read back after it exits, answered in the result as
``files: [{path, data, mode}]`` (missing or non-regular files are left out; files of
/proc and /dev never go out). Relative paths are relative to the call's working
directory. Both directions together carry at most :data:`MAX_BYTES` per call.
"""

from __future__ import annotations

import base64
import os
import stat

from dsec.agent.wire import AgentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_BYTES = 2 * 1024 * 1024  # the result is one JSON frame (4 MiB), base64 included


def check_outputs(req: dict[str, Any]) -> list[str] | None:
    outputs = req.get("outputs")
    if outputs is None:
        return None
    if not isinstance(outputs, list) or not all(isinstance(p, str) and p for p in outputs):
        raise AgentError("invalid_argument", "'outputs' must be a list of paths")
    return outputs


def write_files(items: Any, uid: int, gid: int, cwd: str, budget: list[int]) -> None:
    """Write ``items`` (creating parent directories), owned by ``uid``/``gid``."""
    if not isinstance(items, list):
        raise AgentError("invalid_argument", "'files' must be a list of {path, data}")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not item["path"]:
            raise AgentError("invalid_argument", "each of 'files' needs a 'path' and 'data'")
        path = os.path.join(cwd, item["path"])
        try:
            data = base64.b64decode(item.get("data") or "", validate=True)
        except ValueError:
            raise AgentError("invalid_argument", f"file {path}: 'data' is not base64") from None
        budget[0] -= len(data)
        if budget[0] < 0:
            raise AgentError("payload_too_large", f"files of one call exceed {MAX_BYTES} bytes")
        mode = item.get("mode", 0o644)
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o7777:
            raise AgentError("invalid_argument", f"file {path}: bad mode {mode!r}")
        _write(path, data, mode, uid, gid)


def _write(path: str, data: bytes, mode: int, uid: int, gid: int) -> None:
    missing: list[str] = []
    parent = os.path.dirname(path)
    while parent and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        for d in reversed(missing):
            os.mkdir(d, 0o755)
            os.chown(d, uid, gid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    except OSError as exc:
        raise AgentError("invalid_argument", f"file {path}: {exc.strerror}") from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def read_outputs(paths: list[str], cwd: str, budget: list[int]) -> list[dict[str, Any]]:
    out = []
    special = _special_devices()
    for p in paths:
        item = _read(os.path.join(cwd, p), special, budget)
        if item is not None:
            out.append(item)
    return out


def _read(path: str, special: set[int], budget: list[int]) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_dev in special:
            return None
        if st.st_size > budget[0]:
            raise AgentError(
                "payload_too_large", f"output files of a call exceed {MAX_BYTES} bytes"
            )
        chunks = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        budget[0] -= len(data)
        return {"path": path, "data": base64.b64encode(data).decode(), "mode": st.st_mode & 0o7777}
    finally:
        os.close(fd)


def _special_devices() -> set[int]:
    out = set()
    for p in ("/proc", "/dev", "/sys"):
        try:
            out.add(os.stat(p).st_dev)
        except OSError:
            pass
    return out
