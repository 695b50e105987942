"""The state store on an etcd v3 cluster, through our own small grpc.aio client.

One channel per endpoint; a call that fails because a member is down or has no leader moves
to the next endpoint. Reads, lease calls and watches are retried for ``retry_s``. A write
transaction is retried only when etcd proves it was not applied (no leader, no connection);
otherwise it fails with :class:`~dsec.core.errors.StoreUnavailable`, because it may or may not
have been applied, and the caller decides (for example by re-reading a key it created).
Watches resume after a reconnect from the revision after the last batch they yielded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from dsec.core.errors import (
    Compacted,
    DsecError,
    Internal,
    InvalidArgument,
    LeaseNotFound,
    StoreUnavailable,
    TxnTooLarge,
    ValueTooLarge,
)

from ._gen import etcd_v3_subset_pb2 as pb
from ._gen import etcd_v3_subset_pb2_grpc as pbg
from .api import (
    MAX_TXN_OPS,
    Compare,
    Event,
    EventType,
    KeyValue,
    Op,
    Put,
    RangeResult,
    StoreHelpers,
    Target,
    TxnOp,
    TxnResult,
    WatchBatch,
    check_txn,
    prefix_end,
)

T = TypeVar("T")

_OPS = {
    Op.EQ: pb.Compare.EQUAL,
    Op.NE: pb.Compare.NOT_EQUAL,
    Op.LT: pb.Compare.LESS,
    Op.GT: pb.Compare.GREATER,
}
_TARGETS = {
    Target.VERSION: (pb.Compare.VERSION, "version"),
    Target.CREATE: (pb.Compare.CREATE, "create_revision"),
    Target.MOD: (pb.Compare.MOD, "mod_revision"),
    Target.VALUE: (pb.Compare.VALUE, "value"),
}
# UNAVAILABLE details that prove a request never reached the raft log.
_NOT_SENT = ("no leader", "failed to connect", "connection refused", "all backends failing")


@dataclass(frozen=True)
class EtcdTls:
    """PEM bytes: the CA that signed the etcd members, and our client certificate and key."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None  # overrides the name checked in the members' certificates


def _span(key: bytes, prefix: bool) -> tuple[bytes, bytes]:
    """etcd's (key, range_end) for one key or a prefix (the empty prefix is every key)."""
    if not prefix:
        return key, b""
    if not key:
        return b"\0", b"\0"
    return key, prefix_end(key) or b"\0"


def _kv(m: pb.KeyValue) -> KeyValue:
    return KeyValue(m.key, m.value, m.create_revision, m.mod_revision, m.version, m.lease)


