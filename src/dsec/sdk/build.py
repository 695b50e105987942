"""Client side of ``dsec image build``: the context tar (``.dockerignore`` applied), the
request, and the NDJSON progress reader. Sans-I/O apart from reading the context."""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dsec.core.errors import InvalidArgument
from dsec.sdk.models import JSON
from dsec.sdk.ndjson import NdjsonReader
from dsec.sdk.wire import Request

BUILD_TIMEOUT_S = 4 * 3600.0
DOCKERFILE_IN_CONTEXT = ".dsec-build.Dockerfile"  # an -f file from outside the context

BuildProgress = Callable[[dict[str, Any]], None]


def _pattern_re(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
        i += 1
    return re.compile(out + "(?:/.*)?$")  # a directory's pattern covers what is inside it


def ignore_rules(context: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """``.dockerignore``'s rules as (negated, regex); comments and blanks skipped."""
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        line = os.path.normpath(line.removeprefix("!").strip().lstrip("/"))
        if line and line != ".":
            rules.append((negated, _pattern_re(line)))
    return rules


def ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """True if the last rule matching ``rel`` excludes it."""
    result = False
    for negated, rx in rules:
        if rx.match(rel):
            result = not negated
    return result


def context_tar(context: str | Path, dockerfile: str | Path | None = None) -> tuple[bytes, str]:
    """Tar ``context`` (minus ``.dockerignore`` matches); return (tar, Dockerfile path in it).

    A Dockerfile outside the context (or ignored) is added as ``.dsec-build.Dockerfile``.

    Raises:
        InvalidArgument: the context is not a directory or the Dockerfile does not exist.
    """
    root = Path(context)
    if not root.is_dir():
        raise InvalidArgument(f"build context {str(root)!r} is not a directory")
    df_path = Path(dockerfile) if dockerfile is not None else root / "Dockerfile"
    if not df_path.is_file():
        raise InvalidArgument(f"no Dockerfile at {str(df_path)!r}")
    rules = ignore_rules(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if ignored(rel, rules):
                    if name in dirnames and not any(n for n, _ in rules):
                        dirnames.remove(name)  # nothing can re-include: skip its content
                    continue
                tar.add(full, arcname=rel, recursive=False)
        df_rel = os.path.relpath(df_path.resolve(), root.resolve())
        if df_rel.startswith("..") or ignored(df_rel, rules):
            data = df_path.read_bytes()
            info = tarfile.TarInfo(DOCKERFILE_IN_CONTEXT)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
            df_rel = DOCKERFILE_IN_CONTEXT
    return buf.getvalue(), df_rel


def build_request(
    tar: bytes,
    tag: str,
    *,
    dockerfile: str = "Dockerfile",
    build_args: Mapping[str, str] | None = None,
    no_cache: bool = False,
    edge_id: str = "",
) -> Request:
    """``POST /v1/images/build`` with the context tar as the body (NDJSON answer)."""
    if not tag:
        raise InvalidArgument("a tag for the built image is required")
    params: list[tuple[str, str]] = [("tag", tag), ("dockerfile", dockerfile)]
    params += [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
    if no_cache:
        params.append(("no_cache", "1"))
    if edge_id:
        params.append(("edge_id", edge_id))
    return Request(
        "POST",
        "/v1/images/build",
        tuple(params),
        tar,
        (("Content-Type", "application/x-tar"),),
        BUILD_TIMEOUT_S,
    )


class BuildReader(NdjsonReader[JSON]):
    """Feeds NDJSON bytes in; reports steps, CACHED and RUN output; ends with the image."""

    what = "build"

    def __init__(self, progress: BuildProgress | None) -> None:
        super().__init__()
        self.progress = progress

    def on_object(self, obj: JSON) -> None:
        if "image" in obj:
            self.value = dict(obj["image"])
        elif self.progress is not None:
            self.progress(obj)
