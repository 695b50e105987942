"""Starting one sandbox on one edge, the way every create does it (plain, from a snapshot,
for a trajectory): the iam admits it against the project tree's quotas first (in the
apiserver's shared ``AdmitMany`` batch), then the edge creates it and has the final say; if
the edge refuses or the call fails, the admission is released again. The edge's create
goes as a message of the apiserver's kept stream to it (:mod:`dsec.apiserver.edge_stream`).
"""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from dsec.apiserver import audit
from dsec.apiserver.context import ctx, principal
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core.errors import DsecError, NodeFull, Unavailable
from dsec.core.ids import RANDOM_BYTES, new_sandbox_id
from dsec.core.spec import SandboxSpec, create_deadline_s
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import spec_to_pb


async def admit_and_create(
    request: web.Request, project: str, spec: SandboxSpec, edges: list[EdgeEntry], *,
    from_snapshot: str = "",
) -> pb.SandboxInfo:  # fmt: skip
    """Admit a new sandbox of ``project`` on the first of ``edges`` and create it there;
    when that edge is full or unreachable, release it and try the next.

    Raises:
        QuotaExceeded, NotFound, ...: the iam refused it (nothing to undo).
        NodeFull, Unavailable: the last edge refused it or could not be reached.
        DsecError: another failure of the edge's create (the admission was released).
    """
    c, p = ctx(request), principal(request)
    req_spec = spec_to_pb(spec)
    last: DsecError | None = None
    for entry in edges:
        sid = new_sandbox_id(entry.edge_id, os.urandom(RANDOM_BYTES))
        request[audit.TARGET] = sid
        await c.upstream.iam_batch.admit(
            pb.AdmitRequest(project=project, sandbox_id=sid, cpu=spec.cpu,
                            memory_mb=spec.memory_mb, edge_id=entry.edge_id)
        )  # fmt: skip
        create = pb.CreateSandboxRequest(spec=req_spec, project=project, owner=p.subject,
                                         sandbox_id=sid, from_snapshot=from_snapshot)  # fmt: skip
        try:
            info = await c.upstream.edge_stream(entry).create(
                create, p.metadata(), create_deadline_s(spec.backend)
            )
        except BaseException as exc:
            await asyncio.shield(release(request, [sid]))
            if isinstance(exc, Unavailable):  # full, or unreachable (died since its report)
                c.metrics.inc("create_edge_unavailable", code=exc.code)
                last = exc
                continue
            raise
        c.upstream.placement.placed(entry.edge_id, spec.memory_mb)
        c.metrics.inc("sandboxes_created")
        return info
    raise last or NodeFull("every edge is full")


async def release(request: web.Request, sids: list[str]) -> None:
    """Give back the admissions of sandboxes that were not created."""
    iam = ctx(request).upstream.iam
    for sid in sids:
        try:
            await rpc("iam", iam.Release(pb.ReleaseRequest(sandbox_id=sid), timeout=10))
        except DsecError:
            pass  # the edge's periodic reconcile frees it
