"""The edge's gRPC service: translates requests to the sandbox manager and relays runtime
calls between the apiserver and each sandbox's aether.

The apiserver authenticates users; it forwards the principal in call metadata
(``x-dsec-project``, ``x-dsec-subject``, ``x-dsec-role``), which the edge trusts only
because mTLS proved the caller is an apiserver (enforced by the server's role table).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from dsec.agent import protocol
from dsec.core.errors import (
    DsecError,
    InvalidArgument,
    InvalidState,
    SandboxFailed,
    Unavailable,
)
from dsec.core.lifecycle import State
from dsec.edge import agent_client
from dsec.edge.create_stream import CreateStreamServicer
from dsec.edge.images.reference import parse_reference
from dsec.edge.images.service import EdgeImages, image_to_pb
from dsec.edge.manager import Caller, SandboxManager
from dsec.edge.named_snapshots import NamedSnapshots, SnapshotRecord
from dsec.edge.records import SandboxRecord
from dsec.edge.snapshot_transfer import SnapshotTransfer
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.convert import policy_from_pb, spec_from_pb, spec_to_pb

REPLY_LIMIT = 32 * 1024 * 1024
STREAM_CLOSE_GRACE_S = 10.0  # how long a finished runtime call waits for its caller to stop


def caller_of(context: grpc.aio.ServicerContext[Any, Any]) -> Caller:
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    role = md.get("x-dsec-role", "")
    scopes = md.get("x-dsec-scopes")
    return Caller(
        project=md.get("x-dsec-project", ""),
        subject=md.get("x-dsec-subject", ""),
        admin=role == "admin",
        scopes=None if scopes is None else tuple(s for s in scopes.split(",") if s),
        visible=tuple(s for s in md.get("x-dsec-visible", "").split(",") if s),
    )


def info_to_pb(
    rec: SandboxRecord, edge_id: str, network_stats: dict[str, int] | None = None
) -> pb.SandboxInfo:
    return pb.SandboxInfo(
        network_stats=network_stats or {},
        id=rec.id,
        project=rec.project,
        owner=rec.owner,
        state=rec.state.value,
        spec=spec_to_pb(rec.spec),
        edge_id=edge_id,
        created_at=rec.created_at,
        started_at=rec.started_at,
        expires_at=rec.expires_at,
        error=rec.error,
        moved_to=rec.moved_to,
    )


def snapshot_to_pb(rec: SnapshotRecord, edge_id: str) -> pb.SnapshotInfo:
    return pb.SnapshotInfo(
        id=rec.id,
        name=rec.name,
        project=rec.project,
        owner=rec.owner,
        source_sandbox=rec.source_sandbox,
        backend=rec.backend,
        mode=rec.mode,
        size_bytes=rec.size_bytes,
        created_at=rec.created_at,
        edge_id=edge_id,
        spec=spec_to_pb(rec.spec),
    )


def _parse_request(raw: bytes) -> dict[str, Any]:
    try:
        req = protocol.decode_json(raw)
    except protocol.ProtocolError as exc:
        raise InvalidArgument(str(exc)) from None
    if not isinstance(req.get("op"), str):
        raise InvalidArgument("runtime request needs an 'op'")
    return req


class EdgeService(CreateStreamServicer):
    def __init__(
        self,
        manager: SandboxManager,
        status: Any,
        images: EdgeImages | None = None,
        *,
        list_backends: Callable[[], Awaitable[pb.BackendList]] | None = None,
    ) -> None:
        self._m = manager
        self._status = status  # callable returning pb.EdgeStatus
        self._images = images
        self._list_backends = list_backends
        self._snapshots = NamedSnapshots(manager, images, manager.snapshots_dir)
        self._transfer = SnapshotTransfer(self._snapshots)

    async def ListBackends(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BackendList:
        if self._list_backends is None:
            raise Unavailable("this edge does not report its backends")
        return await self._list_backends()

    def _image_service(self) -> EdgeImages:
        if self._images is None:
            raise Unavailable("this edge has no image store")
        return self._images

    async def PullImage(
        self, request: pb.PullImageRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.PullImageEvent]:
        async for event in self._image_service().pull(request):
            yield event

    async def ListImages(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ImageList:
        return self._image_service().list()

    async def RemoveImage(
        self, request: pb.ImageRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Empty:
        self._image_service().remove(request.name)
        return pb.Empty()

    async def PackSandbox(
        self, request: pb.PackSandboxRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ImageInfo:
        images = self._image_service()
        if request.push:
            parse_reference(request.name)  # fail before freezing the sandbox
        rec = self._m.get(request.sandbox_id, caller_of(context))
        if rec.state is not State.RUNNING:
            raise InvalidState(f"sandbox {rec.id} is {rec.state.value}; only running ones pack")
        backend = self._m.backend(rec.spec.backend)
        upper = self._m.paths(rec.id).state_dir / "upper"
        await backend.pause(rec.id)  # a still upper dir while it is read
        try:
            image = await images.pack(upper, rec.spec.image, request.name)
        finally:
            await backend.resume(rec.id)
        if request.push:
            await images.push(image.name, request)
        return image_to_pb(image, self._m.edge_id)

    async def BuildImage(
        self,
        request_iterator: AsyncIterator[pb.BuildImageRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.BuildImageEvent]:
        images = self._image_service()
        async for event in images.build(request_iterator, self._m, caller_of(context)):
            yield event

    async def SaveImage(
        self, request: pb.ImageRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SaveImageChunk]:
        async for chunk in self._image_service().save(request.name):
            yield chunk

    async def LoadImage(
        self,
        request_iterator: AsyncIterator[pb.LoadImageRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.PullImageEvent]:
        async for event in self._image_service().load(request_iterator):
            yield event

    async def GcImages(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GcImagesReply:
        res = await self._image_service().gc()
        return pb.GcImagesReply(layers=res.layers, blobs=res.blobs, bytes_freed=res.bytes_freed)

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        caller = caller_of(context)
        spec = spec_from_pb(request.spec)
        if request.from_snapshot:
            rec = await self._snapshots.create_sandbox(
                request.from_snapshot,
                request.sandbox_id,
                spec,
                project=request.project or caller.project,
                owner=request.owner or caller.subject,
                caller=caller,
                moved_from=request.moved_from,
            )
            return info_to_pb(rec, self._m.edge_id)
        rec = await self._m.create(
            request.sandbox_id,
            spec,
            project=request.project or caller.project,
            owner=request.owner or caller.subject,
            caller=caller,
        )
        return info_to_pb(rec, self._m.edge_id)

    async def GetSandbox(
        self, request: pb.SandboxRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = self._m.get(request.sandbox_id, caller_of(context))
        return info_to_pb(rec, self._m.edge_id, await self._m.network_stats(rec))

    async def SetNetwork(
        self, request: pb.SetNetworkRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        policy = policy_from_pb(request.network)
        rec = await self._m.set_network(request.sandbox_id, policy, caller_of(context))
        return info_to_pb(rec, self._m.edge_id, await self._m.network_stats(rec))

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxList:
        recs = self._m.query(
            caller_of(context),
            project=request.project,
            include_terminated=request.include_terminated,
        )
        return pb.SandboxList(sandboxes=[info_to_pb(r, self._m.edge_id) for r in recs])

    async def KillSandbox(
        self, request: pb.SandboxRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = await self._m.kill(request.sandbox_id, caller_of(context))
        return info_to_pb(rec, self._m.edge_id)

    async def PauseSandbox(
        self, request: pb.SandboxRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = await self._m.pause(request.sandbox_id, caller_of(context))
        return info_to_pb(rec, self._m.edge_id)

    async def ForkSandbox(
        self, request: pb.ForkSandboxRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxList:
        recs = await self._m.fork(
            request.sandbox_id, request.count, caller_of(context), list(request.child_ids)
        )
        return pb.SandboxList(sandboxes=[info_to_pb(r, self._m.edge_id) for r in recs])

    async def _snapshot_info(
        self, rec: SnapshotRecord | Awaitable[SnapshotRecord]
    ) -> pb.SnapshotInfo:
        """The reply of every single-snapshot call: the record (awaited if need be)."""
        if not isinstance(rec, SnapshotRecord):
            rec = await rec
        return snapshot_to_pb(rec, self._m.edge_id)

    async def CreateSnapshot(
        self, request: pb.CreateSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SnapshotInfo:
        return await self._snapshot_info(self._snapshots.create(
            request.sandbox_id, request.snapshot_id, request.name, request.mode, caller_of(context)
        ))  # fmt: skip

    async def ListSnapshots(
        self, request: pb.ListSnapshotsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SnapshotList:
        recs = self._snapshots.query(
            caller_of(context),
            project=request.project,
            sandbox_id=request.sandbox_id,
            name=request.name,
        )
        return pb.SnapshotList(snapshots=[snapshot_to_pb(r, self._m.edge_id) for r in recs])

    async def GetSnapshot(
        self, request: pb.SnapshotRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SnapshotInfo:
        return await self._snapshot_info(
            self._snapshots.get(request.snapshot_id, caller_of(context))
        )

    async def DeleteSnapshot(
        self, request: pb.SnapshotRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SnapshotInfo:
        return await self._snapshot_info(
            self._snapshots.delete(request.snapshot_id, caller_of(context))
        )

    async def ExportSnapshot(
        self, request: pb.ExportSnapshotRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SnapshotChunk]:
        files = list(request.files)
        caller = caller_of(context)
        async for chunk in self._transfer.export(
            request.snapshot_id, files, caller, sandbox_id=request.sandbox_id
        ):
            yield chunk

    async def ImportSnapshot(
        self,
        request_iterator: AsyncIterator[pb.SnapshotChunk],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ImportSnapshotEvent]:
        async for event in self._transfer.import_(request_iterator, caller_of(context)):
            yield event

    async def EndMovedSandbox(
        self, request: pb.MovedSandbox, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        caller = caller_of(context)
        rec = await self._m.end_moved(request.sandbox_id, request.moved_to, caller)
        return info_to_pb(rec, self._m.edge_id)

    async def DropSnapshotCopies(
        self, request: pb.SnapshotRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Empty:
        await self._transfer.drop_copies(request.snapshot_id)
        return pb.Empty()

    async def ResumeSandbox(
        self, request: pb.SandboxRef, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = await self._m.resume(request.sandbox_id, caller_of(context))
        return info_to_pb(rec, self._m.edge_id)

    async def SetTimeout(
        self, request: pb.SetTimeoutRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = await self._m.set_timeout(request.sandbox_id, request.timeout_s, caller_of(context))
        return info_to_pb(rec, self._m.edge_id)

    async def Status(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EdgeStatus:
        status: pb.EdgeStatus = self._status()
        return status

    async def MarkTrajectory(
        self, request: pb.MarkTrajectoryRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SandboxInfo:
        rec = self._m.mark_trajectory(
            request.sandbox_id, request.trajectory_id, caller_of(context), request.epoch
        )
        return info_to_pb(rec, self._m.edge_id)

    async def Call(
        self, request: pb.RuntimeCall, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RuntimeReply:
        caller = caller_of(context)
        if request.unbound:
            self._m.check_unbound(request.sandbox_id, caller)
        if request.trajectory_epoch:
            self._m.check_epoch(request.sandbox_id, request.trajectory_epoch, caller)
        sock = self._m.agent_socket(request.sandbox_id, caller)
        req = _parse_request(request.request)
        remaining = context.time_remaining()
        try:
            res = await agent_client.call(
                sock,
                req,
                request.stdin if request.has_stdin else None,
                limit=REPLY_LIMIT,
                timeout=remaining,
            )
        except (OSError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
            raise self._lost(request.sandbox_id, caller, exc) from exc
        return pb.RuntimeReply(
            final=json.dumps(res.final).encode(),
            stdout=res.stdout,
            stderr=res.stderr,
            events=[json.dumps(e).encode() for e in res.events],
            truncated=res.truncated,
        )

    async def Stream(
        self,
        request_iterator: AsyncIterator[pb.RuntimeFrame],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.RuntimeFrame]:
        caller = caller_of(context)
        first = await anext(request_iterator, None)
        if first is None:
            return
        if first.kind != protocol.KIND_JSON:
            raise InvalidArgument("the first runtime frame must be the JSON request")
        sock = self._m.agent_socket(first.sandbox_id, caller)
        req = _parse_request(first.data)
        try:
            stream = await agent_client.open_stream(sock, req)
        except (OSError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
            raise self._lost(first.sandbox_id, caller, exc) from exc

        async def pump_in() -> None:
            async for frame in request_iterator:
                await stream.send(frame.kind, frame.data)

        pump = asyncio.ensure_future(pump_in())
        try:
            async for kind, payload in stream:
                yield pb.RuntimeFrame(kind=kind, data=payload)
            # Finish only once the caller stops writing (it half-closes or cancels when it
            # has the final frame): with grpc.aio a write racing the call's end replaces
            # the whole call's outcome, final frame included, with INTERNAL.
            with contextlib.suppress(Exception):  # a late input error changes nothing now
                await asyncio.wait_for(asyncio.shield(pump), STREAM_CLOSE_GRACE_S)
        except (OSError, asyncio.IncompleteReadError, protocol.ProtocolError) as exc:
            raise self._lost(first.sandbox_id, caller, exc) from exc
        finally:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await pump
            await stream.aclose()

    def _lost(self, sandbox_id: str, caller: Caller, exc: BaseException) -> DsecError:
        """A broken agent connection: say whether the sandbox went away or the agent did."""
        try:
            rec = self._m.get(sandbox_id, caller)
        except DsecError as err:
            return err
        if rec.state is not State.RUNNING:
            return InvalidState(f"sandbox {sandbox_id} is {rec.state.value}: the call was cut off")
        return SandboxFailed(f"lost the connection to the agent of {sandbox_id}: {exc}")
