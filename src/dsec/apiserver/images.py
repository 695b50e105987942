"""Image routes: pull onto the edges, list, remove, gc, save/load as OCI layout tars (each
edge owns its image store).

``POST /v1/images/pull`` pulls on every healthy edge (or the one named by ``edge_id``) at
once. With ``"stream": true`` the answer is NDJSON: ``{"edge_id", "progress": {...}}`` lines
while layers move, then one ``{"images": [...]}`` line, or ``{"error": {code, message}}``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from dsec.apiserver.auth import PLATFORM
from dsec.apiserver.context import ctx, flag, json_body, ok, principal, query, sandbox_id
from dsec.apiserver.roles import require_admin_on
from dsec.apiserver.upstream import EdgeEntry, rpc
from dsec.core.errors import DsecError, ImageNotFound, InvalidArgument, Unavailable
from dsec.rpc._gen import dsec_pb2 as pb

PULL_TIMEOUT_S = 3600.0


def image_json(info: pb.ImageInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "edge_id": info.edge_id,
        "layers": list(info.layers),
        "env": list(info.env),
        "cmd": list(info.cmd),
        "entrypoint": list(info.entrypoint),
        "workdir": info.workdir,
        "user": info.user,
        "created": info.created,
        "source": info.source,
        "backend": info.backend,
    }


async def _edges(request: web.Request, edge_id: str = "") -> list[EdgeEntry]:
    edges = [e for e in await ctx(request).upstream.edges() if e.healthy]
    if edge_id:
        edges = [e for e in edges if e.edge_id == edge_id]
        if not edges:
            raise Unavailable(f"edge {edge_id} is unknown or down")
    if not edges:
        raise Unavailable("no healthy edge is reporting to the watcher")
    return edges


def _pull_request(body: dict[str, Any]) -> pb.PullImageRequest:
    reference = body.get("reference")
    if not isinstance(reference, str) or not reference:
        raise InvalidArgument("'reference' (an image reference) is required")
    for key in ("platform", "username", "password"):
        if not isinstance(body.get(key, ""), str):
            raise InvalidArgument(f"{key!r} must be a string")
    return pb.PullImageRequest(
        reference=reference,
        platform=body.get("platform", ""),
        insecure=bool(body.get("insecure", False)),
        username=body.get("username", ""),
        password=body.get("password", ""),
    )


async def pull(request: web.Request) -> web.StreamResponse:
    """Pull an image onto the edges (NDJSON progress with "stream": true)."""
    c, p = ctx(request), principal(request)
    p.require("member")
    body = await json_body(request)
    req = _pull_request(body)
    edges = await _edges(request, str(body.get("edge_id") or ""))
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def one(entry: EdgeEntry) -> dict[str, Any]:
        stream = c.upstream.edge_stub(entry).PullImage(
            req, metadata=p.metadata(), timeout=PULL_TIMEOUT_S
        )

        async def consume() -> dict[str, Any]:
            image: dict[str, Any] = {}
            async for ev in stream:
                if ev.HasField("progress"):
                    pr = ev.progress
                    queue.put_nowait(
                        {
                            "edge_id": entry.edge_id,
                            "progress": {
                                "digest": pr.digest,
                                "status": pr.status,
                                "done": pr.done,
                                "total": pr.total,
                            },
                        }
                    )
                elif ev.HasField("image"):
                    image = image_json(ev.image)
            return image

        return await rpc(f"edge {entry.edge_id}", consume())

    tasks = [asyncio.ensure_future(one(e)) for e in edges]
    gathered = asyncio.gather(*tasks)
    if not body.get("stream"):
        images = await gathered
        return ok({"images": images})
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    try:
        while not gathered.done():
            getter: asyncio.Future[Any] = asyncio.ensure_future(queue.get())
            waiting: set[asyncio.Future[Any]] = {getter, gathered}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await resp.write(_line(getter.result()))
            else:
                getter.cancel()
        while not queue.empty():
            await resp.write(_line(queue.get_nowait()))
        try:
            final: dict[str, Any] = {"images": gathered.result()}
        except DsecError as exc:
            final = {"error": exc.to_wire()}
        await resp.write(_line(final))
    finally:
        for t in tasks:
            t.cancel()
        gathered.cancel()
    await resp.write_eof()
    return resp


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def list_images(request: web.Request) -> web.Response:
    """Images on every edge."""
    c, p = ctx(request), principal(request)
    p.require("member")
    edges = await _edges(request)
    lists = await asyncio.gather(
        *(
            rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).ListImages(pb.Empty(), metadata=p.metadata(), timeout=10),
            )
            for e in edges
        )
    )
    return ok({"images": [image_json(i) for lst in lists for i in lst.images]})


async def remove_image(request: web.Request) -> web.Response:
    """Forget an image on every edge (admin); ?name=REF."""
    c, p = ctx(request), principal(request)
    require_admin_on(p, PLATFORM)
    name = query(request, "name")
    removed = 0
    last: DsecError | None = None
    for e in await _edges(request):
        try:
            await rpc(
                f"edge {e.edge_id}",
                c.upstream.edge_stub(e).RemoveImage(
                    pb.ImageRef(name=name), metadata=p.metadata(), timeout=10
                ),
            )
            removed += 1
        except DsecError as exc:
            last = exc
    if not removed and last is not None:
        raise last
    return ok({"removed": removed})


async def gc_images(request: web.Request) -> web.Response:
    """Remove unreferenced layers and blobs on every edge (admin)."""
    c, p = ctx(request), principal(request)
    require_admin_on(p, PLATFORM)
    out = []
    for e in await _edges(request):
        res = await rpc(
            f"edge {e.edge_id}",
            c.upstream.edge_stub(e).GcImages(pb.Empty(), metadata=p.metadata(), timeout=600),
        )
        out.append(
            {
                "edge_id": e.edge_id,
                "layers": res.layers,
                "blobs": res.blobs,
                "bytes_freed": res.bytes_freed,
            }
        )
    return ok({"edges": out})


async def pack(request: web.Request) -> web.Response:
    """Pack a running sandbox's changes into a new image on its edge."""
    c, p = ctx(request), principal(request)
    p.require("member")
    sid = sandbox_id(request)
    body = await json_body(request)
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("'name' (the new image's name) is required")
    stub = await c.upstream.edge_for(sid)
    info = await rpc(
        f"edge of {sid}",
        stub.PackSandbox(
            pb.PackSandboxRequest(
                sandbox_id=sid,
                name=name,
                push=bool(body.get("push", False)),
                insecure=bool(body.get("insecure", False)),
                username=str(body.get("username") or ""),
                password=str(body.get("password") or ""),
            ),
            metadata=p.metadata(),
            timeout=PULL_TIMEOUT_S,
        ),
    )
    return ok(image_json(info), status=201)


