"""The records of the trajectory log: a trajectory (its name, sandbox, replay state and
policy) and one step (canonical request, result, and what re-running it needs)."""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any

from dsec.core.errors import InvalidArgument

MAX_NAME = 200
MISMATCH_POLICIES = ("diverge", "fail")


def trajectory_id(project: str, name: str) -> str:
    return hashlib.sha256(f"{project}\n{name}".encode()).hexdigest()[:32]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise InvalidArgument(f"a trajectory name is 1 to {MAX_NAME} characters")
    if any(ord(c) < 0x20 for c in name):
        raise InvalidArgument("a trajectory name has no control characters")
    return name


@dataclass(frozen=True)
class Trajectory:
    id: str
    project: str
    name: str
    created_at: float
    updated_at: float
    sandbox_id: str = ""
    epoch: str = ""  # new at each bind: calls sent from a cached record name it to the edge
    steps: int = 0
    bytes: int = 0
    mode: str = "record"  # "replay": calls are matched against steps[cursor:]
    cursor: int = 0
    replayed: int = 0  # steps answered from the log since the last open
    on_mismatch: str = "diverge"
    checkpoint_every: int = 0
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # {"step": n, "image"}
    divergence: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # the create body, to recreate it

    def to_json(self) -> dict[str, Any]:
        """The record's fields (a new dict; nested values are shared, not copied: encoding
        every append's record must not deep-copy its spec)."""
        return {name: getattr(self, name) for name in _TRAJECTORY_FIELDS}

    def encode(self) -> builtins.bytes:  # (``bytes`` here: the field)
        return _JSON.encode(self.__dict__).encode()  # (the fields, in their order)

    def appended(self, size: int, at: float) -> Trajectory:
        """The record after a step of ``size`` bytes made at ``at`` is appended (record
        mode; ``updated_at`` is the later of the two, as a read of the log's tail finds it).
        (A copy of the fields, not ``dataclasses.replace``: it runs on every recorded call
        and these values need no checks.)"""
        new = object.__new__(Trajectory)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(
            steps=self.steps + 1,
            bytes=self.bytes + size,
            cursor=self.steps + 1,
            mode="record",
            updated_at=max(self.updated_at, at),
        )
        return new

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trajectory:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Step:
    n: int
    op: str
    request: dict[str, Any]  # canonical (canon.canonical)
    status: int  # the HTTP status the call answered
    result: dict[str, Any]  # the JSON body the call answered
    at: float
    sandbox_id: str = ""
    idempotent: bool = False
    data: bytes | None = None  # bytes the call answered (a file read)
    payload: bytes | None = None  # bytes the call carried (upload, stdin), for re-running
    raw_request: dict[str, Any] = field(default_factory=dict)  # the op as sent, for re-running

    def _fields(self) -> dict[str, Any]:
        """The step's fields in order, nested values shared (no deep copy on the call
        path): a frozen dataclass without slots keeps exactly them in its ``__dict__``."""
        return dict(self.__dict__)

    def encode(self) -> bytes:
        d = self._fields()
        for k in ("data", "payload"):
            if d[k] is not None:
                d[k] = base64.b64encode(d[k]).decode()
        return _JSON.encode(d).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Step:
        d = json.loads(raw)
        for k in ("data", "payload"):
            if d.get(k) is not None:
                d[k] = base64.b64decode(d[k])
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def export(self) -> dict[str, Any]:
        """One JSON Lines record for training pipelines."""
        d = self._fields()
        d.pop("raw_request")
        for k in ("data", "payload"):
            if d[k] is not None:
                d[k] = {"base64": base64.b64encode(d[k]).decode(), "size": len(d[k])}
        return d


_TRAJECTORY_FIELDS = tuple(f.name for f in fields(Trajectory))
# (one encoder: json.dumps with options builds a new one per call; keys in the fields'
# order, not sorted: a record's encoding is as stable and costs less. Records and steps are
# trees of JSON values made here, never cyclic: no cycle check.)
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)
