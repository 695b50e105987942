"""Users, working directories and environments for the commands aether and chronus start.

Users come from the image's ``/etc/passwd`` and ``/etc/group``, parsed directly: the
bundled interpreter must not load the image's NSS modules (they may not exist, or be built
for another libc).
"""

from __future__ import annotations

import os

from dsec.agent.wire import AgentError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Variables of the agent itself, never passed on to commands.
AGENT_VARS = frozenset(
    {
        "PYTHONHOME",
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "DSEC_LISTEN_FD",
        "DSEC_AGENT_RUN_DIR",
        "DSEC_IMAGE_USER",
        "DSEC_IMAGE_WORKDIR",
    }
)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ETC = os.environ.get("DSEC_AGENT_ETC", "/etc")

# Set by freeze_env() in aether: its environment as a plain dict (it does not change once
# aether runs). Every exec reads the environment; os.environ's mapping decodes each
# variable in Python and answers a missing one by raising KeyError, code that a restored
# microVM under TCG translates again for its first exec.
_frozen_env: dict[str, str] | None = None
# The agent's own user and the files it was read from (their stat fields).
_own: tuple[tuple[object, ...], User] | None = None


class User:
    """A resolved user (a plain slotted class: ``dataclasses`` would cost the agent 1.6 MiB)."""

    __slots__ = ("gid", "groups", "home", "name", "uid")

    def __init__(
        self, uid: int, gid: int, name: str, home: str, groups: tuple[int, ...] = ()
    ) -> None:
        self.uid = uid
        self.gid = gid
        self.name = name
        self.home = home
        self.groups = groups

    def __repr__(self) -> str:
        return f"User(uid={self.uid}, gid={self.gid}, name={self.name!r}, home={self.home!r})"


def _lines(name: str) -> list[list[str]]:
    """The fields of each line of ``ETC/name`` (comments left out).

    Read with ``os`` calls, not ``open()``: every exec looks its user up, and in a restored
    microVM under TCG the io and codec layers were code translated again for the first."""
    try:
        fd = os.open(os.path.join(ETC, name), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return []
    finally:
        os.close(fd)
    text = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.split(":") for line in lines if not line.startswith("#")]


def _supplementary(name: str, gid: int) -> tuple[int, ...]:
    out: list[int] = []
    for fields in _lines("group"):
        if len(fields) >= 4 and fields[2].isdigit() and name in fields[3].split(","):
            g = int(fields[2])
            if g != gid and g not in out:
                out.append(g)
    return tuple(out)


def resolve(spec: str | int | None) -> User:
    """Look a user up by name or uid; ``None`` means the agent's own user.

    Raises:
        AgentError: ``invalid_argument`` for a name that is not in ``/etc/passwd``.
    """
    if spec is None:
        return _own_user()
    uid: int | None
    if isinstance(spec, int) or spec.isdigit():
        uid, name = int(spec), None
    else:
        uid, name = None, spec
    return _lookup(uid, name)


def _own_user() -> User:
    """The agent's own user, read again only when /etc/passwd or /etc/group changed: every
    exec resolves it, and a restored microVM's first exec parsed them in code translated
    again."""
    global _own
    stamp: tuple[object, ...] = (ETC, os.getuid(), *_stamp("passwd"), *_stamp("group"))
    if _own is None or _own[0] != stamp:
        _own = (stamp, _lookup(os.getuid(), None))
    return _own[1]


def _stamp(name: str) -> tuple[int, int, int]:
    try:
        st = os.stat(f"{ETC}/{name}")
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _lookup(uid: int | None, name: str | None) -> User:
    for fields in _lines("passwd"):
        if len(fields) < 7 or not fields[2].isdigit() or not fields[3].isdigit():
            continue
        if (name is not None and fields[0] == name) or (uid is not None and int(fields[2]) == uid):
            u, g = int(fields[2]), int(fields[3])
            return User(u, g, fields[0], fields[5] or "/", _supplementary(fields[0], g))
    if name is not None:
        raise AgentError("invalid_argument", f"no user {name!r} in /etc/passwd")
    assert uid is not None
    home = "/root" if uid == 0 else "/"
    gid = os.getgid() if uid == os.getuid() else uid
    return User(uid, gid, str(uid), home)


def image_user() -> str | None:
    """The image's ``User`` (the default for every command), or ``None``.

    ``name``, ``uid``, ``name:group`` and ``uid:gid`` are accepted; the group part is not
    used (the user's own primary group applies).
    """
    value = _env().get("DSEC_IMAGE_USER", "").partition(":")[0]
    return value or None


def image_workdir() -> str | None:
    """The image's ``WorkingDir`` when it names a directory other than ``/``."""
    value = _env().get("DSEC_IMAGE_WORKDIR", "")
    return value if value.startswith("/") and value != "/" else None


def default_cwd(user: User) -> str:
    """The image's working directory, else the user's home when it exists, else ``/``."""
    workdir = image_workdir()
    if workdir is not None:
        return workdir
    return user.home if os.path.isdir(user.home) else "/"


def freeze_env() -> None:
    """Read the environment once from now on (aether calls it at start)."""
    global _frozen_env
    _frozen_env = dict(os.environ)


def _env() -> dict[str, str] | os._Environ[str]:
    return os.environ if _frozen_env is None else _frozen_env


def base_env() -> dict[str, str]:
    """The agent's environment minus its own variables."""
    env = {k: v for k, v in _env().items() if k not in AGENT_VARS}
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def child_env(user: User, extra: dict[str, str], *, explicit_user: bool) -> dict[str, str]:
    """The environment of a command: the container's, the user's identity, then ``extra``."""
    env = base_env()
    if explicit_user:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    env.update(extra)
    return env


def spawn_kwargs(user: User, explicit_user: bool) -> dict[str, Any]:
    """Keyword arguments for ``subprocess.Popen`` that switch to ``user`` (when needed)."""
    if not explicit_user or (user.uid == os.getuid() and user.gid == os.getgid()):
        return {}
    if os.getuid() != 0:
        raise AgentError("permission_denied", f"the agent cannot switch to uid {user.uid}")
    return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}


def resolve_cwd(cwd: str | None, user: User) -> str:
    """An absolute working directory: ``cwd`` (relative to the home) or the default."""
    if not cwd:
        return default_cwd(user)
    return cwd if cwd.startswith("/") else os.path.join(default_cwd(user), cwd)