BUILD_CHUNK = 1 << 20


def _build_options(request: web.Request) -> pb.BuildImageOptions:
    tag = query(request, "tag")
    build_args: dict[str, str] = {}
    for item in request.query.getall("build_arg", []):
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise InvalidArgument(f"build_arg must be NAME=value, got {item!r}")
        build_args[key] = value
    numbers: dict[str, int] = {}
    for key in ("memory_mb", "timeout_s"):
        raw = query(request, key, required=False, default="0")
        if not raw.isdigit():
            raise InvalidArgument(f"{key!r} must be a whole number")
        numbers[key] = int(raw)
    return pb.BuildImageOptions(
        tag=tag,
        dockerfile=query(request, "dockerfile", required=False, default="Dockerfile"),
        build_args=build_args,
        no_cache=flag(request, "no_cache"),
        **numbers,
    )


async def build(request: web.Request) -> web.StreamResponse:
    """Build an image from a Dockerfile on one edge; the body is the context tar.

    Answers NDJSON: ``{"step": {index, total, instruction, line}}``, ``{"cached": true}``,
    ``{"log": "..."}`` lines, then ``{"image": {...}}`` or ``{"error": {code, message}}``.
    """
    c, p = ctx(request), principal(request)
    p.require("member")
    opts = _build_options(request)
    edge = (await _edges(request, query(request, "edge_id", required=False)))[0]

    async def requests() -> AsyncIterator[pb.BuildImageRequest]:
        yield pb.BuildImageRequest(options=opts)
        async for chunk in request.content.iter_chunked(BUILD_CHUNK):
            yield pb.BuildImageRequest(context=chunk)

    call = c.upstream.edge_stub(edge).BuildImage(
        requests(), metadata=p.metadata(), timeout=PULL_TIMEOUT_S
    )
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)

    async def relay() -> None:
        async for ev in call:
            which = ev.WhichOneof("event")
            if which == "step":
                st = ev.step
                line: dict[str, Any] = {
                    "step": {
                        "index": st.index,
                        "total": st.total,
                        "instruction": st.instruction,
                        "line": st.line,
                    }
                }
            elif which == "image":
                line = {"image": image_json(ev.image)}
            elif which == "cached":
                line = {"cached": True}
            else:
                line = {"log": ev.log}
            await resp.write(_line(line))

    try:
        await rpc(f"edge {edge.edge_id}", relay())
    except DsecError as exc:
        await resp.write(_line({"error": exc.to_wire()}))
    finally:
        call.cancel()
    await resp.write_eof()
    return resp


