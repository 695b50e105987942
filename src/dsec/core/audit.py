"""The audit log's records and hash chain (pure; the iam stores them).

Every entry carries the hash of the one before it, so changing, removing or reordering any
entry breaks every later hash: :func:`verify` finds the first entry that does not fit.
This makes the log tamper-evident (anyone who can rewrite the whole database can rewrite
the whole chain; the iam also logs the chain's head, so an outside copy of the log lines
pins it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from dsec.core.errors import InvalidArgument

GENESIS = "0" * 64
_MAX = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEvent:
    """Who did what, to what, in which project, when, with which result."""

    ts: float
    actor: str  # e.g. "admin (key 1a2b...)" or "spiffe://dsec/edge/e0a1"
    action: str  # e.g. "sandbox.create", "key.revoke"
    project: str = ""
    target: str = ""  # sandbox id, key id, project name
    result: str = "ok"  # "ok" or an error code
    request_id: str = ""
    details: str = ""  # free text, e.g. the error message
    seq: int = 0  # assigned when stored
    prev_hash: str = ""
    hash: str = ""

    def __post_init__(self) -> None:
        if not self.actor or not self.action:
            raise InvalidArgument("an audit event needs an actor and an action")
        for name in ("actor", "action", "project", "target", "result", "request_id"):
            if len(getattr(self, name)) > _MAX:
                raise InvalidArgument(f"audit {name} longer than {_MAX} characters")
        if len(self.details) > 10 * _MAX:
            raise InvalidArgument("audit details too long")


# sorted: a dict built in this order dumps as ``sort_keys`` would, without the sort
_HASHED = tuple(sorted(f.name for f in fields(AuditEvent) if f.name != "hash"))


def _payload(e: AuditEvent, **override: object) -> bytes:
    """What the hash covers: every field but the hash, as sorted compact JSON."""
    body = {name: getattr(e, name) for name in _HASHED}
    body.update(override)  # fields of the event: their place in the order stays
    return json.dumps(body, separators=(",", ":")).encode()


def chain(prev: AuditEvent | None, event: AuditEvent, *, now: float = 0.0) -> AuditEvent:
    """``event`` as the entry after ``prev``: numbered, linked and hashed (an event without
    a time, ``ts`` 0, takes ``now``)."""
    seq = (prev.seq + 1) if prev else 1
    prev_hash = prev.hash if prev else GENESIS
    ts = event.ts or now
    digest = hashlib.sha256(_payload(event, ts=ts, seq=seq, prev_hash=prev_hash)).hexdigest()
    return replace(event, ts=ts, seq=seq, prev_hash=prev_hash, hash=digest)


def verify(entries: Iterable[AuditEvent], *, after: AuditEvent | None = None) -> int | None:
    """The seq of the first entry that breaks the chain, or None if all of it holds.

    ``entries`` must be consecutive and in order, starting after ``after`` (or at 1).
    """
    prev = after
    for e in entries:
        expected_seq = (prev.seq + 1) if prev else 1
        expected_prev = prev.hash if prev else GENESIS
        if e.seq != expected_seq or e.prev_hash != expected_prev:
            return e.seq if e.seq == expected_seq else expected_seq
        if hashlib.sha256(_payload(e)).hexdigest() != e.hash:
            return e.seq
        prev = e
    return None
