"""The iam's records and small shared helpers (values only, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from dsec.core import projects
from dsec.core.errors import InvalidArgument

KEY_ROLES = frozenset({"admin", "member", "viewer"})
DEFAULT_PROJECT = "default"
PLATFORM = "*"  # the scope of a grant on every project
_MAX_TEXT = 200


@dataclass(frozen=True, slots=True)
class Project:
    """A project and its quota; a limit of 0 means no limit."""

    name: str
    max_sandboxes: int
    max_cpu: float
    max_memory_mb: int


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    subject: str
    project: str
    role: str
    name: str
    created_at: float
    revoked: bool


@dataclass(frozen=True, slots=True)
class Principal:
    """Who an API key speaks for."""

    subject: str
    project: str
    role: str
    key_id: str


@dataclass(frozen=True, slots=True)
class Usage:
    project: Project
    sandboxes: int
    cpu: float
    memory_mb: int


@dataclass(frozen=True, slots=True)
class Admission:
    """One request to admit a sandbox against its project's quota."""

    project: str
    sandbox_id: str
    cpu: float
    memory_mb: int
    edge_id: str = ""


@dataclass(frozen=True, slots=True)
class Allocation:
    sandbox_id: str
    project: str
    edge_id: str
    cpu: float
    memory_mb: int
    created_at: float


@dataclass(frozen=True, slots=True)
class Grant:
    """``subject`` has ``role`` on ``project`` and everything beneath it."""

    project: str
    subject: str
    role: str


def check_grant(project: str, subject: str, role: str) -> None:
    """Raise InvalidArgument unless this names a grant ("" role: its removal)."""
    if project != PLATFORM:
        projects.validate(project)
    text(subject, "subject")
    if role and role not in KEY_ROLES:
        raise InvalidArgument(f"role must be one of {sorted(KEY_ROLES)}, got {role!r}")


DEFAULT_QUOTA = Project(DEFAULT_PROJECT, max_sandboxes=1000, max_cpu=0.0, max_memory_mb=0)


def milli(cpu: float) -> int:
    return round(cpu * 1000)


def text(value: str, what: str, *, required: bool = True) -> str:
    if (required and not value) or len(value) > _MAX_TEXT or not value.isprintable():
        raise InvalidArgument(f"{what} must be 1-{_MAX_TEXT} printable characters, got {value!r}")
    return value
