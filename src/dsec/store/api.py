"""The state store interface: the subset of etcd v3 that the control plane needs.

Semantics every backend keeps (and ``dsec.testing.check_state_store`` checks):

- One global revision, starting at 1 for an empty store, that grows by exactly one for each
  transaction that changes at least one key; reads and no-op writes leave it alone.
- Each key carries ``create_revision``, ``mod_revision``, ``version`` (writes since it was
  created; a delete ends the key, a later put starts again at 1) and ``lease``.
- Keys are bytes ordered lexicographically; a prefix ``p`` is the range ``[p, prefix_end(p))``.
- :class:`Compare` tests ``version``, ``create_revision``, ``mod_revision`` or ``value`` with
  ``= != < >``; over a prefix it holds when it holds for every key in it, an empty range
  compares as one absent key (all revisions 0), and a value compare on an absent key is false.
  Create-if-absent is ``Compare(key, Target.CREATE, Op.EQ, 0)``.
- Limits mirror etcd's defaults: at most :data:`MAX_TXN_OPS` compares and ops on each branch,
  values up to :data:`MAX_VALUE_BYTES`.
- A lease deletes all its keys in one revision when it expires or is revoked.
- :meth:`StateStore.watch` yields batches (one per revision) from ``start_revision`` on (0:
  from when iteration starts; the watch is set up by the first ``anext``);
  history older than the compaction point raises :class:`~dsec.core.errors.Compacted`, and the
  caller then lists at a revision R and watches from R + 1.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from dsec.core.errors import InvalidArgument, TxnTooLarge, ValueTooLarge

MAX_TXN_OPS = 128
MAX_VALUE_BYTES = 1024 * 1024
MAX_KEY_BYTES = 4096


class Target(enum.Enum):
    VERSION = "version"
    CREATE = "create_revision"
    MOD = "mod_revision"
    VALUE = "value"


class Op(enum.Enum):
    EQ = "="
    NE = "!="
    LT = "<"
    GT = ">"


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction; ``prefix=True`` applies it to every key under ``key``."""

    key: bytes
    target: Target
    op: Op
    operand: int | bytes
    prefix: bool = False

    def holds(self, kvs: Sequence[KeyValue]) -> bool:
        """Evaluate against the keys the compare covers (at the transaction's revision)."""
        if not kvs:
            return self.check(None)
        for kv in kvs:
            if self.target is Target.VALUE:
                actual: int | bytes = kv.value
            elif self.target is Target.VERSION:
                actual = kv.version
            elif self.target is Target.CREATE:
                actual = kv.create_revision
            else:
                actual = kv.mod_revision
            if not self.check(actual):
                return False
        return True

    def check(self, actual: int | bytes | None) -> bool:
        """Evaluate against the tested field of one key (None: no such key)."""
        if actual is None:
            return self.target is not Target.VALUE and _cmp(0, self.op, self.operand)
        return _cmp(actual, self.op, self.operand)


def _cmp(actual: int | bytes, op: Op, operand: int | bytes) -> bool:
    if isinstance(actual, bytes) != isinstance(operand, bytes):
        raise InvalidArgument("a value compare takes bytes, a revision or version compare an int")
    a, b = actual, operand
    if op is Op.EQ:
        return a == b
    if op is Op.NE:
        return a != b
    if op is Op.LT:
        return a < b  # type: ignore[operator]
    return a > b  # type: ignore[operator]


@dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    key: bytes
    prefix: bool = False


TxnOp = Put | Delete


@dataclass(frozen=True)
class RangeResult:
    kvs: tuple[KeyValue, ...]
    revision: int  # the store revision the range was read at
    more: bool = False  # a limit cut the result short
    count: int = 0  # keys in the range (before the limit)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # the store revision after the transaction
    deleted: tuple[int, ...] = ()  # keys deleted by each Delete op of the branch that ran


@dataclass(frozen=True)
class Event:
    type: EventType
    kv: KeyValue  # for DELETE: the key, the deleting revision as mod_revision, the rest zero


@dataclass(frozen=True)
class WatchBatch:
    revision: int
    events: tuple[Event, ...]


class StateStore(Protocol):
    """A revisioned key-value store with transactions, leases and watches."""

    async def get(self, key: bytes) -> KeyValue | None: ...

    async def get_many(self, keys: Sequence[bytes]) -> list[KeyValue | None]:
        """Several keys, in order (etcd: one round trip, all read at one revision)."""
        ...

    async def range(
        self, prefix: bytes, *, revision: int = 0, limit: int = 0, start: bytes = b""
    ) -> RangeResult:
        """Keys under ``prefix`` in order (from ``start`` on, when given: to page through)."""
        ...

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult: ...

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int: ...

    async def delete(self, key: bytes, *, prefix: bool = False) -> int: ...

    async def lease_grant(self, ttl_s: int) -> int: ...

    async def lease_keepalive(self, lease: int) -> int: ...

    async def lease_revoke(self, lease: int) -> None: ...

    async def compact(self, revision: int) -> None: ...

    def watch(self, prefix: bytes, *, start_revision: int) -> AsyncGenerator[WatchBatch, None]: ...

    async def aclose(self) -> None: ...


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (b"" = no end)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b""


def in_range(key: bytes, start: bytes, prefix: bool) -> bool:
    return key.startswith(start) if prefix else key == start


def check_txn(
    compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp]
) -> None:
    """Enforce the limits etcd enforces, before anything is sent or written."""
    for name, items in (("compares", compare), ("success ops", success), ("failure ops", failure)):
        if len(items) > MAX_TXN_OPS:
            raise TxnTooLarge(f"{len(items)} {name} in one transaction (at most {MAX_TXN_OPS})")
    for c in compare:
        if isinstance(c.operand, bytes) != (c.target is Target.VALUE):
            raise InvalidArgument(
                "a value compare takes bytes, a revision or version compare an int"
            )
    for branch in (success, failure):  # (one pass over each branch: every write runs this)
        puts: set[bytes] = set()
        deletes: list[Delete] = []
        for op in branch:
            key = op.key
            if not key:
                raise InvalidArgument("empty key")
            if len(key) > MAX_KEY_BYTES:
                raise InvalidArgument(f"key of {len(key)} bytes (at most {MAX_KEY_BYTES})")
            if isinstance(op, Put):
                if len(op.value) > MAX_VALUE_BYTES:
                    raise ValueTooLarge(
                        f"value of {len(op.value)} bytes (at most {MAX_VALUE_BYTES})"
                    )
                if key in puts:
                    raise InvalidArgument("a key is put twice in one transaction")
                puts.add(key)
            else:
                deletes.append(op)
        for d in deletes:
            if any(in_range(k, d.key, d.prefix) for k in puts):
                raise InvalidArgument("a key is put and deleted in one transaction")


class StoreHelpers:
    """``put`` and ``delete`` as one-op transactions, and ``get_many`` as one ``get`` per
    key, for every backend (etcd overrides ``get_many``)."""

    async def get(self, key: bytes) -> KeyValue | None:
        raise NotImplementedError

    async def get_many(self, keys: Sequence[bytes]) -> list[KeyValue | None]:
        return [await self.get(k) for k in keys]

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        raise NotImplementedError

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        return (await self.txn((), (Put(key, value, lease),))).revision

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        return (await self.txn((), (Delete(key, prefix),))).deleted[0]