def translate(exc: grpc.aio.AioRpcError) -> DsecError:
    """Our error for an etcd status (the one place foreign errors become ours)."""
    code, details = exc.code(), exc.details() or ""
    low = details.lower()
    if code == grpc.StatusCode.NOT_FOUND and "lease" in low:
        return LeaseNotFound(details)
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in low:
        return Compacted(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "too many operations" in low:
        return TxnTooLarge(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "too large" in low:
        return ValueTooLarge(details)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidArgument(details)
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ) or (code == grpc.StatusCode.UNKNOWN and "leader" in low):
        return StoreUnavailable(f"etcd: {code.name}: {details}")
    return Internal(f"etcd: {code.name}: {details}")


def _not_applied(exc: grpc.aio.AioRpcError) -> bool:
    low = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(s in low for s in _NOT_SENT)


class _Member:
    def __init__(self, endpoint: str, tls: EtcdTls | None) -> None:
        self.endpoint = endpoint
        options: list[tuple[str, str | int]] = [("grpc.max_receive_message_length", 8 << 20)]
        if tls is None:
            self.channel = grpc.aio.insecure_channel(endpoint, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            self.channel = grpc.aio.secure_channel(endpoint, creds, options=options)
        self.kv = pbg.KVStub(self.channel)
        self.watch = pbg.WatchStub(self.channel)
        self.lease = pbg.LeaseStub(self.channel)
        self.maintenance = pbg.MaintenanceStub(self.channel)


class EtcdStore(StoreHelpers):
    """A client of one etcd cluster; make it inside the event loop that will use it."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        tls: EtcdTls | None = None,
        timeout_s: float = 5.0,
        retry_s: float = 15.0,
    ) -> None:
        if not endpoints:
            raise InvalidArgument("no etcd endpoints")
        self._members = [_Member(e, tls) for e in endpoints]
        self._current = 0
        self._timeout = timeout_s
        self._retry_s = retry_s
        self._closed = False

    async def _call(self, fn: Callable[[_Member], Awaitable[T]], *, idempotent: bool) -> T:
        if self._closed:
            raise StoreUnavailable("the store is closed")
        give_up = time.monotonic() + self._retry_s
        delay = 0.05
        while True:
            member = self._members[self._current]
            try:
                return await fn(member)
            except grpc.aio.AioRpcError as exc:
                err = translate(exc)
                retry = isinstance(err, StoreUnavailable) and (idempotent or _not_applied(exc))
                if not retry or time.monotonic() + delay > give_up:
                    raise err from exc
            self._current = (self._current + 1) % len(self._members)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    # KV

    async def get(self, key: bytes) -> KeyValue | None:
        got = await self.range_exact(key)
        return got.kvs[0] if got.kvs else None

    async def get_many(self, keys: Sequence[bytes]) -> list[KeyValue | None]:
        """One read-only Txn per MAX_TXN_OPS keys (etcd serves it without a Raft round)."""
        out: list[KeyValue | None] = []
        for i in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[i : i + MAX_TXN_OPS]
            req = pb.TxnRequest(
                success=[pb.RequestOp(request_range=pb.RangeRequest(key=k)) for k in chunk]
            )

            async def call(m: _Member, req: pb.TxnRequest = req) -> pb.TxnResponse:
                return await m.kv.Txn(req, timeout=self._timeout)

            resp = await self._call(call, idempotent=True)
            for r in resp.responses:
                kvs = r.response_range.kvs
                out.append(_kv(kvs[0]) if kvs else None)
        return out

    async def range_exact(self, key: bytes) -> RangeResult:
        return await self._range(key, b"", 0, 0)

    async def range(
        self, prefix: bytes, *, revision: int = 0, limit: int = 0, start: bytes = b""
    ) -> RangeResult:
        key, end = _span(prefix, True)
        return await self._range(max(key, start), end, revision, limit)

    async def _range(self, key: bytes, end: bytes, revision: int, limit: int) -> RangeResult:
        req = pb.RangeRequest(key=key, range_end=end, revision=revision, limit=limit)

        async def call(m: _Member) -> pb.RangeResponse:
            return await m.kv.Range(req, timeout=self._timeout)

        resp = await self._call(call, idempotent=True)
        kvs = tuple(_kv(kv) for kv in resp.kvs)
        return RangeResult(kvs, revision or resp.header.revision, resp.more, resp.count)

    @staticmethod
    def _op(op: TxnOp) -> pb.RequestOp:
        if isinstance(op, Put):
            return pb.RequestOp(
                request_put=pb.PutRequest(key=op.key, value=op.value, lease=op.lease)
            )
        key, end = _span(op.key, op.prefix)
        return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key, range_end=end))

    @staticmethod
    def _compare(c: Compare) -> pb.Compare:
        target, field = _TARGETS[c.target]
        key, end = _span(c.key, c.prefix)
        expected = c.operand
        if isinstance(expected, bytes) != (c.target is Target.VALUE):
            raise InvalidArgument(
                "a value compare takes bytes, a revision or version compare an int"
            )
        msg = pb.Compare(result=_OPS[c.op], target=target, key=key, range_end=end)
        setattr(msg, field, expected)
        return msg

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        check_txn(compare, success, failure)
        req = pb.TxnRequest(
            compare=[self._compare(c) for c in compare],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )

        async def call(m: _Member) -> pb.TxnResponse:
            return await m.kv.Txn(req, timeout=self._timeout)

        resp = await self._call(call, idempotent=False)
        deleted = tuple(
            r.response_delete_range.deleted
            for r in resp.responses
            if r.WhichOneof("response") == "response_delete_range"
        )
        return TxnResult(resp.succeeded, resp.header.revision, deleted)

    async def compact(self, revision: int) -> None:
        req = pb.CompactionRequest(revision=revision, physical=True)

        async def call(m: _Member) -> pb.CompactionResponse:
            return await m.kv.Compact(req, timeout=self._timeout)

        await self._call(call, idempotent=True)

    # leases

    async def lease_grant(self, ttl_s: int) -> int:
        if ttl_s <= 0:
            raise InvalidArgument("a lease needs a positive TTL")

        async def call(m: _Member) -> pb.LeaseGrantResponse:
            return await m.lease.LeaseGrant(pb.LeaseGrantRequest(TTL=ttl_s), timeout=self._timeout)

        resp = await self._call(call, idempotent=True)  # a lost grant just expires
        if resp.error:
            raise Internal(f"etcd lease grant: {resp.error}")
        return resp.ID

    async def lease_keepalive(self, lease: int) -> int:
        async def call(m: _Member) -> int:
            stream = m.lease.LeaseKeepAlive(timeout=self._timeout)
            try:
                await stream.write(pb.LeaseKeepAliveRequest(ID=lease))
                resp = await stream.read()
            finally:
                stream.cancel()
            if not isinstance(resp, pb.LeaseKeepAliveResponse):
                raise StoreUnavailable("etcd closed the keep-alive stream")
            return resp.TTL

        ttl = await self._call(call, idempotent=True)
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease:x} not found")
        return ttl

    async def lease_revoke(self, lease: int) -> None:
        attempts = 0

        async def call(m: _Member) -> None:
            nonlocal attempts
            attempts += 1
            try:
                await m.lease.LeaseRevoke(pb.LeaseRevokeRequest(ID=lease), timeout=self._timeout)
            except grpc.aio.AioRpcError as exc:
                # A retried revoke that finds nothing was applied by the attempt before it.
                if attempts > 1 and isinstance(translate(exc), LeaseNotFound):
                    return
                raise

        await self._call(call, idempotent=True)

    # watch

    def watch(self, prefix: bytes, *, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        return self._watch(prefix, start_revision)

    async def _watch(self, prefix: bytes, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        key, end = _span(prefix, True)
        next_rev = start_revision
        if next_rev <= 0:
            next_rev = (await self._range(key, end, 0, 1)).revision + 1
        give_up = time.monotonic() + self._retry_s
        delay = 0.05
        while True:
            if self._closed:
                raise StoreUnavailable("the store is closed")
            member = self._members[self._current]
            create = pb.WatchCreateRequest(key=key, range_end=end, start_revision=next_rev)
            stream = member.watch.Watch(metadata=(("hasleader", "true"),))
            try:
                await stream.write(pb.WatchRequest(create_request=create))
                while True:
                    resp = await stream.read()
                    if not isinstance(resp, pb.WatchResponse):
                        break  # the member ended the stream: reconnect
                    if resp.compact_revision:
                        raise Compacted(
                            f"watch from {next_rev}: etcd compacted up to {resp.compact_revision}",
                            resp.compact_revision,
                        )
                    if resp.canceled:
                        break
                    give_up = time.monotonic() + self._retry_s
                    delay = 0.05
                    for batch in _batches(resp.events):
                        next_rev = batch.revision + 1
                        yield batch
            except grpc.aio.AioRpcError as exc:
                err = translate(exc)
                if not isinstance(err, StoreUnavailable) or time.monotonic() > give_up:
                    raise err from exc
            finally:
                stream.cancel()
            if time.monotonic() > give_up:
                raise StoreUnavailable(f"etcd watch on {prefix!r} could not be resumed")
            self._current = (self._current + 1) % len(self._members)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    # cluster

    async def leader_endpoint(self) -> str | None:
        """The endpoint of the member that is leader now, if any member knows one."""
        for m in self._members:
            try:
                st = await m.maintenance.Status(pb.StatusRequest(), timeout=1.0)
            except grpc.aio.AioRpcError:
                continue
            if st.leader and st.leader == st.header.member_id:
                return m.endpoint
        return None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for m in self._members:
            await m.channel.close()


def _batches(events: Sequence[pb.Event]) -> list[WatchBatch]:
    out: list[WatchBatch] = []
    for e in events:
        kind = EventType.DELETE if e.type == pb.Event.DELETE else EventType.PUT
        kv = _kv(e.kv)
        if kind is EventType.DELETE:
            kv = KeyValue(kv.key, b"", 0, kv.mod_revision, 0)
        ev = Event(kind, kv)
        if out and out[-1].revision == kv.mod_revision:
            out[-1] = WatchBatch(kv.mod_revision, (*out[-1].events, ev))
        else:
            out.append(WatchBatch(kv.mod_revision, (ev,)))
    return [WatchBatch(b.revision, tuple(sorted(b.events, key=lambda e: e.kv.key))) for b in out]
