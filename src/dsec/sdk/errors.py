"""The two errors only the SDK raises; everything else is a class of ``dsec.core.errors``."""

from __future__ import annotations

from dsec.core.errors import DeadlineExceeded, Unauthenticated
from dsec.sdk.models import ExecResult


class CommandTimeout(DeadlineExceeded):
    """A command ran past its timeout and was killed; ``result`` holds its partial output."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message)
        self.result = result


class MissingCredentials(Unauthenticated):
    """No API key was given and none could be found; the message says what to set."""
