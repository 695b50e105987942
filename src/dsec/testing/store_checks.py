"""The state store conformance suite: the same checks on every backend.

``check_state_store(make_store)`` runs every check, each on a fresh store from ``make_store``
and under its own key prefix (so a shared etcd can serve them all); tests can also run the
checks one by one from :data:`CHECKS`. A check raises ``AssertionError`` (or the store's
error) when the backend breaks the semantics documented in :mod:`dsec.store.api`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from dsec.core.errors import Compacted, InvalidArgument, LeaseNotFound, TxnTooLarge, ValueTooLarge
from dsec.store.admission import Admitter, Limit
from dsec.store.api import (
    MAX_TXN_OPS,
    MAX_VALUE_BYTES,
    Compare,
    Delete,
    EventType,
    Op,
    Put,
    StateStore,
    Target,
    WatchBatch,
)
from dsec.store.leases import kept_alive

Check = Callable[[StateStore, bytes], Awaitable[None]]
WAIT_S = 10.0


async def _next(it: AsyncGenerator[WatchBatch, None], wait_s: float = WAIT_S) -> WatchBatch:
    return await asyncio.wait_for(anext(it), wait_s)


async def _raises(exc: type[BaseException], aw: Awaitable[object]) -> BaseException:
    try:
        await aw
    except exc as got:
        return got
    raise AssertionError(f"expected {exc.__name__}")


async def check_revisions(s: StateStore, p: bytes) -> None:
    r0 = await s.put(p + b"a", b"1")
    kv = await s.get(p + b"a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"1", r0, r0, 1)
    r1 = await s.put(p + b"a", b"2")
    assert r1 == r0 + 1
    kv = await s.get(p + b"a")
    assert kv is not None
    assert (kv.create_revision, kv.mod_revision, kv.version) == (r0, r1, 2)
    # A no-op write (nothing to delete) and a failed compare leave the revision alone.
    assert await s.delete(p + b"absent") == 0
    res = await s.txn([Compare(p + b"a", Target.VERSION, Op.EQ, 99)], [Put(p + b"a", b"x")])
    assert not res.succeeded
    assert res.revision == r1
    assert await s.delete(p + b"a") == 1
    assert await s.get(p + b"a") is None
    r3 = await s.put(p + b"a", b"3")
    assert r3 == r1 + 2
    kv = await s.get(p + b"a")
    assert kv is not None
    assert (kv.create_revision, kv.version) == (r3, 1)


async def check_range(s: StateStore, p: bytes) -> None:
    for k in (b"b", b"a", b"c\xff", b"c"):
        await s.put(p + b"r/" + k, k)
    await s.put(p + b"r", b"not under r/")
    await s.put(p + b"r0", b"not under r/")
    got = await s.range(p + b"r/")
    assert [kv.key for kv in got.kvs] == [p + b"r/" + k for k in (b"a", b"b", b"c", b"c\xff")]
    assert (got.count, got.more) == (4, False)
    cut = await s.range(p + b"r/", limit=2)
    assert [kv.value for kv in cut.kvs] == [b"a", b"b"]
    assert (cut.count, cut.more) == (4, True)
    old = got.revision
    await s.put(p + b"r/a", b"new")
    await s.delete(p + b"r/b")
    then = await s.range(p + b"r/", revision=old)
    assert [kv.value for kv in then.kvs] == [b"a", b"b", b"c", b"c\xff"]
    now = await s.range(p + b"r/")
    assert [kv.value for kv in now.kvs] == [b"new", b"c", b"c\xff"]
    assert now.revision == old + 2
    await _raises(InvalidArgument, s.range(p + b"r/", revision=now.revision + 1000))
    page = await s.range(p + b"r/", start=p + b"r/c", limit=1)  # paging: from a key on
    assert [kv.value for kv in page.kvs] == [b"c"]
    assert page.more
    rest = await s.range(p + b"r/", start=page.kvs[-1].key + b"\x00")
    assert [kv.value for kv in rest.kvs] == [b"c\xff"]
    assert [kv.key for kv in (await s.range(p + b"r/", start=p)).kvs] == [kv.key for kv in now.kvs]
    assert (await s.range(p + b"r/", start=p + b"s")).kvs == ()
    old_page = await s.range(p + b"r/", revision=old, start=p + b"r/b")
    assert [kv.value for kv in old_page.kvs] == [b"b", b"c", b"c\xff"]


async def check_get_many(s: StateStore, p: bytes) -> None:
    await s.put(p + b"m/a", b"1")
    await s.put(p + b"m/b", b"2")
    await s.put(p + b"m/b", b"3")
    keys = [p + b"m/b", p + b"m/none", p + b"m/a", p + b"m/b"]
    got = await s.get_many(keys)
    assert [kv.value if kv else None for kv in got] == [b"3", None, b"1", b"3"]
    b = got[0]
    assert b is not None
    assert b.version == 2
    assert b.mod_revision > b.create_revision
    many = [p + b"m/n%03d" % i for i in range(300)]  # more than one etcd transaction holds
    await s.put(many[-1], b"last")
    got = await s.get_many(many)
    assert len(got) == 300
    assert got[0] is None
    assert got[-1] is not None
    assert got[-1].value == b"last"
    assert await s.get_many([]) == []


async def check_txn(s: StateStore, p: bytes) -> None:
    k = p + b"t"
    r = await s.put(k, b"m")
    cases: list[tuple[Target, Op, int | bytes, bool]] = [
        (Target.VALUE, Op.EQ, b"m", True),
        (Target.VALUE, Op.NE, b"m", False),
        (Target.VALUE, Op.LT, b"n", True),
        (Target.VALUE, Op.GT, b"n", False),
        (Target.VERSION, Op.EQ, 1, True),
        (Target.VERSION, Op.GT, 1, False),
        (Target.CREATE, Op.EQ, r, True),
        (Target.CREATE, Op.LT, r, False),
        (Target.MOD, Op.NE, r, False),
        (Target.MOD, Op.LT, r + 1, True),
    ]
    for target, op, operand, want in cases:
        res = await s.txn([Compare(k, target, op, operand)], [], [])
        assert res.succeeded is want, (target, op, operand)
    # A value compare on an absent key is false whatever the operator.
    for op in (Op.EQ, Op.NE):
        res = await s.txn([Compare(p + b"none", Target.VALUE, op, b"x")], [])
        assert not res.succeeded
    # Several ops commit at one revision; the failure branch runs when a compare fails.
    res = await s.txn(
        [Compare(k, Target.VALUE, Op.EQ, b"m")],
        [Put(p + b"t1", b"1"), Put(p + b"t2", b"2"), Delete(k)],
        [Put(p + b"wrong", b"1")],
    )
    assert res.succeeded
    assert res.revision == r + 1
    assert res.deleted == (1,)
    for key in (p + b"t1", p + b"t2"):
        kv = await s.get(key)
        assert kv is not None
        assert kv.mod_revision == r + 1
    res = await s.txn([Compare(k, Target.VERSION, Op.GT, 0)], [], [Put(p + b"f", b"1")])
    assert not res.succeeded
    assert await s.get(p + b"f") is not None
    # A prefix compare holds only if it holds for every key under the prefix.
    ok = await s.txn([Compare(p + b"t", Target.MOD, Op.LT, r + 2, prefix=True)], [])
    assert ok.succeeded
    await s.put(p + b"t3", b"3")
    stale = await s.txn([Compare(p + b"t", Target.MOD, Op.LT, r + 2, prefix=True)], [])
    assert not stale.succeeded
    # A compare's operand must fit its target.
    await _raises(InvalidArgument, s.txn([Compare(k, Target.VALUE, Op.EQ, 1)], []))
    await _raises(InvalidArgument, s.txn([Compare(k, Target.MOD, Op.EQ, b"1")], []))
    # Putting one key twice in one transaction is refused.
    await _raises(InvalidArgument, s.txn([], [Put(p + b"d", b"1"), Put(p + b"d", b"2")]))


async def check_create_if_absent(s: StateStore, p: bytes) -> None:
    key = p + b"once"

    async def create(i: int) -> bool:
        res = await s.txn([Compare(key, Target.CREATE, Op.EQ, 0)], [Put(key, b"%d" % i)])
        return res.succeeded

    wins = await asyncio.gather(*(create(i) for i in range(20)))
    assert sum(wins) == 1
    kv = await s.get(key)
    assert kv is not None
    assert kv.version == 1


async def check_leases(s: StateStore, p: bytes) -> None:
    lease = await s.lease_grant(60)
    await s.put(p + b"l/a", b"1", lease=lease)
    await s.put(p + b"l/b", b"2", lease=lease)
    await s.put(p + b"l/keep", b"3")
    kv = await s.get(p + b"l/a")
    assert kv is not None
    assert kv.lease == lease
    assert await s.lease_keepalive(lease) > 0
    start = (await s.range(p + b"l/")).revision + 1
    await s.lease_revoke(lease)
    assert [kv.key for kv in (await s.range(p + b"l/")).kvs] == [p + b"l/keep"]
    async with aclosing(s.watch(p + b"l/", start_revision=start)) as w:
        batch = await _next(w)
    assert batch.revision == start
    assert sorted((e.type, e.kv.key) for e in batch.events) == [
        (EventType.DELETE, p + b"l/a"),
        (EventType.DELETE, p + b"l/b"),
    ]
    await _raises(LeaseNotFound, s.lease_keepalive(lease))
    await _raises(LeaseNotFound, s.lease_revoke(lease))
    await _raises(LeaseNotFound, s.put(p + b"l/c", b"1", lease=lease))


async def check_lease_expiry(s: StateStore, p: bytes) -> None:
    lease = await s.lease_grant(2)
    r = await s.put(p + b"e/a", b"1", lease=lease)
    await s.put(p + b"e/b", b"1", lease=lease)
    give_up = time.monotonic() + WAIT_S
    while (await s.range(p + b"e/")).kvs:
        assert time.monotonic() < give_up, "the lease did not expire"
        await asyncio.sleep(0.1)
    async with aclosing(s.watch(p + b"e/", start_revision=r + 2)) as w:
        batch = await _next(w)
    assert {e.type for e in batch.events} == {EventType.DELETE}
    assert len(batch.events) == 2
    await _raises(LeaseNotFound, s.lease_keepalive(lease))


async def check_kept_alive(s: StateStore, p: bytes) -> None:
    async with kept_alive(s, 2) as lease:
        await s.put(p + b"k", b"1", lease=lease)
        await asyncio.sleep(3.5)  # longer than the TTL: renewals keep the key
        assert await s.get(p + b"k") is not None
    assert await s.get(p + b"k") is None  # revoked on exit


async def check_watch(s: StateStore, p: bytes) -> None:
    r1 = await s.put(p + b"w/a", b"1")
    await s.put(p + b"other", b"x")
    r3 = await s.txn([], [Put(p + b"w/b", b"2"), Put(p + b"w/c", b"3")])
    async with aclosing(s.watch(p + b"w/", start_revision=r1)) as w:
        b1 = await _next(w)
        assert b1.revision == r1
        assert [(e.type, e.kv.key, e.kv.value) for e in b1.events] == [
            (EventType.PUT, p + b"w/a", b"1")
        ]
        b2 = await _next(w)
        assert b2.revision == r3.revision
        assert sorted(e.kv.key for e in b2.events) == [p + b"w/b", p + b"w/c"]
        r4 = await s.delete(p + b"w/a")
        assert r4 == 1
        b3 = await _next(w)
        assert [(e.type, e.kv.key) for e in b3.events] == [(EventType.DELETE, p + b"w/a")]
        assert b3.events[0].kv.mod_revision == b3.revision
        last = b3.revision
    # Resume: a new watch from the revision after the last batch seen misses nothing.
    r5 = await s.put(p + b"w/d", b"4")
    async with aclosing(s.watch(p + b"w/", start_revision=last + 1)) as w:
        b4 = await _next(w)
        assert b4.revision == r5
        assert [e.kv.key for e in b4.events] == [p + b"w/d"]
        live = await s.put(p + b"w/e", b"5")
        b5 = await _next(w)
        assert b5.revision == live
    # start_revision=0 means from when the iteration starts: nothing from before.
    before = await s.put(p + b"w/f", b"6")
    async with aclosing(s.watch(p + b"w/", start_revision=0)) as w:
        first = asyncio.ensure_future(_next(w))
        for i in range(100):  # the watch starts at its first anext(): write until it sees one
            await asyncio.sleep(0.05)
            if first.done():
                break
            await s.put(p + b"w/g%d" % i, b"7")
        got = await first
        assert got.revision > before
        assert all(e.kv.key != p + b"w/f" for e in got.events)


async def check_compaction(s: StateStore, p: bytes) -> None:
    r1 = await s.put(p + b"c/a", b"1")
    await s.put(p + b"c/a", b"2")
    r3 = await s.put(p + b"c/b", b"3")
    await s.compact(r3)
    err = await _raises(Compacted, s.range(p + b"c/", revision=r1))
    assert isinstance(err, Compacted)
    async with aclosing(s.watch(p + b"c/", start_revision=r1)) as w:
        got = await _raises(Compacted, _next(w))
    assert isinstance(got, Compacted)
    assert got.compact_revision >= r3
    at = await s.range(p + b"c/", revision=r3)
    assert [kv.value for kv in at.kvs] == [b"2", b"3"]
    await _raises(Compacted, s.compact(r1))
    await _raises(InvalidArgument, s.compact(r3 + 1000))
    r4 = await s.put(p + b"c/c", b"4")
    async with aclosing(s.watch(p + b"c/", start_revision=r4)) as w:
        assert (await _next(w)).revision == r4


async def check_limits(s: StateStore, p: bytes) -> None:
    ops = [Put(p + b"x/%d" % i, b"") for i in range(MAX_TXN_OPS + 1)]
    await _raises(TxnTooLarge, s.txn([], ops))
    res = await s.txn([], ops[:MAX_TXN_OPS])
    assert res.succeeded
    assert (await s.range(p + b"x/")).count == MAX_TXN_OPS
    await _raises(ValueTooLarge, s.put(p + b"big", b"v" * (MAX_VALUE_BYTES + 1)))
    await s.put(p + b"big", b"v" * MAX_VALUE_BYTES)
    kv = await s.get(p + b"big")
    assert kv is not None
    assert len(kv.value) == MAX_VALUE_BYTES


async def admit_many(
    stores: list[StateStore], prefix: bytes, *, attempts: int, quota: int, used: int
) -> int:
    """``attempts`` concurrent one-unit admissions against ``quota`` with ``used`` taken,
    spread over ``stores`` (one :class:`Admitter` each); returns how many were admitted."""
    for i in range(used):
        await stores[0].put(prefix + b"pre-%d" % i, b"1")
    admitters = [Admitter(st) for st in stores]
    limits = [Limit(prefix, quota)]

    async def one(i: int) -> bool:
        a = admitters[i % len(admitters)]
        return await a.admit(prefix + b"sb-%d" % i, b"1", 1, limits)

    wins = await asyncio.gather(*(one(i) for i in range(attempts)))
    got = await stores[0].range(prefix)
    assert got.count == used + sum(wins), "admissions and records disagree"
    return sum(wins)


async def check_admission(s: StateStore, p: bytes) -> None:
    admitted = await admit_many([s], p + b"q/", attempts=500, quota=310, used=10)
    assert admitted == 300


async def check_nested_quotas(s: StateStore, p: bytes) -> None:
    org, a, b = p + b"org/", p + b"org/a/", p + b"org/b/"
    adm = Admitter(s)

    async def admit(child: bytes, name: bytes, amount: int) -> bool:
        limits = [Limit(org, 6), Limit(child, 4)]
        return await adm.admit(child + name, b"%d" % amount, amount, limits)

    assert await admit(a, b"1", 3)
    assert not await admit(a, b"2", 2)  # the child's limit: 3 + 2 > 4
    assert await admit(b, b"1", 2)
    assert not await admit(b, b"2", 2)  # the parent's limit: 3 + 2 + 2 > 6
    assert await admit(a, b"1", 3)  # an admission that exists is not counted twice
    await s.delete(a + b"1")  # freeing frees the parent too
    assert await admit(b, b"2", 2)


CHECKS: dict[str, Check] = {
    "revisions": check_revisions,
    "range": check_range,
    "get_many": check_get_many,
    "txn": check_txn,
    "create_if_absent": check_create_if_absent,
    "leases": check_leases,
    "lease_expiry": check_lease_expiry,
    "kept_alive": check_kept_alive,
    "watch": check_watch,
    "compaction": check_compaction,
    "limits": check_limits,
    "admission": check_admission,
    "nested_quotas": check_nested_quotas,
}


async def check_state_store(make_store: Callable[[], Awaitable[StateStore]]) -> None:
    """Run every check on a fresh store from ``make_store``."""
    for name, check in CHECKS.items():
        store = await make_store()
        try:
            await check(
                store, b"/conformance/%s/%s/" % (name.encode(), secrets.token_hex(4).encode())
            )
        finally:
            await store.aclose()
