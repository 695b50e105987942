"""Projects form a tree named by paths: ``org``, ``org/team``, ``org/team/exp1``.

A quota set on a project bounds the sum over its whole subtree, so admission checks the
new sandbox against every ancestor (the project itself included). A key of a project acts
on that project and everything beneath it. A path can only name a parent that exists, so
the tree cannot contain a cycle. Pure functions only.
"""

from __future__ import annotations

import re

from dsec.core.errors import InvalidArgument

MAX_DEPTH = 16
_SEGMENT = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


def validate(path: str) -> str:
    """Return ``path`` if it names a project, else raise InvalidArgument saying why."""
    parts = path.split("/")
    if not path or len(path) > 255 or len(parts) > MAX_DEPTH:
        raise InvalidArgument(f"invalid project {path!r}: 1-255 characters, at most "
                              f"{MAX_DEPTH} levels")  # fmt: skip
    for part in parts:
        if not _SEGMENT.match(part):
            raise InvalidArgument(
                f"invalid project {path!r}: each level is lowercase letters, digits, '-' or "
                "'_', starting with a letter or digit"
            )
    return path


def parent(path: str) -> str:
    """The parent's path, or "" for a top-level project."""
    return path.rpartition("/")[0]


def ancestors(path: str) -> list[str]:
    """The project and everything above it, top first: a/b/c -> [a, a/b, a/b/c]."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def contains(ancestor: str, path: str) -> bool:
    """Whether ``path`` is ``ancestor`` or lies beneath it."""
    return path == ancestor or path.startswith(ancestor + "/")
