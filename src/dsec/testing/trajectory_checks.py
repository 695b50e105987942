"""Checks every trajectory log must pass, whatever state store it runs on.

``CHECKS[name](tlog, project)`` runs one check against ``tlog`` (a fresh
:class:`~dsec.trajectory.log.TrajectoryLog` whose blobs live in a private directory), using
only trajectories of ``project`` (unique per call), so checks can share one store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace

from dsec.core.errors import AlreadyExists, InvalidArgument, QuotaExceeded
from dsec.trajectory.blobs import INLINE_MAX
from dsec.trajectory.log import PREFIX, RECORD_EVERY, Step, TrajectoryLog
from dsec.trajectory.retention import Retention, sweep

Check = Callable[[TrajectoryLog, str], Awaitable[None]]
CHECKS: dict[str, Check] = {}


def check(fn: Check) -> Check:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def step(cmd: str, out: str = "", *, idempotent: bool = False) -> Callable[[int], Step]:
    def make(n: int) -> Step:
        return Step(
            n=n,
            op="exec",
            request={"op": "exec", "cmd": cmd},
            status=200,
            result={"stdout": out},
            at=1.0,
            sandbox_id="sbx-test",
            idempotent=idempotent,
            raw_request={"op": "exec", "cmd": cmd, "timeout": 5},
        )

    return make


@check
async def check_record_then_replay(tlog: TrajectoryLog, project: str) -> None:
    t, new = await tlog.open(project, "run1/ep1", spec={"image": "base"})
    assert new
    assert t.steps == 0
    assert t.mode == "record"
    for i in range(3):
        s = await tlog.append(t.id, step(f"echo {i}", f"{i}\n"))
        assert s.n == i
    t = await tlog.get(t.id)
    assert (t.steps, t.cursor, t.mode) == (3, 3, "record")
    again, new = await tlog.open(project, "run1/ep1", spec={}, on_mismatch="fail")
    assert not new
    assert (again.mode, again.cursor, again.on_mismatch) == ("replay", 0, "fail")
    got = await tlog.step(t.id, 1)
    assert got is not None
    assert got.result == {"stdout": "1\n"}
    assert got.raw_request["timeout"] == 5
    assert [s.n async for s in tlog.steps(t.id)] == [0, 1, 2]
    assert await tlog.step(t.id, 3) is None
    assert await tlog.find(project, "run1/ep1") == again
    assert [x.name for x in await tlog.list(project)] == ["run1/ep1"]
    assert t.bytes == await tlog.usage(project) > 0


@check
async def check_bad_input(tlog: TrajectoryLog, project: str) -> None:
    for kwargs in ({"on_mismatch": "ignore"}, {"checkpoint_every": -1}):
        try:
            await tlog.open(project, "x", spec={}, **kwargs)
        except InvalidArgument:
            pass
        else:
            raise AssertionError(f"open accepted {kwargs}")
    for name in ("", "a\nb", "x" * 201):
        try:
            await tlog.open(project, name, spec={})
        except InvalidArgument:
            pass
        else:
            raise AssertionError(f"open accepted the name {name!r}")
    assert await tlog.list(project) == []


@check
async def check_large_step_goes_to_a_blob(tlog: TrajectoryLog, project: str) -> None:
    t, _ = await tlog.open(project, "big", spec={})
    big = "x" * (INLINE_MAX * 2)
    await tlog.append(t.id, step("cat big", big))
    kv = await tlog.store.get(PREFIX + b"s/" + t.id.encode() + b"/0000000000")
    assert kv is not None
    assert len(kv.value) < 1024, "the store holds only a stub"
    stub = json.loads(kv.value)
    got = await tlog.step(t.id, 0)
    assert got is not None
    assert got.result["stdout"] == big
    assert stub["blob"] in await tlog.referenced_blobs()
    assert (await tlog.get(t.id)).bytes == stub["size"] > INLINE_MAX * 2
    keep = Retention(blob_grace_s=0)
    await sweep(tlog, keep, tlog.clock() + 1)
    assert (await tlog.step(t.id, 0)) is not None, "a referenced blob survives the sweep"
    await tlog.remove(t.id)
    res = await sweep(tlog, keep, tlog.clock() + 1)
    assert res.blobs_removed >= 1
    assert stub["blob"] not in {d for d, _ in tlog.blobs.digests()}


@check
async def check_quota(tlog: TrajectoryLog, project: str) -> None:
    await tlog.set_quota(project, 1000)
    t, _ = await tlog.open(project, "q", spec={})
    await tlog.append(t.id, step("a", "y" * 2000))  # crosses the quota: still recorded
    for attempt in (tlog.append(t.id, step("b")), tlog.check_quota(project)):
        message = ""
        try:
            await attempt
        except QuotaExceeded as exc:
            message = str(exc)
        assert project in message, "a step beyond the quota was recorded"
        assert "1000" in message
    assert (await tlog.get(t.id)).steps == 1
    await tlog.remove(t.id)
    assert await tlog.usage(project) == 0
    try:
        await tlog.set_quota(project, -1)
    except InvalidArgument:
        pass
    else:
        raise AssertionError("a negative quota was accepted")


@check
async def check_quota_follows_the_project_tree(tlog: TrajectoryLog, project: str) -> None:
    """A quota bounds the log of the project and of every project beneath it."""
    child, sibling = f"{project}/a", f"{project}/b"
    await tlog.set_quota(project, 1000)
    await tlog.set_quota(child, 10**9)  # a child's own higher quota does not lift the parent's
    a, _ = await tlog.open(child, "a", spec={})
    await tlog.append(a.id, step("a", "y" * 2000))  # crosses the parent's quota
    used = (await tlog.get(a.id)).bytes
    assert await tlog.usage(child) == await tlog.usage(project) == used > 1000
    b, _ = await tlog.open(sibling, "b", spec={})
    for attempt in (tlog.append(b.id, step("b")), tlog.check_quota(sibling)):
        message = ""
        try:
            await attempt
        except QuotaExceeded as exc:
            message = str(exc)
        assert repr(project) in message, message
        assert repr(sibling) in message, message
    assert (await tlog.get(b.id)).steps == 0
    await tlog.remove(a.id)
    assert await tlog.usage(project) == await tlog.usage(child) == 0
    await tlog.append(b.id, step("b"))  # room again
    assert await tlog.usage(project) == await tlog.usage(sibling) > 0
    await tlog.remove(b.id)


@check
async def check_truncate(tlog: TrajectoryLog, project: str) -> None:
    t, _ = await tlog.open(project, "cut", spec={})
    for i in range(5):
        await tlog.append(t.id, step(f"s{i}", "z" * (100 * i)))
    full = (await tlog.get(t.id)).bytes
    cut = await tlog.truncate(t.id, 2, lambda x: replace(x, divergence={"step": 2}))
    assert cut.steps == 2
    assert cut.divergence == {"step": 2}
    assert 0 < cut.bytes < full
    assert await tlog.step(t.id, 2) is None
    assert await tlog.step(t.id, 1) is not None
    assert await tlog.usage(project) == cut.bytes
    s = await tlog.append(t.id, step("new"))
    assert s.n == 2


@check
async def check_bindings(tlog: TrajectoryLog, project: str) -> None:
    a, _ = await tlog.open(project, "a", spec={})
    b, _ = await tlog.open(project, "b", spec={})
    sbx1, sbx2 = f"sbx-1-{a.id[:6]}", f"sbx-2-{a.id[:6]}"
    await tlog.bind(a.id, sbx1)
    got = await tlog.for_sandbox(sbx1)
    assert got is not None
    assert got.id == a.id
    assert got.sandbox_id == sbx1
    try:
        await tlog.bind(b.id, sbx1)
    except AlreadyExists:
        pass
    else:
        raise AssertionError("one sandbox was bound to two trajectories")
    await tlog.bind(a.id, sbx2)  # the trajectory moves to a restored sandbox
    assert await tlog.for_sandbox(sbx1) is None
    assert (await tlog.get(a.id)).sandbox_id == sbx2
    await tlog.remove(a.id)
    assert await tlog.for_sandbox(sbx2) is None


@check
async def check_append_known(tlog: TrajectoryLog, project: str) -> None:
    """The record an append answers is the one stored (a writer appends from it without a
    read), a stale one still numbers steps right, and each bind has a new epoch."""
    t, _ = await tlog.open(project, "known", spec={})
    bound = await tlog.bind(t.id, f"sbx-k-{t.id[:6]}")
    assert bound.epoch
    again = await tlog.bind(t.id, f"sbx-k-{t.id[:6]}")
    assert again.epoch != bound.epoch, "a bind kept the epoch"
    found = await tlog.lookup(f"sbx-k-{t.id[:6]}", t.id)
    assert found is not None
    rec, kv = found
    for i in range(3):
        s, rec, kv = await tlog.append_known(t.id, step(f"k{i}"), known=(rec, kv))
        assert s.n == i
        fresh = await tlog.store.get(kv.key)
        assert fresh == kv, f"append answered {kv}, the store holds {fresh}"
        assert rec == await tlog.get(t.id)
    await tlog.append(t.id, step("elsewhere"))  # another writer: kv is stale now
    s, rec, kv = await tlog.append_known(t.id, step("k3"), known=(rec, kv))
    assert (s.n, rec.steps) == (4, 5)
    assert await tlog.store.get(kv.key) == kv


@check
async def check_record_and_its_tail(tlog: TrajectoryLog, project: str) -> None:
    """An append writes the record only every RECORD_EVERY steps or for a blob step; a read
    adds the steps since (its tail), and a record written from a read keeps them."""
    t, _ = await tlog.open(project, "tail", spec={})
    key = PREFIX + b"t/" + t.id.encode()

    async def stored() -> tuple[int, int]:
        kv = await tlog.store.get(key)
        assert kv is not None
        d = json.loads(kv.value)
        return int(d["steps"]), int(d["bytes"])

    for i in range(RECORD_EVERY + 2):
        await tlog.append(t.id, step(f"t{i}", "z" * i))
    steps = await tlog.store.range(PREFIX + b"s/" + t.id.encode() + b"/")
    t = await tlog.get(t.id)
    assert (t.steps, t.cursor) == (RECORD_EVERY + 2, RECORD_EVERY + 2)
    assert t.bytes == sum(len(kv.value) for kv in steps.kvs)
    written = sum(len(kv.value) for kv in steps.kvs[:RECORD_EVERY])
    assert await stored() == (RECORD_EVERY, written), "the record was not written periodically"
    await tlog.update(t.id, lambda x: replace(x, on_mismatch="fail"))
    assert await stored() == (t.steps, t.bytes), "a record write lost its tail"
    await tlog.append(t.id, step("big", "b" * INLINE_MAX))
    assert (await stored())[0] == RECORD_EVERY + 3, "a blob step did not write the record"
    after = await tlog.get(t.id)
    assert (after.steps, after.bytes) == await stored()
    assert after.on_mismatch == "fail"


@check
async def check_concurrent_appends(tlog: TrajectoryLog, project: str) -> None:
    t, _ = await tlog.open(project, "par", spec={})
    got = await asyncio.gather(*(tlog.append(t.id, step(f"c{i}")) for i in range(12)))
    assert sorted(s.n for s in got) == list(range(12))
    t = await tlog.get(t.id)
    assert t.steps == 12
    assert t.bytes == await tlog.usage(project)


@check
async def check_retention(tlog: TrajectoryLog, project: str) -> None:
    """(The sweep is global: this check first clears the store of trajectories.)"""
    for t in await tlog.list():
        await tlog.remove(t.id)
    real = tlog.clock
    base = real()
    try:
        tlog.clock = lambda: base - 10_000
        old, _ = await tlog.open(project, "old", spec={})
        tlog.clock = lambda: base - 100
        mid, _ = await tlog.open(project, "mid", spec={})
        await tlog.append(mid.id, step("a", "b" * 500))
        tlog.clock = lambda: base
        new, _ = await tlog.open(project, "new", spec={})
        await tlog.append(new.id, step("a", "b" * 500))
        res = await sweep(tlog, Retention(max_age_s=3600), base)
        assert res.removed == (old.id,)
        sizes = {t.id: t.bytes for t in await tlog.list()}
        res = await sweep(tlog, Retention(max_bytes=sum(sizes.values()) - 1), base)
        assert res.removed == (mid.id,), "the least recently used goes first"
        assert [t.id for t in await tlog.list()] == [new.id]
    finally:
        tlog.clock = real


@check
async def check_two_apiservers(tlog: TrajectoryLog, project: str) -> None:
    """Two log objects on one store (two apiservers): the bound record stays exact although
    each caches what it last saw; usage is exact once the records are written (every
    RECORD_EVERY steps: the steps since are counted where they were appended)."""
    other = TrajectoryLog(tlog.store, tlog.blobs)
    a, _ = await tlog.open(project, "a", spec={})
    b, _ = await other.open(project, "b", spec={})
    await tlog.bind(a.id, f"sbx-a-{a.id[:6]}")
    for i in range(RECORD_EVERY):
        await tlog.check_quota(project)
        await tlog.append(a.id, step(f"a{i}", "x" * 10 * i))
        await other.check_quota(project)
        await other.append(b.id, step(f"b{i}", "y" * 7 * i))
    total = (await tlog.get(a.id)).bytes + (await tlog.get(b.id)).bytes
    await tlog.set_quota(project, total)
    message = ""
    for _ in range(200):  # (the other's last steps count once the watch delivers them)
        try:
            await tlog.check_quota(project)
        except QuotaExceeded as exc:
            message = str(exc)
            break
        await asyncio.sleep(0.01)
    assert "quota" in message, "the other apiserver's steps count against the quota"
    await tlog.set_quota(project, 0)
    assert await tlog.usage(project) == total
    found = await other.lookup(f"sbx-a-{a.id[:6]}")
    assert found is not None
    assert found[0].steps == RECORD_EVERY
    # A reopen by one apiserver is what the other sees on its next call.
    await other.open(project, "a", spec={})
    found = await tlog.lookup(f"sbx-a-{a.id[:6]}")
    assert found is not None
    assert (found[0].mode, found[0].cursor) == ("replay", 0)
