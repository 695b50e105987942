"""IAM state on any :class:`~dsec.store.api.StateStore` (etcd for a replicated IAM).

The same records and answers as :class:`dsec.iam.db.IamDb` (the SQLite default), laid out
as keys under ``/dsec/iam/``:

==========================  ========================================================
``projects/<path>``         quota limits (JSON)
``usage/<path>``            sandboxes, millicores and MiB allocated in the subtree
``alloc/<edge>/<sandbox>``  one allocation (project, amounts, time)
``keys/<key id>``           an API key: SHA-256 of its secret, subject, project, role
``grants/<path>/@<subj>``   a role granted to a subject on a project
``revocations/<seq>``       the revocation feed (``meta/revocation_seq`` is its head)
``audit/<seq>``             the audit hash chain (``meta/audit_head`` is its last entry)
``audit_ix/<f>/<h>/<seq>``  an index entry of ``audit/<seq>`` for a query by project,
                            actor or action (``f``: p, a, x; ``h``: a hash of the value)
``audit_ix/t/<ts>/<seq>``   the same by time
==========================  ========================================================

A query of the audit log ranges the index of its most selective filter (or ``audit/``
from the first sequence number asked for) a page at a time and stops when it has the
entries it returns: it reads what it answers, not the log.

Every mutation is one optimistic transaction (:mod:`dsec.iam.stm`) that reads what it
decides on and commits only if none of it changed, so several iam processes on one etcd
cluster stay exact. ``usage/`` is not a free counter: it changes only in the transaction
that adds or removes the allocation it sums, guarded by the same compare, so it cannot drift
from ``alloc/``. Within one process writes are serialized (no self-inflicted races), and a
burst of admissions is decided in one transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from dsec.core import projects
from dsec.core.audit import AuditEvent, chain, verify
from dsec.core.errors import (
    AlreadyExists,
    InvalidArgument,
    InvalidState,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from dsec.core.ids import edge_of, is_sandbox_id, parse_api_key, validate_edge_id
from dsec.iam.audit import AuditQuery
from dsec.iam.keys import hash_secret, new_api_key, secret_matches
from dsec.iam.quotas import check_admission, check_move, check_quota, settled
from dsec.iam.records import (
    DEFAULT_PROJECT,
    DEFAULT_QUOTA,
    KEY_ROLES,
    PLATFORM,
    Admission,
    Allocation,
    Grant,
    KeyRecord,
    Principal,
    Project,
    Usage,
    check_grant,
    milli,
    text,
)
from dsec.iam.stm import Stm, atomically
from dsec.store.api import StateStore

ROOT = b"/dsec/iam/"
MAX_BATCH = 60  # records per transaction (etcd allows 128 compares and 128 ops)
AUDIT_BATCH = 20  # audit entries per transaction (six keys each, the head once)
MAX_KEYS = 120  # keys one admission transaction reads (each read is a compare)
REVOCATION_KINDS = frozenset({"token", "key", "subject"})


def _k(*parts: str) -> bytes:
    return ROOT + "/".join(parts).encode()


def _seq(n: int) -> str:
    return f"{n:016d}"


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def _load(raw: bytes) -> Any:
    return json.loads(raw)


class KvIam:
    """IAM state on a store it does not own (the caller closes the store)."""

    def __init__(
        self, store: StateStore, *, clock: Callable[[], float] = time.time, retry_s: float = 30.0
    ) -> None:
        self.store = store
        self._clock = clock
        self._lock = asyncio.Lock()
        self._retry_s = retry_s
        self._indexed = False  # meta/audit_ix_from is known to be set

    async def _atomic(self, fn: Callable[[Stm], Any]) -> Any:
        return await atomically(self.store, fn, lock=self._lock, retry_s=self._retry_s)

    async def close(self) -> None:
        return None

    # -- audit chain -----------------------------------------------------------------------

    async def _audit(self, stm: Stm, event: AuditEvent) -> AuditEvent:
        raw = await stm.get(_k("meta", "audit_head"))
        head = AuditEvent(**_load(raw)) if raw else None
        entry = chain(head, event)
        body = _dump(asdict(entry))
        stm.put(_k("audit", _seq(entry.seq)), body)
        stm.put(_k("meta", "audit_head"), body)
        if not self._indexed:  # mark the first entry with index keys (in a log from before)
            if await stm.get(_k("meta", "audit_ix_from")) is None:
                stm.put(_k("meta", "audit_ix_from"), str(entry.seq).encode())
            else:
                self._indexed = True
        for field, value in (("p", entry.project), ("a", entry.actor), ("x", entry.action)):
            stm.put(_audit_ix(field, value) + _seq(entry.seq).encode(), b"")
        stm.put(_audit_ix("t") + _ts(entry.ts) + b"/" + _seq(entry.seq).encode(), b"")
        return entry

    async def append_audit(self, event: AuditEvent) -> AuditEvent:
        async def fn(stm: Stm) -> AuditEvent:
            e = event if event.ts else replace(event, ts=self._clock())
            return await self._audit(stm, e)

        result: AuditEvent = await self._atomic(fn)
        return result

    async def append_audit_many(self, events: Sequence[AuditEvent]) -> list[AuditEvent]:
        out: list[AuditEvent] = []
        for i in range(0, len(events), AUDIT_BATCH):

            async def fn(
                stm: Stm, chunk: Sequence[AuditEvent] = events[i : i + AUDIT_BATCH]
            ) -> list[AuditEvent]:
                now = self._clock()
                return [await self._audit(stm, e if e.ts else replace(e, ts=now)) for e in chunk]

            out += await self._atomic(fn)
        return out

    async def _entries(self) -> list[AuditEvent]:
        got = await self.store.range(_k("audit", ""))
        return [AuditEvent(**_load(kv.value)) for kv in got.kvs]

    async def query_audit(self, q: AuditQuery) -> list[AuditEvent]:
        want = max(1, min(q.limit, 10000))
        first = _seq(q.after_seq + 1).encode()
        if q.project or q.actor or (q.action and not q.action.endswith(".")):
            field, value = next((f, v) for f, v in (("p", q.project), ("a", q.actor),
                                                    ("x", q.action)) if v)  # fmt: skip
            prefix = _audit_ix(field, value)
            start = prefix + first
        elif q.since or q.until:
            prefix = _audit_ix("t")
            start = prefix + _ts(q.since)
        else:  # no filter (or only an action prefix): the log itself, from after_seq on
            prefix = _k("audit", "")
            start = prefix + first
        out: list[AuditEvent] = []
        raw = await self.store.get(_k("meta", "audit_ix_from"))
        indexed_from = int(raw.value) if raw else 1 << 62  # earlier entries have no index keys
        if prefix != _k("audit", "") and q.after_seq + 1 < indexed_from:
            out = await self._scan_unindexed(q, want, indexed_from)
            if raw is None:  # nothing is marked as indexed: the scan saw the whole log
                return out
        size = 16  # pages grow while a filter the index does not cover drops entries
        while len(out) < want:
            page = await self.store.range(prefix, start=start, limit=min(size, want - len(out)))
            size *= 2
            if not page.kvs:
                break
            start = page.kvs[-1].key + b"\x00"
            if prefix == _k("audit", ""):
                entries = [AuditEvent(**_load(kv.value)) for kv in page.kvs]
            else:
                seqs = [kv.key.rsplit(b"/", 1)[1].decode() for kv in page.kvs]
                got = await self.store.get_many([_k("audit", n) for n in seqs])
                entries = [AuditEvent(**_load(kv.value)) for kv in got if kv is not None]
            out += [e for e in entries if _matches(e, q)]
            if not page.more or (prefix == _audit_ix("t") and q.until and
                                 entries and entries[-1].ts >= q.until):  # fmt: skip
                break
        if prefix == _audit_ix("t"):
            out.sort(key=lambda e: e.seq)
        return out[:want]

    async def _scan_unindexed(self, q: AuditQuery, want: int, end: int) -> list[AuditEvent]:
        """Entries before ``end`` (written before the indexes existed) that match ``q``."""
        out: list[AuditEvent] = []
        start = _k("audit", _seq(q.after_seq + 1))
        while len(out) < want:
            page = await self.store.range(_k("audit", ""), start=start, limit=256)
            for kv in page.kvs:
                e = AuditEvent(**_load(kv.value))
                if e.seq >= end:
                    return out
                if _matches(e, q) and len(out) < want:
                    out.append(e)
            if not page.more:
                break
            start = page.kvs[-1].key + b"\x00"
        return out

    async def verify_audit(self) -> tuple[int, int | None, str]:
        entries = await self._entries()
        return len(entries), verify(entries), entries[-1].hash if entries else ""

    # -- revocations -----------------------------------------------------------------------

    async def _revoked(self, stm: Stm, kind: str, value: str, now: float) -> None:
        raw = await stm.get(_k("meta", "revocation_seq"))
        seq = int(raw) + 1 if raw else 1
        stm.put(_k("meta", "revocation_seq"), str(seq).encode())
        stm.put(_k("revocations", _seq(seq)), _dump([kind, value, now]))

    async def revocations_after(
        self, seq: int, limit: int = 10000
    ) -> list[tuple[int, str, str, float]]:
        got = await self.store.range(_k("revocations", ""))
        out = []
        for kv in got.kvs:
            n = int(kv.key.rsplit(b"/", 1)[1])
            if n > seq:
                kind, value, at = _load(kv.value)
                out.append((n, str(kind), str(value), float(at)))
                if len(out) >= limit:
                    break
        return out

    # -- projects --------------------------------------------------------------------------

    @staticmethod
    def _put_project(stm: Stm, p: Project, now: float, created: float | None) -> None:
        stm.put(
            _k("projects", p.name),
            _dump({"s": p.max_sandboxes, "c": milli(p.max_cpu), "m": p.max_memory_mb,
                   "t": now if created is None else created}),
        )  # fmt: skip

    async def put_project(
        self, project: Project, *, actor: str = "iam", request_id: str = ""
    ) -> Project:
        projects.validate(project.name)
        if project.max_sandboxes < 0 or project.max_cpu < 0 or project.max_memory_mb < 0:
            raise InvalidArgument("quota limits must be >= 0 (0 means no limit)")

        async def fn(stm: Stm) -> None:
            now = self._clock()
            up = projects.parent(project.name)
            if up and await stm.get(_k("projects", up)) is None:
                raise NotFound(f"no parent project {up!r}: create it first")
            old = await stm.get(_k("projects", project.name))
            self._put_project(stm, project, now, _load(old)["t"] if old else None)
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action="project.put", project=project.name,
                target=project.name, request_id=request_id,
                details=f"max_sandboxes={project.max_sandboxes} max_cpu={project.max_cpu:g} "
                        f"max_memory_mb={project.max_memory_mb}",
            ))  # fmt: skip

        await self._atomic(fn)
        return await self.get_project(project.name)

    async def get_project(self, name: str) -> Project:
        kv = await self.store.get(_k("projects", name))
        if kv is None:
            raise NotFound(f"no project {name!r}")
        return _project(name, _load(kv.value))

    async def list_projects(self) -> list[Project]:
        got = await self.store.range(_k("projects", ""))
        skip = len(_k("projects", ""))
        return sorted(
            (_project(kv.key[skip:].decode(), _load(kv.value)) for kv in got.kvs),
            key=lambda p: p.name,
        )

    async def usage(self, project: str) -> Usage:
        p = await self.get_project(project)
        kv = await self.store.get(_k("usage", project))
        n, c, m = _load(kv.value) if kv else (0, 0, 0)
        return Usage(p, n, c / 1000, m)

    async def delete_project(self, name: str, *, actor: str = "iam", request_id: str = "") -> None:
        async def fn(stm: Stm) -> None:
            if await stm.get(_k("projects", name)) is None:
                raise NotFound(f"no project {name!r}")
            children = len(await stm.range(_k("projects", name + "/")))
            if children:
                raise InvalidState(
                    f"project {name!r} has {children} sub-projects; delete them first"
                )
            raw = await stm.get(_k("usage", name))
            live = _load(raw)[0] if raw else 0
            if live:
                raise InvalidState(
                    f"project {name!r} still has {live} live sandboxes; kill them first"
                )
            now = self._clock()
            for kv in await stm.range(_k("keys", "")):
                rec = _load(kv.value)
                if rec["project"] == name:
                    if rec["revoked_at"] is None:
                        await self._revoked(stm, "key", kv.key.rsplit(b"/", 1)[1].decode(), now)
                    stm.delete(kv.key)
            for kv in await stm.range(_k("grants", name + "/@")):
                stm.delete(kv.key)
            stm.delete(_k("projects", name))
            stm.delete(_k("usage", name))
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action="project.delete", project=name, target=name,
                request_id=request_id,
            ))  # fmt: skip

        await self._atomic(fn)

    # -- role grants -----------------------------------------------------------------------

    async def grant_role(
        self, project: str, subject: str, role: str, *, actor: str = "iam", request_id: str = ""
    ) -> None:
        check_grant(project, subject, role)

        async def fn(stm: Stm) -> None:
            if project != PLATFORM and await stm.get(_k("projects", project)) is None:
                raise NotFound(f"no project {project!r}")
            if role:
                stm.put(_grant_key(project, subject), role.encode())
            else:
                stm.delete(_grant_key(project, subject))
            await self._audit(stm, AuditEvent(
                ts=self._clock(), actor=actor, action="role.grant" if role else "role.remove",
                project=project, target=subject, request_id=request_id, details=f"role={role}",
            ))  # fmt: skip

        await self._atomic(fn)

    async def list_grants(self, subject: str = "", project: str = "") -> list[Grant]:
        got = await self.store.range(_k("grants", ""))
        skip = len(_k("grants", ""))
        out = []
        for kv in got.kvs:
            proj, _, subj = kv.key[skip:].decode().rpartition("/@")
            if (not subject or subj == subject) and (not project or proj == project):
                out.append(Grant(proj, subj, kv.value.decode()))
        return sorted(out, key=lambda g: (g.project, g.subject))

    # -- joining nodes ---------------------------------------------------------------------

    async def create_join_token(
        self, token_id: str, secret: str, ttl_s: float, *, actor: str = "iam",
        request_id: str = "",
    ) -> float:  # fmt: skip
        async def fn(stm: Stm) -> float:
            now = self._clock()
            rec = {"h": hash_secret(secret), "exp": now + ttl_s, "used_by": None}
            stm.put(_k("join_tokens", token_id), _dump(rec))
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action="cluster.token.create", target=token_id,
                request_id=request_id, details=f"ttl_s={ttl_s:g}",
            ))  # fmt: skip
            return now + ttl_s

        expires: float = await self._atomic(fn)
        return expires

    async def redeem_join_token(self, token_id: str, secret: str, edge_id: str) -> None:
        async def fn(stm: Stm) -> None:
            raw = await stm.get(_k("join_tokens", token_id))
            rec = _load(raw) if raw else None
            now = self._clock()
            if (not secret_matches(rec["h"] if rec else None, secret) or rec is None
                    or rec["exp"] < now or rec["used_by"] is not None):  # fmt: skip
                raise Unauthenticated("invalid, expired or used bootstrap token")
            if await stm.get(_k("edges", edge_id)) is not None:
                raise AlreadyExists(f"an edge {edge_id!r} has joined already")
            stm.put(_k("join_tokens", token_id), _dump({**rec, "used_by": edge_id}))
            stm.put(_k("edges", edge_id), repr(now).encode())
            await self._audit(stm, AuditEvent(
                ts=now, actor=f"edge {edge_id}", action="cluster.join", target=edge_id,
                details=f"token={token_id}",
            ))  # fmt: skip

        await self._atomic(fn)

    # -- keys ------------------------------------------------------------------------------

    async def bootstrap(self, write_admin_key: Callable[[str, str], None]) -> bool:
        async def fn(stm: Stm) -> bool:
            if await stm.get(_k("meta", "bootstrapped")) is not None:
                return False
            now = self._clock()
            if await stm.get(_k("projects", DEFAULT_PROJECT)) is None:
                self._put_project(stm, DEFAULT_QUOTA, now, None)
            key_id, token = self._new_key(stm, "admin", DEFAULT_PROJECT, "admin", "bootstrap", now)
            write_admin_key(key_id, token)
            stm.put(_grant_key(PLATFORM, "admin"), b"admin")
            stm.put(_k("meta", "bootstrapped"), repr(now).encode())
            await self._audit(stm, AuditEvent(
                ts=now, actor="iam", action="iam.bootstrap", project=DEFAULT_PROJECT,
                target=key_id,
            ))  # fmt: skip
            return True

        done: bool = await self._atomic(fn)
        return done

    @staticmethod
    def _new_key(
        stm: Stm, subject: str, project: str, role: str, name: str, now: float
    ) -> tuple[str, str]:
        key_id, secret_hash, token = new_api_key()
        stm.put(_k("keys", key_id), _dump({
            "h": secret_hash, "subject": subject, "project": project, "role": role,
            "name": name, "t": now, "revoked_at": None,
        }))  # fmt: skip
        return key_id, token

    async def create_key(
        self, subject: str, project: str, role: str, name: str, *, actor: str = "iam",
        request_id: str = "",
    ) -> tuple[str, KeyRecord]:  # fmt: skip
        text(subject, "subject")
        text(name, "key name", required=False)
        if role not in KEY_ROLES:
            raise InvalidArgument(f"role must be one of {sorted(KEY_ROLES)}, got {role!r}")

        async def fn(stm: Stm) -> tuple[str, str]:
            if await stm.get(_k("projects", project)) is None:
                raise NotFound(f"no project {project!r}")
            now = self._clock()
            key_id, token = self._new_key(stm, subject, project, role, name, now)
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action="key.create", project=project, target=key_id,
                request_id=request_id, details=f"subject={subject} role={role}",
            ))  # fmt: skip
            return key_id, token

        key_id, token = await self._atomic(fn)
        return token, await self.get_key(key_id)

    async def get_key(self, key_id: str) -> KeyRecord:
        kv = await self.store.get(_k("keys", key_id))
        if kv is None:
            raise NotFound(f"no API key {key_id!r}")
        return _key(key_id, _load(kv.value))

    async def list_keys(self, project: str = "") -> list[KeyRecord]:
        got = await self.store.range(_k("keys", ""))
        keys = [_key(kv.key.rsplit(b"/", 1)[1].decode(), _load(kv.value)) for kv in got.kvs]
        return sorted(
            (k for k in keys if not project or k.project == project), key=lambda k: k.created_at
        )

    async def revoke_key(self, key_id: str, *, actor: str = "iam", request_id: str = "") -> None:
        async def fn(stm: Stm) -> None:
            raw = await stm.get(_k("keys", key_id))
            if raw is None:
                raise NotFound(f"no API key {key_id!r}")
            rec = _load(raw)
            now = self._clock()
            if rec["revoked_at"] is None:
                stm.put(_k("keys", key_id), _dump({**rec, "revoked_at": now}))
            await self._revoked(stm, "key", key_id, now)
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action="key.revoke", project=rec["project"], target=key_id,
                request_id=request_id,
            ))  # fmt: skip

        await self._atomic(fn)

    async def revoke(
        self, kind: str, value: str, *, actor: str = "iam", request_id: str = ""
    ) -> None:
        if kind not in REVOCATION_KINDS:
            raise InvalidArgument(f"kind must be one of {sorted(REVOCATION_KINDS)}, got {kind!r}")
        text(value, f"{kind} to revoke")
        if kind == "key":
            await self.revoke_key(value, actor=actor, request_id=request_id)
            return

        async def fn(stm: Stm) -> None:
            now = self._clock()
            await self._revoked(stm, kind, value, now)
            if kind == "subject":
                for kv in await stm.range(_k("keys", "")):
                    rec = _load(kv.value)
                    if rec["subject"] == value and rec["revoked_at"] is None:
                        stm.put(kv.key, _dump({**rec, "revoked_at": now}))
                        await self._revoked(stm, "key", kv.key.rsplit(b"/", 1)[1].decode(), now)
            await self._audit(stm, AuditEvent(
                ts=now, actor=actor, action=f"{kind}.revoke", target=value, request_id=request_id,
            ))  # fmt: skip

        await self._atomic(fn)

    async def authenticate(self, api_key: str) -> Principal:
        try:
            key_id, secret = parse_api_key(api_key)
        except InvalidArgument as e:
            raise Unauthenticated("invalid API key") from e
        kv = await self.store.get(_k("keys", key_id))
        rec = _load(kv.value) if kv else None
        if not secret_matches(rec["h"] if rec else None, secret) or rec is None:
            raise Unauthenticated("invalid API key")
        if rec["revoked_at"] is not None:
            raise Unauthenticated("invalid API key")
        return Principal(rec["subject"], rec["project"], rec["role"], key_id)

    # -- allocations -----------------------------------------------------------------------

    async def admit(
        self, project: str, sandbox_id: str, cpu: float, memory_mb: int, edge_id: str = ""
    ) -> bool:
        (result,) = await self.admit_many([Admission(project, sandbox_id, cpu, memory_mb, edge_id)])
        if isinstance(result, Exception):
            raise result
        return result

    async def admit_many(self, batch: Sequence[Admission]) -> list[bool | Exception]:
        out: list[bool | Exception] = []
        chunk: list[Admission] = []
        keys: set[bytes] = set()
        for a in batch:  # one transaction reads (compares) at most MAX_KEYS keys
            mine = _admission_keys(a)
            if chunk and len(keys | mine) > MAX_KEYS:
                out += await self._admit_batch(chunk)
                chunk, keys = [], set()
            chunk.append(a)
            keys |= mine
        if chunk:
            out += await self._admit_batch(chunk)
        return out

    async def admit_and_append(
        self, admissions: Sequence[Admission], events: Sequence[AuditEvent]
    ) -> tuple[Sequence[bool | Exception], Sequence[AuditEvent | Exception]]:
        """:meth:`admit_many` and :meth:`append_audit_many` side by side, each in its own
        transactions (a store transaction holds only so many keys), so one failing leaves
        the other's answers standing."""
        admitted: list[Any] | BaseException
        appended: list[Any] | BaseException
        admitted, appended = await asyncio.gather(
            self.admit_many(admissions) if admissions else _nothing(),
            self.append_audit_many(events) if events else _nothing(),
            return_exceptions=True,
        )
        return _each(admitted, len(admissions)), _each(appended, len(events))

    async def _admit_batch(self, batch: Sequence[Admission]) -> list[bool | Exception]:
        async def fn(stm: Stm) -> list[bool | Exception]:
            await stm.prefetch(sorted(set().union(*(_admission_keys(a) for a in batch))))
            now = self._clock()
            results: list[bool | Exception] = []
            for a in batch:
                mark = stm.mark()
                try:
                    results.append(await self._admit_one(stm, a, now))
                except Exception as exc:
                    stm.undo(mark)
                    results.append(exc)
            return results

        result: list[bool | Exception] = await self._atomic(fn)
        return result

    async def _admit_one(self, stm: Stm, a: Admission, now: float) -> bool:
        cpu_milli = check_admission(a)
        chain_ = []
        for level in projects.ancestors(a.project):
            raw = await stm.get(_k("projects", level))
            if raw is None:
                raise NotFound(f"no project {level!r}")
            q = _load(raw)
            chain_.append((level, (int(q["s"]), int(q["c"]), int(q["m"]))))
        have = await stm.get(_alloc_key(a.sandbox_id))
        if have is not None:
            if _load(have)["p"] != a.project:
                raise AlreadyExists(f"sandbox {a.sandbox_id} is allocated to another project")
            return False
        used = {}
        for level, limits in chain_:
            raw = await stm.get(_k("usage", level))
            used[level] = tuple(_load(raw)) if raw else (0, 0, 0)
            if limits != (0, 0, 0):
                check_quota(level, limits, used[level], cpu_milli, a.memory_mb)
        for level, (n, c, m) in used.items():
            stm.put(_k("usage", level), _dump([n + 1, c + cpu_milli, m + a.memory_mb]))
        stm.put(
            _alloc_key(a.sandbox_id),
            _dump({"p": a.project, "c": cpu_milli, "m": a.memory_mb, "t": now}),
        )
        return True

    @staticmethod
    async def _free(stm: Stm, sandbox_id: str, rec: dict[str, Any]) -> None:
        for level in projects.ancestors(rec["p"]):
            raw = await stm.get(_k("usage", level))
            n, c, m = _load(raw) if raw else (1, rec["c"], rec["m"])
            stm.put(_k("usage", level), _dump([n - 1, c - rec["c"], m - rec["m"]]))
        stm.delete(_alloc_key(sandbox_id))

    async def release(self, sandbox_id: str, *, edge_id: str = "") -> Allocation | None:
        if not is_sandbox_id(sandbox_id):
            return None

        async def fn(stm: Stm) -> Allocation | None:
            raw = await stm.get(_alloc_key(sandbox_id))
            if raw is None:
                return None
            rec = _load(raw)
            alloc = _alloc(sandbox_id, rec)
            if edge_id and alloc.edge_id != edge_id:
                raise PermissionDenied(f"edge {edge_id} may not release {sandbox_id}")
            await self._free(stm, sandbox_id, rec)
            return alloc

        result: Allocation | None = await self._atomic(fn)
        return result

    async def move_allocation(self, old: str, new: str) -> Allocation:
        check_move(old, new)

        async def fn(stm: Stm) -> Allocation:
            have_old = await stm.get(_alloc_key(old))
            have_new = await stm.get(_alloc_key(new))
            if have_old is not None and have_new is not None:
                raise AlreadyExists(f"sandboxes {old} and {new} both hold an allocation")
            undone = await stm.get(_move_key(new))
            if undone is not None and _load(undone)["n"] == old:  # a move renamed back
                stm.delete(_move_key(new))
            if have_new is not None:
                return _alloc(new, _load(have_new))
            if have_old is None:
                raise NotFound(f"sandbox {old} holds no allocation")
            # created now: the new edge's reconcile grace covers it as for an admission
            rec = {**_load(have_old), "t": self._clock()}
            stm.delete(_alloc_key(old))
            stm.put(_alloc_key(new), _dump(rec))
            stm.put(_move_key(old), _dump({**rec, "n": new}))  # the allocation, as renamed
            return _alloc(new, rec)

        result: Allocation = await self._atomic(fn)
        return result

    async def settle_moves(
        self, edge_id: str, live: Sequence[str], grace_s: float, running: Sequence[str] = ()
    ) -> tuple[list[tuple[str, str]], list[str]]:
        validate_edge_id(edge_id)
        keep = set(live)
        cutoff = self._clock() - grace_s
        allocs = await self.store.range(_k("alloc", edge_id, ""))
        held = {kv.key.rsplit(b"/", 1)[1].decode() for kv in allocs.kvs}
        got = await self.store.range(_k("moves", edge_id, ""))
        moves: dict[str, tuple[str, float]] = {}
        for kv in got.kvs:
            rec = _load(kv.value)
            moves[kv.key.rsplit(b"/", 1)[1].decode()] = (str(rec["n"]), float(rec["t"]))
        done = [o for o, (_, at) in moves.items() if o not in keep and at <= cutoff]
        for i in range(0, len(done), MAX_BATCH):

            async def forget(stm: Stm, batch: list[str] = done[i : i + MAX_BATCH]) -> None:
                for o in batch:
                    stm.delete(_move_key(o))

            await self._atomic(forget)
        moved, unallocated, back = settled(live, held, moves, cutoff, running)
        for old, new in back:
            try:
                await self.move_allocation(new, old)
            except NotFound:  # the new one is gone too, its allocation with it
                if not await self._count_again(old, new):
                    continue
            unallocated.remove(old)
        return moved, unallocated

    async def _count_again(self, old: str, new: str) -> bool:
        """As :meth:`dsec.iam.quotas.QuotasMixin._count_again`."""

        async def fn(stm: Stm) -> bool:
            raw = await stm.get(_move_key(old))
            rec = _load(raw) if raw is not None else {}
            if rec.get("n") != new or "p" not in rec:  # from before moves kept the amounts
                return False
            if await stm.get(_k("projects", rec["p"])) is None:
                return False
            if await stm.get(_alloc_key(old)) is None:
                for level in projects.ancestors(rec["p"]):
                    got = await stm.get(_k("usage", level))
                    n, c, m = _load(got) if got else (0, 0, 0)
                    stm.put(_k("usage", level), _dump([n + 1, c + rec["c"], m + rec["m"]]))
                alloc = {"p": rec["p"], "c": rec["c"], "m": rec["m"], "t": self._clock()}
                stm.put(_alloc_key(old), _dump(alloc))
            stm.delete(_move_key(old))
            return True

        done: bool = await self._atomic(fn)
        return done

    async def reconcile(self, edge_id: str, live: Sequence[str], grace_s: float) -> list[str]:
        validate_edge_id(edge_id)
        keep = set(live)

        async def fn(stm: Stm) -> list[str]:
            cutoff = self._clock() - grace_s
            gone = []
            for kv in await stm.range(_k("alloc", edge_id, "")):
                sid = kv.key.rsplit(b"/", 1)[1].decode()
                rec = _load(kv.value)
                if rec["t"] <= cutoff and sid not in keep:
                    gone.append(sid)
                    await self._free(stm, sid, rec)
                    if len(gone) >= MAX_BATCH:
                        break
            return gone

        gone: list[str] = []
        while True:  # a batch at a time (one transaction holds at most MAX_BATCH deletes)
            step: list[str] = await self._atomic(fn)
            gone += step
            keep.update(step)
            if len(step) < MAX_BATCH:
                return gone

    async def allocations(self, *, edge_id: str = "") -> list[Allocation]:
        got = await self.store.range(_k("alloc", edge_id, "") if edge_id else _k("alloc", ""))
        allocs = [_alloc(kv.key.rsplit(b"/", 1)[1].decode(), _load(kv.value)) for kv in got.kvs]
        return sorted(allocs, key=lambda a: a.created_at)


