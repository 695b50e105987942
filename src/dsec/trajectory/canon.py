"""Canonical requests: what a step is matched on when a trajectory replays.

A runtime request (the JSON op sent to the sandbox) plus the bytes it carries (stdin, a
file upload, PTY input) becomes one canonical dict: keys sorted, ``None`` dropped, the
per-call ``timeout`` left out (a rerun may wait longer for the same command), and the bytes
replaced by their SHA-256 and length. Two calls match when their canonical forms are equal;
:func:`first_difference` names the first field that is not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

IGNORED_FIELDS = frozenset({"timeout"})


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in sorted(value.items()) if v is not None}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def canonical(request: dict[str, Any], payload: bytes | None = None) -> dict[str, Any]:
    """The canonical form of ``request`` carrying ``payload`` (None: no bytes at all)."""
    out = {k: v for k, v in request.items() if k not in IGNORED_FIELDS}
    if payload is not None:
        out["payload"] = {"sha256": digest(payload), "size": len(payload)}
    cleaned: dict[str, Any] = _clean(out)
    return cleaned


def encode(canon: dict[str, Any]) -> str:
    """One stable text form (for hashing and display)."""
    return json.dumps(canon, sort_keys=True, separators=(",", ":"))


def first_difference(recorded: Any, actual: Any, path: str = "") -> str | None:
    """The dotted path of the first field where ``actual`` differs from ``recorded``."""
    if isinstance(recorded, dict) and isinstance(actual, dict):
        for key in sorted(recorded.keys() | actual.keys()):
            if key not in recorded or key not in actual:
                return f"{path}.{key}" if path else key
            sub = first_difference(recorded[key], actual[key], f"{path}.{key}" if path else key)
            if sub is not None:
                return sub
        return None
    if isinstance(recorded, list) and isinstance(actual, list):
        if len(recorded) != len(actual):
            return path or "."
        for i, (a, b) in enumerate(zip(recorded, actual, strict=True)):
            sub = first_difference(a, b, f"{path}[{i}]")
            if sub is not None:
                return sub
        return None
    return None if recorded == actual else (path or ".")


def field_at(obj: Any, path: str) -> Any:
    """The value at a path :func:`first_difference` returned (None when absent)."""
    cur = obj
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("[") and isinstance(cur, list):
            idx = int(part[1:-1])
            cur = cur[idx] if idx < len(cur) else None
        elif isinstance(cur, dict):
            cur = cur.get(part)
        else:
            return None
    return cur
