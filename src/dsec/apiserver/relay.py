"""Calling a sandbox's runtime through its edge: unary (``Edge.Call``) and streaming
(``Edge.Stream``), with errors turned back into DsecError."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc

from dsec.agent import protocol
from dsec.apiserver.auth import Principal
from dsec.apiserver.context import Ctx
from dsec.apiserver.upstream import rpc
from dsec.core.errors import DeadlineExceeded, error_from_wire
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.rpc.errors import translate_rpc_error


@dataclass(frozen=True, slots=True)
class Reply:
    result: dict[str, Any]
    stdout: bytes
    stderr: bytes
    events: list[dict[str, Any]]
    truncated: bool


def raise_for_final(final: dict[str, Any]) -> dict[str, Any]:
    err = final.get("error")
    if isinstance(err, dict):
        raise error_from_wire(str(err.get("code", "internal")), str(err.get("message", "")))
    res = final.get("result")
    return res if isinstance(res, dict) else {}


async def call(
    c: Ctx,
    p: Principal,
    sandbox_id: str,
    request: dict[str, Any],
    stdin: bytes | None = None,
    *,
    deadline_s: float = 3600,
    unbound: bool = False,
    trajectory_epoch: str = "",
) -> Reply:
    """``unbound``: refuse (TrajectoryBound) if the sandbox is bound to a trajectory;
    ``trajectory_epoch``: unless it is bound at that epoch (``trajectory_bindings.py``)."""
    stub = await c.upstream.edge_for(sandbox_id)
    reply = await rpc(
        "edge",
        stub.Call(
            pb.RuntimeCall(
                sandbox_id=sandbox_id,
                request=json.dumps(request).encode(),
                stdin=stdin or b"",
                has_stdin=stdin is not None,
                unbound=unbound,
                trajectory_epoch=trajectory_epoch,
            ),
            metadata=p.metadata(),
            timeout=deadline_s,
        ),
    )
    final = json.loads(reply.final)
    return Reply(
        result=raise_for_final(final) if "error" in final else final.get("result", {}),
        stdout=reply.stdout,
        stderr=reply.stderr,
        events=[json.loads(e) for e in reply.events],
        truncated=reply.truncated,
    )


class EdgeStream:
    """One runtime call streamed through the sandbox's edge."""

    def __init__(self, call: grpc.aio.StreamStreamCall[pb.RuntimeFrame, pb.RuntimeFrame]) -> None:
        self._call = call

    @classmethod
    async def open(
        cls, c: Ctx, p: Principal, sandbox_id: str, request: dict[str, Any]
    ) -> EdgeStream:
        stub = await c.upstream.edge_for(sandbox_id)
        call = stub.Stream(metadata=p.metadata())
        first = pb.RuntimeFrame(
            sandbox_id=sandbox_id, kind=protocol.KIND_JSON, data=json.dumps(request).encode()
        )
        stream = cls(call)
        await stream._guard(call.write(first))
        return stream

    async def send(self, kind: int, data: bytes = b"") -> None:
        await self._guard(self._call.write(pb.RuntimeFrame(kind=kind, data=data)))

    async def done_writing(self) -> None:
        await self._guard(self._call.done_writing())

    async def read(self) -> tuple[int, bytes] | None:
        """The next frame, or None when the call ended."""
        frame = await self._guard(self._call.read())
        if frame is grpc.aio.EOF:
            return None
        assert isinstance(frame, pb.RuntimeFrame)
        return frame.kind, frame.data

    def cancel(self) -> None:
        self._call.cancel()

    async def _guard(self, aw: Any) -> Any:
        try:
            return await aw
        except grpc.aio.AioRpcError as exc:
            raise translate_rpc_error(exc, "edge") from None
        except grpc.aio.UsageError:
            # Writing after the server finished: the final frame (or error) will tell why.
            return None


async def read_final(stream: EdgeStream) -> dict[str, Any]:
    """Read ``stream`` to its final frame: the result, or the error it carries, raised."""
    while (frame := await stream.read()) is not None:
        kind, data = frame
        if kind == protocol.KIND_JSON:
            msg = protocol.decode_json(data)
            if protocol.is_final(msg):
                return raise_for_final(msg)
    raise DeadlineExceeded("the runtime call ended without a result")
