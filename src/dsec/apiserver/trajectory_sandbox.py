"""What the trajectory log does to sandboxes besides relaying calls: checkpoints (packs)
and dropping their images, re-running recorded steps to rebuild a restored sandbox, and
whole-file transfers (a bound sandbox's file reads and writes are buffered so their bytes
can be recorded)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from dsec.agent import protocol
from dsec.apiserver import relay
from dsec.apiserver.auth import Principal
from dsec.apiserver.context import Ctx
from dsec.apiserver.upstream import rpc
from dsec.core.errors import DeadlineExceeded, DsecError, PayloadTooLarge
from dsec.obs import log
from dsec.rpc._gen import dsec_pb2 as pb
from dsec.trajectory.log import Step, Trajectory

_log = logging.getLogger("dsec.apiserver.trajectory")

MAX_BOUND_TRANSFER = 256 * 1024**2  # file bytes a bound call buffers to record them
READ_ONLY_OPS = frozenset({"files.read", "files.stat", "files.list", "process.list", "shell.list"})
PACK_TIMEOUT_S = 600
KEEP_CHECKPOINTS = 3  # the latest ones; older images are removed


async def checkpoint(c: Ctx, p: Principal, tid: str, sandbox_id: str) -> dict[str, Any]:
    """Pack the sandbox into an image that holds its state after the log's last step."""
    assert c.trajectories is not None
    t = await c.trajectories.get(tid)
    name = f"traj-{t.id[:24]}:s{t.steps}"
    stub = await c.upstream.edge_for(sandbox_id)
    await rpc(
        f"edge of {sandbox_id}",
        stub.PackSandbox(
            pb.PackSandboxRequest(sandbox_id=sandbox_id, name=name),
            metadata=p.metadata(),
            timeout=PACK_TIMEOUT_S,
        ),
    )
    entry = {"step": t.steps, "image": name, "sandbox_id": sandbox_id, "at": time.time()}

    dropped: list[dict[str, Any]] = []

    def add(x: Trajectory) -> Trajectory:
        kept = [k for k in x.checkpoints if k["step"] != entry["step"]]
        kept = sorted([*kept, entry], key=lambda k: int(k["step"]))
        dropped[:] = kept[:-KEEP_CHECKPOINTS]
        return replace(x, checkpoints=kept[-KEEP_CHECKPOINTS:])

    await c.trajectories.update(tid, add)
    await drop_images(c, p, dropped)
    c.metrics.inc("trajectory_checkpoints")
    return entry


async def drop_images(c: Ctx, p: Principal, checkpoints: list[dict[str, Any]]) -> None:
    """Forget checkpoint images (best effort: their layers go at the edge's next gc)."""
    for k in checkpoints:
        try:
            stub = await c.upstream.edge_for(str(k["sandbox_id"]))
            await rpc(
                "edge",
                stub.RemoveImage(
                    pb.ImageRef(name=str(k["image"])), metadata=p.metadata(), timeout=10
                ),
            )
        except DsecError as exc:
            log(
                _log,
                "checkpoint image not removed",
                level=logging.WARNING,
                image=k["image"],
                error=exc.message,
            )


async def read_file(c: Ctx, p: Principal, sandbox_id: str, req: dict[str, Any]) -> bytes:
    """A whole file read through the edge (bound sandboxes record what they read)."""
    stream = await relay.EdgeStream.open(c, p, sandbox_id, req)
    chunks: list[bytes] = []
    size = 0
    try:
        await stream.done_writing()
        while (frame := await stream.read()) is not None:
            kind, data = frame
            if kind == protocol.KIND_OUT:
                size += len(data)
                if size > MAX_BOUND_TRANSFER:
                    raise PayloadTooLarge(
                        f"a sandbox bound to a trajectory reads files of at most "
                        f"{MAX_BOUND_TRANSFER} bytes (each read is recorded)"
                    )
                chunks.append(data)
            elif kind == protocol.KIND_JSON:
                msg = protocol.decode_json(data)
                if protocol.is_final(msg):
                    relay.raise_for_final(msg)
                    return b"".join(chunks)
        raise DeadlineExceeded("file download ended without a result")
    finally:
        stream.cancel()


async def write_file(
    c: Ctx, p: Principal, sandbox_id: str, req: dict[str, Any], body: bytes
) -> dict[str, Any]:
    stream = await relay.EdgeStream.open(c, p, sandbox_id, req)
    try:
        for i in range(0, len(body), protocol.CHUNK):
            await stream.send(protocol.KIND_IN, body[i : i + protocol.CHUNK])
        await stream.send(protocol.KIND_CLOSE)
        await stream.done_writing()
        return await relay.read_final(stream)
    finally:
        stream.cancel()


async def read_body(request: web.Request) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(protocol.CHUNK):
        size += len(chunk)
        if size > MAX_BOUND_TRANSFER:
            raise PayloadTooLarge(
                f"a sandbox bound to a trajectory takes uploads of at most {MAX_BOUND_TRANSFER} "
                "bytes (each upload is recorded)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def rerun(c: Ctx, p: Principal, sandbox_id: str, step: Step) -> None:
    """Run a recorded (idempotent) step again for real, to rebuild a restored sandbox."""
    if step.op in READ_ONLY_OPS or step.status != 200:
        return
    if step.op == "files.write":
        await write_file(c, p, sandbox_id, step.raw_request, step.payload or b"")
        return
    timeout = float(step.raw_request.get("timeout", 60))
    await relay.call(c, p, sandbox_id, step.raw_request, step.payload, deadline_s=timeout + 30)
