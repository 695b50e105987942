"""Copying a full (microVM) snapshot from its edge to another, through this apiserver.

The source edge's ``ExportSnapshot`` gives the transfer manifest; the target's
``ImportSnapshot`` takes it and answers which files it lacks (shared bases and fork
templates it holds by digest are not sent); the source streams those files and this
apiserver passes each chunk on as it comes (nothing is buffered beyond one chunk). The
target verifies every digest before it moves anything in; when the source dies or refuses
mid-way, the import is cancelled and the target removes what it received.

The copy is a snapshot of the target edge (its id names that edge, same name, project and
owner); :func:`on_edge` uses one for a single create and deletes it after, so no snapshot
appears twice (the sandboxes made from it keep its files until they end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import grpc
from aiohttp import web

from dsec.apiserver.context import ctx, principal
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core.errors import DsecError, InvalidArgument, Unavailable
from dsec.core.ids import RANDOM_BYTES, new_snapshot_id, snapshot_edge_of
from dsec.core.spec import SandboxSpec
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_json
from dsec.rpc.errors import error_from_rpc

TRANSFER_TIMEOUT_S = 900.0
T = TypeVar("T")


async def copy(
    request: web.Request, snapshot_id: str, source: EdgeEntry, target: EdgeEntry, *,
    sandbox_id: str = "", cache: bool = True,
) -> pb.SnapshotInfo:  # fmt: skip
    """Copy ``snapshot_id`` (or, ``sandbox_id``, that paused sandbox's pause snapshot)
    from ``source`` to ``target``; returns the copy.

    Raises:
        Unavailable: the source edge failed or went away during the transfer.
        SandboxFailed: a file did not match its digest (the target refused the copy).
        DsecError: the source or the target refused (not found, not copyable, ...).
    """
    c, p = ctx(request), principal(request)
    md = p.metadata()
    src = c.upstream.edge_stub(source)
    dst = c.upstream.edge_stub(target)
    started = time.perf_counter()
    head = src.ExportSnapshot(
        pb.ExportSnapshotRequest(snapshot_id=snapshot_id, sandbox_id=sandbox_id),
        metadata=md,
        timeout=120,
    )
    manifest = b""
    async with _from(f"edge {source.edge_id}"):
        async for msg in head:
            manifest = msg.manifest
    if not cache:  # a one-off copy (a fork's snapshot): the target keeps none of it
        try:
            manifest = json.dumps({**json.loads(manifest), "cache": False}).encode()
        except (ValueError, TypeError):
            raise Unavailable(f"edge {source.edge_id} sent a bad snapshot manifest") from None
    copy_id = new_snapshot_id(target.edge_id, os.urandom(RANDOM_BYTES))
    call = dst.ImportSnapshot(metadata=md, timeout=TRANSFER_TIMEOUT_S)
    sent = 0
    try:
        async with _from(f"edge {target.edge_id}"):
            await call.write(pb.SnapshotChunk(manifest=manifest, snapshot_id=copy_id))
            want = await _event(call)
        if want.want:
            files = src.ExportSnapshot(
                pb.ExportSnapshotRequest(
                    snapshot_id=snapshot_id, files=list(want.want), sandbox_id=sandbox_id
                ),
                metadata=md,
                timeout=TRANSFER_TIMEOUT_S,
            )
            try:
                async for chunk in files:
                    sent += len(chunk.data)
                    async with _from(f"edge {target.edge_id}"):
                        await call.write(chunk)
            except grpc.aio.AioRpcError as exc:
                err = error_from_rpc(exc, f"edge {source.edge_id}")
                raise Unavailable(
                    f"edge {source.edge_id} failed while sending snapshot {snapshot_id} "
                    f"to edge {target.edge_id} (nothing was kept there): {err.message}"
                ) from None
            finally:
                files.cancel()  # the target failed: stop the source's stream too
        else:
            await call.write(pb.SnapshotChunk(end=True))
        async with _from(f"edge {target.edge_id}"):
            await call.done_writing()
            done = await _event(call)
    except BaseException:
        call.cancel()
        raise
    c.metrics.inc("snapshots_copied")
    c.metrics.inc("snapshot_copy_bytes", sent)
    c.metrics.observe("snapshot_copy_seconds", time.perf_counter() - started)
    return done.snapshot


async def _event(call: grpc.aio.StreamStreamCall[pb.SnapshotChunk, pb.ImportSnapshotEvent]) -> (
    pb.ImportSnapshotEvent
):  # fmt: skip
    ev = await call.read()
    if ev is grpc.aio.EOF:
        code, details = await call.code(), await call.details()
        raise Unavailable(f"the target edge ended the snapshot import without an answer "
                          f"({code.name.lower()}: {details})")  # fmt: skip
    assert isinstance(ev, pb.ImportSnapshotEvent)
    return ev


@asynccontextmanager
async def _from(component: str) -> AsyncIterator[None]:
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc, component) from None


async def on_edge(
    request: web.Request,
    snapshot_id: str,
    source: EdgeEntry,
    target: EdgeEntry,
    use: Callable[[str], Awaitable[T]],
    *,
    sandbox_id: str = "",
    cache: bool = True,
) -> T:
    """Copy the snapshot (``sandbox_id``: that paused sandbox's) to ``target``, run
    ``use(copy_id)`` (a create from it) and delete the copy whatever happens (sandboxes
    started from it keep its files). ``cache``: the target keeps the snapshot's files by
    digest for the next copy of it (not for a snapshot used once)."""
    snap = await copy(request, snapshot_id, source, target, sandbox_id=sandbox_id, cache=cache)
    try:
        return await use(snap.id)
    finally:
        await asyncio.shield(_delete(request, target, snap.id))


async def _delete(request: web.Request, target: EdgeEntry, copy_id: str) -> None:
    c, p = ctx(request), principal(request)
    stub = c.upstream.edge_stub(target)
    with contextlib.suppress(DsecError):  # the target's copy goes with its edge otherwise
        await rpc(
            f"edge {target.edge_id}",
            stub.DeleteSnapshot(
                pb.SnapshotRef(snapshot_id=copy_id), metadata=p.metadata(), timeout=60
            ),
        )


async def drop_copies(request: web.Request, snapshot_id: str) -> None:
    """Ask every other healthy edge to drop its cached copy of deleted ``snapshot_id``
    (best effort: an edge that misses it drops the files under its cache bound)."""
    c, p = ctx(request), principal(request)
    req = pb.SnapshotRef(snapshot_id=snapshot_id)

    async def one(e: EdgeEntry) -> None:
        with contextlib.suppress(DsecError):
            stub = c.upstream.edge_stub(e)
            await rpc(f"edge {e.edge_id}", stub.DropSnapshotCopies(req, metadata=p.metadata(),
                                                                   timeout=10))  # fmt: skip

    edges = [e for e in await c.upstream.edges() if e.healthy]
    await asyncio.gather(*(one(e) for e in edges if e.edge_id != snapshot_edge_of(snapshot_id)))


async def edge_entry(request: web.Request, edge_id: str) -> EdgeEntry:
    """The healthy edge ``edge_id`` (InvalidArgument if unknown, Unavailable if down)."""
    for e in await ctx(request).upstream.edges(fresh=True):
        if e.edge_id == edge_id:
            if not e.healthy:
                raise Unavailable(f"edge {edge_id} is down")
            return e
    raise InvalidArgument(f"no edge {edge_id!r}")


async def fork_to(
    request: web.Request,
    parent: pb.SandboxInfo,
    count: int,
    target: EdgeEntry,
    timeout_s: int | None,
) -> list[pb.SandboxInfo]:
    """Fork ``count`` children of the running microVM ``parent`` onto ``target``: a full
    snapshot of the parent on its edge (it keeps running), copied to ``target``, each child
    admitted by iam and started from the copy; the snapshot and the copy are deleted after.
    A paused ``parent`` needs no snapshot: its pause snapshot is copied (it stays paused).
    A failure leaves no child and no snapshot."""
    from dsec.apiserver.admission import admit_and_create

    c, p = ctx(request), principal(request)
    source = await edge_entry(request, parent.edge_id)
    stub = c.upstream.edge_stub(source)
    paused = parent.state == "paused"
    snap_id = new_snapshot_id(source.edge_id, os.urandom(RANDOM_BYTES))
    if not paused:
        take = pb.CreateSnapshotRequest(sandbox_id=parent.id, snapshot_id=snap_id,
                                        name="fork", mode="full")  # fmt: skip
        await rpc(f"edge {source.edge_id}", stub.CreateSnapshot(take, metadata=p.metadata(),
                                                                timeout=300))  # fmt: skip
    d = spec_json(parent.spec)
    if timeout_s is not None:
        d["timeout_s"] = timeout_s
    spec = SandboxSpec.from_dict(d)

    async def children(copy_id: str) -> list[pb.SandboxInfo]:
        out: list[pb.SandboxInfo] = []
        try:
            for _ in range(count):
                info = await admit_and_create(
                    request, parent.project, spec, [target], from_snapshot=copy_id
                )
                out.append(info)
        except BaseException:
            dst = c.upstream.edge_stub(target)
            for ch in out:
                kill = dst.KillSandbox(
                    pb.SandboxRef(sandbox_id=ch.id), metadata=p.metadata(), timeout=60
                )
                with contextlib.suppress(DsecError):
                    await rpc("edge", kill)
            raise
        return out

    if paused:
        return await on_edge(request, parent.id, source, target, children, sandbox_id=parent.id)
    try:
        return await on_edge(request, snap_id, source, target, children, cache=False)
    finally:
        await asyncio.shield(_delete(request, source, snap_id))
