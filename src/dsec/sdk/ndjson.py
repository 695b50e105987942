"""Streamed NDJSON answers (pull, build, load): progress lines, then a result or an error."""

from __future__ import annotations

import json
from typing import Any, Generic, TypeVar

from dsec.core.errors import Internal, error_from_wire

T = TypeVar("T")


class NdjsonReader(Generic[T]):
    """Feed bytes in; :meth:`on_object` sees each object and sets ``value`` on the result
    line; an ``{"error": ...}`` line raises the error it names."""

    what = "stream"  # for messages: "pull", "build"

    def __init__(self) -> None:
        self.buf = b""
        self.value: T | None = None

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            obj = json.loads(line)
        except ValueError:
            raise Internal(f"malformed {self.what} progress line: {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise Internal(f"malformed {self.what} progress line")
        if "error" in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            raise error_from_wire(str(err.get("code", "")), str(err.get("message", "")))
        self.on_object(obj)

    def on_object(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def result(self) -> T:
        if self.buf.strip():
            self._line(self.buf)
            self.buf = b""
        if self.value is None:
            raise Internal(f"the {self.what} stream ended without a result")
        return self.value