def _audit_ix(field: str, value: str = "") -> bytes:
    """The prefix of one audit index: by time (``t``), or of one value of a field."""
    if field == "t":
        return _k("audit_ix", "t", "")
    digest = hashlib.blake2b(value.encode(), digest_size=10).hexdigest()
    return _k("audit_ix", field, digest, "")


def _ts(ts: float) -> bytes:
    """A time as a key part that sorts like the number."""
    return f"{max(ts, 0.0):020.6f}".encode()


def _matches(e: AuditEvent, q: AuditQuery) -> bool:
    if e.seq <= q.after_seq or (q.since and e.ts < q.since) or (q.until and e.ts >= q.until):
        return False
    if (q.project and e.project != q.project) or (q.actor and e.actor != q.actor):
        return False
    return not q.action or (
        e.action.startswith(q.action) if q.action.endswith(".") else e.action == q.action
    )


def _admission_keys(a: Admission) -> set[bytes]:
    """The keys deciding ``a`` reads: its project chain, their usage, its allocation."""
    keys = {_k(kind, lv) for lv in _levels(a.project) for kind in ("projects", "usage")}
    if is_sandbox_id(a.sandbox_id):
        keys.add(_alloc_key(a.sandbox_id))
    return keys


def _levels(project: str) -> list[str]:
    try:
        return projects.ancestors(projects.validate(project))
    except InvalidArgument:
        return []


