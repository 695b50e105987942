"""Resuming a paused microVM on another edge: the sandbox moves, under a new id.

A sandbox id names its edge, so the moved sandbox gets a new id on the target; the apiserver
keeps no routing table. The steps, each undone if a later one fails:

1. the source's pause snapshot (RAM, device state, config disk, disk layer and what the
   target lacks of its backing chain) is copied to the target like a named snapshot
   (``snapshot_copy``: streamed, checked by digest; the target does not cache it);
2. the target starts the new id from the copy (the same restore as a fork child: every
   process, shell session, file and ``/dev/shm`` carries on), then drops the copy;
3. the iam renames the sandbox's allocation to the new id (``MoveAllocation``: one row
   renamed, so the project's usage is the same at every moment; the new sandbox is never
   admitted as a second one);
4. the source ends the paused sandbox (``EndMovedSandbox``, refused if it was resumed there
   meanwhile) and keeps its record for an hour as a tombstone: every call on the old id
   answers 404 naming the new id.

A failure before step 4 leaves the paused sandbox as it was on its own edge, resumable
there: the target's sandbox is killed and its copy and staging files removed, and the
allocation is given back to the old id.

If this apiserver dies mid-move, the edges finish it from the iam's reconcile answer
(``ReconcileReply``): the target was created with ``moved_from``, so if it still holds no
allocation ``MOVE_GRACE_S`` after it started (died before step 3) its edge kills it and the
sandbox stays paused at home; if the allocation was renamed (died before step 4), the iam
remembers the move and after ``MOVE_SETTLE_S`` the source edge ends the paused sandbox as
moved, leaving the same tombstone. A source resumed at home meanwhile stays there: the
allocation goes back to it (or, if the new sandbox ended since and freed it, it is counted
anew as the move counted it) and the new sandbox, holding none, is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from time import monotonic

from aiohttp import web

from dsec.apiserver import snapshot_copy
from dsec.apiserver.context import ctx, principal
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core.errors import DeadlineExceeded, DsecError, InvalidArgument, InvalidState
from dsec.core.ids import RANDOM_BYTES, new_sandbox_id
from dsec.core.spec import MOVE_GRACE_S, create_deadline_s
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc._gen import dsec_pb2_grpc as pb_grpc

_log = logging.getLogger("dsec.apiserver")


async def resume_on(
    request: web.Request, info: pb.SandboxInfo, target: EdgeEntry
) -> pb.SandboxInfo:
    """Resume paused microVM ``info`` on ``target``; returns the sandbox under its new id.

    Raises:
        InvalidState: it is not paused, or was resumed on its edge during the move.
        InvalidArgument: not a microVM, or ``target`` does not run microVMs.
        SandboxFailed / Unavailable / NodeFull: the copy or the start there failed (the
            sandbox stays paused on its edge).
    """
    c, p = ctx(request), principal(request)
    if info.state != "paused":
        raise InvalidState(f"sandbox {info.id} is {info.state}: only a paused one resumes "
                           "on another edge")  # fmt: skip
    if info.spec.backend != "microvm":
        raise InvalidArgument(
            f"a {info.spec.backend} sandbox cannot move to another edge (microvm ones can)"
        )
    if info.spec.backend not in target.view.status.backends:
        raise InvalidArgument(f"edge {target.edge_id} does not run {info.spec.backend} sandboxes")
    source = await snapshot_copy.edge_entry(request, info.edge_id)
    new_id = new_sandbox_id(target.edge_id, os.urandom(RANDOM_BYTES))
    dst = c.upstream.edge_stub(target)
    md = p.metadata()

    started: list[float] = []

    async def start(copy_id: str) -> pb.SandboxInfo:
        create = pb.CreateSandboxRequest(spec=info.spec, project=info.project, owner=info.owner,
                                         sandbox_id=new_id, from_snapshot=copy_id,
                                         moved_from=info.id)  # fmt: skip
        deadline = create_deadline_s(info.spec.backend)
        made = await c.upstream.edge_stream(target).create(create, md, deadline)
        started.append(monotonic())
        return made

    moved = await snapshot_copy.on_edge(request, info.id, source, target, start, sandbox_id=info.id)
    step = "iam"
    try:
        if monotonic() - started[0] > MOVE_GRACE_S / 2:  # its edge may be killing it
            raise DeadlineExceeded(f"moving {info.id} took too long: it stays paused")
        await _move_allocation(request, info.id, new_id)
        step = "source"
        end = pb.MovedSandbox(sandbox_id=info.id, moved_to=new_id)
        src = c.upstream.edge_stub(source)
        await rpc(f"edge {source.edge_id}", src.EndMovedSandbox(end, metadata=md, timeout=120))
    except BaseException:
        await asyncio.shield(_undo(request, info.id, new_id, dst, allocation=step == "source"))
        raise
    c.metrics.inc("sandboxes_moved")
    log(_log, "sandbox moved", sandbox=info.id, to=new_id, source=source.edge_id,
        target=target.edge_id)  # fmt: skip
    return moved


async def _move_allocation(request: web.Request, old: str, new: str) -> None:
    req = pb.MoveAllocationRequest(from_sandbox_id=old, to_sandbox_id=new)
    await rpc("iam", ctx(request).upstream.iam.MoveAllocation(req, timeout=10))


async def _undo(
    request: web.Request, old: str, new: str, dst: pb_grpc.EdgeAsyncStub, *, allocation: bool
) -> None:
    """The sandbox stays on its edge: the allocation back to ``old``, ``new`` killed."""
    p = principal(request)
    if allocation:
        try:
            await _move_allocation(request, new, old)
        except DsecError as exc:  # the source's reconcile cannot restore it: say so
            log(_log, "allocation not given back after a failed move", logging.ERROR,
                sandbox=old, moved=new, error=exc.message)  # fmt: skip
    with contextlib.suppress(DsecError):
        await rpc(
            "edge",
            dst.KillSandbox(pb.SandboxRef(sandbox_id=new), metadata=p.metadata(), timeout=60),
        )
