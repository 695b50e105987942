"""The ``files.*`` ops: streamed reads and atomic writes, stat, list, mkdir, remove, rename.

Data moves in chunks of at most ``CHUNK`` bytes through one reused buffer, so a file of
any size costs the agent a constant amount of memory. Paths are taken as given inside the
sandbox's mount namespace; relative ones are relative to the agent user's home.
"""

from __future__ import annotations

import errno
import os
import stat

from dsec.agent import args, users
from dsec.agent.protocol import CHUNK
from dsec.agent.wire import KIND_CLOSE, KIND_IN, KIND_OUT, AgentError, Conn, from_oserror

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_ENTRIES = 20000  # per files.list call; the answer must fit in one frame
MAX_DEPTH = 32

_home: str | None = None


def _abs(path: str) -> str:
    global _home
    if path.startswith("/"):
        return path
    if _home is None:
        _home = users.default_cwd(users.resolve(None))
    return os.path.join(_home, path)


def _path(req: dict[str, Any], key: str = "path") -> str:
    return _abs(args.req_path(req, key))


def _type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def entry(path: str, st: os.stat_result | None = None) -> dict[str, Any]:
    """The wire entry of ``path`` (not following a final symlink unless ``st`` is given)."""
    if st is None:
        st = os.lstat(path)
    out: dict[str, Any] = {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "path": path,
        "type": _type(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
        "uid": st.st_uid,
        "gid": st.st_gid,
    }
    if stat.S_ISLNK(st.st_mode):
        out["target"] = os.readlink(path)
    return out


def op_stat(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    try:
        return entry(path)
    except OSError as exc:
        raise from_oserror(exc, path) from None


def op_read(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    offset = args.opt_int(req, "offset", 0) or 0
    length = args.opt_int(req, "length")
    if offset < 0 or (length is not None and length < 0):
        raise args.bad("'offset' and 'length' must not be negative")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise from_oserror(exc, path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise AgentError("invalid_argument", f"{path} is a directory")
        os.set_blocking(fd, True)
        conn.event("stat", **entry(path, st))
        remaining = length if length is not None else -1
        buf = memoryview(bytearray(CHUNK))
        sent = 0
        while remaining:
            want = CHUNK if remaining < 0 else min(CHUNK, remaining)
            try:
                n = os.preadv(fd, [buf[:want]], offset + sent)
            except OSError as exc:
                if not stat.S_ISREG(st.st_mode) and exc.errno == errno.ESPIPE:
                    n = os.readv(fd, [buf[:want]])
                else:
                    raise from_oserror(exc, path) from None
            if not n:
                break
            conn.send(KIND_OUT, buf[:n])
            sent += n
            if remaining > 0:
                remaining -= n
        return {"size": sent}
    finally:
        os.close(fd)


def _target_stat(path: str) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise from_oserror(exc, path) from None
    if stat.S_ISDIR(st.st_mode):
        raise AgentError("invalid_argument", f"{path} is a directory")
    return st


def op_write(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    mode = args.opt_int(req, "mode")
    if mode is not None and not 0 <= mode <= 0o7777:
        raise args.bad("'mode' must be a permission between 0 and 0o7777")
    append = args.opt_bool(req, "append")
    if os.path.islink(path):  # replace the file the link points to, keep the link
        path = os.path.realpath(path)
    parent = os.path.dirname(path) or "/"
    tmp = None
    try:
        if args.opt_bool(req, "parents"):
            os.makedirs(parent, exist_ok=True)
        old = _target_stat(path)
        if append:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        else:
            fd, tmp = _open_temp(parent, path)
    except OSError as exc:
        raise from_oserror(exc, path) from None
    try:
        _receive(conn, fd)
        if mode is None and not append:  # a replaced file keeps its permissions
            mode = stat.S_IMODE(old.st_mode) if old else 0o644
        if mode is not None:
            os.fchmod(fd, mode)
        if not append and old is not None and os.getuid() == 0:
            os.fchown(fd, old.st_uid, old.st_gid)
        size = os.fstat(fd).st_size
        if not append:
            _publish(fd, tmp, path)
            tmp = None
        return {"path": path, "size": size}
    except OSError as exc:
        if isinstance(exc, BrokenPipeError | ConnectionResetError):
            raise
        raise from_oserror(exc, path) from None
    finally:
        os.close(fd)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _temp_name(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent or "/", f".{name}.dsec-{os.urandom(6).hex()}")


def _open_temp(parent: str, path: str) -> tuple[int, str | None]:
    """A file for the new data: unnamed (``O_TMPFILE``: nothing shows in the directory while
    the data arrives, nothing is left behind if aether dies), or where the filesystem
    cannot do that, a hidden name beside the target (returned, to be renamed or removed)."""
    try:
        return os.open(parent, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600), None
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
            raise
    tmp = _temp_name(path)
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), tmp


def _publish(fd: int, tmp: str | None, path: str) -> None:
    """Put the written file (``fd``, named ``tmp`` or unnamed) at ``path`` in one step."""
    if tmp is not None:
        os.rename(tmp, path)
        return
    try:
        _link_fd(fd, path)  # a new file appears whole, under its own name
        return
    except FileExistsError:
        pass
    # rename replaces atomically but needs a name: this one exists for an instant only
    tmp = _temp_name(path)
    _link_fd(fd, tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _link_fd(fd: int, path: str) -> None:
    """Give the file open as ``fd`` the name ``path`` (linkat through ``/proc/self/fd``,
    following the link: plain ``link()`` would try to link the magic link itself)."""
    fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=fds, follow_symlinks=True)
    finally:
        os.close(fds)


def _receive(conn: Conn, fd: int) -> None:
    """Write the client's ``I`` frames to ``fd`` until ``C``; a hang-up aborts the write."""
    while True:
        frame = conn.read_frame()
        if frame is None:
            raise BrokenPipeError("the client closed the connection before the end of the data")
        kind, payload = frame
        if kind == KIND_CLOSE:
            return
        if kind != KIND_IN:
            continue
        view = memoryview(payload)
        while view:
            n = os.write(fd, view)
            view = view[n:]


def op_list(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    depth = args.opt_int(req, "depth", 1) or 1
    if not 1 <= depth <= MAX_DEPTH:
        raise args.bad(f"'depth' must be between 1 and {MAX_DEPTH}")
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise AgentError("invalid_argument", f"{path} is not a directory")
    except OSError as exc:
        raise from_oserror(exc, path) from None
    entries: list[dict[str, Any]] = []
    _walk(path, depth, entries)
    return {"entries": entries}


def _walk(path: str, depth: int, out: list[dict[str, Any]]) -> None:
    try:
        with os.scandir(path) as it:
            items = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        if out:  # an unreadable subdirectory: list what we can
            return
        raise from_oserror(exc, path) from None
    for item in items:
        if len(out) >= MAX_ENTRIES:
            raise AgentError("payload_too_large", f"more than {MAX_ENTRIES} entries; lower depth")
        try:
            out.append(entry(item.path, item.stat(follow_symlinks=False)))
        except OSError:
            continue
        if depth > 1 and item.is_dir(follow_symlinks=False):
            _walk(item.path, depth - 1, out)


def op_mkdir(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    mode = args.opt_int(req, "mode", 0o755)
    assert mode is not None
    try:
        if args.opt_bool(req, "parents"):
            os.makedirs(path, mode, exist_ok=True)
        else:
            os.mkdir(path, mode)
        return entry(path)
    except OSError as exc:
        raise from_oserror(exc, path) from None


def op_remove(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    path = _path(req)
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
        elif args.opt_bool(req, "recursive"):
            import shutil

            shutil.rmtree(path)
        else:
            os.rmdir(path)
    except OSError as exc:
        raise from_oserror(exc, path) from None
    return {}


def op_rename(conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
    src, dst = _path(req, "src"), _path(req, "dst")
    try:
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno != errno.EXDEV:  # another file system: copy, then delete
                raise
            import shutil

            shutil.move(src, dst)
        return entry(dst)
    except OSError as exc:
        raise from_oserror(exc, f"{src} -> {dst}") from None