def _grant_key(project: str, subject: str) -> bytes:
    return _k("grants", f"{project}/@{subject}")


def _alloc_key(sandbox_id: str) -> bytes:
    return _k("alloc", edge_of(sandbox_id), sandbox_id)


def _move_key(old: str) -> bytes:
    """A sandbox moved to another edge, under its old id: ``{"n": new id, "t": when}`` and
    the allocation it had (``p``, ``c``, ``m``: project, millicores, MiB)."""
    return _k("moves", edge_of(old), old)


# The layout, for tools that write state in bulk (bench/cluster.py).
alloc_key = _alloc_key
dump = _dump


def usage_key(project: str) -> bytes:
    return _k("usage", project)


def _project(name: str, q: dict[str, Any]) -> Project:
    return Project(name, int(q["s"]), int(q["c"]) / 1000, int(q["m"]))


def _key(key_id: str, r: dict[str, Any]) -> KeyRecord:
    return KeyRecord(
        key_id, r["subject"], r["project"], r["role"], r["name"], float(r["t"]),
        r["revoked_at"] is not None,
    )  # fmt: skip


def _alloc(sandbox_id: str, r: dict[str, Any]) -> Allocation:
    return Allocation(
        sandbox_id, r["p"], edge_of(sandbox_id), int(r["c"]) / 1000, int(r["m"]), float(r["t"])
    )


async def _nothing() -> list[Any]:
    return []


def _each(result: list[Any] | BaseException, n: int) -> list[Any]:
    """A batch's answers, or its one failure as every item's answer."""
    if isinstance(result, Exception):
        return [result] * n
    if isinstance(result, BaseException):  # cancelled: not an answer
        raise result
    return result