async def save(request: web.Request) -> web.StreamResponse:
    """The image ?name= as an OCI image-layout tar, from the first edge that has it
    (or ?edge_id=)."""
    c, p = ctx(request), principal(request)
    p.require("member")
    req = pb.ImageRef(name=query(request, "name"))
    last: DsecError | None = None
    for entry in await _edges(request, query(request, "edge_id", required=False)):
        call = c.upstream.edge_stub(entry).SaveImage(
            req, metadata=p.metadata(), timeout=PULL_TIMEOUT_S
        )
        stream = aiter(call)
        try:
            first = await rpc(f"edge {entry.edge_id}", anext(stream, None))
        except ImageNotFound as exc:
            last = exc
            call.cancel()
            continue
        filename = req.name.replace("/", "_").replace(":", "_") + ".tar"
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/x-tar",
                "Content-Disposition": f'attachment; filename="{filename}"',
            }
        )
        await resp.prepare(request)
        try:
            chunk = first
            while chunk is not None:
                await resp.write(chunk.data)
                chunk = await rpc(f"edge {entry.edge_id}", anext(stream, None))
        except DsecError:
            call.cancel()
            raise  # the client sees a cut tar, which a load refuses
        await resp.write_eof()
        return resp
    assert last is not None
    raise last


async def load(request: web.Request) -> web.StreamResponse:
    """Import the OCI layout tar in the body on one edge (?edge_id=, else the first);
    ?name= names a single-image tarball. With ?kind=vm the body is a bootable disk (raw or
    qcow2) imported as vm system image ?name=. NDJSON answer, as for a streamed pull."""
    c, p = ctx(request), principal(request)
    p.require("member")
    name = query(request, "name", required=False)
    kind = query(request, "kind", required=False)
    if kind not in ("", "vm"):
        raise InvalidArgument(f"kind {kind!r}: '' (an OCI image-layout tar) or 'vm' (a disk)")
    if kind == "vm" and not name:
        raise InvalidArgument("a VM image import needs ?name=")
    entry = (await _edges(request, query(request, "edge_id", required=False)))[0]

    async def requests() -> AsyncIterator[pb.LoadImageRequest]:
        yield pb.LoadImageRequest(name=name, kind=kind)
        async for chunk in request.content.iter_chunked(BUILD_CHUNK):
            yield pb.LoadImageRequest(data=chunk)

    call = c.upstream.edge_stub(entry).LoadImage(
        requests(), metadata=p.metadata(), timeout=PULL_TIMEOUT_S
    )
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    images: list[dict[str, Any]] = []

    async def relay() -> None:
        async for ev in call:
            if ev.HasField("progress"):
                pr = ev.progress
                progress = {
                    "digest": pr.digest,
                    "status": pr.status,
                    "done": pr.done,
                    "total": pr.total,
                }
                await resp.write(_line({"edge_id": entry.edge_id, "progress": progress}))
            elif ev.HasField("image"):
                images.append(image_json(ev.image))

    try:
        await rpc(f"edge {entry.edge_id}", relay())
        await resp.write(_line({"images": images}))
    except DsecError as exc:
        await resp.write(_line({"error": exc.to_wire()}))
    finally:
        call.cancel()
    await resp.write_eof()
    return resp


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/images/save", save),
    ("POST", "/v1/images/load", load),
    ("POST", "/v1/images/build", build),
    ("POST", "/v1/sandboxes/{sandbox_id}/pack", pack),
    ("POST", "/v1/images/pull", pull),
    ("GET", "/v1/images", list_images),
    ("DELETE", "/v1/images", remove_image),
    ("POST", "/v1/images/gc", gc_images),
]
