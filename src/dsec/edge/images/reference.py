"""Image references: ``[registry[:port]/]repo[:tag][@sha256:hex]``.

Names without a registry part are Docker Hub's (``docker.io``, with ``library/`` for
single-segment repositories), as in the Docker CLI. The first segment is a registry when it
contains a ``.`` or a ``:`` or is ``localhost``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsec.core.errors import InvalidArgument

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_REPO_SEG = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?$")


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed image reference."""

    registry: str  # host[:port] as written (docker.io for Docker Hub)
    repository: str  # e.g. library/python
    tag: str  # "" when only a digest is given
    digest: str  # "sha256:<hex>" or ""

    @property
    def api_host(self) -> str:
        """The host[:port] to talk to (Docker Hub's API lives on another name)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def selector(self) -> str:
        """What to ask the manifests endpoint for: the digest if any, else the tag."""
        return self.digest or self.tag

    @property
    def name(self) -> str:
        """The canonical full name, e.g. ``127.0.0.1:5000/sbx/app:v1`` or ``...@sha256:..``."""
        base = f"{self.registry}/{self.repository}"
        if self.tag:
            base += f":{self.tag}"
        if self.digest:
            base += f"@{self.digest}"
        return base

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.registry, self.repository, "", digest)


def parse_reference(text: str) -> Reference:
    """Parse an image reference.

    Raises:
        InvalidArgument: the reference is empty or malformed.
    """
    ref = text.strip()
    if not ref or len(ref) > 512 or any(c.isspace() for c in ref):
        raise InvalidArgument(f"invalid image reference {text!r}")
    digest = ""
    if "@" in ref:
        ref, digest = ref.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidArgument(
                f"invalid image reference {text!r}: the digest must be sha256:<64 hex>"
            )
    first, slash, rest = ref.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        if not _HOST.match(first):
            raise InvalidArgument(f"invalid image reference {text!r}: bad registry {first!r}")
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, ref
    tag = ""
    last_slash = path.rfind("/")
    colon = path.rfind(":")
    if colon > last_slash:
        path, tag = path[:colon], path[colon + 1 :]
        if not _TAG.match(tag):
            raise InvalidArgument(f"invalid image reference {text!r}: bad tag {tag!r}")
    segments = path.split("/")
    if not path or not all(_REPO_SEG.match(s) for s in segments):
        raise InvalidArgument(
            f"invalid image reference {text!r}: the repository must be lowercase "
            "letters, digits and separators"
        )
    if registry == DOCKER_HUB and len(segments) == 1:
        path = f"library/{path}"
    if not tag and not digest:
        tag = "latest"
    return Reference(registry, path, tag, digest)
