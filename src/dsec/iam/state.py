"""What the iam service needs from its state, and where that state lives.

:class:`IamState` is the async interface; two implementations give the same answers
(``tests/unit/test_iam_db.py`` and ``test_iam_projects.py`` run on both):

- :class:`SqliteIam`: the embedded default, :class:`dsec.iam.db.IamDb` run on one
  dedicated thread (so the event loop never waits on SQLite or an fsync);
- :class:`dsec.iam.kv.KvIam`: keys in a :class:`~dsec.store.api.StateStore`, e.g. a
  3-member etcd cluster, so several iam processes can share one replicated state.

:func:`open_state` picks one from a store URL: ``""`` or ``sqlite:`` (``<home>/iam.db``),
``etcd://host:port,host:port`` (TLS material from ``etcd_tls``), or ``memory:`` (tests).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from dsec.core.audit import AuditEvent
from dsec.core.errors import InvalidArgument
from dsec.iam.audit import AuditQuery
from dsec.iam.db import IamDb
from dsec.iam.records import (
    Admission,
    Allocation,
    Grant,
    KeyRecord,
    Principal,
    Project,
    Usage,
)
from dsec.store.api import StateStore

_T = TypeVar("_T")


class IamState(Protocol):
    async def bootstrap(self, write_admin_key: Callable[[str, str], None]) -> bool: ...
    async def create_key(
        self, subject: str, project: str, role: str, name: str, *, actor: str = ...,
        request_id: str = ...,
    ) -> tuple[str, KeyRecord]: ...  # fmt: skip
    async def get_key(self, key_id: str) -> KeyRecord: ...
    async def list_keys(self, project: str = "") -> list[KeyRecord]: ...
    async def revoke_key(self, key_id: str, *, actor: str = ..., request_id: str = ...) -> None: ...
    async def revoke(
        self, kind: str, value: str, *, actor: str = ..., request_id: str = ...
    ) -> None: ...
    async def revocations_after(
        self, seq: int, limit: int = 10000
    ) -> list[tuple[int, str, str, float]]: ...
    async def append_audit(self, event: AuditEvent) -> AuditEvent: ...
    async def append_audit_many(self, events: Sequence[AuditEvent]) -> list[AuditEvent]: ...
    async def query_audit(self, q: AuditQuery) -> list[AuditEvent]: ...
    async def verify_audit(self) -> tuple[int, int | None, str]: ...
    async def authenticate(self, api_key: str) -> Principal: ...
    async def put_project(
        self, project: Project, *, actor: str = ..., request_id: str = ...
    ) -> Project: ...
    async def get_project(self, name: str) -> Project: ...
    async def list_projects(self) -> list[Project]: ...
    async def admit_many(self, batch: Sequence[Admission]) -> list[bool | Exception]: ...
    async def admit_and_append(
        self, admissions: Sequence[Admission], events: Sequence[AuditEvent]
    ) -> tuple[Sequence[bool | Exception], Sequence[AuditEvent | Exception]]: ...
    async def release(self, sandbox_id: str, *, edge_id: str = "") -> Allocation | None: ...
    async def reconcile(self, edge_id: str, live: Sequence[str], grace_s: float) -> list[str]: ...
    async def move_allocation(self, old: str, new: str) -> Allocation: ...
    async def settle_moves(
        self, edge_id: str, live: Sequence[str], grace_s: float, running: Sequence[str] = ()
    ) -> tuple[list[tuple[str, str]], list[str]]: ...
    async def usage(self, project: str) -> Usage: ...
    async def delete_project(
        self, name: str, *, actor: str = ..., request_id: str = ...
    ) -> None: ...
    async def allocations(self, *, edge_id: str = "") -> list[Allocation]: ...
    async def grant_role(
        self, project: str, subject: str, role: str, *, actor: str = ..., request_id: str = ...
    ) -> None: ...
    async def list_grants(self, subject: str = "", project: str = "") -> list[Grant]: ...
    async def create_join_token(
        self, token_id: str, secret: str, ttl_s: float, *, actor: str = ...,
        request_id: str = ...,
    ) -> float: ...  # fmt: skip
    async def redeem_join_token(self, token_id: str, secret: str, edge_id: str) -> None: ...
    async def close(self) -> None: ...


class SqliteIam:
    """:class:`IamDb` behind the async interface: every call on one database thread."""

    def __init__(self, db: IamDb) -> None:
        self.db = db
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iam-db")

    async def _run(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    async def close(self) -> None:
        await self._run(self.db.close)
        self._pool.shutdown(wait=True)

    async def bootstrap(self, write_admin_key: Callable[[str, str], None]) -> bool:
        return await self._run(self.db.bootstrap, write_admin_key)

    async def create_key(
        self, subject: str, project: str, role: str, name: str, *, actor: str = "iam",
        request_id: str = "",
    ) -> tuple[str, KeyRecord]:  # fmt: skip
        return await self._run(
            self.db.create_key, subject, project, role, name, actor=actor, request_id=request_id
        )

    async def get_key(self, key_id: str) -> KeyRecord:
        return await self._run(self.db.get_key, key_id)

    async def list_keys(self, project: str = "") -> list[KeyRecord]:
        return await self._run(self.db.list_keys, project)

    async def revoke_key(self, key_id: str, *, actor: str = "iam", request_id: str = "") -> None:
        await self._run(self.db.revoke_key, key_id, actor=actor, request_id=request_id)

    async def revoke(
        self, kind: str, value: str, *, actor: str = "iam", request_id: str = ""
    ) -> None:
        await self._run(self.db.revoke, kind, value, actor=actor, request_id=request_id)

    async def revocations_after(
        self, seq: int, limit: int = 10000
    ) -> list[tuple[int, str, str, float]]:
        return await self._run(self.db.revocations_after, seq, limit)

    async def append_audit(self, event: AuditEvent) -> AuditEvent:
        return await self._run(self.db.append_audit, event)

    async def append_audit_many(self, events: Sequence[AuditEvent]) -> list[AuditEvent]:
        return await self._run(self.db.append_audit_many, events)

    async def query_audit(self, q: AuditQuery) -> list[AuditEvent]:
        return await self._run(self.db.query_audit, q)

    async def verify_audit(self) -> tuple[int, int | None, str]:
        return await self._run(self.db.verify_audit)

    async def authenticate(self, api_key: str) -> Principal:
        return await self._run(self.db.authenticate, api_key)

    async def put_project(
        self, project: Project, *, actor: str = "iam", request_id: str = ""
    ) -> Project:
        return await self._run(self.db.put_project, project, actor=actor, request_id=request_id)

    async def get_project(self, name: str) -> Project:
        return await self._run(self.db.get_project, name)

    async def list_projects(self) -> list[Project]:
        return await self._run(self.db.list_projects)

    async def admit_many(self, batch: Sequence[Admission]) -> list[bool | Exception]:
        return await self._run(self.db.admit_many, batch)

    async def admit_and_append(
        self, admissions: Sequence[Admission], events: Sequence[AuditEvent]
    ) -> tuple[Sequence[bool | Exception], Sequence[AuditEvent | Exception]]:
        return await self._run(self.db.admit_and_append, admissions, events)

    async def release(self, sandbox_id: str, *, edge_id: str = "") -> Allocation | None:
        return await self._run(self.db.release, sandbox_id, edge_id=edge_id)

    async def reconcile(self, edge_id: str, live: Sequence[str], grace_s: float) -> list[str]:
        return await self._run(self.db.reconcile, edge_id, live, grace_s)

    async def move_allocation(self, old: str, new: str) -> Allocation:
        return await self._run(self.db.move_allocation, old, new)

    async def settle_moves(
        self, edge_id: str, live: Sequence[str], grace_s: float, running: Sequence[str] = ()
    ) -> tuple[list[tuple[str, str]], list[str]]:
        return await self._run(self.db.settle_moves, edge_id, live, grace_s, running)

    async def usage(self, project: str) -> Usage:
        return await self._run(self.db.usage, project)

    async def delete_project(self, name: str, *, actor: str = "iam", request_id: str = "") -> None:
        await self._run(self.db.delete_project, name, actor=actor, request_id=request_id)

    async def allocations(self, *, edge_id: str = "") -> list[Allocation]:
        return await self._run(self.db.allocations, edge_id=edge_id)

    async def grant_role(
        self, project: str, subject: str, role: str, *, actor: str = "iam", request_id: str = ""
    ) -> None:
        await self._run(
            self.db.grant_role, project, subject, role, actor=actor, request_id=request_id
        )

    async def list_grants(self, subject: str = "", project: str = "") -> list[Grant]:
        return await self._run(self.db.list_grants, subject, project)

    async def create_join_token(
        self, token_id: str, secret: str, ttl_s: float, *, actor: str = "iam",
        request_id: str = "",
    ) -> float:  # fmt: skip
        return await self._run(self.db.create_join_token, token_id, secret, ttl_s, actor=actor,
                               request_id=request_id)  # fmt: skip

    async def redeem_join_token(self, token_id: str, secret: str, edge_id: str) -> None:
        await self._run(self.db.redeem_join_token, token_id, secret, edge_id)


async def open_state(
    url: str, home: Path, *, etcd_tls_dir: Path | None = None
) -> tuple[IamState, StateStore | None]:
    """The state named by ``url`` and the store under it (None for SQLite) to close after it.

    Raises:
        InvalidArgument: an unknown scheme, or etcd without endpoints.
    """
    from dsec.iam.kv import KvIam

    if url in ("", "sqlite:", "sqlite"):
        db = await asyncio.to_thread(IamDb, home / "iam.db")
        return SqliteIam(db), None
    if url == "memory:":
        from dsec.store.memory import MemoryStore

        mem = MemoryStore()
        return KvIam(mem), mem
    if url.startswith("etcd://"):
        from dsec.store.etcd import EtcdStore, EtcdTls

        endpoints = [e for e in url.removeprefix("etcd://").split(",") if e]
        if not endpoints:
            raise InvalidArgument(f"no etcd endpoints in {url!r}")
        tls = None
        if etcd_tls_dir is not None:
            tls = EtcdTls(
                (etcd_tls_dir / "ca.pem").read_bytes(),
                (etcd_tls_dir / "client.pem").read_bytes(),
                (etcd_tls_dir / "client-key.pem").read_bytes(),
            )
        store = EtcdStore(endpoints, tls=tls, retry_s=30.0)
        return KvIam(store), store
    raise InvalidArgument(
        f"unknown IAM store {url!r}: use sqlite:, etcd://HOST:PORT,... or memory:"
    )
